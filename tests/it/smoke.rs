//! The foundation: each real server answers the way the product relies on.

use std::time::Duration;

use futures::StreamExt;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally::store;

use crate::support::{TestEnv, TestResult};

#[tokio::test]
async fn cassandra_insert_if_not_exists_applies_once_and_reports_it_both_ways() -> TestResult {
    let env = TestEnv::new().await;
    let insert = env
        .session
        .prepare("INSERT INTO reactions (user_id, target_id, state, version) VALUES (?, ?, ?, ?) IF NOT EXISTS")
        .await
        ?;

    let first = env
        .session
        .execute_unpaged(&insert, ("alice", "video_1", "like", 1_i64))
        .await;
    let second = env
        .session
        .execute_unpaged(&insert, ("alice", "video_1", "dislike", 1_i64))
        .await;

    assert!(
        store::was_applied(first?)?,
        "the first INSERT IF NOT EXISTS must apply"
    );
    assert!(
        !store::was_applied(second?)?,
        "the second INSERT IF NOT EXISTS must not apply"
    );

    let (state,): (String,) = env
        .session
        .query_unpaged(
            "SELECT state FROM reactions WHERE user_id = 'alice' AND target_id = 'video_1'",
            (),
        )
        .await?
        .into_rows_result()?
        .single_row()?;
    assert_eq!(state, "like", "the losing insert must not have written");
    Ok(())
}

#[tokio::test]
async fn kafka_carries_one_message_from_a_producer_to_a_consumer() -> TestResult {
    let env = TestEnv::new().await;
    let producer: FutureProducer = env
        .kafka
        .client()
        .set("enable.idempotence", "true")
        .create()?;
    let payload = format!("hello from {}", env.id);
    producer
        .send(
            FutureRecord::to(&env.kafka.topic)
                .key("video_1")
                .payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|(e, _)| panic!("delivery failed: {e}"));

    let consumer: StreamConsumer = env
        .kafka
        .client()
        .set("group.id", &env.group)
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&env.kafka.topic])?;
    let msg = tokio::time::timeout(Duration::from_secs(60), consumer.stream().next())
        .await
        .unwrap_or_else(|_| panic!("no message within 60s"))
        .unwrap_or_else(|| panic!("stream ended"))?;
    assert_eq!(msg.payload(), Some(payload.as_bytes()));
    assert_eq!(msg.key(), Some(&b"video_1"[..]));
    Ok(())
}

#[tokio::test]
async fn redis_stores_and_returns_a_key() -> TestResult {
    let env = TestEnv::new().await;
    let pool = tally::cache::pool(&env.redis)?;
    let mut conn = pool.get().await?;
    let key = format!("{}:smoke", env.redis.prefix);
    let () = redis::cmd("SET")
        .arg(&key)
        .arg(&env.id)
        .query_async(&mut conn)
        .await?;
    let back: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
    assert_eq!(back.as_deref(), Some(env.id.as_str()));
    Ok(())
}

#[tokio::test]
async fn migrate_twice_applies_nothing_the_second_time_and_keeps_the_bucket_count() -> TestResult {
    let env = TestEnv::new().await;
    let session = store::connect(&env.cassandra).await?;
    let simple = store::migrate::Replication::Simple(1);
    let again = store::migrate::run(&session, &env.cassandra.keyspace, &simple, None).await?;
    assert!(again.applied.is_empty(), "re-applied {:?}", again.applied);
    assert_eq!(again.already.len(), store::migrate::MIGRATIONS.len());
    let layout = tally::domain::Layout::new(crate::support::TEST_BUCKETS)?;
    assert_eq!(again.layout, Some(layout), "the count it was created with");
    // Another count would move users between buckets: refused.
    let other = tally::domain::Layout::new(8)?;
    let refused = store::migrate::run(&session, &env.cassandra.keyspace, &simple, Some(other))
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:#}"));
    assert_eq!(
        refused,
        Err(format!(
            "the keyspace was created with {} buckets per target, and the count cannot change (asked for 8)",
            layout.count()
        ))
    );
    Ok(())
}

/// A run that applied a migration's statements and stopped before it
/// recorded the migration (killed, or schema agreement timed out after the
/// last statement) leaves columns an `ALTER TABLE ... ADD` made. Run again,
/// that statement used to fail ("already exists") every time, and tally
/// could not start until someone fixed the keyspace by hand.
#[tokio::test]
async fn migrate_finishes_migrations_an_earlier_run_applied_but_did_not_record() -> TestResult {
    let env = TestEnv::new().await;
    let session = store::connect(&env.cassandra).await?;
    env.cql(
        "INSERT INTO reactions (user_id, target_id, state, version, intent_shard) \
         VALUES ('kept', 'video_kept', 'like', 1, 3)",
    )
    .await;
    for id in ["0004_outbox", "0006_intent_shard"] {
        env.cql(&format!("DELETE FROM schema_migrations WHERE id = '{id}'"))
            .await;
    }
    let simple = store::migrate::Replication::Simple(1);
    let again = store::migrate::run(&session, &env.cassandra.keyspace, &simple, None).await?;
    assert_eq!(again.applied, ["0004_outbox", "0006_intent_shard"]);
    let shard: Option<i32> = session
        .query_unpaged(
            format!(
                "SELECT intent_shard FROM {}.reactions WHERE user_id = 'kept' AND target_id = 'video_kept'",
                env.cassandra.keyspace
            ),
            (),
        )
        .await?
        .into_rows_result()?
        .maybe_first_row::<(Option<i32>,)>()?
        .and_then(|(s,)| s);
    assert_eq!(shard, Some(3), "the column and its value are still there");
    let after = store::migrate::run(&session, &env.cassandra.keyspace, &simple, None).await?;
    assert!(after.applied.is_empty(), "{:?}", after.applied);
    Ok(())
}

/// Two runs of `tally migrate` at once (an init container in every pod)
/// could both apply a migration neither had recorded; 0005 drops
/// `target_stats`, so a second run's drop could land after the first had
/// recreated it and the services had started counting into it. A run takes
/// the keyspace's lease, and the other waits for it.
#[tokio::test]
async fn migrate_runs_one_at_a_time_under_a_lease() -> TestResult {
    use store::migrate::{Replication, run_waiting};

    let env = TestEnv::new().await;
    let session = store::connect(&env.cassandra).await?;
    let keyspace = env.cassandra.keyspace.as_str();
    let simple = Replication::Simple(1);
    let unrecord = "DELETE FROM schema_migrations WHERE id = '0006_intent_shard'";
    let recorded = async || {
        env.session
            .query_unpaged(
                "SELECT id FROM schema_migrations WHERE id = '0006_intent_shard'",
                (),
            )
            .await
            .ok()
            .and_then(|r| r.into_rows_result().ok())
            .map_or(0, |r| r.rows_num())
    };

    // Racing runs: one applies the migration, the other finds it recorded.
    env.cql(unrecord).await;
    let wait = Duration::from_secs(60);
    let (a, b) = tokio::join!(
        run_waiting(&session, keyspace, &simple, None, wait),
        run_waiting(&session, keyspace, &simple, None, wait),
    );
    let (a, b) = (a?, b?);
    assert_eq!(
        a.applied.len() + b.applied.len(),
        1,
        "applied by both: {:?} and {:?}",
        a.applied,
        b.applied
    );

    // A run whose lease is held applies nothing, and says who holds it.
    env.cql(unrecord).await;
    env.cql(
        "INSERT INTO schema_lease (name, owner, since) \
         VALUES ('migrate', 6f1d7a3e-0000-4000-8000-000000000001, toTimestamp(now())) \
         IF NOT EXISTS USING TTL 120",
    )
    .await;
    let refused = run_waiting(&session, keyspace, &simple, None, Duration::from_secs(2))
        .await
        .map(|r| r.applied)
        .map_err(|e| format!("{e:#}"));
    let reason = refused.err().unwrap_or_default();
    assert!(
        reason.contains("another tally migrate holds the keyspace's lease (6f1d7a3e-"),
        "{reason}"
    );
    assert_eq!(recorded().await, 0, "applied under another run's lease");
    // Once it is given back, the migration is applied, and the lease given
    // back again: the next run takes it at once.
    env.cql("DELETE FROM schema_lease WHERE name = 'migrate' IF EXISTS")
        .await;
    let done = run_waiting(&session, keyspace, &simple, None, Duration::ZERO).await?;
    assert_eq!(done.applied, ["0006_intent_shard"]);
    assert_eq!(recorded().await, 1);
    let again = run_waiting(&session, keyspace, &simple, None, Duration::ZERO).await?;
    assert!(again.applied.is_empty(), "{:?}", again.applied);
    Ok(())
}

#[test]
fn tally_help_lists_every_subcommand() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for sub in ["vote", "consumer", "reconcile", "migrate"] {
        assert!(help.contains(sub), "--help does not list {sub}:\n{help}");
    }
}

#[test]
fn a_short_hs256_secret_stops_tally_vote_at_start_with_the_reason() {
    for sub in [&["vote"][..], &["token", "--sub", "alice"][..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(sub)
            .env("TALLY_JWT_SECRET", "dev-secret-change-me")
            .env_remove("TALLY_INSECURE_DEV_SECRET")
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "error")
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "tally {sub:?} started: {stderr}");
        assert!(
            stderr.contains("20 bytes") && stderr.contains("at least 32"),
            "tally {sub:?}: {stderr}"
        );
        assert!(
            !stderr.contains("dev-secret-change-me"),
            "the secret printed"
        );
    }
}

/// A refusal ratio that is negative, not a number, or so small it is off in
/// all but name stops `tally vote` before it connects to anything, saying
/// what it takes.
#[test]
fn a_bad_admission_refusal_ratio_stops_tally_vote_with_what_it_takes() {
    for bad in ["-1", "nan", "inf", "0.01", "lots"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .arg("vote")
            .arg(format!("--admission-refusal-ratio={bad}"))
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("--admission-refusal-ratio") && stderr.contains("at least 0.1"),
            "{bad}: {stderr}"
        );
    }
}

/// Settings no operator can mean, alone or together, stop `tally` before it
/// connects to anything: exit code 2 and the setting named, never a panic.
/// Some of these used to start: `--relay-interval 0s` panicked the relay's
/// task and went on serving with no relay, `--rate inf` panicked reconcile,
/// and `--max-in-flight 0` quietly became 32.
#[test]
fn settings_that_mean_nothing_stop_tally_at_start_naming_the_setting() {
    let cases: &[(&[&str], &str)] = &[
        (&["vote", "--relay-interval", "0s"], "--relay-interval"),
        (&["vote", "--redis-timeout", "0s"], "--redis-timeout"),
        (&["vote", "--body-timeout", "100y"], "longer than a year"),
        (&["vote", "--max-in-flight", "0"], "--max-in-flight"),
        (
            &["vote", "--max-in-flight", "18446744073709551615"],
            "--max-in-flight",
        ),
        (&["vote", "--workers", "0"], "--workers"),
        (&["vote", "--user-rate", "NaN"], "--user-rate"),
        (&["vote", "--user-burst", "0"], "--user-burst"),
        (
            &["vote", "--cassandra-timeout-ms", "0"],
            "--cassandra-timeout-ms",
        ),
        (
            &["vote", "--min-in-flight", "64", "--max-in-flight", "32"],
            "--min-in-flight 64 is above --max-in-flight 32",
        ),
        (
            &["vote", "--cache-ttl-min", "2h"],
            "is above --cache-ttl-max",
        ),
        (&["vote", "--cache-ttl-min", "500ms"], "--cache-ttl-min"),
        (&["vote", "--publish-timeout", "1ms"], "--publish-timeout"),
        (
            &["vote", "--relay-settle", "5s"],
            "not longer than a vote may take",
        ),
        (
            &["vote", "--idempotency-ttl", "10m"],
            "not longer than the relay looks back",
        ),
        (
            &["consumer", "--write-parallelism", "0"],
            "--write-parallelism",
        ),
        (
            &["consumer", "--redis-prefix", "tally:d:eu"],
            "--redis-prefix",
        ),
        (&["vote", "--redis-prefix", ""], "must not be empty"),
        (&["reconcile", "--all", "--rate", "inf"], "--rate"),
        (&["reconcile", "--all", "--rate", "1e-300"], "--rate"),
        (
            &["reconcile", "--all", "--repeat-every", "0s"],
            "--repeat-every",
        ),
        (&["status", "--interval", "0s"], "--interval"),
        (&["vote", "--listen", "8080"], "--listen"),
        (&["consumer", "--listen", "nowhere"], "--listen"),
        (
            &[
                "vote",
                "--ops-listen",
                "127.0.0.1:8080",
                "--listen",
                "127.0.0.1:8080",
            ],
            "--ops-listen",
        ),
        (&["vote", "--redis-url", "localhost:6379"], "--redis-url"),
        (
            &[
                "consumer",
                "--redis-tls-ca",
                "/nonexistent/ca.pem",
                "--redis-url",
                "rediss://127.0.0.1:6380",
            ],
            "/nonexistent/ca.pem",
        ),
        (
            &[
                "reconcile",
                "--target",
                "v1",
                "--redis-url",
                "localhost:6379",
            ],
            "--redis-url",
        ),
        (
            &["reconcile", "--target", "v1", "--repeat-every", "10m"],
            "--all",
        ),
        (&["token", "--sub", "alice", "--ttl", "0s"], "--ttl"),
    ];
    for (args, says) in cases {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(*args)
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("TALLY_OPS_LISTEN", "127.0.0.1:0")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("{e}")) {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("tally {args:?} was still running 20 s after it started");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        if let Some(mut err) = child.stderr.take() {
            use std::io::Read;
            let _ = err.read_to_string(&mut stderr);
        }
        assert_eq!(status.code(), Some(2), "tally {args:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "tally {args:?} did not say {says:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "tally {args:?}: {stderr}");
    }
}
