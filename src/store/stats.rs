//! The `target_stats` table: durable per-target totals and the per-user
//! versions they include. Only the consumer and reconcile write it, and every
//! write is one conditional batch fenced on the partition's `seq`.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use scylla::client::session::Session;
use scylla::serialize::SerializationError;
use scylla::serialize::row::{RowSerializationContext, SerializeRow};
use scylla::serialize::value::SerializeValue;
use scylla::serialize::writers::RowWriter;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use scylla::value::{CqlValue, MaybeUnset};

use super::{Cas, StoreError, classify};
use crate::domain::reaction::N_COUNTED;
use crate::domain::{Applied, Reaction, TargetId, TargetType, Totals, UserId};

/// Most users one fenced write may carry, keeping the batch well under
/// Cassandra's batch size limits. Larger groups are written in chunks, each
/// self-consistent (its totals include exactly the users it records).
pub const MAX_USERS_PER_WRITE: usize = 200;

/// Which read a fenced writer needs: a plain LOCAL_QUORUM read, or one at
/// LOCAL_SERIAL, which first completes any Paxos round still in flight on the
/// partition (after a lost fence or an unknown outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadAt {
    Quorum,
    Serial,
}

/// A target's static columns: the fence and the totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Head {
    /// `None` when nothing was ever written for the target.
    pub seq: Option<i64>,
    pub totals: Totals,
    pub target_type: Option<TargetType>,
}

/// One fenced write: the new totals and the applied rows of some users, if
/// the partition's `seq` is still `read_seq`. It sets `seq` to `read_seq + 1`.
#[derive(Debug, Clone, Copy)]
pub struct FencedWrite<'a> {
    pub read_seq: Option<i64>,
    pub totals: Totals,
    /// Recorded when known; an absent type leaves the stored one alone.
    pub target_type: Option<TargetType>,
    pub users: &'a [(UserId, Applied)],
}

pub struct Stats {
    levels: super::Levels,
    session: Arc<Session>,
    head: PreparedStatement,
    head_serial: PreparedStatement,
    applied_of: PreparedStatement,
    applied_all: PreparedStatement,
    write_head: PreparedStatement,
    write_user: PreparedStatement,
}

type AppliedRow = (Option<String>, Option<i64>, Option<String>);

impl Stats {
    pub async fn prepare(session: Arc<Session>, levels: super::Levels) -> anyhow::Result<Stats> {
        // One column per counted reaction, named after its total.
        let totals = Reaction::total_names().collect::<Vec<_>>();
        // Only static columns: LIMIT 1 returns the partition's one value.
        let head_cql = format!(
            "SELECT {}, seq, target_type FROM target_stats WHERE target_id = ? LIMIT 1",
            totals.join(", ")
        );
        let head = session
            .prepare(head_cql.as_str())
            .await
            .context("prepare head")?;
        let mut head_serial = session
            .prepare(head_cql.as_str())
            .await
            .context("prepare serial head")?;
        head_serial.set_consistency(levels.serial_read);
        let applied_of = session
            .prepare(
                "SELECT user_id, applied_version, applied_state FROM target_stats \
                 WHERE target_id = ? AND user_id IN ?",
            )
            .await
            .context("prepare applied rows of users")?;
        let applied_all = session
            .prepare(
                "SELECT user_id, applied_version, applied_state FROM target_stats \
                 WHERE target_id = ?",
            )
            .await
            .context("prepare all applied rows")?;
        let set_totals: Vec<String> = totals.iter().map(|t| format!("{t} = ?")).collect();
        let write_head = session
            .prepare(format!(
                "UPDATE target_stats SET {}, seq = ?, target_type = ? WHERE target_id = ? IF seq = ?",
                set_totals.join(", ")
            ))
            .await
            .context("prepare head write")?;
        let write_user = session
            .prepare(
                "UPDATE target_stats SET applied_version = ?, applied_state = ? \
                 WHERE target_id = ? AND user_id = ?",
            )
            .await
            .context("prepare user write")?;
        Ok(Stats {
            levels,
            session,
            head,
            head_serial,
            applied_of,
            applied_all,
            write_head,
            write_user,
        })
    }

    /// The durable totals of one target; zeros if nothing was counted yet.
    pub async fn totals(&self, target: &TargetId) -> Result<Totals, StoreError> {
        Ok(self.head(target, ReadAt::Quorum).await?.totals)
    }

    /// The fence and the totals.
    pub async fn head(&self, target: &TargetId, at: ReadAt) -> Result<Head, StoreError> {
        let stmt = match at {
            ReadAt::Quorum => &self.head,
            ReadAt::Serial => &self.head_serial,
        };
        let row: Option<scylla::value::Row> =
            super::first_row(&self.session, stmt, (target.as_str(),)).await?;
        let columns = row.map(|r| r.columns).unwrap_or_default();
        let bigint = |i: usize| match columns.get(i) {
            Some(Some(CqlValue::BigInt(n))) => Some(*n),
            _ => None,
        };
        let totals = std::array::from_fn(|i| bigint(i).unwrap_or(0));
        let kind = match columns.get(N_COUNTED + 1) {
            Some(Some(CqlValue::Text(t))) => TargetType::parse(t),
            _ => None,
        };
        Ok(Head {
            seq: bigint(N_COUNTED),
            totals: Totals::from_values(totals),
            target_type: kind,
        })
    }

    /// The applied rows of `users`. Read after `head`: a write that lands in
    /// between moves the fence, so it cannot go unnoticed.
    pub async fn applied_of(
        &self,
        target: &TargetId,
        users: &[&UserId],
    ) -> Result<HashMap<UserId, Applied>, StoreError> {
        let ids: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
        let rows: Vec<AppliedRow> =
            super::all_rows(&self.session, &self.applied_of, (target.as_str(), ids)).await?;
        Ok(applied_map(rows))
    }

    /// Every applied row of the target, page by page.
    pub async fn applied_all(
        &self,
        target: &TargetId,
    ) -> Result<HashMap<UserId, Applied>, StoreError> {
        let rows: Vec<AppliedRow> =
            super::all_rows(&self.session, &self.applied_all, (target.as_str(),)).await?;
        Ok(applied_map(rows))
    }

    /// Writes the totals and the applied rows in one conditional batch on
    /// the partition's `seq`.
    pub async fn write(&self, target: &TargetId, w: &FencedWrite<'_>) -> Cas {
        let mut batch = Batch::new(BatchType::Unlogged);
        batch.set_consistency(self.levels.quorum);
        batch.set_serial_consistency(Some(self.levels.serial));
        batch.append_statement(self.write_head.clone());
        let kind = match w.target_type {
            Some(t) => MaybeUnset::Set(t.as_str()),
            None => MaybeUnset::Unset,
        };
        let totals = w.totals.values();
        let next_seq = w.read_seq.unwrap_or(0) + 1;
        let target_id = target.as_str();
        let mut head: Vec<&(dyn SerializeValue + Sync)> = totals
            .iter()
            .map(|t| t as &(dyn SerializeValue + Sync))
            .collect();
        head.extend([
            &next_seq as &(dyn SerializeValue + Sync),
            &kind,
            &target_id,
            &w.read_seq,
        ]);
        let mut values = Vec::with_capacity(w.users.len() + 1);
        values.push(Row::Head(head));
        for (user, a) in w.users {
            batch.append_statement(self.write_user.clone());
            values.push(Row::User((
                a.version,
                a.state.as_str(),
                target.as_str(),
                user.as_str(),
            )));
        }
        classify(self.session.batch(&batch, values).await)
    }
}

/// A partition holding only its static columns answers one row with a null
/// user_id; it, and rows that do not parse, are skipped.
fn applied_map(rows: Vec<AppliedRow>) -> HashMap<UserId, Applied> {
    let mut applied = HashMap::new();
    for (user, version, state) in rows {
        let (Some(Ok(user)), Some(version)) = (user.as_deref().map(UserId::parse), version) else {
            continue;
        };
        let state = state
            .and_then(|s| s.parse::<Reaction>().ok())
            .unwrap_or(Reaction::None);
        applied.insert(user, Applied { version, state });
    }
    applied
}

/// The values of one statement of a stats batch: the statics, or one user.
enum Row<'a> {
    Head(Vec<&'a (dyn SerializeValue + Sync)>),
    User((i64, &'a str, &'a str, &'a str)),
}

impl SerializeRow for Row<'_> {
    fn serialize(
        &self,
        ctx: &RowSerializationContext<'_>,
        writer: &mut RowWriter,
    ) -> Result<(), SerializationError> {
        match self {
            Row::Head(v) => SerializeRow::serialize(v, ctx, writer),
            Row::User(v) => SerializeRow::serialize(v, ctx, writer),
        }
    }

    fn is_empty(&self) -> bool {
        false
    }
}
