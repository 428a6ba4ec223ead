//! What operators poll: `/metrics` (Prometheus text), `/healthz` (the process
//! is alive, with each dependency's last state) and `/readyz` (503 naming the
//! dependencies the role cannot work without). The vote API mounts these
//! beside its routes; the consumer serves them on its own `--listen` address.
//!
//! The vote API does not need Kafka to take a vote: a vote commits to
//! Cassandra and the outbox relay publishes it once Kafka answers. So for
//! the API a Kafka outage is reported (degraded), never a reason to be
//! pulled from a load balancer. The consumer cannot work without Kafka.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{App, HttpResponse, HttpServer, web};
use anyhow::Context;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

use crate::bus::{self, KafkaConfig};
use crate::cache::{Cache, RedisConfig};
use crate::store::{CassandraConfig, Store};

/// Where the three stores are. Every long-running role (the API, the
/// consumer) talks to all of them and reports whether each answers.
#[derive(clap::Args, Debug, Clone)]
pub struct Stores {
    #[command(flatten)]
    pub cassandra: CassandraConfig,
    #[command(flatten)]
    pub kafka: KafkaConfig,
    #[command(flatten)]
    pub redis: RedisConfig,
}

/// Checks each dependency with a short timeout.
#[derive(Clone)]
pub struct Readiness {
    store: Arc<Store>,
    kafka: bus::Probe,
    cache: Cache,
    /// Whether the role is unready without Kafka.
    needs_kafka: bool,
    /// Each dependency's state at its last check, for `/healthz`.
    last: Arc<Mutex<BTreeMap<&'static str, bool>>>,
}

const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

impl Readiness {
    /// The vote API's: Cassandra and Redis; Kafka only reported.
    pub fn for_api(
        store: Arc<Store>,
        kafka: &KafkaConfig,
        cache: Cache,
    ) -> anyhow::Result<Readiness> {
        Readiness::new(store, kafka, cache, false)
    }

    /// The consumer's: all three.
    pub fn for_consumer(
        store: Arc<Store>,
        kafka: &KafkaConfig,
        cache: Cache,
    ) -> anyhow::Result<Readiness> {
        Readiness::new(store, kafka, cache, true)
    }

    fn new(
        store: Arc<Store>,
        kafka: &KafkaConfig,
        cache: Cache,
        needs_kafka: bool,
    ) -> anyhow::Result<Readiness> {
        Ok(Readiness {
            store,
            kafka: bus::Probe::new(kafka)?,
            cache,
            needs_kafka,
            last: Arc::default(),
        })
    }

    /// The dependencies that do not answer, with why.
    pub async fn failing(&self) -> Vec<(&'static str, String)> {
        let cassandra = async {
            match tokio::time::timeout(CHECK_TIMEOUT, self.store.ping()).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(("cassandra", e.to_string())),
                Err(_) => Some(("cassandra", "timed out".into())),
            }
        };
        let kafka = async {
            self.kafka
                .check(CHECK_TIMEOUT)
                .await
                .err()
                .map(|e| ("kafka", format!("{e:#}")))
        };
        let redis = async {
            match tokio::time::timeout(CHECK_TIMEOUT, self.cache.ping()).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(("redis", e.to_string())),
                Err(_) => Some(("redis", "timed out".into())),
            }
        };
        let (c, k, r) = tokio::join!(cassandra, kafka, redis);
        for (name, failed) in [("cassandra", &c), ("kafka", &k), ("redis", &r)] {
            let up = failed.is_none();
            metrics::gauge!(crate::metrics::DEPENDENCY_UP, "dependency" => name).set(if up {
                1.0
            } else {
                0.0
            });
            if let Ok(mut last) = self.last.lock() {
                last.insert(name, up);
            }
        }
        [c, k, r].into_iter().flatten().collect()
    }

    /// Checks every dependency and sorts the failing ones into those the
    /// role cannot work without, and those it can.
    async fn check(&self) -> (Vec<(&'static str, String)>, Vec<&'static str>) {
        let (needed, degraded) = self
            .failing()
            .await
            .into_iter()
            .partition(|(name, _)| *name != "kafka" || self.needs_kafka);
        (needed, degraded.into_iter().map(|(name, _)| name).collect())
    }
}

/// Alive, with each dependency's state as of its last check (every
/// `/readyz` checks them all).
pub async fn healthz(readiness: web::Data<Readiness>) -> HttpResponse {
    let last = readiness.last.lock().map(|l| l.clone()).unwrap_or_default();
    let dependencies: serde_json::Map<String, serde_json::Value> = last
        .into_iter()
        .map(|(name, up)| (name.to_owned(), json!(if up { "up" } else { "down" })))
        .collect();
    HttpResponse::Ok().json(json!({"status": "ok", "dependencies": dependencies}))
}

pub async fn readyz(readiness: web::Data<Readiness>) -> HttpResponse {
    let (failing, degraded) = readiness.check().await;
    if failing.is_empty() {
        return HttpResponse::Ok().json(json!({"status": "ready", "degraded": degraded}));
    }
    let names: Vec<&str> = failing.iter().map(|(n, _)| *n).collect();
    let detail: serde_json::Map<String, serde_json::Value> = failing
        .iter()
        .map(|(n, e)| ((*n).to_owned(), json!(e)))
        .collect();
    HttpResponse::ServiceUnavailable()
        .insert_header((actix_web::http::header::RETRY_AFTER, "5"))
        .json(json!({"status": "unavailable", "failing": names, "detail": detail}))
}

pub async fn metrics(handle: web::Data<PrometheusHandle>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(handle.render())
}

/// The consumer's small HTTP server for the three endpoints. Returns the
/// bound port and the server future.
pub fn serve(
    listen: &str,
    readiness: Readiness,
    handle: PrometheusHandle,
) -> anyhow::Result<(u16, actix_web::dev::Server)> {
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("Failed to listen on {listen}"))?;
    let port = listener.local_addr()?.port();
    let (readiness, handle) = (web::Data::new(readiness), web::Data::new(handle));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(readiness.clone())
            .app_data(handle.clone())
            .route("/metrics", web::get().to(metrics))
            .route("/healthz", web::get().to(healthz))
            .route("/readyz", web::get().to(readyz))
    })
    .workers(1)
    .disable_signals()
    .listen(listener)?
    .run();
    Ok((port, server))
}
