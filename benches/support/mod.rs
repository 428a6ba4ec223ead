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

pub fn skip_message(bench: &str) {
    eprintln!("{bench}: the local stack is not up; start it with `scripts/stack.sh up`. Skipping.");
}

/// A bench's own keyspace and topics, made with the product's migrate.
pub struct BenchEnv {
    pub cassandra: CassandraConfig,
    pub kafka: KafkaConfig,
    pub redis: RedisConfig,
}

pub async fn bench_env(name: &str, partitions: i32) -> BenchEnv {
    let id = format!("{name}_{}", std::process::id());
    let cassandra = CassandraConfig::local(&format!("b_{id}"));
    let kafka = KafkaConfig::local(&format!("b-{id}-transitions"));
    let redis = RedisConfig::local(&format!("b-{id}"));
    let session = store::connect(&cassandra)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    store::migrate::run(&session, &cassandra.keyspace, &Replication::Simple(1))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    tally::bus::admin::ensure_topics(&kafka, partitions, 1)
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

/// Zipf(s) over 0..n by inverse CDF, driven by a small deterministic LCG.
pub struct Zipf {
    cdf: Vec<f64>,
    state: u64,
}

impl Zipf {
    pub fn new(n: usize, s: f64, seed: u64) -> Zipf {
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf, state: seed }
    }

    pub fn uniform(&mut self) -> f64 {
        self.state = self
            .state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.state >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: u64) -> u64 {
        (self.uniform() * n as f64) as u64 % n.max(1)
    }

    pub fn sample(&mut self) -> usize {
        let u = self.uniform();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

/// Latency percentiles in milliseconds, from a histogram of microseconds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
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
