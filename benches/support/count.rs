//! What counting one transition costs the store, measured beside the vote:
//! the fenced conditional batch of `store::stats` that the consumer writes
//! today, and the plain batch stamped with its offset that
//! docs/counting-without-a-paxos-round.md proposes, written into a
//! bench-only table shaped like that design's bucket.
//!
//! Each bench task owns its targets, as one Kafka partition's owner would,
//! so no write of either kind loses to another writer; what they know of
//! their buckets lasts across a run's rounds.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use scylla::client::session::Session;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use tally::domain::{Applied, Outcome, Reaction, TargetId, TargetType, Totals, UserId, apply};
use tally::fence::{self, Fold, Read, Step};
use tally::store::stats::{FencedWrite, ReadAt};
use tally::store::{Cas, Store, StoreError, token_of};

/// The stamped design's bucket: its head is a clustering row with a fixed
/// key (the minimum token, which no user id hashes to), so a read naming
/// users always returns it, and the voters' applied rows sit beside it.
const STAMPED_TABLE: &str = "CREATE TABLE IF NOT EXISTS bench_stamped_stats (
    target_id text, bucket int, user_token bigint, user_id text,
    likes bigint, dislikes bigint, through bigint,
    applied_version bigint, applied_state text,
    PRIMARY KEY ((target_id, bucket), user_token, user_id))";

const HEAD_TOKEN: i64 = i64::MIN;

/// A bench-wide offset: every stamped write is newer than the one before.
static OFFSET: AtomicI64 = AtomicI64::new(1);

/// The stamped batch's two statements, prepared once.
#[derive(Clone)]
pub struct Stamped {
    head: PreparedStatement,
    user: PreparedStatement,
    bucket: PreparedStatement,
}

impl Stamped {
    pub async fn prepare(session: &Session) -> Stamped {
        session
            .query_unpaged(STAMPED_TABLE, ())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let prepare = |cql: &'static str| async move {
            let mut s = session.prepare(cql).await.unwrap_or_else(|e| panic!("{e}"));
            s.set_consistency(scylla::statement::Consistency::LocalQuorum);
            s
        };
        Stamped {
            head: prepare(
                "INSERT INTO bench_stamped_stats (target_id, bucket, user_token, user_id, likes, dislikes, through) \
                 VALUES (?, ?, ?, '', ?, ?, ?) USING TIMESTAMP ?",
            )
            .await,
            user: prepare(
                "INSERT INTO bench_stamped_stats (target_id, bucket, user_token, user_id, applied_version, applied_state) \
                 VALUES (?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
            )
            .await,
            bucket: prepare(
                "SELECT user_token, likes, dislikes, applied_state FROM bench_stamped_stats \
                 WHERE target_id = ? AND bucket = ?",
            )
            .await,
        }
    }
}

/// A bucket's key, and its head as its owner knows it: the fence and the
/// totals.
type BucketKey = (String, i32);
type Head = (Option<i64>, Totals);

/// What a run's owners know: each bucket's fence and totals, and each
/// (target, user)'s applied row, as the consumer keeps them between
/// batches.
#[derive(Default)]
pub struct Owned {
    buckets: Mutex<HashMap<BucketKey, Head>>,
    users: Mutex<HashMap<(String, String), Applied>>,
}

impl Owned {
    /// The transition a bench vote on (`target`, `user`) would publish
    /// next: like and dislike in turn, one version on.
    pub fn next_vote(&self, target: &TargetId, user: &UserId) -> Applied {
        let now = self.applied(target, user).unwrap_or(Applied::NEVER);
        let state = if now.state == Reaction::Like {
            Reaction::Dislike
        } else {
            Reaction::Like
        };
        Applied {
            version: now.version + 1,
            state,
        }
    }

    fn applied(&self, target: &TargetId, user: &UserId) -> Option<Applied> {
        let key = (target.as_str().to_owned(), user.as_str().to_owned());
        self.users.lock().ok()?.get(&key).copied()
    }

    fn bucket(&self, key: &BucketKey) -> Head {
        self.buckets
            .lock()
            .ok()
            .and_then(|b| b.get(key).copied())
            .unwrap_or_default()
    }

    /// Every bucket the run wrote to.
    fn written(&self) -> Vec<BucketKey> {
        self.buckets
            .lock()
            .map(|b| b.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn learnt(&self, key: BucketKey, head: Head, user: (&UserId, Applied)) {
        let user_key = (key.0.clone(), user.0.as_str().to_owned());
        if let Ok(mut b) = self.buckets.lock() {
            b.insert(key, head);
        }
        if let Ok(mut u) = self.users.lock() {
            u.insert(user_key, user.1);
        }
    }
}

/// Counts `event` (the user's new version and state) into today's
/// `target_stats` as the consumer does: `fence::land_unread` from what the
/// owner knows, and on a refusal or an unknown outcome the consumer's reading
/// rounds (`fence::write`), which read the head at SERIAL and the row.
pub async fn fenced(
    store: &Store,
    owned: &Owned,
    target: &TargetId,
    user: &UserId,
    event: Applied,
) -> Cas {
    let bucket = store.stats.bucket_of(user);
    let key = (target.as_str().to_owned(), bucket.column());
    let (seq, totals) = owned.bucket(&key);
    let before = owned.applied(target, user);
    let now = before.unwrap_or(Applied::NEVER);
    let (next, delta) = match apply(now, event.version, now.state, event.state) {
        Outcome::Replay => return Cas::Applied,
        Outcome::Apply { next, delta, .. } => (next, delta),
    };
    let users = [(user.clone(), next)];
    let write = FencedWrite {
        read_seq: seq,
        totals: totals.apply(delta),
        target_type: Some(TargetType::Video),
        users: &users,
        before: &[before],
    };
    match fence::land_unread(&store.stats, None, (target, bucket), &write).await {
        Cas::Applied => {
            let head = (Some(seq.unwrap_or(0) + 1), write.totals);
            owned.learnt(key, head, (user, next));
            return Cas::Applied;
        }
        Cas::Failed(e) => return Cas::Failed(e),
        Cas::NotApplied | Cas::Unknown(_) => {}
    }
    let mut one = CountOne {
        user,
        event,
        after: None,
    };
    match fence::write(&store.stats, None, (target, bucket), &[user], &mut one).await {
        Ok(done) => {
            if let (Some(head), Some(after)) = (done.left, one.after) {
                owned.learnt(key, head, (user, after));
            }
            Cas::Applied
        }
        Err(e) => Cas::Unknown(e.into()),
    }
}

/// One event folded into each reading round, as the consumer's chunks are.
struct CountOne<'a> {
    user: &'a UserId,
    event: Applied,
    /// The user's row as the last round left it.
    after: Option<Applied>,
}

impl Fold for CountOne<'_> {
    async fn fold(&mut self, _: &TargetId, read: Read) -> Result<Step, StoreError> {
        let now = read
            .applied
            .get(self.user)
            .copied()
            .unwrap_or(Applied::NEVER);
        Ok(
            match apply(now, self.event.version, now.state, self.event.state) {
                Outcome::Replay => {
                    self.after = Some(now);
                    Step::Settled
                }
                Outcome::Apply { next, delta, .. } => {
                    self.after = Some(next);
                    Step::Write {
                        totals: read.head.totals.apply(delta),
                        target_type: Some(TargetType::Video),
                        users: vec![(self.user.clone(), next)],
                    }
                }
            },
        )
    }
}

/// Counts `event` the stamped way: one unlogged single-partition batch of
/// the bucket's head and the user's applied row, `USING TIMESTAMP` of a new
/// offset, from what the owner knows, with no read and no condition. A
/// failed write is written again with the same stamp and values.
pub async fn stamped(
    store: &Store,
    session: &Session,
    statements: &Stamped,
    owned: &Owned,
    (target, user): (&TargetId, &UserId),
    event: Applied,
) -> Cas {
    let bucket = store.stats.bucket_of(user).column();
    let key = (target.as_str().to_owned(), bucket);
    let (_, totals) = owned.bucket(&key);
    let now = owned.applied(target, user).unwrap_or(Applied::NEVER);
    let (next, delta) = match apply(now, event.version, now.state, event.state) {
        Outcome::Replay => return Cas::Applied,
        Outcome::Apply { next, delta, .. } => (next, delta),
    };
    let totals = totals.apply(delta);
    let offset = OFFSET.fetch_add(1, Ordering::Relaxed);
    let mut batch = Batch::new(BatchType::Unlogged);
    batch.set_consistency(scylla::statement::Consistency::LocalQuorum);
    batch.append_statement(statements.head.clone());
    batch.append_statement(statements.user.clone());
    let t = target.as_str();
    let head = (
        t,
        bucket,
        HEAD_TOKEN,
        totals.get(Reaction::Like),
        totals.get(Reaction::Dislike),
        offset,
        offset,
    );
    let row = (
        t,
        bucket,
        token_of(user),
        user.as_str(),
        next.version,
        next.state.as_str(),
        offset,
    );
    // The owner may not move on while a write of its bucket is in doubt: a
    // later stamp carrying totals without this delta would overwrite a head
    // that has it, beside a row that says it was counted.
    let mut last = None;
    for _ in 0..STAMPED_ATTEMPTS {
        match session.batch(&batch, (head, row)).await {
            Ok(_) => {
                owned.learnt(key, (Some(offset), totals), (user, next));
                return Cas::Applied;
            }
            Err(e) => last = Some(e),
        }
    }
    panic!("a stamped count was not written in {STAMPED_ATTEMPTS} attempts: {last:?}")
}

const STAMPED_ATTEMPTS: usize = 20;

/// Panics unless every bucket a counting run wrote holds the totals its
/// voters' applied rows add up to, read back from the store: a run whose
/// writes were lost or counted twice would have measured nothing.
pub async fn check(
    store: &Store,
    session: &Session,
    statements: &Stamped,
    owned: &Owned,
    stamped: bool,
) {
    use futures::StreamExt;
    let buckets = owned.written();
    let checked = futures::stream::iter(buckets)
        .map(|(target, bucket)| async move {
            let id = TargetId::parse(&target).unwrap_or_else(|e| panic!("{e}"));
            let (head, states) = if stamped {
                stamped_bucket(session, statements, &id, bucket).await
            } else {
                fenced_bucket(store, &id, bucket).await
            };
            let tally = Totals::count(states);
            assert_eq!(
                head, tally,
                "{target} bucket {bucket}: its head says {head:?}, its voters' rows {tally:?}"
            );
        })
        .buffer_unordered(64)
        .count()
        .await;
    assert!(checked > 0, "a counting run wrote no bucket");
}

async fn fenced_bucket(store: &Store, target: &TargetId, column: i32) -> (Totals, Vec<Reaction>) {
    let layout = store.stats.layout();
    let bucket = layout
        .bucket(i64::from(column))
        .unwrap_or_else(|| panic!("bucket {column} outside {layout:?}"));
    let head = store
        .stats
        .head(target, bucket, ReadAt::Serial)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let rows = store
        .stats
        .applied_page(target, bucket, layout.range(bucket), 100_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (head.totals, rows.iter().map(|r| r.applied.state).collect())
}

async fn stamped_bucket(
    session: &Session,
    statements: &Stamped,
    target: &TargetId,
    bucket: i32,
) -> (Totals, Vec<Reaction>) {
    type Row = (i64, Option<i64>, Option<i64>, Option<String>);
    let read = async {
        let result = session
            .execute_unpaged(&statements.bucket, (target.as_str(), bucket))
            .await?
            .into_rows_result()?;
        let rows = result.rows::<Row>()?.collect::<Result<Vec<_>, _>>()?;
        anyhow::Ok(rows)
    };
    let rows = read.await.unwrap_or_else(|e| panic!("{e}"));
    let mut head = Totals::default();
    let mut states = Vec::new();
    for (token, likes, dislikes, state) in rows {
        if token == HEAD_TOKEN {
            // The bench votes only like and dislike, whatever else is counted.
            head = Totals::from_values(std::array::from_fn(|i| match Reaction::COUNTED[i] {
                Reaction::Like => likes.unwrap_or(0),
                Reaction::Dislike => dislikes.unwrap_or(0),
                _ => 0,
            }));
        } else if let Some(state) = state {
            states.push(state.parse().unwrap_or_else(|e| panic!("{e:?}")));
        }
    }
    (head, states)
}
