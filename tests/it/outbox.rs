//! Durable publication: every committed vote reaches the totals with no
//! reconcile, whatever kept its transition from Kafka when it was cast: an
//! unreachable Kafka, a process killed with -9, a client that hung up, a
//! Redis that stopped answering. Each test ends with `target_stats` equal to
//! the recount of `reactions` and with the served totals equal to it too.

use std::io::Write;
use std::time::{Duration, Instant};

use tally::domain::Totals;

use crate::support::{PrivateRedis, TestApp, TestEnv, TestResult, eventually, free_port, new_key};

/// An API instance whose Kafka is unreachable: it can commit votes but not
/// publish them, and runs no relay.
fn kafka_unreachable(env: &TestEnv) -> tally::api::ApiConfig {
    let mut config = env.api_config();
    config.stores.kafka.brokers = format!("127.0.0.1:{}", free_port());
    config.publish_timeout = Duration::from_millis(500);
    config
}

/// An API instance with a working Kafka that runs the relay.
fn relaying(env: &TestEnv) -> tally::api::ApiConfig {
    let mut config = env.api_config();
    config.relay.disabled = false;
    config
}

/// Runs a consumer until `target_stats` equals the recount, then checks the
/// served totals of `targets` against the recount as well.
async fn counted_and_served(env: &TestEnv, app: &TestApp, targets: &[&str]) -> TestResult {
    counted_and_served_with(env, env.consumer_config(), app, targets).await
}

/// The same, with a consumer of its own settings (an app's private Redis).
async fn counted_and_served_with(
    env: &TestEnv,
    consumer: tally::consumer::ConsumerConfig,
    app: &TestApp,
    targets: &[&str],
) -> TestResult {
    let consumer = env.start_consumer_with(consumer);
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    consumer.stop().await;
    let truth = env.recount().await;
    let summary = app.summary("checker", &targets.join(",")).await.json();
    for t in targets {
        let served: Totals = serde_json::from_value(summary["items"][*t].clone())?;
        let expected = truth.get(*t).map(|tally| tally.totals).unwrap_or_default();
        assert_eq!(served, expected, "{t}: served {served}, truth {expected}");
    }
    Ok(())
}

#[tokio::test]
async fn votes_commit_while_kafka_is_unreachable_and_the_relay_publishes_them() -> TestResult {
    let env = TestEnv::new().await;
    let cut_off = env.spawn_app_with(kafka_unreachable(&env)).await;

    // Readiness comes from a background check: until the first one has
    // run the answer is 503 "starting"; after it, ready without Kafka.
    let url = format!("{}/readyz", cut_off.ops);
    let body = eventually(
        "the first readiness check",
        Duration::from_secs(30),
        || async {
            let ready = cut_off.client.get(&url).send().await.ok()?;
            let status = ready.status().as_u16();
            let body: serde_json::Value = ready.json().await.ok()?;
            (body["status"] != "starting").then_some((status, body))
        },
    )
    .await;
    assert_eq!(
        body.0, 200,
        "Kafka is not needed to take a vote: {}",
        body.1
    );
    assert_eq!(
        body.1["degraded"],
        serde_json::json!(["kafka"]),
        "{}",
        body.1
    );

    for i in 0..20 {
        let action = ["like", "dislike", "none", "like"][i % 4];
        let reply = cut_off
            .vote(
                &format!("u{}", i % 7),
                new_key(),
                &format!("t{}", i % 3),
                action,
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(env.published(), 0, "nothing reached Kafka yet");
    assert!(!env.recount().await.is_empty(), "the votes committed");

    // Kafka answers again, for an instance that runs the relay.
    let relay = env.spawn_app_with(relaying(&env)).await;
    counted_and_served(&env, &relay, &["t0", "t1", "t2"]).await
}

#[tokio::test]
async fn votes_of_a_process_killed_with_9_are_published_by_another_instances_relay() -> TestResult {
    let env = TestEnv::new().await;
    // A real `tally vote` process that cannot publish, so every vote it
    // answers is committed and unpublished when it dies.
    let (mut child, doomed) = env
        .spawn_vote_process(|cmd| {
            cmd.env("TALLY_KAFKA_BROKERS", format!("127.0.0.1:{}", free_port()))
                .env("TALLY_PUBLISH_TIMEOUT", "500ms")
                .env("TALLY_NO_RELAY", "true");
        })
        .await?;
    let mut answered = 0;
    for i in 0..15 {
        let reply = doomed
            .vote(&format!("k{i}"), new_key(), &format!("v{}", i % 2), "like")
            .await;
        answered += usize::from(reply.status == 200);
    }
    assert_eq!(answered, 15);
    child.kill9();
    assert_eq!(env.published(), 0);

    let relay = env.spawn_app_with(relaying(&env)).await;
    counted_and_served(&env, &relay, &["v0", "v1"]).await
}

#[tokio::test]
async fn a_client_that_hangs_up_after_its_vote_committed_still_has_it_counted() -> TestResult {
    let env = TestEnv::new().await;
    // A frozen Redis holds each vote in its cache step, after the commit and
    // before the answer, for the whole Redis deadline: that is when the
    // client hangs up. No relay runs: the vote's own task must publish.
    let redis = PrivateRedis::start(free_port());
    let mut config = env.api_config();
    config.stores.redis.url = format!("redis://127.0.0.1:{}", redis.port);
    config.stores.redis.timeout = Duration::from_secs(3);
    let app = env.spawn_app_with(config).await;
    let address = app.address.trim_start_matches("http://").to_owned();
    let body = r#"{"target_id":"hangup","target_type":"video","action":"like"}"#;
    redis.freeze();
    for user in ["h1", "h2", "h3"] {
        let request = format!(
            "POST /v1/votes HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {}\r\n\
             Idempotency-Key: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            crate::support::token(user),
            new_key(),
            body.len()
        );
        let mut stream = std::net::TcpStream::connect(&address)?;
        stream.write_all(request.as_bytes())?;
        eventually("the vote to commit", Duration::from_secs(30), || async {
            env.reaction(user, "hangup").await.map(|_| ())
        })
        .await;
        // Committed, not yet answered: hang up.
        stream.shutdown(std::net::Shutdown::Both)?;
        drop(stream);
    }
    redis.thaw();
    let mut consumer = env.consumer_config();
    consumer.stores.redis.url = format!("redis://127.0.0.1:{}", redis.port);
    counted_and_served_with(&env, consumer, &app, &["hangup"]).await
}

#[tokio::test]
async fn a_frozen_redis_slows_a_vote_by_its_deadline_and_loses_nothing() -> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let mut config = env.api_config();
    config.stores.redis.url = format!("redis://127.0.0.1:{}", redis.port);
    config.stores.redis.timeout = Duration::from_millis(300);
    let app = env.spawn_app_with(config).await;
    eventually(
        "the app to answer with Redis up",
        Duration::from_secs(30),
        || async {
            let r = app.vote("warm", new_key(), "frozen", "like").await;
            (r.status == 200).then_some(())
        },
    )
    .await;

    redis.freeze();
    let started = Instant::now();
    for user in ["f1", "f2", "f3", "f4"] {
        let reply = app.vote(user, new_key(), "frozen", "dislike").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let took = started.elapsed();
    redis.thaw();
    // Four votes, each waiting at most a few Redis deadlines (300 ms), not
    // forever: a loose bound, to tell a deadline from a hang.
    assert!(
        took < Duration::from_secs(20),
        "four votes took {took:?} with Redis frozen"
    );
    let mut consumer = env.consumer_config();
    consumer.stores.redis.url = format!("redis://127.0.0.1:{}", redis.port);
    counted_and_served_with(&env, consumer, &app, &["frozen"]).await
}

#[tokio::test]
async fn a_replay_of_a_vote_that_never_reached_kafka_publishes_it() -> TestResult {
    let env = TestEnv::new().await;
    let cut_off = env.spawn_app_with(kafka_unreachable(&env)).await;
    let key = new_key();
    let first = cut_off.vote("rosa", &key, "replayed", "like").await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(env.published(), 0);

    // The client retries on an instance that can publish; no relay runs.
    let app = env.spawn_app().await;
    let retry = app.vote("rosa", &key, "replayed", "like").await;
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed(), "{:?}", retry.headers);
    // It waits out the longest the vote it repeats may take: 20 s here.
    eventually("the replay to publish", Duration::from_secs(45), || async {
        (env.published() == 1).then_some(())
    })
    .await;
    counted_and_served(&env, &app, &["replayed"]).await
}

/// A retry can be answered from the record while the request it repeats
/// is still learning its own outcome (its write timed out, a replica
/// paused), before that request has counted its change in the cache. Had
/// the retry published at once, the consumer would count the change, and
/// the first request's late cache step would then add it again on top of a
/// base that counts it; if that request then died before publishing, nothing
/// would take it out before the entry's TTL. The retry publishes only once
/// the longest a vote takes has passed. Here the first request's Kafka and
/// Redis are unreachable, so its own publish and cache step never come; the
/// test makes that step 5 s after the retry, well within the 8 s deadline
/// the first request has to learn its outcome.
#[tokio::test]
async fn a_replay_publishes_only_after_the_vote_it_repeats_could_have_counted_in_the_cache()
-> TestResult {
    use tally::cache::{Cache, Pending};
    use tally::domain::{Reaction, TargetId, UserId};

    let env = TestEnv::new().await;
    let mut stalled = kafka_unreachable(&env);
    stalled.stores.redis.url = format!("redis://127.0.0.1:{}", free_port());
    let stalled = env.spawn_app_with(stalled).await;
    let key = new_key();
    let first = stalled.vote("ulla", &key, "late_step", "like").await;
    assert_eq!(first.status, 200, "{}", first.body);

    // What the first request's cache step will call, made ready now so
    // that step comes when the test says.
    let counts = tally::counts::Counts::new(
        Cache::new(&env.redis, Duration::from_secs(60))?,
        std::sync::Arc::new(
            tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?,
        ),
    );
    let (ulla, target) = (UserId::parse("ulla")?, TargetId::parse("late_step")?);
    let late_step = Pending {
        user: &ulla,
        version: 1,
        from: Reaction::None,
        to: Reaction::Like,
    };

    let consumer = env.start_consumer();
    let app = env.spawn_app().await;
    let retry = app.vote("ulla", &key, "late_step", "like").await;
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed(), "{:?}", retry.headers);
    let served = async || {
        let reply = app.summary("reader", "late_step").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["items"]["late_step"]["likes"].as_i64()
    };
    assert_eq!(served().await, Some(0), "nothing has counted the like yet");

    // The first request learns its outcome and only now counts its change
    // in the cache. A fixed pause, because it stands for that request's
    // stall, not for a condition to wait on.
    tokio::time::sleep(Duration::from_secs(5)).await;
    counts.apply_committed(&target, &late_step).await;

    // Counted ahead of a base that does not count it yet. Before, the retry
    // published after 2 s, the consumer had counted the like by now, and
    // this served 2, as it went on doing until the entry expired.
    assert_eq!(served().await, Some(1), "the like, counted ahead");
    // The retry's publish then counts it once, and the consumer's write
    // through takes the first request's change out.
    env.wait_until_no_drift(Duration::from_secs(45)).await;
    eventually("the like served once", Duration::from_secs(10), || async {
        (served().await == Some(1)).then_some(())
    })
    .await;
    consumer.stop().await;
    assert_eq!(env.published(), 1);
    assert_eq!(served().await, Some(1));
    Ok(())
}

#[tokio::test]
async fn the_intent_of_a_failed_attempt_does_not_publish_the_retry_that_committed_before_it_settles()
-> TestResult {
    use tally::domain::UserId;
    use tally::store::outbox::{bucket_at, shard_of};

    let env = TestEnv::new().await;
    // The first attempt wrote its intent and then failed (a 409, or a 503
    // that says to retry with the same key): its intent is left unresolved.
    let key = new_key();
    let first_attempt = bucket_at(std::time::SystemTime::now() - Duration::from_secs(40));
    env.session
        .query_unpaged(
            "INSERT INTO outbox_intents (bucket, shard, user_id, idem_key, resolved) \
             VALUES (?, ?, 'ulla', ?, false)",
            (
                first_attempt,
                shard_of(&UserId::parse("ulla")?),
                key.as_str(),
            ),
        )
        .await?;
    // The retry commits; its own publish does not happen.
    let cut_off = env.spawn_app_with(kafka_unreachable(&env)).await;
    let retry = cut_off.vote("ulla", &key, "retried", "like").await;
    assert_eq!(retry.status, 200, "{}", retry.body);

    // The relay reaches the first attempt's intent long before the retry's
    // has settled: the retry may still be in flight (learning its outcome,
    // counting its change in the cache), so that intent publishes nothing.
    // (The production settle: the tests' 2 s would let the relay reach the
    // retry's own intent in the same pass.)
    let mut config = relaying(&env);
    config.relay.settle = Duration::from_secs(25);
    let relay = env.spawn_app_with(config).await;
    eventually(
        "the first attempt's intent to be resolved",
        Duration::from_secs(20),
        || async {
            let rows = env
                .session
                .query_unpaged(
                    "SELECT resolved FROM outbox_intents WHERE bucket = ? AND shard = ? \
                     AND user_id = 'ulla' AND idem_key = ?",
                    (
                        first_attempt,
                        shard_of(&UserId::parse("ulla").ok()?),
                        key.as_str(),
                    ),
                )
                .await
                .ok()?
                .into_rows_result()
                .ok()?;
            let (resolved,): (bool,) = rows.single_row().ok()?;
            resolved.then_some(())
        },
    )
    .await;
    assert_eq!(env.published(), 0, "published ahead of the retry's settle");
    // The retry's own intent, once settled, publishes it.
    counted_and_served(&env, &relay, &["retried"]).await?;
    assert_eq!(env.recount().await["retried"].likes(), 1);
    Ok(())
}

#[tokio::test]
async fn racing_votes_records_each_name_the_place_of_their_grouped_intent() -> TestResult {
    let env = TestEnv::new().await;
    let cut_off = env.spawn_app_with(kafka_unreachable(&env)).await;
    let keys: Vec<String> = (0..48).map(|_| new_key()).collect();
    let replies = futures::future::join_all(keys.iter().enumerate().map(|(i, key)| {
        let (user, target) = (format!("g{i}"), format!("t{}", i % 4));
        let app = &cut_off;
        async move { app.vote(&user, key, &target, "like").await }
    }))
    .await;
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.body);
    }

    // Every intent, and where each record says its intent is.
    let intents: std::collections::HashSet<(i64, i32, String, String)> = env
        .session
        .query_unpaged(
            "SELECT bucket, shard, user_id, idem_key FROM outbox_intents",
            (),
        )
        .await?
        .into_rows_result()?
        .rows::<(i64, i32, String, String)>()?
        .collect::<Result<_, _>>()?;
    let records: Vec<(String, String, Option<i64>, Option<i32>)> = env
        .session
        .query_unpaged(
            "SELECT user_id, target_id, intent_bucket, intent_shard FROM reactions",
            (),
        )
        .await?
        .into_rows_result()?
        .rows::<(String, String, Option<i64>, Option<i32>)>()?
        .filter_map(Result::ok)
        .filter(|(_, clustering, ..)| clustering.starts_with('#'))
        .collect();
    assert_eq!(records.len(), 48, "one record per vote");
    for (user, clustering, bucket, shard) in &records {
        let (Some(bucket), Some(shard)) = (*bucket, *shard) else {
            panic!("{user}'s record of a change names no intent");
        };
        let key = clustering.trim_start_matches('#').to_owned();
        assert!(
            intents.contains(&(bucket, shard, user.clone(), key)),
            "{user}'s record names ({bucket}, {shard}), where its intent is not"
        );
    }
    // The relay finds them where the records say, and publishes them.
    let relay = env.spawn_app_with(relaying(&env)).await;
    counted_and_served(&env, &relay, &["t0", "t1", "t2", "t3"]).await
}

#[tokio::test]
async fn votes_that_leave_nothing_to_publish_mark_their_intents_so_the_relay_skips_them()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let key = new_key();
    let first = app.vote("nico", &key, "quiet", "like").await;
    assert_eq!(first.status, 200, "{}", first.body);
    let again = app.vote("nico", new_key(), "quiet", "like").await;
    assert_eq!(
        again.status, 200,
        "a vote for the state held: {}",
        again.body
    );
    let replay = app.vote("nico", &key, "quiet", "like").await;
    assert_eq!(replay.status, 200, "a replay: {}", replay.body);
    let reused = app.vote("nico", &key, "quiet", "dislike").await;
    assert_eq!(reused.status, 422, "a reused key: {}", reused.body);

    // Four requests, four intents: the change's is marked once Kafka has the
    // transition, the others as soon as their answers are known.
    eventually("every intent marked", Duration::from_secs(30), || async {
        let rows = env.intents().await?;
        (rows.len() == 4 && rows.iter().all(|(_, r)| *r == Some(true))).then_some(())
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn lingering_marks_are_all_written_whether_their_partition_fills_or_not() -> TestResult {
    use tally::domain::{IdempotencyKey, UserId};
    use tally::store::outbox::{SHARDS, Slot, bucket_at};
    let env = TestEnv::new().await;
    let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?;
    let bucket = bucket_at(std::time::SystemTime::now());
    // 40 marks in one partition: more than one grouped write holds, so one
    // goes when the partition fills and the rest when they have lingered;
    // and one mark alone in each of two other partitions.
    let slot = |shard| Slot { bucket, shard };
    let mut marks = Vec::new();
    for i in 0..40 {
        marks.push((slot(0), format!("m{i}")));
    }
    marks.push((slot(1), "alone1".to_owned()));
    marks.push((slot(SHARDS - 1), "alone2".to_owned()));
    let parsed: Vec<(Slot, UserId, IdempotencyKey)> = marks
        .iter()
        .map(|(s, user)| Ok((*s, UserId::parse(user)?, IdempotencyKey::parse(&new_key())?)))
        .collect::<anyhow::Result<_>>()?;
    // A partition that never fills must still be written: bounded, so a
    // mark held forever fails the test instead of hanging it.
    let written = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::join_all(
            parsed
                .iter()
                .map(|(s, user, key)| store.outbox.resolve(*s, user, key)),
        ),
    )
    .await?;
    for (w, (s, user, _)) in written.iter().zip(&parsed) {
        assert!(w.is_ok(), "{user}'s mark in {s:?}: {w:?}");
    }
    for (s, user, key) in &parsed {
        assert!(
            store.outbox.is_resolved(*s, user, key).await?,
            "{user}'s mark in {s:?} was answered written but is not there"
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_relay_signs_what_it_publishes_and_the_consumer_counts_it_unread() -> TestResult {
    let mut env = TestEnv::new().await;
    let secret = tally::secret::Secret::new("the-relay-test-event-signing-key-32b");
    let key = tally::bus::signature::EventKey::new(&secret).map_err(anyhow::Error::msg)?;
    env.kafka.event_signing_key = Some(secret);
    let cut_off = env.spawn_app_with(kafka_unreachable(&env)).await;
    for (user, action) in [
        ("u0", "like"),
        ("u1", "dislike"),
        ("u0", "dislike"),
        ("u2", "like"),
        ("u1", "none"),
        ("u3", "like"),
    ] {
        let reply = cut_off.vote(user, new_key(), "t0", action).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(env.published(), 0, "nothing reached Kafka yet");

    let relay = env.spawn_app_with(relaying(&env)).await;
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    let messages = env.messages().await;
    assert!(messages.len() >= 6, "{} published", messages.len());
    for (payload, signature) in &messages {
        let signature = signature.as_deref().unwrap_or_default();
        assert!(key.verifies(payload, signature), "{payload:?}");
    }
    let progress = &consumer.progress;
    eventually(
        "the consumer to take every published event",
        Duration::from_secs(30),
        || async { (consumer.processed() >= messages.len() as u64).then_some(()) },
    )
    .await;
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    // The relay may publish a transition more than once, and go on after
    // the topic was read: every event the consumer took was signed.
    assert!(load(&progress.signed) >= messages.len() as u64);
    assert_eq!(load(&progress.row_reads), 0);
    assert_eq!(load(&progress.bad_signatures) + load(&progress.unsigned), 0);
    consumer.stop().await;
    let truth = env.recount().await;
    let served: Totals =
        serde_json::from_value(relay.summary("checker", "t0").await.json()["items"]["t0"].clone())?;
    assert_eq!(served, truth["t0"].totals);
    Ok(())
}
