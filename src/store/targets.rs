//! The `targets` registry walked by the reconcile sweep, and the sweep's
//! checkpoints.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use scylla::client::session::Session;
use scylla::statement::Consistency;
use scylla::statement::prepared::PreparedStatement;

use super::{Levels, StoreError};
use crate::domain::{TargetId, TargetType};

/// Targets this process registered, or found registered, recently, at
/// most; the registry is an idempotent upsert, so forgetting only costs a
/// repeat write or read.
const REMEMBERED: usize = 100_000;

/// Registered targets in two generations of half the capacity each: when
/// the newer fills, the older is forgotten and the newer takes its place.
/// Emptying one set at once forgot every target together, and the next
/// votes on them all wrote the registry again (and counted against their
/// users' new-target limit) in a burst; now at most half is forgotten, the
/// half least recently added.
#[derive(Default)]
struct Remembered {
    newer: HashSet<TargetId>,
    older: HashSet<TargetId>,
}

impl Remembered {
    fn contains(&self, target: &TargetId) -> bool {
        self.newer.contains(target) || self.older.contains(target)
    }

    fn insert(&mut self, target: &TargetId, capacity: usize) {
        if self.contains(target) {
            return;
        }
        if self.newer.len() >= capacity / 2 {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(target.clone());
    }
}

/// A sweep's resume point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// The token of the last target done.
    pub last_token: Option<i64>,
    pub checked: i64,
    pub drifted: i64,
    /// The target after it, if the sweep stopped inside it, and the bucket
    /// to go on from.
    pub in_target: Option<(String, u32)>,
}

#[derive(Clone)]
pub struct Targets {
    session: Arc<Session>,
    register: PreparedStatement,
    registered_row: PreparedStatement,
    first_page: PreparedStatement,
    next_page: PreparedStatement,
    read_checkpoint: PreparedStatement,
    write_checkpoint: PreparedStatement,
    delete_checkpoint: PreparedStatement,
    /// Shared by every session's copy: registered once per process.
    registered: Arc<Mutex<Remembered>>,
    /// The level of plain reads and writes, the registry's included.
    quorum: Consistency,
}

impl Targets {
    /// The same statements over another session, with the same memory of
    /// what this process registered.
    pub fn on(&self, session: Arc<Session>) -> Targets {
        Targets {
            session,
            ..self.clone()
        }
    }

    pub async fn prepare(session: Arc<Session>, levels: Levels) -> anyhow::Result<Targets> {
        Ok(Targets {
            register: super::prepare(&session, "INSERT INTO targets (target_id, target_type) VALUES (?, ?)").await.context("prepare register")?,
            registered_row: super::prepare(&session, "SELECT target_id FROM targets WHERE target_id = ?")
                .await
                .context("prepare registered row")?,
            first_page: super::prepare(&session, "SELECT target_id, token(target_id) FROM targets LIMIT ?")
                .await
                .context("prepare first page")?,
            next_page: super::prepare(&session, "SELECT target_id, token(target_id) FROM targets WHERE token(target_id) > ? LIMIT ?")
                .await
                .context("prepare next page")?,
            read_checkpoint: super::prepare(&session, "SELECT last_token, checked, drifted, in_target, next_bucket FROM reconcile_checkpoints WHERE name = ?")
                .await?,
            write_checkpoint: super::prepare(&session,
                    "INSERT INTO reconcile_checkpoints \
                     (name, last_token, checked, drifted, in_target, next_bucket, updated_at) \
                     VALUES (?, ?, ?, ?, ?, ?, toTimestamp(now()))",
                )
                .await?,
            delete_checkpoint: super::prepare(&session, "DELETE FROM reconcile_checkpoints WHERE name = ?").await?,
            registered: Arc::default(),
            quorum: levels.quorum,
            session,
        })
    }

    /// Whether this process registered the target, or found it registered,
    /// recently (a vote on it writes nothing to the registry).
    pub fn remembers(&self, target: &TargetId) -> bool {
        self.registered.lock().is_ok_and(|s| s.contains(target))
    }

    /// Records that the target has reactions. Called before a first reaction
    /// commits; skipped when this process registered it recently.
    pub async fn register(&self, target: &TargetId, kind: TargetType) -> Result<(), StoreError> {
        if self.remembers(target) {
            return Ok(());
        }
        self.session
            .execute_unpaged(&self.register, (target.as_str(), kind.as_str()))
            .await
            .map_err(super::request_failed)?;
        self.remember(target);
        Ok(())
    }

    /// Remembers a target known to be registered, as if this process had
    /// registered it: a vote on it then writes nothing to the registry.
    pub fn remember(&self, target: &TargetId) {
        if let Ok(mut s) = self.registered.lock() {
            s.insert(target, REMEMBERED);
        }
    }

    /// Whether anyone has reacted to the target: false only when the
    /// registry has no row for it. `register` completes (at the session's
    /// level, as this read) before a target's first reaction commits, and
    /// nothing deletes a registry row, so when this read finds none, no
    /// reaction to the target had committed when it began, and every bucket
    /// of the target was empty then. One partition, where the heads are one
    /// per bucket. Without `sees_every_registration` it answers true
    /// without reading. A row found is remembered.
    pub async fn has_reactions(&self, target: &TargetId) -> Result<bool, StoreError> {
        if self.remembers(target) || !self.sees_every_registration() {
            return Ok(true);
        }
        let row: Option<(String,)> =
            super::first_row(&self.session, &self.registered_row, (target.as_str(),)).await?;
        if row.is_some() {
            // For good: the next miss on it reads its buckets straight away,
            // and a vote on it writes nothing here.
            self.remember(target);
        }
        Ok(row.is_some())
    }

    /// Whether a read of the registry sees every registration that
    /// completed before it began, asked of the cluster as the driver knows
    /// it now (a region added later counts from when its nodes appear).
    pub fn sees_every_registration(&self) -> bool {
        let state = self.session.get_cluster_state();
        let datacenters = state
            .get_nodes_info()
            .iter()
            .filter_map(|n| n.datacenter.as_deref());
        registrations_overlap(self.quorum, datacenters)
    }

    /// The next `limit` targets after `after` in token order, with their tokens.
    pub async fn page(
        &self,
        after: Option<i64>,
        limit: i32,
    ) -> Result<Vec<(TargetId, i64)>, StoreError> {
        let rows: Vec<(String, i64)> = match after {
            None => super::all_rows(&self.session, &self.first_page, (limit,)).await?,
            Some(t) => super::all_rows(&self.session, &self.next_page, (t, limit)).await?,
        };
        Ok(rows
            .into_iter()
            .filter_map(|(t, tok)| TargetId::parse(&t).ok().map(|t| (t, tok)))
            .collect())
    }

    pub async fn checkpoint(&self, name: &str) -> Result<Option<Checkpoint>, StoreError> {
        type Row = (
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<String>,
            Option<i32>,
        );
        let row: Option<Row> =
            super::first_row(&self.session, &self.read_checkpoint, (name,)).await?;
        Ok(row.map(
            |(last_token, checked, drifted, in_target, bucket)| Checkpoint {
                last_token,
                checked: checked.unwrap_or(0),
                drifted: drifted.unwrap_or(0),
                in_target: in_target.zip(bucket.and_then(|b| u32::try_from(b).ok())),
            },
        ))
    }

    pub async fn save_checkpoint(&self, name: &str, c: &Checkpoint) -> Result<(), StoreError> {
        self.session
            .execute_unpaged(
                &self.write_checkpoint,
                (
                    name,
                    c.last_token,
                    c.checked,
                    c.drifted,
                    c.in_target.as_ref().map(|(t, _)| t.as_str()),
                    c.in_target.as_ref().map(|(_, b)| *b as i32),
                ),
            )
            .await
            .map_err(super::request_failed)?;
        Ok(())
    }

    pub async fn clear_checkpoint(&self, name: &str) -> Result<(), StoreError> {
        self.session
            .execute_unpaged(&self.delete_checkpoint, (name,))
            .await
            .map_err(super::request_failed)?;
        Ok(())
    }
}

/// Whether a read at `level` overlaps every write at `level` that completed
/// before it, in a cluster whose nodes are in `datacenters`: at QUORUM
/// always; at LOCAL_QUORUM only in one datacenter. Across regions two
/// LOCAL_QUORUMs share no replica, and a registration, written once and
/// not again with every count as a bucket's totals are, may not reach
/// another region for as long as its hints take, or ever without a repair.
fn registrations_overlap<'a>(
    level: Consistency,
    mut datacenters: impl Iterator<Item = &'a str>,
) -> bool {
    match level {
        Consistency::Quorum | Consistency::All | Consistency::EachQuorum => true,
        Consistency::LocalQuorum => datacenters
            .next()
            .is_some_and(|first| datacenters.all(|dc| dc == first)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{Remembered, registrations_overlap};
    use crate::domain::TargetId;
    use scylla::statement::Consistency;

    #[test]
    fn a_full_memory_of_targets_forgets_the_older_half_not_everything() {
        let t = |i: usize| TargetId::parse(&format!("t{i}")).unwrap_or_else(|e| panic!("{e}"));
        let mut r = Remembered::default();
        for i in 0..10 {
            r.insert(&t(i), 10);
        }
        // Ten added with room for ten: all remembered, in two halves.
        assert!((0..10).all(|i| r.contains(&t(i))));
        // One more: the first five go, the last five and the new one stay.
        r.insert(&t(10), 10);
        assert!((0..5).all(|i| !r.contains(&t(i))));
        assert!((5..11).all(|i| r.contains(&t(i))));
        // Adding one already remembered changes nothing.
        r.insert(&t(5), 10);
        assert!((5..11).all(|i| r.contains(&t(i))));
        assert!(r.newer.len() + r.older.len() <= 10);
    }

    #[test]
    fn the_registry_decides_only_where_its_reads_see_every_registration() {
        let one = ["dc1", "dc1", "dc1"];
        let two = ["dc1", "dc1", "dc2"];
        assert!(registrations_overlap(
            Consistency::LocalQuorum,
            one.into_iter()
        ));
        assert!(!registrations_overlap(
            Consistency::LocalQuorum,
            two.into_iter()
        ));
        assert!(registrations_overlap(Consistency::Quorum, two.into_iter()));
        // A cluster the driver knows no datacenter of: read the buckets.
        assert!(!registrations_overlap(
            Consistency::LocalQuorum,
            std::iter::empty()
        ));
        assert!(!registrations_overlap(Consistency::One, one.into_iter()));
    }
}
