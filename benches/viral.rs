//! A viral target: a million voters on one video, counted by the real
//! consumer into `target_stats`, whose buckets keep every partition small.
//!
//! Three cases, each in its own keyspace and topic, in one run:
//! - uniform: one voter on each of many targets (the consumer's usual load);
//! - small: a tenth of the voters on one target;
//! - hot: all of them on one target.
//!
//! Each case writes its rows to `reactions` (plain inserts: the truth the
//! recount reads), publishes one transition per row straight to its topic,
//! and runs the real consumer until it has counted all of them. The bench
//! then reports events/s per case, the largest partition of `target_stats`
//! as Cassandra's own sstablepartitions measures it after a flush, whether
//! the totals equal the rows (from the rows' known states, and from a
//! recount by `tally reconcile`), and that reconcile's time and peak memory
//! (VmHWM, from /proc) for the small and the hot target.
//!
//!   scripts/stack.sh up && cargo bench --bench viral
//!
//! TALLY_VIRAL_VOTERS (1,000,000) and TALLY_VIRAL_UNIFORM (50,000) size it;
//! TALLY_VIRAL_KEEP=1 keeps the keyspaces and topics to look at afterwards.
//! It prints a table and writes target/tally-bench/viral.json.

#[path = "support/mod.rs"]
mod support;

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use support::{BenchEnv, bench_env, env_num};

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !support::stack_up() {
        support::skip_message("viral");
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(run());
}

#[derive(Debug, Serialize)]
struct Case {
    name: &'static str,
    voters: u64,
    targets: u64,
    consumer_seconds: f64,
    events_per_sec: f64,
    requests_per_event: f64,
    fenced_writes: u64,
    /// The target's totals after the drain, and what its rows add up to.
    totals: Option<(i64, i64)>,
    expected: Option<(i64, i64)>,
    reconcile: Option<ReconcileRun>,
    largest_partition: Option<Partition>,
}

#[derive(Debug, Serialize)]
struct ReconcileRun {
    seconds: f64,
    peak_rss_kib: u64,
    drifted: bool,
    totals_before: (i64, i64),
    recounted: (i64, i64),
}

#[derive(Debug, Serialize, Clone)]
struct Partition {
    key: String,
    rows: u64,
    bytes: u64,
}

async fn run() {
    let voters = env_num("TALLY_VIRAL_VOTERS", 1_000_000);
    let uniform = env_num("TALLY_VIRAL_UNIFORM", 50_000);
    let mut cases = Vec::new();
    for (name, n, one_target) in [
        ("uniform", uniform, false),
        ("small", voters / 10, true),
        ("hot", voters, true),
    ] {
        let env = bench_env(&format!("viral_{name}"), 6).await;
        eprintln!("viral/{name}: writing {n} rows to reactions and {n} transitions to Kafka");
        seed(&env, n, one_target).await;
        eprintln!("viral/{name}: counting");
        let mut case = count(&env, name, n, one_target).await;
        if one_target {
            let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            let t = store
                .stats
                .totals(&target())
                .await
                .unwrap_or_else(|e| panic!("{e:#}"));
            case.totals = Some((t.values()[0], t.values()[1]));
            case.expected = Some(expected(n));
            eprintln!("viral/{name}: reconcile of the target");
            case.reconcile = Some(reconcile(&env, case.totals));
        }
        case.largest_partition = largest_partition(&env).await;
        eprintln!("viral/{name}: {case:?}");
        cases.push(case);
        if std::env::var_os("TALLY_VIRAL_KEEP").is_none() {
            env.drop_all().await;
        }
    }
    report(&cases);
}

fn target() -> tally::domain::TargetId {
    tally::domain::TargetId::parse("viral").unwrap_or_else(|e| panic!("{e}"))
}

/// Voter i likes, except every fourth, who dislikes.
fn state_of(i: u64) -> &'static str {
    if i % 4 == 3 { "dislike" } else { "like" }
}

fn expected(n: u64) -> (i64, i64) {
    let dislikes = (n / 4) as i64;
    (n as i64 - dislikes, dislikes)
}

/// The rows, then one transition per row.
async fn seed(env: &BenchEnv, n: u64, one_target: bool) {
    let target_of = |i: u64| {
        if one_target {
            "viral".to_owned()
        } else {
            format!("t{i}")
        }
    };
    let session = tally::store::connect_keyspace(&env.cassandra)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let insert = session
        .prepare(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version, updated_at) \
             VALUES (?, ?, 'video', ?, 1, toTimestamp(now()))",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let started = Instant::now();
    let writes = (0..n).map(|i| {
        let (session, insert) = (&session, &insert);
        let target = target_of(i);
        async move {
            session
                .execute_unpaged(insert, (format!("u{i}"), target, state_of(i)))
                .await
                .map(|_| ())
        }
    });
    let mut writes = futures::stream::iter(writes).buffer_unordered(256);
    while let Some(r) = writes.next().await {
        r.unwrap_or_else(|e| panic!("{e}"));
    }
    eprintln!("  rows written in {:.0} s", started.elapsed().as_secs_f64());

    let transitions = env.transitions();
    let sends =
        (0..n).map(|i| transitions.send(target_of(i), format!("u{i}"), "none", state_of(i), 1));
    let mut sends = futures::stream::iter(sends).buffer_unordered(5000);
    while sends.next().await.is_some() {}
}

/// Runs the real consumer until it has counted all `n` transitions.
async fn count(env: &BenchEnv, name: &'static str, n: u64, one_target: bool) -> Case {
    let config = support::consumer_config(
        format!("bench-viral-{name}-{}", std::process::id()),
        tally::consumer::WriteMode::Batched,
        env.stores(),
    );
    let (stop, rx) = tokio::sync::watch::channel(false);
    let progress = Arc::new(tally::consumer::Progress::default());
    let started = Instant::now();
    let task = tokio::spawn(tally::consumer::run(config, rx, progress.clone()));
    let mut last = Instant::now();
    while progress.processed.load(Ordering::Relaxed) < n {
        if task.is_finished() {
            panic!("the consumer stopped early: {:?}", task.await);
        }
        if last.elapsed() >= Duration::from_secs(15) {
            last = Instant::now();
            eprintln!(
                "  {} of {n} counted",
                progress.processed.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = stop.send(true);
    let _ = task.await;
    let requests = progress.requests.load(Ordering::Relaxed);
    Case {
        name,
        voters: n,
        targets: if one_target { 1 } else { n },
        consumer_seconds: seconds,
        events_per_sec: n as f64 / seconds,
        requests_per_event: requests as f64 / n.max(1) as f64,
        fenced_writes: progress.writes.load(Ordering::Relaxed),
        totals: None,
        expected: None,
        reconcile: None,
        largest_partition: None,
    }
}

/// `tally reconcile --target viral --json` as its own process, its peak
/// resident memory read from /proc while it runs.
fn reconcile(env: &BenchEnv, stored: Option<(i64, i64)>) -> ReconcileRun {
    let started = Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["reconcile", "--target", "viral", "--json"])
        .env("TALLY_KEYSPACE", &env.cassandra.keyspace)
        .env("TALLY_CASSANDRA_NODES", env.cassandra.nodes.join(","))
        .env("TALLY_REDIS_PREFIX", &env.redis.prefix)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    while child.try_wait().ok().flatten().is_none() {
        // VmHWM is the process's own high-water mark: the last read before
        // it exits is its peak.
        if let Some(kib) = std::fs::read_to_string(&status)
            .ok()
            .and_then(|s| vm_hwm_kib(&s))
        {
            peak = peak.max(kib);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let seconds = started.elapsed().as_secs_f64();
    let summary: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert!(
        out.status.success(),
        "reconcile failed: {summary} {:?}",
        out.status
    );
    assert_eq!(summary["targets_checked"], 1, "{summary}");
    let totals = |v: &serde_json::Value| {
        (
            v["likes"].as_i64().unwrap_or(-1),
            v["dislikes"].as_i64().unwrap_or(-1),
        )
    };
    // A drifted target is listed with what it held and what its rows add
    // up to; one that is not listed held exactly what its rows add up to.
    let drifted = summary["targets_drifted"] != 0;
    let (before, recounted) = match summary["corrections"].get(0) {
        Some(r) => (totals(&r["totals_before"]), totals(&r["totals_after"])),
        None => {
            let stored = stored.unwrap_or((-1, -1));
            (stored, stored)
        }
    };
    ReconcileRun {
        seconds,
        peak_rss_kib: peak,
        drifted,
        totals_before: before,
        recounted,
    }
}

fn vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Flushes and compacts `target_stats` and asks Cassandra's
/// sstablepartitions for its largest partition: key, rows and bytes (the
/// partition's serialized size in the Data.db file), read from the SSTable.
async fn largest_partition(env: &BenchEnv) -> Option<Partition> {
    let ks = &env.cassandra.keyspace;
    let stack = |args: &[&str]| {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack.sh"))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{e}"))
    };
    // Flushed, then compacted into one SSTable: each partition is then
    // whole in one file, as it would be after the node's own compactions.
    for step in ["flush", "compact"] {
        let done = stack(&["nodetool", step, ks, "target_stats"]);
        if !done.status.success() {
            eprintln!("  nodetool {step} failed: {done:?}");
            return None;
        }
    }
    // The table's folder is named after its id (the keyspace also holds
    // the folder of the dropped single-partition table of the same name).
    let session = tally::store::connect_keyspace(&env.cassandra).await.ok()?;
    let (id,): (uuid::Uuid,) = session
        .query_unpaged(
            "SELECT id FROM system_schema.tables WHERE keyspace_name = ? AND table_name = 'target_stats'",
            (ks,),
        )
        .await
        .ok()?
        .into_rows_result()
        .ok()?
        .first_row()
        .ok()?;
    let table = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".stack/cassandra/data/data")
        .join(ks)
        .join(format!("target_stats-{}", id.as_simple()));
    // Every partition at or above 0 bytes: all of them, with their sizes.
    let out = stack(&["sstablepartitions", "-m", "-t", "0", table.to_str()?]);
    let text = String::from_utf8_lossy(&out.stdout);
    let largest = largest_of_csv(&text);
    if largest.is_none() {
        eprintln!(
            "  sstablepartitions on {} said: {text}{}",
            table.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    largest
}

/// The largest partition in sstablepartitions' CSV: a header naming the
/// columns, one line per partition and SSTable (summed per key, should a
/// partition still span several).
fn largest_of_csv(csv: &str) -> Option<Partition> {
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next()?.split(',').map(str::trim).collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let (key, rows, bytes) = (col("key")?, col("rowCount")?, col("size")?);
    let mut partitions: std::collections::HashMap<String, Partition> = Default::default();
    for l in lines {
        let cells: Vec<&str> = l.split(',').map(str::trim).collect();
        let (Some(k), Some(r), Some(b)) = (
            cells.get(key),
            cells.get(rows).and_then(|r| r.parse::<u64>().ok()),
            cells.get(bytes).and_then(|b| b.parse::<u64>().ok()),
        ) else {
            continue;
        };
        let p = partitions
            .entry(k.trim_matches('"').to_owned())
            .or_insert_with(|| Partition {
                key: k.trim_matches('"').to_owned(),
                rows: 0,
                bytes: 0,
            });
        p.rows += r;
        p.bytes += b;
    }
    partitions.into_values().max_by_key(|p| p.bytes)
}

fn report(cases: &[Case]) {
    let uniform = cases
        .iter()
        .find(|c| c.name == "uniform")
        .map_or(1.0, |c| c.events_per_sec);
    println!("\n## A viral target\n");
    println!(
        "| case | voters | targets | events/s | vs uniform | CQL req/event | largest partition (rows, bytes) | totals = rows | reconcile s | reconcile peak RSS |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---|---:|---:|");
    for c in cases {
        let partition = c.largest_partition.as_ref().map_or("?".into(), |p| {
            format!("{} rows, {:.1} MB", p.rows, p.bytes as f64 / 1e6)
        });
        let exact = match (c.totals, c.expected, &c.reconcile) {
            (Some(t), Some(e), Some(r)) => format!(
                "{} (recount {:?}, drift {})",
                t == e && r.recounted == e,
                r.recounted,
                r.drifted
            ),
            _ => "-".into(),
        };
        let (secs, rss) = c.reconcile.as_ref().map_or(("-".into(), "-".into()), |r| {
            (
                format!("{:.1}", r.seconds),
                format!("{:.0} MiB", r.peak_rss_kib as f64 / 1024.0),
            )
        });
        println!(
            "| {} | {} | {} | {:.0} | {:.2}x | {:.2} | {} | {} | {} | {} |",
            c.name,
            c.voters,
            c.targets,
            c.events_per_sec,
            c.events_per_sec / uniform,
            c.requests_per_event,
            partition,
            exact,
            secs,
            rss
        );
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tally-bench");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("viral.json");
    if let Ok(json) = serde_json::to_string_pretty(cases) {
        let _ = std::fs::write(&path, json);
        println!("\n(raw: {})", path.display());
    }
}
