//! The outbox's index: `outbox_intents`, one row per vote that may commit a
//! transition, written before its conditional batch, and the relay's
//! checkpoint.
//!
//! The transition itself is durable in the vote's idempotency record; an
//! intent only says where to look (user and key) and when. Intents live in
//! time buckets spread over `SHARDS` partitions, carry the key's TTL, and are
//! never deleted: a resolved intent is marked, so no tombstones pile up in
//! front of the rows the relay reads.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use scylla::client::session::Session;
use scylla::statement::prepared::PreparedStatement;

use super::StoreError;
use crate::domain::{IdempotencyKey, UserId};

/// Seconds of votes one bucket holds.
pub const BUCKET_SECS: i64 = 10;

/// Partitions one bucket is spread over, so a busy second is not one hot
/// partition. Writers and the relay must agree on it.
pub const SHARDS: i32 = 16;

/// Where one intent lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    intend: PreparedStatement,
    resolve: PreparedStatement,
    resolved: PreparedStatement,
    bucket: PreparedStatement,
    read_checkpoint: PreparedStatement,
    write_checkpoint: PreparedStatement,
    ttl_secs: i32,
}

impl Outbox {
    pub async fn prepare(
        session: Arc<Session>,
        ttl_secs: i32,
        levels: super::Levels,
    ) -> anyhow::Result<Outbox> {
        let mut intend = session
            .prepare(
                "INSERT INTO outbox_intents (bucket, shard, user_id, idem_key, resolved) \
                 VALUES (?, ?, ?, ?, false) USING TTL ?",
            )
            .await
            .context("prepare intent")?;
        // The intent must outlive a crash right after the vote commits.
        intend.set_consistency(levels.quorum);
        let resolve = session
            .prepare(
                "UPDATE outbox_intents USING TTL ? SET resolved = true \
                 WHERE bucket = ? AND shard = ? AND user_id = ? AND idem_key = ?",
            )
            .await
            .context("prepare resolve")?;
        let resolved = session
            .prepare(
                "SELECT resolved FROM outbox_intents \
                 WHERE bucket = ? AND shard = ? AND user_id = ? AND idem_key = ?",
            )
            .await
            .context("prepare resolved read")?;
        let bucket = session
            .prepare(
                "SELECT user_id, idem_key, resolved FROM outbox_intents \
                 WHERE bucket = ? AND shard = ?",
            )
            .await
            .context("prepare bucket read")?;
        let read_checkpoint = session
            .prepare("SELECT bucket FROM relay_checkpoints WHERE name = ?")
            .await
            .context("prepare relay checkpoint read")?;
        let write_checkpoint = session
            .prepare(
                "INSERT INTO relay_checkpoints (name, bucket, updated_at) \
                 VALUES (?, ?, toTimestamp(now()))",
            )
            .await
            .context("prepare relay checkpoint write")?;
        Ok(Outbox {
            session,
            intend,
            resolve,
            resolved,
            bucket,
            read_checkpoint,
            write_checkpoint,
            ttl_secs,
        })
    }

    /// Records that `user` may commit a transition under `key`, now.
    pub async fn intend(&self, user: &UserId, key: &IdempotencyKey) -> Result<Slot, StoreError> {
        let slot = Slot {
            bucket: bucket_at(SystemTime::now()),
            shard: shard_of(user),
        };
        let values = (
            slot.bucket,
            slot.shard,
            user.as_str(),
            key.as_str(),
            self.ttl_secs,
        );
        self.session
            .execute_unpaged(&self.intend, values)
            .await
            .map_err(super::request_failed)?;
        Ok(slot)
    }

    /// Marks an intent resolved: its transition is published, counted, or
    /// was never committed. Losing this write only costs the relay a check.
    pub async fn resolve(
        &self,
        slot: Slot,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        let values = (
            self.ttl_secs,
            slot.bucket,
            slot.shard,
            user.as_str(),
            key.as_str(),
        );
        self.session
            .execute_unpaged(&self.resolve, values)
            .await
            .map_err(super::request_failed)?;
        Ok(())
    }

    /// Whether the intent `user` wrote for `key` in `bucket` is resolved.
    pub async fn is_resolved(
        &self,
        bucket: i64,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<bool, StoreError> {
        let values = (bucket, shard_of(user), user.as_str(), key.as_str());
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
