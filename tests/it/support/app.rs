//! The vote API running in-process, and one helper per endpoint.

use std::time::Duration;

use super::rng::Rng;
use super::{JWT_SECRET, TestEnv};

/// The vote API running in-process on a free port, over a `TestEnv`.
#[derive(Clone)]
pub struct TestApp {
    pub address: String,
    /// Where its operator endpoints (/metrics, /readyz) are.
    pub ops: String,
    pub client: reqwest::Client,
}

impl TestEnv {
    pub fn api_config(&self) -> tally::api::ApiConfig {
        tally::api::ApiConfig {
            listen: "127.0.0.1:0".into(),
            ops_listen: "127.0.0.1:0".into(),
            workers: 2,
            idempotency_ttl: Duration::from_secs(24 * 3600),
            publish_timeout: Duration::from_secs(5),
            // A healthy Kafka acknowledges well within this, so a test that
            // counts the topic right after an answer sees its transition.
            publish_wait: Duration::from_secs(5),
            user_rate: 20.0,
            user_burst: 60,
            // Tests read far more often than people do.
            user_read_rate: 10_000.0,
            user_read_burst: 10_000,
            user_daily_votes: 1_000_000,
            user_new_targets_rate: 10_000.0,
            user_new_targets_burst: 10_000,
            targets: tally::api::targets::TargetRules::default(),
            max_in_flight: 1024,
            min_in_flight: 4,
            slow_request: Duration::from_millis(500),
            body_timeout: Duration::from_secs(5),
            // Debug builds on a busy machine are slow; tests that race many
            // requests must not be refused for it. The admission test sets
            // its own limit.
            admission_target: Duration::from_secs(60),
            admission_queue_wait: Duration::from_millis(50),
            admission_refusal_ratio: 15.0,
            demo: false,
            consumer_group: self.group.clone(),
            // Tests that need the relay turn it on (`with_relay`).
            relay: tally::relay::RelayConfig {
                settle: Duration::from_secs(2),
                interval: Duration::from_millis(500),
                horizon: Duration::from_secs(60),
                disabled: true,
            },
            auth: tally::auth::AuthConfig::hs256(JWT_SECRET),
            cache_ttl: tally::cache::TtlPolicy {
                min: Duration::from_secs(60),
                max: Duration::from_secs(3600),
            },
            stores: self.stores(),
        }
    }

    pub async fn spawn_app(&self) -> TestApp {
        self.spawn_app_with(self.api_config()).await
    }

    pub async fn spawn_app_with(&self, config: tally::api::ApiConfig) -> TestApp {
        let app = tally::api::Application::build(config)
            .await
            .unwrap_or_else(|e| panic!("app: {e:#}"));
        let address = format!("http://127.0.0.1:{}", app.port());
        let ops = format!("http://127.0.0.1:{}", app.ops_port());
        tokio::spawn(app.run_until_stopped());
        TestApp {
            address,
            ops,
            client: reqwest::Client::new(),
        }
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
    /// Whether this is a stored answer given again (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.headers
            .get("Idempotent-Replayed")
            .is_some_and(|v| v.as_bytes() == b"true")
    }

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

/// A vote from `user` with `key`, as a client of the fault runs sends it to
/// a `tally vote` process at `base`, given up after `timeout`.
pub async fn post_vote(
    client: &reqwest::Client,
    base: &str,
    user: &str,
    key: &str,
    target: &str,
    action: &str,
    timeout: std::time::Duration,
) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{base}/v1/votes"))
        .bearer_auth(token(user))
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"target_id": target, "target_type": "video", "action": action}))
        .timeout(timeout)
        .send()
        .await
}

impl TestEnv {
    /// A `tally vote` process of its own over this test's stores, as
    /// another instance is in production (its own metrics, caches and
    /// hints), once it answers `/healthz`. `configure` adds to its
    /// environment; dropping the `Proc` kills it. A free port can be taken
    /// by someone else before the process binds it: then it starts again on
    /// others, up to three times. Any other start that fails panics with
    /// what the process printed.
    pub async fn spawn_vote_process(
        &self,
        configure: impl Fn(&mut std::process::Command),
    ) -> std::io::Result<(super::Proc, TestApp)> {
        let mut tries = 0;
        loop {
            tries += 1;
            let (port, ops) = (super::free_port(), super::free_port());
            let log = std::env::temp_dir().join(format!("tally-vote-{}-{port}.log", self.id));
            let mut cmd = self.tally();
            cmd.arg("vote")
                .env("TALLY_LISTEN", format!("127.0.0.1:{port}"))
                .env("TALLY_OPS_LISTEN", format!("127.0.0.1:{ops}"))
                .env("TALLY_JWT_SECRET", JWT_SECRET)
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(&log)?);
            configure(&mut cmd);
            let mut process = super::Proc(cmd.spawn()?);
            let app = TestApp {
                address: format!("http://127.0.0.1:{port}"),
                ops: format!("http://127.0.0.1:{ops}"),
                client: reqwest::Client::new(),
            };
            let started = until_serving(
                &app.client,
                &app.address,
                &mut process,
                &log,
                Duration::from_secs(60),
            )
            .await;
            let _ = std::fs::remove_file(&log);
            match started {
                Ok(()) => return Ok((process, app)),
                Err(e)
                    if e.exit.is_some() && e.printed.contains("Failed to listen") && tries < 3 =>
                {
                    eprintln!("tally vote lost its port; starting it on others: {e}");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

/// How a `tally vote` process that never answered `/healthz` ended.
#[derive(Debug)]
pub struct NotServing {
    /// Its exit status; `None` when the time ran out first.
    pub exit: Option<std::process::ExitStatus>,
    /// The last lines it printed.
    pub printed: String,
}

impl std::fmt::Display for NotServing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.exit {
            Some(status) => write!(
                f,
                "tally vote exited ({status}) before it answered /healthz"
            )?,
            None => write!(f, "tally vote did not answer /healthz in time")?,
        }
        write!(f, "; it printed:\n{}", self.printed)
    }
}

/// Waits up to `deadline` for the `tally vote` process `vote` to answer
/// `/healthz` at `base`, and stops waiting as soon as it exits. What it
/// printed to `log` says why it did not serve.
pub async fn until_serving(
    client: &reqwest::Client,
    base: &str,
    vote: &mut super::Proc,
    log: &std::path::Path,
    deadline: Duration,
) -> Result<(), NotServing> {
    // `Some(None)`: serving; `Some(Some(status))`: exited first.
    let waited = tokio::time::timeout(
        deadline,
        super::eventually("tally vote to answer or exit", Duration::MAX, || {
            let exited = vote.0.try_wait().ok().flatten();
            async move {
                if answers_healthz(client, base).await {
                    Some(None)
                } else {
                    exited.map(Some)
                }
            }
        }),
    )
    .await;
    let exit = match waited {
        Ok(None) => return Ok(()),
        Ok(Some(status)) => Some(status),
        Err(_) => None,
    };
    let printed = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = printed.lines().collect();
    Err(NotServing {
        exit,
        printed: lines[lines.len().saturating_sub(20)..].join("\n"),
    })
}

/// Waits until a `tally vote` process at `base` answers `/healthz`.
pub async fn wait_until_healthy(
    client: &reqwest::Client,
    base: &str,
    deadline: std::time::Duration,
) {
    super::eventually("tally vote to answer", deadline, || async {
        answers_healthz(client, base).await.then_some(())
    })
    .await;
}

/// Whether a `tally vote` process at `base` answers `/healthz` now.
async fn answers_healthz(client: &reqwest::Client, base: &str) -> bool {
    client
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

pub fn new_key() -> String {
    uuid::Uuid::new_v4().to_string()
}

impl TestApp {
    /// Casts `n` votes from `users` users over `targets` targets, `width` at a
    /// time, with actions drawn from `rng`. Returns how many were answered 200.
    pub async fn random_votes(
        &self,
        rng: &mut Rng,
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
