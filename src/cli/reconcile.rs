//! `tally reconcile`: one target, or the rolling sweep with its schedule,
//! its progress on a terminal, and the report operators read.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cache::{Cache, RedisConfig};
use crate::domain::TargetId;
use crate::reconcile::{ReconcileError, Reconciler, SweepOptions, SweepSummary};
use crate::store::{CassandraConfig, SerialScope, Store};

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
    #[arg(long, env = "TALLY_RECONCILE_RATE", default_value_t = 100.0, value_parser = super::values::per_second_or_unlimited)]
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
    /// (`all` unless given)
    #[arg(long)]
    pub checkpoint: Option<String>,

    /// With --all: ignore the checkpoint and start from the beginning.
    #[arg(long)]
    pub restart: bool,

    /// With --all: a rolling schedule; start again this long after each
    /// complete sweep. Above zero: a sweep of an empty keyspace ends at once,
    /// and zero would read it again without pause.
    #[arg(long, value_parser = super::values::duration_above_zero)]
    pub repeat_every: Option<std::time::Duration>,

    /// Rows that changed less than this long ago and are not yet counted are
    /// in flight (the consumer's lag), not drift: they are counted, but they
    /// neither mark a target drifted nor trip --fail-on-drift.
    #[arg(long, env = "TALLY_RECONCILE_LAG_GRACE", value_parser = super::values::duration,
          default_value = "60s")]
    pub lag_grace: Duration,

    /// Skip a target (and report it) after losing its fence to another writer
    /// this many times; the next sweep retries it.
    #[arg(long, default_value_t = crate::reconcile::DEFAULT_MAX_FENCE_LOSSES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_fence_losses: u32,

    #[command(flatten)]
    pub cassandra: CassandraConfig,
    #[command(flatten)]
    pub redis: RedisConfig,
}

impl ReconcileArgs {
    /// Settings that would be ignored, refused before anything is connected
    /// to: an operator who asked for a schedule must not get a single run.
    pub fn check(&self) -> Result<(), String> {
        if !self.all {
            let sweep_only = [
                ("--checkpoint", self.checkpoint.is_some()),
                ("--restart", self.restart),
                ("--repeat-every", self.repeat_every.is_some()),
            ];
            if let Some((flag, _)) = sweep_only.iter().find(|(_, given)| *given) {
                return Err(format!("{flag} works only with --all"));
            }
        }
        self.redis.check()
    }

    fn checkpoint(&self) -> &str {
        self.checkpoint.as_deref().unwrap_or("all")
    }
}

fn parse_target(s: &str) -> Result<TargetId, String> {
    TargetId::parse(s).map_err(|e| e.to_string())
}

/// Longest a run waits, at its end, for Redis to take the drops of entries
/// its writes through could not reach.
const DROPS_BOUND: Duration = Duration::from_secs(10);

/// Exit status of `tally reconcile --fail-on-drift` when drift was found.
const DRIFT_FOUND: u8 = 3;
/// Exit status of `tally reconcile --target` when a named target could not
/// be checked: another writer kept moving its fence.
const NOT_CHECKED: u8 = 4;
/// Exit status when the check of a target failed while Cassandra answered
/// (a damaged row, a partition too costly to read): the others were checked.
const CHECK_FAILED: u8 = 5;

pub async fn run(args: ReconcileArgs) -> anyhow::Result<ExitCode> {
    // Reads at QUORUM of every datacenter and Paxos at SERIAL, whatever
    // `--serial-consistency` says: users are homed, but a recount is not.
    // Read in a region that has not yet received a user's row, a counted
    // vote would look like a ghost and be taken out, and a head read at
    // SERIAL beside rows read locally would repair totals from stale rows.
    // In one datacenter the levels are the same replicas.
    let cassandra = CassandraConfig {
        serial: SerialScope::Serial,
        ..args.cassandra.clone()
    };
    let store = Arc::new(Store::open(&cassandra, Duration::from_secs(1)).await?);
    // Settings no connection can be made with were refused before this
    // (`Command::check`): a reconcile that repaired the totals but not the
    // cache would leave the stale totals served until they expired.
    let cache = Some(Cache::new(&args.redis, Duration::from_secs(60))?.keeping_pending_changes());
    let drops_task = cache
        .clone()
        .map(|cache| tokio::spawn(cache.keep_dropping_owed()));
    let reconciler = Reconciler::new(store, cache.clone())
        .with_lag_grace(args.lag_grace)
        .with_max_fence_losses(args.max_fence_losses);
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        super::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let swept = if args.all {
        sweep_on_schedule(&reconciler, &args, &stop_rx).await
    } else {
        each_target(&reconciler, &args.targets, args.dry_run).await
    };
    if let (Some(task), Some(cache)) = (drops_task, &cache) {
        task.abort();
        cache.drop_owed_before_exit(DROPS_BOUND).await;
    }
    let summary = swept?;
    if args.json {
        println!("{}", json_report(&summary, args.dry_run));
    } else {
        print!("{}", text_report(&summary));
    }
    // Drift found is what `--fail-on-drift` asks about: it comes first.
    Ok(if args.fail_on_drift && summary.targets_drifted > 0 {
        ExitCode::from(DRIFT_FOUND)
    } else if summary.targets_failed > 0 {
        ExitCode::from(CHECK_FAILED)
    } else if !args.all && summary.targets_skipped > 0 {
        ExitCode::from(NOT_CHECKED)
    } else {
        ExitCode::SUCCESS
    })
}

async fn each_target(
    reconciler: &Reconciler,
    targets: &[TargetId],
    dry_run: bool,
) -> anyhow::Result<SweepSummary> {
    let mut summary = SweepSummary {
        complete: true,
        ..SweepSummary::default()
    };
    for target in targets {
        let report = match reconciler.target(target, dry_run).await {
            Ok(report) => report,
            Err(ReconcileError::Contention(id)) => {
                summary.targets_skipped += 1;
                summary.skipped.push(id);
                continue;
            }
            Err(ReconcileError::Store(e)) if reconciler.store_answers().await => {
                summary.fail(target, e);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        summary.record(report);
    }
    Ok(summary)
}

/// One sweep, or with `--repeat-every` a sweep after each pause, until a
/// stop. Returns the last sweep's summary.
async fn sweep_on_schedule(
    reconciler: &Reconciler,
    args: &ReconcileArgs,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<SweepSummary> {
    let options = SweepOptions {
        // A dry run must not move the real sweep's resume point.
        name: if args.dry_run {
            format!("{}.dry-run", args.checkpoint())
        } else {
            args.checkpoint().to_owned()
        },
        rate: args.rate,
        dry_run: args.dry_run,
        restart: args.restart,
        page_size: 100,
    };
    loop {
        let summary = sweep_with_progress(reconciler, &options, stop).await?;
        let (Some(pause), true) = (args.repeat_every, summary.complete) else {
            return Ok(summary);
        };
        tracing::info!(
            checked = summary.targets_checked,
            drifted = summary.targets_drifted,
            "sweep complete; next in {}",
            humantime::format_duration(pause)
        );
        let mut stop = stop.clone();
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return Ok(summary),
        }
    }
}

fn json_report(summary: &SweepSummary, dry_run: bool) -> serde_json::Value {
    serde_json::json!({
        "targets_checked": summary.targets_checked,
        "targets_drifted": summary.targets_drifted,
        "targets_skipped": summary.targets_skipped,
        "users_in_flight": summary.users_in_flight,
        "skipped": summary.skipped,
        "targets_failed": summary.targets_failed,
        "failed": summary.failed,
        "dry_run": dry_run,
        "complete": summary.complete,
        "resumed_from_token": summary.resumed_from,
        "corrections": summary.corrections,
    })
}

/// What an operator reads: one line per correction, then the count.
fn text_report(summary: &SweepSummary) -> String {
    let mut out = String::new();
    for r in &summary.corrections {
        let done = if r.repaired {
            "repaired"
        } else {
            "not repaired (dry run)"
        };
        out += &format!(
            "{}: {} -> {}, {} user(s) behind, {done}\n",
            r.target_id, r.totals_before, r.totals_after, r.users_behind
        );
    }
    for id in &summary.skipped {
        out += &format!("{id}: skipped, the consumer kept writing it; the next sweep retries it\n");
    }
    for f in &summary.failed {
        out += &format!("{}: not checked: {}\n", f.target_id, f.error);
    }
    let interrupted = if summary.complete {
        ""
    } else {
        " (interrupted; run again to resume)"
    };
    let in_flight = match summary.users_in_flight {
        0 => String::new(),
        n => format!(", {n} user(s) in flight counted ahead of the consumer"),
    };
    out += &format!(
        "checked {} target(s), {} drifted{in_flight}{interrupted}\n",
        summary.targets_checked, summary.targets_drifted
    );
    out
}

/// A progress bar on a terminal, a log line every 10 s otherwise.
async fn sweep_with_progress(
    reconciler: &Reconciler,
    options: &SweepOptions,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<SweepSummary> {
    let tty = std::io::stderr().is_terminal();
    let mut last_log = Instant::now();
    let summary = reconciler
        .sweep(options, stop, |status| {
            let c = status;
            if tty {
                let filled = ((status.fraction * 30.0).round() as usize).min(30);
                crate::telemetry::show_status(&format!(
                    "[{}{}] {:5.1}%  {} checked, {} drifted",
                    "#".repeat(filled),
                    " ".repeat(30 - filled),
                    status.fraction * 100.0,
                    c.checked,
                    c.drifted
                ));
            } else if last_log.elapsed() >= Duration::from_secs(10) {
                last_log = Instant::now();
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
        crate::telemetry::end_status();
    }
    Ok(summary)
}
