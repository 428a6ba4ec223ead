//! The outbox's index: `outbox_intents`, one row per vote that may commit a
//! transition, written before its conditional batch, and the relay's
//! checkpoint.
//!
//! The transition itself is durable in the vote's idempotency record; an
//! intent only says where to look (user and key) and when. Intents live in
//! time buckets spread over `SHARDS` partitions, carry the key's TTL, and are
//! never deleted: a resolved intent is marked, so no tombstones pile up in
//! front of the rows the relay reads.
//!
//! Intents and their marks are written in groups. The votes that wait for
//! their intents at one moment share one write: a batch of their rows in one
//! shard of the bucket, a single mutation of one partition. Under load a vote
//! then costs Cassandra a fraction of a plain write for its intent, not a
//! whole one; alone, a vote waits for nobody.
//!
//! Marks go where their intents are, so the marks waiting at one moment
//! span many partitions, about one row each. Nobody waits on a mark, so a
//! mark lingers (`MARK_LINGER`) for others of its partition, and a partition's
//! marks are written when there are `GROUP_MAX` of them or the oldest has
//! waited that long. A mark lost in a crash while it lingers costs the
//! relay one check, like any lost mark.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use scylla::client::session::Session;
use scylla::errors::ExecutionError;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::StoreError;
use crate::domain::{IdempotencyKey, UserId};

/// Seconds of votes one bucket holds.
pub const BUCKET_SECS: i64 = 10;

/// Partitions one bucket is spread over, so a busy second is not one hot
/// partition. Writers and the relay must agree on it.
pub const SHARDS: i32 = 16;

/// The most rows one grouped write carries: about 3 KB of intents, under
/// Cassandra's default batch size warning (5 KB).
const GROUP_MAX: usize = 32;

/// How long a mark waits for others of its partition. Far below the
/// relay's settling time, so the relay rarely checks an intent whose mark
/// is on its way.
pub const MARK_LINGER: Duration = Duration::from_millis(500);

/// Grouped writes of one kind in flight at once. While they are, the next
/// votes wait in the queue, and that wait is what forms the next group.
const GROUPS_IN_FLIGHT: usize = 4;

/// Where one intent lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub bucket: i64,
    pub shard: i32,
}

/// One intent as the relay reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    pub slot: Slot,
    pub user: UserId,
    pub key: IdempotencyKey,
    pub resolved: bool,
}

/// The bucket of a moment.
pub fn bucket_at(t: SystemTime) -> i64 {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    i64::try_from(secs).unwrap_or(i64::MAX) / BUCKET_SECS
}

/// When a bucket begins.
pub fn bucket_start(bucket: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(u64::try_from(bucket * BUCKET_SECS).unwrap_or(0))
}

/// A user's shard: FNV-1a of the id, stable across processes and releases.
pub fn shard_of(user: &UserId) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in user.as_str().bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    i32::try_from(h % SHARDS.unsigned_abs()).unwrap_or(0)
}

pub struct Outbox {
    session: Arc<Session>,
    intents: mpsc::Sender<Waiting>,
    /// Marks that may linger (the votes'), and marks written as soon as a
    /// place is free (the relay's, whose pass waits on them).
    marks: Marks,
    /// What the grouped writers are started from, again for each session.
    writers: Writers,
    resolved: PreparedStatement,
    bucket: PreparedStatement,
    read_checkpoint: PreparedStatement,
    write_checkpoint: PreparedStatement,
}

impl Outbox {
    pub async fn prepare(
        session: Arc<Session>,
        ttl_secs: i32,
        levels: super::Levels,
    ) -> anyhow::Result<Outbox> {
        // Both take the same values in the same order, so one grouped writer
        // serves both.
        let intend = super::prepare(
            &session,
            "INSERT INTO outbox_intents (bucket, shard, user_id, idem_key, resolved) \
                 VALUES (?, ?, ?, ?, false) USING TTL ?",
        )
        .await
        .context("prepare intent")?;
        let resolve = super::prepare(
            &session,
            "INSERT INTO outbox_intents (bucket, shard, user_id, idem_key, resolved) \
                 VALUES (?, ?, ?, ?, true) USING TTL ?",
        )
        .await
        .context("prepare resolve")?;
        let resolved = super::prepare(
            &session,
            "SELECT resolved FROM outbox_intents \
                 WHERE bucket = ? AND shard = ? AND user_id = ? AND idem_key = ?",
        )
        .await
        .context("prepare resolved read")?;
        let bucket = super::prepare(
            &session,
            "SELECT user_id, idem_key, resolved FROM outbox_intents \
                 WHERE bucket = ? AND shard = ?",
        )
        .await
        .context("prepare bucket read")?;
        let read_checkpoint = super::prepare(
            &session,
            "SELECT bucket FROM relay_checkpoints WHERE name = ?",
        )
        .await
        .context("prepare relay checkpoint read")?;
        let write_checkpoint = super::prepare(
            &session,
            "INSERT INTO relay_checkpoints (name, bucket, updated_at) \
                 VALUES (?, ?, toTimestamp(now()))",
        )
        .await
        .context("prepare relay checkpoint write")?;
        let writers = Writers {
            intend,
            resolve,
            consistency: levels.quorum,
            ttl_secs,
        };
        let (intents, marks) = writers.start(&session);
        Ok(Outbox {
            session,
            intents,
            marks,
            writers,
            resolved,
            bucket,
            read_checkpoint,
            write_checkpoint,
        })
    }

    /// The same statements over another session, with grouped writers of
    /// its own, started on the calling thread's runtime.
    pub fn on(&self, session: Arc<Session>) -> Outbox {
        let (intents, marks) = self.writers.start(&session);
        Outbox {
            intents,
            marks,
            writers: self.writers.clone(),
            resolved: self.resolved.clone(),
            bucket: self.bucket.clone(),
            read_checkpoint: self.read_checkpoint.clone(),
            write_checkpoint: self.write_checkpoint.clone(),
            session,
        }
    }

    /// Records that `user` may commit a transition under `key`, now, and
    /// says where: the key's record must name the slot.
    pub async fn intend(&self, user: &UserId, key: &IdempotencyKey) -> Result<Slot, StoreError> {
        wait_for(&self.intents, None, user, key).await
    }

    /// Marks an intent resolved: its transition is published, counted, or
    /// was never committed. Losing this write only costs the relay a check.
    /// The mark lingers for others of its partition: this returns up to
    /// `MARK_LINGER` after it is asked, so nothing a client waits for may
    /// wait on it.
    pub async fn resolve(
        &self,
        slot: Slot,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        wait_for(&self.marks.lingering, Some(slot), user, key).await?;
        Ok(())
    }

    /// The same mark, grouped only with the marks waiting at this moment:
    /// for the relay, which checks a few intents at a time and waits for
    /// each one's mark.
    pub async fn resolve_now(
        &self,
        slot: Slot,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        wait_for(&self.marks.now, Some(slot), user, key).await?;
        Ok(())
    }

    /// Whether the intent `user` wrote for `key` in `slot` is resolved.
    pub async fn is_resolved(
        &self,
        slot: Slot,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<bool, StoreError> {
        let values = (slot.bucket, slot.shard, user.as_str(), key.as_str());
        let row: Option<(Option<bool>,)> =
            super::first_row(&self.session, &self.resolved, values).await?;
        Ok(row.and_then(|(r,)| r).unwrap_or(false))
    }

    /// Every intent of one shard of one bucket, page by page.
    pub async fn intents(&self, slot: Slot) -> Result<Vec<Intent>, StoreError> {
        let rows: Vec<(String, String, Option<bool>)> =
            super::all_rows(&self.session, &self.bucket, (slot.bucket, slot.shard)).await?;
        Ok(rows
            .into_iter()
            .filter_map(|(user, key, resolved)| {
                Some(Intent {
                    slot,
                    user: UserId::parse(&user).ok()?,
                    key: IdempotencyKey::parse(&key).ok()?,
                    resolved: resolved.unwrap_or(false),
                })
            })
            .collect())
    }

    /// The first bucket the relay `name` has not fully resolved.
    pub async fn checkpoint(&self, name: &str) -> Result<Option<i64>, StoreError> {
        let row: Option<(Option<i64>,)> =
            super::first_row(&self.session, &self.read_checkpoint, (name,)).await?;
        Ok(row.and_then(|(b,)| b))
    }

    pub async fn save_checkpoint(&self, name: &str, bucket: i64) -> Result<(), StoreError> {
        self.session
            .execute_unpaged(&self.write_checkpoint, (name, bucket))
            .await
            .map_err(super::request_failed)?;
        Ok(())
    }
}

/// Until `due`, or forever when there is nothing held.
async fn sleep_until(due: Option<tokio::time::Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One row waiting for a grouped write, and who to tell.
struct Waiting {
    slot: Option<Slot>,
    user: String,
    key: String,
    done: oneshot::Sender<Result<Slot, GroupFailed>>,
}

/// A grouped write that failed; every row in it failed with it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the grouped outbox write failed")]
pub struct GroupFailed(#[source] Arc<ExecutionError>);

async fn wait_for(
    queue: &mpsc::Sender<Waiting>,
    slot: Option<Slot>,
    user: &UserId,
    key: &IdempotencyKey,
) -> Result<Slot, StoreError> {
    let (done, answer) = oneshot::channel();
    let waiting = Waiting {
        slot,
        user: user.as_str().to_owned(),
        key: key.as_str().to_owned(),
        done,
    };
    let gone = || StoreError::Request(anyhow::anyhow!("the outbox writer has stopped"));
    queue.send(waiting).await.map_err(|_| gone())?;
    answer
        .await
        .map_err(|_| gone())?
        .map_err(super::request_failed)
}

/// The statements of the two grouped writers (intents and their marks).
#[derive(Clone)]
struct Writers {
    intend: PreparedStatement,
    resolve: PreparedStatement,
    consistency: scylla::statement::Consistency,
    ttl_secs: i32,
}

/// The queues of the two writers of marks.
struct Marks {
    lingering: mpsc::Sender<Waiting>,
    now: mpsc::Sender<Waiting>,
}

impl Writers {
    fn start(&self, session: &Arc<Session>) -> (mpsc::Sender<Waiting>, Marks) {
        let writer = |statement: &PreparedStatement| Grouped {
            session: session.clone(),
            statement: statement.clone(),
            consistency: self.consistency,
            ttl_secs: self.ttl_secs,
            next_shard: AtomicI32::new(0),
        };
        let marks = Marks {
            lingering: writer(&self.resolve).start_lingering(MARK_LINGER),
            now: writer(&self.resolve).start(),
        };
        (writer(&self.intend).start(), marks)
    }
}

/// A writer that turns the rows waiting at one moment into one batch per
/// partition. Its task ends when the `Outbox` (the sender) is dropped.
struct Grouped {
    session: Arc<Session>,
    statement: PreparedStatement,
    consistency: scylla::statement::Consistency,
    ttl_secs: i32,
    next_shard: AtomicI32,
}

impl Grouped {
    fn start(self) -> mpsc::Sender<Waiting> {
        let (tx, rx) = mpsc::channel(4 * GROUP_MAX * GROUPS_IN_FLIGHT);
        tokio::spawn(self.run(rx));
        tx
    }

    async fn run(self, mut rx: mpsc::Receiver<Waiting>) {
        let this = Arc::new(self);
        let in_flight = Arc::new(Semaphore::new(GROUPS_IN_FLIGHT));
        loop {
            let Ok(permit) = in_flight.clone().acquire_owned().await else {
                return;
            };
            let Some(first) = rx.recv().await else {
                return;
            };
            let mut rows = vec![first];
            while rows.len() < GROUP_MAX {
                match rx.try_recv() {
                    Ok(w) => rows.push(w),
                    Err(_) => break,
                }
            }
            // The drained rows hold one place, however many partitions
            // they span.
            let permit = Arc::new(permit);
            for (slot, group) in this.partitions(rows) {
                this.spawn_write(slot, group, permit.clone());
            }
        }
    }

    fn start_lingering(self, linger: Duration) -> mpsc::Sender<Waiting> {
        let (tx, rx) = mpsc::channel(4 * GROUP_MAX * GROUPS_IN_FLIGHT);
        tokio::spawn(self.linger(rx, linger));
        tx
    }

    /// Holds rows by partition until a partition has `GROUP_MAX` of them or
    /// its oldest has waited `linger`, then writes that partition's. When
    /// the sender is dropped, writes what it holds and ends.
    async fn linger(self, mut rx: mpsc::Receiver<Waiting>, linger: Duration) {
        let this = Arc::new(self);
        let in_flight = Arc::new(Semaphore::new(GROUPS_IN_FLIGHT));
        let mut held: HashMap<Slot, (tokio::time::Instant, Vec<Waiting>)> = HashMap::new();
        loop {
            let due = held.values().map(|(since, _)| *since + linger).min();
            let next = tokio::select! {
                next = rx.recv() => next,
                () = sleep_until(due) => {
                    let now = tokio::time::Instant::now();
                    let ripe: Vec<Slot> = held
                        .iter()
                        .filter(|(_, (since, _))| *since + linger <= now)
                        .map(|(slot, _)| *slot)
                        .collect();
                    for slot in ripe {
                        if let Some((_, rows)) = held.remove(&slot) {
                            this.write_held(&in_flight, slot, rows).await;
                        }
                    }
                    continue;
                }
            };
            let Some(w) = next else {
                for (slot, (_, rows)) in held.drain() {
                    this.write_held(&in_flight, slot, rows).await;
                }
                return;
            };
            let slot = w.slot.unwrap_or_else(|| this.next_slot());
            let (_, rows) = held
                .entry(slot)
                .or_insert_with(|| (tokio::time::Instant::now(), Vec::new()));
            rows.push(w);
            if rows.len() >= GROUP_MAX
                && let Some((_, rows)) = held.remove(&slot)
            {
                this.write_held(&in_flight, slot, rows).await;
            }
        }
    }

    /// Writes one partition's held rows in a task of its own, once fewer
    /// than `GROUPS_IN_FLIGHT` writes are running.
    async fn write_held(
        self: &Arc<Self>,
        in_flight: &Arc<Semaphore>,
        slot: Slot,
        rows: Vec<Waiting>,
    ) {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        self.spawn_write(slot, rows, permit);
    }

    /// Writes `rows` to `slot` in a task of its own and tells each row how
    /// it went; `place` (a place among the writes in flight) is held until
    /// then.
    fn spawn_write<P: Send + 'static>(self: &Arc<Self>, slot: Slot, rows: Vec<Waiting>, place: P) {
        let this = self.clone();
        tokio::spawn(async move {
            let result = this.write(slot, &rows).await.map(|()| slot);
            for w in rows {
                let _ = w.done.send(result.clone());
            }
            drop(place);
        });
    }

    /// The slot of rows that may go anywhere: this bucket, the next shard.
    fn next_slot(&self) -> Slot {
        Slot {
            bucket: bucket_at(SystemTime::now()),
            shard: self
                .next_shard
                .fetch_add(1, Ordering::Relaxed)
                .rem_euclid(SHARDS),
        }
    }

    /// The rows, by the partition each goes to. Rows that may go anywhere
    /// (intents, whose records will say where) share the next shard in
    /// turn; marks go where their intents are.
    fn partitions(&self, rows: Vec<Waiting>) -> HashMap<Slot, Vec<Waiting>> {
        let anywhere = self.next_slot();
        let mut by_slot: HashMap<Slot, Vec<Waiting>> = HashMap::new();
        for w in rows {
            by_slot
                .entry(w.slot.unwrap_or(anywhere))
                .or_default()
                .push(w);
        }
        by_slot
    }

    async fn write(&self, slot: Slot, rows: &[Waiting]) -> Result<(), GroupFailed> {
        let mut batch = Batch::new(BatchType::Unlogged);
        for _ in rows {
            batch.append_statement(self.statement.clone());
        }
        batch.set_consistency(self.consistency);
        let values: Vec<_> = rows
            .iter()
            .map(|w| {
                (
                    slot.bucket,
                    slot.shard,
                    w.user.as_str(),
                    w.key.as_str(),
                    self.ttl_secs,
                )
            })
            .collect();
        self.session
            .batch(&batch, values)
            .await
            .map(|_| ())
            .map_err(|e| GroupFailed(Arc::new(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_stable_and_in_range() {
        let u = |s: &str| UserId::parse(s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(shard_of(&u("alice")), shard_of(&u("alice")));
        let shards: std::collections::BTreeSet<i32> =
            (0..500).map(|i| shard_of(&u(&format!("u{i}")))).collect();
        assert!(shards.iter().all(|s| (0..SHARDS).contains(s)));
        assert_eq!(shards.len(), SHARDS as usize, "500 users reach every shard");
    }

    #[test]
    fn a_bucket_holds_its_seconds() {
        let t = UNIX_EPOCH + Duration::from_secs(1_000_000_007);
        let b = bucket_at(t);
        assert_eq!(b, 100_000_000);
        assert!(bucket_start(b) <= t && t < bucket_start(b + 1));
    }
}
