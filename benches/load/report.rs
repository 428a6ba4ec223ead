//! What the load bench found, as the tables of BENCHMARKS.md, the JSON
//! beside them and the latency chart: rendering only, no measuring.

use std::fmt::Write as _;

use serde::Serialize;

use super::support::Percentiles;
pub use super::support::StoreRun;

#[derive(Debug, Clone, Serialize)]
pub struct ConsumerRun {
    pub workload: String,
    pub mode: String,
    pub events: u64,
    pub seconds: f64,
    pub events_per_sec: f64,
    pub requests_per_event: f64,
    pub fenced_writes: u64,
    /// Cassandra's CPU time per event, in microseconds.
    pub store_cpu_us: f64,
    /// The machine's busy CPU time per event, in microseconds (the
    /// consumer runs inside the bench process).
    pub machine_cpu_us: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RateStep {
    pub rate: u64,
    pub achieved: f64,
    pub latency_ms: Percentiles,
    pub errors: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Results {
    pub date: String,
    pub commit: String,
    pub store: Vec<StoreRun>,
    pub consumer: Vec<ConsumerRun>,
    pub e2e_writes: Vec<RateStep>,
    pub e2e_reads: Vec<RateStep>,
    pub e2e_closed_loop_writes: Option<StoreRun>,
}

pub fn report(r: &Results) {
    let mut md = String::new();
    let _ = writeln!(md, "Run {} at commit {}\n", r.date, r.commit);
    if !r.store.is_empty() {
        let _ = writeln!(
            md,
            "| store, 64 in flight | ops/s | p50 ms | p95 ms | p99 ms | CAS timeouts | conflicts | Cassandra CPU per op |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        );
        for s in &r.store {
            let l = s.latency_ms;
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0} µs |",
                s.name,
                s.ops_per_sec,
                l.p50,
                l.p95,
                l.p99,
                s.cas_unknown,
                s.conflicts,
                s.store_cpu_us
            );
        }
        let rate = |op| super::support::rate_of(&r.store, op);
        if let (Some(with), Some(without), Some(bare)) = (
            rate(super::support::Op::Vote),
            rate(super::support::Op::VoteNoOutbox),
            rate(super::support::Op::BareLwt),
        ) {
            let _ = writeln!(
                md,
                "\nVote with its outbox / without: {:.2}x ({:.1}% fewer votes/s); vote / bare LWT: {:.2}x\n",
                with / without,
                100.0 * (1.0 - with / without),
                with / bare
            );
        }
        use super::support::Op;
        if let (Some(fenced), Some(stamped), Some(vf), Some(vs), Some(bare)) = (
            rate(Op::CountFenced),
            rate(Op::CountStamped),
            rate(Op::VoteCountedFenced),
            rate(Op::VoteCountedStamped),
            rate(Op::BareLwt),
        ) {
            let _ = writeln!(
                md,
                "Counting alone, stamped / fenced: {:.2}x. A vote counted / bare LWT: fenced {:.2}x, stamped {:.2}x (stamped / fenced {:.2}x)\n",
                stamped / fenced,
                vf / bare,
                vs / bare,
                vs / vf
            );
        }
        if let (Some(fenced), Some(sharded), Some(vf), Some(vsh), Some(bare)) = (
            rate(Op::CountFenced),
            rate(Op::CountSharded),
            rate(Op::VoteCountedFenced),
            rate(Op::VoteCountedSharded),
            rate(Op::BareLwt),
        ) {
            let _ = writeln!(
                md,
                "Counting alone, sharded / fenced: {:.2}x. A vote counted sharded / bare LWT: {:.2}x (sharded / fenced {:.2}x); {} transitions a sharded write at most\n",
                sharded / fenced,
                vsh / bare,
                vsh / vf,
                super::support::env_num("TALLY_BENCH_SHARD_BATCH", 8)
            );
        }
    }
    if !r.consumer.is_empty() {
        let _ = writeln!(
            md,
            "| workload | consumer | events | seconds | events/s | CQL requests/event | fenced writes | Cassandra CPU per event | machine CPU per event |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
        );
        for c in &r.consumer {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {:.0} | {:.3} | {} | {:.0} µs | {:.0} µs |",
                c.workload,
                c.mode,
                c.events,
                c.seconds,
                c.events_per_sec,
                c.requests_per_event,
                c.fenced_writes,
                c.store_cpu_us,
                c.machine_cpu_us
            );
        }
        let _ = writeln!(md);
        for pair in r.consumer.chunks(2) {
            if let [batched, per_event] = pair {
                let _ = writeln!(
                    md,
                    "{}: batched vs per-event, {:.1}x the events/s, {:.1}x fewer requests per event",
                    batched.workload,
                    batched.events_per_sec / per_event.events_per_sec,
                    per_event.requests_per_event / batched.requests_per_event
                );
            }
        }
        let _ = writeln!(md);
    }
    for (name, steps, target) in [
        ("writes (POST /v1/votes)", &r.e2e_writes, 100.0),
        ("reads (summary, 21 ids)", &r.e2e_reads, 20.0),
    ] {
        if steps.is_empty() {
            continue;
        }
        let _ = writeln!(
            md,
            "| e2e {name}, open loop | target/s | achieved/s | p50 ms | p95 ms | p99 ms | errors |\n|---|---:|---:|---:|---:|---:|---:|"
        );
        for s in steps.iter() {
            let l = s.latency_ms;
            let _ = writeln!(
                md,
                "| | {} | {:.0} | {:.1} | {:.1} | {:.1} | {} |",
                s.rate, s.achieved, l.p50, l.p95, l.p99, s.errors
            );
        }
        let best = steps
            .iter()
            .filter(|s| {
                s.latency_ms.p95 < target && (s.errors as f64) < 0.01 * s.latency_ms.count as f64
            })
            .map(|s| s.rate)
            .max();
        let _ = writeln!(
            md,
            "\nHighest rate with p95 under {target} ms: {}\n",
            best.map_or("none tried".into(), |b| format!("{b}/s"))
        );
    }
    if let (Some(api), Some(bare)) = (&r.e2e_closed_loop_writes, r.store.get(1)) {
        let _ = writeln!(
            md,
            "Vote API closed loop (64 in flight): {:.0} votes/s, p95 {:.1} ms, {} errors, {:.0} µs of Cassandra CPU per vote; store bare LWT rate {:.0}/s at {:.0} µs; API / store: {:.2}x",
            api.ops_per_sec,
            api.latency_ms.p95,
            api.conflicts,
            api.store_cpu_us,
            bare.ops_per_sec,
            bare.store_cpu_us,
            api.ops_per_sec / bare.ops_per_sec
        );
    }
    println!("{md}");

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tally-bench");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(r).unwrap_or_default(),
    );
    let _ = std::fs::write(dir.join("results.md"), &md);
    let _ = std::fs::write(dir.join("latency.svg"), svg(r));
    eprintln!("results in {}", dir.display());
}

/// Latency percentiles of every measured scenario as grouped bars.
fn svg(r: &Results) -> String {
    let mut rows: Vec<(String, Percentiles)> = r
        .store
        .iter()
        .map(|s| (format!("store: {}", s.name), s.latency_ms))
        .collect();
    if let Some(api) = &r.e2e_closed_loop_writes {
        rows.push(("API writes, 64 in flight".into(), api.latency_ms));
    }
    for (name, steps, target) in [
        ("API writes", &r.e2e_writes, 100.0),
        ("API reads (21 ids)", &r.e2e_reads, 20.0),
    ] {
        if let Some(best) = steps
            .iter()
            .filter(|s| s.latency_ms.p95 < target)
            .max_by_key(|s| s.rate)
        {
            rows.push((
                format!("{name}, open loop {}/s", best.rate),
                best.latency_ms,
            ));
        }
    }
    let max = rows.iter().map(|(_, p)| p.p99).fold(1.0, f64::max);
    let (width, row_h, left) = (900.0, 54.0, 330.0);
    let height = 60.0 + row_h * rows.len() as f64;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='12'>\n\
         <text x='10' y='20' font-size='14'>Latency percentiles, ms (p50 / p95 / p99), {} at {}</text>\n",
        r.date, r.commit
    );
    for (i, (name, p)) in rows.iter().enumerate() {
        let y = 40.0 + i as f64 * row_h;
        let _ = writeln!(
            s,
            "<text x='10' y='{:.0}'>{}</text>",
            y + 20.0,
            name.replace('&', "and").replace('<', "(").replace('>', ")")
        );
        for (j, (label, v, color)) in [
            ("p50", p.p50, "#4c78a8"),
            ("p95", p.p95, "#f58518"),
            ("p99", p.p99, "#e45756"),
        ]
        .iter()
        .enumerate()
        {
            let w = (v / max * (width - left - 80.0)).max(1.0);
            let by = y + j as f64 * 14.0;
            let _ = writeln!(
                s,
                "<rect x='{left}' y='{by:.0}' width='{w:.1}' height='12' fill='{color}'/><text x='{:.1}' y='{:.0}'>{label} {v:.1}</text>",
                left + w + 4.0,
                by + 10.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
