//! The `target_stats` table: durable totals and the per-user versions they
//! include, one partition per bucket of a target (see `domain::bucket`).
//! Only the consumer and reconcile write it, and every write is one
//! conditional batch fenced on the bucket's `seq` and on each applied row it
//! changes holding what its writer read or believes.

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

use super::{Cas, StoreError, classify, token_of};
use crate::domain::reaction::N_COUNTED;
use crate::domain::{Applied, Bucket, Layout, Reaction, TargetId, TargetType, Totals, UserId};

/// The levels of the `seq` fence: its Paxos round and the read that
/// completes one run over every datacenter's replicas, whatever
/// `--serial-consistency` says. Users are homed to a region, targets are
/// not: each region's consumer counts the votes on one target, and under
/// LOCAL_SERIAL two regions could each win `IF seq = s` on one bucket, and
/// replication would keep one of their totals and both of their applied
/// rows, a count lost for good. In one datacenter the two are the same
/// replicas, at the same cost. Plain reads and the commit stay at the
/// configured level: a stale read only loses the fence and reads again at
/// SERIAL.
fn fence_levels(configured: super::Levels) -> super::Levels {
    let global = super::SerialScope::Serial.levels();
    super::Levels {
        serial: global.serial,
        serial_read: global.serial_read,
        ..configured
    }
}

/// Which read a fenced writer needs: a plain quorum read, or one at SERIAL,
/// which first completes any Paxos round still in flight on the partition
/// (after a lost fence or an unknown outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadAt {
    Quorum,
    Serial,
}

/// A bucket's static columns: the fence and the bucket's totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Head {
    /// `None` when nothing was ever written to the bucket.
    pub seq: Option<i64>,
    pub totals: Totals,
    pub target_type: Option<TargetType>,
}

/// A head from its columns: the totals, seq, target_type.
fn head_of(columns: &[Option<CqlValue>]) -> Head {
    let bigint = |i: usize| match columns.get(i) {
        Some(Some(CqlValue::BigInt(n))) => Some(*n),
        _ => None,
    };
    let totals = std::array::from_fn(|i| bigint(i).unwrap_or(0));
    let kind = match columns.get(N_COUNTED + 1) {
        Some(Some(CqlValue::Text(t))) => TargetType::parse(t),
        _ => None,
    };
    Head {
        seq: bigint(N_COUNTED),
        totals: Totals::from_values(totals),
        target_type: kind,
    }
}

/// The heads of all of a target's buckets, in bucket order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heads(pub Vec<Head>);

impl Heads {
    /// Every bucket of `layout` as nobody has written it.
    pub fn empty(layout: Layout) -> Heads {
        Heads(layout.buckets().map(|_| Head::default()).collect())
    }

    /// The target's totals: the sum of its buckets'.
    pub fn totals(&self) -> Totals {
        self.0
            .iter()
            .fold(Totals::default(), |sum, h| sum.plus(h.totals))
    }
}

/// One fenced write: the new totals and the applied rows of some users, if
/// the bucket's `seq` is still `read_seq` and each of those rows still holds
/// what `before` says. It sets `seq` to `read_seq + 1`.
///
/// The fence alone is not enough once there are replicas: a commit that
/// reached one replica (its coordinator timed out or died) can show in one
/// LOCAL_QUORUM read and not in the next, so a writer can read the new head
/// beside old rows and move the totals a second time for a change already in
/// them. Paxos evaluates every condition on the same linearizable view, so a
/// writer whose rows were stale is refused as one whose head was.
#[derive(Debug, Clone, Copy)]
pub struct FencedWrite<'a> {
    pub read_seq: Option<i64>,
    pub totals: Totals,
    /// Recorded when known; an absent type leaves the stored one alone.
    pub target_type: Option<TargetType>,
    pub users: &'a [(UserId, Applied)],
    /// What each of `users`, in order, holds before this write as its writer
    /// read it (or, without reading, believes it): `None` for no row. A row
    /// can hold `Applied::NEVER` (reconcile forgetting a user writes it), and
    /// that is not the same condition as no row.
    pub before: &'a [Option<Applied>],
}

/// An applied row, with the token it is clustered by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedRow {
    pub token: i64,
    pub user: UserId,
    pub applied: Applied,
}

#[derive(Clone)]
pub struct Stats {
    layout: Layout,
    levels: super::Levels,
    session: Arc<Session>,
    head: PreparedStatement,
    head_serial: PreparedStatement,
    all_heads: PreparedStatement,
    applied_of: PreparedStatement,
    applied_page: PreparedStatement,
    write_head: PreparedStatement,
    write_user_at: PreparedStatement,
    write_user_new: PreparedStatement,
    probe: PreparedStatement,
}

type StoredRow = (Option<i64>, Option<String>, Option<i64>, Option<String>);

impl Stats {
    /// The same statements over another session.
    pub fn on(&self, session: Arc<Session>) -> Stats {
        Stats {
            session,
            ..self.clone()
        }
    }

    pub async fn prepare(
        session: Arc<Session>,
        levels: super::Levels,
        layout: Layout,
    ) -> anyhow::Result<Stats> {
        let levels = fence_levels(levels);
        // One column per counted reaction, named after its total.
        let totals = Reaction::total_names().collect::<Vec<_>>();
        // Only static columns: LIMIT 1 returns the partition's one value.
        let head_cql = format!(
            "SELECT {}, seq, target_type FROM target_stats WHERE target_id = ? AND bucket = ? LIMIT 1",
            totals.join(", ")
        );
        let head = super::prepare(&session, head_cql.as_str())
            .await
            .context("prepare head")?;
        let mut head_serial = super::prepare(&session, head_cql.as_str())
            .await
            .context("prepare serial head")?;
        head_serial.set_consistency(levels.serial_read);
        // Every bucket's head in one request: a bounded IN over the target's
        // own partitions (the layout's count, at most 1,024), so a miss costs
        // one request to Cassandra rather than one per bucket.
        let all_heads = super::prepare(
            &session,
            format!(
                "SELECT bucket, {}, seq, target_type FROM target_stats \
                     WHERE target_id = ? AND bucket IN ? PER PARTITION LIMIT 1",
                totals.join(", ")
            )
            .as_str(),
        )
        .await
        .context("prepare all heads")?;
        let applied_of = super::prepare(
            &session,
            "SELECT user_token, user_id, applied_version, applied_state FROM target_stats \
                 WHERE target_id = ? AND bucket = ? AND (user_token, user_id) IN ?",
        )
        .await
        .context("prepare applied rows of users")?;
        let applied_page = super::prepare(&session,
                "SELECT user_token, user_id, applied_version, applied_state FROM target_stats \
                 WHERE target_id = ? AND bucket = ? AND user_token >= ? AND user_token <= ? LIMIT ?",
            )
            .await
            .context("prepare a page of applied rows")?;
        let set_totals: Vec<String> = totals.iter().map(|t| format!("{t} = ?")).collect();
        let write_head = super::prepare(
            &session,
            format!(
                "UPDATE target_stats SET {}, seq = ?, target_type = ? \
                 WHERE target_id = ? AND bucket = ? IF seq = ?",
                set_totals.join(", ")
            ),
        )
        .await
        .context("prepare head write")?;
        let user_cql = "UPDATE target_stats SET applied_version = ?, applied_state = ? \
                        WHERE target_id = ? AND bucket = ? AND user_token = ? AND user_id = ?";
        let write_user_at = super::prepare(
            &session,
            format!("{user_cql} IF applied_version = ? AND applied_state = ?"),
        )
        .await
        .context("prepare user write on its applied row")?;
        let write_user_new =
            super::prepare(&session, format!("{user_cql} IF applied_version = null"))
                .await
                .context("prepare user write on no applied row")?;
        // A conditional write to a row of its own, which no reader depends on.
        let probe = super::prepare(
            &session,
            "INSERT INTO settings (name, value) VALUES ('consumer_probe', 0) IF NOT EXISTS",
        )
        .await
        .context("prepare the store probe")?;
        Ok(Stats {
            layout,
            levels,
            session,
            head,
            head_serial,
            all_heads,
            applied_of,
            applied_page,
            write_head,
            write_user_at,
            write_user_new,
            probe,
        })
    }

    /// Whether Cassandra takes a conditional write elsewhere: one Paxos round
    /// on a partition of its own. When it does and a bucket's writes keep
    /// failing, the fault is that bucket's, not the store's.
    pub async fn probe(&self) -> Result<(), StoreError> {
        match classify(self.session.execute_unpaged(&self.probe, ()).await) {
            Cas::Applied | Cas::NotApplied => Ok(()),
            Cas::Unknown(e) | Cas::Failed(e) => Err(StoreError::Request(e)),
        }
    }

    /// The keyspace's bucket count.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The bucket a user's applied row lives in.
    pub fn bucket_of(&self, user: &UserId) -> Bucket {
        self.layout.of_token(token_of(user))
    }

    /// The durable totals of one target: the sum of its buckets'.
    pub async fn totals(&self, target: &TargetId) -> Result<Totals, StoreError> {
        Ok(self.heads(target).await?.totals())
    }

    /// The head of every bucket of a target, in one request (never the
    /// voters: one static row per bucket).
    pub async fn heads(&self, target: &TargetId) -> Result<Heads, StoreError> {
        let buckets: Vec<Bucket> = self.layout.buckets().collect();
        let heads = self.heads_of(target, &buckets).await?;
        Ok(Heads(heads.into_iter().map(|(_, head)| head).collect()))
    }

    /// The heads of some buckets of a target, in one request, in the order
    /// given. A bucket nobody has written has no row: an empty head.
    pub async fn heads_of(
        &self,
        target: &TargetId,
        buckets: &[Bucket],
    ) -> Result<Vec<(Bucket, Head)>, StoreError> {
        let columns: Vec<i32> = buckets.iter().map(|b| b.column()).collect();
        // One row per bucket at most (PER PARTITION LIMIT 1).
        let rows: Vec<scylla::value::Row> =
            super::bounded_rows(&self.session, &self.all_heads, (target.as_str(), &columns))
                .await?;
        let mut heads: Vec<(Bucket, Head)> =
            buckets.iter().map(|b| (*b, Head::default())).collect();
        for row in rows {
            let Some(Some(CqlValue::Int(bucket))) = row.columns.first() else {
                continue;
            };
            if let Some(slot) = heads.iter_mut().find(|(b, _)| b.column() == *bucket) {
                slot.1 = head_of(&row.columns[1..]);
            }
        }
        Ok(heads)
    }

    /// One bucket's fence and totals.
    pub async fn head(
        &self,
        target: &TargetId,
        bucket: Bucket,
        at: ReadAt,
    ) -> Result<Head, StoreError> {
        let stmt = match at {
            ReadAt::Quorum => &self.head,
            ReadAt::Serial => &self.head_serial,
        };
        let row: Option<scylla::value::Row> =
            super::first_row(&self.session, stmt, (target.as_str(), bucket.column())).await?;
        let columns = row.map(|r| r.columns).unwrap_or_default();
        Ok(head_of(&columns))
    }

    /// The applied rows of `users`, all of them in `bucket`. Read after
    /// `head`: a write that lands in between moves the fence, so it cannot
    /// go unnoticed.
    pub async fn applied_of(
        &self,
        target: &TargetId,
        bucket: Bucket,
        users: &[&UserId],
    ) -> Result<HashMap<UserId, Applied>, StoreError> {
        let keys: Vec<(i64, &str)> = users.iter().map(|u| (token_of(u), u.as_str())).collect();
        let rows: Vec<StoredRow> = super::all_rows(
            &self.session,
            &self.applied_of,
            (target.as_str(), bucket.column(), keys),
        )
        .await?;
        Ok(parse_rows(rows)?
            .into_iter()
            .map(|r| (r.user, r.applied))
            .collect())
    }

    /// At most `limit` applied rows of a bucket with tokens in `from..=to`,
    /// in clustering order: by token, then user id.
    pub async fn applied_page(
        &self,
        target: &TargetId,
        bucket: Bucket,
        (from, to): (i64, i64),
        limit: i32,
    ) -> Result<Vec<AppliedRow>, StoreError> {
        let rows: Vec<StoredRow> = super::all_rows(
            &self.session,
            &self.applied_page,
            (target.as_str(), bucket.column(), from, to, limit),
        )
        .await?;
        parse_rows(rows)
    }

    /// Writes a bucket's totals and applied rows in one conditional batch on
    /// the bucket's `seq` and on each changed row holding what `w.before`
    /// says. Refused (`NotApplied`) if any of them differs. Every user must
    /// belong to `bucket`.
    pub async fn write(&self, target: &TargetId, bucket: Bucket, w: &FencedWrite<'_>) -> Cas {
        debug_assert!(w.users.iter().all(|(u, _)| self.bucket_of(u) == bucket));
        debug_assert_eq!(w.before.len(), w.users.len());
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
        let column = bucket.column();
        let mut head: Vec<&(dyn SerializeValue + Sync)> = totals
            .iter()
            .map(|t| t as &(dyn SerializeValue + Sync))
            .collect();
        head.extend([
            &next_seq as &(dyn SerializeValue + Sync),
            &kind,
            &target_id,
            &column,
            &w.read_seq,
        ]);
        let mut values = Vec::with_capacity(w.users.len() + 1);
        values.push(Row::Head(head));
        for (i, (user, a)) in w.users.iter().enumerate() {
            let row = (
                a.version,
                a.state.as_str(),
                target_id,
                column,
                token_of(user),
                user.as_str(),
            );
            // A missing belief (a writer's bug) is taken as no row, so the
            // write is refused unless that is true; never unconditioned.
            match w.before.get(i).copied().flatten() {
                None => {
                    batch.append_statement(self.write_user_new.clone());
                    values.push(Row::User(row));
                }
                Some(was) => {
                    batch.append_statement(self.write_user_at.clone());
                    values.push(Row::UserAt(row, (was.version, was.state.as_str())));
                }
            }
        }
        classify(self.session.batch(&batch, values).await)
    }
}

/// A partition holding only its static columns answers one row with null
/// clustering columns; it, and rows without a user or a version, are skipped.
/// A state this build does not know is an error, not `none`: every write is
/// conditioned on the state it read, so a misread one would be refused for
/// ever, and before that it would have moved the totals wrongly.
fn parse_rows(rows: Vec<StoredRow>) -> Result<Vec<AppliedRow>, StoreError> {
    let mut parsed = Vec::with_capacity(rows.len());
    for (token, user, version, state) in rows {
        let (Some(token), Some(Ok(user)), Some(version)) =
            (token, user.as_deref().map(UserId::parse), version)
        else {
            continue;
        };
        let Some(state) = state.as_deref().and_then(|s| s.parse::<Reaction>().ok()) else {
            return Err(StoreError::Corrupt(format!(
                "the applied row of user {user} holds state {state:?}, which this build does not know"
            )));
        };
        parsed.push(AppliedRow {
            token,
            user,
            applied: Applied { version, state },
        });
    }
    Ok(parsed)
}

/// The values of one statement of a stats batch: the statics, or one user.
enum Row<'a> {
    Head(Vec<&'a (dyn SerializeValue + Sync)>),
    User(UserValues<'a>),
    /// A user row conditioned on the applied version and state it holds.
    UserAt(UserValues<'a>, (i64, &'a str)),
}

/// applied_version, applied_state, target_id, bucket, user_token, user_id.
type UserValues<'a> = (i64, &'a str, &'a str, i32, i64, &'a str);

impl SerializeRow for Row<'_> {
    fn serialize(
        &self,
        ctx: &RowSerializationContext<'_>,
        writer: &mut RowWriter,
    ) -> Result<(), SerializationError> {
        match self {
            Row::Head(v) => SerializeRow::serialize(v, ctx, writer),
            Row::User(v) => SerializeRow::serialize(v, ctx, writer),
            Row::UserAt((a, b, c, d, e, f), (g, h)) => {
                SerializeRow::serialize(&(a, b, c, d, e, f, g, h), ctx, writer)
            }
        }
    }

    fn is_empty(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_runs_paxos_over_every_datacenter_whatever_the_votes_scope() {
        use crate::store::SerialScope;
        use scylla::statement::{Consistency, SerialConsistency};
        for scope in [SerialScope::LocalSerial, SerialScope::Serial] {
            let configured = scope.levels();
            let fence = fence_levels(configured);
            assert_eq!(fence.serial, SerialConsistency::Serial, "{scope:?}");
            assert_eq!(fence.serial_read, Consistency::Serial, "{scope:?}");
            assert_eq!(fence.quorum, configured.quorum, "{scope:?}");
        }
    }

    fn row(user: Option<&str>, version: Option<i64>, state: Option<&str>) -> StoredRow {
        (
            Some(7),
            user.map(str::to_owned),
            version,
            state.map(str::to_owned),
        )
    }

    #[test]
    fn the_static_row_is_skipped_and_a_known_state_is_read() {
        let rows = parse_rows(vec![
            (None, None, None, None),
            row(Some("ann"), Some(3), Some("dislike")),
            row(Some("ben"), None, None),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].user.as_str(), "ann");
        assert_eq!(
            rows[0].applied,
            Applied {
                version: 3,
                state: Reaction::Dislike
            }
        );
    }

    #[test]
    fn a_state_this_build_does_not_know_is_an_error_not_none() {
        for state in [Some("love"), None] {
            let read = parse_rows(vec![row(Some("ann"), Some(3), state)]);
            assert!(
                matches!(read, Err(StoreError::Corrupt(_))),
                "{state:?}: {read:?}"
            );
        }
    }
}
