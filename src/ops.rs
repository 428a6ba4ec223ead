//! What operators poll: `/metrics` (Prometheus text), `/healthz` (the process
//! is alive) and `/readyz` (Cassandra, Kafka and Redis answer; 503 naming the
//! ones that do not). The vote API mounts these beside its routes; the
//! consumer serves them on its own `--listen` address.

use std::sync::Arc;
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
}

const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

impl Readiness {
    pub fn new(store: Arc<Store>, kafka: &KafkaConfig, cache: Cache) -> anyhow::Result<Readiness> {
        Ok(Readiness {
            store,
            kafka: bus::Probe::new(kafka)?,
            cache,
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
        [c, k, r].into_iter().flatten().collect()
    }
}

pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

pub async fn readyz(readiness: web::Data<Readiness>) -> HttpResponse {
    let failing = readiness.failing().await;
    if failing.is_empty() {
        return HttpResponse::Ok().json(json!({"status": "ready"}));
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
