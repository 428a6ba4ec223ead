//! The `target_stats` table: durable per-target totals and the per-user
//! versions they include. Only the consumer and reconcile write it, and every
//! write is one conditional batch fenced on the partition's `seq`.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use scylla::client::session::Session;
use scylla::serialize::SerializationError;
use scylla::serialize::row::{RowSerializationContext, SerializeRow};
use scylla::serialize::writers::RowWriter;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use scylla::statement::{Consistency, SerialConsistency};
use scylla::value::MaybeUnset;

use super::reactions::{Cas, Unavailable, classify};
use crate::domain::{Applied, Ledger, Reaction, TargetId, TargetType, Totals, UserId};

/// Most users one fenced write may carry, keeping the batch well under
/// Cassandra's batch size limits. Larger groups are written in chunks, each
/// self-consistent (its totals include exactly the users it records).
pub const MAX_USERS_PER_WRITE: usize = 200;

/// A target's durable state as read: the fence and the ledger.
#[derive(Debug, Clone)]
pub struct TargetRead {
    /// `None` when nothing was ever written for the target.
    pub seq: Option<i64>,
    pub ledger: Ledger,
}

pub struct Stats {
    session: Arc<Session>,
    totals: PreparedStatement,
    head: [PreparedStatement; 2],
    users: [PreparedStatement; 2],
    all_users: PreparedStatement,
    write_head: PreparedStatement,
    write_user: PreparedStatement,
}

impl Stats {
    pub async fn prepare(session: Arc<Session>) -> anyhow::Result<Stats> {
        // Only static columns: LIMIT 1 returns the partition's one value.
        const HEAD: &str =
            "SELECT likes, dislikes, seq FROM target_stats WHERE target_id = ? LIMIT 1";
        const USERS: &str = "SELECT user_id, applied_version, applied_state FROM target_stats WHERE target_id = ? AND user_id IN ?";
        let totals = session.prepare(HEAD).await.context("prepare totals")?;
        let serial = |mut s: PreparedStatement| {
            s.set_consistency(Consistency::LocalSerial);
            s
        };
        let head = [
            session.prepare(HEAD).await?,
            serial(session.prepare(HEAD).await?),
        ];
        let users = [
            session.prepare(USERS).await?,
            serial(session.prepare(USERS).await?),
        ];
        let all_users = session
            .prepare("SELECT user_id, applied_version, applied_state FROM target_stats WHERE target_id = ?")
            .await
            .context("prepare all users")?;
        let write_head = session
            .prepare(
                "UPDATE target_stats SET likes = ?, dislikes = ?, seq = ?, target_type = ? WHERE target_id = ? IF seq = ?",
            )
            .await
            .context("prepare head write")?;
        let write_user = session
            .prepare("UPDATE target_stats SET applied_version = ?, applied_state = ? WHERE target_id = ? AND user_id = ?")
            .await
            .context("prepare user write")?;
        Ok(Stats {
            session,
            totals,
            head,
            users,
            all_users,
            write_head,
            write_user,
        })
    }

    /// The durable totals of one target; zeros if nothing was counted yet.
    pub async fn totals(&self, target: &TargetId) -> Result<Totals, Unavailable> {
        Ok(self.head(&self.totals, target).await?.1)
    }

    async fn head(
        &self,
        stmt: &PreparedStatement,
        target: &TargetId,
    ) -> Result<(Option<i64>, Totals), Unavailable> {
        let row: Option<(Option<i64>, Option<i64>, Option<i64>)> =
            super::first_row(&self.session, stmt, (target.as_str(),)).await?;
        let (likes, dislikes, seq) = row.unwrap_or((None, None, None));
        Ok((
            seq,
            Totals {
                likes: likes.unwrap_or(0),
                dislikes: dislikes.unwrap_or(0),
            },
        ))
    }

    /// Reads the fence, the totals and the applied rows of `users` (or of
    /// every user, when `users` is `None`), at LOCAL_SERIAL when `serial`.
    pub async fn read(
        &self,
        target: &TargetId,
        users: Option<&[&UserId]>,
        serial: bool,
    ) -> Result<TargetRead, Unavailable> {
        let i = usize::from(serial);
        let head = self.head(&self.head[i], target);
        // A partition holding only its static columns answers one row with a
        // null user_id.
        type Row = (Option<String>, Option<i64>, Option<String>);
        let rows = async {
            match users {
                Some(users) => {
                    let ids: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
                    super::all_rows::<Row, _>(&self.session, &self.users[i], (target.as_str(), ids))
                        .await
                }
                None => {
                    super::all_rows::<Row, _>(&self.session, &self.all_users, (target.as_str(),))
                        .await
                }
            }
        };
        let ((seq, totals), rows) = futures::try_join!(head, rows)?;
        let mut applied = HashMap::new();
        for (user, version, state) in rows {
            let (Some(Ok(user)), Some(version)) = (user.as_deref().map(UserId::parse), version)
            else {
                continue;
            };
            let state = state
                .and_then(|s| s.parse::<Reaction>().ok())
                .unwrap_or(Reaction::None);
            applied.insert(user, Applied { version, state });
        }
        Ok(TargetRead {
            seq,
            ledger: Ledger::new(totals, applied),
        })
    }

    /// Writes the ledger's totals and the applied rows of `users`, if the
    /// partition's seq is still `read.seq`. Sets seq to `read.seq + 1`.
    pub async fn write(
        &self,
        target: &TargetId,
        target_type: Option<TargetType>,
        read_seq: Option<i64>,
        ledger: &Ledger,
        users: &[&UserId],
    ) -> Cas {
        let mut batch = Batch::new(BatchType::Unlogged);
        batch.set_consistency(Consistency::LocalQuorum);
        batch.set_serial_consistency(Some(SerialConsistency::LocalSerial));
        batch.append_statement(self.write_head.clone());
        let kind = match target_type {
            Some(t) => MaybeUnset::Set(t.as_str()),
            None => MaybeUnset::Unset,
        };
        let mut values = Vec::with_capacity(users.len() + 1);
        values.push(Row::Head((
            ledger.totals.likes,
            ledger.totals.dislikes,
            read_seq.unwrap_or(0) + 1,
            kind,
            target.as_str(),
            read_seq,
        )));
        for user in users {
            let a = ledger.applied.get(*user).copied().unwrap_or(Applied::NEVER);
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

/// The values of one statement of a stats batch: the statics, or one user.
enum Row<'a> {
    Head((i64, i64, i64, MaybeUnset<&'a str>, &'a str, Option<i64>)),
    User((i64, &'a str, &'a str, &'a str)),
}

impl SerializeRow for Row<'_> {
    fn serialize(
        &self,
        ctx: &RowSerializationContext<'_>,
        writer: &mut RowWriter,
    ) -> Result<(), SerializationError> {
        match self {
            Row::Head(v) => v.serialize(ctx, writer),
            Row::User(v) => v.serialize(ctx, writer),
        }
    }

    fn is_empty(&self) -> bool {
        false
    }
}
