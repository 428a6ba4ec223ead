//! The `tally` command line: one binary, one subcommand per role.

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::api::{ApiConfig, Application};
use crate::auth::{self, TokenArgs};
use crate::bus::{self, KafkaConfig};
use crate::cache::{Cache, RedisConfig};
use crate::consumer::ConsumerConfig;
use crate::domain::TargetId;
use crate::reconcile::{Reconciler, SweepOptions, SweepSummary};
use crate::store::{self, CassandraConfig, Store, migrate::Replication};
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

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the HTTP vote API (POST /v1/votes, GET /v1/votes/summary).
    Vote(ApiConfig),
    /// Count published transitions exactly once into per-target totals.
    Consumer(ConsumerConfig),
    /// Recount totals from the per-user rows and repair drift.
    Reconcile(ReconcileArgs),
    /// Create the keyspace, apply pending CQL migrations, create the Kafka topics.
    Migrate(MigrateArgs),
    /// Print a development token signed with the configured key.
    Token(TokenArgs),
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["targets", "all"])))]
pub struct ReconcileArgs {
    /// Reconcile this target now (repeatable).
    #[arg(long = "target", value_parser = parse_target)]
    pub targets: Vec<TargetId>,

    /// Sweep every target in token order, resuming from the checkpoint.
    #[arg(long)]
    pub all: bool,

    /// With --all: targets checked per second (0 = as fast as possible).
    #[arg(long, env = "TALLY_RECONCILE_RATE", default_value_t = 100.0)]
    pub rate: f64,

    /// Report drift, write nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Print a machine-readable summary on stdout.
    #[arg(long)]
    pub json: bool,

    /// Exit with status 3 when any drift was found (for monitoring).
    #[arg(long)]
    pub fail_on_drift: bool,

    /// With --all: the checkpoint to resume from and save to.
    #[arg(long, default_value = "all")]
    pub checkpoint: String,

    /// With --all: ignore the checkpoint and start from the beginning.
    #[arg(long)]
    pub restart: bool,

    /// With --all: a rolling schedule; start again this long after each complete sweep.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub repeat_every: Option<std::time::Duration>,

    #[command(flatten)]
    pub cassandra: CassandraConfig,
    #[command(flatten)]
    pub redis: RedisConfig,
}

fn parse_target(s: &str) -> Result<TargetId, String> {
    TargetId::parse(s).map_err(|e| e.to_string())
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
        Command::Vote(config) => vote(config).await,
        Command::Token(args) => {
            println!(
                "{}",
                auth::mint(&args.auth, &args.sub, args.ttl, args.roles)?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Consumer(config) => consumer(config).await,
        Command::Reconcile(args) => reconcile(args).await,
    }
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    let session = store::connect(&args.cassandra).await?;
    let report = store::migrate::run(&session, &args.cassandra.keyspace, &args.replication).await?;
    let topics = bus::admin::ensure_topics(&args.kafka, args.partitions, args.topic_replication)
        .await
        .context("Failed to create the Kafka topics")?;
    println!(
        "keyspace {}: {} migration(s) applied, {} already applied; topics created: {}",
        args.cassandra.keyspace,
        report.applied.len(),
        report.already.len(),
        if topics.is_empty() {
            "none (all existed)".to_owned()
        } else {
            topics.join(", ")
        }
    );
    Ok(ExitCode::SUCCESS)
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

/// Exit status of `tally reconcile --fail-on-drift` when drift was found.
const DRIFT_FOUND: u8 = 3;

async fn reconcile(args: ReconcileArgs) -> anyhow::Result<ExitCode> {
    let store =
        std::sync::Arc::new(Store::open(&args.cassandra, std::time::Duration::from_secs(1)).await?);
    let cache = Cache::new(&args.redis, std::time::Duration::from_secs(60))
        .inspect_err(|e| tracing::warn!(error = %e, "no cache; repaired targets keep stale cached totals until they expire"))
        .ok();
    let reconciler = Reconciler::new(store, cache);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });

    let summary = if args.all {
        let options = SweepOptions {
            // A dry run must not move the real sweep's resume point.
            name: if args.dry_run {
                format!("{}.dry-run", args.checkpoint)
            } else {
                args.checkpoint.clone()
            },
            rate: args.rate,
            dry_run: args.dry_run,
            restart: args.restart,
            page_size: 100,
        };
        loop {
            let summary = sweep_with_progress(&reconciler, &options, &stop_rx).await?;
            let (Some(pause), true) = (args.repeat_every, summary.complete) else {
                break summary;
            };
            tracing::info!(
                checked = summary.targets_checked,
                drifted = summary.targets_drifted,
                "sweep complete; next in {}",
                humantime::format_duration(pause)
            );
            let mut stop = stop_rx.clone();
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = stop.wait_for(|s| *s) => break summary,
            }
        }
    } else {
        let mut summary = SweepSummary {
            complete: true,
            ..SweepSummary::default()
        };
        for target in &args.targets {
            let report = reconciler.target(target, args.dry_run).await?;
            summary.targets_checked += 1;
            if report.drifted {
                summary.targets_drifted += 1;
                summary.corrections.push(report);
            }
        }
        summary
    };

    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "targets_checked": summary.targets_checked,
                "targets_drifted": summary.targets_drifted,
                "dry_run": args.dry_run,
                "complete": summary.complete,
                "resumed_from_token": summary.resumed_from,
                "corrections": summary.corrections,
            })
        );
    } else {
        for r in &summary.corrections {
            println!(
                "{}: likes {} -> {}, dislikes {} -> {}, {} user(s) behind{}",
                r.target_id,
                r.totals_before.likes,
                r.totals_after.likes,
                r.totals_before.dislikes,
                r.totals_after.dislikes,
                r.users_behind,
                if r.repaired {
                    ", repaired"
                } else {
                    ", not repaired (dry run)"
                }
            );
        }
        println!(
            "checked {} target(s), {} drifted{}",
            summary.targets_checked,
            summary.targets_drifted,
            if summary.complete {
                ""
            } else {
                " (interrupted; run again to resume)"
            }
        );
    }
    Ok(if args.fail_on_drift && summary.targets_drifted > 0 {
        ExitCode::from(DRIFT_FOUND)
    } else {
        ExitCode::SUCCESS
    })
}

/// A progress bar on a terminal, a log line every 10 s otherwise.
async fn sweep_with_progress(
    reconciler: &Reconciler,
    options: &SweepOptions,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<SweepSummary> {
    use std::io::{IsTerminal, Write};
    let tty = std::io::stderr().is_terminal();
    let mut last_log = std::time::Instant::now();
    let summary = reconciler
        .sweep(options, stop, |status| {
            let c = status.checkpoint;
            if tty {
                let filled = (status.fraction * 30.0).round() as usize;
                eprint!(
                    "\r[{}{}] {:5.1}%  {} checked, {} drifted ",
                    "#".repeat(filled.min(30)),
                    " ".repeat(30 - filled.min(30)),
                    status.fraction * 100.0,
                    c.checked,
                    c.drifted
                );
                let _ = std::io::stderr().flush();
            } else if last_log.elapsed() >= std::time::Duration::from_secs(10) {
                last_log = std::time::Instant::now();
                tracing::info!(
                    checked = c.checked,
                    drifted = c.drifted,
                    progress = format!("{:.1}%", status.fraction * 100.0),
                    "reconcile sweep"
                );
            }
        })
        .await?;
    if tty {
        eprintln!();
    }
    Ok(summary)
}
