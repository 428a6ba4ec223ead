//! What operators see: /metrics with the six signals, /healthz, /readyz, on
//! the operator address (`--ops-listen`), not the public one.

use std::time::Duration;

use futures::FutureExt;

use crate::support::{PrivateRedis, Rng, TestEnv, TestResult, eventually, free_port, new_key};

/// Sums the samples of `name` whose labels contain every `labels` fragment.
pub fn sample_sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let metric = series.split('{').next().unwrap_or("");
        if metric == name && labels.iter().all(|l| series.contains(l)) {
            *found.get_or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    found
}

pub async fn scrape(client: &reqwest::Client, url: &str) -> String {
    client
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn metrics_show_every_signal_and_lag_rises_while_the_consumer_is_stopped() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let metrics_url = format!("{}/metrics", app.ops);
    // Operator endpoints are on their own address, not the public one.
    for path in ["/metrics", "/readyz"] {
        let public = app
            .client
            .get(format!("{}{path}", app.address))
            .send()
            .await?;
        assert_eq!(public.status().as_u16(), 404, "{path} on the public port");
    }
    // The operator port refuses what it does not serve as the API does: in JSON.
    for (method, path, status, code) in [
        (reqwest::Method::GET, "/nope", 404, "not_found"),
        (reqwest::Method::POST, "/metrics", 405, "method_not_allowed"),
    ] {
        let reply = app
            .client
            .request(method, format!("{}{path}", app.ops))
            .send()
            .await?;
        assert_eq!(reply.status().as_u16(), status, "{path}");
        let body: serde_json::Value = reply.json().await?;
        assert_eq!(body["error"]["code"], code, "{path}: {body}");
    }

    let consumer = env.start_consumer();
    assert_eq!(app.random_votes(&mut Rng(21), 30, 10, 3, 8).await, 30);
    for _ in 0..5 {
        assert_eq!(
            app.summary("reader", "t0,t1,t2,never_voted").await.status,
            200
        );
    }
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    env.cql("UPDATE target_stats SET likes = 55 WHERE target_id = 't0' AND bucket = 1")
        .await;
    env.reconciler()
        .await
        .target(&tally::domain::TargetId::parse("t0")?, false)
        .await?;
    let consumer_port = consumer
        .progress
        .ops_port
        .load(std::sync::atomic::Ordering::Relaxed);
    let consumer_url = format!("http://127.0.0.1:{consumer_port}/metrics");
    let consumer_metrics = eventually(
        "the consumer's own lag gauge",
        Duration::from_secs(30),
        || async {
            let text = scrape(&app.client, &consumer_url).await;
            sample_sum(&text, "tally_consumer_lag_messages", &[]).map(|_| text)
        },
    )
    .await;
    consumer.stop().await;

    let text = scrape(&app.client, &metrics_url).await;
    let at_least = |name: &str, labels: &[&str], min: f64| {
        let v = sample_sum(&text, name, labels)
            .unwrap_or_else(|| panic!("{name}{labels:?} missing from /metrics"));
        assert!(v >= min, "{name}{labels:?} = {v}, expected at least {min}");
    };
    at_least("tally_vote_write_seconds_count", &["outcome=\"ok\""], 30.0);
    at_least("tally_vote_write_seconds_bucket", &["le=\"0.1\""], 1.0);
    at_least("tally_vote_read_seconds_count", &["outcome=\"ok\""], 5.0);
    at_least("tally_cache_lookups_total", &["result=\"hit\""], 1.0);
    at_least("tally_cache_lookups_total", &["result=\"miss\""], 1.0);
    at_least(
        "tally_cas_total",
        &["statement=\"vote\"", "outcome=\"applied\""],
        1.0,
    );
    at_least("tally_reconcile_drift_found_total", &[], 1.0);
    at_least("tally_reconcile_drift_repaired_total", &[], 1.0);
    at_least("tally_http_responses_total", &["status=\"200\""], 35.0);
    for (name, labels) in [
        ("tally_consumer_events_total", &["result=\"applied\""][..]),
        (
            "tally_cas_total",
            &["statement=\"stats\"", "outcome=\"applied\""][..],
        ),
        ("tally_consumer_lag_messages", &[][..]),
    ] {
        assert!(
            sample_sum(&consumer_metrics, name, labels).is_some_and(|v| v >= 0.0),
            "consumer /metrics lacks {name}{labels:?}"
        );
    }

    // Signal 3, from outside: votes with no consumer running make lag rise.
    let before = env.published();
    assert_eq!(app.random_votes(&mut Rng(22), 12, 10, 3, 4).await, 12);
    let unconsumed = (env.published() - before) as f64;
    assert!(unconsumed > 0.0, "some of the votes changed state");
    eventually(
        "the group lag to show every unconsumed transition",
        Duration::from_secs(30),
        || async {
            let text = scrape(&app.client, &metrics_url).await;
            let messages = sample_sum(&text, "tally_consumer_group_lag_messages", &[])?;
            let seconds = sample_sum(&text, "tally_consumer_group_lag_seconds", &[])?;
            (messages == unconsumed && seconds > 0.0).then_some(())
        },
    )
    .await;
    let consumer = env.start_consumer();
    eventually(
        "the group lag to return to zero",
        Duration::from_secs(60),
        || async {
            let text = scrape(&app.client, &metrics_url).await;
            (sample_sum(&text, "tally_consumer_group_lag_messages", &[]) == Some(0.0)).then_some(())
        },
    )
    .await;
    consumer.stop().await;
    Ok(())
}

#[tokio::test]
async fn readyz_names_redis_while_it_is_down_and_recovers_when_it_is_back() -> TestResult {
    let env = TestEnv::new().await;
    let port = free_port();
    let redis = PrivateRedis::start(port);
    let mut config = env.api_config();
    config.stores.redis.url = format!("redis://127.0.0.1:{}", redis.port);
    let app = tally::api::Application::build(config).await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    let ops = format!("http://127.0.0.1:{}", app.ops_port());
    tokio::spawn(app.run_until_stopped());
    let client = reqwest::Client::new();
    let readyz = |client: reqwest::Client, url: String| async move {
        let res = client.get(url).send().await.ok()?;
        let status = res.status().as_u16();
        Some((status, res.json::<serde_json::Value>().await.ok()?))
    };

    eventually("ready with Redis up", Duration::from_secs(30), || {
        readyz(client.clone(), format!("{ops}/readyz")).map(|r| r.filter(|(s, _)| *s == 200))
    })
    .await;
    let health = client.get(format!("{base}/healthz")).send().await?;
    assert_eq!(health.status().as_u16(), 200);

    redis.stop();
    let (_, body) = eventually("503 naming redis", Duration::from_secs(30), || {
        readyz(client.clone(), format!("{ops}/readyz")).map(|r| r.filter(|(s, _)| *s == 503))
    })
    .await;
    assert_eq!(body["failing"], serde_json::json!(["redis"]), "{body}");
    // A vote still commits without the cache: Redis is not the truth.
    let vote = crate::support::TestApp {
        address: base.clone(),
        ops: ops.clone(),
        client: client.clone(),
    }
    .vote("rita", new_key(), "video_r", "like")
    .await;
    assert_eq!(vote.status, 200, "{vote:?}");

    let _back = PrivateRedis::start(port);
    eventually("ready again", Duration::from_secs(30), || {
        readyz(client.clone(), format!("{ops}/readyz")).map(|r| r.filter(|(s, _)| *s == 200))
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn tally_status_reports_what_the_services_metrics_and_the_group_offsets_say() -> TestResult {
    use crate::support::{Proc, free_port};
    let env = TestEnv::new().await;
    // Processes of their own: each has its own metrics, as in production.
    let consumer_ops = free_port();
    // Signing keys that differ, as while one is being changed: every event
    // is read against the rows, and the screen marks it.
    let (_vote, app) = env
        .spawn_vote_process(|cmd| {
            cmd.env(
                "TALLY_EVENT_SIGNING_KEY",
                "the-vote-api-s-new-signing-key-32b",
            );
        })
        .await?;
    let _consumer = Proc(
        env.tally()
            .arg("consumer")
            .env("TALLY_CONSUMER_LISTEN", format!("127.0.0.1:{consumer_ops}"))
            .env(
                "TALLY_EVENT_SIGNING_KEY",
                "the-consumer-s-old-signing-key-32b",
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    );
    let mut rng = Rng(5);
    assert_eq!(app.random_votes(&mut rng, 60, 12, 10, 8).await, 60);
    for _ in 0..3 {
        assert_eq!(app.summary("reader", "t0,t1,t2,t3").await.status, 200);
    }
    env.publish_raw("t0", b"not a transition").await;
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let vote_ops = app.ops.clone();
    let consumer_url = format!("http://127.0.0.1:{consumer_ops}");
    eventually(
        "the dead letter to be counted",
        Duration::from_secs(30),
        || async {
            let text = scrape(&app.client, &format!("{consumer_url}/metrics")).await;
            (sample_sum(&text, "tally_consumer_dead_lettered_total", &[]) == Some(1.0))
                .then_some(())
        },
    )
    .await;

    // The group commits its offsets every few seconds: polled until it has.
    let status = eventually(
        "the group's committed offsets to catch up",
        Duration::from_secs(30),
        || async {
            let out = env.status(&vote_ops, &consumer_url, "200ms").ok()?;
            // Exit 4 when a read failed (Kafka's offsets, say): read again.
            out.status.success().then_some(())?;
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let lag = status["lag"].as_array().cloned().unwrap_or_default();
            lag.iter().all(|l| l["messages"] == 0).then_some(status)
        },
    )
    .await;
    let vote = scrape(&app.client, &format!("{vote_ops}/metrics")).await;
    let num = |key: &str| num_of(&status, key);
    let metric = |name: &str, labels: &[&str]| sample_sum(&vote, name, labels).unwrap_or(0.0);
    assert_eq!(
        num("cas_applied"),
        metric("tally_cas_total", &["outcome=\"applied\""])
    );
    assert!(num("cas_applied") >= 60.0, "{status}");
    assert_eq!(
        num("cas_unknown"),
        metric("tally_cas_total", &["outcome=\"unknown\""])
    );
    assert_eq!(
        num("cas_not_applied"),
        metric("tally_cas_total", &["outcome=\"not_applied\""])
    );
    let (hits, misses) = (
        metric("tally_cache_lookups_total", &["result=\"hit\""]),
        metric("tally_cache_lookups_total", &["result=\"miss\""]),
    );
    assert!(hits + misses > 0.0);
    assert!(
        (num("cache_hit_ratio") - hits / (hits + misses)).abs() < 1e-9,
        "{status}"
    );
    assert_eq!(num("dead_letters"), 1.0);
    assert_eq!(
        num("drift_found"),
        metric("tally_reconcile_drift_found_total", &[])
    );
    let consumer = scrape(&app.client, &format!("{consumer_url}/metrics")).await;
    let checked = |by: &str| {
        sample_sum(
            &consumer,
            "tally_consumer_event_checks_total",
            &[&format!("by=\"{by}\"")],
        )
        .unwrap_or(0.0)
    };
    assert!(checked("row_bad_signature") > 0.0, "{consumer}");
    assert_eq!(num("mismatched"), checked("row_bad_signature"));
    assert_eq!(num("checked_by_row"), checked("row_bad_signature"));
    assert_eq!(num("checked_by_signature"), 0.0);
    // Redis answered throughout: nothing owed, no offsets held.
    assert_eq!(
        num("drops_owed_consumer"),
        sample_sum(&consumer, "tally_cache_drops_owed", &[]).unwrap_or(0.0)
    );
    assert_eq!(num("drops_owed_consumer"), 0.0, "{status}");
    assert_eq!(num("batches_held"), 0.0, "{status}");
    assert_eq!(
        num("batches_held"),
        sample_sum(&consumer, "tally_consumer_batches_held", &[]).unwrap_or(0.0)
    );
    assert!(
        num("redis_clock_offset_seconds").abs() < 0.25,
        "one host's clock against itself: {status}"
    );
    assert_eq!(num("votes_per_sec"), 0.0, "nothing voted during its reads");
    let lag = status["lag"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        lag.len(),
        crate::support::TEST_PARTITIONS as usize,
        "{status}"
    );
    assert!(lag.iter().all(|l| l["messages"] == 0), "{status}");
    assert_eq!(status["unreachable"], serde_json::json!([]));

    // The screen says the same, and marks what is past its threshold.
    let screen = env
        .tally()
        .args(["status", "--interval", "200ms"])
        .args(["--vote-ops", &vote_ops, "--consumer-ops", &consumer_url])
        .output()?;
    let screen = String::from_utf8_lossy(&screen.stdout).into_owned();
    assert!(screen.contains("dead letters          1  (!)"), "{screen}");
    assert!(
        screen.contains(&format!(
            "events checked        0 by signature, {} by row ({} where the keys disagree)  (!)",
            num("checked_by_row"),
            num("mismatched")
        )),
        "{screen}"
    );
    assert!(screen.contains("lag, partition 0"), "{screen}");

    // A service that does not answer is named, its values are unknown rather
    // than zero, and the run fails: a script must not read a healthy zero.
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let out = env.status(&nobody, &consumer_url, "200ms")?;
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let status: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    for key in [
        "votes_per_sec",
        "cas_applied",
        "outbox_backlog",
        "drops_owed_api",
    ] {
        assert!(status[key].is_null(), "{key}: {status}");
    }
    assert_eq!(num_of(&status, "dead_letters"), 1.0, "{status}");
    let unreachable = status["unreachable"].to_string();
    assert!(unreachable.contains("tally vote"), "{status}");
    assert!(!unreachable.contains("tally consumer"), "{status}");
    let screen = env
        .tally()
        .args(["status", "--interval", "200ms"])
        .args(["--vote-ops", &nobody, "--consumer-ops", &consumer_url])
        .output()?;
    assert_eq!(screen.status.code(), Some(4));
    let screen = String::from_utf8_lossy(&screen.stdout).into_owned();
    assert!(
        screen.contains("conditional writes    - applied, - refused, - unknown\n"),
        "{screen}"
    );
    assert!(screen.contains("not answering"), "{screen}");
    Ok(())
}

/// Forwards connections to `port` on to `to`, from `after` on: until then
/// nothing listens there, as while a Cassandra node restarts.
fn listen_after(after: Duration, port: u16, to: String) {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) else {
            return;
        };
        for inbound in listener.incoming().flatten() {
            let Ok(outbound) = std::net::TcpStream::connect(&to) else {
                continue;
            };
            for (mut from, mut into) in [
                (inbound.try_clone(), outbound.try_clone()),
                (Ok(outbound), Ok(inbound)),
            ]
            .into_iter()
            .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
            {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut into);
                    let _ = into.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
}

/// A `tally vote` started while Cassandra does not answer waits for it, as
/// it rides out Redis and Kafka, and serves votes once it answers; it used to
/// exit, and a process started during a Cassandra restart stayed down.
#[tokio::test]
async fn a_vote_process_started_before_cassandra_answers_waits_for_it_then_serves() -> TestResult {
    use crate::support::free_port;
    let env = TestEnv::new().await;
    let port = free_port();
    let node = env
        .cassandra
        .nodes
        .first()
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:9042".into());
    // How long Cassandra is away after the process starts.
    listen_after(Duration::from_secs(3), port, node);
    let (_vote, app) = env
        .spawn_vote_process(|cmd| {
            cmd.env("TALLY_CASSANDRA_NODES", format!("127.0.0.1:{port}"));
        })
        .await?;
    let reply = app.vote("early", new_key(), "t_waited", "like").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    eventually("the vote to be served", Duration::from_secs(30), || async {
        let summary = app.summary("reader", "t_waited").await.json();
        (summary["items"]["t_waited"]["likes"].as_i64() == Some(1)).then_some(())
    })
    .await;
    Ok(())
}

fn num_of(status: &serde_json::Value, key: &str) -> f64 {
    status[key].as_f64().unwrap_or(f64::NAN)
}

/// Redis's clock as each `tally vote` measures it against its own, which a
/// vote's cache step relies on: exported, so operators can alert on it and
/// compare hosts. Through a link that shifts Redis's `TIME` 3 s ahead, the
/// offset reads 3 s; straight to the same Redis, next to nothing.
#[tokio::test]
async fn the_api_exports_how_far_the_clock_of_redis_is_from_its_own() -> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let ahead = crate::support::SkewedLink::start(redis.port, 3).await;
    let offset = async |app: &crate::support::TestApp| {
        let text = scrape(&app.client, &format!("{}/metrics", app.ops)).await;
        sample_sum(&text, "tally_redis_clock_offset_seconds", &[])
    };
    let mut readings = Vec::new();
    for port in [ahead.port, redis.port] {
        let (process, app) = env
            .spawn_vote_process(|cmd| {
                cmd.env("TALLY_REDIS_URL", format!("redis://127.0.0.1:{port}"));
            })
            .await?;
        let reading = eventually("the clock's offset", Duration::from_secs(30), || {
            offset(&app)
        })
        .await;
        readings.push(reading);
        drop(process);
    }
    let (through_link, straight) = (readings[0], readings[1]);
    assert!(
        (through_link - 3.0).abs() < 0.25,
        "Redis 3 s ahead read as {through_link} s"
    );
    assert!(
        straight.abs() < 0.25,
        "the same clock read as {straight} s apart"
    );
    Ok(())
}
