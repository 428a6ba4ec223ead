//! `tally vote`: the HTTP API. Handlers parse into domain types, call
//! `cast` or `counts`, and map errors to HTTP in `error`.

pub mod admin;
pub mod admission;
mod caller;
pub mod demo;
pub mod error;
pub mod limit;
pub mod openapi;
mod pacing;
pub mod summary;
pub mod targets;
pub mod votes;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Server, ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, HttpMessage, HttpRequest, HttpResponse, HttpServer, web};
use anyhow::Context;
use tracing::Instrument;

use crate::auth::{AuthConfig, Verifier};
use crate::bus::publisher::Publisher;
use crate::cache::{Cache, TtlPolicy};
use crate::cast::{CastConfig, Caster};
use crate::cli::values;
use crate::counts::Counts;
use crate::ops::{self, Readiness, Stores};
use crate::reconcile::Reconciler;
use crate::relay::{Relay, RelayConfig};
use crate::store::Store;
use error::ApiError;

/// The longest a publish may wait for Kafka's acknowledgement: far past any
/// outage a vote should wait out, and within librdkafka's 32-bit milliseconds.
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The most HTTP worker threads: each is a thread with a runtime of its own.
const MOST_WORKERS: usize = 1_024;
/// The most requests of a kind admitted at once; far more than any store
/// finishes in time, and within what a semaphore holds.
const MOST_IN_FLIGHT: usize = 1_000_000;

/// How long a stopping API waits for Redis to take the drops it owes:
/// after it, nothing would send them.
const DROPS_BEFORE_EXIT: Duration = Duration::from_secs(5);

/// Settings of `tally vote`.
#[derive(clap::Args, Debug, Clone)]
pub struct ApiConfig {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080", value_parser = values::listen_address)]
    pub listen: String,

    /// Address of the operator endpoints: /metrics, /readyz and /healthz.
    /// Keep it off the public network; the public port answers /healthz
    /// only.
    #[arg(long = "ops-listen", env = "TALLY_OPS_LISTEN", default_value = "127.0.0.1:9090", value_parser = values::listen_address)]
    pub ops_listen: String,

    /// HTTP worker threads.
    #[arg(long, env = "TALLY_WORKERS", default_value_t = 2, value_parser = values::count(MOST_WORKERS))]
    pub workers: usize,

    /// How long an Idempotency-Key and its answer are kept.
    #[arg(long = "idempotency-ttl", env = "TALLY_IDEMPOTENCY_TTL", default_value = "24h", value_parser = values::duration_within(values::SECOND, values::LONGEST))]
    pub idempotency_ttl: Duration,

    /// How long one attempt to publish a transition may take; after that the
    /// relay publishes it from the outbox.
    #[arg(long = "publish-timeout", env = "TALLY_PUBLISH_TIMEOUT", default_value = "3s", value_parser = values::duration_within(crate::bus::publisher::SHORTEST_TIMEOUT, DAY))]
    pub publish_timeout: Duration,

    /// How long an answer waits for Kafka to acknowledge its transition
    /// (0s: not at all; the transition is already durable with the change,
    /// and the relay publishes what the vote's own task does not).
    #[arg(long = "publish-wait", env = "TALLY_PUBLISH_WAIT", default_value = "0s", value_parser = values::duration)]
    pub publish_wait: Duration,

    /// Votes per second each user may cast (a token bucket; 429 beyond it).
    #[arg(long = "user-rate", env = "TALLY_USER_RATE", default_value_t = 20.0, value_parser = values::per_second)]
    pub user_rate: f64,

    /// Burst of votes a user may cast at once.
    #[arg(long = "user-burst", env = "TALLY_USER_BURST", default_value_t = 60, value_parser = values::at_least_one_u32)]
    pub user_burst: u32,

    /// Summary reads per second each user may make (a token bucket of its
    /// own; 429 beyond it), so one client's flood of reads cannot crowd out
    /// the others'.
    #[arg(long = "user-read-rate", env = "TALLY_USER_READ_RATE", default_value_t = 50.0, value_parser = values::per_second)]
    pub user_read_rate: f64,

    /// Votes each user may cast in one UTC day (counted in Redis; 429
    /// `daily_limit` beyond it). It bounds the idempotency records a user
    /// can pile into their partition.
    #[arg(long = "user-daily-votes", env = "TALLY_USER_DAILY_VOTES", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub user_daily_votes: u64,

    /// Votes per second each user may cast on targets this process has not
    /// seen (each one a registry write; 429 `new_targets_limited` beyond it).
    #[arg(
        long = "user-new-targets-rate",
        env = "TALLY_USER_NEW_TARGETS_RATE",
        default_value_t = 2.0,
        value_parser = values::per_second
    )]
    pub user_new_targets_rate: f64,

    /// Burst of such votes a user may cast at once.
    #[arg(
        long = "user-new-targets-burst",
        env = "TALLY_USER_NEW_TARGETS_BURST",
        default_value_t = 100,
        value_parser = values::at_least_one_u32
    )]
    pub user_new_targets_burst: u32,

    #[command(flatten)]
    pub targets: targets::TargetRules,

    /// Burst of summary reads a user may make at once.
    #[arg(long = "user-read-burst", env = "TALLY_USER_READ_BURST", default_value_t = 100, value_parser = values::at_least_one_u32)]
    pub user_read_burst: u32,

    /// The most votes (and, apart, summaries) processed at once. Below it
    /// the admission limit adapts to latency (`--admission-target`); above
    /// the limit requests wait in a short queue, then are answered 503 with
    /// Retry-After (paced by `--admission-refusal-ratio`).
    #[arg(long = "max-in-flight", env = "TALLY_MAX_IN_FLIGHT", default_value_t = 1024, value_parser = values::count(MOST_IN_FLIGHT))]
    pub max_in_flight: usize,

    /// The fewest requests of a kind admitted at once, however slow: enough
    /// to keep the stores busy, so that CPU taken by other work (which also
    /// slows votes) cannot shrink the limit to nothing.
    #[arg(long = "min-in-flight", env = "TALLY_MIN_IN_FLIGHT", default_value_t = 32, value_parser = values::count(MOST_IN_FLIGHT))]
    pub min_in_flight: usize,

    /// While requests of a kind take longer than this on average, fewer are
    /// admitted at once; while they are faster, more.
    #[arg(long = "admission-target", env = "TALLY_ADMISSION_TARGET", default_value = "50ms", value_parser = values::duration_above_zero)]
    pub admission_target: Duration,

    /// The shortest a request above the limit may wait for a place before it
    /// is refused: it waits up to two average requests' time when that is
    /// longer, never more than four `--admission-target`s (at most as many
    /// wait as the limit; the rest are refused at once).
    #[arg(long = "admission-queue-wait", env = "TALLY_ADMISSION_QUEUE_WAIT", default_value = "50ms", value_parser = values::duration)]
    pub admission_queue_wait: Duration,

    /// Refusals (503) of a kind answered at once per request of that kind
    /// completed (on average over the last five seconds); beyond that rate
    /// each refusal waits its turn, at most a second, so clients that send
    /// again the moment they are refused cannot take the stores' CPU with
    /// refusals. An open loop at ten times the capacity needs about 10 when
    /// goodput holds; 15 leaves room for goodput to dip by a third. 0
    /// answers every refusal at once.
    #[arg(long = "admission-refusal-ratio", env = "TALLY_ADMISSION_REFUSAL_RATIO", default_value_t = 15.0, value_parser = refusal_ratio)]
    pub admission_refusal_ratio: f64,

    /// Requests slower than this are logged at WARN, whatever the filter.
    #[arg(long = "slow-request", env = "TALLY_SLOW_REQUEST", default_value = "500ms", value_parser = values::duration)]
    pub slow_request: Duration,

    /// How long a client may take to send a request's headers, and then a
    /// vote's body. A vote's body is read whole before the vote is admitted,
    /// so a client that trickles it holds no place meant for the others; it
    /// gets 408 when this runs out.
    #[arg(long = "body-timeout", env = "TALLY_BODY_TIMEOUT", default_value = "5s", value_parser = values::duration_above_zero)]
    pub body_timeout: Duration,

    /// Serve the demo page at /demo (a video and its comments, drawn by the
    /// reference JavaScript client) with a development login that signs a
    /// token for any name. For a laptop only: never on a public address.
    #[arg(long, env = "TALLY_DEMO")]
    pub demo: bool,

    /// The consumer group whose lag this API measures and sizes cache TTLs by.
    #[arg(long = "consumer-group", env = "TALLY_CONSUMER_GROUP", default_value = "tally-consumer")]
    pub consumer_group: String,

    #[command(flatten)]
    pub relay: RelayConfig,
    #[command(flatten)]
    pub auth: AuthConfig,
    #[command(flatten)]
    pub cache_ttl: TtlPolicy,
    #[command(flatten)]
    pub stores: Stores,
}

impl ApiConfig {
    fn cast_config(&self) -> CastConfig {
        CastConfig {
            publish_wait: self.publish_wait,
            request_timeout: Duration::from_millis(self.stores.cassandra.request_timeout_ms),
            ..CastConfig::default()
        }
    }

    /// The settings that contradict each other, each of which parsed alone.
    /// `tally vote` refuses them before it connects to anything.
    pub fn check(&self) -> Result<(), String> {
        targets::TargetPolicy::new(&self.targets).map_err(|e| format!("{e:#}"))?;
        self.stores.redis.check()?;
        if overlap(&self.listen, &self.ops_listen) {
            return Err(format!(
                "--listen {} and --ops-listen {} are the same address: the operator endpoints need one of their own",
                self.listen, self.ops_listen
            ));
        }
        self.stores.kafka.event_key()?;
        if self.min_in_flight > self.max_in_flight {
            return Err(format!(
                "--min-in-flight {} is above --max-in-flight {}",
                self.min_in_flight, self.max_in_flight
            ));
        }
        if self.cache_ttl.min > self.cache_ttl.max {
            return Err(format!(
                "--cache-ttl-min {} is above --cache-ttl-max {}",
                shown(self.cache_ttl.min),
                shown(self.cache_ttl.max)
            ));
        }
        // The cache's marks and reconcile's look at recent rows cover a
        // vote's late cache step for so long: a vote that may take longer
        // could count in the cache a change they took for counted already.
        let longest_vote = self
            .cast_config()
            .longest_vote(self.stores.redis.change_budget());
        if longest_vote > crate::cast::LONGEST_VOTE {
            return Err(format!(
                "--cassandra-timeout-ms and --redis-timeout let a vote take {} (its deadline, \
                 two Cassandra requests and counting it in the cache), more than the {} the \
                 cache's marks and reconcile are sized for",
                shown(longest_vote),
                shown(crate::cast::LONGEST_VOTE)
            ));
        }
        if self.relay.disabled {
            return Ok(());
        }
        // The relay must not look at a vote still in flight: it would take
        // it for one that never committed, and if the vote's own publish then
        // failed, only reconcile would count it.
        if self.relay.settle <= longest_vote {
            return Err(format!(
                "--relay-settle {} is not longer than a vote may take ({}: \
                 its deadline, two Cassandra requests and counting it in the cache)",
                shown(self.relay.settle),
                shown(longest_vote)
            ));
        }
        // The relay reads a vote's outcome from its key's record: once that
        // has expired, a vote that committed looks like one that never did.
        let reach = self.relay.horizon + self.relay.settle;
        if self.idempotency_ttl <= reach {
            return Err(format!(
                "--idempotency-ttl {} is not longer than the relay looks back \
                 (--relay-horizon plus --relay-settle, {})",
                shown(self.idempotency_ttl),
                shown(reach)
            ));
        }
        Ok(())
    }
}

/// Whether two listen addresses would take the same port on one address
/// (an unspecified address, 0.0.0.0, takes it on all). Port 0 picks a free
/// port each time, so it never clashes.
fn overlap(a: &str, b: &str) -> bool {
    use std::net::ToSocketAddrs;
    let resolved = |s: &str| s.to_socket_addrs().map(Vec::from_iter).unwrap_or_default();
    let (a, b) = (resolved(a), resolved(b));
    a.iter().any(|x| {
        b.iter().any(|y| {
            x.port() != 0
                && x.port() == y.port()
                && (x.ip() == y.ip() || x.ip().is_unspecified() || y.ip().is_unspecified())
        })
    })
}

/// A duration as the command line takes it: 15m 20s, not 920s.
fn shown(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

/// 0 (off), or a finite ratio of at least 0.1: below that a refusal would
/// be allowed less than every 0.2 s at the floor, which is off in all but name.
fn refusal_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(n) if n == 0.0 || (n.is_finite() && n >= 0.1) => Ok(n),
        _ => Err(format!(
            "expected 0 (off) or a number of at least 0.1, not {s:?}"
        )),
    }
}

/// One HTTP worker's clients of Cassandra and Redis. Each actix worker
/// serves its connections on a runtime of its own, on its own thread; the
/// clients made in `Application::build` are driven by the main runtime's
/// threads, and every round trip through them wakes one of those threads
/// and then the worker again. A worker's own clients are made by the worker
/// itself, on its first request (see `Worker`), so their connections are
/// driven by the thread that serves the request. The memory of the process
/// (the casters' hints, the registry of targets, the cache's TTL) is shared.
pub struct Clients {
    pub caster: Caster,
    pub counts: Counts,
    pub store: Arc<Store>,
    /// Where each user's votes of the day are counted.
    pub cache: Cache,
}

/// Where a worker's clients are, once its first request has made them.
pub struct Worker {
    templates: Templates,
    clients: tokio::sync::OnceCell<Arc<Clients>>,
}

impl Worker {
    /// This worker's clients, made on its own runtime the first time. Until
    /// a connection succeeds every request tries again, and is answered 503.
    pub async fn clients(&self) -> Result<Arc<Clients>, ApiError> {
        self.clients
            // Boxed: connecting is a deep future, run once, that the
            // handlers' futures need not carry.
            .get_or_try_init(|| async {
                Box::pin(self.templates.clone().clients())
                    .await
                    .map(Arc::new)
            })
            .await
            .cloned()
            .map_err(|e| {
                ApiError::Unavailable(e.context("an HTTP worker could not connect to the stores"))
            })
    }
}

/// What a worker's `Clients` are made from: the process's own, and the
/// settings to connect again.
#[derive(Clone)]
struct Templates {
    caster: Arc<Caster>,
    counts: Counts,
    store: Arc<Store>,
    cache: Cache,
    cassandra: crate::store::CassandraConfig,
    redis: crate::cache::RedisConfig,
}

impl Templates {
    async fn clients(self) -> anyhow::Result<Clients> {
        let store = Arc::new(self.store.on_own_session(&self.cassandra).await?);
        let cache = self.cache.with_own_pool(&self.redis)?;
        let counts = self.counts.on(cache.clone(), store.clone());
        Ok(Clients {
            caster: self.caster.on(store.clone(), counts.clone()),
            counts,
            store,
            cache,
        })
    }
}

pub struct AppState {
    pub reconciler: Reconciler,
    pub limiter: limit::UserLimiter,
    /// Each user's summary reads, apart from their votes.
    pub readers: limit::UserLimiter,
    /// Each user's votes on targets this process has not registered.
    pub new_targets: limit::UserLimiter,
    pub targets: targets::TargetPolicy,
    pub daily_votes: u64,
    /// Admission of votes and of summaries, each adapting on its own.
    pub votes: Arc<admission::Admission>,
    pub summaries: Arc<admission::Admission>,
    /// Requests slower than this are always in the access log.
    pub slow_request: Duration,
    /// How long a vote's body may take to arrive.
    pub body_timeout: Duration,
}

/// The id of one HTTP request: the caller's `X-Request-Id` if it sent a sane
/// one, otherwise a new UUID. It is echoed back, logged on every line of the
/// request, and carried into the Kafka message.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

pub const REQUEST_ID: &str = "x-request-id";

pub struct Application {
    port: u16,
    ops_port: u16,
    server: Server,
    ops: Server,
    cache: Cache,
}

impl Application {
    /// Connects to every dependency, prepares every statement and binds the
    /// listener; the server runs once `run_until_stopped` is awaited.
    pub async fn build(config: ApiConfig) -> anyhow::Result<Application> {
        let verifier = web::Data::new(Verifier::build(&config.auth).await?);
        let demo = config
            .demo
            .then(|| demo::Demo::new(&config.auth))
            .transpose()?;

        let store =
            Arc::new(Store::open_waiting(&config.stores.cassandra, config.idempotency_ttl).await?);
        let cache = Cache::new(&config.stores.redis, config.cache_ttl.min)?;
        // A wrong password or CA is a setting to fix, not an outage to ride out.
        cache.check_login().await?;
        config.stores.kafka.check_login().await?;
        let counts = Counts::new(cache.clone(), store.clone());
        let publisher = Publisher::new(&config.stores.kafka, config.publish_timeout)?;
        let caster = Caster::new(
            store.clone(),
            counts.clone(),
            publisher.clone(),
            config.cast_config(),
        );
        let reconciler = Reconciler::new(store.clone(), Some(cache.clone()));
        if !config.relay.disabled {
            tokio::spawn(Relay::new(store.clone(), publisher.clone(), config.relay.clone()).run());
        }
        let readiness = Readiness::for_api(store.clone(), &config.stores.kafka, cache.clone())?;
        let (ops_port, ops) = crate::ops::serve(
            &config.ops_listen,
            readiness.clone(),
            crate::metrics::install(),
        )?;
        let readiness = web::Data::new(readiness);
        let limiter = limit::UserLimiter::new(config.user_rate, config.user_burst);
        let admission = admission::AdmissionConfig {
            target: config.admission_target,
            min: config.min_in_flight,
            max: config.max_in_flight,
            queue_wait: config.admission_queue_wait,
            refusal_ratio: config.admission_refusal_ratio,
        };
        let templates = Templates {
            caster: Arc::new(caster),
            counts: counts.clone(),
            store,
            cache: cache.clone(),
            cassandra: config.stores.cassandra.clone(),
            redis: config.stores.redis.clone(),
        };
        let state = web::Data::new(AppState {
            reconciler,
            limiter,
            readers: limit::UserLimiter::new(config.user_read_rate, config.user_read_burst),
            new_targets: limit::UserLimiter::new(
                config.user_new_targets_rate,
                config.user_new_targets_burst,
            ),
            targets: targets::TargetPolicy::new(&config.targets)?,
            daily_votes: config.user_daily_votes,
            votes: admission::Admission::new("vote", admission),
            summaries: admission::Admission::new("summary", admission),
            slow_request: config.slow_request,
            body_timeout: config.body_timeout,
        });

        // A vote's cache step and `POST /v1/admin/reconcile`'s write through
        // owe a drop where Redis did not take them, as in the consumer.
        tokio::spawn(cache.clone().keep_dropping_owed());
        tokio::spawn(cache.clone().keep_checking_clock());
        tokio::spawn(config.cache_ttl.clone().follow_consumer_lag(
            cache.clone(),
            config.stores.kafka.clone(),
            config.consumer_group.clone(),
        ));

        let listener = TcpListener::bind(&config.listen)
            .with_context(|| format!("Failed to listen on {}", config.listen))?;
        let port = listener.local_addr()?.port();
        if demo.is_some() {
            // Its login signs a token for anyone who asks: harmless on the
            // loopback address of a laptop, a hole anywhere else.
            if listener.local_addr()?.ip().is_loopback() {
                tracing::info!(
                    page = format!("http://{}/demo", listener.local_addr()?),
                    "--demo: the demo page and its development login are served"
                );
            } else {
                tracing::warn!(address = %listener.local_addr()?, "--demo on an address other than loopback: /demo/login signs a token for any name it is given; never serve this publicly");
            }
        }
        let server = HttpServer::new(move || {
            // Called once per worker: each gets a `Worker` of its own.
            let worker = web::Data::new(Worker {
                templates: templates.clone(),
                clients: tokio::sync::OnceCell::new(),
            });
            App::new()
                .app_data(worker)
                .app_data(state.clone())
                .app_data(verifier.clone())
                .app_data(readiness.clone())
                .wrap(from_fn(admit))
                .wrap(from_fn(read_body))
                .wrap(from_fn(observe))
                .service(
                    web::resource("/v1/votes")
                        .route(web::post().to(votes::cast))
                        .default_service(web::to(only_post)),
                )
                .service(
                    web::resource("/v1/votes/summary")
                        .route(web::get().to(summary::summary))
                        .default_service(web::to(only_get)),
                )
                .service(
                    web::resource("/v1/admin/reconcile/{target_id}")
                        .route(web::post().to(admin::reconcile))
                        .default_service(web::to(only_post)),
                )
                .configure(|cfg| {
                    if let Some(demo) = &demo {
                        demo.routes(cfg);
                    }
                })
                .route("/openapi.json", web::get().to(openapi))
                .route("/healthz", web::get().to(ops::healthz))
                .default_service(web::to(not_found))
        })
        .workers(config.workers.max(1))
        .client_request_timeout(config.body_timeout)
        .shutdown_timeout(10)
        .listen(listener)?
        .run();
        Ok(Application {
            port,
            ops_port,
            server,
            ops,
            cache,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The bound port of the operator endpoints.
    pub fn ops_port(&self) -> u16 {
        self.ops_port
    }

    /// Serves until the API server stops (on a signal), sends the drops it
    /// owes, then stops the operator endpoints too.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let ops = self.ops.handle();
        let ops_task = tokio::spawn(self.ops);
        let served = self.server.await;
        self.cache.drop_owed_before_exit(DROPS_BEFORE_EXIT).await;
        ops.stop(true).await;
        let _ = ops_task.await;
        served
    }
}

async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound)
}

async fn only_post() -> Result<HttpResponse, ApiError> {
    Err(ApiError::MethodNotAllowed("POST"))
}

async fn only_get() -> Result<HttpResponse, ApiError> {
    Err(ApiError::MethodNotAllowed("GET"))
}

async fn openapi() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(openapi::document())
}

/// The access log: one compact line per request under the target
/// `tally::access`, outside the request's span so its fields are not
/// repeated. Answers of 5xx and slower than `--slow-request`, admission's
/// refusals excepted, are WARN, and always written; the rest are INFO, which the default filter leaves out
/// (`RUST_LOG=info,tally::access=info` writes them: about 200 bytes each).
fn access_log(res: &ServiceResponse<impl MessageBody>, id: &str, elapsed: Duration) {
    let slow = res
        .request()
        .app_data::<web::Data<AppState>>()
        .map_or(Duration::MAX, |s| s.slow_request);
    let status = res.status().as_u16();
    let ms = elapsed.as_secs_f64() * 1000.0;
    let (method, path) = (res.request().method().as_str(), res.request().path());
    // A refusal by admission is load being shed as designed, thousands a
    // second under overload: counted (tally_admission_refused_total), not
    // written one by one.
    let shed = res
        .response()
        .extensions()
        .get::<error::ErrorCode>()
        .is_some_and(|c| c.0 == "overloaded");
    // A paced refusal waits up to a second on purpose: not slow either.
    if !shed && (status >= 500 || elapsed >= slow) {
        tracing::warn!(target: "tally::access", method, path, status, ms, request_id = id, "answered");
    } else {
        tracing::info!(target: "tally::access", method, path, status, ms, request_id = id, "answered");
    }
}

/// The method and the path as the router matches them: with percent
/// escapes decoded, so `/v1/vote%73` is `/v1/votes` here as it is there.
/// `path()` is the URI's as sent, and a request spelled that way would
/// reach the handler past every check that compared it.
fn routed(req: &ServiceRequest) -> (&str, &str) {
    (req.method().as_str(), req.match_info().as_str())
}

/// Admits a vote or a summary request, or refuses it with 503 before any
/// of its work (the token's signature, the body, the stores). A vote's
/// permit goes into the request, for the vote's own task to hold.
async fn admit(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let admission = match routed(&req) {
        ("POST", "/v1/votes") => req.app_data::<web::Data<AppState>>().map(|s| &s.votes),
        ("GET", "/v1/votes/summary") => req.app_data::<web::Data<AppState>>().map(|s| &s.summaries),
        _ => None,
    };
    if let Some(admission) = admission {
        let Some(permit) = admission.admit().await else {
            let refused = actix_web::ResponseError::error_response(&ApiError::Overloaded);
            return Ok(req.into_response(refused).map_into_right_body());
        };
        req.extensions_mut().insert(Admitted(permit));
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}

/// Reads a vote's body whole, within `--body-timeout` and `MAX_BODY`, before
/// admission: a client that sends its body slowly (or never) then waits on
/// its own connection, not in a place the admission limit keeps for work,
/// and is answered 408 when its time is up.
async fn read_body(
    mut req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    if routed(&req) != ("POST", "/v1/votes") {
        return next
            .call(req)
            .await
            .map(ServiceResponse::map_into_left_body);
    }
    let deadline = req
        .app_data::<web::Data<AppState>>()
        .map_or(Duration::from_secs(5), |s| s.body_timeout);
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let read = match declared {
        Some(n) if n > votes::MAX_BODY => Err(ApiError::TooLarge(votes::MAX_BODY)),
        _ => {
            let payload = req.take_payload();
            match tokio::time::timeout(deadline, votes::read_capped(payload)).await {
                Ok(read) => read,
                Err(_) => Err(ApiError::BodyTimeout(deadline)),
            }
        }
    };
    match read {
        Ok(body) => {
            req.set_payload(actix_web::dev::Payload::from(body));
            next.call(req)
                .await
                .map(ServiceResponse::map_into_left_body)
        }
        Err(e) => {
            let refused = actix_web::ResponseError::error_response(&e);
            Ok(req.into_response(refused).map_into_right_body())
        }
    }
}

/// A request's admission permit, in its extensions until it ends (or, for a
/// vote, until its task does).
pub struct Admitted(pub admission::Permit);

/// Marks the request's admission permit, if it has one, as past its checks
/// (its token, its user's limits): from here its time is the stores'.
fn at_work(req: &HttpRequest) {
    if let Some(Admitted(permit)) = req.extensions_mut().get_mut::<Admitted>() {
        permit.at_work();
    }
}

/// Around every request: its id (echoed back, on every log line of the
/// request, carried into Kafka), its access log line, its status count, and
/// for the two API endpoints, its latency labelled by outcome.
async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
    req.extensions_mut().insert(RequestId(id.clone()));
    let latency = match routed(&req) {
        ("POST", "/v1/votes") => Some(crate::metrics::VOTE_WRITE_SECONDS),
        ("GET", "/v1/votes/summary") => Some(crate::metrics::VOTE_READ_SECONDS),
        _ => None,
    };
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.path());
    let started = std::time::Instant::now();
    let mut res = next.call(req).instrument(span.clone()).await?;
    let elapsed = started.elapsed();
    if let Some(name) = latency {
        let outcome = match res.response().extensions().get::<error::ErrorCode>() {
            Some(code) => code.0,
            None if res.headers().contains_key(votes::REPLAYED) => "replayed",
            None => "ok",
        };
        metrics::histogram!(name, "outcome" => outcome).record(elapsed.as_secs_f64());
    }
    access_log(&res, &id, elapsed);
    metrics::counter!(crate::metrics::HTTP_RESPONSES, "status" => res.status().as_u16().to_string())
        .increment(1);
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut()
            .insert(HeaderName::from_static(REQUEST_ID), v);
    }
    Ok(res)
}
