//! What correctness costs under load, every figure a ratio of two runs made
//! side by side in this one process, on this machine:
//!
//! - store: vote writes with 64 in flight, conditional (the real store code)
//!   against plain upserts, and a viral target against a uniform spread;
//! - consumer: Zipf(1.1) transitions over 10,000 targets counted by the real
//!   consumer, batched against one write per event;
//! - e2e: an open-loop generator (fixed arrival rate, latency measured from
//!   the scheduled send time, so coordinated omission is corrected) against
//!   the real vote API with Kafka, Redis and the consumer in the loop.
//!
//!   cargo bench --bench load                       # everything
//!   TALLY_BENCH=store cargo bench --bench load     # one section: store | consumer | e2e
//!
//! Knobs: TALLY_BENCH_SECS (store run length, default 15), TALLY_BENCH_EVENTS
//! (consumer events, default 200000), TALLY_BENCH_BASELINE_SECS (time given
//! to the per-event baseline, default 60), TALLY_BENCH_E2E_SECS (per rate
//! step, default 10). Results: stdout (Markdown), target/tally-bench/.

#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use support::{Percentiles, Zipf, bench_env, histogram, percentiles};
use tally::domain::{IdempotencyKey, Reaction, TargetId, TargetType, UserId};
use tally::store::Cas;
use tally::store::Store;
use tally::store::reactions::{Change, KeyRecord};

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone, Serialize)]
struct StoreRun {
    name: String,
    ops_per_sec: f64,
    latency_ms: Percentiles,
    cas_unknown: u64,
    conflicts: u64,
}

#[derive(Debug, Clone, Serialize)]
struct ConsumerRun {
    mode: String,
    events: u64,
    seconds: f64,
    events_per_sec: f64,
    requests_per_event: f64,
    fenced_writes: u64,
}

#[derive(Debug, Clone, Serialize)]
struct RateStep {
    rate: u64,
    achieved: f64,
    latency_ms: Percentiles,
    errors: u64,
}

#[derive(Debug, Default, Serialize)]
struct Results {
    date: String,
    commit: String,
    store: Vec<StoreRun>,
    consumer: Vec<ConsumerRun>,
    e2e_writes: Vec<RateStep>,
    e2e_reads: Vec<RateStep>,
    e2e_closed_loop_writes: Option<StoreRun>,
}

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
    });
    report(&results);
}

// ---------------------------------------------------------------- store

async fn store_section(results: &mut Results) {
    let secs = env_num("TALLY_BENCH_SECS", 15);
    let env = bench_env("load_store", 1).await;
    let store = Arc::new(
        Store::open(&env.cassandra, Duration::from_secs(3600))
            .await
            .unwrap_or_else(|e| panic!("{e:#}")),
    );
    let session = Arc::new(
        tally::store::connect_keyspace(&env.cassandra)
            .await
            .unwrap_or_else(|e| panic!("{e:#}")),
    );
    let upsert = session
        .prepare("INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES (?, ?, ?, ?, ?)")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    for (name, lwt, hot) in [
        ("plain upsert, uniform", false, false),
        ("LWT vote, uniform over 10,000 targets", true, false),
        ("LWT vote, 90% on one target", true, true),
    ] {
        eprintln!("store: {name}, 64 in flight, {secs}s");
        let deadline = Instant::now() + Duration::from_secs(secs);
        let (unknown, conflicts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut tasks = Vec::new();
        for w in 0..64u64 {
            let (store, session, upsert, unknown, conflicts) = (
                store.clone(),
                session.clone(),
                upsert.clone(),
                unknown.clone(),
                conflicts.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut rng = Zipf::new(1, 1.0, w + 1);
                let mut h = histogram();
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let user = format!("u{}", rng.below(20_000));
                    let target = if hot && rng.uniform() < 0.9 {
                        "viral".to_owned()
                    } else {
                        format!("t{}", rng.below(10_000))
                    };
                    let start = Instant::now();
                    if lwt {
                        match lwt_vote(&store, &user, &target, w * 1_000_000 + n).await {
                            Cas::Applied => {}
                            Cas::NotApplied => {
                                conflicts.fetch_add(1, Ordering::Relaxed);
                            }
                            Cas::Unknown(_) => {
                                unknown.fetch_add(1, Ordering::Relaxed);
                            }
                            Cas::Failed(e) => panic!("{e:#}"),
                        }
                    } else {
                        let state = if n % 2 == 0 { "like" } else { "none" };
                        session
                            .execute_unpaged(&upsert, (&user, &target, "video", state, n as i64))
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                    let _ = h.record(start.elapsed().as_micros() as u64);
                    n += 1;
                }
                h
            }));
        }
        let started = Instant::now();
        let mut all = histogram();
        for t in tasks {
            let h = t.await.unwrap_or_else(|e| panic!("{e}"));
            all.add(&h).unwrap_or_else(|e| panic!("{e}"));
        }
        let elapsed = started.elapsed().as_secs_f64().max(secs as f64);
        results.store.push(StoreRun {
            name: name.into(),
            ops_per_sec: all.len() as f64 / elapsed,
            latency_ms: percentiles(&all),
            cas_unknown: unknown.load(Ordering::Relaxed),
            conflicts: conflicts.load(Ordering::Relaxed),
        });
    }
    env.drop_all().await;
}

/// One vote through the store, as `cast` does it: the snapshot read, then the
/// conditional batch with an idempotency record.
async fn lwt_vote(store: &Store, user: &str, target: &str, n: u64) -> Cas {
    let (user, target) = (
        UserId::parse(user).unwrap_or_else(|e| panic!("{e}")),
        TargetId::parse(target).unwrap_or_else(|e| panic!("{e}")),
    );
    let key = IdempotencyKey::parse(&format!("k{n}")).unwrap_or_else(|e| panic!("{e}"));
    let snap = match store.reactions.snapshot(&user, &target, &key, false).await {
        Ok(s) => s,
        Err(e) => return Cas::Unknown(e.into()),
    };
    let from = snap.current.map_or(Reaction::None, |c| c.state);
    let to = if from == Reaction::Like {
        Reaction::Dislike
    } else {
        Reaction::Like
    };
    let record = KeyRecord {
        request_hash: "h".into(),
        owner: uuid::Uuid::new_v4(),
        status: 200,
        body: "{}".into(),
    };
    let change = Change {
        user: &user,
        target: &target,
        target_type: TargetType::Video,
        expected: snap.current.map(|c| c.version),
        to,
        key: &key,
        record: &record,
    };
    store.reactions.commit(&change).await
}

// ---------------------------------------------------------------- consumer

async fn consumer_section(results: &mut Results) {
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let n_events = env_num("TALLY_BENCH_EVENTS", 200_000);
    let baseline_secs = env_num("TALLY_BENCH_BASELINE_SECS", 60);
    let env = bench_env("load_consumer", 6).await;
    let baseline_env = bench_env("load_consumer_base", 1).await;

    eprintln!("consumer: producing {n_events} Zipf(1.1) transitions over 10,000 targets");
    let producer: FutureProducer = env
        .kafka
        .client()
        .set("linger.ms", "20")
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut zipf = Zipf::new(10_000, 1.1, 42);
    let mut state: HashMap<(u32, usize), (i64, Reaction)> = HashMap::new();
    let mut pending = futures::stream::FuturesUnordered::new();
    for _ in 0..n_events {
        let target = zipf.sample();
        let user = zipf.below(50_000) as u32;
        let (version, from) = state
            .get(&(user, target))
            .copied()
            .unwrap_or((0, Reaction::None));
        let to = Reaction::ALL
            .into_iter()
            .filter(|r| *r != from)
            .nth(zipf.below(2) as usize)
            .unwrap_or(Reaction::Like);
        state.insert((user, target), (version + 1, to));
        let payload = serde_json::json!({
            "target_id": format!("t{target}"), "target_type": "video", "user_id": format!("u{user}"),
            "from": from, "to": to, "version": version + 1, "occurred_at": "2026-11-29T00:00:00.000Z"
        })
        .to_string();
        let key = format!("t{target}");
        let producer = producer.clone();
        let topic = env.kafka.topic.clone();
        pending.push(async move {
            producer
                .send(
                    FutureRecord::to(&topic).key(&key).payload(&payload),
                    Duration::from_secs(30),
                )
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        });
        if pending.len() >= 5000 {
            use futures::StreamExt;
            if let Some(r) = pending.next().await {
                r.unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
    {
        use futures::StreamExt;
        while let Some(r) = pending.next().await {
            r.unwrap_or_else(|e| panic!("{e}"));
        }
    }

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
        let config = tally::consumer::ConsumerConfig {
            group: format!("bench-{mode:?}-{}", std::process::id()),
            batch_max: 500,
            batch_wait: Duration::from_millis(50),
            parallelism: 16,
            drain_timeout: Duration::from_secs(30),
            mode,
            listen: "127.0.0.1:0".into(),
            cassandra: cassandra.clone(),
            kafka: env.kafka.clone(),
            redis: env.redis.clone(),
        };
        let (stop, rx) = tokio::sync::watch::channel(false);
        let progress = Arc::new(tally::consumer::Progress::default());
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
        let _ = stop.send(true);
        let _ = task.await;
        results.consumer.push(ConsumerRun {
            mode: format!("{mode:?}"),
            events: processed,
            seconds,
            events_per_sec: processed as f64 / seconds,
            requests_per_event: requests as f64 / processed.max(1) as f64,
            fenced_writes: progress.writes.load(Ordering::Relaxed),
        });
    }
    env.drop_all().await;
    baseline_env.drop_all().await;
}

// ---------------------------------------------------------------- e2e

const SECRET: &str = "bench-secret-0123";

async fn e2e_section(results: &mut Results) {
    let secs = env_num("TALLY_BENCH_E2E_SECS", 10);
    let env = bench_env("load_e2e", 6).await;
    let api = tally::api::ApiConfig {
        listen: "127.0.0.1:0".into(),
        workers: 2,
        idempotency_ttl: Duration::from_secs(3600),
        publish_timeout: Duration::from_secs(5),
        user_rate: 1000.0,
        user_burst: 1000,
        max_in_flight: 4096,
        consumer_group: format!("bench-e2e-{}", std::process::id()),
        auth: tally::auth::AuthConfig::hs256(SECRET),
        cache_ttl: tally::cache::TtlPolicy {
            min: Duration::from_secs(60),
            max: Duration::from_secs(3600),
        },
        cassandra: env.cassandra.clone(),
        kafka: env.kafka.clone(),
        redis: env.redis.clone(),
    };
    let app = tally::api::Application::build(api)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let base = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until_stopped());
    let (stop, rx) = tokio::sync::watch::channel(false);
    let consumer_config = tally::consumer::ConsumerConfig {
        group: format!("bench-e2e-{}", std::process::id()),
        batch_max: 500,
        batch_wait: Duration::from_millis(50),
        parallelism: 16,
        drain_timeout: Duration::from_secs(30),
        mode: tally::consumer::WriteMode::Batched,
        listen: "127.0.0.1:0".into(),
        cassandra: env.cassandra.clone(),
        kafka: env.kafka.clone(),
        redis: env.redis.clone(),
    };
    let consumer = tokio::spawn(tally::consumer::run(consumer_config, rx, Arc::default()));

    let tokens: Arc<Vec<String>> = Arc::new(
        (0..2000)
            .map(|i| {
                tally::auth::mint(
                    &tally::auth::AuthConfig::hs256(SECRET),
                    &format!("u{i}"),
                    Duration::from_secs(7200),
                    vec![],
                )
            })
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{e:#}")),
    );
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));

    // Closed loop, 64 in flight: the API's saturation throughput, to set
    // against the store's bare conditional-write rate.
    eprintln!("e2e: closed loop, 64 in flight, {secs}s");
    let deadline = Instant::now() + Duration::from_secs(secs);
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
        ops_per_sec: all.len() as f64 / started.elapsed().as_secs_f64(),
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

// ---------------------------------------------------------------- report

fn report(r: &Results) {
    let mut md = String::new();
    let _ = writeln!(md, "Run {} at commit {}\n", r.date, r.commit);
    if !r.store.is_empty() {
        let _ = writeln!(
            md,
            "| store, 64 in flight | ops/s | p50 ms | p95 ms | p99 ms | CAS timeouts | conflicts |\n|---|---:|---:|---:|---:|---:|---:|"
        );
        for s in &r.store {
            let l = s.latency_ms;
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} |",
                s.name, s.ops_per_sec, l.p50, l.p95, l.p99, s.cas_unknown, s.conflicts
            );
        }
        if let [upsert, uniform, hot] = &r.store[..] {
            let _ = writeln!(
                md,
                "\nLWT vs upsert throughput: {:.2}x; LWT p95 / upsert p95: {:.2}x; hot / uniform throughput: {:.2}x\n",
                uniform.ops_per_sec / upsert.ops_per_sec,
                uniform.latency_ms.p95 / upsert.latency_ms.p95,
                hot.ops_per_sec / uniform.ops_per_sec
            );
        }
    }
    if !r.consumer.is_empty() {
        let _ = writeln!(
            md,
            "| consumer | events | seconds | events/s | CQL requests/event | fenced writes |\n|---|---:|---:|---:|---:|---:|"
        );
        for c in &r.consumer {
            let _ = writeln!(
                md,
                "| {} | {} | {:.1} | {:.0} | {:.3} | {} |",
                c.mode,
                c.events,
                c.seconds,
                c.events_per_sec,
                c.requests_per_event,
                c.fenced_writes
            );
        }
        if let [batched, per_event] = &r.consumer[..] {
            let _ = writeln!(
                md,
                "\nBatched vs per-event: {:.1}x the events/s, {:.1}x fewer requests per event\n",
                batched.events_per_sec / per_event.events_per_sec,
                per_event.requests_per_event / batched.requests_per_event
            );
        }
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
            "Vote API closed loop (64 in flight): {:.0} votes/s, p95 {:.1} ms, {} errors; store bare LWT rate {:.0}/s; API / store: {:.2}x",
            api.ops_per_sec,
            api.latency_ms.p95,
            api.conflicts,
            bare.ops_per_sec,
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
