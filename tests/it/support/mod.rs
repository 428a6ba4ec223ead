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
        let admin = store::connect(&cassandra).await.unwrap_or_else(|e| panic!("is the stack up? {e:#}"));
        store::migrate::run(&admin, &cassandra.keyspace, &Replication::Simple(1))
            .await
            .unwrap_or_else(|e| panic!("migrate failed: {e:#}"));
        bus::admin::ensure_topics(&kafka, TEST_PARTITIONS, 1).await.unwrap_or_else(|e| panic!("topics: {e:#}"));
        let session = store::connect_keyspace(&cassandra).await.unwrap_or_else(|e| panic!("{e:#}"));
        TestEnv { group: format!("t-{id}-group"), id, cassandra, kafka, redis, session }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let (cassandra, kafka, redis) = (self.cassandra.clone(), self.kafka.clone(), self.redis.clone());
        // Drop runs outside async code (and maybe while panicking), so the
        // clean-up gets a thread and a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            rt.block_on(async move {
                if let Ok(session) = store::connect(&cassandra).await {
                    let _ = session.query_unpaged(format!("DROP KEYSPACE IF EXISTS {}", cassandra.keyspace), ()).await;
                }
                let _ = bus::admin::delete_topics(&kafka, &[&kafka.topic, &kafka.dead_letter_topic]).await;
                if let Ok(pool) = tally::cache::pool(&redis) {
                    if let Ok(mut conn) = pool.get().await {
                        let keys: Vec<String> = redis::cmd("KEYS")
                            .arg(format!("{}:*", redis.prefix))
                            .query_async(&mut conn)
                            .await
                            .unwrap_or_default();
                        if !keys.is_empty() {
                            let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
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
