//! `tally consumer` against the real stack: duplicates, reordering, poison,
//! a kill -9 mid-batch, and a rebalance between two consumers.

use std::time::Duration;

use futures::StreamExt;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;

use crate::support::{Rng, TestEnv, TestResult, eventually, new_key};

async fn processed_at_least(c: &crate::support::RunningConsumer, n: u64) {
    eventually(
        &format!("the consumer to process {n} messages"),
        Duration::from_secs(60),
        || async { (c.processed() >= n).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn the_same_events_delivered_twice_leave_the_totals_unchanged() -> TestResult {
    let env = TestEnv::new().await;
    let events = [
        ("u1", "none", "like", 1),
        ("u2", "none", "dislike", 1),
        ("u1", "like", "none", 2),
        ("u3", "none", "like", 1),
    ];
    for (u, f, t, v) in events {
        env.publish_transition(u, "video_dup", f, t, v).await;
    }
    let consumer = env.start_consumer_trusting();
    processed_at_least(&consumer, 4).await;
    let once = env.stats().await;

    for (u, f, t, v) in events {
        env.publish_transition(u, "video_dup", f, t, v).await;
    }
    processed_at_least(&consumer, 8).await;
    let twice = env.stats().await;
    consumer.stop().await;

    assert_eq!(once["video_dup"].likes(), 1, "likes: u3 only");
    assert_eq!(once["video_dup"].dislikes(), 1, "dislikes: u2");
    assert_eq!(twice, once, "a redelivery changes nothing");
    Ok(())
}

/// A newer release may add a reaction, and its rows then hold a state this
/// consumer does not know. The read behind an event used to fail on it, on
/// every try, and the consumer counted nothing more. Now a row past the
/// event is enough, whatever its state, and the events behind it go on.
#[tokio::test]
async fn a_row_in_a_state_this_release_does_not_know_stops_nothing() -> TestResult {
    let env = TestEnv::new().await;
    env.cql(
        "INSERT INTO reactions (user_id, target_id, target_type, state, version) \
         VALUES ('newer', 'video_newer', 'video', 'love', 2)",
    )
    .await;
    env.cql(
        "INSERT INTO reactions (user_id, target_id, target_type, state, version) \
         VALUES ('plain', 'video_after', 'video', 'like', 1)",
    )
    .await;
    // Unsigned, so each is checked against its row.
    env.publish_transition("newer", "video_newer", "none", "like", 1)
        .await;
    env.publish_transition("newer", "video_newer", "like", "love", 2)
        .await;
    env.publish_transition("plain", "video_after", "none", "like", 1)
        .await;
    let consumer = env.start_consumer();
    processed_at_least(&consumer, 3).await;
    let stats = env.stats().await;
    consumer.stop().await;
    assert_eq!(
        stats["video_after"].likes(),
        1,
        "the event behind is counted"
    );
    // Version 1, overtaken by the row, is counted; version 2's "love" is a
    // reaction this release refuses, as before, and goes to the dead letters.
    assert_eq!(stats["video_newer"].likes(), 1);
    Ok(())
}

#[tokio::test]
async fn version_6_before_5_ends_at_the_users_latest_state() -> TestResult {
    let env = TestEnv::new().await;
    for (f, t, v) in [
        ("none", "like", 1),
        ("like", "none", 2),
        ("none", "like", 3),
        ("like", "none", 4),
    ] {
        env.publish_transition("ursula", "video_gap", f, t, v).await;
    }
    // v5 (none -> like) is lost; v6 says like -> dislike.
    env.publish_transition("ursula", "video_gap", "like", "dislike", 6)
        .await;
    let consumer = env.start_consumer_trusting();
    processed_at_least(&consumer, 5).await;
    // A late v5 must not move anything.
    env.publish_transition("ursula", "video_gap", "none", "like", 5)
        .await;
    processed_at_least(&consumer, 6).await;
    let gaps = consumer
        .progress
        .gaps
        .load(std::sync::atomic::Ordering::Relaxed);
    consumer.stop().await;

    let stats = env.stats().await;
    let gap = &stats["video_gap"];
    assert_eq!((gap.likes(), gap.dislikes()), (0, 1));
    assert_eq!(gap.users["ursula"], (6, "dislike".to_owned()));
    assert!(gaps >= 1, "the gap was counted");
    Ok(())
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_and_the_partition_keeps_flowing() -> TestResult {
    let env = TestEnv::new().await;
    // Same key, so the same partition: the valid event is behind the poison.
    env.publish_raw("video_p", b"{definitely not a transition")
        .await;
    env.publish_raw("video_p", br#"{"target_id":"video_p","target_type":"video","user_id":"u","from":"like","to":"like","version":2,"occurred_at":"x"}"#).await;
    env.publish_transition("victor", "video_p", "none", "like", 1)
        .await;
    let consumer = env.start_consumer_trusting();
    processed_at_least(&consumer, 3).await;
    let dead = consumer
        .progress
        .dead_lettered
        .load(std::sync::atomic::Ordering::Relaxed);
    consumer.stop().await;

    assert_eq!(
        env.stats().await["video_p"].likes(),
        1,
        "the valid event behind the poison was applied"
    );
    assert_eq!(dead, 2);
    let letters = dead_letters(&env, 2).await?;
    assert!(
        letters.iter().all(|(key, _)| key == "video_p"),
        "{letters:?}"
    );
    let reasons: Vec<&String> = letters.iter().map(|(_, reason)| reason).collect();
    assert!(reasons[0].contains("not a transition"), "{reasons:?}");
    assert!(reasons[1].contains("must change"), "{reasons:?}");
    Ok(())
}

/// A message near the transitions topic's size limit could not be sent to
/// the dead-letter topic whole: librdkafka refuses a message over its own
/// 1,000,000 bytes, and the headers add to it. Since an event is never
/// skipped, the consumer tried again forever and counted nothing behind it.
/// Now a dead letter keeps the first 64 KiB, with the whole length and
/// SHA-256 in headers.
#[tokio::test]
async fn a_message_too_large_to_dead_letter_whole_is_dead_lettered_cut() -> TestResult {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use sha2::{Digest, Sha256};
    use tally::bus::dead_letter::{
        KEPT_PAYLOAD, ORIGINAL_BYTES_HEADER, ORIGINAL_KEY_BYTES_HEADER, ORIGINAL_SHA256_HEADER,
    };

    let env = TestEnv::new().await;
    // Under the topic's 1,048,588 bytes, over what a producer takes by
    // default: whoever can write to the topic can send it.
    let garbage: Vec<u8> = (0..1_040_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let producer: FutureProducer = env
        .kafka
        .client()
        .set("message.max.bytes", "1048576")
        .create()?;
    producer
        .send(
            FutureRecord::to(&env.kafka.topic)
                .key("video_big")
                .payload(&garbage),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    // A transition whose state is a megabyte long: the parse error quotes it.
    let long_state = format!(
        r#"{{"target_id":"video_big","target_type":"video","user_id":"u","from":"none","to":"{}","version":1,"occurred_at":"x"}}"#,
        "x".repeat(1_000_000)
    );
    producer
        .send(
            FutureRecord::to(&env.kafka.topic)
                .key("video_big")
                .payload(long_state.as_bytes()),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    // Same key, so the same partition: the valid event is behind them.
    env.publish_transition("wanda", "video_big", "none", "like", 1)
        .await;
    let consumer = env.start_consumer_trusting();
    processed_at_least(&consumer, 3).await;
    let dead = consumer
        .progress
        .dead_lettered
        .load(std::sync::atomic::Ordering::Relaxed);
    consumer.stop().await;
    assert_eq!(dead, 2);
    assert_eq!(env.stats().await["video_big"].likes(), 1);

    let dlq = dead_letter_reader(&env)?;
    let letter = tokio::time::timeout(Duration::from_secs(30), dlq.stream().next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
    let header = |name: &str| {
        letter
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == name).and_then(|h| h.value))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    assert_eq!(letter.payload(), Some(&garbage[..KEPT_PAYLOAD]));
    assert_eq!(letter.key(), Some(&b"video_big"[..]));
    assert_eq!(header(ORIGINAL_BYTES_HEADER).as_deref(), Some("1040000"));
    assert_eq!(
        header(ORIGINAL_SHA256_HEADER),
        Some(hex::encode(Sha256::digest(&garbage)))
    );
    assert_eq!(
        header(ORIGINAL_KEY_BYTES_HEADER),
        None,
        "the key was kept whole"
    );
    assert!(
        header("tally-dlq-reason").is_some_and(|r| r.contains("not a transition")),
        "{:?}",
        header("tally-dlq-reason")
    );

    let second = tokio::time::timeout(Duration::from_secs(30), dlq.stream().next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
    let reason = second
        .headers()
        .and_then(|h| {
            h.iter()
                .find(|h| h.key == "tally-dlq-reason")
                .and_then(|h| h.value)
        })
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    assert!(
        reason.len() < 5_000 && reason.contains("cut from"),
        "{} bytes: {}",
        reason.len(),
        reason.chars().take(200).collect::<String>()
    );
    assert_eq!(second.payload().map(<[u8]>::len), Some(KEPT_PAYLOAD));
    Ok(())
}

/// A consumer of the dead-letter topic from its start, in a group of its own.
fn dead_letter_reader(env: &TestEnv) -> Result<StreamConsumer, anyhow::Error> {
    let dlq: StreamConsumer = env
        .kafka
        .client()
        .set(
            "group.id",
            format!("{}-dlq-{}", env.group, uuid::Uuid::new_v4()),
        )
        .set("auto.offset.reset", "earliest")
        .create()?;
    dlq.subscribe(&[&env.kafka.dead_letter_topic])?;
    Ok(dlq)
}

/// The first `n` dead letters: each one's key and reason.
async fn dead_letters(env: &TestEnv, n: usize) -> Result<Vec<(String, String)>, anyhow::Error> {
    let dlq = dead_letter_reader(env)?;
    let mut letters = Vec::new();
    let mut stream = dlq.stream();
    while letters.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap_or_else(|_| panic!("dead letters missing; got {letters:?}"))
            .unwrap_or_else(|| panic!("stream ended"))?;
        let reason = m
            .headers()
            .and_then(|h| {
                h.iter()
                    .find(|h| h.key == "tally-dlq-reason")
                    .and_then(|h| h.value)
            })
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        letters.push((key, reason));
    }
    Ok(letters)
}

/// A transition as the API publishes it.
fn transition(user: &str, target: &str, from: &str, to: &str, version: i64) -> Vec<u8> {
    serde_json::json!({
        "target_id": target, "target_type": "video", "user_id": user,
        "from": from, "to": to, "version": version, "occurred_at": "2026-12-01T00:00:00.000Z"
    })
    .to_string()
    .into_bytes()
}

/// Fills a bucket of a target with `n` row tombstones ahead of any row, so
/// that every read of the bucket's head scans them all and Cassandra aborts
/// it (its tombstone_failure_threshold is 100,000): the bucket can be
/// neither read nor written, while every other partition answers.
async fn bury_in_tombstones(env: &TestEnv, target: &str, bucket: i32, n: i64) -> TestResult {
    use scylla::statement::batch::{Batch, BatchType};
    let delete = env
        .session
        .prepare(
            "DELETE FROM target_stats WHERE target_id = ? AND bucket = ? AND user_token = ? AND user_id = 'ghost'",
        )
        .await?;
    let per_batch = 100;
    let batches = (0..n / per_batch).map(|b| {
        let mut batch = Batch::new(BatchType::Unlogged);
        let mut values = Vec::new();
        for i in 0..per_batch {
            batch.append_statement(delete.clone());
            values.push((target, bucket, i64::MIN + b * per_batch + i));
        }
        let session = &env.session;
        async move { session.batch(&batch, values).await.map(|_| ()) }
    });
    let results: Vec<_> = futures::stream::iter(batches)
        .buffer_unordered(16)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(())
}

#[tokio::test]
async fn a_target_whose_writes_always_fail_is_parked_and_every_other_target_is_still_counted()
-> TestResult {
    let env = TestEnv::new().await;
    let broken = "video_broken";
    let (bucket, _) = env.place_of("b0");
    let voters: Vec<String> = (0..)
        .map(|i| format!("b{i}"))
        .filter(|u| env.place_of(u).0 == bucket)
        .take(3)
        .collect();
    bury_in_tombstones(&env, broken, bucket, 110_000).await?;
    // One key, so one partition: the broken target's events come first and
    // every other target's wait behind them.
    for u in &voters {
        env.publish_raw(broken, &transition(u, broken, "none", "like", 1))
            .await;
    }
    for (u, target) in [
        ("o1", "video_ok1"),
        ("o2", "video_ok1"),
        ("o3", "video_ok2"),
    ] {
        env.publish_raw(broken, &transition(u, target, "none", "like", 1))
            .await;
    }
    let mut config = env.consumer_config();
    config.park_after = 3;
    config.trust_events = true;
    let consumer = env.start_consumer_with(config);
    let counted = || async {
        (
            likes_of(&env, "video_ok1").await,
            likes_of(&env, "video_ok2").await,
        )
    };
    let parked = || {
        consumer
            .progress
            .parked
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // The batch is done, its offsets stored, once the broken target's
    // events are parked: the partition moves on.
    eventually(
        "the other targets counted and the batch done",
        Duration::from_secs(90),
        || async { (consumer.processed() == 6 && counted().await == (2, 1)).then_some(()) },
    )
    .await;
    assert_eq!(parked(), 3, "the broken target's three events were parked");

    // Parked lately: its next event is parked at its first failure, and
    // the partition keeps flowing.
    env.publish_raw(broken, &transition(&voters[0], broken, "like", "none", 2))
        .await;
    env.publish_raw(broken, &transition("o4", "video_ok2", "none", "like", 1))
        .await;
    eventually(
        "the next event of another target to be counted",
        Duration::from_secs(60),
        || async { (consumer.processed() == 8 && counted().await == (2, 2)).then_some(()) },
    )
    .await;
    assert_eq!(parked(), 4);
    consumer.stop().await;

    let letters = dead_letters(&env, 4).await?;
    for (_, reason) in &letters {
        assert!(
            reason.contains("target video_broken") && reason.contains("writes failed"),
            "{reason}"
        );
    }
    Ok(())
}

/// A target's likes, read from its own buckets: a scan of the table would
/// reach a buried bucket's tombstones and fail as the consumer's reads do.
async fn likes_of(env: &TestEnv, target: &str) -> i64 {
    let rows = env
        .session
        .query_unpaged(
            "SELECT likes FROM target_stats WHERE target_id = ? AND bucket IN (0, 1, 2, 3) PER PARTITION LIMIT 1",
            (target,),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_rows_result()
        .unwrap_or_else(|e| panic!("{e}"));
    rows.rows::<(Option<i64>,)>()
        .unwrap_or_else(|e| panic!("{e}"))
        .map(|r| r.map_or(0, |(n,)| n.unwrap_or(0)))
        .sum()
}

/// Sets one config of a topic (the rest back to the broker's defaults).
async fn set_topic_config(env: &TestEnv, topic: &str, name: &str, value: &str) -> TestResult {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = env.kafka.client().create()?;
    let results = admin
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(topic)).set(name, value)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for r in results {
        r.map_err(|(resource, e)| anyhow::anyhow!("{resource:?}: {e}"))?;
    }
    Ok(())
}

#[tokio::test]
async fn while_the_dead_letter_topic_takes_nothing_the_consumer_stops_and_is_unready() -> TestResult
{
    let env = TestEnv::new().await;
    let dlq = env.kafka.dead_letter_topic.clone();
    // A record batch larger than this is refused by the broker.
    set_topic_config(&env, &dlq, "max.message.bytes", "16").await?;
    env.publish_raw(
        "video_d",
        b"{this poison message cannot be parsed as a transition at all",
    )
    .await;
    env.publish_raw("video_d", &transition("dora", "video_d", "none", "like", 1))
        .await;
    let consumer = env.start_consumer_trusting();
    let ops = eventually(
        "the consumer's ops port",
        Duration::from_secs(30),
        || async {
            let port = consumer
                .progress
                .ops_port
                .load(std::sync::atomic::Ordering::Relaxed);
            (port != 0).then(|| format!("http://127.0.0.1:{port}/readyz"))
        },
    )
    .await;
    let client = reqwest::Client::new();
    let readyz = || async {
        let r = client.get(&ops).send().await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.json::<serde_json::Value>().await.ok()?))
    };
    let body = eventually(
        "/readyz to name the dead-letter topic",
        Duration::from_secs(60),
        || async {
            readyz()
                .await
                .filter(|(status, body)| {
                    *status == 503 && body["failing"].to_string().contains("dead_letter_topic")
                })
                .map(|(_, body)| body)
        },
    )
    .await;
    assert_eq!(body["status"], "unavailable");
    assert_eq!(
        consumer.processed(),
        0,
        "nothing past the poison is consumed"
    );
    assert!(
        !env.stats().await.contains_key("video_d"),
        "the event behind it waits"
    );

    set_topic_config(&env, &dlq, "max.message.bytes", "1048588").await?;
    eventually(
        "the event behind the poison to be counted",
        Duration::from_secs(90),
        || async { (env.stats().await.get("video_d").map(|s| s.likes()) == Some(1)).then_some(()) },
    )
    .await;
    eventually(
        "/readyz to answer 200 again",
        Duration::from_secs(30),
        || async {
            readyz()
                .await
                .filter(|(status, _)| *status == 200)
                .map(|_| ())
        },
    )
    .await;
    let dead = consumer
        .progress
        .dead_lettered
        .load(std::sync::atomic::Ordering::Relaxed);
    consumer.stop().await;
    assert_eq!(dead, 1);
    let letters = dead_letters(&env, 1).await?;
    assert_eq!(letters[0].0, "video_d");
    Ok(())
}

#[tokio::test]
async fn events_that_no_vote_made_are_dead_lettered_and_the_totals_stay_what_the_rows_say()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    assert_eq!(
        app.vote("ana", new_key(), "video_f", "like").await.status,
        200
    );
    // What someone who can write to the topic could inject: a vote of a
    // user who never voted, a version from the future that would freeze
    // ana's count, and another state at ana's real version.
    env.publish_transition("mallory", "video_f", "none", "like", 1)
        .await;
    env.publish_transition("ana", "video_f", "like", "dislike", 1 << 62)
        .await;
    env.publish_transition("ana", "video_f", "none", "dislike", 1)
        .await;
    let consumer = env.start_consumer();
    let dead = || {
        consumer
            .progress
            .dead_lettered
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    eventually(
        "the API's event counted and the forged ones dead-lettered",
        Duration::from_secs(60),
        || async { (consumer.processed() >= 4 && dead() == 3).then_some(()) },
    )
    .await;
    assert_eq!(env.stats().await, env.recount().await);
    assert_eq!(env.stats().await["video_f"].likes(), 1);

    // ana's next real vote still counts: nothing froze her row.
    assert_eq!(
        app.vote("ana", new_key(), "video_f", "dislike")
            .await
            .status,
        200
    );
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let video = &env.stats().await["video_f"];
    assert_eq!((video.likes(), video.dislikes()), (0, 1));
    consumer.stop().await;

    let mut reasons: Vec<String> = dead_letters(&env, 3)
        .await?
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    reasons.sort();
    assert!(
        reasons.iter().any(|r| r.contains("no reaction row")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("is ahead of the row")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("holds like at version 1")),
        "{reasons:?}"
    );
    Ok(())
}

#[tokio::test]
async fn kill_9_of_the_consumer_mid_batch_then_a_restart_leaves_no_drift() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let mut rng = Rng(7);
    let ok = app.random_votes(&mut rng, 600, 60, 40, 24).await;
    assert_eq!(ok, 600);

    let spawn = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .arg("consumer")
            .args([
                "--batch-max",
                "25",
                "--batch-wait",
                "5ms",
                "--write-parallelism",
                "2",
            ])
            .env("TALLY_KEYSPACE", &env.cassandra.keyspace)
            .env("TALLY_TOPIC", &env.kafka.topic)
            .env("TALLY_DEAD_LETTER_TOPIC", &env.kafka.dead_letter_topic)
            .env("TALLY_CONSUMER_GROUP", &env.group)
            .env("TALLY_REDIS_PREFIX", &env.redis.prefix)
            .env("TALLY_CONSUMER_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
    };
    let mut first = spawn()?;
    // Kill it as soon as it has written something, well before it is done.
    eventually(
        "the first consumer to write",
        Duration::from_secs(60),
        || async { (!env.stats().await.is_empty()).then_some(()) },
    )
    .await;
    first.kill()?; // SIGKILL
    let _ = first.wait();
    assert_ne!(
        env.stats().await,
        env.recount().await,
        "the kill came too late to interrupt anything"
    );

    let mut second = spawn()?;
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    second.kill()?;
    let _ = second.wait();
    Ok(())
}

#[tokio::test]
async fn two_consumers_in_one_group_with_a_rebalance_mid_stream_leave_no_drift() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let mut rng = Rng(11);

    let a = env.start_consumer();
    assert_eq!(app.random_votes(&mut rng, 250, 40, 30, 16).await, 250);
    let b = env.start_consumer();
    assert_eq!(app.random_votes(&mut rng, 250, 40, 30, 16).await, 250);
    // A leaves while B runs: a second rebalance, B takes every partition.
    a.stop().await;
    assert_eq!(app.random_votes(&mut rng, 150, 40, 30, 16).await, 150);

    env.wait_until_no_drift(Duration::from_secs(90)).await;
    assert!(b.processed() > 0, "the second consumer took part");
    b.stop().await;
    Ok(())
}

/// A consumer that has not written a target's buckets yet (after a restart
/// or a rebalance) learns all the buckets a batch touches in one read, then
/// writes each unread, instead of reading each bucket's head and rows first.
#[tokio::test]
async fn a_consumer_new_to_a_target_learns_its_buckets_in_one_read_per_batch() -> TestResult {
    use std::sync::atomic::Ordering::Relaxed;
    let env = TestEnv::new().await;
    let users: Vec<String> = (0..40).map(|i| format!("u{i}")).collect();
    let first = env.start_consumer_trusting();
    for u in &users {
        env.publish_transition(u, "t0", "none", "like", 1).await;
    }
    processed_at_least(&first, 40).await;
    first.stop().await;

    // The same group again, so it starts after round 1, knowing nothing.
    for u in &users {
        env.publish_transition(u, "t0", "like", "dislike", 2).await;
    }
    let second = env.start_consumer_trusting();
    processed_at_least(&second, 40).await;
    let p = &second.progress;
    let (requests, writes, batches, registrations) = (
        p.requests.load(Relaxed),
        p.writes.load(Relaxed),
        p.batches.load(Relaxed),
        p.registrations.load(Relaxed),
    );
    // No vote registered t0: this process does, once, not once a bucket.
    assert_eq!(registrations, 1, "t0 registered once");
    let reads = requests - writes - registrations;
    assert!(
        writes >= 2,
        "40 users fall in more than one bucket: {writes} writes"
    );
    assert!(
        (1..=batches).contains(&reads),
        "one read per batch at most, not two per bucket: {reads} reads for {writes} writes in {batches} batches"
    );
    let stats = env.stats().await;
    assert_eq!((stats["t0"].likes(), stats["t0"].dislikes()), (0, 40));
    assert!(
        stats["t0"]
            .users
            .values()
            .all(|(v, s)| *v == 2 && s == "dislike")
    );
    second.stop().await;
    Ok(())
}

#[tokio::test]
async fn in_order_transitions_are_counted_without_reads_until_another_writer_moves_the_fence()
-> TestResult {
    use std::sync::atomic::Ordering::Relaxed;
    let env = TestEnv::new().await;
    let consumer = env.start_consumer_trusting();
    let p = consumer.progress.clone();
    let users: Vec<String> = (0..40).map(|i| format!("u{i}")).collect();
    let round = |from: &'static str, to: &'static str, version: i64| {
        let (env, users) = (&env, &users);
        async move {
            for u in users {
                env.publish_transition(u, "t0", from, to, version).await;
            }
        }
    };
    // Each round waits for the one before, so its events find the buckets
    // as the last round left them.
    round("none", "like", 1).await;
    processed_at_least(&consumer, 40).await;
    let (requests, writes) = (p.requests.load(Relaxed), p.writes.load(Relaxed));

    round("like", "dislike", 2).await;
    processed_at_least(&consumer, 80).await;
    let unread = (
        p.requests.load(Relaxed) - requests,
        p.writes.load(Relaxed) - writes,
    );
    assert_eq!(
        unread.0, unread.1,
        "in order: one request per write, no reads (requests, writes) = {unread:?}"
    );
    let stats = env.stats().await;
    assert_eq!((stats["t0"].likes(), stats["t0"].dislikes()), (0, 40));

    // Another writer moves bucket 0's fence, and round 2 is delivered again.
    env.cql("UPDATE target_stats SET seq = 1000 WHERE target_id = 't0' AND bucket = 0")
        .await;
    let (requests, writes) = (p.requests.load(Relaxed), p.writes.load(Relaxed));
    round("like", "dislike", 2).await;
    round("dislike", "like", 3).await;
    processed_at_least(&consumer, 160).await;
    let read = (
        p.requests.load(Relaxed) - requests,
        p.writes.load(Relaxed) - writes,
    );
    assert!(
        read.0 > read.1,
        "the refused writes fell back to reading: (requests, writes) = {read:?}"
    );
    let stats = env.stats().await;
    assert_eq!(
        (stats["t0"].likes(), stats["t0"].dislikes()),
        (40, 0),
        "the replayed round counted once, the new one once"
    );
    assert!(
        stats["t0"]
            .users
            .values()
            .all(|(v, s)| *v == 3 && s == "like")
    );
    consumer.stop().await;
    Ok(())
}

/// With `--trust-events` no vote registered the target, so the consumer
/// does before counting it: a read that misses (here, after the entry is
/// dropped) asks the registry before reading any bucket, and would serve a
/// target missing from it as zeros.
#[tokio::test]
async fn a_target_counted_from_trusted_events_alone_is_served_after_its_entry_is_dropped()
-> TestResult {
    use tally::cache::Cache;
    use tally::domain::TargetId;

    let env = TestEnv::new().await;
    for (user, to) in [("u1", "like"), ("u2", "like"), ("u3", "dislike")] {
        env.publish_transition(user, "video_synthetic", "none", to, 1)
            .await;
    }
    let consumer = env.start_consumer_trusting();
    processed_at_least(&consumer, 3).await;
    consumer.stop().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    cache
        .invalidate(&TargetId::parse("video_synthetic")?)
        .await?;

    let app = env.spawn_app().await;
    let reply = app.summary("reader", "video_synthetic").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let item = &reply.json()["items"]["video_synthetic"];
    assert_eq!(
        (item["likes"].as_i64(), item["dislikes"].as_i64()),
        (Some(2), Some(1)),
        "{item}"
    );
    Ok(())
}

/// A secret for `--event-signing-key`, and the key it makes.
fn event_key(s: &str) -> (tally::secret::Secret, tally::bus::signature::EventKey) {
    let secret = tally::secret::Secret::new(format!("{s}-an-event-signing-key-of-32-bytes"));
    let key = tally::bus::signature::EventKey::new(&secret).unwrap_or_else(|e| panic!("{e}"));
    (secret, key)
}

/// `target`'s (likes, dislikes) as `GET /v1/votes/summary` serves them.
async fn served(app: &crate::support::TestApp, target: &str) -> (i64, i64) {
    let summary = app.summary("checker", target).await.json();
    let item = &summary["items"][target];
    (
        item["likes"].as_i64().unwrap_or(-1),
        item["dislikes"].as_i64().unwrap_or(-1),
    )
}

fn load(n: &std::sync::atomic::AtomicU64) -> u64 {
    n.load(std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test]
async fn signed_votes_are_counted_without_reading_their_rows_and_forgeries_are_still_refused()
-> TestResult {
    let mut env = TestEnv::new().await;
    let (secret, key) = event_key("ours");
    env.kafka.event_signing_key = Some(secret);
    let app = env.spawn_app().await;
    for (user, action) in [
        ("ana", "like"),
        ("bob", "like"),
        ("ana", "dislike"),
        ("cy", "like"),
        ("cy", "none"),
    ] {
        let reply = app.vote(user, new_key(), "video_s", action).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(env.published(), 5);
    // Every transition the API published carries its signature.
    for (payload, signature) in env.messages().await {
        let signature = signature.unwrap_or_else(|| panic!("unsigned: {payload:?}"));
        assert!(key.verifies(&payload, &signature));
    }

    // The votes' events are counted without a read of the rows behind them.
    let consumer = env.start_consumer();
    processed_at_least(&consumer, 5).await;
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let progress = &consumer.progress;
    assert_eq!(load(&progress.signed), 5);
    assert_eq!(load(&progress.row_reads), 0);

    // What someone who can write to the topic but lacks the key could
    // inject: an event signed with another key, a signed event altered
    // after signing, and an unsigned one. None has a row behind it.
    let forged = transition("mallory", "video_s", "none", "like", 1);
    let other = event_key("theirs").1.sign(&forged);
    env.publish_raw_signed("video_s", &forged, Some(&other))
        .await;
    let signed = transition("eve", "video_s", "none", "like", 1);
    let altered = transition("evf", "video_s", "none", "like", 1);
    env.publish_raw_signed("video_s", &altered, Some(&key.sign(&signed)))
        .await;
    env.publish_raw(
        "video_s",
        &transition("oscar", "video_s", "none", "like", 1),
    )
    .await;
    eventually(
        "the forgeries dead-lettered",
        Duration::from_secs(60),
        || async {
            (consumer.processed() >= 8 && load(&progress.dead_lettered) == 3).then_some(())
        },
    )
    .await;
    assert_eq!(
        (load(&progress.bad_signatures), load(&progress.unsigned)),
        (2, 1)
    );
    assert!(load(&progress.row_reads) >= 1, "the forgeries were read");
    assert_eq!(load(&progress.signed), 5);
    let video = &env.stats().await["video_s"];
    assert_eq!((video.likes(), video.dislikes()), (1, 1));
    assert_eq!(env.stats().await, env.recount().await);
    assert_eq!(served(&app, "video_s").await, (1, 1));
    consumer.stop().await;

    let reasons: Vec<(String, String)> = dead_letters(&env, 3).await?;
    assert!(
        reasons.iter().all(|(_, r)| r.contains("no reaction row")),
        "{reasons:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_consumer_with_another_key_or_none_reads_the_rows_and_counts_every_vote() -> TestResult {
    // A key being changed: the vote API already signs with the new key,
    // the consumer still verifies with the old one; then a consumer that
    // was given no key at all.
    let mut env = TestEnv::new().await;
    let mut api = env.api_config();
    api.stores.kafka.event_signing_key = Some(event_key("new").0);
    let app = env.spawn_app_with(api).await;
    for (user, action) in [("ana", "like"), ("bob", "dislike"), ("ana", "none")] {
        let reply = app.vote(user, new_key(), "video_k", action).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    env.kafka.event_signing_key = Some(event_key("old").0);
    let consumer = env.start_consumer();
    processed_at_least(&consumer, 3).await;
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let video = &env.stats().await["video_k"];
    assert_eq!((video.likes(), video.dislikes()), (0, 1));
    assert_eq!(served(&app, "video_k").await, (0, 1));
    let progress = &consumer.progress;
    assert_eq!(load(&progress.signed), 0);
    assert_eq!(load(&progress.bad_signatures), 3);
    assert!(load(&progress.row_reads) >= 1);
    assert_eq!(load(&progress.dead_lettered), 0, "no vote refused");
    consumer.stop().await;

    // A consumer of another group, with no key: the same votes, read.
    env.kafka.event_signing_key = None;
    let keyless = env.start_consumer_with(tally::consumer::ConsumerConfig {
        group: format!("{}-keyless", env.group),
        ..env.consumer_config()
    });
    processed_at_least(&keyless, 3).await;
    let progress = &keyless.progress;
    assert_eq!((load(&progress.signed), load(&progress.unverified)), (0, 3));
    assert_eq!(load(&progress.dead_lettered), 0, "no vote refused");
    assert_eq!(env.stats().await, env.recount().await);
    keyless.stop().await;
    Ok(())
}
