//! The only code that speaks CQL. Every statement is prepared once, when a
//! `Store` is built, with its consistency chosen here (`Levels`):
//! LOCAL_QUORUM for reads and writes, LOCAL_SERIAL for conditions, or with
//! `--serial-consistency serial`, QUORUM and SERIAL across every DC.

pub mod migrate;
pub mod outbox;
pub mod reactions;
pub mod stats;
pub mod targets;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use scylla::client::execution_profile::ExecutionProfile;
use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;
use scylla::errors::{DbError, ExecutionError, RequestAttemptError};
use scylla::policies::load_balancing::DefaultPolicy;
use scylla::statement::{Consistency, SerialConsistency};

use crate::domain::{Layout, UserId};
use crate::secret::Secret;

/// `--cassandra-timeout-ms` unless given.
pub const REQUEST_TIMEOUT_MS: u64 = 5000;

/// Where Cassandra is and how to talk to it.
#[derive(clap::Args, Debug, Clone)]
pub struct CassandraConfig {
    /// Cassandra contact points, host:port, comma separated.
    #[arg(
        long = "cassandra-nodes",
        env = "TALLY_CASSANDRA_NODES",
        value_delimiter = ',',
        default_value = "127.0.0.1:9042"
    )]
    pub nodes: Vec<String>,

    /// Keyspace holding tally's tables.
    #[arg(long, env = "TALLY_KEYSPACE", default_value = "tally", value_parser = parse_keyspace)]
    pub keyspace: String,

    /// Prefer coordinators in this datacenter (LOCAL_* consistency is relative to it).
    #[arg(long = "cassandra-local-dc", env = "TALLY_CASSANDRA_LOCAL_DC")]
    pub local_dc: Option<String>,

    /// Client-side timeout for one CQL request, in milliseconds.
    #[arg(
        long = "cassandra-timeout-ms",
        env = "TALLY_CASSANDRA_TIMEOUT_MS",
        default_value_t = REQUEST_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000)
    )]
    pub request_timeout_ms: u64,

    /// Where a vote's lightweight transaction is linearizable: `local-serial`
    /// within the local datacenter (users homed to one region), or `serial`
    /// across every datacenter, at cross-region latency.
    #[arg(
        long = "serial-consistency",
        env = "TALLY_SERIAL_CONSISTENCY",
        value_enum,
        default_value_t = SerialScope::LocalSerial
    )]
    pub serial: SerialScope,

    /// Role to log in as (Cassandra's PasswordAuthenticator).
    #[arg(
        long = "cassandra-user",
        id = "cassandra_user",
        value_name = "USER",
        env = "TALLY_CASSANDRA_USER",
        requires = "cassandra_password"
    )]
    pub user: Option<String>,

    /// That role's password.
    #[arg(
        long = "cassandra-password",
        id = "cassandra_password",
        value_name = "PASSWORD",
        env = "TALLY_CASSANDRA_PASSWORD",
        hide_env_values = true,
        requires = "cassandra_user"
    )]
    pub password: Option<Secret>,

    /// Speak TLS to Cassandra, trusting the certificate authorities in this
    /// PEM file; each node's certificate must name its address.
    #[arg(
        long = "cassandra-tls-ca",
        id = "cassandra_tls_ca",
        value_name = "FILE",
        env = "TALLY_CASSANDRA_TLS_CA"
    )]
    pub tls_ca: Option<PathBuf>,
}

/// The two ways tally can run Paxos; see `--serial-consistency`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SerialScope {
    #[default]
    LocalSerial,
    Serial,
}

/// The consistency levels every statement is prepared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Levels {
    /// Plain reads and writes, and the commit of a conditional write.
    pub quorum: Consistency,
    /// The Paxos phase of a conditional write.
    pub serial: SerialConsistency,
    /// A read that completes any Paxos round in flight.
    pub serial_read: Consistency,
}

impl SerialScope {
    pub fn levels(self) -> Levels {
        match self {
            SerialScope::LocalSerial => Levels {
                quorum: Consistency::LocalQuorum,
                serial: SerialConsistency::LocalSerial,
                serial_read: Consistency::LocalSerial,
            },
            // A quorum of every replica, so a plain read in any region sees
            // what a Paxos round committed in another.
            SerialScope::Serial => Levels {
                quorum: Consistency::Quorum,
                serial: SerialConsistency::Serial,
                serial_read: Consistency::Serial,
            },
        }
    }
}

fn parse_keyspace(s: &str) -> Result<String, String> {
    migrate::check_keyspace_name(s).map(|()| s.to_owned())
}

impl CassandraConfig {
    pub fn local(keyspace: &str) -> CassandraConfig {
        CassandraConfig {
            nodes: vec!["127.0.0.1:9042".into()],
            keyspace: keyspace.into(),
            local_dc: None,
            request_timeout_ms: REQUEST_TIMEOUT_MS,
            serial: SerialScope::LocalSerial,
            user: None,
            password: None,
            tls_ca: None,
        }
    }
}

/// A TLS context that trusts only the CAs in `ca` and checks the peer.
fn tls_context(ca: &Path) -> anyhow::Result<openssl::ssl::SslContext> {
    use openssl::ssl::{SslContextBuilder, SslMethod, SslVerifyMode};
    let mut builder = SslContextBuilder::new(SslMethod::tls_client())?;
    builder
        .set_ca_file(ca)
        .with_context(|| format!("Cannot read the Cassandra CA file {}", ca.display()))?;
    builder.set_verify(SslVerifyMode::PEER);
    Ok(builder.build())
}

/// Whether a failed `Store::open` met Cassandra not (yet) able to serve, as
/// while it restarts: no node took a connection, a connection broke, a
/// request timed out, or the node answered that it is shutting down,
/// starting or short of replicas. Anything else (a keyspace that does not
/// exist, a refused login) is a setting to fix.
fn not_ready(e: &anyhow::Error) -> bool {
    use scylla::errors::{
        ConnectionError, ConnectionPoolError, ExecutionError, MetadataError, NewSessionError,
        PrepareError, UseKeyspaceError,
    };
    e.chain().any(|cause| {
        if let Some(e) = cause.downcast_ref::<NewSessionError>() {
            return matches!(
                e,
                NewSessionError::MetadataError(MetadataError::ConnectionPoolError(
                    ConnectionPoolError::Broken {
                        last_connection_error: ConnectionError::ConnectTimeout
                            | ConnectionError::IoError(_)
                            | ConnectionError::BrokenConnection(_),
                    }
                ))
            );
        }
        if let Some(e) = cause.downcast_ref::<UseKeyspaceError>() {
            return use_keyspace_not_ready(e);
        }
        if let Some(e) = cause.downcast_ref::<PrepareError>() {
            return prepare_not_ready(e);
        }
        if let Some(e) = cause.downcast_ref::<ExecutionError>() {
            return match e {
                ExecutionError::ConnectionPoolError(_) | ExecutionError::RequestTimeout(_) => true,
                ExecutionError::LastAttemptError(attempt) => attempt_not_ready(attempt),
                ExecutionError::PrepareError(e) => prepare_not_ready(e),
                ExecutionError::UseKeyspaceError(e) => use_keyspace_not_ready(e),
                _ => false,
            };
        }
        false
    })
}

fn use_keyspace_not_ready(e: &scylla::errors::UseKeyspaceError) -> bool {
    use scylla::errors::UseKeyspaceError;
    match e {
        UseKeyspaceError::RequestError(attempt) => attempt_not_ready(attempt),
        UseKeyspaceError::RequestTimeout(_) => true,
        _ => false,
    }
}

fn prepare_not_ready(e: &scylla::errors::PrepareError) -> bool {
    use scylla::errors::PrepareError;
    match e {
        PrepareError::ConnectionPoolError(_) => true,
        PrepareError::AllAttemptsFailed { first_attempt } => attempt_not_ready(first_attempt),
        _ => false,
    }
}

fn attempt_not_ready(e: &scylla::errors::RequestAttemptError) -> bool {
    use scylla::errors::{DbError, RequestAttemptError};
    match e {
        RequestAttemptError::BrokenConnectionError(_)
        | RequestAttemptError::UnableToAllocStreamId => true,
        RequestAttemptError::DbError(db, _) => matches!(
            db,
            DbError::Overloaded
                | DbError::IsBootstrapping
                | DbError::Unavailable { .. }
                | DbError::ReadTimeout { .. }
                | DbError::WriteTimeout { .. }
        ),
        _ => false,
    }
}

/// Opens a session (no keyspace selected). Statements that need other levels
/// set them on the prepared statement itself.
pub async fn connect(config: &CassandraConfig) -> anyhow::Result<Session> {
    let mut policy = DefaultPolicy::builder().token_aware(true);
    if let Some(dc) = &config.local_dc {
        policy = policy
            .prefer_datacenter(dc.clone())
            .permit_dc_failover(false);
    }
    let levels = config.serial.levels();
    let profile = ExecutionProfile::builder()
        .consistency(levels.quorum)
        .serial_consistency(Some(levels.serial))
        .request_timeout(Some(Duration::from_millis(config.request_timeout_ms)))
        .load_balancing_policy(policy.build())
        .build();
    let mut builder = SessionBuilder::new()
        .known_nodes(&config.nodes)
        .default_execution_profile_handle(profile.into_handle());
    if let (Some(user), Some(password)) = (&config.user, &config.password) {
        builder = builder.user(user, password.expose());
    }
    if let Some(ca) = &config.tls_ca {
        builder = builder.tls_context(Some(tls_context(ca)?));
    }
    let session = builder.build().await.with_context(|| {
        format!(
            "Failed to connect to Cassandra at {}{}",
            config.nodes.join(","),
            match (&config.user, &config.tls_ca) {
                (Some(user), Some(_)) => format!(" over TLS as {user}"),
                (Some(user), None) => format!(" as {user}"),
                (None, Some(_)) => " over TLS".into(),
                (None, None) => String::new(),
            }
        )
    })?;
    let datacenters: Vec<String> = session
        .get_cluster_state()
        .get_nodes_info()
        .iter()
        .filter_map(|n| n.datacenter.clone())
        .collect();
    check_local_dc(&datacenters, config.local_dc.as_deref())?;
    Ok(session)
}

/// LOCAL_QUORUM and LOCAL_SERIAL are relative to the coordinator's
/// datacenter. With more than one, "local" must be named, or it means
/// whichever coordinator the driver happened to pick, and two requests of
/// one user could run Paxos in two regions.
pub fn check_local_dc(datacenters: &[String], local_dc: Option<&str>) -> anyhow::Result<()> {
    let mut known: Vec<&str> = datacenters.iter().map(String::as_str).collect();
    known.sort_unstable();
    known.dedup();
    match local_dc {
        None if known.len() > 1 => anyhow::bail!(
            "the cluster spans datacenters {}: name this region's with --cassandra-local-dc",
            known.join(", ")
        ),
        Some(dc) if !known.is_empty() && !known.contains(&dc) => anyhow::bail!(
            "--cassandra-local-dc {dc} names no datacenter of the cluster (it has {})",
            known.join(", ")
        ),
        _ => Ok(()),
    }
}

/// Opens a session on the configured keyspace.
pub async fn connect_keyspace(config: &CassandraConfig) -> anyhow::Result<Session> {
    let session = connect(config).await?;
    session
        .use_keyspace(&config.keyspace, false)
        .await
        .with_context(|| {
            format!(
                "Keyspace {} is not usable; has `tally migrate` run?",
                config.keyspace
            )
        })?;
    Ok(session)
}

/// The bucket count the keyspace was created with (see `domain::bucket`).
pub async fn read_layout(session: &Session) -> anyhow::Result<Layout> {
    let mut read = scylla::statement::unprepared::Statement::new(
        "SELECT value FROM settings WHERE name = 'stats_buckets'",
    );
    read.set_consistency(scylla::statement::Consistency::Quorum);
    let value = session
        .query_unpaged(read, ())
        .await
        .context("Failed to read the bucket count; has `tally migrate` run?")?
        .into_rows_result()
        .context("Failed to read the bucket count")?
        .maybe_first_row::<(Option<i64>,)>()
        .context("Failed to read the bucket count")?
        .and_then(|(v,)| v)
        .context("The keyspace has no bucket count; run `tally migrate`")?;
    Ok(Layout::new(value)?)
}

/// The Murmur3 token Cassandra gives a partition keyed by this user id: it
/// decides the user's bucket, and the order of a bucket's applied rows.
pub fn token_of(user: &UserId) -> i64 {
    use scylla::routing::partitioner::{Murmur3Partitioner, Partitioner};
    Murmur3Partitioner
        .hash_one(user.as_str().as_bytes())
        .value()
}

/// Why a read or a plain write failed. A conditional write answers `Cas`
/// instead, because its failure may still have applied.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("Cassandra request failed")]
    Request(#[source] anyhow::Error),
    #[error("a stored row is corrupt: {0}")]
    Corrupt(String),
}

/// Wraps any driver error.
pub(crate) fn request_failed<E: Into<anyhow::Error>>(e: E) -> StoreError {
    StoreError::Request(e.into())
}

/// The result of a conditional write.
#[derive(Debug)]
pub enum Cas {
    Applied,
    /// A condition failed: another request changed the row or used the key.
    NotApplied,
    /// The request may or may not have been applied (a CAS timeout, a lost
    /// connection). Only a SERIAL read can tell.
    Unknown(anyhow::Error),
    /// It certainly did not run (no replica could take it).
    Failed(anyhow::Error),
}

/// Sorts the result of a conditional write into applied, not applied, failed
/// before it ran, or unknown. Anything not known to have failed before
/// reaching Paxos is unknown: guessing "not applied" could lose a vote, and
/// guessing "applied" could publish a transition that never happened.
pub(crate) fn classify(
    result: Result<scylla::response::query_result::QueryResult, ExecutionError>,
) -> Cas {
    match result {
        Ok(r) => match was_applied(r) {
            Ok(true) => Cas::Applied,
            Ok(false) => Cas::NotApplied,
            Err(e) => Cas::Unknown(e),
        },
        Err(e) => {
            let certainly_not_run = match &e {
                ExecutionError::EmptyPlan
                | ExecutionError::ConnectionPoolError(_)
                | ExecutionError::BadQuery(_) => true,
                ExecutionError::PrepareError(_) => true,
                ExecutionError::LastAttemptError(RequestAttemptError::DbError(db, _)) => matches!(
                    db,
                    DbError::Unavailable { .. }
                        | DbError::Overloaded
                        | DbError::IsBootstrapping
                        | DbError::Invalid
                        | DbError::SyntaxError
                        | DbError::Unprepared { .. }
                ),
                ExecutionError::LastAttemptError(RequestAttemptError::SerializationError(_)) => {
                    true
                }
                ExecutionError::LastAttemptError(RequestAttemptError::CqlRequestSerialization(
                    _,
                )) => true,
                ExecutionError::LastAttemptError(RequestAttemptError::UnableToAllocStreamId) => {
                    true
                }
                _ => false,
            };
            if certainly_not_run {
                Cas::Failed(e.into())
            } else {
                Cas::Unknown(e.into())
            }
        }
    }
}

/// Prepares `cql` with its table named in full (`keyspace.table`, the
/// session's keyspace): a statement that leaned on the connection's `USE`
/// would be ambiguous, and Cassandra 5 warns about each one.
pub(crate) async fn prepare(
    session: &Session,
    cql: impl AsRef<str>,
) -> Result<scylla::statement::prepared::PreparedStatement, scylla::errors::PrepareError> {
    let cql = match session.get_keyspace() {
        Some(keyspace) => qualify(&keyspace, cql.as_ref()),
        None => cql.as_ref().to_owned(),
    };
    session.prepare(cql).await
}

/// `cql` with the table after FROM, INTO or UPDATE named in `keyspace`,
/// unless it names a keyspace already.
fn qualify(keyspace: &str, cql: &str) -> String {
    let mut out = String::with_capacity(cql.len() + keyspace.len() + 1);
    let mut table_next = false;
    for word in cql.split_inclusive(char::is_whitespace) {
        if table_next && !word.trim().is_empty() {
            if !word.contains('.') && word.starts_with(|c: char| c.is_ascii_alphabetic()) {
                out.push_str(keyspace);
                out.push('.');
            }
            table_next = false;
        }
        out.push_str(word);
        let keyword = word.trim_end().to_ascii_uppercase();
        if ["FROM", "INTO", "UPDATE"].contains(&keyword.as_str()) {
            table_next = true;
        }
    }
    out
}

/// Runs a prepared statement and reads its first row, if any.
pub(crate) async fn first_row<T, V>(
    session: &Session,
    stmt: &scylla::statement::prepared::PreparedStatement,
    values: V,
) -> Result<Option<T>, StoreError>
where
    T: for<'f> scylla::deserialize::row::DeserializeRow<'f, 'f>,
    V: scylla::serialize::row::SerializeRow,
{
    let result = session
        .execute_unpaged(stmt, values)
        .await
        .map_err(request_failed)?;
    result
        .into_rows_result()
        .map_err(request_failed)?
        .maybe_first_row::<T>()
        .map_err(request_failed)
}

/// Runs a prepared statement whose rows its own values bound (an IN over at
/// most a page's ids, say) and reads them all from one unpaged result: no
/// pager task, no channel, one round trip, on the hot paths.
pub(crate) async fn bounded_rows<T, V>(
    session: &Session,
    stmt: &scylla::statement::prepared::PreparedStatement,
    values: V,
) -> Result<Vec<T>, StoreError>
where
    T: for<'f, 'm> scylla::deserialize::row::DeserializeRow<'f, 'm>,
    V: scylla::serialize::row::SerializeRow,
{
    let result = session
        .execute_unpaged(stmt, values)
        .await
        .map_err(request_failed)?
        .into_rows_result()
        .map_err(request_failed)?;
    result
        .rows::<T>()
        .map_err(request_failed)?
        .collect::<Result<_, _>>()
        .map_err(request_failed)
}

/// Runs a prepared statement and reads every row, page by page (never one
/// unpaged result of unknown size).
pub(crate) async fn all_rows<T, V>(
    session: &Session,
    stmt: &scylla::statement::prepared::PreparedStatement,
    values: V,
) -> Result<Vec<T>, StoreError>
where
    T: for<'f, 'm> scylla::deserialize::row::DeserializeRow<'f, 'm> + 'static,
    V: scylla::serialize::row::SerializeRow,
{
    use futures::TryStreamExt;
    session
        .execute_iter(stmt.clone(), values)
        .await
        .map_err(request_failed)?
        .rows_stream::<T>()
        .map_err(request_failed)?
        .try_collect()
        .await
        .map_err(request_failed)
}

/// Reads `[applied]` from the result of a conditional statement or batch.
/// Cassandra returns only `[applied]` when the condition held, but the
/// current values of the conditioned rows (a varying set of columns) when it
/// did not, so the row is read untyped and only its first column is used.
pub fn was_applied(result: scylla::response::query_result::QueryResult) -> anyhow::Result<bool> {
    let rows = result
        .into_rows_result()
        .context("A conditional statement returned no rows")?;
    match rows.column_specs().get_by_index(0) {
        Some(spec) if spec.name() == "[applied]" => {}
        _ => anyhow::bail!("A conditional statement returned no [applied] column"),
    }
    let first = rows
        .maybe_first_row::<scylla::value::Row>()
        .context("Failed to read [applied]")?
        .and_then(|row| row.columns.into_iter().next().flatten())
        .and_then(|v| v.as_boolean());
    first.context("[applied] was not a boolean")
}

impl Store {
    /// Whether a read at QUORUM of the keyspace's own data is answered: one
    /// node answering alone is not enough.
    pub async fn answers_at_quorum(&self) -> bool {
        read_layout(&self.session).await.is_ok()
    }

    /// A cheap round trip to Cassandra, for readiness.
    pub async fn ping(&self) -> anyhow::Result<()> {
        self.session
            .execute_unpaged(&self.ping, ())
            .await
            .context("Cassandra did not answer")?;
        Ok(())
    }
}

/// Every prepared statement tally uses, over one session.
pub struct Store {
    pub reactions: reactions::Reactions,
    pub stats: stats::Stats,
    pub targets: targets::Targets,
    pub outbox: outbox::Outbox,
    /// The keyspace's bucket count.
    pub layout: Layout,
    session: Arc<Session>,
    ping: scylla::statement::prepared::PreparedStatement,
}

/// How long `tally vote` and `tally consumer` wait at startup for a
/// Cassandra that does not answer at all: a process started while Cassandra
/// restarts (by a supervisor during an outage, or a deploy beside a rolling
/// restart) comes up once it is back, as it rides out Redis and Kafka, rather
/// than exiting and leaving its work (the outbox relay, the partitions it
/// would own) undone.
pub const STARTUP_WAIT: Duration = Duration::from_secs(120);

impl Store {
    /// `open`, trying again every second for up to `STARTUP_WAIT` while
    /// Cassandra cannot serve yet (`not_ready`: no node accepts a connection,
    /// or one is shutting down or starting). Anything else (a keyspace `tally
    /// migrate` has not made, a refused login, a datacenter the cluster lacks)
    /// is a setting to fix and fails at once.
    pub async fn open_waiting(
        config: &CassandraConfig,
        key_ttl: Duration,
    ) -> anyhow::Result<Store> {
        let deadline = std::time::Instant::now() + STARTUP_WAIT;
        loop {
            match Store::open(config, key_ttl).await {
                Err(e) if not_ready(&e) && std::time::Instant::now() < deadline => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "Cassandra does not answer yet; trying again"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                opened => return opened,
            }
        }
    }

    /// Connects to the keyspace and prepares every statement once.
    /// `key_ttl` is how long idempotency keys are kept.
    pub async fn open(config: &CassandraConfig, key_ttl: Duration) -> anyhow::Result<Store> {
        let session = Arc::new(connect_keyspace(config).await?);
        let ttl = i32::try_from(key_ttl.as_secs()).unwrap_or(i32::MAX).max(1);
        let levels = config.serial.levels();
        let layout = read_layout(&session).await?;
        Ok(Store {
            layout,
            reactions: reactions::Reactions::prepare(session.clone(), ttl, levels).await?,
            stats: stats::Stats::prepare(session.clone(), levels, layout).await?,
            targets: targets::Targets::prepare(session.clone(), levels).await?,
            outbox: outbox::Outbox::prepare(session.clone(), ttl, levels).await?,
            ping: session
                .prepare("SELECT release_version FROM system.local")
                .await
                .context("prepare ping")?,
            session,
        })
    }

    /// The same statements over a session of its own, connected from the
    /// calling thread's runtime, so that the session's connections are
    /// driven there: an HTTP worker's requests to Cassandra then never wait
    /// for another thread to wake. Nothing is prepared again (a statement is
    /// the cluster's, not a session's), and the registry's memory is shared.
    pub async fn on_own_session(&self, config: &CassandraConfig) -> anyhow::Result<Store> {
        let session = Arc::new(connect_keyspace(config).await?);
        Ok(Store {
            layout: self.layout,
            reactions: self.reactions.on(session.clone()),
            stats: self.stats.on(session.clone()),
            targets: self.targets.on(session.clone()),
            outbox: self.outbox.on(session.clone()),
            ping: self.ping.clone(),
            session,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{check_local_dc, not_ready};
    use scylla::errors::{DbError, RequestAttemptError, UseKeyspaceError};

    fn use_keyspace_failed(db: DbError, message: &str) -> anyhow::Error {
        anyhow::Error::new(UseKeyspaceError::RequestError(
            RequestAttemptError::DbError(db, message.into()),
        ))
        .context("Keyspace k is not usable; has `tally migrate` run?")
    }

    #[test]
    fn a_node_shutting_down_or_starting_is_waited_for() {
        // What Cassandra 5 answers `USE` with while it shuts down.
        let e = use_keyspace_failed(DbError::Overloaded, "Server is shutting down");
        assert!(not_ready(&e), "{e:#}");
        assert!(not_ready(&use_keyspace_failed(
            DbError::IsBootstrapping,
            ""
        )));
    }

    #[test]
    fn a_missing_keyspace_or_a_refused_request_is_a_setting_to_fix() {
        let missing = use_keyspace_failed(DbError::Invalid, "Keyspace 'k' does not exist");
        assert!(!not_ready(&missing), "{missing:#}");
        assert!(!not_ready(&use_keyspace_failed(DbError::Unauthorized, "")));
        assert!(!not_ready(&anyhow::anyhow!(
            "the keyspace has no bucket count"
        )));
    }

    fn dcs(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn one_datacenter_needs_no_name() {
        assert!(check_local_dc(&dcs(&["dc1", "dc1", "dc1"]), None).is_ok());
        assert!(check_local_dc(&dcs(&["dc1"]), Some("dc1")).is_ok());
    }

    #[test]
    fn several_datacenters_refuse_to_start_without_the_local_one() {
        let two = dcs(&["eu", "us", "eu"]);
        let refused = check_local_dc(&two, None).map_err(|e| e.to_string());
        assert_eq!(
            refused,
            Err(
                "the cluster spans datacenters eu, us: name this region's with --cassandra-local-dc"
                    .to_owned()
            )
        );
        assert!(check_local_dc(&two, Some("us")).is_ok());
    }

    #[test]
    fn a_local_datacenter_the_cluster_lacks_is_refused() {
        assert!(check_local_dc(&dcs(&["dc1"]), Some("dc2")).is_err());
    }
}

#[cfg(test)]
mod qualify_tests {
    use super::qualify;

    #[test]
    fn tables_after_from_into_and_update_get_the_keyspace() {
        assert_eq!(
            qualify("ks", "SELECT a FROM reactions WHERE user_id = ?"),
            "SELECT a FROM ks.reactions WHERE user_id = ?"
        );
        assert_eq!(
            qualify("ks", "INSERT INTO targets (a) VALUES (?) IF NOT EXISTS"),
            "INSERT INTO ks.targets (a) VALUES (?) IF NOT EXISTS"
        );
        assert_eq!(
            qualify("ks", "UPDATE target_stats SET seq = ? WHERE target_id = ?"),
            "UPDATE ks.target_stats SET seq = ? WHERE target_id = ?"
        );
        assert_eq!(
            qualify("ks", "DELETE FROM\n  settings WHERE name = ?"),
            "DELETE FROM\n  ks.settings WHERE name = ?"
        );
        assert_eq!(
            qualify("ks", "SELECT x FROM other.t"),
            "SELECT x FROM other.t"
        );
        assert_eq!(
            qualify("ks", "SELECT release_version FROM system.local"),
            "SELECT release_version FROM system.local"
        );
    }
}
