//! `POST /v1/votes` and `GET /v1/votes/summary` against the real stack,
//! judged by the rows written, the transitions published and the answers.

use futures::future::join_all;
use tally::domain::Reaction;

use crate::support::{TestEnv, TestResult, new_key};

fn totals(reply: &crate::support::Reply) -> (i64, i64, String) {
    let v = reply.json();
    (
        v["likes"].as_i64().unwrap_or(-1),
        v["dislikes"].as_i64().unwrap_or(-1),
        v["user_state"].as_str().unwrap_or("?").to_owned(),
    )
}

#[tokio::test]
async fn alice_like_then_dislike_then_undo_moves_each_total_once() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;

    let like = app.vote("alice", new_key(), "video_abc123", "like").await;
    let dislike = app
        .vote("alice", new_key(), "video_abc123", "dislike")
        .await;
    let undo = app.vote("alice", new_key(), "video_abc123", "none").await;

    assert_eq!(
        (like.status, dislike.status, undo.status),
        (200, 200, 200),
        "{like:?} {dislike:?} {undo:?}"
    );
    assert_eq!(totals(&like), (1, 0, "like".into()));
    assert_eq!(totals(&dislike), (0, 1, "dislike".into()));
    assert_eq!(totals(&undo), (0, 0, "none".into()));

    let seen: Vec<(Reaction, Reaction, i64)> = env
        .transitions()
        .await
        .iter()
        .map(|t| (t.from, t.to, t.version))
        .collect();
    assert_eq!(
        seen,
        [
            (Reaction::None, Reaction::Like, 1),
            (Reaction::Like, Reaction::Dislike, 2),
            (Reaction::Dislike, Reaction::None, 3)
        ]
    );
    let t = &env.transitions().await[0];
    assert_eq!(
        (t.user_id.as_str(), t.target_id.as_str()),
        ("alice", "video_abc123")
    );
    assert_eq!(
        env.reaction("alice", "video_abc123").await,
        Some(("none".into(), 3))
    );
    Ok(())
}

#[tokio::test]
async fn a_double_click_with_two_keys_publishes_one_transition() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;

    let (a, b) = tokio::join!(
        app.vote("bob", new_key(), "video_1", "like"),
        app.vote("bob", new_key(), "video_1", "like")
    );

    assert_eq!((a.status, b.status), (200, 200), "{a:?} {b:?}");
    assert_eq!((totals(&a).2, totals(&b).2), ("like".into(), "like".into()));
    assert_eq!(env.published(), 1);
    assert_eq!(
        env.reaction("bob", "video_1").await,
        Some(("like".into(), 1))
    );
    Ok(())
}

#[tokio::test]
async fn fifty_concurrent_likes_from_one_user_publish_exactly_one_transition() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;

    let replies =
        join_all((0..50).map(|_| app.vote("carol", new_key(), "video_hot", "like"))).await;

    for r in &replies {
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(totals(r).2, "like");
    }
    assert_eq!(
        env.published(),
        1,
        "50 likes of one user are one change of state"
    );
    assert_eq!(
        env.reaction("carol", "video_hot").await,
        Some(("like".into(), 1))
    );
    let summary = app.summary("carol", "video_hot").await.json();
    assert_eq!(summary["items"]["video_hot"]["likes"], 1);
    Ok(())
}

#[tokio::test]
async fn fifty_users_liking_one_target_concurrently_publish_fifty_first_versions() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;

    let users: Vec<String> = (0..50).map(|i| format!("user_{i}")).collect();
    let replies = join_all(
        users
            .iter()
            .map(|u| app.vote(u, new_key(), "video_viral", "like")),
    )
    .await;

    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    let transitions = env.transitions().await;
    assert_eq!(transitions.len(), 50);
    assert!(
        transitions
            .iter()
            .all(|t| t.version == 1 && t.from == Reaction::None && t.to == Reaction::Like)
    );
    let mut voters: Vec<&str> = transitions.iter().map(|t| t.user_id.as_str()).collect();
    voters.sort_unstable();
    voters.dedup();
    assert_eq!(voters.len(), 50, "one transition per user");
    let summary = app.summary("someone_else", "video_viral").await.json();
    assert_eq!(
        summary["items"]["video_viral"]["likes"], 50,
        "the cache took every delta once"
    );
    Ok(())
}

#[tokio::test]
async fn a_replayed_key_returns_the_identical_body_and_publishes_nothing() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let key = new_key();

    let first = app.vote("dave", &key, "video_2", "like").await;
    let published = env.published();
    // Someone else likes it meanwhile, so a recomputed answer would differ.
    app.vote("erin", new_key(), "video_2", "like").await;
    let after_erin = env.published();
    let again = app.vote("dave", &key, "video_2", "like").await;

    assert_eq!(first.status, 200);
    assert!(first.headers.get("Idempotent-Replayed").is_none());
    assert_eq!(again.status, 200);
    assert_eq!(again.body, first.body, "a replay is byte-identical");
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(published, 1);
    assert_eq!(env.published(), after_erin, "the replay published nothing");
    assert_eq!(
        env.reaction("dave", "video_2").await,
        Some(("like".into(), 1))
    );
    Ok(())
}

#[tokio::test]
async fn a_late_retry_of_a_like_after_a_dislike_leaves_the_user_on_dislike() -> TestResult {
    // A like whose response is lost, then a dislike, then the like's retry arrives.
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let like_key = new_key();

    let like = app.vote("frank", &like_key, "video_3", "like").await;
    let dislike = app.vote("frank", new_key(), "video_3", "dislike").await;
    let late_retry = app.vote("frank", &like_key, "video_3", "like").await;

    assert_eq!(
        (like.status, dislike.status, late_retry.status),
        (200, 200, 200)
    );
    assert_eq!(
        late_retry.body, like.body,
        "the retry gets the like's stored answer"
    );
    assert_eq!(
        env.reaction("frank", "video_3").await,
        Some(("dislike".into(), 2))
    );
    assert_eq!(env.published(), 2);
    let summary = app.summary("frank", "video_3").await.json();
    assert_eq!(summary["items"]["video_3"]["user_state"], "dislike");
    Ok(())
}

#[tokio::test]
async fn a_no_op_records_its_key_so_its_late_retry_cannot_undo_a_later_change() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    app.vote("gina", new_key(), "video_4", "like").await;
    let noop_key = new_key();

    let noop = app.vote("gina", &noop_key, "video_4", "like").await;
    app.vote("gina", new_key(), "video_4", "none").await;
    let retry = app.vote("gina", &noop_key, "video_4", "like").await;

    assert_eq!(noop.status, 200);
    assert_eq!(retry.body, noop.body);
    assert_eq!(
        env.reaction("gina", "video_4").await,
        Some(("none".into(), 2))
    );
    assert_eq!(
        env.published(),
        2,
        "like and none; the no-op published nothing"
    );
    Ok(())
}

#[tokio::test]
async fn a_key_reused_with_another_body_is_refused_with_422() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let key = new_key();

    app.vote("hank", &key, "video_5", "like").await;
    let reused = app.vote("hank", &key, "video_5", "dislike").await;
    let other_target = app.vote("hank", &key, "video_6", "like").await;

    assert_eq!(reused.status, 422, "{reused:?}");
    assert_eq!(reused.code(), "idempotency_key_reused");
    assert_eq!(other_target.status, 422);
    assert_eq!(
        env.reaction("hank", "video_5").await,
        Some(("like".into(), 1))
    );
    assert_eq!(env.reaction("hank", "video_6").await, None);
    assert_eq!(env.published(), 1);
    Ok(())
}

#[tokio::test]
async fn keys_are_scoped_to_the_user() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let key = new_key();

    let a = app.vote("ivan", &key, "video_7", "like").await;
    let b = app.vote("judy", &key, "video_7", "dislike").await;

    assert_eq!((a.status, b.status), (200, 200));
    assert!(b.headers.get("Idempotent-Replayed").is_none());
    assert_eq!(
        env.reaction("judy", "video_7").await,
        Some(("dislike".into(), 1))
    );
    assert_eq!(env.published(), 2);
    Ok(())
}

#[tokio::test]
async fn the_summary_gives_counts_and_only_the_callers_own_state() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    app.vote("kate", new_key(), "video_8", "like").await;
    app.vote("leo", new_key(), "video_8", "dislike").await;
    app.vote("leo", new_key(), "comment_1", "like").await;

    let kate = app
        .summary("kate", "video_8,comment_1,nobody_voted,video_8")
        .await;
    let v = kate.json();

    assert_eq!(kate.status, 200);
    assert_eq!(
        v["items"].as_object().map(|m| m.len()),
        Some(3),
        "duplicates collapse: {v}"
    );
    assert_eq!(
        v["items"]["video_8"],
        serde_json::json!({"likes": 1, "dislikes": 1, "user_state": "like"})
    );
    assert_eq!(
        v["items"]["comment_1"],
        serde_json::json!({"likes": 1, "dislikes": 0, "user_state": "none"})
    );
    assert_eq!(
        v["items"]["nobody_voted"],
        serde_json::json!({"likes": 0, "dislikes": 0, "user_state": "none"})
    );
    Ok(())
}

/// The vote's write is one conditional batch that needs no read before it:
/// a wrong guess of the row is refused with what the row holds, and a reused
/// key is refused with its record, each in the same round.
#[tokio::test]
async fn a_refused_vote_write_returns_the_row_and_the_record_it_was_refused_on() -> TestResult {
    use tally::domain::{IdempotencyKey, TargetId, TargetType, UserId};
    use tally::store::reactions::{Change, Current, KeyRecord, Written};

    let env = TestEnv::new().await;
    let store =
        tally::store::Store::open(&env.cassandra, std::time::Duration::from_secs(60)).await?;
    let (user, target) = (UserId::parse("guesser")?, TargetId::parse("video_guess")?);
    let record = |body: &str| KeyRecord {
        request_hash: "h".into(),
        owner: uuid::Uuid::new_v4(),
        status: 200,
        body: body.into(),
        transition: None,
        intent_bucket: None,
        intent_shard: None,
    };
    let write = |expected: Option<Current>, to: Reaction, key: IdempotencyKey, r: KeyRecord| {
        let (store, user, target) = (&store, &user, &target);
        async move {
            let change = Change {
                user,
                target,
                target_type: TargetType::Video,
                expected,
                to,
                key: &key,
                record: &r,
            };
            store.reactions.commit(&change).await
        }
    };
    let first_key = IdempotencyKey::parse(&new_key())?;
    let first = write(None, Reaction::Like, first_key.clone(), record("first")).await;
    assert!(matches!(first, Written::Applied), "{first:?}");

    // Guessing "no row" again: refused, with the row as it is and no record.
    let guess = write(
        None,
        Reaction::Dislike,
        IdempotencyKey::parse(&new_key())?,
        record("second"),
    )
    .await;
    let Written::Refused(snap) = guess else {
        anyhow::bail!("a wrong guess applied: {guess:?}");
    };
    let liked = Current {
        state: Reaction::Like,
        version: 1,
    };
    assert_eq!(snap.current, Some(liked));
    assert!(snap.record.is_none(), "{snap:?}");

    // The right guess, from the refusal, applies.
    let second = write(
        Some(liked),
        Reaction::Dislike,
        IdempotencyKey::parse(&new_key())?,
        record("second"),
    )
    .await;
    assert!(matches!(second, Written::Applied), "{second:?}");

    // The first key again, guessing right: refused on the key's record.
    let replay = write(
        Some(Current {
            state: Reaction::Dislike,
            version: 2,
        }),
        Reaction::Like,
        first_key,
        record("again"),
    )
    .await;
    let Written::Refused(snap) = replay else {
        anyhow::bail!("a reused key applied: {replay:?}");
    };
    assert_eq!(snap.record.map(|r| r.body).as_deref(), Some("first"));
    assert_eq!(
        snap.current.map(|c| (c.state, c.version)),
        Some((Reaction::Dislike, 2))
    );
    Ok(())
}

/// A vote for the state a process believes the user holds is answered only
/// if the row holds it: two instances, each with its own stale belief, never
/// acknowledge a state the row does not have.
#[tokio::test]
async fn a_stale_belief_of_the_row_never_acknowledges_a_state_the_row_lacks() -> TestResult {
    let env = TestEnv::new().await;
    let (a, b) = (env.spawn_app().await, env.spawn_app().await);
    let state_of = |reply: &crate::support::Reply| reply.json()["user_state"].clone();

    // A sees the like. B has seen nothing, so it believes bob has no row:
    // "none" looks like nothing to do, but the row says like.
    assert_eq!(
        state_of(&a.vote("bob", new_key(), "video_stale", "like").await),
        "like"
    );
    let undo = b.vote("bob", new_key(), "video_stale", "none").await;
    assert_eq!(
        (undo.status, state_of(&undo)),
        (200, "none".into()),
        "{}",
        undo.body
    );
    let now = a.summary("bob", "video_stale").await.json()["items"]["video_stale"].clone();
    assert_eq!(
        (now["user_state"].clone(), now["likes"].clone()),
        ("none".into(), 0.into()),
        "{now}"
    );

    // A still believes bob likes it: "like" looks like nothing to do, but
    // the row says none.
    let again = a.vote("bob", new_key(), "video_stale", "like").await;
    assert_eq!(
        (again.status, state_of(&again)),
        (200, "like".into()),
        "{}",
        again.body
    );
    let now = b.summary("bob", "video_stale").await.json()["items"]["video_stale"].clone();
    assert_eq!(
        (now["user_state"].clone(), now["likes"].clone()),
        ("like".into(), 1.into()),
        "{now}"
    );
    Ok(())
}

/// A page is read before its buttons are pressed. The read tells the process
/// the caller's rows, so the vote after it guesses the row right and takes one
/// Paxos round, even when none of that user's votes went through this process.
#[tokio::test]
async fn a_vote_after_reading_its_page_takes_one_round_where_a_blind_one_takes_two() -> TestResult {
    use crate::ops::{sample_sum, scrape};
    let env = TestEnv::new().await;
    // Rows written through another instance: the process below has seen none.
    let first = env.spawn_app().await;
    for user in ["reader", "stranger"] {
        let liked = first.vote(user, new_key(), "page_item", "like").await;
        assert_eq!(liked.status, 200, "{}", liked.body);
    }
    let (_process, other) = env.spawn_vote_process(|_| {}).await?;
    let metrics = format!("{}/metrics", other.ops);
    let refused = |text: &str| {
        sample_sum(
            text,
            "tally_cas_total",
            &["statement=\"vote\"", "outcome=\"not_applied\""],
        )
        .unwrap_or(0.0)
    };

    let page = other.summary("reader", "page_item").await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(page.json()["items"]["page_item"]["user_state"], "like");
    let after_page = other
        .vote("reader", new_key(), "page_item", "dislike")
        .await;
    assert_eq!(after_page.status, 200, "{}", after_page.body);
    assert_eq!(
        refused(&scrape(&other.client, &metrics).await),
        0.0,
        "the vote after the page guessed the row the page read"
    );

    // The same vote with no page read first: the guess is "no row", refused
    // once with the row, then written. The counter above could have moved.
    let blind = other
        .vote("stranger", new_key(), "page_item", "dislike")
        .await;
    assert_eq!(blind.status, 200, "{}", blind.body);
    assert_eq!(refused(&scrape(&other.client, &metrics).await), 1.0);

    let served = other.summary("reader", "page_item").await.json();
    assert_eq!(served["items"]["page_item"]["user_state"], "dislike");
    Ok(())
}

/// A process that has not registered a target still writes nothing to the
/// registry for a vote on it when the served totals count someone: that
/// count proves a registration before it. Where nobody is counted (a new
/// target, or one whose every reaction was taken back) it registers, unless
/// a miss of this process found the registry row.
/// Cassandra's write time of the registry row says whether it was written.
#[tokio::test]
async fn a_vote_registers_its_target_only_where_the_served_totals_count_nobody() -> TestResult {
    let env = TestEnv::new().await;
    let written_at = async |target: &str| -> anyhow::Result<Option<i64>> {
        let rows = env
            .session
            .query_unpaged(
                "SELECT WRITETIME(target_type) FROM targets WHERE target_id = ?",
                (target,),
            )
            .await?
            .into_rows_result()?;
        Ok(rows.maybe_first_row::<(Option<i64>,)>()?.and_then(|(t,)| t))
    };
    let first = env.spawn_app().await;
    for (user, target, action) in [
        ("reg1", "counted", "like"),
        ("reg1", "emptied", "like"),
        ("reg1", "emptied", "none"),
        ("reg1", "read", "like"),
        ("reg1", "read", "none"),
    ] {
        let reply = first.vote(user, new_key(), target, action).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let counted = written_at("counted")
        .await?
        .ok_or_else(|| anyhow::anyhow!("counted: not registered by its first vote"))?;
    let emptied = written_at("emptied")
        .await?
        .ok_or_else(|| anyhow::anyhow!("emptied: not registered by its first vote"))?;
    let read = written_at("read")
        .await?
        .ok_or_else(|| anyhow::anyhow!("read: not registered by its first vote"))?;
    assert_eq!(written_at("fresh").await?, None);

    // Another process, which registered nothing: it reads each target's
    // totals for its answer anyway. A page's miss on a target finds its
    // registry row, which it remembers, though the target counts nobody.
    let second = env.spawn_app().await;
    let cache = tally::cache::Cache::new(&env.redis, std::time::Duration::from_secs(60))?;
    cache
        .invalidate(&tally::domain::TargetId::parse("read")?)
        .await?;
    assert_eq!(second.summary("reg2", "read").await.status, 200);
    let reply = second.vote("reg2", new_key(), "read", "like").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        written_at("read").await?,
        Some(read),
        "a target whose registry row a miss found is not registered again"
    );
    for (user, target) in [("reg2", "counted"), ("reg2", "emptied"), ("reg2", "fresh")] {
        let reply = second.vote(user, new_key(), target, "like").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert_eq!(
        written_at("counted").await?,
        Some(counted),
        "a target counting a like is not registered again"
    );
    assert!(
        written_at("emptied").await?.is_some_and(|t| t > emptied),
        "a target counting nobody is registered again"
    );
    assert!(
        written_at("fresh").await?.is_some(),
        "a new target is registered"
    );
    // And the new target's count is served after its entry goes: this
    // process registered it, so the miss reads the buckets.
    let consumer = env.start_consumer();
    env.wait_until_no_drift(std::time::Duration::from_secs(60))
        .await;
    consumer.stop().await;
    let cache = tally::cache::Cache::new(&env.redis, std::time::Duration::from_secs(60))?;
    cache
        .invalidate(&tally::domain::TargetId::parse("fresh")?)
        .await?;
    let summary = second.summary("reg2", "fresh").await.json();
    assert_eq!(summary["items"]["fresh"]["likes"], 1, "{summary}");
    Ok(())
}
