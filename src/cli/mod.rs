//! The `tally` command line: one binary, one subcommand per role.

mod reconcile;
mod status;
pub mod values;

/// A read of a service's `/metrics`, for the benches as for `tally status`.
pub use status::Metrics;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

use crate::api::{ApiConfig, Application};
use crate::auth::{self, TokenArgs};
use crate::bus::{self, KafkaConfig};
use crate::consumer::ConsumerConfig;
use crate::domain::Layout;
use crate::store::{self, CassandraConfig, migrate::Replication};
use crate::telemetry::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "tally",
    version,
    about = "Vote and likes counting: each user's reaction is the truth, every total is derived from it"
)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "TALLY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Auto, global = true)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Parses the command line, then refuses settings that contradict each
    /// other the way clap refuses one bad value: the reason on stderr and
    /// exit code 2, before anything is connected to.
    pub fn parse_checked() -> Cli {
        let cli = Cli::parse();
        if let Err(reason) = cli.command.check() {
            let mut root = Cli::command();
            root.build();
            let kind = clap::error::ErrorKind::ArgumentConflict;
            match root.find_subcommand_mut(cli.command.name()) {
                Some(sub) => sub.error(kind, reason).exit(),
                None => root.error(kind, reason).exit(),
            }
        }
        cli
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the HTTP vote API (POST /v1/votes, GET /v1/votes/summary).
    Vote(Box<ApiConfig>),
    /// Count published transitions exactly once into per-target totals.
    Consumer(Box<ConsumerConfig>),
    /// Recount totals from the per-user rows and repair drift.
    Reconcile(reconcile::ReconcileArgs),
    /// Create the keyspace, apply pending CQL migrations, create the Kafka topics.
    Migrate(MigrateArgs),
    /// Print a development token signed with the configured key.
    Token(TokenArgs),
    /// One screen of the running service: rates, latencies, lag, outbox,
    /// cache, conflicts, drift and dead letters.
    Status(status::StatusArgs),
}

impl Command {
    /// The subcommand's name on the command line.
    fn name(&self) -> &'static str {
        match self {
            Command::Vote(_) => "vote",
            Command::Consumer(_) => "consumer",
            Command::Reconcile(_) => "reconcile",
            Command::Migrate(_) => "migrate",
            Command::Token(_) => "token",
            Command::Status(_) => "status",
        }
    }

    /// The settings of this subcommand that contradict each other.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Command::Vote(config) => config.check(),
            Command::Consumer(config) => config.check(),
            Command::Reconcile(args) => args.check(),
            _ => Ok(()),
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub cassandra: CassandraConfig,
    #[command(flatten)]
    pub kafka: KafkaConfig,

    /// Keyspace replication: `simple:N` for one local node, or `DC:N[,DC:N]`
    /// (NetworkTopologyStrategy) in production, e.g. `dc1:3,dc2:3`.
    #[arg(long, env = "TALLY_REPLICATION", default_value = "simple:1")]
    pub replication: Replication,

    /// Buckets per target in `target_stats`, fixed when the keyspace is
    /// created (16 unless given); a different count later is refused. See
    /// docs/operations.md, "Sizing the buckets".
    #[arg(long = "stats-buckets", env = "TALLY_STATS_BUCKETS", value_parser = parse_buckets)]
    pub stats_buckets: Option<Layout>,

    /// Partitions of the transitions topic: the most consumers that can share the work.
    #[arg(long, env = "TALLY_PARTITIONS", default_value_t = 6, value_parser = clap::value_parser!(i32).range(1..=1024))]
    pub partitions: i32,

    /// Replication factor of the Kafka topics (3 in production).
    #[arg(long = "topic-replication", env = "TALLY_TOPIC_REPLICATION", default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=9))]
    pub topic_replication: i32,
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Migrate(args) => migrate(args).await,
        Command::Vote(config) => vote(*config).await,
        Command::Token(args) => {
            println!(
                "{}",
                auth::mint(&args.auth, &args.sub, args.ttl, args.roles)?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Consumer(config) => consumer(*config).await,
        Command::Reconcile(args) => reconcile::run(args).await,
        Command::Status(args) => status::run(args).await,
    }
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    let session = store::connect(&args.cassandra).await?;
    let report = store::migrate::run(
        &session,
        &args.cassandra.keyspace,
        &args.replication,
        args.stats_buckets,
    )
    .await?;
    match args.kafka.reach(Duration::from_secs(30)).await? {
        bus::Reach::Answered => {}
        bus::Reach::Refused(reason) => anyhow::bail!(
            "Kafka at {} refused the login or the TLS settings: {reason}",
            args.kafka.brokers
        ),
        bus::Reach::Silent => {
            anyhow::bail!("Kafka at {} did not answer within 30 s", args.kafka.brokers)
        }
    }
    let topics = bus::admin::ensure_topics(&args.kafka, args.partitions, args.topic_replication)
        .await
        .context("Failed to create the Kafka topics")?;
    println!(
        "keyspace {}: {} migration(s) applied, {} already applied, {} bucket(s) per target; topics created: {}",
        args.cassandra.keyspace,
        report.applied.len(),
        report.already.len(),
        report.layout.map_or(0, Layout::count),
        if topics.is_empty() {
            "none (all existed)".to_owned()
        } else {
            topics.join(", ")
        }
    );
    Ok(ExitCode::SUCCESS)
}

fn parse_buckets(s: &str) -> Result<Layout, String> {
    let n: i64 = s
        .parse()
        .map_err(|_| format!("expected a whole number, not {s:?}"))?;
    Layout::new(n).map_err(|e| e.to_string())
}

async fn vote(config: ApiConfig) -> anyhow::Result<ExitCode> {
    let app = Application::build(config.clone()).await?;
    let host = config
        .listen
        .rsplit_once(':')
        .map_or(config.listen.as_str(), |(h, _)| h);
    tracing::info!(
        address = format!("http://{host}:{}", app.port()),
        "tally vote listening"
    );
    app.run_until_stopped()
        .await
        .context("The HTTP server failed")?;
    Ok(ExitCode::SUCCESS)
}

async fn consumer(config: ConsumerConfig) -> anyhow::Result<ExitCode> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("stop requested; finishing the batch in hand");
        let _ = stop_tx.send(true);
    });
    crate::consumer::run(config, stop_rx, Default::default()).await?;
    Ok(ExitCode::SUCCESS)
}

/// SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_agree_with_each_other() {
        Cli::command().debug_assert();
        let names: Vec<String> = Cli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                "vote",
                "consumer",
                "reconcile",
                "migrate",
                "token",
                "status"
            ]
        );
        for args in [
            &["tally", "vote"][..],
            &["tally", "consumer"],
            &["tally", "status"],
        ] {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(cli.command.check(), Ok(()), "{args:?}");
        }
    }

    #[test]
    fn a_target_id_pattern_that_can_mean_nothing_is_refused_before_connecting() {
        let check = |pattern: &[&str]| {
            let args = [&["tally", "vote"][..], pattern].concat();
            let cli = Cli::try_parse_from(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            cli.command.check()
        };
        assert_eq!(check(&["--target-id-pattern", "video=v_[0-9]+"]), Ok(()));
        for bad in [
            &["--target-id-pattern", "video=("][..],
            &["--target-id-pattern", "movie=x"],
            &["--target-id-pattern", "no equals sign"],
            &[
                "--target-id-pattern",
                "video=a",
                "--target-id-pattern",
                "video=b",
            ],
        ] {
            let refused = check(bad);
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|e| e.contains("--target-id-pattern")),
                "{bad:?}: {refused:?}"
            );
        }
    }

    #[test]
    fn the_operator_endpoints_need_an_address_of_their_own() {
        let check = |listen: &str, ops: &str| {
            let args = ["tally", "vote", "--listen", listen, "--ops-listen", ops];
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            cli.command.check()
        };
        for (listen, ops) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "127.0.0.1:8080"),
            ("localhost:8080", "127.0.0.1:8080"),
        ] {
            let refused = check(listen, ops);
            assert!(
                refused.as_ref().is_err_and(|e| e.contains("--ops-listen")),
                "{listen} {ops}: {refused:?}"
            );
        }
        assert_eq!(check("127.0.0.1:0", "127.0.0.1:0"), Ok(()));
        assert_eq!(check("0.0.0.0:8080", "127.0.0.1:9090"), Ok(()));
    }

    /// The cache's marks and reconcile's look at recent rows cover a vote's
    /// late cache step for 40 s after its row changed, 10 s of it for
    /// clocks: timeouts that let a vote take over 30 s are refused, relay or
    /// not.
    #[test]
    fn a_vote_may_not_take_longer_than_the_marks_of_the_cache_last() {
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            cli.command.check()
        };
        let vote = |extra: &[&str]| {
            let mut args = vec!["tally", "vote", "--relay-settle", "1m"];
            args.extend_from_slice(extra);
            check(&args)
        };
        // 8 s + 2 x 10 s + 2 s in the cache: 30 s.
        assert_eq!(vote(&["--cassandra-timeout-ms", "10000"]), Ok(()));
        let refused = vote(&["--cassandra-timeout-ms", "10001"])
            .err()
            .unwrap_or_default();
        assert!(
            refused.contains("--cassandra-timeout-ms and --redis-timeout"),
            "{refused}"
        );
        // 8 s + 2 x 5 s + (2 x 6 s + 1 s) in the cache: 31 s.
        assert!(vote(&["--redis-timeout", "6s"]).is_err());
        assert_eq!(vote(&["--redis-timeout", "5500ms"]), Ok(()));
        assert!(vote(&["--no-relay", "--redis-timeout", "6s"]).is_err());
    }

    #[test]
    fn a_vote_without_a_relay_needs_no_settle_longer_than_a_vote() {
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            cli.command.check()
        };
        assert!(check(&["tally", "vote", "--relay-settle", "5s"]).is_err());
        // A vote may take its 8 s deadline, two requests of 5 s (a write
        // that times out, then the SERIAL read of its outcome) and 2 s in
        // the cache: 20 s.
        assert!(check(&["tally", "vote", "--relay-settle", "20s"]).is_err());
        assert_eq!(check(&["tally", "vote", "--relay-settle", "21s"]), Ok(()));
        assert!(
            check(&[
                "tally",
                "vote",
                "--relay-settle",
                "21s",
                "--cassandra-timeout-ms",
                "6000"
            ])
            .is_err()
        );
        assert_eq!(
            check(&["tally", "vote", "--relay-settle", "5s", "--no-relay"]),
            Ok(())
        );
        // The relay's reach grows with the settle it is given.
        assert!(check(&["tally", "vote", "--relay-horizon", "24h"]).is_err());
        assert_eq!(
            check(&[
                "tally",
                "vote",
                "--relay-horizon",
                "24h",
                "--idempotency-ttl",
                "25h"
            ]),
            Ok(())
        );
    }

    #[test]
    fn a_short_event_signing_key_is_refused_without_being_printed() {
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            cli.command.check()
        };
        for role in ["vote", "consumer"] {
            let refused = check(&["tally", role, "--event-signing-key", "short-but-secret"]);
            let reason = refused.err().unwrap_or_default();
            assert!(reason.contains("at least 32"), "{role}: {reason}");
            assert!(!reason.contains("short-but-secret"), "{role}: {reason}");
            let key = "k".repeat(32);
            assert_eq!(check(&["tally", role, "--event-signing-key", &key]), Ok(()));
        }
        // A trusting consumer checks no event, so a key would do nothing.
        let key = "k".repeat(32);
        let both = check(&[
            "tally",
            "consumer",
            "--trust-events",
            "--event-signing-key",
            &key,
        ]);
        assert!(both.is_err_and(|e| e.contains("--trust-events")));
    }

    #[test]
    fn a_publish_timeout_must_outlast_the_producers_linger() {
        let parse = |t: &str| Cli::try_parse_from(["tally", "vote", "--publish-timeout", t]);
        assert!(
            parse("10ms").is_err(),
            "librdkafka refuses a timeout within its linger"
        );
        assert!(parse("49ms").is_err());
        assert!(parse("50ms").is_ok());
        assert!(crate::bus::publisher::LINGER < crate::bus::publisher::SHORTEST_TIMEOUT);
    }
}
