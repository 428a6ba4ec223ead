//! What operators poll: `/metrics` (Prometheus text), `/healthz` (the process
//! is alive, with each dependency's last state) and `/readyz` (503 naming the
//! dependencies the role cannot work without). Each role serves them on an
//! address of its own (`--ops-listen` for the vote API, `--listen` for the
//! consumer), apart from the public API; the vote API also answers
//! `/healthz` on its public port, for load balancers.
//!
//! The dependencies are checked once a second in the background, whoever
//! asks: a flood of `/readyz` costs the stores nothing, and the answer names
//! what fails without its error (the log has that).
//!
//! The vote API does not need Kafka to take a vote: a vote commits to
//! Cassandra and the outbox relay publishes it once Kafka answers. So for
//! the API a Kafka outage is reported (degraded), never a reason to be
//! pulled from a load balancer. The consumer cannot work without Kafka.

use std::collections::{BTreeMap, BTreeSet};
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
    /// The last check's verdict, for `/readyz`; `None` until the first.
    verdict: Arc<Mutex<Option<Verdict>>>,
    /// What the role itself found it cannot work without, until released
    /// (the consumer's dead-letter topic refusing writes).
    held: Arc<Mutex<BTreeSet<&'static str>>>,
}

/// What the last check found: what the role cannot work without, and what
/// it can.
#[derive(Debug, Clone, Default)]
struct Verdict {
    failing: Vec<&'static str>,
    degraded: Vec<&'static str>,
}

const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the dependencies are checked.
const CHECK_EVERY: Duration = Duration::from_secs(1);

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
            verdict: Arc::default(),
            held: Arc::default(),
        })
    }

    /// Makes the role unready, naming `name`, until `release`. True when it
    /// was not held already.
    pub fn hold(&self, name: &'static str) -> bool {
        self.held.lock().is_ok_and(|mut h| h.insert(name))
    }

    pub fn release(&self, name: &'static str) {
        if let Ok(mut held) = self.held.lock() {
            held.remove(name);
        }
    }

    fn held(&self) -> Vec<&'static str> {
        self.held
            .lock()
            .map(|h| h.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Checks the dependencies every `CHECK_EVERY`, for as long as the
    /// runtime runs. A dependency that starts failing is logged with its
    /// error once, and again when it answers.
    pub fn watch(&self) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut down: BTreeMap<&'static str, String> = BTreeMap::new();
            loop {
                let failing = this.failing().await;
                for (name, error) in &failing {
                    if !down.contains_key(name) {
                        tracing::warn!(dependency = name, error = %error, "dependency not answering");
                    }
                }
                for name in down.keys() {
                    if !failing.iter().any(|(n, _)| n == name) {
                        tracing::info!(dependency = name, "dependency answers again");
                    }
                }
                down = failing.iter().map(|(n, e)| (*n, e.clone())).collect();
                let (needed, degraded): (Vec<_>, Vec<_>) = failing
                    .into_iter()
                    .map(|(name, _)| name)
                    .partition(|name| *name != "kafka" || this.needs_kafka);
                if let Ok(mut verdict) = this.verdict.lock() {
                    *verdict = Some(Verdict {
                        failing: needed,
                        degraded,
                    });
                }
                tokio::time::sleep(CHECK_EVERY).await;
            }
        });
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
}

/// Alive, with each dependency's state as of its last check.
pub async fn healthz(readiness: web::Data<Readiness>) -> HttpResponse {
    let mut last = readiness.last.lock().map(|l| l.clone()).unwrap_or_default();
    for name in readiness.held() {
        last.insert(name, false);
    }
    let dependencies: serde_json::Map<String, serde_json::Value> = last
        .into_iter()
        .map(|(name, up)| (name.to_owned(), json!(if up { "up" } else { "down" })))
        .collect();
    HttpResponse::Ok().json(json!({"status": "ok", "dependencies": dependencies}))
}

/// Ready or not, as of the last background check: names, never errors.
pub async fn readyz(readiness: web::Data<Readiness>) -> HttpResponse {
    let mut verdict = readiness.verdict.lock().ok().and_then(|v| v.clone());
    if let Some(v) = verdict.as_mut() {
        v.failing.extend(readiness.held());
    }
    let unavailable = |body: serde_json::Value| {
        HttpResponse::ServiceUnavailable()
            .insert_header((actix_web::http::header::RETRY_AFTER, "5"))
            .json(body)
    };
    match verdict {
        None => unavailable(json!({"status": "starting"})),
        Some(v) if v.failing.is_empty() => {
            HttpResponse::Ok().json(json!({"status": "ready", "degraded": v.degraded}))
        }
        Some(v) => unavailable(json!({"status": "unavailable", "failing": v.failing})),
    }
}

pub async fn metrics(handle: web::Data<PrometheusHandle>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(handle.render())
}

/// A resource of the operator server that answers other methods with a
/// JSON 405, as the API does, rather than actix's empty 404.
fn only_get(path: &str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(|| async {
        let mut res = refusal(
            actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this endpoint answers GET only",
        );
        res.headers_mut().insert(
            actix_web::http::header::ALLOW,
            actix_web::http::header::HeaderValue::from_static("GET"),
        );
        res
    }))
}

/// An error in the API's shape: `{"error": {"code", "message"}}`.
fn refusal(status: actix_web::http::StatusCode, code: &str, message: &str) -> HttpResponse {
    HttpResponse::build(status).json(json!({ "error": { "code": code, "message": message } }))
}

/// A role's small HTTP server for the three endpoints, and the background
/// checks behind them. Returns the bound port and the server future.
pub fn serve(
    listen: &str,
    readiness: Readiness,
    handle: PrometheusHandle,
) -> anyhow::Result<(u16, actix_web::dev::Server)> {
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("Failed to listen on {listen} (operator endpoints)"))?;
    readiness.watch();
    let port = listener.local_addr()?.port();
    let (readiness, handle) = (web::Data::new(readiness), web::Data::new(handle));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(readiness.clone())
            .app_data(handle.clone())
            .service(only_get("/metrics").route(web::get().to(metrics)))
            .service(only_get("/healthz").route(web::get().to(healthz)))
            .service(only_get("/readyz").route(web::get().to(readyz)))
            .default_service(web::to(|| async {
                refusal(
                    actix_web::http::StatusCode::NOT_FOUND,
                    "not_found",
                    "no such endpoint: /metrics, /healthz and /readyz are served here",
                )
            }))
    })
    .workers(1)
    .disable_signals()
    // Nothing here is worth holding a stop for: a scraper's keep-alive
    // connection would otherwise keep it waiting up to actix's 30 s.
    .shutdown_timeout(2)
    .listen(listener)?
    .run();
    Ok((port, server))
}
