//! The `reactions` table: each user's current reaction per target (the
//! source of truth) and, in the same partition, the user's idempotency
//! records, so a change and the key that names it commit together.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context;
use scylla::client::session::Session;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;
use scylla::value::CqlTimestamp;
use uuid::Uuid;

use super::outbox::{Slot, shard_of};
use super::{Cas, StoreError};
use crate::domain::{IdempotencyKey, Reaction, TargetId, TargetType, UserId};

/// The types of an idempotency record's columns (request_hash,
/// request_owner, response_status, response_body, transition, intent_bucket,
/// intent_shard),
/// after the types of any columns a query reads before them: rows are flat
/// tuples, and this keeps the record's part declared once.
macro_rules! record_columns {
    ($($before:ty),*) => {
        ($($before,)* Option<String>, Option<Uuid>, Option<i32>, Option<String>, Option<String>, Option<i64>, Option<i32>)
    };
}

/// Clustering values of idempotency rows start with this; target ids cannot.
const KEY_MARKER: char = '#';

fn key_row(key: &IdempotencyKey) -> String {
    format!("{KEY_MARKER}{}", key.as_str())
}

/// A user's current reaction to a target, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Current {
    pub state: Reaction,
    pub version: i64,
}

/// What an idempotency key recorded: which request it was (hash), which
/// attempt wrote it (owner), and the response to give every repeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub request_hash: String,
    pub owner: Uuid,
    pub status: u16,
    pub body: String,
    /// The transition the request committed, as published (JSON); `None`
    /// when it changed nothing. This is the outbox: it is durable exactly
    /// when the change is.
    pub transition: Option<String>,
    /// The time bucket of the vote's outbox intent, when it wrote one.
    pub intent_bucket: Option<i64>,
    /// The shard of that bucket the intent went to; `None` in a record
    /// written before intents were grouped, whose intent is in its user's.
    pub intent_shard: Option<i32>,
}

impl KeyRecord {
    /// Where the intent of this record's vote is, if it wrote one.
    pub fn intent_slot(&self, user: &UserId) -> Option<Slot> {
        Some(Slot {
            bucket: self.intent_bucket?,
            shard: self.intent_shard.unwrap_or_else(|| shard_of(user)),
        })
    }
}

/// What a conditional write of the user's partition did. A refusal carries
/// what the partition holds, as the Paxos round read it: the user's row and
/// the key's record, so the next attempt needs no read of its own.
#[derive(Debug)]
pub enum Written {
    Applied,
    Refused(Snapshot),
    Unknown(anyhow::Error),
    Failed(anyhow::Error),
}

impl Written {
    /// The outcome's name, as metrics count it.
    pub fn label(&self) -> &'static str {
        match self {
            Written::Applied => "applied",
            Written::Refused(_) => "not_applied",
            Written::Unknown(_) => "unknown",
            Written::Failed(_) => "failed",
        }
    }
}

/// The rows a vote needs, read together from the user's partition.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub current: Option<Current>,
    pub record: Option<KeyRecord>,
}

/// The change a vote commits.
pub struct Change<'a> {
    pub user: &'a UserId,
    pub target: &'a TargetId,
    pub target_type: TargetType,
    /// What the change expects the user's row to hold; `None` for a first
    /// reaction.
    pub expected: Option<Current>,
    pub to: Reaction,
    pub key: &'a IdempotencyKey,
    pub record: &'a KeyRecord,
}

#[derive(Clone)]
pub struct Reactions {
    session: Arc<Session>,
    snapshot: PreparedStatement,
    snapshot_serial: PreparedStatement,
    record_serial: PreparedStatement,
    states: PreparedStatement,
    rows_of_users: PreparedStatement,
    by_target: PreparedStatement,
    kind_of: PreparedStatement,
    first_change: Batch,
    next_change: Batch,
    unchanged: Batch,
    still_absent: Batch,
    key_ttl_secs: i32,
}

impl Reactions {
    /// The same statements over another session.
    pub fn on(&self, session: Arc<Session>) -> Reactions {
        Reactions {
            session,
            ..self.clone()
        }
    }

    pub async fn prepare(
        session: Arc<Session>,
        key_ttl_secs: i32,
        levels: super::Levels,
    ) -> anyhow::Result<Reactions> {
        const SNAPSHOT: &str = "SELECT target_id, state, version, request_hash, request_owner, \
             response_status, response_body, transition, intent_bucket, intent_shard \
             FROM reactions WHERE user_id = ? AND target_id IN (?, ?)";
        let snapshot = super::prepare(&session, SNAPSHOT)
            .await
            .context("prepare snapshot")?;
        // The same read at SERIAL: it sees (and completes) any in-flight
        // Paxos round, which is how an unknown outcome becomes a known one.
        let mut snapshot_serial = super::prepare(&session, SNAPSHOT)
            .await
            .context("prepare serial snapshot")?;
        snapshot_serial.set_consistency(levels.serial_read);
        let mut record_serial = super::prepare(
            &session,
            "SELECT request_hash, request_owner, response_status, response_body, transition, \
                 intent_bucket, intent_shard FROM reactions WHERE user_id = ? AND target_id = ?",
        )
        .await
        .context("prepare serial record")?;
        record_serial.set_consistency(levels.serial_read);

        let states = super::prepare(
            &session,
            "SELECT target_id, state, version FROM reactions WHERE user_id = ? AND target_id IN ?",
        )
        .await
        .context("prepare states")?;

        // The consumer's check of events against the rows they claim to
        // come from: one request for a chunk's users (at most
        // MAX_USERS_PER_WRITE partitions).
        let rows_of_users = super::prepare(
            &session,
            "SELECT user_id, state, version FROM reactions WHERE user_id IN ? AND target_id = ?",
        )
        .await
        .context("prepare rows of users")?;

        // Served by the reactions_by_target SAI index; reconcile only. The
        // rows come in token order, a range of tokens (a bucket) at a time.
        let by_target = super::prepare(
            &session,
            "SELECT token(user_id), user_id, state, version, updated_at FROM reactions \
                 WHERE target_id = ? AND token(user_id) >= ? AND token(user_id) <= ? LIMIT ?",
        )
        .await
        .context("prepare by target")?;
        let kind_of = super::prepare(
            &session,
            "SELECT target_type FROM reactions WHERE target_id = ? LIMIT 1",
        )
        .await
        .context("prepare kind of target")?;

        let insert_first = super::prepare(
            &session,
            "INSERT INTO reactions (user_id, target_id, target_type, state, version, updated_at) \
                 VALUES (?, ?, ?, ?, 1, ?) IF NOT EXISTS",
        )
        .await
        .context("prepare first reaction")?;
        // Conditioned on the state too, though the version implies it: a
        // refusal then returns both, and the next attempt knows its `from`.
        let update_next = super::prepare(
            &session,
            "UPDATE reactions SET target_type = ?, state = ?, version = ?, updated_at = ? \
                 WHERE user_id = ? AND target_id = ? IF state = ? AND version = ?",
        )
        .await
        .context("prepare next reaction")?;
        let record_only = super::prepare(
            &session,
            "INSERT INTO reactions (user_id, target_id, request_hash, request_owner, \
                 response_status, response_body, transition, intent_bucket, intent_shard) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS USING TTL ?",
        )
        .await
        .context("prepare idempotency record")?;

        // A vote for the state the user already holds changes nothing, but
        // its key is recorded only if the row still holds that state: the
        // state it was answered from may be a guess. The row is rewritten
        // with the value it has (no new version), or, for a user with no
        // row, a cell is cleared that no live row has (no row is created).
        let keep_state = super::prepare(
            &session,
            "UPDATE reactions SET state = ? WHERE user_id = ? AND target_id = ? \
                 IF state = ? AND version = ?",
        )
        .await
        .context("prepare unchanged reaction")?;
        let keep_absent = super::prepare(
            &session,
            "UPDATE reactions SET updated_at = null WHERE user_id = ? AND target_id = ? \
                 IF version = null",
        )
        .await
        .context("prepare absent reaction")?;

        // One partition, one table: Cassandra runs the whole batch as one
        // Paxos round, so the change and its key land together or not at all.
        let batch = |change: &PreparedStatement| {
            let mut b = Batch::new(BatchType::Unlogged);
            b.append_statement(change.clone());
            b.append_statement(record_only.clone());
            b.set_consistency(levels.quorum);
            b.set_serial_consistency(Some(levels.serial));
            b
        };
        Ok(Reactions {
            first_change: batch(&insert_first),
            next_change: batch(&update_next),
            unchanged: batch(&keep_state),
            still_absent: batch(&keep_absent),
            session,
            snapshot,
            snapshot_serial,
            record_serial,
            states,
            rows_of_users,
            by_target,
            kind_of,
            key_ttl_secs,
        })
    }

    /// Reads the user's row for the target and the key's record, at
    /// LOCAL_QUORUM, or LOCAL_SERIAL when `serial`.
    pub async fn snapshot(
        &self,
        user: &UserId,
        target: &TargetId,
        key: &IdempotencyKey,
        serial: bool,
    ) -> Result<Snapshot, StoreError> {
        let stmt = if serial {
            &self.snapshot_serial
        } else {
            &self.snapshot
        };
        let key_row = key_row(key);
        let rows: Vec<SnapshotRow> = super::all_rows(
            &self.session,
            stmt,
            (user.as_str(), target.as_str(), key_row.as_str()),
        )
        .await?;
        fold_rows(&key_row, rows)
    }

    /// The key's record, read at LOCAL_SERIAL: any Paxos round still in
    /// flight on the user's partition is completed first, so the answer is
    /// final. `None` means no request with this key ever committed.
    pub async fn record_serial(
        &self,
        user: &UserId,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let key_row = key_row(key);
        let row: Option<RecordRow> = super::first_row(
            &self.session,
            &self.record_serial,
            (user.as_str(), key_row.as_str()),
        )
        .await?;
        match row {
            Some(row) => key_record(row),
            None => Ok(None),
        }
    }

    /// Writes the change and its key record in one conditional batch: one
    /// Paxos round, which also tells a replay (the key's record exists) and a
    /// stale expectation (the row holds something else) apart.
    pub async fn commit(&self, change: &Change<'_>) -> Written {
        let now = CqlTimestamp(now_millis());
        let (user, target) = (change.user.as_str(), change.target.as_str());
        let key_row = key_row(change.key);
        let record = self.record_values(change.user, &key_row, change.record);
        let result = match change.expected {
            None => {
                let first = (
                    user,
                    target,
                    change.target_type.as_str(),
                    change.to.as_str(),
                    now,
                );
                self.session
                    .batch(&self.first_change, (first, record))
                    .await
            }
            Some(current) => {
                let next = (
                    change.target_type.as_str(),
                    change.to.as_str(),
                    current.version + 1,
                    now,
                    user,
                    target,
                    current.state.as_str(),
                    current.version,
                );
                self.session.batch(&self.next_change, (next, record)).await
            }
        };
        written(&key_row, result)
    }

    /// Records a key whose request changes nothing (the user already holds
    /// that state), so its retries get the same answer; on the condition that
    /// the row holds what `expected` says, in the same round.
    pub async fn record_unchanged(
        &self,
        user: &UserId,
        target: &TargetId,
        expected: Option<Current>,
        key: &IdempotencyKey,
        record: &KeyRecord,
    ) -> Written {
        let key_row = key_row(key);
        let values = self.record_values(user, &key_row, record);
        let (u, t) = (user.as_str(), target.as_str());
        let result = match expected {
            Some(c) => {
                let state = c.state.as_str();
                let keep = (state, u, t, state, c.version);
                self.session.batch(&self.unchanged, (keep, values)).await
            }
            None => {
                self.session
                    .batch(&self.still_absent, ((u, t), values))
                    .await
            }
        };
        written(&key_row, result)
    }

    /// The bound values of `record_only`, the insert of a key's record.
    fn record_values<'a>(
        &self,
        user: &'a UserId,
        key_row: &'a str,
        r: &'a KeyRecord,
    ) -> impl scylla::serialize::row::SerializeRow + 'a {
        (
            user.as_str(),
            key_row,
            r.request_hash.as_str(),
            r.owner,
            i32::from(r.status),
            r.body.as_str(),
            r.transition.as_deref(),
            r.intent_bucket,
            r.intent_shard,
            self.key_ttl_secs,
        )
    }

    /// The caller's row of each target that has one (absent targets are
    /// missing): one single-partition query. The version comes along for
    /// the caller's next vote to guess from.
    pub async fn states(
        &self,
        user: &UserId,
        targets: &[TargetId],
    ) -> Result<HashMap<TargetId, Current>, StoreError> {
        let ids: Vec<&str> = targets.iter().map(TargetId::as_str).collect();
        // At most a page's ids (summary::MAX_IDS): bounded by the query.
        let rows: Vec<(String, Option<String>, Option<i64>)> =
            super::bounded_rows(&self.session, &self.states, (user.as_str(), ids)).await?;
        let mut out = HashMap::new();
        for (target, state, version) in rows {
            if let (Ok(target), Some(Ok(state)), Some(version)) = (
                TargetId::parse(&target),
                state.map(|s| s.parse::<Reaction>()),
                version,
            ) {
                out.insert(target, Current { state, version });
            }
        }
        Ok(out)
    }
}

/// A user's row as a checker reads it: its version always, its state only
/// if this release knows it (a newer release may have added a reaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub version: i64,
    /// The state, or the name of one this release does not know.
    pub state: Result<Reaction, String>,
}

impl Reactions {
    /// Each user's row of `target`, for those who have one. A state this
    /// release does not know is kept by name rather than failing the read:
    /// the read would fail on every try, and the events behind it wait.
    pub async fn rows_of(
        &self,
        users: &[&UserId],
        target: &TargetId,
    ) -> Result<HashMap<UserId, Seen>, StoreError> {
        let ids: Vec<&str> = users.iter().map(|u| u.as_str()).collect();
        let rows: Vec<(String, Option<String>, Option<i64>)> =
            super::all_rows(&self.session, &self.rows_of_users, (ids, target.as_str())).await?;
        let mut out = HashMap::new();
        for (user, state, version) in rows {
            let (Ok(user), Some(state), Some(version)) = (UserId::parse(&user), state, version)
            else {
                continue;
            };
            let state = state.parse::<Reaction>().map_err(|_| state);
            out.insert(user, Seen { version, state });
        }
        Ok(out)
    }

    /// The type one of the target's rows names, if it has any (through the
    /// SAI index).
    pub async fn kind_of(&self, target: &TargetId) -> Result<Option<TargetType>, StoreError> {
        let row: Option<(Option<String>,)> =
            super::first_row(&self.session, &self.kind_of, (target.as_str(),)).await?;
        Ok(row
            .and_then(|(kind,)| kind)
            .and_then(|k| TargetType::parse(&k)))
    }

    /// At most `limit` rows of one target whose users' tokens fall in
    /// `from..=to`, in token order, read through the SAI index.
    pub async fn by_target(
        &self,
        target: &TargetId,
        (from, to): (i64, i64),
        limit: i32,
    ) -> Result<TargetPage, StoreError> {
        let rows: Vec<ByTargetRow> = super::all_rows(
            &self.session,
            &self.by_target,
            (target.as_str(), from, to, limit),
        )
        .await?;
        let mut out = TargetPage {
            read: rows.len(),
            last_token: rows.last().map(|r| r.0),
            rows: Vec::with_capacity(rows.len()),
        };
        for (token, user, state, version, updated_at) in rows {
            let (Ok(user), Some(Ok(state)), Some(version)) =
                (UserId::parse(&user), state.map(|s| s.parse()), version)
            else {
                continue;
            };
            out.rows.push((
                token,
                user,
                Counted {
                    current: Current { state, version },
                    updated_at: updated_at
                        .and_then(|t| u64::try_from(t.0).ok())
                        .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)),
                },
            ));
        }
        Ok(out)
    }
}

/// A page of a target's rows in token order. Rows this release cannot read
/// (a state it does not know) are left out of `rows`, but counted in `read`:
/// a page they filled is full, and the next page starts after it.
#[derive(Debug, Default)]
pub struct TargetPage {
    pub rows: Vec<(i64, UserId, Counted)>,
    /// Rows the read returned, readable or not.
    pub read: usize,
    /// The token of the last row it returned.
    pub last_token: Option<i64>,
}

/// token(user_id), user_id, state, version, updated_at.
type ByTargetRow = (
    i64,
    String,
    Option<String>,
    Option<i64>,
    Option<CqlTimestamp>,
);

/// A row as reconcile reads it: the reaction, and when it last changed
/// (none for a row written without it, which counts as long ago).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    pub current: Current,
    pub updated_at: Option<std::time::SystemTime>,
}

/// The columns of an idempotency record.
type RecordRow = record_columns!();

/// A row of the user's partition as a vote reads it: the clustering value,
/// the reaction's columns, then the record's.
type SnapshotRow = record_columns!(String, Option<String>, Option<i64>);

/// The user's row and the key's record, from the rows of their partition.
fn fold_rows(
    key_row: &str,
    rows: impl IntoIterator<Item = SnapshotRow>,
) -> Result<Snapshot, StoreError> {
    let mut snap = Snapshot::default();
    for (clustering, state, version, hash, owner, status, body, transition, bucket, shard) in rows {
        if clustering == key_row {
            snap.record = key_record((hash, owner, status, body, transition, bucket, shard))?;
        } else if let (Some(state), Some(version)) = (state, version) {
            let state = state
                .parse()
                .map_err(|e: crate::domain::reaction::UnknownReaction| {
                    StoreError::Corrupt(e.to_string())
                })?;
            snap.current = Some(Current { state, version });
        }
    }
    Ok(snap)
}

/// Sorts the answer to a conditional write of the user's partition. Every
/// such write conditions the key's row on `IF NOT EXISTS`, so Cassandra
/// answers a refusal with every column of the rows it read (the user's row
/// and the key's, those that exist), whatever their order.
fn written(
    key_row: &str,
    result: Result<scylla::response::query_result::QueryResult, scylla::errors::ExecutionError>,
) -> Written {
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            return match super::classify(Err(e)) {
                Cas::Failed(e) => Written::Failed(e),
                Cas::Unknown(e) => Written::Unknown(e),
                Cas::Applied | Cas::NotApplied => {
                    Written::Unknown(anyhow::anyhow!("an error classified as an outcome"))
                }
            };
        }
    };
    match refused_rows(result) {
        Ok(None) => Written::Applied,
        Ok(Some(rows)) => match fold_rows(key_row, rows) {
            Ok(snap) => Written::Refused(snap),
            Err(e) => Written::Unknown(e.into()),
        },
        Err(e) => Written::Unknown(e),
    }
}

/// `None` when the write applied; else the rows it returned, by column name.
fn refused_rows(
    result: scylla::response::query_result::QueryResult,
) -> anyhow::Result<Option<Vec<SnapshotRow>>> {
    use scylla::value::{CqlValue, Row};
    let rows = result
        .into_rows_result()
        .context("A conditional write returned no rows")?;
    let names: Vec<String> = rows
        .column_specs()
        .iter()
        .map(|c| c.name().to_owned())
        .collect();
    if names.first().map(String::as_str) != Some("[applied]") {
        anyhow::bail!("A conditional write returned no [applied] column");
    }
    let at = |name: &str| names.iter().position(|n| n == name);
    let columns = [
        "target_id",
        "state",
        "version",
        "request_hash",
        "request_owner",
        "response_status",
        "response_body",
        "transition",
        "intent_bucket",
        "intent_shard",
    ]
    .map(at);
    let mut out = Vec::new();
    for row in rows.rows::<Row>().context("Failed to read a refusal")? {
        let row = row.context("Failed to read a refusal's row")?;
        let applied = row
            .columns
            .first()
            .and_then(|v| v.as_ref())
            .and_then(CqlValue::as_boolean)
            .context("[applied] was not a boolean")?;
        if applied {
            return Ok(None);
        }
        let value = |i: usize| columns[i].and_then(|at| row.columns.get(at).cloned().flatten());
        let text = |i: usize| value(i).and_then(CqlValue::into_string);
        let Some(clustering) = text(0) else {
            // The [applied] row of a refusal that read no existing row.
            continue;
        };
        out.push((
            clustering,
            text(1),
            value(2).and_then(|v| v.as_bigint()),
            text(3),
            value(4).and_then(|v| v.as_uuid()),
            value(5).and_then(|v| v.as_int()),
            text(6),
            text(7),
            value(8).and_then(|v| v.as_bigint()),
            value(9).and_then(|v| v.as_int()),
        ));
    }
    Ok(Some(out))
}

/// A record from its columns; `None` for a row that is not a whole record.
fn key_record(
    (hash, owner, status, body, transition, intent_bucket, intent_shard): RecordRow,
) -> Result<Option<KeyRecord>, StoreError> {
    let (Some(request_hash), Some(owner), Some(status), Some(body)) = (hash, owner, status, body)
    else {
        return Ok(None);
    };
    let status = u16::try_from(status)
        .ok()
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| StoreError::Corrupt(format!("idempotency record status {status}")))?;
    Ok(Some(KeyRecord {
        request_hash,
        owner,
        status,
        body,
        transition,
        intent_bucket,
        intent_shard,
    }))
}

fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
