//! `tally migrate`: creates the keyspace and applies the numbered CQL files in
//! `migrations/` that are not yet recorded in `schema_migrations`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::TryStreamExt;
use scylla::client::session::Session;
use sha2::{Digest, Sha256};

use crate::domain::Layout;

/// One numbered migration, compiled into the binary so `tally migrate` needs
/// nothing beside it.
pub struct Migration {
    pub id: &'static str,
    pub cql: &'static str,
}

/// A migration from `migrations/<id>.cql`, compiled in.
macro_rules! migration {
    ($id:literal) => {
        Migration {
            id: $id,
            cql: include_str!(concat!("../../migrations/", $id, ".cql")),
        }
    };
}

pub const MIGRATIONS: &[Migration] = &[
    migration!("0001_reactions"),
    migration!("0002_target_stats"),
    migration!("0003_reconcile"),
    migration!("0004_outbox"),
    migration!("0005_stats_buckets"),
    migration!("0006_intent_shard"),
    #[cfg(feature = "third-reaction")]
    migration!("feature/9001_love"),
];

/// Keyspace replication: `simple:N` (SimpleStrategy, for one local node) or
/// `DC:N[,DC:N...]` (NetworkTopologyStrategy, for production).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replication {
    Simple(u32),
    NetworkTopology(Vec<(String, u32)>),
}

impl FromStr for Replication {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let factor = |n: &str| -> Result<u32, String> {
            match n.parse::<u32>() {
                Ok(f) if (1..=9).contains(&f) => Ok(f),
                _ => Err(format!("replication factor must be 1 to 9, not {n:?}")),
            }
        };
        if let Some(n) = s.strip_prefix("simple:") {
            return Ok(Replication::Simple(factor(n)?));
        }
        let mut dcs = Vec::new();
        for part in s.split(',') {
            let (dc, n) = part
                .split_once(':')
                .ok_or_else(|| format!("expected simple:N or DC:N[,DC:N], not {s:?}"))?;
            if dc.is_empty()
                || !dc
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(format!("bad datacenter name {dc:?}"));
            }
            dcs.push((dc.to_owned(), factor(n)?));
        }
        Ok(Replication::NetworkTopology(dcs))
    }
}

impl fmt::Display for Replication {
    /// The CQL replication map.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Replication::Simple(n) => write!(
                f,
                "{{'class': 'SimpleStrategy', 'replication_factor': {n}}}"
            ),
            Replication::NetworkTopology(dcs) => {
                write!(f, "{{'class': 'NetworkTopologyStrategy'")?;
                for (dc, n) in dcs {
                    write!(f, ", '{dc}': {n}")?;
                }
                write!(f, "}}")
            }
        }
    }
}

/// Keyspace names are spliced into DDL, so only CQL's unquoted identifiers
/// are accepted.
pub fn check_keyspace_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "keyspace must match [a-z][a-z0-9_]{{0,47}}, not {name:?}"
        ))
    }
}

/// The statements of one migration file: split on `;`, with `--` comments
/// removed, both only outside single-quoted strings (`''` inside a string
/// is an escaped quote, which toggling twice handles).
pub fn statements(cql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut in_string = false;
    let mut chars = cql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_string = !in_string;
                current.push(c);
            }
            '-' if !in_string && chars.peek() == Some(&'-') => {
                // Skip to the end of the line.
                for next in chars.by_ref() {
                    if next == '\n' {
                        current.push('\n');
                        break;
                    }
                }
            }
            ';' if !in_string => out.push(std::mem::take(&mut current)),
            _ => current.push(c),
        }
    }
    out.push(current);
    out.into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

fn checksum(cql: &str) -> String {
    hex::encode(Sha256::digest(cql.as_bytes()))
}

#[derive(Debug, Default)]
pub struct Report {
    pub applied: Vec<&'static str>,
    pub already: Vec<&'static str>,
    /// The bucket count of the keyspace.
    pub layout: Option<Layout>,
}

/// How long a run waits for another run's lease before it gives up.
pub const LEASE_WAIT: Duration = Duration::from_secs(600);

/// How long a lease lasts unless renewed: a run that dies leaves it to
/// expire. Renewed before every migration, each of which takes far less.
const LEASE_TTL_SECS: i32 = 300;

/// Creates the keyspace if needed and applies pending migrations in order,
/// waiting for schema agreement after every DDL statement so the next one
/// (or the first prepared statement) sees it on every node. One run at a
/// time: a run waits up to `LEASE_WAIT` for another's lease.
pub async fn run(
    session: &Session,
    keyspace: &str,
    replication: &Replication,
    buckets: Option<Layout>,
) -> anyhow::Result<Report> {
    run_waiting(session, keyspace, replication, buckets, LEASE_WAIT).await
}

/// `run`, waiting at most `lease_wait` for another run to finish.
pub async fn run_waiting(
    session: &Session,
    keyspace: &str,
    replication: &Replication,
    buckets: Option<Layout>,
    lease_wait: Duration,
) -> anyhow::Result<Report> {
    check_keyspace_name(keyspace).map_err(anyhow::Error::msg)?;
    ddl(
        session,
        &format!("CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = {replication}"),
    )
    .await?;
    session
        .use_keyspace(keyspace, false)
        .await
        .context("Failed to use the keyspace")?;
    ddl(
        session,
        "CREATE TABLE IF NOT EXISTS schema_lease (name text PRIMARY KEY, owner uuid, since timestamp)",
    )
    .await?;
    let lease = Lease::take(session, keyspace, lease_wait).await?;
    let report = apply_pending(session, keyspace, buckets, &lease).await;
    lease.give_back(session, keyspace).await;
    report
}

/// The right to migrate a keyspace, held by one run at a time. Two runs at
/// once could both apply a migration neither had recorded: 0005 drops
/// `target_stats`, and a second run's drop could land after the first had
/// recreated it and the services had started counting into it.
struct Lease {
    owner: uuid::Uuid,
}

impl Lease {
    async fn take(session: &Session, keyspace: &str, wait: Duration) -> anyhow::Result<Lease> {
        let owner = uuid::Uuid::new_v4();
        let mut take = lease_statement(
            keyspace,
            "INSERT INTO schema_lease (name, owner, since) VALUES ('migrate', ?, toTimestamp(now())) \
             IF NOT EXISTS USING TTL ?",
        );
        take.set_request_timeout(Some(DDL_TIMEOUT));
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let (applied, holder) = conditional(session, &take, (owner, LEASE_TTL_SECS)).await?;
            if applied {
                return Ok(Lease { owner });
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "another tally migrate holds the keyspace's lease ({}); it expires {LEASE_TTL_SECS} s \
                     after that run last renewed it",
                    holder.map_or("unknown".to_owned(), |h| h.to_string())
                );
            }
            tracing::info!(holder = ?holder, "another tally migrate is running; waiting for it");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Extends the lease, and fails if it was lost (it expired, and another
    /// run took it): nothing more may be applied then.
    async fn renew(&self, session: &Session, keyspace: &str) -> anyhow::Result<()> {
        let renew = lease_statement(
            keyspace,
            "UPDATE schema_lease USING TTL ? SET owner = ?, since = toTimestamp(now()) \
             WHERE name = 'migrate' IF owner = ?",
        );
        let (applied, holder) =
            conditional(session, &renew, (LEASE_TTL_SECS, self.owner, self.owner)).await?;
        if !applied {
            bail!(
                "this run's lease on the keyspace expired and is held by {}; run tally migrate again",
                holder.map_or("nobody".to_owned(), |h| h.to_string())
            );
        }
        Ok(())
    }

    /// Gives the lease back; if that fails, it expires on its own.
    async fn give_back(self, session: &Session, keyspace: &str) {
        let release = lease_statement(
            keyspace,
            "DELETE FROM schema_lease WHERE name = 'migrate' IF owner = ?",
        );
        if let Err(e) = conditional(session, &release, (self.owner,)).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "the migration lease was not given back; it expires on its own"
            );
        }
    }
}

/// A lightweight transaction on the lease, linearizable across every
/// datacenter: runs may start in any of them.
fn lease_statement(keyspace: &str, cql: &str) -> scylla::statement::unprepared::Statement {
    let mut statement =
        scylla::statement::unprepared::Statement::new(super::qualify(keyspace, cql));
    statement.set_consistency(scylla::statement::Consistency::Quorum);
    statement.set_serial_consistency(Some(scylla::statement::SerialConsistency::Serial));
    statement
}

/// Runs a conditional statement on the lease: whether it applied, and the
/// owner it found if it did not.
async fn conditional(
    session: &Session,
    statement: &scylla::statement::unprepared::Statement,
    values: impl scylla::serialize::row::SerializeRow,
) -> anyhow::Result<(bool, Option<uuid::Uuid>)> {
    let rows = session
        .query_unpaged(statement.clone(), values)
        .await
        .context("Failed to reach the migration lease")?
        .into_rows_result()
        .context("the migration lease answered no rows")?;
    let specs = rows.column_specs();
    let owner_at = specs.iter().position(|c| c.name() == "owner");
    let row: scylla::value::Row = rows
        .first_row()
        .context("the migration lease answered no row")?;
    let applied = matches!(
        row.columns.first(),
        Some(Some(scylla::value::CqlValue::Boolean(true)))
    );
    let holder = owner_at
        .and_then(|i| row.columns.get(i).cloned().flatten())
        .and_then(|v| v.as_uuid());
    Ok((applied, holder))
}

/// Applies what is not yet recorded, under the lease.
async fn apply_pending(
    session: &Session,
    keyspace: &str,
    buckets: Option<Layout>,
    lease: &Lease,
) -> anyhow::Result<Report> {
    ddl(
        session,
        "CREATE TABLE IF NOT EXISTS schema_migrations (id text PRIMARY KEY, checksum text, applied_at timestamp)",
    )
    .await?;

    let recorded: Vec<(String, String)> = session
        .query_iter("SELECT id, checksum FROM schema_migrations", ())
        .await
        .context("Failed to read schema_migrations")?
        .rows_stream::<(String, String)>()
        .context("schema_migrations has unexpected columns")?
        .try_collect()
        .await
        .context("Failed to read schema_migrations")?;

    let mut report = Report::default();
    for m in MIGRATIONS {
        match recorded.iter().find(|(id, _)| id == m.id) {
            Some((_, sum)) if *sum == checksum(m.cql) => report.already.push(m.id),
            Some(_) => bail!(
                "migration {} was changed after it was applied; add a new migration instead",
                m.id
            ),
            None => {
                lease.renew(session, keyspace).await?;
                for stmt in statements(m.cql) {
                    if let Some((table, columns)) = added_columns(&stmt)
                        && has_columns(session, keyspace, table, &columns).await?
                    {
                        // An earlier run applied it and stopped before it
                        // recorded the migration: added again, it would fail.
                        tracing::info!(migration = m.id, statement = %stmt, "already applied");
                        continue;
                    }
                    ddl(session, &stmt)
                        .await
                        .with_context(|| format!("migration {} failed", m.id))?;
                }
                // Qualified: a statement with values is prepared by the driver.
                session
                    .query_unpaged(
                        super::qualify(keyspace, "INSERT INTO schema_migrations (id, checksum, applied_at) VALUES (?, ?, toTimestamp(now()))"),
                        (m.id, checksum(m.cql)),
                    )
                    .await
                    .with_context(|| format!("Failed to record migration {}", m.id))?;
                tracing::info!(migration = m.id, "applied");
                report.applied.push(m.id);
            }
        }
    }
    report.layout = Some(fix_layout(session, keyspace, buckets).await?);
    Ok(report)
}

/// The bucket count a new keyspace gets unless `tally migrate` is told
/// otherwise: 10 million voters on one target make partitions of about
/// 625,000 rows (see docs/operations.md, "Sizing the buckets").
pub const DEFAULT_BUCKETS: u32 = 16;

/// Writes the bucket count once, the first time the keyspace is migrated,
/// and refuses a different one later: changing it would move users between
/// buckets, and their applied rows with them.
async fn fix_layout(
    session: &Session,
    keyspace: &str,
    wanted: Option<Layout>,
) -> anyhow::Result<Layout> {
    let first = wanted.map_or(i64::from(DEFAULT_BUCKETS), |l| i64::from(l.count()));
    let mut insert = scylla::statement::unprepared::Statement::new(super::qualify(
        keyspace,
        "INSERT INTO settings (name, value) VALUES ('stats_buckets', ?) IF NOT EXISTS",
    ));
    insert.set_consistency(scylla::statement::Consistency::Quorum);
    session
        .query_unpaged(insert, (first,))
        .await
        .context("Failed to record the bucket count")?;
    let fixed = super::read_layout(session).await?;
    if let Some(w) = wanted.filter(|w| *w != fixed) {
        bail!(
            "the keyspace was created with {} buckets per target, and the count cannot change (asked for {})",
            fixed.count(),
            w.count()
        );
    }
    Ok(fixed)
}

/// The table and the columns an `ALTER TABLE t ADD ...` adds; `None` for
/// any other statement. The one statement of a migration that cannot be
/// run twice: every other one says `IF [NOT] EXISTS`.
fn added_columns(stmt: &str) -> Option<(&str, Vec<&str>)> {
    let rest = stmt.trim().strip_prefix("ALTER TABLE ")?;
    let (table, added) = rest.split_once(" ADD ")?;
    let added = added.trim();
    let added = added
        .strip_prefix('(')
        .and_then(|a| a.strip_suffix(')'))
        .unwrap_or(added);
    let columns: Vec<&str> = added
        .split(',')
        .filter_map(|c| c.split_whitespace().next())
        .collect();
    (!columns.is_empty()).then_some((table.trim(), columns))
}

/// Whether `table` has every one of `columns`.
async fn has_columns(
    session: &Session,
    keyspace: &str,
    table: &str,
    columns: &[&str],
) -> anyhow::Result<bool> {
    let present: Vec<(String,)> = session
        .query_unpaged(
            "SELECT column_name FROM system_schema.columns WHERE keyspace_name = ? AND table_name = ?",
            (keyspace, table),
        )
        .await
        .with_context(|| format!("Failed to read the columns of {table}"))?
        .into_rows_result()
        .context("system_schema.columns answered no rows")?
        .rows::<(String,)>()
        .context("system_schema.columns has unexpected columns")?
        .collect::<Result<_, _>>()
        .context("system_schema.columns has unexpected columns")?;
    Ok(columns.iter().all(|c| present.iter().any(|(p,)| p == c)))
}

/// Schema changes wait for every node; they get far longer than queries.
const DDL_TIMEOUT: Duration = Duration::from_secs(60);

async fn ddl(session: &Session, stmt: &str) -> anyhow::Result<()> {
    let mut statement = scylla::statement::unprepared::Statement::new(stmt);
    statement.set_request_timeout(Some(DDL_TIMEOUT));
    session
        .query_unpaged(statement, ())
        .await
        .with_context(|| format!("Failed to run {stmt}"))?;
    session
        .await_schema_agreement()
        .await
        .context("Schema agreement was not reached")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replication_parses_both_strategies() {
        assert_eq!("simple:1".parse(), Ok(Replication::Simple(1)));
        assert_eq!(
            "dc1:3,dc2:2".parse(),
            Ok(Replication::NetworkTopology(vec![
                ("dc1".into(), 3),
                ("dc2".into(), 2)
            ]))
        );
        assert_eq!(
            Replication::NetworkTopology(vec![("dc1".into(), 3)]).to_string(),
            "{'class': 'NetworkTopologyStrategy', 'dc1': 3}"
        );
        for bad in ["", "simple:0", "simple:x", "dc1", "dc 1:3", "dc1:3,"] {
            assert!(bad.parse::<Replication>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keyspace_names_are_plain_identifiers() {
        assert!(check_keyspace_name("tally").is_ok());
        assert!(check_keyspace_name("t_0a1b").is_ok());
        for bad in [
            "",
            "Tally",
            "1x",
            "a-b",
            "x; DROP KEYSPACE y",
            &"k".repeat(49),
        ] {
            assert!(check_keyspace_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_columns_an_alter_adds_are_read_from_either_form() {
        assert_eq!(
            added_columns("ALTER TABLE reactions ADD (transition text, intent_bucket bigint)"),
            Some(("reactions", vec!["transition", "intent_bucket"]))
        );
        assert_eq!(
            added_columns("\nALTER TABLE target_stats ADD loves bigint static"),
            Some(("target_stats", vec!["loves"]))
        );
        for other in [
            "CREATE TABLE IF NOT EXISTS a (x int PRIMARY KEY)",
            "DROP TABLE IF EXISTS target_stats",
            "ALTER TABLE a WITH comment = 'x'",
        ] {
            assert_eq!(added_columns(other), None, "{other}");
        }
    }

    #[test]
    fn statements_split_outside_strings_and_comments_only() {
        let cql = "-- a; comment\nCREATE TABLE a (x int) WITH comment = 'one; two -- three';\nCREATE TABLE b (y text) -- trailing; note\n;";
        assert_eq!(
            statements(cql),
            [
                "CREATE TABLE a (x int) WITH comment = 'one; two -- three'",
                "CREATE TABLE b (y text)"
            ]
        );
        assert_eq!(
            statements("SELECT 'it''s; fine' FROM t"),
            ["SELECT 'it''s; fine' FROM t"]
        );
    }

    #[test]
    fn every_migration_splits_into_schema_statements() {
        for m in MIGRATIONS {
            let stmts = statements(m.cql);
            assert!(!stmts.is_empty(), "{} has no statements", m.id);
            for s in stmts {
                assert!(
                    s.starts_with("CREATE ")
                        || s.starts_with("ALTER ")
                        || s.starts_with("DROP TABLE IF EXISTS "),
                    "{}: {s}",
                    m.id
                );
            }
        }
    }
}

// A `third-reaction` build adds a migration the production schema does not
// have, so this check is for the production build only.
#[cfg(all(test, not(feature = "third-reaction")))]
mod schema_file {
    use super::*;

    /// `schema/tally.cql` is for people to read; it must say what the
    /// migrations do, statement for statement.
    #[test]
    fn the_schema_file_equals_the_migrations_in_order() {
        let schema = statements(include_str!("../../schema/tally.cql"));
        let migrations: Vec<String> = MIGRATIONS.iter().flat_map(|m| statements(m.cql)).collect();
        assert_eq!(
            schema, migrations,
            "regenerate schema/tally.cql from migrations/"
        );
    }
}
