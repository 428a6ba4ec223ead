//! What counting one transition costs the store, measured beside the vote:
//! the fenced conditional batch of `store::stats` that the consumer writes
//! today, and the plain batch stamped with its offset that
//! docs/counting-without-a-paxos-round.md proposes, written into a
//! bench-only table shaped like that design's bucket; and a third way that
//! keeps the fence but shares its Paxos round: every target of a shard in
//! one partition (`bench_shard_stats`), and a shard's queue of transitions
//! counted in one conditional batch on all of their heads and rows.
//!
//! Each bench task owns its targets, as one Kafka partition's owner would,
//! so no write of any kind loses to another writer; what they know of
//! their buckets lasts across a run's rounds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use scylla::client::session::Session;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use scylla::value::MaybeUnset;
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
        create(session, STAMPED_TABLE).await;
        let prepare = |cql| at_quorum(session, cql);
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

/// Creates a bench-only table.
async fn create(session: &Session, table: &str) {
    session
        .query_unpaged(table, ())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// `cql` prepared at LOCAL_QUORUM, and LOCAL_SERIAL for any condition.
async fn at_quorum(session: &Session, cql: &str) -> PreparedStatement {
    let mut s = session.prepare(cql).await.unwrap_or_else(|e| panic!("{e}"));
    s.set_consistency(scylla::statement::Consistency::LocalQuorum);
    s.set_serial_consistency(Some(scylla::statement::SerialConsistency::LocalSerial));
    s
}

/// A head's totals from its columns: the bench votes only like and dislike,
/// whatever else is counted.
fn head_totals(likes: Option<i64>, dislikes: Option<i64>) -> Totals {
    Totals::from_values(std::array::from_fn(|i| match Reaction::COUNTED[i] {
        Reaction::Like => likes.unwrap_or(0),
        Reaction::Dislike => dislikes.unwrap_or(0),
        _ => 0,
    }))
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

    /// The applied states of `target`'s voters as its owner counted them.
    fn states_of(&self, target: &str) -> Vec<Reaction> {
        self.users
            .lock()
            .map(|u| {
                u.iter()
                    .filter(|((t, _), _)| t == target)
                    .map(|(_, a)| a.state)
                    .collect()
            })
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
            head = head_totals(likes, dislikes);
        } else if let Some(state) = state {
            states.push(state.parse().unwrap_or_else(|e| panic!("{e:?}")));
        }
    }
    (head, states)
}

/// The sharded design's partition: every target of one consumer shard, each
/// target's head a clustering row with a fixed user key beside its voters'
/// applied rows. One conditional batch can then fence many targets at once:
/// each head on its own `seq` and each voter's row on its applied version,
/// one Paxos round for all of them.
const SHARD_TABLE: &str = "CREATE TABLE IF NOT EXISTS bench_shard_stats (
    shard int, target_id text, user_token bigint, user_id text,
    likes bigint, dislikes bigint, seq bigint,
    applied_version bigint, applied_state text,
    PRIMARY KEY ((shard), target_id, user_token, user_id))";

/// The sharded batch's one statement shape (a head sets its totals and seq,
/// a voter's row its applied version; each leaves the other columns unset,
/// and a head never holds an applied version nor a voter's row a seq, so one
/// condition fits both), the shard's read back, and a head's read at SERIAL.
#[derive(Clone)]
pub struct Sharded {
    write: PreparedStatement,
    shard: PreparedStatement,
    seq: PreparedStatement,
}

impl Sharded {
    pub async fn prepare(session: &Session) -> Sharded {
        create(session, SHARD_TABLE).await;
        let prepare = |cql| at_quorum(session, cql);
        Sharded {
            write: prepare(
                "UPDATE bench_shard_stats SET likes = ?, dislikes = ?, seq = ?, \
                 applied_version = ?, applied_state = ? \
                 WHERE shard = ? AND target_id = ? AND user_token = ? AND user_id = ? \
                 IF seq = ? AND applied_version = ?",
            )
            .await,
            shard: prepare(
                "SELECT target_id, user_token, likes, dislikes, applied_state \
                 FROM bench_shard_stats WHERE shard = ?",
            )
            .await,
            seq: {
                let mut s = prepare(
                    "SELECT seq FROM bench_shard_stats WHERE shard = ? AND target_id = ? \
                     AND user_token = ? AND user_id = ''",
                )
                .await;
                s.set_consistency(scylla::statement::Consistency::LocalSerial);
                s
            },
        }
    }
}

/// The transitions a shard's owner has taken and not yet counted.
pub type Queue = Vec<(TargetId, UserId, Applied)>;

/// The transition a bench vote on (`target`, `user`) would publish next,
/// after those already waiting in `queue`.
pub fn next_vote_after(owned: &Owned, queue: &Queue, target: &TargetId, user: &UserId) -> Applied {
    let waiting = queue
        .iter()
        .rev()
        .find(|(t, u, _)| t == target && u == user)
        .map(|(_, _, a)| *a);
    let now = waiting
        .or_else(|| owned.applied(target, user))
        .unwrap_or(Applied::NEVER);
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

/// One statement's values: totals and seq for a head, or a voter's applied
/// row, then the key and the two conditions.
type ShardRow = (
    MaybeUnset<i64>,
    MaybeUnset<i64>,
    MaybeUnset<i64>,
    MaybeUnset<i64>,
    MaybeUnset<String>,
    i32,
    String,
    i64,
    String,
    Option<i64>,
    Option<i64>,
);

/// What one sharded write changes: each target's head (its seq and totals
/// before, its totals after) and each voter's row (before, after).
#[derive(Default)]
struct ShardWrite {
    heads: BTreeMap<TargetId, (Option<i64>, Totals)>,
    users: BTreeMap<(TargetId, UserId), (Option<Applied>, Applied)>,
}

impl ShardWrite {
    /// Folds `queue` in order through the apply rule, from what the owner
    /// knows: replays drop out, and a target or a voter met twice is one
    /// row, conditioned on what the owner knew before the first.
    fn fold(owned: &Owned, shard: i32, queue: &Queue) -> ShardWrite {
        let mut w = ShardWrite::default();
        for (target, user, event) in queue {
            let key = (target.clone(), user.clone());
            let now = match w.users.get(&key) {
                Some((_, after)) => *after,
                None => owned.applied(target, user).unwrap_or(Applied::NEVER),
            };
            let Outcome::Apply { next, delta, .. } =
                apply(now, event.version, now.state, event.state)
            else {
                continue;
            };
            let head = w
                .heads
                .entry(target.clone())
                .or_insert_with(|| owned.bucket(&(target.as_str().to_owned(), shard)));
            head.1 = head.1.apply(delta);
            w.users
                .entry(key)
                .and_modify(|(_, after)| *after = next)
                .or_insert((owned.applied(target, user), next));
        }
        w
    }

    fn values(&self, owned: &Owned, shard: i32) -> Vec<ShardRow> {
        use MaybeUnset::{Set, Unset};
        let mut rows = Vec::with_capacity(self.heads.len() + self.users.len());
        for (target, (seq, totals)) in &self.heads {
            let (before, _) = owned.bucket(&(target.as_str().to_owned(), shard));
            debug_assert_eq!(before, *seq);
            rows.push((
                Set(totals.get(Reaction::Like)),
                Set(totals.get(Reaction::Dislike)),
                Set(seq.unwrap_or(0) + 1),
                Unset,
                Unset,
                shard,
                target.as_str().to_owned(),
                HEAD_TOKEN,
                String::new(),
                *seq,
                None,
            ));
        }
        for ((target, user), (before, after)) in &self.users {
            rows.push((
                Unset,
                Unset,
                Unset,
                Set(after.version),
                Set(after.state.as_str().to_owned()),
                shard,
                target.as_str().to_owned(),
                token_of(user),
                user.as_str().to_owned(),
                None,
                before.map(|a| a.version),
            ));
        }
        rows
    }

    fn learnt(&self, owned: &Owned, shard: i32) {
        if let Ok(mut b) = owned.buckets.lock() {
            for (target, (seq, totals)) in &self.heads {
                let head = (Some(seq.unwrap_or(0) + 1), *totals);
                b.insert((target.as_str().to_owned(), shard), head);
            }
        }
        if let Ok(mut u) = owned.users.lock() {
            for ((target, user), (_, after)) in &self.users {
                u.insert(
                    (target.as_str().to_owned(), user.as_str().to_owned()),
                    *after,
                );
            }
        }
    }
}

/// Counts every transition in `queue` (all of them the owner's, on targets
/// of `shard`) in one conditional batch on the shard's partition, from what
/// the owner knows, with no read, and empties it. A write in doubt or
/// refused is settled by reading one of its heads at SERIAL: the batch is
/// applied whole or not at all, so that head says which, and one not
/// applied is written again.
pub async fn sharded(
    session: &Session,
    statements: &Sharded,
    owned: &Owned,
    shard: i32,
    queue: &mut Queue,
) -> Cas {
    let write = ShardWrite::fold(owned, shard, queue);
    queue.clear();
    let Some((probe, (seq, _))) = write.heads.iter().next() else {
        return Cas::Applied;
    };
    let values = write.values(owned, shard);
    let mut batch = Batch::new(BatchType::Unlogged);
    batch.set_consistency(scylla::statement::Consistency::LocalQuorum);
    batch.set_serial_consistency(Some(scylla::statement::SerialConsistency::LocalSerial));
    for _ in &values {
        batch.append_statement(statements.write.clone());
    }
    let mut last = None;
    for _ in 0..STAMPED_ATTEMPTS {
        match session
            .batch(&batch, &values)
            .await
            .map(tally::store::was_applied)
        {
            Ok(Ok(true)) => {
                write.learnt(owned, shard);
                return Cas::Applied;
            }
            outcome => last = Some(format!("{outcome:?}")),
        }
        let read = session
            .execute_unpaged(&statements.seq, (shard, probe.as_str(), HEAD_TOKEN))
            .await
            .ok()
            .and_then(|r| r.into_rows_result().ok())
            .and_then(|r| r.maybe_first_row::<(Option<i64>,)>().ok().flatten())
            .map(|(s,)| s);
        match read {
            Some(now) if now == Some(seq.unwrap_or(0) + 1) => {
                write.learnt(owned, shard);
                return Cas::Applied;
            }
            Some(now) if now != *seq => {
                panic!("shard {shard}, {probe}: seq {now:?}, but its owner knew {seq:?}")
            }
            // Not applied, or not read: written again.
            _ => {}
        }
    }
    panic!("a sharded count was not written in {STAMPED_ATTEMPTS} attempts: {last:?}")
}

/// Panics unless every target a sharded run wrote holds the totals its
/// voters' applied rows add up to, read back shard by shard.
pub async fn check_sharded(session: &Session, statements: &Sharded, owned: &Owned) {
    type Row = (String, i64, Option<i64>, Option<i64>, Option<String>);
    let written = owned.written();
    let shards: std::collections::BTreeSet<i32> = written.iter().map(|(_, s)| *s).collect();
    let mut checked = 0;
    for shard in shards {
        let read = async {
            let result = session
                .execute_unpaged(&statements.shard, (shard,))
                .await?
                .into_rows_result()?;
            let rows = result.rows::<Row>()?.collect::<Result<Vec<_>, _>>()?;
            anyhow::Ok(rows)
        };
        let rows = read.await.unwrap_or_else(|e| panic!("{e}"));
        let mut heads: HashMap<String, Totals> = HashMap::new();
        let mut voters: HashMap<String, Vec<Reaction>> = HashMap::new();
        for (target, token, likes, dislikes, state) in rows {
            if token == HEAD_TOKEN {
                heads.insert(target, head_totals(likes, dislikes));
            } else if let Some(state) = state {
                let state = state.parse().unwrap_or_else(|e| panic!("{e:?}"));
                voters.entry(target).or_default().push(state);
            }
        }
        for (target, _) in written.iter().filter(|(_, s)| *s == shard) {
            let head = heads
                .get(target)
                .copied()
                .unwrap_or_else(|| panic!("{target} in shard {shard}: no head"));
            let tally = Totals::count(voters.remove(target).unwrap_or_default());
            assert_eq!(
                head, tally,
                "{target} in shard {shard}: its head says {head:?}, its voters' rows {tally:?}"
            );
            // A write its owner took as applied that never landed would
            // leave the head and the rows both older, and still agreeing.
            let (_, counted) = owned.bucket(&(target.clone(), shard));
            let voted = Totals::count(owned.states_of(target));
            assert_eq!(
                (head, tally),
                (counted, voted),
                "{target} in shard {shard}: the store against what its owner counted"
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "a sharded run wrote no target");
}
