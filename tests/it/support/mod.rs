//! The test harness: every test gets its own keyspace, topics, consumer group
//! and Redis key prefix, migrated with the product's own `migrate`, and
//! dropped again when the test ends (also when it panics).

use std::time::Duration;

use scylla::client::session::Session;
use tally::bus::{self, KafkaConfig};
use tally::cache::RedisConfig;
use tally::store::{self, CassandraConfig, migrate::Replication};

/// Partitions of each test's transitions topic: more than one, so ordering
/// across partitions is exercised.
pub const TEST_PARTITIONS: i32 = 3;

pub struct TestEnv {
    pub id: String,
    pub cassandra: CassandraConfig,
    pub kafka: KafkaConfig,
    pub redis: RedisConfig,
    pub group: String,
    pub session: Session,
}

impl TestEnv {
    pub async fn new() -> TestEnv {
        if std::env::var_os("TEST_LOG").is_some() {
            tally::telemetry::init(tally::telemetry::LogFormat::Human);
        }
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let cassandra = CassandraConfig::local(&format!("t_{id}"));
        let kafka = KafkaConfig::local(&format!("t-{id}-transitions"));
        let redis = RedisConfig::local(&format!("t-{id}"));
        let admin = store::connect(&cassandra)
            .await
            .unwrap_or_else(|e| panic!("is the stack up? {e:#}"));
        store::migrate::run(&admin, &cassandra.keyspace, &Replication::Simple(1))
            .await
            .unwrap_or_else(|e| panic!("migrate failed: {e:#}"));
        bus::admin::ensure_topics(&kafka, TEST_PARTITIONS, 1)
            .await
            .unwrap_or_else(|e| panic!("topics: {e:#}"));
        let session = store::connect_keyspace(&cassandra)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        TestEnv {
            group: format!("t-{id}-group"),
            id,
            cassandra,
            kafka,
            redis,
            session,
        }
    }
}

impl TestEnv {
    /// A fresh session, after a fault took Cassandra down and up again.
    pub async fn reconnect(&mut self) {
        self.session = eventually(
            "Cassandra to accept a session",
            Duration::from_secs(120),
            || async { store::connect_keyspace(&self.cassandra).await.ok() },
        )
        .await;
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let (cassandra, kafka, redis) = (
            self.cassandra.clone(),
            self.kafka.clone(),
            self.redis.clone(),
        );
        // Drop runs outside async code (and maybe while panicking), so the
        // clean-up gets a thread and a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(session) = store::connect(&cassandra).await {
                    let _ = session
                        .query_unpaged(
                            format!("DROP KEYSPACE IF EXISTS {}", cassandra.keyspace),
                            (),
                        )
                        .await;
                }
                let _ =
                    bus::admin::delete_topics(&kafka, &[&kafka.topic, &kafka.dead_letter_topic])
                        .await;
                if let Ok(pool) = tally::cache::pool(&redis) {
                    if let Ok(mut conn) = pool.get().await {
                        let keys: Vec<String> = redis::cmd("KEYS")
                            .arg(format!("{}:*", redis.prefix))
                            .query_async(&mut conn)
                            .await
                            .unwrap_or_default();
                        if !keys.is_empty() {
                            let _: Result<(), _> =
                                redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
                        }
                    }
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = tokio::time::Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub const JWT_SECRET: &str = "integration-test-secret";

/// The vote API running in-process on a free port, over a `TestEnv`.
pub struct TestApp {
    pub address: String,
    pub client: reqwest::Client,
}

impl TestEnv {
    pub fn api_config(&self) -> tally::api::ApiConfig {
        tally::api::ApiConfig {
            listen: "127.0.0.1:0".into(),
            workers: 2,
            idempotency_ttl: Duration::from_secs(24 * 3600),
            publish_timeout: Duration::from_secs(5),
            user_rate: 20.0,
            user_burst: 60,
            max_in_flight: 1024,
            consumer_group: self.group.clone(),
            auth: tally::auth::AuthConfig::hs256(JWT_SECRET),
            cache_ttl: tally::cache::TtlPolicy {
                min: Duration::from_secs(60),
                max: Duration::from_secs(3600),
            },
            cassandra: self.cassandra.clone(),
            kafka: self.kafka.clone(),
            redis: self.redis.clone(),
        }
    }

    pub async fn spawn_app(&self) -> TestApp {
        let app = tally::api::Application::build(self.api_config())
            .await
            .unwrap_or_else(|e| panic!("app: {e:#}"));
        let address = format!("http://127.0.0.1:{}", app.port());
        tokio::spawn(app.run_until_stopped());
        TestApp {
            address,
            client: reqwest::Client::new(),
        }
    }

    /// How many messages the transitions topic holds (sum of high
    /// watermarks). The API answers only after Kafka acknowledged, so once a
    /// response is in, this count is final: no waiting needed to see that
    /// nothing was published.
    pub fn published(&self) -> i64 {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = self
            .kafka
            .client()
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        (0..TEST_PARTITIONS)
            .map(|p| {
                let (_, high) = consumer
                    .fetch_watermarks(&self.kafka.topic, p, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("watermarks: {e}"));
                high
            })
            .sum()
    }

    /// Every transition on the topic, in partition order.
    pub async fn transitions(&self) -> Vec<tally::domain::Transition> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::{Message, Offset, TopicPartitionList};
        let expected = self.published();
        let consumer: BaseConsumer = self
            .kafka
            .client()
            .set(
                "group.id",
                format!("{}-reader-{}", self.group, uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut tpl = TopicPartitionList::new();
        for p in 0..TEST_PARTITIONS {
            tpl.add_partition_offset(&self.kafka.topic, p, Offset::Beginning)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        consumer.assign(&tpl).unwrap_or_else(|e| panic!("{e}"));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        while (out.len() as i64) < expected {
            assert!(
                std::time::Instant::now() < deadline,
                "read {} of {expected} transitions",
                out.len()
            );
            if let Some(msg) = consumer.poll(Duration::from_millis(200)) {
                let msg = msg.unwrap_or_else(|e| panic!("{e}"));
                let t = tally::domain::Transition::from_json(msg.payload().unwrap_or_default())
                    .unwrap_or_else(|e| panic!("bad event on the topic: {e}"));
                out.push(t);
            }
        }
        out
    }

    /// The user's reaction row: (state, version), if any.
    pub async fn reaction(&self, user: &str, target: &str) -> Option<(String, i64)> {
        self.session
            .query_unpaged(
                "SELECT state, version FROM reactions WHERE user_id = ? AND target_id = ?",
                (user, target),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_rows_result()
            .unwrap_or_else(|e| panic!("{e}"))
            .maybe_first_row::<(String, i64)>()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// How many rows (reactions and idempotency records) the user has.
    pub async fn rows_of(&self, user: &str) -> i64 {
        let (n,): (i64,) = self
            .session
            .query_unpaged("SELECT count(*) FROM reactions WHERE user_id = ?", (user,))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_rows_result()
            .unwrap_or_else(|e| panic!("{e}"))
            .single_row()
            .unwrap_or_else(|e| panic!("{e}"));
        n
    }
}

pub fn token(sub: &str) -> String {
    tally::auth::mint(
        &tally::auth::AuthConfig::hs256(JWT_SECRET),
        sub,
        Duration::from_secs(3600),
        vec![],
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The error code of a JSON error body.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("not an error body: {}", self.body))
            .to_owned()
    }
}

impl TestApp {
    pub async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        let res = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("request failed: {e}"));
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let body = res.text().await.unwrap_or_else(|e| panic!("{e}"));
        Reply {
            status,
            headers,
            body,
        }
    }

    /// POST /v1/votes as `user` with `key`.
    pub async fn vote(
        &self,
        user: &str,
        key: impl AsRef<str>,
        target: &str,
        action: &str,
    ) -> Reply {
        let body =
            serde_json::json!({"target_id": target, "target_type": "video", "action": action});
        self.send(
            self.client
                .post(format!("{}/v1/votes", self.address))
                .bearer_auth(token(user))
                .header("Idempotency-Key", key.as_ref())
                .json(&body),
        )
        .await
    }

    pub async fn summary(&self, user: &str, ids: &str) -> Reply {
        self.send(
            self.client
                .get(format!(
                    "{}/v1/votes/summary?target_ids={ids}",
                    self.address
                ))
                .bearer_auth(token(user)),
        )
        .await
    }
}

pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Per target: likes, dislikes, and per user (version, state).
pub type Tallies = std::collections::BTreeMap<
    String,
    (i64, i64, std::collections::BTreeMap<String, (i64, String)>),
>;

/// A consumer running in-process.
pub struct RunningConsumer {
    stop: tokio::sync::watch::Sender<bool>,
    pub progress: std::sync::Arc<tally::consumer::Progress>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningConsumer {
    pub fn processed(&self) -> u64 {
        self.progress
            .processed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops it the way SIGTERM does, and waits for it to leave the group.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        match tokio::time::timeout(Duration::from_secs(60), self.task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("consumer did not stop cleanly: {other:?}"),
        }
    }
}

impl TestEnv {
    pub fn consumer_config(&self) -> tally::consumer::ConsumerConfig {
        tally::consumer::ConsumerConfig {
            group: self.group.clone(),
            batch_max: 200,
            batch_wait: Duration::from_millis(20),
            parallelism: 8,
            drain_timeout: Duration::from_secs(20),
            mode: tally::consumer::WriteMode::Batched,
            listen: "127.0.0.1:0".into(),
            cassandra: self.cassandra.clone(),
            kafka: self.kafka.clone(),
            redis: self.redis.clone(),
        }
    }

    pub fn start_consumer(&self) -> RunningConsumer {
        self.start_consumer_with(self.consumer_config())
    }

    pub fn start_consumer_with(&self, config: tally::consumer::ConsumerConfig) -> RunningConsumer {
        let (stop, rx) = tokio::sync::watch::channel(false);
        let progress = std::sync::Arc::new(tally::consumer::Progress::default());
        let task = tokio::spawn(tally::consumer::run(config, rx, progress.clone()));
        RunningConsumer {
            stop,
            progress,
            task,
        }
    }

    /// Publishes raw bytes to the transitions topic, keyed like the API does.
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) {
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let producer: FutureProducer = self
            .kafka
            .client()
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        producer
            .send(
                FutureRecord::to(&self.kafka.topic)
                    .key(key)
                    .payload(payload),
                Duration::from_secs(10),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("{e}"));
    }

    pub async fn publish_transition(
        &self,
        user: &str,
        target: &str,
        from: &str,
        to: &str,
        version: i64,
    ) {
        let t = serde_json::json!({
            "target_id": target, "target_type": "video", "user_id": user,
            "from": from, "to": to, "version": version, "occurred_at": "2026-11-29T00:00:00.000Z"
        });
        self.publish_raw(target, t.to_string().as_bytes()).await;
    }

    /// What `target_stats` holds.
    pub async fn stats(&self) -> Tallies {
        use futures::TryStreamExt;
        type Row = (
            String,
            Option<String>,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            Option<String>,
        );
        let rows: Vec<Row> = self
            .session
            .query_iter("SELECT target_id, user_id, likes, dislikes, applied_version, applied_state FROM target_stats", ())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .rows_stream::<Row>()
            .unwrap_or_else(|e| panic!("{e}"))
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut out = Tallies::new();
        for (target, user, likes, dislikes, version, state) in rows {
            let e = out.entry(target).or_default();
            e.0 = likes.unwrap_or(0);
            e.1 = dislikes.unwrap_or(0);
            if let (Some(u), Some(v), Some(s)) = (user, version, state) {
                e.2.insert(u, (v, s));
            }
        }
        out
    }

    /// The truth: totals recounted from `reactions`, with every user's
    /// version and state. Users at `none` are kept (their version matters).
    pub async fn recount(&self) -> Tallies {
        use futures::TryStreamExt;
        let rows: Vec<(String, String, Option<String>, Option<i64>)> = self
            .session
            .query_iter(
                "SELECT user_id, target_id, state, version FROM reactions",
                (),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .rows_stream::<(String, String, Option<String>, Option<i64>)>()
            .unwrap_or_else(|e| panic!("{e}"))
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut out = Tallies::new();
        for (user, target, state, version) in rows {
            let (Some(state), Some(version)) = (state, version) else {
                continue;
            }; // an idempotency record
            let e = out.entry(target).or_default();
            match state.as_str() {
                "like" => e.0 += 1,
                "dislike" => e.1 += 1,
                _ => {}
            }
            e.2.insert(user, (version, state));
        }
        out
    }

    /// Waits until `target_stats` says exactly what `reactions` says.
    pub async fn wait_until_no_drift(&self, deadline: Duration) {
        let start = tokio::time::Instant::now();
        loop {
            let (stats, truth) = (self.stats().await, self.recount().await);
            if stats == truth {
                return;
            }
            if start.elapsed() > deadline {
                let drifted: Vec<_> = truth
                    .iter()
                    .filter(|(t, v)| stats.get(*t) != Some(*v))
                    .map(|(t, v)| (t, v, stats.get(t)))
                    .take(5)
                    .collect();
                panic!("drift after {deadline:?}: (target, truth, stats) {drifted:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A small deterministic generator, so a failing run can be repeated.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

impl TestApp {
    /// Casts `n` votes from `users` users over `targets` targets, `width` at a
    /// time, with actions drawn from `rng`. Returns how many were answered 200.
    pub async fn random_votes(
        &self,
        rng: &mut Lcg,
        n: usize,
        users: u64,
        targets: u64,
        width: usize,
    ) -> usize {
        let actions = ["like", "dislike", "none"];
        let plan: Vec<(String, String, &str)> = (0..n)
            .map(|_| {
                (
                    format!("u{}", rng.below(users)),
                    format!("t{}", rng.below(targets)),
                    actions[rng.below(3) as usize],
                )
            })
            .collect();
        let mut ok = 0;
        for chunk in plan.chunks(width) {
            let replies = futures::future::join_all(
                chunk.iter().map(|(u, t, a)| self.vote(u, new_key(), t, a)),
            )
            .await;
            ok += replies.iter().filter(|r| r.status == 200).count();
        }
        ok
    }
}

impl TestEnv {
    pub async fn reconciler(&self) -> tally::reconcile::Reconciler {
        let store = tally::store::Store::open(&self.cassandra, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let cache = tally::cache::Cache::new(&self.redis, Duration::from_secs(60)).ok();
        tally::reconcile::Reconciler::new(std::sync::Arc::new(store), cache)
    }

    /// Runs a CQL statement of the test's own (to damage data on purpose).
    pub async fn cql(&self, stmt: &str) {
        self.session
            .query_unpaged(stmt, ())
            .await
            .unwrap_or_else(|e| panic!("{stmt}: {e}"));
    }

    /// The `tally` binary with this test's keyspace, topics, group and prefix.
    pub fn tally(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tally"));
        cmd.env("TALLY_KEYSPACE", &self.cassandra.keyspace)
            .env("TALLY_TOPIC", &self.kafka.topic)
            .env("TALLY_DEAD_LETTER_TOPIC", &self.kafka.dead_letter_topic)
            .env("TALLY_CONSUMER_GROUP", &self.group)
            .env("TALLY_REDIS_PREFIX", &self.redis.prefix)
            .env("TALLY_CONSUMER_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "warn");
        cmd
    }

    /// Casts votes and runs a consumer until target_stats agrees with reactions.
    pub async fn votes_counted(
        &self,
        app: &TestApp,
        rng: &mut Lcg,
        n: usize,
        users: u64,
        targets: u64,
    ) {
        assert_eq!(app.random_votes(rng, n, users, targets, 32).await, n);
        let consumer = self.start_consumer();
        self.wait_until_no_drift(Duration::from_secs(90)).await;
        consumer.stop().await;
    }
}
