//! The secure run: tally against the stack of `scripts/stack.sh up --secure`,
//! where Cassandra, Kafka and Redis all want TLS and a login. The vote API and
//! the consumer run as their own Kafka users, with only their ACLs. Votes,
//! the summary, the consumer and reconcile must work; a wrong password, a
//! missing one or no TLS must stop tally with an error naming the store; and
//! neither role may write the other's topic.
//!
//!   scripts/stack.sh up --secure
//!   cargo test --test secure -- --nocapture

#[path = "it/support/mod.rs"]
mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use support::stack::stack;
use support::{JWT_SECRET, Proc, TestEnv, eventually, free_port, new_key, secure_vars, token};

#[tokio::test]
async fn tally_works_with_logins_and_tls_to_every_store_and_names_the_store_that_refuses_it()
-> anyhow::Result<()> {
    assert_eq!(
        stack(&["status"]).lines().next(),
        Some("mode: secure"),
        "this test needs `scripts/stack.sh up --secure`"
    );
    let env = TestEnv::on_secure_stack().await;

    let (port, ops) = (free_port(), free_port());
    let base = format!("http://127.0.0.1:{port}");
    // What each process prints goes to a file, so a start that fails says why.
    let log_of =
        |role: &str| std::env::temp_dir().join(format!("tally-secure-{}-{role}.log", env.id));
    let spawn = |role: &str, args: &[&str]| {
        let mut cmd = env.tally();
        let log = std::fs::File::create(log_of(role)).unwrap_or_else(|e| panic!("{e}"));
        cmd.arg(role)
            .args(args)
            .envs(secure_vars(role))
            .env("TALLY_JWT_SECRET", JWT_SECRET)
            .env("TALLY_CACHE_TTL_MIN", "3s")
            .env("TALLY_CACHE_TTL_MAX", "5s")
            .stdout(Stdio::null())
            .stderr(log);
        Proc(cmd.spawn().unwrap_or_else(|e| panic!("{e}")))
    };
    let listen = (
        format!("--listen=127.0.0.1:{port}"),
        format!("--ops-listen=127.0.0.1:{ops}"),
    );
    let mut vote = spawn("vote", &[&listen.0, &listen.1]);
    let consumer_ops = free_port();
    let _consumer = spawn("consumer", &[&format!("--listen=127.0.0.1:{consumer_ops}")]);
    let client = reqwest::Client::new();
    if let Err(e) = support::until_serving(
        &client,
        &base,
        &mut vote,
        &log_of("vote"),
        Duration::from_secs(90),
    )
    .await
    {
        panic!("{e}");
    }

    // Votes from 12 users on 3 targets, some changed and taken back.
    let targets = ["video_s1", "video_s2", "video_s3"];
    let mut accepted = 0;
    for round in 0..3 {
        for u in 0..12 {
            let target = targets[(u + round) % 3];
            let action = ["like", "dislike", "like", "none"][(u * 7 + round) % 4];
            let user = format!("secure-{u}");
            let r = support::post_vote(
                &client,
                &base,
                &user,
                &new_key(),
                target,
                action,
                Duration::from_secs(10),
            )
            .await?;
            assert!(r.status().is_success(), "vote refused: {}", r.status());
            accepted += 1;
        }
    }
    assert_eq!(accepted, 36);

    // The consumer counted every transition: durable totals equal the
    // recount of the users' rows, with no reconcile.
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let truth = env.recount().await;
    assert!(
        truth
            .values()
            .map(|t| t.likes() + t.dislikes())
            .sum::<i64>()
            > 0
    );

    // And the served answer, through Redis over TLS, says the same.
    let list = targets.join(",");
    let served = eventually(
        "served counts to equal the recount",
        Duration::from_secs(30),
        || async {
            let body: serde_json::Value = client
                .get(format!("{base}/v1/votes/summary?target_ids={list}"))
                .bearer_auth(token("secure-reader"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            targets
                .iter()
                .all(|t| {
                    let item = &body["items"][*t];
                    let want = truth.get(*t).map_or((0, 0), |x| (x.likes(), x.dislikes()));
                    (item["likes"].as_i64(), item["dislikes"].as_i64())
                        == (Some(want.0), Some(want.1))
                })
                .then_some(body)
        },
    )
    .await;
    eprintln!("secure: served {served}");

    // The two roles share the stack's event signing key: the consumer kept
    // every event by its signature and read no row behind one.
    let metrics = client
        .get(format!("http://127.0.0.1:{consumer_ops}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let checks = |by: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("tally_consumer_event_checks_total{{by=\"{by}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(checks("signature") > 0.0, "{metrics}");
    for by in ["row", "row_bad_signature", "row_unsigned", "row_unverified"] {
        assert_eq!(checks(by), 0.0, "{by}: {metrics}");
    }

    // Reconcile, as the migrating role, finds nothing to repair.
    let out = env
        .tally()
        .args(["reconcile", "--target", "video_s1"])
        .output()?;
    assert!(
        out.status.success(),
        "reconcile failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // What tally printed below, to check that no password is in it.
    let mut printed = String::new();

    // ACLs: only the vote API produces transitions, only the consumer
    // writes dead letters.
    let refused = |role: &'static str, topic: String| {
        let kafka = kafka_as(&env, role);
        async move {
            use rdkafka::producer::{FutureProducer, FutureRecord};
            let producer: FutureProducer = kafka
                .client()
                .set("message.timeout.ms", "10000")
                .create()
                .unwrap_or_else(|e| panic!("{e}"));
            let sent = producer
                .send(
                    FutureRecord::to(&topic).key("video_s1").payload("{}"),
                    Duration::from_secs(10),
                )
                .await;
            match sent {
                Err((e, _)) => format!("{e}"),
                Ok(_) => panic!("{role} produced to {topic}"),
            }
        }
    };
    let why = refused("consumer", env.kafka.topic.clone()).await;
    assert!(why.contains("authoriz"), "{why}");
    printed.push_str(&why);
    let why = refused("vote", env.kafka.dead_letter_topic.clone()).await;
    assert!(why.contains("authoriz"), "{why}");
    printed.push_str(&why);

    // A wrong or missing login, or no TLS, stops tally with the store's name.
    let fails = |role: &str, changes: &[(&str, &str)], removed: &[&str]| {
        let login = if role == "migrate" { "admin" } else { role };
        let mut cmd = env.tally();
        cmd.arg(role).envs(secure_vars(login));
        if role == "vote" {
            cmd.env("TALLY_JWT_SECRET", JWT_SECRET)
                .arg(format!("--listen=127.0.0.1:{}", free_port()))
                .arg(format!("--ops-listen=127.0.0.1:{}", free_port()));
        }
        cmd.envs(changes.iter().copied());
        for name in removed {
            cmd.env_remove(name);
        }
        let out = run_for(cmd, Duration::from_secs(60));
        assert!(
            !out.0,
            "tally {role} started with {changes:?} without {removed:?}"
        );
        eprintln!(
            "secure: tally {role} with {changes:?}, without {removed:?}: {}",
            out.1.lines().last().unwrap_or_default()
        );
        out.1
    };
    let why = fails("migrate", &[("TALLY_CASSANDRA_PASSWORD", "wrong")], &[]);
    assert!(
        why.contains("Cassandra") && why.contains("Authentication failed"),
        "{why}"
    );
    printed.push_str(&why);
    let why = fails(
        "migrate",
        &[],
        &["TALLY_CASSANDRA_USER", "TALLY_CASSANDRA_PASSWORD"],
    );
    assert!(why.contains("Cassandra"), "{why}");
    printed.push_str(&why);
    let why = fails("migrate", &[], &["TALLY_CASSANDRA_TLS_CA"]);
    assert!(why.contains("Cassandra"), "{why}");
    printed.push_str(&why);
    let why = fails("migrate", &[("TALLY_KAFKA_PASSWORD", "wrong")], &[]);
    assert!(
        why.contains("Kafka") && why.contains("refused the login"),
        "{why}"
    );
    printed.push_str(&why);
    let why = fails("consumer", &[("TALLY_KAFKA_PASSWORD", "wrong")], &[]);
    assert!(
        why.contains("Kafka") && why.contains("refused the login"),
        "{why}"
    );
    printed.push_str(&why);
    let why = fails("vote", &[("TALLY_REDIS_PASSWORD", "wrong")], &[]);
    assert!(
        why.contains("Redis") && why.contains("refused the login"),
        "{why}"
    );
    printed.push_str(&why);
    let why = fails("vote", &[], &["TALLY_REDIS_TLS_CA"]);
    assert!(why.contains("Redis"), "{why}");
    printed.push_str(&why);
    // None of it printed a password.
    for role in ["vote", "consumer", "admin"] {
        for (k, v) in secure_vars(role) {
            if k.ends_with("_PASSWORD") || k.ends_with("_KEY") {
                assert!(!printed.contains(&v), "{k} printed");
            }
        }
    }
    drop((vote, _consumer));
    for role in ["vote", "consumer"] {
        // Nor did either process log its signing key.
        let log = std::fs::read_to_string(log_of(role)).unwrap_or_default();
        for (k, v) in secure_vars(role) {
            assert!(
                k != "TALLY_EVENT_SIGNING_KEY" || !log.contains(&v),
                "{role} logged {k}"
            );
        }
        // The ACL lets the consumer check which Redis process it writes to.
        assert!(
            !log.contains("Redis refused the check"),
            "{role}: {}",
            log.lines()
                .find(|l| l.contains("Redis refused the check"))
                .unwrap_or_default()
        );
        let _ = std::fs::remove_file(log_of(role));
    }
    Ok(())
}

/// The test's Kafka settings as one role of the secure stack.
fn kafka_as(env: &TestEnv, role: &str) -> tally::bus::KafkaConfig {
    let mut kafka = env.kafka.clone();
    for (k, v) in secure_vars(role) {
        match k.as_str() {
            "TALLY_KAFKA_USER" => kafka.user = Some(v),
            "TALLY_KAFKA_PASSWORD" => kafka.password = Some(tally::secret::Secret::new(v)),
            _ => {}
        }
    }
    kafka
}

/// Runs `cmd` until it exits or `limit` passes (then kills it): whether it
/// started (exited successfully, or still ran), and what it printed on stderr.
fn run_for(mut cmd: Command, limit: Duration) -> (bool, String) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut err);
    }
    let _ = child.wait();
    // Still running at the limit counts as started.
    (status.is_none_or(|s| s.success()), err)
}
