//! What correctness costs under load, every figure a ratio of two runs made
//! side by side in this one process, on this machine:
//!
//! - store: vote writes with 64 in flight, conditional (the real store code)
//!   against plain upserts, and a viral target against a uniform spread;
//! - consumer: transitions counted by the real consumer, batched against one
//!   write per event, for two workloads: Zipf(1.1) over 10,000 targets, and
//!   90% of them on one target;
//! - e2e: an open-loop generator (fixed arrival rate, latency measured from
//!   the scheduled send time, so coordinated omission is corrected) against
//!   the real vote API with Kafka, Redis and the consumer in the loop.
//!
//!   cargo bench --bench load                       # everything
//!   TALLY_BENCH=store cargo bench --bench load     # one section: store | consumer | e2e
//!
//! Knobs: TALLY_BENCH_SECS (store run length, default 15), TALLY_BENCH_WARM_SECS
//! (each store run's unmeasured warm-up, default 15, 0 for none), TALLY_BENCH_EVENTS
//! (consumer events, default 200000), TALLY_BENCH_BASELINE_SECS (time given
//! to the per-event baseline, default 60), TALLY_BENCH_E2E_SECS (per rate
//! step, default 10). Results: stdout (Markdown), target/tally-bench/.

#[path = "load/report.rs"]
mod report;
#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use report::{ConsumerRun, RateStep, Results, StoreRun};
use support::{
    Op, StoreOps, Zipf, bench_env, env_num, histogram, percentiles, store_runs, warm_up,
};
use tally::domain::Reaction;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo bench probing for criterion-style listing
    }
    if !support::stack_up() {
        support::skip_message("load bench");
        return;
    }
    let which = std::env::var("TALLY_BENCH").unwrap_or_else(|_| "all".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut results = Results {
        date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        commit: std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default(),
        ..Results::default()
    };
    rt.block_on(async {
        if which == "all" || which == "store" {
            store_section(&mut results).await;
        }
        if which == "all" || which == "consumer" {
            consumer_section(&mut results).await;
        }
        if which == "all" || which == "e2e" {
            e2e_section(&mut results).await;
        }
        if which == "all" || which == "outage" {
            outage_section().await;
        }
    });
    report::report(&results);
}

// ---------------------------------------------------------------- store

async fn store_section(results: &mut Results) {
    let secs = env_num("TALLY_BENCH_SECS", 15);
    let env = bench_env("load_store", 1).await;
    let stores = StoreOps::open(&env).await;
    let runs = [
        ("plain upsert, uniform", Op::Upsert, false),
        (
            "bare single-row LWT (INSERT IF NOT EXISTS)",
            Op::BareLwt,
            false,
        ),
        (
            "read, then the conditional batch (no outbox)",
            Op::ReadThenWrite,
            false,
        ),
        (
            "vote before: read, outbox intent, then the batch with the transition",
            Op::ReadThenVote,
            false,
        ),
        (
            "vote: outbox intent, then the optimistic conditional batch",
            Op::Vote,
            false,
        ),
        (
            "vote without its intent: the optimistic batch, the transition in its record",
            Op::VoteBatchOnly,
            false,
        ),
        (
            "vote without the outbox: the optimistic batch, no intent, no transition",
            Op::VoteNoOutbox,
            false,
        ),
        ("vote, 90% on one target", Op::Vote, true),
        (
            "counting a transition fenced: the conditional batch on seq and the applied row",
            Op::CountFenced,
            false,
        ),
        (
            "counting a transition stamped: a plain batch USING TIMESTAMP",
            Op::CountStamped,
            false,
        ),
        (
            "vote, then its transition counted fenced",
            Op::VoteCountedFenced,
            false,
        ),
        (
            "vote, then its transition counted stamped",
            Op::VoteCountedStamped,
            false,
        ),
        (
            "counting a transition sharded: a conditional batch of a shard's queue",
            Op::CountSharded,
            false,
        ),
        (
            "vote, then its transition counted sharded",
            Op::VoteCountedSharded,
            false,
        ),
    ];
    warm_up(&runs, "load_store_warm").await;
    results.store = store_runs(&stores, &runs, Duration::from_secs(secs), 3).await;
    env.drop_all().await;
}

// ---------------------------------------------------------------- consumer

/// The consumer's workloads: which target each transition is for.
#[derive(Debug, Clone, Copy)]
enum Workload {
    /// Zipf(1.1) over 10,000 targets: many lukewarm targets, each batch's
    /// events spread over hundreds of them.
    Zipf,
    /// 90% on one target, the rest Zipf(1.1) over 10,000 (as the store
    /// section's hot run): a viral video.
    Hot,
}

impl Workload {
    fn describe(self) -> &'static str {
        match self {
            Workload::Zipf => "Zipf(1.1) over 10,000 targets",
            Workload::Hot => "90% on one target, the rest Zipf(1.1) over 10,000",
        }
    }

    fn target(self, zipf: &mut Zipf) -> usize {
        match self {
            Workload::Zipf => zipf.sample(),
            Workload::Hot if zipf.below(10) < 9 => 0,
            Workload::Hot => zipf.sample(),
        }
    }
}

async fn consumer_section(results: &mut Results) {
    for workload in [Workload::Zipf, Workload::Hot] {
        consumer_workload(workload, results).await;
    }
}

/// Publishes the workload's transitions once, then counts them batched and
/// per event (each into a keyspace of its own, each its own group).
async fn consumer_workload(workload: Workload, results: &mut Results) {
    let n_events = env_num("TALLY_BENCH_EVENTS", 200_000);
    let baseline_secs = env_num("TALLY_BENCH_BASELINE_SECS", 60);
    let name = format!("load_consumer_{workload:?}").to_lowercase();
    let env = bench_env(&name, 6).await;
    let baseline_env = bench_env(&format!("{name}_base"), 1).await;

    eprintln!(
        "consumer: producing {n_events} transitions, {}",
        workload.describe()
    );
    produce_transitions(&env, workload, n_events).await;

    for (mode, cassandra, limit) in [
        (tally::consumer::WriteMode::Batched, &env.cassandra, None),
        (
            tally::consumer::WriteMode::PerEvent,
            &baseline_env.cassandra,
            Some(Duration::from_secs(baseline_secs)),
        ),
    ] {
        eprintln!(
            "consumer: counting in {mode:?} mode{}",
            limit.map_or(String::new(), |l| format!(" for at most {}s", l.as_secs()))
        );
        let config = support::consumer_config(
            format!("bench-{name}-{mode:?}-{}", std::process::id()),
            mode,
            tally::ops::Stores {
                cassandra: cassandra.clone(),
                ..env.stores()
            },
        );
        let (stop, rx) = tokio::sync::watch::channel(false);
        let progress = Arc::new(tally::consumer::Progress::default());
        let cpu_before = (
            support::cassandra_cpu_micros(),
            support::machine_cpu_micros(),
        );
        let started = Instant::now();
        let task = tokio::spawn(tally::consumer::run(config, rx, progress.clone()));
        while progress.processed.load(Ordering::Relaxed) < n_events
            && limit.is_none_or(|l| started.elapsed() < l)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let processed = progress.processed.load(Ordering::Relaxed);
        let requests = progress.requests.load(Ordering::Relaxed);
        let per_event = |micros: u64| micros as f64 / processed.max(1) as f64;
        let store_cpu_us = per_event(support::cassandra_cpu_micros().saturating_sub(cpu_before.0));
        let machine_cpu_us = per_event(support::machine_cpu_micros().saturating_sub(cpu_before.1));
        let _ = stop.send(true);
        let _ = task.await;
        results.consumer.push(ConsumerRun {
            workload: workload.describe().into(),
            mode: format!("{mode:?}"),
            events: processed,
            seconds,
            events_per_sec: processed as f64 / seconds,
            requests_per_event: requests as f64 / processed.max(1) as f64,
            fenced_writes: progress.writes.load(Ordering::Relaxed),
            store_cpu_us,
            machine_cpu_us,
        });
    }
    env.drop_all().await;
    baseline_env.drop_all().await;
}

/// `n` transitions of the workload to `env`'s topic, keyed by target as the
/// vote API keys them: users drawn uniformly from 50,000, each user's
/// versions in order per target, every action a change.
async fn produce_transitions(env: &support::BenchEnv, workload: Workload, n: u64) {
    use futures::StreamExt;

    let transitions = env.transitions();
    let mut zipf = Zipf::new(10_000, 1.1, 42);
    let mut state: HashMap<(u32, usize), (i64, Reaction)> = HashMap::new();
    let mut pending = futures::stream::FuturesUnordered::new();
    for _ in 0..n {
        let target = workload.target(&mut zipf);
        let user = zipf.below(50_000) as u32;
        let (version, from) = state
            .get(&(user, target))
            .copied()
            .unwrap_or((0, Reaction::None));
        let to = Reaction::ALL
            .iter()
            .copied()
            .filter(|r| *r != from)
            .nth(zipf.below(2) as usize)
            .unwrap_or(Reaction::Like);
        state.insert((user, target), (version + 1, to));
        pending.push(transitions.send(
            format!("t{target}"),
            format!("u{user}"),
            from.as_str(),
            to.as_str(),
            version + 1,
        ));
        if pending.len() >= 5000 {
            pending.next().await;
        }
    }
    while pending.next().await.is_some() {}
}

// ---------------------------------------------------------------- e2e

const SECRET: &str = "bench-secret-of-32-bytes-or-more-0123";

async fn e2e_section(results: &mut Results) {
    let secs = env_num("TALLY_BENCH_E2E_SECS", 10);
    let env = bench_env("load_e2e", 6).await;
    let api = api_config(&env, env.kafka.clone());
    let app = tally::api::Application::build(api)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let base = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until_stopped());
    let (stop, rx) = tokio::sync::watch::channel(false);
    let consumer_config = support::consumer_config(
        format!("bench-e2e-{}", std::process::id()),
        tally::consumer::WriteMode::Batched,
        env.stores(),
    );
    let consumer = tokio::spawn(tally::consumer::run(consumer_config, rx, Arc::default()));

    let (tokens, client) = voters_and_client();

    // Closed loop, 64 in flight: the API's saturation throughput, to set
    // against the store's bare conditional-write rate.
    eprintln!("e2e: closed loop, 64 in flight, {secs}s");
    let deadline = Instant::now() + Duration::from_secs(secs);
    let cpu_before = (
        support::cassandra_cpu_micros(),
        support::machine_cpu_micros(),
    );
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Zipf::new(10_000, 1.1, 1000 + w);
            let (mut h, mut errors) = (histogram(), 0u64);
            while Instant::now() < deadline {
                let start = Instant::now();
                if !write_once(&client, &base, &tokens, &mut rng).await {
                    errors += 1;
                }
                let _ = h.record(start.elapsed().as_micros() as u64);
            }
            (h, errors)
        }));
    }
    let started = Instant::now();
    let (mut all, mut errors) = (histogram(), 0);
    for t in tasks {
        let (h, e) = t.await.unwrap_or_else(|e| panic!("{e}"));
        all.add(&h).unwrap_or_else(|e| panic!("{e}"));
        errors += e;
    }
    results.e2e_closed_loop_writes = Some(StoreRun {
        name: "vote API POST /v1/votes, 64 in flight".into(),
        op: "api".into(),
        hot: false,
        ops_per_sec: all.len() as f64 / started.elapsed().as_secs_f64(),
        store_cpu_us: support::cassandra_cpu_micros().saturating_sub(cpu_before.0) as f64
            / all.len().max(1) as f64,
        machine_cpu_us: support::machine_cpu_micros().saturating_sub(cpu_before.1) as f64
            / all.len().max(1) as f64,
        latency_ms: percentiles(&all),
        cas_unknown: 0,
        conflicts: errors,
    });

    for rate in [50, 100, 200, 300, 400, 600, 800] {
        eprintln!("e2e: writes, open loop at {rate}/s for {secs}s");
        let step =
            open_loop(rate, secs, {
                let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
                move |i| {
                    let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
                    async move {
                        write_once(&client, &base, &tokens, &mut Zipf::new(10_000, 1.1, i)).await
                    }
                }
            })
            .await;
        let overloaded = step.latency_ms.p95 > 300.0;
        results.e2e_writes.push(step);
        if overloaded {
            break;
        }
    }
    for rate in [100, 200, 400, 800, 1200, 1600, 2400] {
        eprintln!("e2e: summary reads of 21 ids, open loop at {rate}/s for {secs}s");
        let step =
            open_loop(rate, secs, {
                let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
                move |i| {
                    let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
                    async move {
                        read_once(&client, &base, &tokens, &mut Zipf::new(10_000, 1.1, i)).await
                    }
                }
            })
            .await;
        let overloaded = step.latency_ms.p95 > 60.0;
        results.e2e_reads.push(step);
        if overloaded {
            break;
        }
    }
    let _ = stop.send(true);
    let _ = consumer.await;
    env.drop_all().await;
}

/// Tokens for 2,000 voters, and an HTTP client with room for them all.
fn voters_and_client() -> (Arc<Vec<String>>, reqwest::Client) {
    let auth = tally::auth::AuthConfig::hs256(SECRET);
    let tokens = (0..2000)
        .map(|i| tally::auth::mint(&auth, &format!("u{i}"), Duration::from_secs(7200), vec![]))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e:#}"));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    (Arc::new(tokens), client)
}

/// The vote API as the benches run it: limits out of the way, everything
/// else as in production.
fn api_config(env: &support::BenchEnv, kafka: tally::bus::KafkaConfig) -> tally::api::ApiConfig {
    tally::api::ApiConfig {
        listen: "127.0.0.1:0".into(),
        ops_listen: "127.0.0.1:0".into(),
        workers: 2,
        idempotency_ttl: Duration::from_secs(3600),
        publish_timeout: Duration::from_secs(3),
        publish_wait: Duration::from_millis(500),
        user_rate: 1000.0,
        user_burst: 1000,
        user_read_rate: 10_000.0,
        user_read_burst: 10_000,
        user_daily_votes: 1_000_000,
        user_new_targets_rate: 10_000.0,
        user_new_targets_burst: 10_000,
        targets: tally::api::targets::TargetRules::default(),
        max_in_flight: 4096,
        min_in_flight: 4,
        slow_request: Duration::from_millis(500),
        body_timeout: Duration::from_secs(5),
        admission_target: Duration::from_secs(60),
        admission_queue_wait: Duration::from_millis(50),
        admission_refusal_ratio: 15.0,
        demo: false,
        consumer_group: format!("bench-e2e-{}", std::process::id()),
        relay: tally::relay::RelayConfig {
            settle: Duration::from_secs(25),
            interval: Duration::from_secs(2),
            horizon: Duration::from_secs(900),
            disabled: false,
        },
        auth: tally::auth::AuthConfig::hs256(SECRET),
        cache_ttl: tally::cache::TtlPolicy {
            min: Duration::from_secs(60),
            max: Duration::from_secs(3600),
        },
        stores: tally::ops::Stores {
            cassandra: env.cassandra.clone(),
            kafka,
            redis: env.redis.clone(),
        },
    }
}

// ---------------------------------------------------------------- outage

/// Votes per second through the API with Kafka reachable, then with Kafka
/// unreachable (the relay publishes later), in one run: what an outage
/// costs the write path. Closed loop, 64 in flight, each for
/// TALLY_BENCH_E2E_SECS.
async fn outage_section() {
    let secs = env_num("TALLY_BENCH_E2E_SECS", 10);
    let env = bench_env("load_outage", 6).await;
    let (tokens, client) = voters_and_client();
    let mut rates = Vec::new();
    for (name, brokers) in [
        ("Kafka reachable", env.kafka.brokers.clone()),
        ("Kafka unreachable", "127.0.0.1:9".to_owned()),
    ] {
        let mut kafka = env.kafka.clone();
        kafka.brokers = brokers;
        let mut api = api_config(&env, kafka);
        // Nothing publishes the cut-off run's votes: its relay is off.
        api.relay.disabled = true;
        let app = tally::api::Application::build(api)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let base = format!("http://127.0.0.1:{}", app.port());
        tokio::spawn(app.run_until_stopped());
        let deadline = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..64u64 {
            let (client, tokens, base) = (client.clone(), tokens.clone(), base.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Zipf::new(10_000, 1.1, 5000 + w);
                let mut ok = 0u64;
                while Instant::now() < deadline {
                    ok += u64::from(write_once(&client, &base, &tokens, &mut rng).await);
                }
                ok
            }));
        }
        let mut ok = 0;
        for t in tasks {
            ok += t.await.unwrap_or_else(|e| panic!("{e}"));
        }
        let rate = ok as f64 / secs as f64;
        eprintln!("outage: {name}: {rate:.0} votes/s accepted");
        rates.push(rate);
    }
    if let [up, down] = rates[..] {
        eprintln!(
            "outage: votes/s with Kafka unreachable / reachable = {:.2}",
            down / up.max(1.0)
        );
    }
    env.drop_all().await;
}

async fn write_once(
    client: &reqwest::Client,
    base: &str,
    tokens: &[String],
    rng: &mut Zipf,
) -> bool {
    let user = rng.below(tokens.len() as u64) as usize;
    let target = rng.sample();
    let action = ["like", "dislike", "none"][rng.below(3) as usize];
    let res = client
        .post(format!("{base}/v1/votes"))
        .bearer_auth(&tokens[user])
        .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
        .json(&serde_json::json!({"target_id": format!("t{target}"), "target_type": "video", "action": action}))
        .send()
        .await;
    matches!(res, Ok(r) if r.status().is_success())
}

async fn read_once(
    client: &reqwest::Client,
    base: &str,
    tokens: &[String],
    rng: &mut Zipf,
) -> bool {
    let user = rng.below(tokens.len() as u64) as usize;
    // A video page: a Zipf-popular video and the twenty comments shown under
    // it (the same ones for the same video, as on a real page).
    let video = rng.sample();
    let mut ids = vec![format!("t{video}")];
    ids.extend((0..20).map(|i| format!("c{video}_{i}")));
    let res = client
        .get(format!(
            "{base}/v1/votes/summary?target_ids={}",
            ids.join(",")
        ))
        .bearer_auth(&tokens[user])
        .send()
        .await;
    matches!(res, Ok(r) if r.status().is_success())
}

/// Sends request `i` at `start + i / rate`, whatever earlier requests are
/// doing, and measures each from its scheduled time: a stall shows up as
/// the latency of every request it delayed (coordinated omission corrected).
async fn open_loop<F, Fut>(rate: u64, secs: u64, request: F) -> RateStep
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let total = rate * secs;
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut handles = Vec::with_capacity(total as usize);
    for i in 0..total {
        let scheduled = start + Duration::from_secs_f64(i as f64 / rate as f64);
        tokio::time::sleep_until(scheduled).await;
        let fut = request(i + 7);
        handles.push(tokio::spawn(async move {
            let ok = tokio::time::timeout(Duration::from_secs(10), fut)
                .await
                .unwrap_or(false);
            (scheduled.elapsed(), ok)
        }));
    }
    let (mut h, mut errors) = (histogram(), 0);
    let mut last_done = start;
    for handle in handles {
        let (latency, ok) = handle.await.unwrap_or((Duration::from_secs(10), false));
        let _ = h.record(latency.as_micros() as u64);
        if !ok {
            errors += 1;
        }
        last_done = last_done.max(tokio::time::Instant::now());
    }
    let achieved = total as f64 / (last_done - start).as_secs_f64().max(secs as f64);
    RateStep {
        rate,
        achieved,
        latency_ms: percentiles(&h),
        errors,
    }
}
