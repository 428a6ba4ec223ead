//! The HTTP API measured from outside, with a standard load generator.
//!
//! `tally vote` and `tally consumer` run as their own processes (the release
//! binary), and vegeta drives the API, also in its own process: closed loop
//! (a fixed number of requests in flight) for capacity, open loop (a fixed
//! arrival rate, whatever the server does) for the latency curve and for
//! overload. The closed loops of votes and pages run again from wrk, the
//! lightest generator (C, one thread), and the votes' once more from this
//! process (reqwest), the in-repo way: three generators whose own CPU on the
//! shared cores differs several times over. Beside every throughput: the
//! server's own CPU per request and the generator's, from /proc, and the
//! API's cache misses per request, from its metrics. In the same
//! run, the ceilings: `/healthz`, a bare single-row LWT and the vote's store
//! operation, with 64 in flight, after every store run once unmeasured
//! (TALLY_BENCH_WARM_SECS a run, 15; 0 for none): a Cassandra that has not
//! warmed up yet halves the ceilings and flatters every ratio to them.
//!
//!   scripts/stack.sh up && cargo bench --bench http
//!
//! Knobs: TALLY_HTTP_SECS (seconds per step, default 10), TALLY_HTTP_PIN=1
//! (the machine split in two with `taskset`: every server, the stack's and
//! tally's, on CPU 0, the generators and this process on CPU 1, so that no
//! generator takes CPU from the service it measures), TALLY_HTTP_OVERLOAD=1
//! (only this: the capacity of a closed loop of votes, then open loops at
//! 0.5x, 1x, 3x and 10x of it, or the multiples TALLY_HTTP_OVERLOAD_TIMES
//! lists (the first the unloaded reference), adaptive admission and the
//! fixed ceiling, each step started with the consumer caught up; every step
//! also counts the connection attempts the machine's listeners dropped and
//! how busy the generator's core was; then a retry storm of wrk's, 1,500
//! connections that vote again the moment they are answered, against
//! adaptive admission with refusals paced and not, and the fixed ceiling;
//! http-overload.json),
//! TALLY_HTTP_QUICK=1 (only the closed
//! loops of the API: to try one setting against another), TALLY_HTTP_PROFILE=1 (`perf record` of
//! `tally vote` during closed loops of votes and of pages of their own, after
//! the measured ones), TALLY_HTTP_FLOOD=1 (only this: other users' pages at a
//! steady rate, alone and while one user floods the summary endpoint, with the
//! production read limits; http-flood.json), TALLY_HTTP_AGAINST=<another
//! tally binary> (only this: the closed loops of votes and of pages for this
//! build and that one, three rounds in alternating order, each API started
//! afresh: one change measured in one run; http-against.json; with
//! TALLY_HTTP_AGAINST_OVERLOAD=1 also open-loop votes at 3x and 10x the first
//! closed loop's rate, the same rates for both). Results:
//! stdout (Markdown), target/tally-bench/http.json, http-latency.svg,
//! vote-profile.txt and summary-profile.txt.

#[path = "support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use support::{
    Op, Percentiles, StoreOps, StoreRun, Zipf, bench_env, cassandra_cpu_micros, cpu_micros,
    env_num, machine_cpu_micros, store_runs, waited_children_cpu_micros, warm_up,
};

const SECRET: &str = "bench-secret-of-32-bytes-or-more-0123";
const VOTERS: u64 = 5_000;
const VOTE_TARGETS: u64 = 10_000;
const READERS: u64 = 2_000;
const PAGES: u64 = 200;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !support::stack_up() {
        support::skip_message("http bench");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    // Before anything starts: the servers tally spawns take CPU 0 from here.
    let _split = pinned().then(Split::apply);
    if std::env::var("TALLY_HTTP_FLOOD").is_ok_and(|v| v == "1") {
        rt.block_on(flood());
        return;
    }
    if let Some(other) = std::env::var_os("TALLY_HTTP_AGAINST") {
        rt.block_on(against(PathBuf::from(other)));
        return;
    }
    if std::env::var("TALLY_HTTP_OVERLOAD").is_ok_and(|v| v == "1") {
        rt.block_on(overload());
        return;
    }
    let results = rt.block_on(run());
    report(&results);
}

/// One step of vegeta against the API.
#[derive(Debug, Clone, Serialize)]
struct Step {
    /// Offered requests per second; `None` for a closed loop.
    offered: Option<f64>,
    /// Requests in flight, for a closed loop.
    workers: Option<u64>,
    seconds: f64,
    sent: u64,
    /// 2xx answers per second.
    goodput: f64,
    /// Latency of the 2xx answers.
    ok_ms: Percentiles,
    /// 503 answers (admission refusals and the like).
    refused: u64,
    /// Latency of the 503 answers (how fast a refusal is).
    refused_ms: Percentiles,
    /// Anything else: other statuses, timeouts, connection errors.
    errors: u64,
    /// `tally vote`'s CPU time per request sent, in microseconds.
    server_cpu_us: f64,
    /// Cassandra's CPU time per request sent, in microseconds (with the
    /// consumer's and the relay's work in that time).
    cassandra_cpu_us: f64,
    /// The whole machine's busy CPU time per request sent, in microseconds:
    /// every server's, the generator's and the kernel's.
    machine_cpu_us: f64,
    /// The load generator's own CPU time per request sent, in microseconds:
    /// on shared cores, what it takes from the servers.
    generator_cpu_us: f64,
    /// How much of one core the load generator was busy over the step, 0 to
    /// 1 (more with the machine not split): near 1 on its own core, the
    /// step measures the generator as much as the service.
    generator_core: f64,
    /// Connection attempts the machine's listeners dropped during the step
    /// (see `support::listen_drops`).
    listen_drops: u64,
    /// The API's cache misses per request sent: on pages, how many of a
    /// page's 21 ids were not in Redis. `None` if its metrics could not be
    /// read. Two loops at once (the flood mode) each count the other's, as
    /// their CPU does.
    cache_misses: Option<f64>,
}

/// CPU time of `tally vote`, of Cassandra, of the machine and of the
/// generators at one moment, to subtract from a later one; and the
/// connection attempts dropped so far.
#[derive(Clone, Copy)]
struct CpuMark<'a> {
    api: &'a Api,
    cache_misses: Option<u64>,
    tally: u64,
    cassandra: u64,
    machine: u64,
    own: u64,
    children: u64,
    listen_drops: u64,
}

/// CPU time used since a mark, in microseconds.
#[derive(Clone, Copy, Default)]
struct CpuUsed {
    tally: u64,
    cassandra: u64,
    machine: u64,
    /// This process's: the generator of the in-process loop.
    own: u64,
    /// The children this process waited for since: vegeta's and wrk's.
    children: u64,
    listen_drops: u64,
    cache_misses: Option<u64>,
}

impl CpuMark<'_> {
    fn now(api: &Api) -> CpuMark<'_> {
        // The fields are read in the order written: the scrape of the
        // metrics before the CPU marks here, and after them in `used`, so
        // that its own CPU stays out of the step's.
        CpuMark {
            api,
            cache_misses: api.cache_misses(),
            tally: cpu_micros(api.pid()),
            cassandra: cassandra_cpu_micros(),
            machine: machine_cpu_micros(),
            own: cpu_micros(std::process::id()),
            children: waited_children_cpu_micros(),
            listen_drops: support::listen_drops(),
        }
    }

    fn used(&self) -> CpuUsed {
        CpuUsed {
            tally: cpu_micros(self.api.pid()).saturating_sub(self.tally),
            cassandra: cassandra_cpu_micros().saturating_sub(self.cassandra),
            machine: machine_cpu_micros().saturating_sub(self.machine),
            own: cpu_micros(std::process::id()).saturating_sub(self.own),
            children: waited_children_cpu_micros().saturating_sub(self.children),
            listen_drops: support::listen_drops().saturating_sub(self.listen_drops),
            cache_misses: self
                .api
                .cache_misses()
                .zip(self.cache_misses)
                .map(|(after, before)| after.saturating_sub(before)),
        }
    }
}

#[derive(Debug, Default, Serialize)]
struct Results {
    date: String,
    commit: String,
    pinned: bool,
    healthz: Option<Step>,
    store: Vec<StoreRun>,
    votes_closed: Option<Step>,
    /// The same closed loop of votes from this process (reqwest), as the
    /// in-repo harness of `load` measures: set against vegeta's.
    votes_closed_in_process: Option<Step>,
    /// The same closed loop of votes from wrk, the lightest generator.
    votes_closed_wrk: Option<Step>,
    /// Seconds after the closed-loop votes until the consumer group's lag was 0.
    consumer_drain_secs: Option<f64>,
    pages_closed: Option<Step>,
    /// The same closed loop of pages from wrk.
    pages_closed_wrk: Option<Step>,
    votes_curve: Vec<Step>,
    pages_curve: Vec<Step>,
    /// Open loop at 1x, 3x, 10x the closed-loop vote capacity, adaptive admission.
    overload_after: Vec<Step>,
    /// The same with admission fixed at the ceiling (the behaviour before).
    overload_before: Vec<Step>,
}

async fn run() -> Results {
    let secs = env_num("TALLY_HTTP_SECS", 10);
    let pinned = pinned();
    // Only the closed loops of the API: for trying a setting against another.
    let quick = std::env::var("TALLY_HTTP_QUICK").is_ok_and(|v| v == "1");
    let vegeta = Vegeta::install(pinned);
    let env = bench_env("http", 6).await;
    let group = format!("bench-http-{}", std::process::id());
    let dir = results_dir();
    let mut results = Results {
        date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        commit: git_commit(),
        pinned,
        ..Results::default()
    };

    let tokens = tokens("u", 0..VOTERS);
    let mut consumer = spawn_consumer(&env, &group);
    let mut api = Api::spawn(&env, &group, Admission::Adaptive).await;

    eprintln!("http: /healthz, closed loop, 64 in flight, {secs}s");
    results.healthz =
        Some(vegeta.attack(&api, &mut Targets::Healthz, Load::Closed(64), secs, &dir));

    // The store ceilings, in this run, while the API idles, in a keyspace of
    // their own: the API's loops after them would otherwise run on a table
    // holding their rows (about a million), still being flushed and compacted.
    let runs = [
        ("plain upsert", Op::Upsert, false),
        (
            "bare single-row LWT (INSERT IF NOT EXISTS)",
            Op::BareLwt,
            false,
        ),
        (
            "the vote's store operation (intent + optimistic batch)",
            Op::Vote,
            false,
        ),
        (
            "the vote's batch alone (no intent)",
            Op::VoteBatchOnly,
            false,
        ),
        (
            "the vote without the outbox (no intent, no transition)",
            Op::VoteNoOutbox,
            false,
        ),
        (
            "the vote before: read, intent, then the batch",
            Op::ReadThenVote,
            false,
        ),
        ("read, then the batch (no outbox)", Op::ReadThenWrite, false),
    ];
    if !quick {
        warm_up(&runs, "http_store_warm").await;
        eprintln!("http: store ceilings, 64 in flight, {secs}s each in 3 rounds");
        let ceilings = bench_env("http_store", 1).await;
        let ops = StoreOps::open(&ceilings).await;
        results.store = store_runs(&ops, &runs, Duration::from_secs(secs), 3).await;
        ceilings.drop_all().await;
    }

    let mut rng = Zipf::new(1, 1.0, 42);
    eprintln!("http: votes, closed loop, 64 in flight, {}s", secs * 2);
    let votes = vegeta.attack(
        &api,
        &mut Targets::Votes(&tokens, &mut rng),
        Load::Closed(64),
        secs * 2,
        &dir,
    );
    let vote_capacity = votes.goodput.max(1.0);
    results.votes_closed = Some(votes);
    if !quick {
        results.consumer_drain_secs = drained(&env.kafka, &group, Duration::from_secs(120)).await;
    }
    if !quick {
        eprintln!("http: votes, closed loop from this process (reqwest), 64 in flight, {secs}s");
        results.votes_closed_in_process = Some(in_process_votes(&api, &tokens, secs).await);
        // Each generator's loop starts with the consumer caught up, so none
        // runs beside the counting of another's votes.
        drained(&env.kafka, &group, Duration::from_secs(120)).await;
    }
    let wrk = Wrk::install(pinned, &tokens, &dir);
    eprintln!("http: votes, closed loop from wrk, 64 connections, {secs}s");
    results.votes_closed_wrk = Some(wrk.closed(&api, Wrk::VOTES, &wrk.voters, 64, secs));
    if !quick {
        drained(&env.kafka, &group, Duration::from_secs(120)).await;
    }

    eprintln!("http: summary pages, closed loop, 32 in flight, {secs}s");
    let pages = vegeta.attack(
        &api,
        &mut Targets::Pages(&tokens[..READERS as usize], &mut rng),
        Load::Closed(32),
        secs,
        &dir,
    );
    if profile_requested() {
        // Closed loops of their own: sampling costs CPU, and the figures
        // above set the rates of every step after them.
        eprintln!("http: votes and pages under perf, {secs}s each (not measured)");
        let profile = Profile::start(api.pid(), secs, &dir);
        let _ = vegeta.attack(
            &api,
            &mut Targets::Votes(&tokens, &mut rng),
            Load::Closed(64),
            secs,
            &dir,
        );
        profile.report(&dir.join("vote-profile.txt"));
        let profile = Profile::start(api.pid(), secs, &dir);
        let _ = vegeta.attack(
            &api,
            &mut Targets::Pages(&tokens[..READERS as usize], &mut rng),
            Load::Closed(32),
            secs,
            &dir,
        );
        profile.report(&dir.join("summary-profile.txt"));
    }
    let page_capacity = pages.goodput.max(1.0);
    results.pages_closed = Some(pages);
    eprintln!("http: summary pages, closed loop from wrk, 32 connections, {secs}s");
    results.pages_closed_wrk = Some(wrk.closed(&api, Wrk::PAGES, &wrk.readers, 32, secs));
    if quick {
        api.stop();
        let _ = consumer.kill();
        let _ = consumer.wait();
        env.drop_all().await;
        return results;
    }

    for share in [0.25, 0.5, 0.75, 1.0] {
        let rate = vote_capacity * share;
        eprintln!("http: votes, open loop at {rate:.0}/s, {secs}s");
        let step = vegeta.attack(
            &api,
            &mut Targets::Votes(&tokens, &mut rng),
            Load::Open(rate),
            secs,
            &dir,
        );
        results.votes_curve.push(step);
    }
    // As every closed loop does, the curve of pages starts with the votes of
    // the curve before counted: their counting is not the pages' load.
    drained(&env.kafka, &group, Duration::from_secs(120)).await;
    for share in [0.25, 0.5, 0.75, 1.0, 1.5] {
        let rate = page_capacity * share;
        eprintln!("http: pages, open loop at {rate:.0}/s, {secs}s");
        let step = vegeta.attack(
            &api,
            &mut Targets::Pages(&tokens[..READERS as usize], &mut rng),
            Load::Open(rate),
            secs,
            &dir,
        );
        results.pages_curve.push(step);
    }
    let overload = Overload {
        vegeta: &vegeta,
        env: &env,
        group: &group,
        tokens: &tokens,
        dir: &dir,
        secs,
        capacity: vote_capacity,
    };
    (results.overload_after, results.overload_before) = overload
        .after_and_before(api, &mut rng, &[1.0, 3.0, 10.0])
        .await;
    let _ = consumer.kill();
    let _ = consumer.wait();
    env.drop_all().await;
    results
}

/// Open loops of votes at multiples of a measured capacity.
struct Overload<'a> {
    vegeta: &'a Vegeta,
    env: &'a support::BenchEnv,
    group: &'a str,
    tokens: &'a [String],
    dir: &'a Path,
    secs: u64,
    /// Votes/s of the closed loop the rates are multiples of.
    capacity: f64,
}

impl Overload<'_> {
    /// One step per multiple, each started with the consumer caught up, as
    /// the closed loop that measured the capacity was: a backlog left by the
    /// step before would otherwise count against the next.
    async fn steps(&self, api: &Api, rng: &mut Zipf, times: &[f64], admission: &str) -> Vec<Step> {
        let mut steps = Vec::new();
        for &times in times {
            if drained(&self.env.kafka, self.group, Duration::from_secs(120))
                .await
                .is_none()
            {
                eprintln!("http: the consumer did not catch up within 120 s; the step runs anyway");
            }
            let rate = self.capacity * times;
            eprintln!(
                "http: votes, overload {times}x at {rate:.0}/s, {admission}, {}s",
                self.secs
            );
            steps.push(self.vegeta.attack(
                api,
                &mut Targets::Votes(self.tokens, rng),
                Load::Open(rate),
                self.secs,
                self.dir,
            ));
        }
        steps
    }

    /// A retry storm against each admission in turn, each API started
    /// afresh with the consumer caught up: `STORM` connections of wrk that
    /// vote again the moment they are answered, refused or not.
    async fn storms(&self, wrk: &Wrk) -> Vec<(&'static str, Step)> {
        let mut storms = Vec::new();
        for (name, admission) in [
            ("adaptive, refusals paced", Admission::Adaptive),
            ("adaptive, refusals not paced", Admission::Unpaced),
            ("fixed ceiling (before)", Admission::FixedCeiling),
        ] {
            let mut api = Api::spawn(self.env, self.group, admission).await;
            if drained(&self.env.kafka, self.group, Duration::from_secs(120))
                .await
                .is_none()
            {
                eprintln!(
                    "http: the consumer did not catch up within 120 s; the storm runs anyway"
                );
            }
            eprintln!(
                "http: votes, a storm of {STORM} connections (wrk), {name}, {}s",
                self.secs
            );
            storms.push((
                name,
                wrk.closed(&api, Wrk::VOTES, &wrk.voters, STORM, self.secs),
            ));
            api.stop();
        }
        storms
    }

    /// The steps against `api` (adaptive admission), which then stops, and
    /// again against an API whose admission never adapts, so it admits up
    /// to the fixed ceiling: the behaviour before.
    async fn after_and_before(
        &self,
        mut api: Api,
        rng: &mut Zipf,
        times: &[f64],
    ) -> (Vec<Step>, Vec<Step>) {
        let after = self.steps(&api, rng, times, "adaptive admission").await;
        api.stop();
        let mut api = Api::spawn(self.env, self.group, Admission::FixedCeiling).await;
        let before = self.steps(&api, rng, times, "fixed ceiling").await;
        api.stop();
        (after, before)
    }
}

/// Connections of the overload mode's retry storm: the size of the storm
/// the issue that asked for admission measured.
const STORM: u64 = 1_500;

/// The multiples of the capacity the overload mode offers:
/// TALLY_HTTP_OVERLOAD_TIMES (comma-separated, the first the unloaded
/// reference), else 0.5, 1, 3 and 10.
fn overload_times() -> Vec<f64> {
    let given = std::env::var("TALLY_HTTP_OVERLOAD_TIMES").ok().map(|v| {
        v.split(',')
            .map(|t| match t.trim().parse::<f64>() {
                Ok(t) if t > 0.0 => t,
                _ => panic!("TALLY_HTTP_OVERLOAD_TIMES: {t:?} is not a positive number"),
            })
            .collect::<Vec<_>>()
    });
    given.unwrap_or_else(|| vec![0.5, 1.0, 3.0, 10.0])
}

/// Only the overload table (TALLY_HTTP_OVERLOAD=1): a closed loop of votes
/// for the capacity, then open loops at 0.5x (the unloaded reference for
/// latency), 1x, 3x and 10x of it, with adaptive admission and with the fixed
/// ceiling, each API started afresh.
async fn overload() {
    let secs = env_num("TALLY_HTTP_SECS", 10);
    let vegeta = Vegeta::install(pinned());
    let env = bench_env("httpol", 6).await;
    let group = format!("bench-http-ol-{}", std::process::id());
    let dir = results_dir();
    let tokens = tokens("u", 0..VOTERS);
    let mut consumer = spawn_consumer(&env, &group);
    let mut rng = Zipf::new(1, 1.0, 42);
    let times = overload_times();

    let api = Api::spawn(&env, &group, Admission::Adaptive).await;
    // A fresh keyspace, a new process and maybe a cold JVM: the first loop
    // ran at a tenth of the next one's rate, so it is only a warm-up.
    eprintln!("http: votes, closed loop, 64 in flight, {secs}s (warm-up, not measured)");
    let _ = vegeta.attack(
        &api,
        &mut Targets::Votes(&tokens, &mut rng),
        Load::Closed(64),
        secs,
        &dir,
    );
    drained(&env.kafka, &group, Duration::from_secs(120)).await;
    eprintln!("http: votes, closed loop, 64 in flight, {}s", secs * 2);
    let closed = vegeta.attack(
        &api,
        &mut Targets::Votes(&tokens, &mut rng),
        Load::Closed(64),
        secs * 2,
        &dir,
    );
    let overload = Overload {
        vegeta: &vegeta,
        env: &env,
        group: &group,
        tokens: &tokens,
        dir: &dir,
        secs,
        capacity: closed.goodput.max(1.0),
    };
    let (after, before) = overload.after_and_before(api, &mut rng, &times).await;
    let wrk = Wrk::install(pinned(), &tokens, &dir);
    let storms = overload.storms(&wrk).await;
    let _ = consumer.kill();
    let _ = consumer.wait();
    env.drop_all().await;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "HTTP overload, {} at {} (service on CPU 0, generators on CPU 1: {})\n",
        humantime::format_rfc3339_seconds(std::time::SystemTime::now()),
        git_commit(),
        pinned()
    );
    let _ = writeln!(
        md,
        "capacity: a closed loop of 64 votes in flight, {:.0} votes/s, p99 {:.1} ms\n",
        overload.capacity, closed.ok_ms.p99
    );
    for (name, steps) in [
        ("adaptive admission", &after),
        ("fixed ceiling (before)", &before),
    ] {
        steps_table(&mut md, name, steps);
        // The unloaded reference: the first step (half the capacity, unless
        // TALLY_HTTP_OVERLOAD_TIMES says otherwise).
        let unloaded = steps.first().map_or(1.0, |s| s.ok_ms.p99.max(1e-9));
        for (t, s) in times.iter().zip(steps).skip(1) {
            let _ = writeln!(
                md,
                "- {name}, {t}x: goodput {:.2}x the capacity, admitted p99 {:.2}x the p99 at {}x, {} refused (p99 {:.1} ms), {} other errors{}",
                s.goodput / overload.capacity,
                s.ok_ms.p99 / unloaded,
                times[0],
                s.refused,
                s.refused_ms.p99,
                s.errors,
                if saturated(s) {
                    "; the generator was saturated, so this step measures it as much as the service"
                } else {
                    ""
                }
            );
        }
        md.push('\n');
    }
    storms_table(&mut md, &storms, overload.capacity);
    println!("{md}");
    let json = serde_json::json!({
        "commit": git_commit(),
        "date": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "pinned": pinned(),
        "capacity": closed,
        "times": times,
        "adaptive": after,
        "fixed_ceiling": before,
        "storm_connections": STORM,
        "storms": storms.iter().map(|(name, s)| serde_json::json!({"admission": name, "step": s})).collect::<Vec<_>>(),
    });
    write_json(&dir.join("http-overload.json"), &json, "http overload");
    let _ = std::fs::write(dir.join("http-overload.md"), &md);
}

/// TALLY_HTTP_PIN=1: servers on CPU 0, generators on CPU 1 (`Split`).
fn pinned() -> bool {
    std::env::var("TALLY_HTTP_PIN").is_ok_and(|v| v == "1")
}

/// The machine split in two for the run (TALLY_HTTP_PIN=1): the stack's
/// servers on CPU 0, this process (the store ceilings' driver, the in-process
/// generator) on CPU 1, where the generators it spawns inherit it, and the
/// tally processes it spawns on CPU 0 (`server`). On two shared cores an open
/// loop at 10x the capacity took 1.5 cores for vegeta alone, starving the
/// service it measured. Put back as it was when dropped.
struct Split {
    /// Each pinned process with the CPUs it had before.
    before: Vec<(u32, String)>,
}

impl Split {
    fn apply() -> Split {
        let own = std::process::id();
        let allowed = cpus_of(own).unwrap_or_else(|| panic!("no CPU list for this process"));
        assert!(
            ["0", "1"].iter().all(|c| cpu_in(&allowed, c)),
            "TALLY_HTTP_PIN=1 needs CPUs 0 and 1; this process may use {allowed}"
        );
        let run = std::env::var_os("TALLY_STACK_DIR")
            .map_or_else(|| PathBuf::from(".stack"), PathBuf::from)
            .join("run");
        let stack: Vec<u32> = std::fs::read_dir(&run)
            .unwrap_or_else(|e| panic!("{}: {e}", run.display()))
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "pid"))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok()?.trim().parse().ok())
            .collect();
        let mut split = Split { before: Vec::new() };
        for (pid, cpus) in stack.iter().map(|&p| (p, "0")).chain([(own, "1")]) {
            let Some(had) = cpus_of(pid) else { continue };
            assert!(pin(pid, cpus), "taskset could not move {pid} to CPU {cpus}");
            split.before.push((pid, had));
        }
        eprintln!(
            "http: the stack's servers ({} processes) and tally on CPU 0, the generators on CPU 1; \
             put back when the bench ends (after a kill: scripts/stack.sh restart)",
            split.before.len().saturating_sub(1)
        );
        split
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        for (pid, cpus) in &self.before {
            pin(*pid, cpus);
        }
    }
}

/// The CPUs `pid` may run on, as Linux lists them ("0-1"); `None` if it is gone.
fn cpus_of(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|l| l.trim().to_owned())
}

/// Whether `cpu` is in a list like "0-1,4".
fn cpu_in(list: &str, cpu: &str) -> bool {
    let Ok(cpu) = cpu.parse::<u32>() else {
        return false;
    };
    list.split(',').any(|part| match part.split_once('-') {
        Some((lo, hi)) => {
            lo.parse().is_ok_and(|lo: u32| lo <= cpu) && hi.parse().is_ok_and(|hi: u32| cpu <= hi)
        }
        None => part.parse() == Ok(cpu),
    })
}

/// Every thread of `pid` on `cpus`.
fn pin(pid: u32, cpus: &str) -> bool {
    Command::new("taskset")
        .args(["-a", "-p", "-c", cpus])
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A tally process's command: on CPU 0 when the machine is split.
fn server(bin: &Path) -> Command {
    on_cpu(bin, "0", pinned())
}

/// `bin`'s command, started on `cpu` only when `pinned`.
fn on_cpu(bin: &Path, cpu: &str, pinned: bool) -> Command {
    if pinned {
        let mut c = Command::new("taskset");
        c.args(["-c", cpu]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

/// Pages read by 2,000 users at a steady rate, alone, then while one more
/// user floods the summary endpoint (64 requests in flight, retried at
/// once), with the production per-user read limit (`--user-read-rate` 50,
/// `--user-read-burst` 100): what the flood costs everyone else.
async fn flood() {
    let secs = env_num("TALLY_HTTP_SECS", 10) * 2;
    let rate = env_num("TALLY_HTTP_FLOOD_RATE", 200) as f64;
    let vegeta = Vegeta::install(false);
    let env = bench_env("httpflood", 6).await;
    let group = format!("bench-http-flood-{}", std::process::id());
    let dir = results_dir();
    let tokens = tokens("r", 0..=READERS);
    let (readers, flooder) = tokens.split_at(READERS as usize);
    let mut api = Api::spawn_with(&env, &group, Admission::Adaptive, true).await;
    let mut rng = Zipf::new(1, 1.0, 7);

    eprintln!("http flood: {rate}/s pages from {READERS} users, alone, {secs}s");
    let alone = vegeta.attack(
        &api,
        &mut Targets::Pages(readers, &mut rng),
        Load::Open(rate),
        secs,
        &dir,
    );
    eprintln!("http flood: the same while one user floods, {secs}s");
    let flood = std::thread::scope(|scope| {
        let flooding = scope.spawn(|| {
            let mut rng = Zipf::new(1, 1.0, 8);
            vegeta.attack_as(
                "flood",
                &api,
                &mut Targets::Pages(flooder, &mut rng),
                Load::Closed(64),
                secs,
                &dir,
            )
        });
        let others = vegeta.attack(
            &api,
            &mut Targets::Pages(readers, &mut rng),
            Load::Open(rate),
            secs,
            &dir,
        );
        let flood = flooding
            .join()
            .unwrap_or_else(|_| panic!("the flood's vegeta failed"));
        (others, flood)
    });
    api.stop();
    env.drop_all().await;
    let (with_flood, flooder) = flood;
    println!("### Summary flood from one user (`TALLY_HTTP_FLOOD=1 cargo bench --bench http`)\n");
    println!(
        "{READERS} users read pages of 21 ids at {rate:.0}/s (open loop); one more user sends pages 64 at a time, each again as soon as it is answered. Read limit per user: 50/s, bursts of 100. Commit {}.\n",
        git_commit()
    );
    println!("| step | sent | 2xx/s | p50 ms | p95 ms | p99 ms | other answers |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, s) in [
        ("others, alone", &alone),
        ("others, during the flood", &with_flood),
        ("the flooding user", &flooder),
    ] {
        println!(
            "| {name} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {} |",
            s.sent,
            s.goodput,
            s.ok_ms.p50,
            s.ok_ms.p95,
            s.ok_ms.p99,
            s.errors + s.refused
        );
    }
    let json = serde_json::json!({
        "commit": git_commit(),
        "date": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "rate": rate,
        "others_alone": alone,
        "others_during_flood": with_flood,
        "flooder": flooder,
    });
    write_json(&dir.join("http-flood.json"), &json, "http flood");
}

/// One API's closed loops in an A/B run: which build, which round, votes, pages.
type AbRun = (usize, u64, Step, Step);

/// The closed loops of votes and pages, for this build and another binary
/// (built from an earlier commit, say), in rounds that alternate which goes
/// first, so that background work on the shared machine falls on both.
async fn against(other: PathBuf) {
    let secs = env_num("TALLY_HTTP_SECS", 10);
    let rounds = env_num("TALLY_HTTP_ROUNDS", 3);
    assert!(
        other.is_file(),
        "TALLY_HTTP_AGAINST: no binary at {}",
        other.display()
    );
    let vegeta = Vegeta::install(pinned());
    let env = bench_env("httpab", 6).await;
    let group = format!("bench-http-ab-{}", std::process::id());
    let dir = results_dir();
    let tokens = tokens("u", 0..VOTERS);
    let mut consumer = spawn_consumer(&env, &group);
    let this = PathBuf::from(env!("CARGO_BIN_EXE_tally"));
    let builds = [("this build", this), ("the other", other.clone())];
    let mut rng = Zipf::new(1, 1.0, 42);
    let mut runs: Vec<AbRun> = Vec::new();
    let overload = std::env::var("TALLY_HTTP_AGAINST_OVERLOAD").is_ok_and(|v| v == "1");
    // (build, round, times the capacity, step)
    let mut overloads: Vec<(usize, u64, f64, Step)> = Vec::new();
    let mut capacity: Option<f64> = None;
    for round in 0..rounds {
        for turn in 0..builds.len() {
            let b = (turn + round as usize) % builds.len();
            let mut api =
                Api::spawn_binary(&builds[b].1, &env, &group, Admission::Adaptive, false).await;
            eprintln!(
                "http against: round {round}, {}: votes 64 and pages 32 in flight, {secs}s each",
                builds[b].0
            );
            let votes = vegeta.attack(
                &api,
                &mut Targets::Votes(&tokens, &mut rng),
                Load::Closed(64),
                secs,
                &dir,
            );
            let pages = vegeta.attack(
                &api,
                &mut Targets::Pages(&tokens[..READERS as usize], &mut rng),
                Load::Closed(32),
                secs,
                &dir,
            );
            // Both builds are offered the same rates: the first closed loop's.
            let capacity = *capacity.get_or_insert(votes.goodput.max(1.0));
            if overload {
                let times = [3.0, 10.0];
                let steps = Overload {
                    vegeta: &vegeta,
                    env: &env,
                    group: &group,
                    tokens: &tokens,
                    dir: &dir,
                    secs,
                    capacity,
                }
                .steps(&api, &mut rng, &times, builds[b].0)
                .await;
                overloads.extend(times.into_iter().zip(steps).map(|(t, s)| (b, round, t, s)));
            }
            api.stop();
            runs.push((b, round, votes, pages));
        }
    }
    let _ = consumer.kill();
    let _ = consumer.wait();
    env.drop_all().await;

    let median = |b: usize, f: &dyn Fn(&AbRun) -> f64| {
        let mut v: Vec<f64> = runs.iter().filter(|r| r.0 == b).map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    println!(
        "### This build ({}) against {} (`TALLY_HTTP_AGAINST`)\n",
        git_commit(),
        other.display()
    );
    println!(
        "| build | round | votes/s | votes refused | vote p99 ms | CPU per vote | Cassandra CPU per vote | machine CPU per vote | pages/s | page p99 ms | CPU per page |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (b, round, v, p) in &runs {
        println!(
            "| {} | {round} | {:.0} | {} of {} | {:.1} | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} | {:.1} | {:.0} µs |",
            builds[*b].0,
            v.goodput,
            v.refused,
            v.sent,
            v.ok_ms.p99,
            v.server_cpu_us,
            v.cassandra_cpu_us,
            v.machine_cpu_us,
            p.goodput,
            p.ok_ms.p99,
            p.server_cpu_us
        );
    }
    if !overloads.is_empty() {
        println!(
            "\n| build | round | offered | sent | votes/s | ok p99 ms | refused | refusal p99 ms | other errors | dropped connection attempts |"
        );
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for (b, round, times, s) in &overloads {
            println!(
                "| {} | {round} | {times}x, {:.0}/s | {} | {:.0} | {:.1} | {} | {:.1} | {} | {} |",
                builds[*b].0,
                s.offered.unwrap_or_default(),
                s.sent,
                s.goodput,
                s.ok_ms.p99,
                s.refused,
                s.refused_ms.p99,
                s.errors,
                s.listen_drops
            );
        }
    }
    let ratio = |f: &dyn Fn(&AbRun) -> f64| median(0, f) / median(1, f).max(1e-9);
    println!(
        "\nMedians, this build over the other: votes/s {:.2}x, CPU per vote {:.2}x, Cassandra CPU per vote {:.2}x, machine CPU per vote {:.2}x, pages/s {:.2}x, CPU per page {:.2}x",
        ratio(&|r| r.2.goodput),
        ratio(&|r| r.2.server_cpu_us),
        ratio(&|r| r.2.cassandra_cpu_us),
        ratio(&|r| r.2.machine_cpu_us),
        ratio(&|r| r.3.goodput),
        ratio(&|r| r.3.server_cpu_us),
    );
    let json = serde_json::json!({
        "commit": git_commit(),
        "other": other.display().to_string(),
        "date": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "runs": runs.iter().map(|(b, round, v, p)| serde_json::json!({
            "build": builds[*b].0, "round": round, "votes": v, "pages": p,
        })).collect::<Vec<_>>(),
        "overload": overloads.iter().map(|(b, round, times, s)| serde_json::json!({
            "build": builds[*b].0, "round": round, "times": times, "votes": s,
        })).collect::<Vec<_>>(),
    });
    write_json(&dir.join("http-against.json"), &json, "http against");
}

/// Where the bench writes what it measured.
fn results_dir() -> PathBuf {
    let dir = PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
        .join("tally-bench");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

/// Tokens of users `{prefix}0`, `{prefix}1`, ... for the ids in `ids`.
fn tokens(prefix: &str, ids: impl Iterator<Item = u64>) -> Vec<String> {
    let auth = tally::auth::AuthConfig::hs256(SECRET);
    ids.map(|i| {
        tally::auth::mint(
            &auth,
            &format!("{prefix}{i}"),
            Duration::from_secs(7200),
            vec![],
        )
    })
    .collect::<Result<_, _>>()
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn write_json(path: &Path, json: &serde_json::Value, who: &str) {
    std::fs::write(path, serde_json::to_string_pretty(json).unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{who}: wrote {}", path.display());
}

/// How a bench's `tally vote` admits requests.
#[derive(Clone, Copy)]
enum Admission {
    /// As in production: an adaptive limit, refusals paced.
    Adaptive,
    /// The adaptive limit, every refusal answered at once
    /// (`--admission-refusal-ratio 0`).
    Unpaced,
    /// The fixed ceiling of before: an admission target no answer reaches,
    /// so the limit never moves, and refusals answered at once.
    FixedCeiling,
}

/// `tally vote` in a process of its own.
struct Api {
    child: Child,
    base: String,
    /// Its operator endpoints (`/metrics`), host and port.
    ops: String,
}

impl Api {
    /// The API with production settings, except the per-user rate (the
    /// generator's users vote faster than people) and its admission.
    async fn spawn(env: &support::BenchEnv, group: &str, admission: Admission) -> Api {
        Api::spawn_with(env, group, admission, false).await
    }

    /// With `read_limits`, summary reads keep the production per-user limit.
    async fn spawn_with(
        env: &support::BenchEnv,
        group: &str,
        admission: Admission,
        read_limits: bool,
    ) -> Api {
        let this = Path::new(env!("CARGO_BIN_EXE_tally"));
        Api::spawn_binary(this, env, group, admission, read_limits).await
    }

    /// The same from another binary (`TALLY_HTTP_AGAINST`).
    async fn spawn_binary(
        bin: &Path,
        env: &support::BenchEnv,
        group: &str,
        admission: Admission,
        read_limits: bool,
    ) -> Api {
        // A port found free may be taken before tally binds it: it comes from
        // the ephemeral range, which an open loop of vegeta's fills with
        // client connections. A process that exits before it is ready (it
        // could not listen) is started again on other ports.
        for _ in 0..5 {
            let started = Api::try_spawn(bin, env, group, admission, read_limits).await;
            if let Some(api) = started {
                return api;
            }
        }
        panic!("tally vote exited before it became ready, five times");
    }

    /// `None` when the process exited before it became ready.
    async fn try_spawn(
        bin: &Path,
        env: &support::BenchEnv,
        group: &str,
        admission: Admission,
        read_limits: bool,
    ) -> Option<Api> {
        let (port, ops_port) = (free_port(), free_port());
        let mut cmd = server(bin);
        cmd.arg("vote")
            .env("TALLY_LISTEN", format!("127.0.0.1:{port}"))
            .env("TALLY_OPS_LISTEN", format!("127.0.0.1:{ops_port}"))
            .env("TALLY_USER_RATE", "10000")
            .env("TALLY_USER_BURST", "10000")
            .env("TALLY_USER_NEW_TARGETS_RATE", "10000")
            .env("TALLY_USER_NEW_TARGETS_BURST", "10000")
            .env("TALLY_USER_DAILY_VOTES", "100000000")
            .env("TALLY_CONSUMER_GROUP", group)
            .env("TALLY_LOG_FORMAT", "json")
            .env("RUST_LOG", "warn");
        if !read_limits {
            cmd.env("TALLY_USER_READ_RATE", "10000")
                .env("TALLY_USER_READ_BURST", "10000");
        }
        match admission {
            Admission::Adaptive => {}
            Admission::Unpaced => {
                cmd.env("TALLY_ADMISSION_REFUSAL_RATIO", "0");
            }
            Admission::FixedCeiling => {
                cmd.env("TALLY_ADMISSION_TARGET", "1h")
                    .env("TALLY_ADMISSION_REFUSAL_RATIO", "0");
            }
        }
        stores_env(&mut cmd, env);
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("tally vote: {e}"));
        let base = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = client
                .get(format!("http://127.0.0.1:{ops_port}/readyz"))
                .send()
                .await;
            if matches!(&ready, Ok(r) if r.status().is_success()) {
                return Some(Api {
                    child,
                    base,
                    ops: format!("127.0.0.1:{ops_port}"),
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                eprintln!("tally vote exited before it was ready ({status}); starting it again");
                return None;
            }
            assert!(Instant::now() < deadline, "tally vote did not become ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The cache misses it has counted so far (`tally_cache_lookups_total`):
    /// a page's ids that were not in Redis, each read from Cassandra or
    /// joined to a read in flight. 0 before its first lookup, when the
    /// counter is not exported yet; `None` if its metrics cannot be read.
    fn cache_misses(&self) -> Option<u64> {
        use std::io::Read as _;
        let wait = Duration::from_secs(5);
        let addr = self.ops.parse().ok()?;
        let mut conn = std::net::TcpStream::connect_timeout(&addr, wait).ok()?;
        conn.set_read_timeout(Some(wait)).ok()?;
        conn.set_write_timeout(Some(wait)).ok()?;
        let request = format!("GET /metrics HTTP/1.0\r\nHost: {}\r\n\r\n", self.ops);
        conn.write_all(request.as_bytes()).ok()?;
        let mut body = String::new();
        conn.read_to_string(&mut body).ok()?;
        let metrics = tally::cli::Metrics::parse(&body);
        Some(metrics.sum(tally::metrics::CACHE_LOOKUPS, &[("result", "miss")]) as u64)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A bench that panics (a step's assertion, a deadline) leaves no `tally
/// vote` behind holding its ports and the stores' connections.
impl Drop for Api {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn_consumer(env: &support::BenchEnv, group: &str) -> Child {
    let mut cmd = server(Path::new(env!("CARGO_BIN_EXE_tally")));
    cmd.arg("consumer")
        .env("TALLY_CONSUMER_GROUP", group)
        .env("TALLY_CONSUMER_LISTEN", "127.0.0.1:0")
        .env("TALLY_LOG_FORMAT", "json")
        .env("RUST_LOG", "warn");
    stores_env(&mut cmd, env);
    cmd.stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("tally consumer: {e}"))
}

fn stores_env(cmd: &mut Command, env: &support::BenchEnv) {
    cmd.env("TALLY_KEYSPACE", &env.cassandra.keyspace)
        .env("TALLY_CASSANDRA_NODES", env.cassandra.nodes.join(","))
        .env("TALLY_KAFKA_BROKERS", &env.kafka.brokers)
        .env("TALLY_TOPIC", &env.kafka.topic)
        .env("TALLY_DEAD_LETTER_TOPIC", &env.kafka.dead_letter_topic)
        .env("TALLY_REDIS_PREFIX", &env.redis.prefix)
        .env("TALLY_JWT_SECRET", SECRET);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls the consumer group's lag until it is 0, and says how long that took.
/// A lag that could not be read (a broker slow to answer on a busy core), or
/// a group with no partitions yet, is asked again until `limit`.
async fn drained(kafka: &tally::bus::KafkaConfig, group: &str, limit: Duration) -> Option<f64> {
    let started = Instant::now();
    while started.elapsed() < limit {
        let lag = tally::bus::lag::group_lag(kafka, group).unwrap_or_default();
        if !lag.is_empty() && lag.iter().all(|p| p.messages == 0) {
            return Some(started.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// What vegeta sends.
enum Targets<'a> {
    Healthz,
    /// A vote by a random one of the tokens' users on a random one of 10,000
    /// videos, a random action, a new Idempotency-Key each.
    Votes(&'a [String], &'a mut Zipf),
    /// A video page: one of 200 videos and its own 20 comments (21 ids), read
    /// by a random one of the tokens' users.
    Pages(&'a [String], &'a mut Zipf),
}

enum Load {
    /// This many requests in flight, each sent when the last one answered.
    Closed(u64),
    /// This many requests a second, whatever the server does.
    Open(f64),
}

struct Vegeta {
    bin: PathBuf,
    pinned: bool,
}

impl Vegeta {
    fn install(pinned: bool) -> Vegeta {
        Vegeta {
            bin: bench_tool("vegeta"),
            pinned,
        }
    }

    fn command(&self) -> Command {
        generator(&self.bin, self.pinned)
    }

    /// Runs one step and reads vegeta's results back.
    fn attack(&self, api: &Api, targets: &mut Targets, load: Load, secs: u64, dir: &Path) -> Step {
        self.attack_as("http", api, targets, load, secs, dir)
    }

    /// The same, with files of its own (`name`), so two can run at once.
    fn attack_as(
        &self,
        name: &str,
        api: &Api,
        targets: &mut Targets,
        load: Load,
        secs: u64,
        dir: &Path,
    ) -> Step {
        let file = dir.join(format!("{name}-targets.jsonl"));
        let results = dir.join(format!("{name}-results.bin"));
        // Enough targets for the step: open loop sends rate x secs; a closed
        // loop of votes or pages is bounded by what the server answers, far
        // below these. /healthz is one target, sent again and again.
        let (count, lazy) = match (&targets, &load) {
            (Targets::Healthz, _) => (1, false),
            (_, Load::Open(rate)) => ((rate * secs as f64 * 1.05) as u64 + 100, true),
            (Targets::Votes(..), Load::Closed(_)) => (10_000 * secs, true),
            (Targets::Pages(..), Load::Closed(_)) => (20_000 * secs, true),
        };
        write_targets(&file, &api.base, targets, count);
        let mut cmd = self.command();
        cmd.arg("attack")
            .args(["-format", "json", "-timeout", "10s"])
            .arg(format!("-duration={secs}s"))
            .arg(format!("-targets={}", file.display()))
            .arg(format!("-output={}", results.display()));
        if lazy {
            cmd.arg("-lazy");
        }
        match load {
            Load::Closed(n) => {
                cmd.args(["-rate", "0"])
                    .arg(format!("-workers={n}"))
                    .arg(format!("-max-workers={n}"));
            }
            Load::Open(rate) => {
                cmd.arg(format!("-rate={}/1s", rate.round().max(1.0) as u64))
                    .arg("-max-workers=20000");
            }
        }
        let mark = CpuMark::now(api);
        let started = Instant::now();
        let status = cmd
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("vegeta attack: {e}"));
        let seconds = started.elapsed().as_secs_f64().min(secs as f64 + 10.0);
        let cpu = mark.used();
        assert!(status.success(), "vegeta attack failed");
        let step = self.read(&results, load, secs as f64, seconds, cpu);
        if lazy && step.sent >= count {
            eprintln!("http: the step ran out of targets; its rate is a floor");
        }
        let _ = std::fs::remove_file(&file);
        let _ = std::fs::remove_file(&results);
        step
    }

    /// Sorts vegeta's results by outcome, from its CSV encoding:
    /// timestamp, status code, latency in ns, then fields not used here.
    fn read(&self, results: &Path, load: Load, secs: f64, wall: f64, cpu: CpuUsed) -> Step {
        let out = Command::new(&self.bin)
            .args(["encode", "-to", "csv"])
            .stdin(std::fs::File::open(results).unwrap_or_else(|e| panic!("{e}")))
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("vegeta encode: {e}"));
        let (mut ok, mut refused) = (support::histogram(), support::histogram());
        let (mut sent, mut errors) = (0u64, 0u64);
        for line in out.stdout.lines() {
            let Ok(line) = line else { continue };
            let mut fields = line.splitn(4, ',');
            let (_, Some(code), Some(latency)) = (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            sent += 1;
            let micros = latency.parse::<u64>().unwrap_or(0) / 1000;
            match code.parse::<u16>().unwrap_or(0) {
                200..=299 => {
                    let _ = ok.record(micros.max(1));
                }
                503 => {
                    let _ = refused.record(micros.max(1));
                }
                _ => errors += 1,
            }
        }
        let (offered, workers) = match load {
            Load::Open(rate) => (Some(rate), None),
            Load::Closed(n) => (None, Some(n)),
        };
        Step {
            offered,
            workers,
            seconds: secs,
            sent,
            goodput: ok.len() as f64 / secs,
            ok_ms: support::percentiles(&ok),
            refused: refused.len(),
            refused_ms: support::percentiles(&refused),
            errors,
            server_cpu_us: cpu.tally as f64 / sent.max(1) as f64,
            cassandra_cpu_us: cpu.cassandra as f64 / sent.max(1) as f64,
            machine_cpu_us: cpu.machine as f64 / sent.max(1) as f64,
            generator_cpu_us: cpu.children as f64 / sent.max(1) as f64,
            generator_core: cpu.children as f64 / 1e6 / wall.max(1e-9),
            listen_drops: cpu.listen_drops,
            cache_misses: cpu.cache_misses.map(|m| m as f64 / sent.max(1) as f64),
        }
    }
}

/// The path of a load generator, installed by `scripts/bench-tools.sh`.
fn bench_tool(name: &str) -> PathBuf {
    let out = Command::new("scripts/bench-tools.sh")
        .arg(name)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("scripts/bench-tools.sh: {e}"));
    assert!(out.status.success(), "scripts/bench-tools.sh {name} failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A generator's command, on CPU 1 only when `pinned` (TALLY_HTTP_PIN=1;
/// this process is there too then, so this only says so).
fn generator(bin: &Path, pinned: bool) -> Command {
    on_cpu(bin, "1", pinned)
}

/// Writes `count` of vegeta's JSON targets, one a line.
fn write_targets(file: &Path, base: &str, targets: &mut Targets, count: u64) {
    let mut out = BufWriter::new(std::fs::File::create(file).unwrap_or_else(|e| panic!("{e}")));
    static STEP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // Keys unique to this process and step: no step replays another's.
    let step = STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let run = format!("{}-{step}", std::process::id());
    let mut line = String::new();
    let mut next_key = 0u64;
    for _ in 0..count {
        line.clear();
        match targets {
            Targets::Healthz => {
                let _ = write!(line, r#"{{"method":"GET","url":"{base}/healthz"}}"#);
            }
            Targets::Votes(tokens, rng) => {
                let user = rng.below(tokens.len() as u64) as usize;
                let target = rng.below(VOTE_TARGETS);
                let action = ["like", "dislike", "none"][rng.below(3) as usize];
                let body = format!(
                    r#"{{"target_id":"t{target}","target_type":"video","action":"{action}"}}"#
                );
                next_key += 1;
                let _ = write!(
                    line,
                    r#"{{"method":"POST","url":"{base}/v1/votes","body":"{}","header":{{"Authorization":["Bearer {}"],"Content-Type":["application/json"],"Idempotency-Key":["{run}-{next_key}"]}}}}"#,
                    base64(body.as_bytes()),
                    tokens[user]
                );
            }
            Targets::Pages(tokens, rng) => {
                let user = rng.below(tokens.len() as u64) as usize;
                let video = rng.below(PAGES);
                let mut ids = format!("t{video}");
                for i in 0..20 {
                    let _ = write!(ids, ",c{video}_{i}");
                }
                let _ = write!(
                    line,
                    r#"{{"method":"GET","url":"{base}/v1/votes/summary?target_ids={ids}","header":{{"Authorization":["Bearer {}"]}}}}"#,
                    tokens[user]
                );
            }
        }
        line.push('\n');
        out.write_all(line.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
    }
    out.flush().unwrap_or_else(|e| panic!("{e}"));
}

/// wrk (Debian's): closed loop only, in C and on one thread, so on shared
/// cores it takes the least from the servers of the three generators here.
/// Its requests are built by the Lua scripts of benches/wrk, which
/// `benches/wrk/run.sh` uses too.
struct Wrk {
    bin: PathBuf,
    pinned: bool,
    /// One token a line: every voter's, and the readers'.
    voters: PathBuf,
    readers: PathBuf,
}

impl Wrk {
    const VOTES: &str = "votes.lua";
    const PAGES: &str = "pages.lua";

    fn install(pinned: bool, tokens: &[String], dir: &Path) -> Wrk {
        let (voters, readers) = (dir.join("wrk-voters.txt"), dir.join("wrk-readers.txt"));
        for (file, tokens) in [(&voters, tokens), (&readers, &tokens[..READERS as usize])] {
            std::fs::write(file, tokens.join("\n") + "\n").unwrap_or_else(|e| panic!("{e}"));
        }
        Wrk {
            bin: bench_tool("wrk"),
            pinned,
            voters,
            readers,
        }
    }

    /// `connections` requests in flight for `secs`, from `script` with the
    /// users of `tokens`; read back from the script's `done` line. Its
    /// latencies are of every answer: wrk does not tell them apart by status.
    fn closed(&self, api: &Api, script: &str, tokens: &Path, connections: u64, secs: u64) -> Step {
        let mut cmd = generator(&self.bin, self.pinned);
        cmd.args(["-t1", "--timeout", "10s"])
            .arg(format!("-c{connections}"))
            .arg(format!("-d{secs}s"))
            .arg("-s")
            .arg(Path::new("benches/wrk").join(script))
            .arg(&api.base)
            .env("WRK_TOKENS", tokens)
            .stderr(Stdio::inherit());
        let mark = CpuMark::now(api);
        let out = cmd.output().unwrap_or_else(|e| panic!("wrk: {e}"));
        let cpu = mark.used();
        assert!(out.status.success(), "wrk failed");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("tally-wrk "))
            .unwrap_or_else(|| panic!("wrk printed no tally-wrk line:\n{stdout}"));
        let field = |name: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("wrk's line has no {name}: {line}"))
        };
        let (sent, refused, errors) = (field("requests"), field("non2xx"), field("socket_errors"));
        let seconds = field("micros") / 1e6;
        let ms = |name: &str| field(name) / 1000.0;
        Step {
            offered: None,
            workers: Some(connections),
            seconds,
            sent: sent as u64,
            goodput: (sent - refused) / seconds.max(1e-9),
            ok_ms: Percentiles {
                p50: ms("p50"),
                p90: ms("p90"),
                p95: ms("p95"),
                p99: ms("p99"),
                max: ms("max"),
                count: sent as u64,
            },
            refused: refused as u64,
            refused_ms: Percentiles::default(),
            errors: errors as u64,
            server_cpu_us: cpu.tally as f64 / sent.max(1.0),
            cassandra_cpu_us: cpu.cassandra as f64 / sent.max(1.0),
            machine_cpu_us: cpu.machine as f64 / sent.max(1.0),
            generator_cpu_us: cpu.children as f64 / sent.max(1.0),
            generator_core: cpu.children as f64 / 1e6 / seconds.max(1e-9),
            listen_drops: cpu.listen_drops,
            cache_misses: cpu.cache_misses.map(|m| m as f64 / sent.max(1.0)),
        }
    }
}

fn profile_requested() -> bool {
    std::env::var("TALLY_HTTP_PROFILE").is_ok_and(|v| v == "1")
}

/// `perf record` (Debian's linux-perf) on one process, with call graphs.
struct Profile {
    child: Child,
    data: PathBuf,
}

impl Profile {
    fn start(pid: u32, secs: u64, dir: &Path) -> Profile {
        let data = dir.join("profile.data");
        let child = Command::new("perf")
            .args(["record", "-F", "499", "-g", "-o"])
            .arg(&data)
            .args(["-p", &pid.to_string(), "--", "sleep", &secs.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("perf record (apt-get install linux-perf): {e}"));
        Profile { child, data }
    }

    /// Where the samples fell, by symbol, self time, as text.
    fn report(mut self, out: &Path) {
        let _ = self.child.wait();
        let report = Command::new("perf")
            .args([
                "report",
                "--stdio",
                "--no-children",
                "--sort",
                "dso,symbol",
                "--percent-limit",
                "0.5",
                "-g",
                "none",
                "-i",
            ])
            .arg(&self.data)
            .output()
            .unwrap_or_else(|e| panic!("perf report: {e}"));
        let _ = std::fs::write(out, &report.stdout);
        eprintln!("http: profile in {}", out.display());
    }
}

/// 64 tasks of this process each sending a vote and waiting for its answer.
async fn in_process_votes(api: &Api, tokens: &[String], secs: u64) -> Step {
    use std::sync::Arc;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let tokens = Arc::new(tokens.to_vec());
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mark = CpuMark::now(api);
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let (client, tokens, base) = (client.clone(), tokens.clone(), api.base.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Zipf::new(1, 1.0, 7_000 + w);
            let (mut ok, mut refused, mut errors) =
                (support::histogram(), support::histogram(), 0u64);
            while Instant::now() < deadline {
                let user = rng.below(tokens.len() as u64) as usize;
                let action = ["like", "dislike", "none"][rng.below(3) as usize];
                let body = serde_json::json!({
                    "target_id": format!("t{}", rng.below(VOTE_TARGETS)),
                    "target_type": "video",
                    "action": action,
                });
                let start = Instant::now();
                let res = client
                    .post(format!("{base}/v1/votes"))
                    .bearer_auth(&tokens[user])
                    .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
                    .json(&body)
                    .send()
                    .await;
                let micros = start.elapsed().as_micros() as u64;
                match res.map(|r| r.status().as_u16()) {
                    Ok(200..=299) => {
                        let _ = ok.record(micros.max(1));
                    }
                    Ok(503) => {
                        let _ = refused.record(micros.max(1));
                    }
                    _ => errors += 1,
                }
            }
            (ok, refused, errors)
        }));
    }
    let (mut ok, mut refused, mut errors) = (support::histogram(), support::histogram(), 0);
    for t in tasks {
        let (o, r, e) = t.await.unwrap_or_else(|e| panic!("{e}"));
        ok.add(&o).unwrap_or_else(|e| panic!("{e}"));
        refused.add(&r).unwrap_or_else(|e| panic!("{e}"));
        errors += e;
    }
    let sent = ok.len() + refused.len() + errors;
    let cpu = mark.used();
    Step {
        offered: None,
        workers: Some(64),
        seconds: secs as f64,
        sent,
        goodput: ok.len() as f64 / secs as f64,
        ok_ms: support::percentiles(&ok),
        refused: refused.len(),
        refused_ms: support::percentiles(&refused),
        errors,
        server_cpu_us: cpu.tally as f64 / sent.max(1) as f64,
        cassandra_cpu_us: cpu.cassandra as f64 / sent.max(1) as f64,
        machine_cpu_us: cpu.machine as f64 / sent.max(1) as f64,
        generator_cpu_us: cpu.own as f64 / sent.max(1) as f64,
        generator_core: cpu.own as f64 / 1e6 / secs as f64,
        listen_drops: cpu.listen_drops,
        cache_misses: cpu.cache_misses.map(|m| m as f64 / sent.max(1) as f64),
    }
}

/// Standard base64 with padding, for vegeta's JSON bodies.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

// ---------------------------------------------------------------- report

fn report(r: &Results) {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "HTTP bench, {} at {} (service on CPU 0, generators on CPU 1: {})\n",
        r.date, r.commit, r.pinned
    );
    let _ = writeln!(
        md,
        "| ceiling / closed loop | req/s | p50 ms | p99 ms | tally CPU per request | Cassandra CPU per request | machine CPU per request | generator CPU per request |"
    );
    let _ = writeln!(
        md,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (name, step) in [
        ("/healthz, 64 in flight (vegeta)", &r.healthz),
        ("POST /v1/votes, 64 in flight (vegeta)", &r.votes_closed),
        (
            "POST /v1/votes, 64 in flight, from the bench process (reqwest)",
            &r.votes_closed_in_process,
        ),
        (
            "POST /v1/votes, 64 connections (wrk; latency of every answer)",
            &r.votes_closed_wrk,
        ),
        (
            "GET /v1/votes/summary (21 ids), 32 in flight (vegeta)",
            &r.pages_closed,
        ),
        (
            "GET /v1/votes/summary (21 ids), 32 connections (wrk; latency of every answer)",
            &r.pages_closed_wrk,
        ),
    ] {
        if let Some(s) = step {
            let _ = writeln!(
                md,
                "| {name} | {:.0} | {:.2} | {:.2} | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} µs |",
                s.goodput,
                s.ok_ms.p50,
                s.ok_ms.p99,
                s.server_cpu_us,
                s.cassandra_cpu_us,
                s.machine_cpu_us,
                s.generator_cpu_us
            );
        }
    }
    for s in &r.store {
        let _ = writeln!(
            md,
            "| store: {}, 64 in flight | {:.0} | {:.2} | {:.2} | | {:.0} µs | {:.0} µs |",
            s.name,
            s.ops_per_sec,
            s.latency_ms.p50,
            s.latency_ms.p99,
            s.store_cpu_us,
            s.machine_cpu_us
        );
    }
    let _ = writeln!(
        md,
        "\nconsumer drained {:?} s after the closed-loop votes\n",
        r.consumer_drain_secs
    );
    ratios(&mut md, r);
    for (name, steps) in [
        ("votes, open loop", &r.votes_curve),
        ("pages, open loop", &r.pages_curve),
        ("votes overload, adaptive admission", &r.overload_after),
        ("votes overload, fixed ceiling (before)", &r.overload_before),
    ] {
        steps_table(&mut md, name, steps);
        md.push('\n');
    }
    println!("{md}");
    let dir = results_dir();
    let _ = std::fs::write(
        dir.join("http.json"),
        serde_json::to_string_pretty(r).unwrap_or_default(),
    );
    let _ = std::fs::write(dir.join("http.md"), &md);
    let _ = std::fs::write(dir.join("http-latency.svg"), svg(r));
    eprintln!("results in {}", dir.display());
}

/// Open-loop steps as a Markdown table.
fn steps_table(md: &mut String, name: &str, steps: &[Step]) {
    let _ = writeln!(
        md,
        "| {name}: offered/s | sent | goodput/s | ok p50 ms | ok p99 ms | 503s | 503 p50 ms | 503 p99 ms | other errors | dropped connection attempts | tally CPU/request | generator CPU/request | generator's core busy | cache misses/request |"
    );
    let _ = writeln!(
        md,
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for s in steps {
        let _ = writeln!(
            md,
            "| {:.0} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} | {} | {:.0} µs | {:.0} µs | {:.0}%{} | {} |",
            s.offered.unwrap_or_default(),
            s.sent,
            s.goodput,
            s.ok_ms.p50,
            s.ok_ms.p99,
            s.refused,
            s.refused_ms.p50,
            s.refused_ms.p99,
            s.errors,
            s.listen_drops,
            s.server_cpu_us,
            s.generator_cpu_us,
            s.generator_core * 100.0,
            if saturated(s) { " (saturated)" } else { "" },
            s.cache_misses
                .map_or_else(|| "unread".to_string(), |m| format!("{m:.2}"))
        );
    }
}

/// The retry storms: goodput against the capacity, and what every answer
/// (refusals included: wrk does not tell them apart) took.
fn storms_table(md: &mut String, storms: &[(&str, Step)], capacity: f64) {
    let _ = writeln!(
        md,
        "| a storm of {STORM} connections (wrk) | answers/s | goodput/s | × capacity | p50 ms | p99 ms | 503s | tally CPU/request | generator's core busy |"
    );
    let _ = writeln!(
        md,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (name, s) in storms {
        let _ = writeln!(
            md,
            "| {name} | {:.0} | {:.0} | {:.2}x | {:.2} | {:.2} | {} | {:.0} µs | {:.0}%{} |",
            s.sent as f64 / s.seconds.max(1e-9),
            s.goodput,
            s.goodput / capacity,
            s.ok_ms.p50,
            s.ok_ms.p99,
            s.refused,
            s.server_cpu_us,
            s.generator_core * 100.0,
            if saturated(s) { " (saturated)" } else { "" }
        );
    }
    md.push('\n');
}

/// A step whose generator was busy for 90% of a core or more: pinned to one
/// core, it could not send at its rate, and what the step shows is the
/// generator's limit as much as the service's.
fn saturated(s: &Step) -> bool {
    pinned() && s.generator_core >= 0.9
}

/// The must-show ratios of the closed loops, each generator's in turn.
fn ratios(md: &mut String, r: &Results) {
    let lwt = support::rate_of(&r.store, Op::BareLwt);
    let generators = [
        ("vegeta", &r.votes_closed),
        ("reqwest", &r.votes_closed_in_process),
        ("wrk", &r.votes_closed_wrk),
    ];
    for (name, votes) in generators {
        if let (Some(votes), Some(lwt)) = (votes, lwt) {
            let _ = writeln!(
                md,
                "- vote API ({name}) against the bare LWT: {:.2}x",
                votes.goodput / lwt.max(1e-9)
            );
        }
    }
    if let Some(in_repo) = &r.votes_closed_in_process {
        for (name, votes) in [generators[0], generators[2]] {
            if let Some(votes) = votes {
                let _ = writeln!(
                    md,
                    "- in-repo (reqwest) against external ({name}), votes/s: {:.2}x",
                    in_repo.goodput / votes.goodput.max(1e-9)
                );
            }
        }
    }
    if let (Some(vegeta), Some(wrk)) = (&r.pages_closed, &r.pages_closed_wrk) {
        let _ = writeln!(
            md,
            "- pages/s, wrk against vegeta: {:.2}x",
            wrk.goodput / vegeta.goodput.max(1e-9)
        );
    }
    md.push('\n');
}

/// p50 and p99 against the offered rate, votes and pages side by side.
fn svg(r: &Results) -> String {
    let (panel_w, panel_h, pad) = (440.0, 300.0, 50.0);
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='11'>\n\
         <text x='10' y='18' font-size='13'>Latency against offered load, open loop (vegeta), {} at {}</text>\n",
        2.0 * panel_w + 40.0,
        panel_h + 70.0,
        r.date,
        r.commit
    );
    let votes: Vec<&Step> = r
        .votes_curve
        .iter()
        .chain(r.overload_after.first())
        .collect();
    for (i, (title, steps)) in [
        ("POST /v1/votes", votes),
        (
            "GET /v1/votes/summary, 21 ids",
            r.pages_curve.iter().collect(),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let x0 = 20.0 + i as f64 * (panel_w + 20.0);
        let y0 = 40.0;
        let max_x = steps.iter().filter_map(|s| s.offered).fold(1.0, f64::max);
        let max_y = steps.iter().map(|s| s.ok_ms.p99).fold(1.0, f64::max);
        let px = |x: f64| x0 + pad + x / max_x * (panel_w - pad - 10.0);
        let py = |y: f64| y0 + panel_h - pad + 10.0 - y / max_y * (panel_h - pad - 10.0);
        let _ = writeln!(
            s,
            "<text x='{:.0}' y='{:.0}' font-size='12'>{title}</text>\n\
             <line x1='{:.0}' y1='{:.0}' x2='{:.0}' y2='{:.0}' stroke='black'/>\n\
             <line x1='{:.0}' y1='{:.0}' x2='{:.0}' y2='{:.0}' stroke='black'/>\n\
             <text x='{:.0}' y='{:.0}'>offered requests/s (max {max_x:.0})</text>\n\
             <text x='{:.0}' y='{:.0}'>ms (max {max_y:.1})</text>",
            x0 + pad,
            y0 + 4.0,
            px(0.0),
            py(0.0),
            px(max_x),
            py(0.0),
            px(0.0),
            py(0.0),
            px(0.0),
            py(max_y),
            px(0.0),
            py(0.0) + 30.0,
            x0,
            y0 + 16.0,
        );
        for (label, color, pick) in [
            (
                "p50",
                "#4c78a8",
                (|s: &Step| s.ok_ms.p50) as fn(&Step) -> f64,
            ),
            ("p99", "#e45756", |s: &Step| s.ok_ms.p99),
        ] {
            let points: Vec<String> = steps
                .iter()
                .filter_map(|st| {
                    st.offered
                        .map(|x| format!("{:.1},{:.1}", px(x), py(pick(st))))
                })
                .collect();
            let _ = writeln!(
                s,
                "<polyline fill='none' stroke='{color}' stroke-width='2' points='{}'/>",
                points.join(" ")
            );
            for st in &steps {
                if let Some(x) = st.offered {
                    let _ = writeln!(
                        s,
                        "<circle cx='{:.1}' cy='{:.1}' r='3' fill='{color}'/><text x='{:.1}' y='{:.1}' fill='{color}'>{:.1}</text>",
                        px(x),
                        py(pick(st)),
                        px(x) + 4.0,
                        py(pick(st)) - 4.0,
                        pick(st)
                    );
                }
            }
            let ly = if label == "p50" { 30.0 } else { 44.0 };
            let _ = writeln!(
                s,
                "<text x='{:.0}' y='{:.0}' fill='{color}'>{label}</text>",
                x0 + panel_w - 60.0,
                y0 + ly
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
