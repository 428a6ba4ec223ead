//! Shared by the benches: is the stack up, a fresh keyspace and topic, a Zipf
//! sampler, and percentile summaries.
#![allow(dead_code)]

use std::time::Duration;

use tally::bus::KafkaConfig;
use tally::cache::RedisConfig;
use tally::store::{self, CassandraConfig, migrate::Replication};

/// True when Cassandra, Kafka and Redis answer on their local ports.
pub fn stack_up() -> bool {
    ["127.0.0.1:9042", "127.0.0.1:9092", "127.0.0.1:6379"]
        .iter()
        .all(|a| {
            a.parse().ok().is_some_and(|addr| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
            })
        })
}

/// A bench's size from the environment, or its default.
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn skip_message(bench: &str) {
    eprintln!("{bench}: the local stack is not up; start it with `scripts/stack.sh up`. Skipping.");
}

/// With TALLY_BENCH_CLUSTER=1, the benches run on the three-node cluster of
/// `scripts/stack.sh up --cluster` (RF 3 in dc1, topics at RF 3): the same
/// write path, its cost on replicas.
pub fn on_cluster() -> bool {
    std::env::var("TALLY_BENCH_CLUSTER").is_ok_and(|v| v == "1")
}

/// A bench's own keyspace and topics, made with the product's migrate.
pub struct BenchEnv {
    pub cassandra: CassandraConfig,
    pub kafka: KafkaConfig,
    pub redis: RedisConfig,
}

pub async fn bench_env(name: &str, partitions: i32) -> BenchEnv {
    let id = format!("{name}_{}", std::process::id());
    let mut cassandra = CassandraConfig::local(&format!("b_{id}"));
    let mut kafka = KafkaConfig::local(&format!("b-{id}-transitions"));
    let redis = RedisConfig::local(&format!("b-{id}"));
    let (replication, topic_replication) = if on_cluster() {
        let hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];
        cassandra.nodes = hosts.map(|h| format!("{h}:9042")).to_vec();
        cassandra.local_dc = Some("dc1".into());
        kafka.brokers = hosts.map(|h| format!("{h}:9092")).join(",");
        (Replication::NetworkTopology(vec![("dc1".into(), 3)]), 3)
    } else {
        (Replication::Simple(1), 1)
    };
    let session = store::connect(&cassandra)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    store::migrate::run(&session, &cassandra.keyspace, &replication, None)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    tally::bus::admin::ensure_topics(&kafka, partitions, topic_replication)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    BenchEnv {
        cassandra,
        kafka,
        redis,
    }
}

impl BenchEnv {
    pub async fn drop_all(&self) {
        if let Ok(session) = store::connect(&self.cassandra).await {
            let _ = session
                .query_unpaged(
                    format!("DROP KEYSPACE IF EXISTS {}", self.cassandra.keyspace),
                    (),
                )
                .await;
        }
        let _ = tally::bus::admin::delete_topics(
            &self.kafka,
            &[&self.kafka.topic, &self.kafka.dead_letter_topic],
        )
        .await;
    }
}

/// The consumer as the benches run it: batches of up to 500 events or 50 ms,
/// 16 fenced writes in flight.
pub fn consumer_config(
    group: String,
    mode: tally::consumer::WriteMode,
    stores: tally::ops::Stores,
) -> tally::consumer::ConsumerConfig {
    tally::consumer::ConsumerConfig {
        group,
        batch_max: 500,
        batch_wait: Duration::from_millis(50),
        parallelism: 16,
        drain_timeout: Duration::from_secs(30),
        mode,
        park_after: 8,
        trust_events: true,
        cache_ttl: tally::cache::TtlPolicy {
            min: Duration::from_secs(60),
            max: Duration::from_secs(3600),
        },
        listen: "127.0.0.1:0".into(),
        stores,
    }
}

impl BenchEnv {
    /// This bench's three stores.
    pub fn stores(&self) -> tally::ops::Stores {
        tally::ops::Stores {
            cassandra: self.cassandra.clone(),
            kafka: self.kafka.clone(),
            redis: self.redis.clone(),
        }
    }
}

/// Synthetic transitions sent straight to a bench's topic, keyed by target
/// as the relay keys them, for the benches that time the consumer alone.
#[derive(Clone)]
pub struct Transitions {
    producer: rdkafka::producer::FutureProducer,
    topic: String,
}

impl BenchEnv {
    pub fn transitions(&self) -> Transitions {
        Transitions {
            producer: self
                .kafka
                .client()
                .set("linger.ms", "20")
                .create()
                .unwrap_or_else(|e| panic!("{e}")),
            topic: self.kafka.topic.clone(),
        }
    }
}

impl Transitions {
    /// One user's move on one target from `from` to `to` at `version`,
    /// resolved once Kafka has it; panics if Kafka refuses it, since a bench
    /// that lost an event would time the wrong work.
    pub fn send(
        &self,
        target: String,
        user: String,
        from: &'static str,
        to: &'static str,
        version: i64,
    ) -> impl std::future::Future<Output = ()> + 'static {
        let Transitions { producer, topic } = self.clone();
        async move {
            let payload = serde_json::json!({
                "target_id": target, "target_type": "video", "user_id": user,
                "from": from, "to": to, "version": version,
                "occurred_at": "2026-11-30T00:00:00.000Z"
            })
            .to_string();
            producer
                .send(
                    rdkafka::producer::FutureRecord::to(&topic)
                        .key(&target)
                        .payload(&payload),
                    Duration::from_secs(30),
                )
                .await
                .map(|_| ())
                .unwrap_or_else(|(e, _)| panic!("{e}"));
        }
    }
}

pub mod count;

/// The tests' one generator and Zipf, shared rather than copied.
#[path = "../../tests/it/support/rng.rs"]
pub mod rng;
#[allow(unused_imports)]
pub use rng::Zipf;

/// One vote through the store code the API used before the outbox: the
/// snapshot read, then the conditional batch (the change and its
/// idempotency record), flipping the user between like and dislike.
pub async fn lwt_vote(
    store: &tally::store::Store,
    user: &tally::domain::UserId,
    target: &tally::domain::TargetId,
    n: u64,
) -> tally::store::Cas {
    let key = match bench_key(n) {
        Ok(k) => k,
        Err(e) => return tally::store::Cas::Failed(e),
    };
    let snap = match store.reactions.snapshot(user, target, &key, false).await {
        Ok(s) => s,
        Err(e) => return tally::store::Cas::Unknown(e.into()),
    };
    let (change, _) = flip(snap.current);
    cas(write(store, user, target, &key, snap.current, change, None).await)
}

/// How much of the outbox a bench vote writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxPart {
    /// The intent, and the transition in the key's record: what the API does.
    Whole,
    /// The transition in the record, no intent.
    Record,
    /// Neither: the write path without the outbox.
    Nothing,
}

/// One vote as the API casts it now: its outbox intent, then the
/// conditional batch guessing the row holds what `hints` last saw (as the
/// API's process does), and on a refusal again with what the refusal
/// returned (no read of its own).
pub async fn lwt_vote_optimistic(
    store: &tally::store::Store,
    user: &tally::domain::UserId,
    target: &tally::domain::TargetId,
    n: u64,
    hints: &tally::cast::Hints,
    outbox: OutboxPart,
) -> tally::store::Cas {
    use tally::store::outbox::Slot;
    use tally::store::reactions::Written;
    let key = match bench_key(n) {
        Ok(k) => k,
        Err(e) => return tally::store::Cas::Failed(e),
    };
    let slot = match outbox {
        OutboxPart::Whole => match store.outbox.intend(user, &key).await {
            Ok(slot) => Some(slot),
            Err(e) => return tally::store::Cas::Failed(e.into()),
        },
        OutboxPart::Record => Some(Slot {
            bucket: 0,
            shard: 0,
        }),
        OutboxPart::Nothing => None,
    };
    let mut current = hints.get(user, target);
    for _ in 0..4 {
        let (to, version) = flip(current);
        match write(
            store,
            user,
            target,
            &key,
            current,
            to,
            slot.map(|s| (s, version)),
        )
        .await
        {
            Written::Refused(snap) if snap.record.is_none() => current = snap.current,
            other => {
                if let Written::Applied = other {
                    hints.remember(user, target, to, version);
                }
                return cas(other);
            }
        }
    }
    tally::store::Cas::NotApplied
}

/// One vote as the API cast it before it went optimistic: a read of the
/// row and the key, the outbox intent, then the batch with the transition.
pub async fn vote_after_read(
    store: &tally::store::Store,
    user: &tally::domain::UserId,
    target: &tally::domain::TargetId,
    n: u64,
) -> tally::store::Cas {
    let key = match bench_key(n) {
        Ok(k) => k,
        Err(e) => return tally::store::Cas::Failed(e),
    };
    let snap = match store.reactions.snapshot(user, target, &key, false).await {
        Ok(s) => s,
        Err(e) => return tally::store::Cas::Unknown(e.into()),
    };
    let slot = match store.outbox.intend(user, &key).await {
        Ok(slot) => slot,
        Err(e) => return tally::store::Cas::Failed(e.into()),
    };
    let (to, version) = flip(snap.current);
    cas(write(
        store,
        user,
        target,
        &key,
        snap.current,
        to,
        Some((slot, version)),
    )
    .await)
}

fn bench_key(n: u64) -> anyhow::Result<tally::domain::IdempotencyKey> {
    Ok(tally::domain::IdempotencyKey::parse(&format!(
        "k{n}-{}",
        uuid::Uuid::new_v4().simple()
    ))?)
}

/// The reaction a bench vote moves to from `current`, and its version.
fn flip(current: Option<tally::store::reactions::Current>) -> (tally::domain::Reaction, i64) {
    use tally::domain::Reaction;
    let to = match current {
        Some(c) if c.state == Reaction::Like => Reaction::Dislike,
        _ => Reaction::Like,
    };
    (to, current.map_or(1, |c| c.version + 1))
}

/// The conditional batch; with `outbox` (the intent's bucket and the new
/// version), its record carries the transition as the API's does.
async fn write(
    store: &tally::store::Store,
    user: &tally::domain::UserId,
    target: &tally::domain::TargetId,
    key: &tally::domain::IdempotencyKey,
    current: Option<tally::store::reactions::Current>,
    to: tally::domain::Reaction,
    outbox: Option<(tally::store::outbox::Slot, i64)>,
) -> tally::store::reactions::Written {
    use tally::domain::{Reaction, TargetType, Transition};
    use tally::store::reactions::{Change, KeyRecord};
    let (transition, intent) = match outbox {
        Some((slot, version)) => {
            let t = Transition {
                target_id: target.clone(),
                target_type: TargetType::Video,
                user_id: user.clone(),
                from: current.map_or(Reaction::None, |c| c.state),
                to,
                version,
                occurred_at: "2026-11-30T00:00:00.000Z".into(),
            };
            let json = t.to_json().ok().and_then(|j| String::from_utf8(j).ok());
            (json, Some(slot))
        }
        None => (None, None),
    };
    let record = KeyRecord {
        request_hash: "h".into(),
        owner: uuid::Uuid::new_v4(),
        status: 200,
        body: "{}".into(),
        transition,
        intent_bucket: intent.map(|s| s.bucket),
        intent_shard: intent.map(|s| s.shard),
    };
    let change = Change {
        user,
        target,
        target_type: TargetType::Video,
        expected: current,
        to,
        key,
        record: &record,
    };
    store.reactions.commit(&change).await
}

fn cas(written: tally::store::reactions::Written) -> tally::store::Cas {
    use tally::store::{Cas, reactions::Written};
    match written {
        Written::Applied => Cas::Applied,
        Written::Refused(_) => Cas::NotApplied,
        Written::Unknown(e) => Cas::Unknown(e),
        Written::Failed(e) => Cas::Failed(e),
    }
}

/// Latency percentiles in milliseconds, from a histogram of microseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub count: u64,
}

pub fn percentiles(h: &hdrhistogram::Histogram<u64>) -> Percentiles {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Percentiles {
        p50: ms(0.50),
        p90: ms(0.90),
        p95: ms(0.95),
        p99: ms(0.99),
        max: h.max() as f64 / 1000.0,
        count: h.len(),
    }
}

pub fn histogram() -> hdrhistogram::Histogram<u64> {
    // 1 µs to 60 s, 3 significant digits.
    hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3).unwrap_or_else(|e| panic!("{e}"))
}

/// What one store run does per operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A plain write of one row: no read, no condition.
    Upsert,
    /// One single-row `INSERT ... IF NOT EXISTS` of a fresh row: the ceiling
    /// of any write that is one Paxos round.
    BareLwt,
    /// The vote's store work before it went optimistic: a read of the row
    /// and the key, then the conditional batch (no outbox).
    ReadThenWrite,
    /// The vote's store work as the API does it: the outbox intent, then the
    /// conditional batch on a guess, retried on what a refusal returns.
    Vote,
    /// The same without the outbox intent: what the batch alone costs.
    VoteBatchOnly,
    /// The same batch without the transition in its record: the write path
    /// without any of the outbox.
    VoteNoOutbox,
    /// The vote's store work before it went optimistic: the read, the
    /// intent, then the batch carrying the transition.
    ReadThenVote,
    /// Counting one transition as the consumer does when it knows the
    /// bucket: the conditional batch on its `seq` and the user's applied
    /// row, no read (`count::fenced`).
    CountFenced,
    /// Counting one transition the stamped way: a plain batch `USING
    /// TIMESTAMP`, no read, no condition (`count::stamped`).
    CountStamped,
    /// `Vote`, then its transition counted by `CountFenced`: what a vote
    /// costs the store with today's consumer keeping up.
    VoteCountedFenced,
    /// `Vote`, then its transition counted by `CountStamped`.
    VoteCountedStamped,
    /// Counting one transition the sharded way: queued by the task, which
    /// owns a shard of targets, and every `TALLY_BENCH_SHARD_BATCH`-th
    /// counted with the rest of the queue in one conditional batch on the
    /// shard's partition (`count::sharded`).
    CountSharded,
    /// `Vote`, then its transition counted by `CountSharded`.
    VoteCountedSharded,
}

impl Op {
    /// Whether the run's tasks each own their targets, as the consumer's
    /// partition owners do: every run that counts.
    fn owns_targets(self) -> bool {
        matches!(
            self,
            Op::CountFenced
                | Op::CountStamped
                | Op::VoteCountedFenced
                | Op::VoteCountedStamped
                | Op::CountSharded
                | Op::VoteCountedSharded
        )
    }
}

/// One store run's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreRun {
    pub name: String,
    /// The `Op` it ran, by name, and whether 90% of it went to one target.
    pub op: String,
    pub hot: bool,
    pub ops_per_sec: f64,
    pub latency_ms: Percentiles,
    pub cas_unknown: u64,
    pub conflicts: u64,
    /// Cassandra's CPU time per operation (every node's, summed), in
    /// microseconds: on one machine this, more than latency, says what an
    /// operation costs the store.
    pub store_cpu_us: f64,
    /// The whole machine's busy CPU time per operation, in microseconds:
    /// the store's, the client's and the kernel's.
    pub machine_cpu_us: f64,
}

/// The store and the plain statements the store runs measure against.
#[derive(Clone)]
pub struct StoreOps {
    store: std::sync::Arc<tally::store::Store>,
    session: std::sync::Arc<scylla::client::session::Session>,
    upsert: scylla::statement::prepared::PreparedStatement,
    bare: scylla::statement::prepared::PreparedStatement,
    stamped: count::Stamped,
    sharded: count::Sharded,
}

impl StoreOps {
    pub async fn open(env: &BenchEnv) -> StoreOps {
        let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(3600))
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let session = store::connect_keyspace(&env.cassandra)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let upsert = session
            .prepare("INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES (?, ?, ?, ?, ?)")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let bare = session
            .prepare("INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES (?, ?, ?, ?, 1) IF NOT EXISTS")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let stamped = count::Stamped::prepare(&session).await;
        let sharded = count::Sharded::prepare(&session).await;
        StoreOps {
            store: std::sync::Arc::new(store),
            session: std::sync::Arc::new(session),
            upsert,
            bare,
            stamped,
            sharded,
        }
    }
}

/// One store run's latencies, seconds, CAS timeouts and conflicts.
type Ran = (hdrhistogram::Histogram<u64>, f64, u64, u64);

/// A store run's figures over its rounds: those of `Ran`, then Cassandra's
/// and the machine's CPU time in microseconds.
type Measured = (hdrhistogram::Histogram<u64>, f64, u64, u64, (u64, u64));

/// The rate of the uniform run of `op` among `runs`.
pub fn rate_of(runs: &[StoreRun], op: Op) -> Option<f64> {
    let op = format!("{op:?}");
    runs.iter()
        .find(|r| r.op == op && !r.hot)
        .map(|r| r.ops_per_sec)
}

/// Every store run once, unmeasured, on a keyspace of its own (`name`): a
/// Cassandra just started ran the bare LWT at half the rate it reached
/// minutes later, and 2 s a run did not change that where 15 s did
/// (BENCHMARKS.md, section 25), so without this the first ceilings after
/// `scripts/stack.sh up` measure a Cassandra still warming up.
/// `TALLY_BENCH_WARM_SECS` (15) is the length of each run, 0 for none.
pub async fn warm_up(runs: &[(&str, Op, bool)], name: &str) {
    let secs = env_num("TALLY_BENCH_WARM_SECS", 15);
    if secs == 0 {
        return;
    }
    eprintln!("store: warming up, {secs} s a run, unmeasured");
    let env = bench_env(name, 1).await;
    let stores = StoreOps::open(&env).await;
    let _ = store_runs(&stores, runs, Duration::from_secs(secs), 1).await;
    env.drop_all().await;
}

/// Each of `runs` (name, op, hot) for `secs` in all, in `rounds` turns of
/// `secs / rounds`, each round in an order rotated by one: whatever the
/// stores do in the background (compaction of what earlier runs wrote, say)
/// falls on every run alike rather than on the later ones.
pub async fn store_runs(
    ops: &StoreOps,
    runs: &[(&str, Op, bool)],
    secs: Duration,
    rounds: u32,
) -> Vec<StoreRun> {
    let rounds = rounds.max(1);
    let mut totals: Vec<Option<Measured>> = runs.iter().map(|_| None).collect();
    // Each run keeps its own rows (its users are its own) and what it saw
    // of them across its rounds, as one API process would.
    let seen: Vec<Seen> = runs
        .iter()
        .map(|_| {
            (
                std::sync::Arc::new(tally::cast::Hints::default()),
                std::sync::Arc::new(count::Owned::default()),
            )
        })
        .collect();
    for round in 0..rounds {
        // Each round starts one run later, so no run always follows the same
        // one (and inherits its flushes and compactions).
        let order = (0..runs.len()).map(|i| (i + round as usize) % runs.len());
        for i in order {
            let (name, op, hot) = &runs[i];
            eprintln!(
                "store: {name}, 64 in flight, round {} of {rounds}",
                round + 1
            );
            let cpu_before = (cassandra_cpu_micros(), machine_cpu_micros());
            let (h, elapsed, unknown, conflicts) =
                store_run(ops, (*op, *hot, i), &seen[i], secs / rounds, round).await;
            let cpu = (
                cassandra_cpu_micros().saturating_sub(cpu_before.0),
                machine_cpu_micros().saturating_sub(cpu_before.1),
            );
            match &mut totals[i] {
                Some((all, e, u, c, p)) => {
                    all.add(&h).unwrap_or_else(|e| panic!("{e}"));
                    *e += elapsed;
                    *u += unknown;
                    *c += conflicts;
                    p.0 += cpu.0;
                    p.1 += cpu.1;
                }
                slot => *slot = Some((h, elapsed, unknown, conflicts, cpu)),
            }
        }
    }
    for ((_, op, _), (_, owned)) in runs.iter().zip(&seen) {
        if matches!(op, Op::CountSharded | Op::VoteCountedSharded) {
            count::check_sharded(&ops.session, &ops.sharded, owned).await;
        } else if op.owns_targets() {
            let stamped = matches!(op, Op::CountStamped | Op::VoteCountedStamped);
            count::check(&ops.store, &ops.session, &ops.stamped, owned, stamped).await;
        }
    }
    runs.iter()
        .zip(totals)
        .filter_map(|((name, op, hot), t)| {
            t.map(|(all, elapsed, unknown, conflicts, cpu)| StoreRun {
                name: (*name).into(),
                op: format!("{op:?}"),
                hot: *hot,
                ops_per_sec: all.len() as f64 / elapsed,
                store_cpu_us: cpu.0 as f64 / all.len().max(1) as f64,
                machine_cpu_us: cpu.1 as f64 / all.len().max(1) as f64,
                latency_ms: percentiles(&all),
                cas_unknown: unknown,
                conflicts,
            })
        })
        .collect()
}

/// What a run saw of its users' rows (the vote's hints) and what its owners
/// counted of them.
type Seen = (
    std::sync::Arc<tally::cast::Hints>,
    std::sync::Arc<count::Owned>,
);

/// One operation of a run that counts: the transition counted alone (the
/// next one a vote would publish), or a vote and then its transition.
async fn counted(
    ops: &StoreOps,
    op: Op,
    (user, target): (&str, &str),
    n: u64,
    (hints, owned): (&tally::cast::Hints, &count::Owned),
) -> tally::store::Cas {
    let (user, target) = ids(user, target);
    let event = match op {
        Op::CountFenced | Op::CountStamped => owned.next_vote(&target, &user),
        _ => match voted(ops, (&user, &target), n, hints).await {
            Ok(event) => event,
            Err(cas) => return cas,
        },
    };
    match op {
        Op::CountFenced | Op::VoteCountedFenced => {
            count::fenced(&ops.store, owned, &target, &user, event).await
        }
        _ => {
            let on = (&target, &user);
            count::stamped(&ops.store, &ops.session, &ops.stamped, owned, on, event).await
        }
    }
}

/// A run's ids, parsed.
fn ids(user: &str, target: &str) -> (tally::domain::UserId, tally::domain::TargetId) {
    use tally::domain::{TargetId, UserId};
    match (UserId::parse(user), TargetId::parse(target)) {
        (Ok(u), Ok(t)) => (u, t),
        _ => panic!("bad ids {user} {target}"),
    }
}

/// The vote's optimistic store operation, and the transition it committed,
/// as the vote API would publish it; the vote's outcome when it committed
/// none.
async fn voted(
    ops: &StoreOps,
    (user, target): (&tally::domain::UserId, &tally::domain::TargetId),
    n: u64,
    hints: &tally::cast::Hints,
) -> Result<tally::domain::Applied, tally::store::Cas> {
    use tally::store::Cas;
    let part = OutboxPart::Whole;
    match lwt_vote_optimistic(&ops.store, user, target, n, hints, part).await {
        Cas::Applied => match hints.get(user, target) {
            Some(row) => Ok(tally::domain::Applied {
                version: row.version,
                state: row.state,
            }),
            // The hints started over between the vote and this read.
            None => Err(Cas::Unknown(anyhow::anyhow!(
                "the vote's row was forgotten"
            ))),
        },
        other => Err(other),
    }
}

/// One operation of a sharded run: the transition (the next one alone, or
/// the one a vote committed) queued on the task's shard, and the queue
/// counted in one write once it holds `batch`.
async fn queued(
    ops: &StoreOps,
    op: Op,
    (user, target): (&str, &str),
    n: u64,
    (hints, owned): (&tally::cast::Hints, &count::Owned),
    (shard, queue, batch): (i32, &mut count::Queue, usize),
) -> tally::store::Cas {
    use tally::store::Cas;
    let (user, target) = ids(user, target);
    let event = match op {
        Op::CountSharded => count::next_vote_after(owned, queue, &target, &user),
        _ => match voted(ops, (&user, &target), n, hints).await {
            Ok(event) => event,
            Err(cas) => return cas,
        },
    };
    queue.push((target, user, event));
    if queue.len() < batch {
        return Cas::Applied;
    }
    count::sharded(&ops.session, &ops.sharded, owned, shard, queue).await
}

/// `op` with 64 in flight for `secs`: 20,000 users over 10,000 targets, or
/// 90% on one target when `hot`. The latencies, the seconds it took, CAS
/// timeouts and conflicts. The users are the `run`'s own, and `seen` what
/// it saw of their rows and counted of them in earlier rounds; `round`
/// varies the draws. A run that counts gives each task targets of its own.
async fn store_run(
    ops: &StoreOps,
    (op, hot, run): (Op, bool, usize),
    seen: &Seen,
    secs: Duration,
    round: u32,
) -> Ran {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tally::domain::{TargetId, UserId};
    use tally::store::Cas;
    let deadline = std::time::Instant::now() + secs;
    let shard_batch = env_num("TALLY_BENCH_SHARD_BATCH", 8).max(1) as usize;
    let (unknown, conflicts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let (ops, unknown, conflicts) = (ops.clone(), unknown.clone(), conflicts.clone());
        let (hints, owned) = (seen.0.clone(), seen.1.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Zipf::new(1, 1.0, w + 1 + u64::from(round) * 1_000);
            let mut h = histogram();
            let mut n = 0u64;
            // A sharded run's task owns shard `run * 64 + w`: its targets.
            let shard = (run * 64) as i32 + w as i32;
            let mut queue = count::Queue::new();
            while std::time::Instant::now() < deadline {
                let user = format!("r{run}u{}", rng.below(20_000));
                let target = if op.owns_targets() {
                    // About 10,000 targets in all, task w owning those equal to w mod 64.
                    format!("r{run}t{}", w + 64 * rng.below(157))
                } else if hot && rng.uniform() < 0.9 {
                    "viral".to_owned()
                } else {
                    format!("t{}", rng.below(10_000))
                };
                let start = std::time::Instant::now();
                let outcome = match op {
                    Op::Upsert => {
                        let state = if n % 2 == 0 { "like" } else { "none" };
                        ops.session
                            .execute_unpaged(
                                &ops.upsert,
                                (&user, &target, "video", state, n as i64),
                            )
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                        Cas::Applied
                    }
                    Op::BareLwt => {
                        let fresh = format!("b{round}-{w}-{n}");
                        match ops
                            .session
                            .execute_unpaged(&ops.bare, (&user, &fresh, "video", "like"))
                            .await
                            .map(tally::store::was_applied)
                        {
                            Ok(Ok(true)) => Cas::Applied,
                            Ok(Ok(false)) => Cas::NotApplied,
                            _ => Cas::Unknown(anyhow::anyhow!("bare LWT")),
                        }
                    }
                    Op::CountFenced
                    | Op::CountStamped
                    | Op::VoteCountedFenced
                    | Op::VoteCountedStamped => {
                        let k = u64::from(round) * 100_000_000 + w * 1_000_000 + n;
                        counted(&ops, op, (&user, &target), k, (&hints, &owned)).await
                    }
                    Op::CountSharded | Op::VoteCountedSharded => {
                        let k = u64::from(round) * 100_000_000 + w * 1_000_000 + n;
                        let on = (shard, &mut queue, shard_batch);
                        queued(&ops, op, (&user, &target), k, (&hints, &owned), on).await
                    }
                    Op::ReadThenWrite
                    | Op::Vote
                    | Op::VoteBatchOnly
                    | Op::VoteNoOutbox
                    | Op::ReadThenVote => {
                        let (user, target) = match (UserId::parse(&user), TargetId::parse(&target))
                        {
                            (Ok(u), Ok(t)) => (u, t),
                            _ => panic!("bad ids {user} {target}"),
                        };
                        let k = u64::from(round) * 100_000_000 + w * 1_000_000 + n;
                        match op {
                            Op::ReadThenWrite => lwt_vote(&ops.store, &user, &target, k).await,
                            Op::ReadThenVote => {
                                vote_after_read(&ops.store, &user, &target, k).await
                            }
                            Op::Vote => {
                                let part = OutboxPart::Whole;
                                lwt_vote_optimistic(&ops.store, &user, &target, k, &hints, part)
                                    .await
                            }
                            Op::VoteBatchOnly => {
                                let part = OutboxPart::Record;
                                lwt_vote_optimistic(&ops.store, &user, &target, k, &hints, part)
                                    .await
                            }
                            _ => {
                                let part = OutboxPart::Nothing;
                                lwt_vote_optimistic(&ops.store, &user, &target, k, &hints, part)
                                    .await
                            }
                        }
                    }
                };
                match outcome {
                    Cas::Applied => {}
                    Cas::NotApplied => {
                        conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    Cas::Unknown(_) => {
                        unknown.fetch_add(1, Ordering::Relaxed);
                    }
                    Cas::Failed(e) => panic!("{e:#}"),
                }
                let _ = h.record(start.elapsed().as_micros() as u64);
                n += 1;
            }
            // What is still queued is counted inside the run's time.
            if !queue.is_empty()
                && let tally::store::Cas::Failed(e) =
                    count::sharded(&ops.session, &ops.sharded, &owned, shard, &mut queue).await
            {
                panic!("{e:#}");
            }
            h
        }));
    }
    let started = std::time::Instant::now();
    let mut all = histogram();
    for t in tasks {
        let h = t.await.unwrap_or_else(|e| panic!("{e}"));
        all.add(&h).unwrap_or_else(|e| panic!("{e}"));
    }
    let elapsed = started.elapsed().as_secs_f64().max(secs.as_secs_f64());
    (
        all,
        elapsed,
        unknown.load(Ordering::Relaxed),
        conflicts.load(Ordering::Relaxed),
    )
}

/// `pid`'s CPU time so far (user + system), in microseconds; 0 if it is gone.
pub fn cpu_micros(pid: u32) -> u64 {
    proc_stat_micros(pid, &[11, 12])
}

/// The sum of some of `/proc/<pid>/stat`'s clock-tick fields, counted from
/// the state (field 3) as 0: after the command name, which may hold spaces
/// in its parentheses. utime and stime are 11 and 12, the waited-for
/// children's 13 and 14.
fn proc_stat_micros(pid: u32, fields: &[usize]) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0;
    };
    let all: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .iter()
        .filter_map(|&i| all.get(i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    ticks * 1_000_000 / clock_ticks()
}

/// CPU time of this process's children that it has waited for, so far, in
/// microseconds: a load generator's own cost once its run is over.
pub fn waited_children_cpu_micros() -> u64 {
    proc_stat_micros(std::process::id(), &[13, 14])
}

fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100)
    })
}

/// The CPU time so far of every Cassandra node on this machine, summed, in
/// microseconds: the nodes are found by their main class, so one node and a
/// cluster are measured alike.
pub fn cassandra_cpu_micros() -> u64 {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(DAEMON.len()).any(|w| w == DAEMON))
        })
        .map(cpu_micros)
        .sum()
}

const DAEMON: &[u8] = b"org.apache.cassandra.service.CassandraDaemon";

/// The busy CPU time of the whole machine so far (user, nice, system, irq
/// and softirq of every CPU, from /proc/stat; not idle, iowait or time a
/// hypervisor took), in microseconds.
/// Connection attempts the machine's listeners dropped since boot: the
/// kernel's `TcpExt: ListenDrops` (`/proc/net/netstat`), which counts a
/// full accept queue (`ListenOverflows`) and every other refusal of a
/// listener. A client whose SYN is dropped sends it again 1 s later, then
/// 3 s, then 7 s, so a handful of these add seconds to requests the server
/// never saw.
pub fn listen_drops() -> u64 {
    let Ok(netstat) = std::fs::read_to_string("/proc/net/netstat") else {
        return 0;
    };
    // Two lines per group: the names, then the values.
    let mut lines = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "ListenDrops")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

pub fn machine_cpu_micros() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = stat.lines().next() else {
        return 0;
    };
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: u64 = [0, 1, 2, 5, 6].iter().filter_map(|&i| fields.get(i)).sum();
    busy * 1_000_000 / clock_ticks()
}
