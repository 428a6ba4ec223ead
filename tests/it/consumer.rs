//! `tally consumer` against the real stack: duplicates, reordering, poison,
//! a kill -9 mid-batch, and a rebalance between two consumers.

use std::time::Duration;

use futures::StreamExt;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Headers;

use crate::support::{Rng, TestEnv, TestResult, eventually};

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
    let consumer = env.start_consumer();
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
    let consumer = env.start_consumer();
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
    let consumer = env.start_consumer();
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
    let dlq: StreamConsumer = env
        .kafka
        .client()
        .set("group.id", format!("{}-dlq", env.group))
        .set("auto.offset.reset", "earliest")
        .create()?;
    dlq.subscribe(&[&env.kafka.dead_letter_topic])?;
    let mut reasons = Vec::new();
    let mut stream = dlq.stream();
    while reasons.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap_or_else(|_| panic!("dead letters missing; got {reasons:?}"))
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
        assert_eq!(m.key(), Some(&b"video_p"[..]));
        reasons.push(reason);
    }
    assert!(reasons[0].contains("not a transition"), "{reasons:?}");
    assert!(reasons[1].contains("must change"), "{reasons:?}");
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

#[tokio::test]
async fn in_order_transitions_are_counted_without_reads_until_another_writer_moves_the_fence()
-> TestResult {
    use std::sync::atomic::Ordering::Relaxed;
    let env = TestEnv::new().await;
    let consumer = env.start_consumer();
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
