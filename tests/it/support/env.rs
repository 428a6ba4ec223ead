//! Each test's own keyspace, topics, consumer group and Redis prefix.

use std::time::Duration;

use scylla::client::session::Session;
use tally::bus::{self, KafkaConfig};
use tally::cache::RedisConfig;
use tally::store::{self, CassandraConfig, migrate::Replication};

use super::eventually;

/// Partitions of each test's transitions topic: more than one, so ordering
/// across partitions is exercised.
pub const TEST_PARTITIONS: i32 = 3;

/// Buckets per target in test keyspaces: few, so that a few dozen voters
/// already spread over all of them.
pub const TEST_BUCKETS: i64 = 4;

pub struct TestEnv {
    pub id: String,
    pub cassandra: CassandraConfig,
    pub kafka: KafkaConfig,
    pub redis: RedisConfig,
    pub group: String,
    pub session: Session,
    /// Variables every `tally` this test runs gets (the secure stack's logins).
    pub cli_env: Vec<(String, String)>,
}

/// The addresses of the cluster `scripts/stack.sh up --cluster` starts.
pub const CLUSTER_HOSTS: [&str; 3] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];

impl TestEnv {
    /// On the single-node stack (`scripts/stack.sh up`).
    pub async fn new() -> TestEnv {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let cassandra = CassandraConfig::local(&format!("t_{id}"));
        let kafka = KafkaConfig::local(&format!("t-{id}-transitions"));
        TestEnv::create(id, cassandra, kafka, Replication::Simple(1), 1).await
    }

    /// On the three-node cluster (`scripts/stack.sh up --cluster`): the
    /// keyspace at NetworkTopologyStrategy dc1:3, topics at RF 3.
    pub async fn on_cluster() -> TestEnv {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let mut cassandra = CassandraConfig::local(&format!("t_{id}"));
        cassandra.nodes = CLUSTER_HOSTS.map(|h| format!("{h}:9042")).to_vec();
        cassandra.local_dc = Some("dc1".into());
        let mut kafka = KafkaConfig::local(&format!("t-{id}-transitions"));
        kafka.brokers = CLUSTER_HOSTS.map(|h| format!("{h}:9092")).join(",");
        let replication = Replication::NetworkTopology(vec![("dc1".into(), 3)]);
        TestEnv::create(id, cassandra, kafka, replication, 3).await
    }

    /// On the secure stack (`scripts/stack.sh up --secure`), as the
    /// migrating role (`admin.env`): TLS and logins to all three stores. Its
    /// topics and group carry the prefixes the stack's ACLs name: `tx-`
    /// transitions, `dlq-` dead letters, `g-` groups.
    pub async fn on_secure_stack() -> TestEnv {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let vars = secure_vars("admin");
        let var = |name: &str| {
            vars.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("{name} missing from admin.env"))
        };
        let mut cassandra = CassandraConfig::local(&format!("t_{id}"));
        cassandra.user = Some(var("TALLY_CASSANDRA_USER"));
        cassandra.password = Some(tally::secret::Secret::new(var("TALLY_CASSANDRA_PASSWORD")));
        cassandra.tls_ca = Some(var("TALLY_CASSANDRA_TLS_CA").into());
        let mut kafka = KafkaConfig::local(&format!("tx-{id}"));
        kafka.dead_letter_topic = format!("dlq-{id}");
        kafka.security = bus::KafkaSecurity::SaslSsl;
        kafka.user = Some(var("TALLY_KAFKA_USER"));
        kafka.password = Some(tally::secret::Secret::new(var("TALLY_KAFKA_PASSWORD")));
        kafka.tls_ca = Some(var("TALLY_KAFKA_TLS_CA").into());
        let mut env = TestEnv::create(id, cassandra, kafka, Replication::Simple(1), 1).await;
        env.redis.url = var("TALLY_REDIS_URL");
        env.redis.user = Some(var("TALLY_REDIS_USER"));
        env.redis.password = Some(tally::secret::Secret::new(var("TALLY_REDIS_PASSWORD")));
        env.redis.tls_ca = Some(var("TALLY_REDIS_TLS_CA").into());
        env.group = format!("g-{}", env.id);
        env.cli_env = vars;
        env
    }

    async fn create(
        id: String,
        cassandra: CassandraConfig,
        kafka: KafkaConfig,
        replication: Replication,
        topic_replication: i32,
    ) -> TestEnv {
        if std::env::var_os("TEST_LOG").is_some() {
            tally::telemetry::init(tally::telemetry::LogFormat::Human);
        }
        let redis = RedisConfig::local(&format!("t-{id}"));
        let admin = store::connect(&cassandra)
            .await
            .unwrap_or_else(|e| panic!("is the stack up? {e:#}"));
        let buckets = tally::domain::Layout::new(TEST_BUCKETS).ok();
        let mut restarted = false;
        loop {
            match store::migrate::run(&admin, &cassandra.keyspace, &replication, buckets).await {
                Ok(_) => break,
                // On the cluster, a node that dropped a DDL's schema pushes
                // stays behind until it restarts (see
                // `restart_nodes_out_of_schema_agreement`); the migrations
                // are idempotent, so they are applied again after it.
                Err(e)
                    if !restarted
                        && matches!(replication, Replication::NetworkTopology(_))
                        && format!("{e:#}").contains("schema agreement") =>
                {
                    eprintln!("migrate: {e:#}");
                    tokio::task::spawn_blocking(
                        super::stack::restart_nodes_out_of_schema_agreement,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                    restarted = true;
                }
                Err(e) => panic!("migrate failed: {e:#}"),
            }
        }
        bus::admin::ensure_topics(&kafka, TEST_PARTITIONS, topic_replication)
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
            cli_env: Vec::new(),
        }
    }
}

/// The TALLY_* variables of one role of the secure stack
/// (`.stack/secure/{role}.env`, written by `scripts/stack.sh up --secure`).
pub fn secure_vars(role: &str) -> Vec<(String, String)> {
    let dir = std::env::var_os("TALLY_STACK_DIR")
        .map_or_else(|| super::stack::root().join(".stack"), Into::into);
    let path = dir.join("secure").join(format!("{role}.env"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (is `scripts/stack.sh up --secure` up?)",
            path.display()
        )
    });
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
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

impl TestEnv {
    /// This test's stores, as the API and the consumer are configured.
    pub fn stores(&self) -> tally::ops::Stores {
        tally::ops::Stores {
            cassandra: self.cassandra.clone(),
            kafka: self.kafka.clone(),
            redis: self.redis.clone(),
        }
    }

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

    /// Where a user's applied row of a target lives: the `bucket` and
    /// `user_token` columns of `target_stats`, for CQL that damages it.
    pub fn place_of(&self, user: &str) -> (i32, i64) {
        let user = tally::domain::UserId::parse(user).unwrap_or_else(|e| panic!("{e}"));
        let token = tally::store::token_of(&user);
        let layout = tally::domain::Layout::new(TEST_BUCKETS).unwrap_or_else(|e| panic!("{e}"));
        (layout.of_token(token).column(), token)
    }

    /// `tally status --json` against these operator addresses, reading
    /// their metrics `interval` apart.
    pub fn status(
        &self,
        vote_ops: &str,
        consumer_ops: &str,
        interval: &str,
    ) -> std::io::Result<std::process::Output> {
        self.tally()
            .args(["status", "--json", "--interval", interval])
            .args(["--vote-ops", vote_ops, "--consumer-ops", consumer_ops])
            .output()
    }

    /// The `tally` binary with this test's keyspace, topics, group and prefix.
    pub fn tally(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tally"));
        cmd.env("TALLY_KEYSPACE", &self.cassandra.keyspace)
            .env("TALLY_CASSANDRA_NODES", self.cassandra.nodes.join(","))
            .env("TALLY_KAFKA_BROKERS", &self.kafka.brokers)
            .env("TALLY_TOPIC", &self.kafka.topic)
            .env("TALLY_DEAD_LETTER_TOPIC", &self.kafka.dead_letter_topic)
            .env("TALLY_CONSUMER_GROUP", &self.group)
            .env("TALLY_REDIS_PREFIX", &self.redis.prefix)
            .env("TALLY_CONSUMER_LISTEN", "127.0.0.1:0")
            // Fault runs drive few users hard: the fair-use limits stay out
            // of their way (tests of the limits configure them).
            .env("TALLY_USER_NEW_TARGETS_RATE", "10000")
            .env("TALLY_USER_NEW_TARGETS_BURST", "10000")
            .env("TALLY_USER_DAILY_VOTES", "100000000")
            .env("RUST_LOG", "warn")
            .envs(self.cli_env.iter().map(|(k, v)| (k, v)));
        cmd
    }
}
