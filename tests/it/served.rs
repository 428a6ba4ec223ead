//! What readers are served: under continuous load, longer than several cache
//! TTLs, the served totals stay within the votes in flight of the truth,
//! every voter reads their own vote, and once the load stops the served
//! totals equal the recount of `reactions` within seconds: no flush, no
//! waiting for entries to expire.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally::domain::{Reaction, Totals};

use crate::support::{
    GatedLink, MoveFence, PrivateRedis, Proc, Rng, TestEnv, TestResult, eventually, free_port,
    new_key, signal,
};

const TARGETS: [&str; 4] = ["hot0", "hot1", "hot2", "hot3"];

/// One answered vote: when it was in flight, on which target.
struct Flight {
    target: usize,
    started: Instant,
    ended: Instant,
}

/// One poll of the served totals of every target: sent, then answered.
struct Poll {
    sent: Instant,
    at: Instant,
    totals: Vec<Totals>,
}

/// How long after its answer a vote's transition may still be on its way
/// into the totals (the consumer's lag); well above this test's.
const CONSUMER_LAG: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_totals_converge_under_continuous_load_longer_than_three_ttls() -> TestResult {
    let env = TestEnv::new().await;
    let ttl = Duration::from_secs(2);
    let mut config = env.api_config();
    config.cache_ttl = tally::cache::TtlPolicy { min: ttl, max: ttl };
    let app = Arc::new(env.spawn_app_with(config).await);
    let mut consumer = env.consumer_config();
    consumer.cache_ttl = tally::cache::TtlPolicy { min: ttl, max: ttl };
    let consumer = env.start_consumer_with(consumer);
    let run_for = ttl * 4;
    let deadline = Instant::now() + run_for;
    let flights = Arc::new(Mutex::new(Vec::<Flight>::new()));
    let ryw_violations = Arc::new(Mutex::new(Vec::<String>::new()));

    let mut writers = Vec::new();
    for w in 0..10u64 {
        let (app, flights, ryw) = (app.clone(), flights.clone(), ryw_violations.clone());
        writers.push(tokio::spawn(async move {
            let mut rng = Rng(100 + w);
            while Instant::now() < deadline {
                // Two writers share each user: conflicting tabs.
                let user = format!("u{}", (w / 2) * 3 + rng.below(3));
                let t = rng.below(TARGETS.len() as u64) as usize;
                let action = ["like", "dislike", "none"][rng.below(3) as usize];
                let started = Instant::now();
                // One in four is a double click: the same action twice at once.
                let replies = if rng.below(4) == 0 {
                    let (a, b) = tokio::join!(
                        app.vote(&user, new_key(), TARGETS[t], action),
                        app.vote(&user, new_key(), TARGETS[t], action)
                    );
                    vec![a, b]
                } else {
                    vec![app.vote(&user, new_key(), TARGETS[t], action).await]
                };
                let ended = Instant::now();
                if let Ok(mut f) = flights.lock() {
                    f.push(Flight {
                        target: t,
                        started,
                        ended,
                    });
                }
                let Some(ok) = replies.iter().find(|r| r.status == 200) else {
                    continue;
                };
                // Read-your-writes: the voter's own summary counts the vote.
                let state = ok.json()["user_state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                let summary = app.summary(&user, TARGETS[t]).await.json();
                let item = &summary["items"][TARGETS[t]];
                let seen = item["user_state"].as_str().unwrap_or_default();
                let counted = match state.parse::<Reaction>() {
                    Ok(r @ (Reaction::Like | Reaction::Dislike)) => r
                        .total_name()
                        .and_then(|n| item[n].as_i64())
                        .is_some_and(|n| n >= 1),
                    _ => true,
                };
                // A concurrent tab of the same user may have moved it on since.
                let moved_on = seen != state;
                if !counted && !moved_on {
                    if let Ok(mut v) = ryw.lock() {
                        v.push(format!(
                            "{user} on {}: voted {state}, read {item}",
                            TARGETS[t]
                        ));
                    }
                }
            }
        }));
    }

    // A reader polls every target's served totals throughout.
    let reader = {
        let app = app.clone();
        tokio::spawn(async move {
            let mut polls = Vec::new();
            while Instant::now() < deadline {
                let sent = Instant::now();
                let reply = app.summary("reader", &TARGETS.join(",")).await;
                let at = Instant::now();
                if reply.status == 200 {
                    let body = reply.json();
                    let totals = TARGETS
                        .iter()
                        .map(|t| {
                            serde_json::from_value(body["items"][*t].clone()).unwrap_or_default()
                        })
                        .collect();
                    polls.push(Poll { sent, at, totals });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            polls
        })
    };
    for w in writers {
        w.await?;
    }
    let polls = reader.await?;
    let load_ended = Instant::now();

    // The durable totals catch up with the consumer...
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;
    let drained = Instant::now();
    // ...and the served ones equal the recount within 5 s of that.
    let truth = env.recount().await;
    let converged = eventually(
        "served totals to equal the recount",
        Duration::from_secs(5),
        || async {
            let summary = app.summary("checker", &TARGETS.join(",")).await.json();
            TARGETS
                .iter()
                .all(|t| {
                    let served: Totals =
                        serde_json::from_value(summary["items"][*t].clone()).unwrap_or_default();
                    served == truth.get(*t).map(|tally| tally.totals).unwrap_or_default()
                })
                .then(Instant::now)
        },
    )
    .await;

    // A poll-to-poll move is never larger than the transitions in flight
    // between the two polls: votes whose request overlapped the window, or
    // whose transition was still on its way into the totals (a change of
    // reaction moves each total by at most one).
    let flights = flights
        .lock()
        .map(|f| {
            f.iter()
                .map(|x| (x.target, x.started, x.ended))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let mut worst_excess = 0i64;
    let mut largest_move = 0i64;
    for pair in polls.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        for t in 0..TARGETS.len() {
            let in_flight = flights
                .iter()
                .filter(|(ft, s, e)| *ft == t && *s < b.at && *e + CONSUMER_LAG > a.sent)
                .count() as i64;
            for r in Reaction::COUNTED {
                let moved = (b.totals[t].get(*r) - a.totals[t].get(*r)).abs();
                largest_move = largest_move.max(moved);
                worst_excess = worst_excess.max(moved - in_flight);
            }
        }
    }
    let violations = ryw_violations.lock().map(|v| v.clone()).unwrap_or_default();
    eprintln!(
        "served: {} votes over {:?} (TTL {ttl:?}), {} polls, largest move {largest_move}, \
         worst move beyond the votes in flight {worst_excess}, drained {:?} after the load, \
         served = recount {:?} after draining, read-your-writes violations {}",
        flights.len(),
        run_for,
        polls.len(),
        drained - load_ended,
        converged - drained,
        violations.len()
    );
    assert!(
        flights.len() > 100,
        "too little load to mean anything: {}",
        flights.len()
    );
    assert!(
        violations.is_empty(),
        "read-your-writes violated: {:?}",
        &violations[..violations.len().min(5)]
    );
    assert!(
        worst_excess <= 0,
        "a served total moved {worst_excess} more than the votes in flight"
    );
    Ok(())
}

/// Reconcile may count a row before the vote that changed it has counted
/// the change in the cache (the vote's cache step runs after its commit).
/// Its write-through marks such users, and the late step is then not
/// counted a second time; a write-through without the mark would be.
#[tokio::test]
async fn a_change_reconcile_counted_before_its_votes_cache_step_is_served_once() -> TestResult {
    use tally::cache::{Cache, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let one = Layout::new(1)?;
    for (id, marked) in [("marked", true), ("unmarked", false)] {
        let target = TargetId::parse(id)?;
        let ann = UserId::parse("ann")?;
        let empty = Head {
            seq: Some(1),
            totals: Totals::default(),
            target_type: None,
        };
        fill(&cache, &target, &Heads(vec![empty])).await?;
        // Reconcile counts ann's like, her row at version 1...
        let users = [(
            ann.clone(),
            Applied {
                version: 1,
                state: Reaction::Like,
            },
        )];
        let ahead = [(ann.clone(), 1)];
        let written = Written {
            buckets: one,
            bucket: Bucket::FIRST,
            seq: 2,
            totals: Totals::count([Reaction::Like]),
            users: &users,
            ahead: if marked { &ahead } else { &[] },
        };
        cache.write_through(&target, &written).await?;
        // ...and then her vote's own cache step arrives.
        count_first_like(&cache, &target, &ann, one).await?;
        let expected = if marked { 1 } else { 2 };
        assert_eq!(served_likes(&cache, &target).await?, Some(expected), "{id}");
    }
    Ok(())
}

/// A vote's cache step whose command is held on its way to Redis past the
/// call's own timeout, but not past the deadline Redis checks, still lands.
/// The vote is published only once that deadline has passed, so the
/// consumer's write-through comes after the step and takes it out. Published
/// at once, the consumer counted the like first, the step then added it
/// again, and the drop owed for it was lost with the link: served 2 for 1.
#[tokio::test]
async fn a_cache_step_that_lands_after_its_call_timed_out_is_not_counted_twice() -> TestResult {
    use crate::support::LateLink;

    let env = TestEnv::new().await;
    let redis_port = env
        .redis
        .url
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or(6379);
    let link = LateLink::start(redis_port).await;
    let direct = env.spawn_app().await;
    // The scripts loaded, and the entry filled, on the direct path.
    let warm = direct.vote("warm", new_key(), "warm", "like").await;
    assert_eq!(warm.status, 200, "{}", warm.body);
    assert_eq!(
        totals_served(&direct, "held").await,
        Some(Totals::default())
    );
    let mut config = env.api_config();
    config.stores.redis.url = format!("redis://127.0.0.1:{}", link.port);
    let held = env.spawn_app_with(config).await;
    let consumer = env.start_consumer();
    // A consumer that has joined and counts at once: counted within a second
    // of a publish, it would come before the held step, which the test needs.
    eventually(
        "the consumer to count the warm-up vote",
        Duration::from_secs(30),
        || async { (consumer.processed() >= 1).then_some(()) },
    )
    .await;

    // Held 1.4 s: past the call's 500 ms, within Redis's 1.9 s deadline.
    link.hold_next_script(Duration::from_millis(1400));
    let vote = held.vote("ann", new_key(), "held", "like").await;
    assert_eq!(vote.status, 200, "{}", vote.body);
    eventually(
        "the held step to land and the like to be counted",
        Duration::from_secs(30),
        || async {
            let counted = env.stats().await.get("held").map(|t| t.likes()) == Some(1);
            (link.delivered() && counted).then_some(())
        },
    )
    .await;
    env.wait_until_no_drift(Duration::from_secs(30)).await;
    consumer.stop().await;
    let served = totals_served(&direct, "held")
        .await
        .map(|t| t.get(Reaction::Like));
    assert_eq!(served, Some(1), "served against one like");
    Ok(())
}

/// While the consumer is behind, its write-throughs, which keep entries
/// alive, stop; an entry that then expired was filled again from durable
/// totals without the votes of the lag, and served counts went back. A vote
/// keeps its entry at least the TTL from its change.
#[tokio::test]
async fn an_entry_holding_a_change_not_yet_counted_outlives_its_first_ttl() -> TestResult {
    let env = TestEnv::new().await;
    let mut config = env.api_config();
    config.cache_ttl = tally::cache::TtlPolicy {
        min: Duration::from_secs(2),
        max: Duration::from_secs(2),
    };
    // No consumer: nothing counts the like durably during the test.
    let app = env.spawn_app_with(config).await;
    assert_eq!(
        totals_served(&app, "lagging").await,
        Some(Totals::default())
    );
    let key = format!("{}:d:lagging", env.redis.prefix);
    let mut redis = redis::Client::open(env.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let expiry = eventually(
        "the entry to near its expiry",
        Duration::from_secs(5),
        || {
            let (key, mut redis) = (key.clone(), redis.clone());
            async move {
                let left: i64 = redis::cmd("PTTL")
                    .arg(&key)
                    .query_async(&mut redis)
                    .await
                    .ok()?;
                (0..800)
                    .contains(&left)
                    .then(|| Instant::now() + Duration::from_millis(left as u64))
            }
        },
    )
    .await;
    let like = app.vote("ann", new_key(), "lagging", "like").await;
    assert_eq!(like.status, 200, "{}", like.body);
    // Time passing is what is tested: past the entry's first expiry.
    tokio::time::sleep_until((expiry + Duration::from_millis(300)).into()).await;
    let served = totals_served(&app, "lagging")
        .await
        .map(|t| t.get(Reaction::Like));
    assert_eq!(served, Some(1), "the like, still to be counted durably");
    let left: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut redis).await?;
    assert!(left > 0, "{left}");
    Ok(())
}

/// A write-through drops pending changes left behind (older than 30 s),
/// unless the consumers' lag says changes that old may still be counted;
/// reconcile's drop none.
#[tokio::test]
async fn a_lagging_consumer_keeps_the_pending_changes_it_has_yet_to_count() -> TestResult {
    use tally::cache::{Cache, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let one = Layout::new(1)?;
    let mut redis = redis::Client::open(env.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let (ann, bob) = (UserId::parse("ann")?, UserId::parse("bob")?);
    let lagging = Cache::new(&env.redis, Duration::from_secs(60))?;
    lagging.follow_lag(60.0);
    // Reconcile follows no lag, and leaves the dropping to the consumer.
    let reconciling = Cache::new(&env.redis, Duration::from_secs(60))?.keeping_pending_changes();
    let keeping_up = Cache::new(&env.redis, Duration::from_secs(60))?;
    for (id, cache, expected) in [
        ("lag_60s", lagging, 2),
        ("reconcile", reconciling, 2),
        ("no_lag", keeping_up, 1),
    ] {
        let target = TargetId::parse(id)?;
        let empty = Head {
            seq: Some(1),
            totals: Totals::default(),
            target_type: None,
        };
        fill(&cache, &target, &Heads(vec![empty])).await?;
        count_first_like(&cache, &target, &ann, one).await?;
        // Ann's change, counted in the cache 40 s ago.
        let key = format!("{}:d:{id}", env.redis.prefix);
        let field = "p:ann";
        let change: String = redis::cmd("HGET")
            .arg(&key)
            .arg(field)
            .query_async(&mut redis)
            .await?;
        let (rest, ms) = change.rsplit_once('|').unwrap_or_default();
        let aged = ms.parse::<u64>()? - 40_000;
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg(field)
            .arg(format!("{rest}|{aged}"))
            .query_async(&mut redis)
            .await?;
        // The consumer counts bob's like, not yet ann's.
        let users = [(
            bob.clone(),
            Applied {
                version: 1,
                state: Reaction::Like,
            },
        )];
        let written = Written {
            buckets: one,
            bucket: Bucket::FIRST,
            seq: 2,
            totals: Totals::count([Reaction::Like]),
            users: &users,
            ahead: &[],
        };
        cache.write_through(&target, &written).await?;
        assert_eq!(served_likes(&cache, &target).await?, Some(expected), "{id}");
    }
    Ok(())
}

/// A mark keeps its entry for as long as a late cache step may come, even
/// past a TTL shorter than that: the entry filled again once the mark had
/// gone with it would count the change, and the late step would count it
/// again on top.
#[tokio::test]
async fn a_mark_outlives_a_ttl_shorter_than_a_late_step_may_take() -> TestResult {
    use tally::cache::{Cache, Counted, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let ttl = Duration::from_secs(2);
    let cache = Cache::new(&env.redis, ttl)?;
    let one = Layout::new(1)?;
    let target = TargetId::parse("short_ttl")?;
    let ann = UserId::parse("ann")?;
    let head = |seq, likes| Head {
        seq: Some(seq),
        totals: Totals::count(std::iter::repeat_n(Reaction::Like, likes)),
        target_type: None,
    };
    fill(&cache, &target, &Heads(vec![head(1, 0)])).await?;
    // Reconcile counts ann's like ahead of her vote's cache step.
    let users = [(
        ann.clone(),
        Applied {
            version: 1,
            state: Reaction::Like,
        },
    )];
    let written = Written {
        buckets: one,
        bucket: Bucket::FIRST,
        seq: 2,
        totals: Totals::count([Reaction::Like]),
        users: &users,
        ahead: &[(ann.clone(), 1)],
    };
    cache.write_through(&target, &written).await?;
    // The consumer then counts bob: a write with no marks, whose TTL must
    // not cut the mark's short.
    let bob = UserId::parse("bob")?;
    let both = [
        users[0].clone(),
        (
            bob.clone(),
            Applied {
                version: 1,
                state: Reaction::Like,
            },
        ),
    ];
    let bobs = Written {
        seq: 3,
        totals: Totals::count([Reaction::Like, Reaction::Like]),
        users: &both[1..],
        ahead: &[],
        ..written
    };
    cache.write_through(&target, &bobs).await?;
    // Time passing is what is tested: past the TTL, within a vote's time.
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    // The late step, filling the entry from the durable head if it is gone.
    let late = first_like(&ann);
    let deadline = cache.change_deadline();
    if let Counted::NeedsHeads(fence) = cache.apply(&target, &late, one, None, deadline).await? {
        let durable = Heads(vec![head(3, 2)]);
        cache
            .apply(&target, &late, one, Some((&fence, &durable)), deadline)
            .await?;
    }
    assert_eq!(served_likes(&cache, &target).await?, Some(2), "ann and bob");
    Ok(())
}

/// A mark says a user is counted at a version; a write-through that arrives
/// late (a former owner's, after a rebalance) carries an older mark, and
/// must not lower it: a late cache step between the two would pass.
#[tokio::test]
async fn a_late_write_through_does_not_lower_a_newer_mark() -> TestResult {
    use tally::cache::{Cache, Pending, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let one = Layout::new(1)?;
    let target = TargetId::parse("marked_late")?;
    let ann = UserId::parse("ann")?;
    let empty = Head {
        seq: Some(1),
        totals: Totals::default(),
        target_type: None,
    };
    fill(&cache, &target, &Heads(vec![empty])).await?;
    let written = |seq, version: i64, ahead: &[(UserId, i64)]| {
        let users = vec![(
            ann.clone(),
            Applied {
                version,
                state: Reaction::Like,
            },
        )];
        (seq, users, ahead.to_vec())
    };
    // The new owner counts ann at version 5, past a version 4 it never
    // counted; then the former owner's write of version 3 lands.
    for (seq, users, ahead) in [
        written(7, 5, &[(ann.clone(), 5)]),
        written(6, 3, &[(ann.clone(), 3)]),
    ] {
        let write = Written {
            buckets: one,
            bucket: Bucket::FIRST,
            seq,
            totals: Totals::count([Reaction::Like]),
            users: &users,
            ahead: &ahead,
        };
        cache.write_through(&target, &write).await?;
    }
    // Version 4's late cache step: counted at 5 already, so nothing.
    let late = Pending {
        user: &ann,
        version: 4,
        from: Reaction::None,
        to: Reaction::Like,
    };
    cache
        .apply(&target, &late, one, None, cache.change_deadline())
        .await?;
    assert_eq!(served_likes(&cache, &target).await?, Some(1));
    Ok(())
}

/// Write-throughs of one bucket can arrive out of order (the consumer's and
/// reconcile's, say). The older one still takes away the pending changes it
/// counted: the newer base counts them already.
#[tokio::test]
async fn an_older_write_through_arriving_late_still_takes_away_what_it_counted() -> TestResult {
    use tally::cache::{Cache, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let one = Layout::new(1)?;
    let target = TargetId::parse("late")?;
    let (ann, bob) = (UserId::parse("ann")?, UserId::parse("bob")?);
    let like = |version| Applied {
        version,
        state: Reaction::Like,
    };
    let empty = Head {
        seq: Some(1),
        totals: Totals::default(),
        target_type: None,
    };
    fill(&cache, &target, &Heads(vec![empty])).await?;
    // ann's vote counts her like ahead of the consumer.
    count_first_like(&cache, &target, &ann, one).await?;
    // The write of seq 2 counts ann; the write of seq 3, after it, counts
    // bob too. Their write-throughs arrive newest first.
    let (bob_row, ann_row) = ([(bob.clone(), like(1))], [(ann.clone(), like(1))]);
    let write = |seq, likes, users| Written {
        buckets: one,
        bucket: Bucket::FIRST,
        seq,
        totals: Totals::count(std::iter::repeat_n(Reaction::Like, likes)),
        users,
        ahead: &[],
    };
    cache.write_through(&target, &write(3, 2, &bob_row)).await?;
    cache.write_through(&target, &write(2, 1, &ann_row)).await?;
    assert_eq!(
        served_likes(&cache, &target).await?,
        Some(2),
        "ann and bob, each once"
    );
    Ok(())
}

/// A read's miss reads a target's buckets only when the registry has a row
/// for it: a vote registers its target before its first reaction commits,
/// so a target without a row has nothing counted, and most ids on a page
/// were never reacted to. Both targets here have totals written straight
/// into a bucket, which nothing does to a target outside the registry: only
/// the registered one's are read.
#[tokio::test]
async fn a_miss_reads_the_buckets_only_of_a_target_in_the_registry() -> TestResult {
    let env = TestEnv::new().await;
    for target in ["listed", "unlisted"] {
        env.cql(&format!(
            "UPDATE target_stats SET likes = 5, seq = 1 WHERE target_id = '{target}' AND bucket = 0"
        ))
        .await;
    }
    env.cql("INSERT INTO targets (target_id, target_type) VALUES ('listed', 'video')")
        .await;
    let app = env.spawn_app().await;
    let reply = app.summary("reader", "listed,unlisted").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let items = &reply.json()["items"];
    assert_eq!(items["listed"]["likes"], 5, "{items}");
    assert_eq!(items["unlisted"]["likes"], 0, "{items}");
    Ok(())
}

/// First votes on fresh targets race reads that miss. The readers' process
/// never registered the targets, so every miss asks the registry, and some
/// find no row and fill zeros while a first vote commits; the readers drop
/// the entries throughout. Once the votes stop and the consumer drains,
/// every target is served as its users' rows say: no flush, no expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_votes_racing_misses_that_find_no_registry_row_end_served_as_counted() -> TestResult {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use tally::cache::Cache;
    use tally::domain::TargetId;

    let env = TestEnv::new().await;
    let consumer = env.start_consumer();
    let voter = Arc::new(env.spawn_app().await);
    let reader = Arc::new(env.spawn_app().await);
    let cache = Arc::new(Cache::new(&env.redis, Duration::from_secs(60))?);
    let targets: Arc<Vec<String>> = Arc::new((0..24).map(|i| format!("fresh{i}")).collect());
    let voting = Arc::new(AtomicBool::new(true));
    let reads = Arc::new(AtomicU64::new(0));

    let mut readers = Vec::new();
    for _ in 0..2 {
        let (reader, cache, targets) = (reader.clone(), cache.clone(), targets.clone());
        let (voting, reads) = (voting.clone(), reads.clone());
        readers.push(tokio::spawn(async move {
            let ids = targets.join(",");
            while voting.load(Ordering::Relaxed) {
                for t in targets.iter() {
                    cache.invalidate(&TargetId::parse(t)?).await?;
                }
                let reply = reader.summary("reader", &ids).await;
                anyhow::ensure!(reply.status == 200, "summary: {}", reply.body);
                reads.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    // Four voters at a time, each a target's three first votes at once.
    let mut voters = Vec::new();
    for lane in 0..4 {
        let (voter, targets) = (voter.clone(), targets.clone());
        voters.push(tokio::spawn(async move {
            for t in targets.iter().skip(lane).step_by(4) {
                let (a, b, c) = tokio::join!(
                    voter.vote("ann", new_key(), t, "like"),
                    voter.vote("bob", new_key(), t, "dislike"),
                    voter.vote("cy", new_key(), t, "like"),
                );
                for reply in [a, b, c] {
                    anyhow::ensure!(reply.status == 200, "vote on {t}: {}", reply.body);
                }
            }
            anyhow::Ok(())
        }));
    }
    for v in voters {
        v.await??;
    }
    voting.store(false, Ordering::Relaxed);
    for r in readers {
        r.await??;
    }
    assert!(
        reads.load(Ordering::Relaxed) >= 2,
        "the readers read while the votes went in"
    );

    let truth = env.recount().await;
    for t in targets.iter() {
        assert_eq!(
            (truth[t].likes(), truth[t].dislikes()),
            (2, 1),
            "{t}: every vote committed"
        );
    }
    let ids = targets.join(",");
    eventually(
        "every target served as its rows say",
        Duration::from_secs(30),
        || async {
            let reply = reader.summary("reader", &ids).await;
            let items = reply.json()["items"].clone();
            targets
                .iter()
                .all(|t| {
                    items[t]["likes"] == truth[t].likes()
                        && items[t]["dislikes"] == truth[t].dislikes()
                })
                .then_some(())
        },
    )
    .await;
    consumer.stop().await;
    Ok(())
}

/// A read's miss writes no field for a bucket nobody has written (its base
/// is empty at seq 0), only the `z` mark that says so. Such a bucket's first
/// write through is still counted on top of the others, a stale fill after
/// it takes nothing away, and a base at seq 0 that is not empty (written by
/// hand) is kept like any other.
#[tokio::test]
async fn a_fill_writes_no_field_for_an_empty_bucket_and_its_first_write_still_counts() -> TestResult
{
    use tally::cache::{Cache, Written};
    use tally::domain::{Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let four = Layout::new(4)?;
    let target = TargetId::parse("sparse")?;
    let likes = |n: usize| Totals::count(std::iter::repeat_n(Reaction::Like, n));
    let head = |seq: Option<i64>, n| Head {
        seq,
        totals: likes(n),
        target_type: None,
    };
    // Bucket 1 was written (seq 3, 2 likes), bucket 2 holds 4 likes at no
    // seq, buckets 0 and 3 were never written.
    let filled = Heads(vec![
        head(None, 0),
        head(Some(3), 2),
        head(None, 4),
        head(None, 0),
    ]);
    fill(&cache, &target, &filled).await?;
    assert_eq!(served_likes(&cache, &target).await?, Some(6));
    let pool = tally::cache::pool(&env.redis)?;
    let mut conn = pool.get().await?;
    let key = format!("{}:d:sparse", env.redis.prefix);
    let mut fields = fields_of(&mut conn, &key).await?;
    fields.retain(|f| f.starts_with("s:"));
    fields.sort();
    assert_eq!(
        fields,
        ["s:1", "s:2"],
        "a field for each bucket that is not empty"
    );

    // Bucket 0's first write, through: one like.
    let ann = UserId::parse("ann")?;
    let ann_row = [(
        ann.clone(),
        tally::domain::Applied {
            version: 1,
            state: Reaction::Like,
        },
    )];
    let first = Written {
        buckets: four,
        bucket: Bucket::FIRST,
        seq: 1,
        totals: likes(1),
        users: &ann_row,
        ahead: &[],
    };
    cache.write_through(&target, &first).await?;
    assert_eq!(served_likes(&cache, &target).await?, Some(7));
    // A fill read before that write arrives after it.
    fill(
        &cache,
        &target,
        &Heads(vec![
            head(None, 0),
            head(Some(3), 2),
            head(None, 4),
            head(None, 0),
        ]),
    )
    .await?;
    assert_eq!(
        served_likes(&cache, &target).await?,
        Some(7),
        "the stale fill keeps bucket 0's write"
    );
    // A vote's change in bucket 3, ahead of the consumer.
    let bob = UserId::parse("bob")?;
    count_first_like(&cache, &target, &bob, four).await?;
    assert_eq!(served_likes(&cache, &target).await?, Some(8));
    Ok(())
}

/// A read misses and reads the durable heads; meanwhile a vote is counted
/// and written through; then the entry is dropped (a DEL after Redis
/// refused a change; an eviction, a flush or a restart drops it the same
/// way), and that write's base goes with it. Landing now, the miss's fill
/// would serve its older heads until the bucket's next write or the TTL.
/// Its fence went with the entry, so it is not written, and the next read
/// is served the vote. A vote's own fill is fenced the same way.
#[tokio::test]
async fn a_fill_read_before_a_drop_that_took_a_newer_write_is_not_written_after_it() -> TestResult {
    use tally::cache::{Cache, Counted};
    use tally::domain::{TargetId, UserId};

    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let consumer = env.start_consumer();
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?;
    let target = TargetId::parse("dropped")?;
    let key = format!("{}:d:dropped", env.redis.prefix);
    let pool = tally::cache::pool(&env.redis)?;
    let durable_likes = async || -> Option<i64> {
        let heads = store.stats.heads(&target).await.ok()?;
        Some(heads.totals().get(Reaction::Like))
    };
    let like = async |user: &str| {
        let reply = app.vote(user, new_key(), "dropped", "like").await;
        assert_eq!(reply.status, 200, "{user}: {}", reply.body);
    };
    like("ann").await;
    eventually("ann's like counted", Duration::from_secs(30), || async {
        (durable_likes().await? == 1).then_some(())
    })
    .await;

    // A reader misses: it arms the fence, then reads the heads.
    cache.invalidate(&target).await?;
    let fences = cache.arm_many(&[&target]).await?;
    let mut conn = pool.get().await?;
    let ttl: i64 = redis::cmd("TTL").arg(&key).query_async(&mut conn).await?;
    assert!(ttl > 0, "an entry armed from nothing expires: TTL {ttl}");
    let read = store.stats.heads(&target).await?;
    assert_eq!(read.totals().get(Reaction::Like), 1);

    // bob's like is counted and written through before that fill lands:
    // the entry serves 2 with no pending change left.
    like("bob").await;
    eventually(
        "bob's like counted and written through",
        Duration::from_secs(30),
        || async {
            let mut conn = pool.get().await.ok()?;
            let fields = fields_of(&mut conn, &key).await.ok()?;
            let pending = fields.iter().any(|f| f.starts_with("p:"));
            let served = served_likes(&cache, &target).await.ok()??;
            (served == 2 && !pending).then_some(())
        },
    )
    .await;

    cache.invalidate(&target).await?;
    let landed = cache.fill(&target, &fences[0], &read).await?;
    assert_eq!(landed, None, "a fill whose fence went with its entry");
    assert_eq!(
        served_likes(&cache, &target).await?,
        None,
        "nothing written"
    );
    let reply = app.summary("reader", "dropped").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["items"]["dropped"]["likes"],
        2,
        "{}",
        reply.body
    );

    // A vote's cache step on a missing entry arms the fence, reads the
    // heads, and fills under it; an entry dropped in between is left alone.
    cache.invalidate(&target).await?;
    let cid = UserId::parse("cid")?;
    let change = first_like(&cid);
    let deadline = cache.change_deadline();
    let first = cache
        .apply(&target, &change, store.layout, None, deadline)
        .await?;
    let Counted::NeedsHeads(fence) = first else {
        anyhow::bail!("a missing entry's change asked for no heads: {first:?}");
    };
    cache.invalidate(&target).await?;
    let second = cache
        .apply(
            &target,
            &change,
            store.layout,
            Some((&fence, &read)),
            deadline,
        )
        .await?;
    assert_eq!(second, Counted::Dropped);
    assert_eq!(
        served_likes(&cache, &target).await?,
        None,
        "nothing written"
    );
    consumer.stop().await;
    let reply = app.summary("reader", "dropped").await;
    assert_eq!(
        reply.json()["items"]["dropped"]["likes"],
        2,
        "{}",
        reply.body
    );
    Ok(())
}

/// Reconcile counts a voter's row before the vote's own cache step has run,
/// and marks the user so that the step does not count them again. A drop
/// then takes the entry and the mark, and the late step counts the like on
/// top of heads that count it already, whether it fills the entry itself or
/// a reader filled it first. The consumer, taking the vote's transition,
/// finds it counted and takes that pending change out, whether its round
/// writes nothing or writes another voter of the bucket: once it has
/// drained, the summary serves the like once.
#[tokio::test]
async fn a_votes_late_cache_step_after_a_drop_is_served_once_when_the_consumer_drains() -> TestResult
{
    use tally::cache::Cache;
    use tally::domain::{TargetId, UserId};

    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let store = Arc::new(tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?);
    let counts = tally::counts::Counts::new(cache.clone(), store.clone());
    let ann = UserId::parse("ann")?;
    let change = first_like(&ann);
    let served = async |id: &str| {
        let reply = app.summary("reader", id).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["items"][id]["likes"].as_i64()
    };
    // A voter whose row lives in ann's bucket: their transition and hers
    // are counted in one round, which writes theirs and finds hers counted.
    let (ann_bucket, _) = env.place_of("ann");
    let neighbour = (0..1_000)
        .map(|i| format!("n{i}"))
        .find(|u| env.place_of(u).0 == ann_bucket)
        .ok_or_else(|| anyhow::anyhow!("no user in ann's bucket"))?;
    let ids = ["ahead", "refilled", "with_neighbour"];
    for id in ids {
        let target = TargetId::parse(id)?;
        // ann's like commits; nothing counts it durably yet.
        let reply = app.vote("ann", new_key(), id, "like").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        env.reconciler().await.target(&target, false).await?;
        assert_eq!(store.stats.totals(&target).await?.get(Reaction::Like), 1);
        cache.invalidate(&target).await?;
        if id == "refilled" {
            assert_eq!(served(id).await, Some(1), "a reader refills {id}");
        }
        // Her vote's cache step comes only now, and counts her again.
        counts.apply_committed(&target, &change).await;
        assert_eq!(served_likes(&cache, &target).await?, Some(2), "{id}");
        if id == "with_neighbour" {
            let reply = app.vote(&neighbour, new_key(), id, "like").await;
            assert_eq!(reply.status, 200, "{}", reply.body);
        }
    }
    let expected = |id: &str| if id == "with_neighbour" { 2 } else { 1 };

    let consumer = env.start_consumer();
    for id in ids {
        eventually(
            &format!("{id} served once the consumer has her transition"),
            Duration::from_secs(30),
            || async { (served(id).await == Some(expected(id))).then_some(()) },
        )
        .await;
    }
    consumer.stop().await;
    for id in ids {
        assert_eq!(served(id).await, Some(expected(id)), "{id}");
    }
    Ok(())
}

/// A replayed round finds its user counted, writes nothing, and takes the
/// user's pending change out of the entry if the base there counts it.
/// Another writer landing between that round's reads and its second read of
/// the head leaves a head newer than the one the round read: the round
/// settles against the newer head, which counts its rows too, or, if that
/// writer's write through has not come (or never will), drops the entry.
/// Driven step by step on the real stores, with the other writer landing
/// inside the round, so the interleaving is certain.
#[tokio::test]
async fn a_round_that_settles_while_another_writer_moves_the_head_still_takes_its_change_out()
-> TestResult {
    use tally::cache::Cache;
    use tally::domain::{Reaction, TargetId, UserId};
    use tally::fence::{Ending, Fold, Read, Step};
    use tally::store::stats::Stats;

    /// The replayed round: its user is counted, and before it settles
    /// another writer of the bucket lands, writing through to `through`.
    struct CountedWhileMoved<'a> {
        stats: &'a Stats,
        through: Option<&'a Cache>,
        user: &'a UserId,
    }
    impl Fold for CountedWhileMoved<'_> {
        async fn fold(
            &mut self,
            target: &TargetId,
            read: Read,
        ) -> Result<Step, tally::store::StoreError> {
            let counted = read.applied.get(self.user);
            assert_eq!(
                counted.map(|a| (a.version, a.state)),
                Some((1, Reaction::Like))
            );
            let bucket = self.stats.bucket_of(self.user);
            let moved = tally::fence::write(
                self.stats,
                self.through,
                (target, bucket),
                &[],
                &mut MoveFence,
            )
            .await?;
            assert_eq!(moved.ending, Ending::Written);
            Ok(Step::Settled)
        }
    }

    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let store = Arc::new(tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?);
    let ann = UserId::parse("ann")?;
    let bucket = store.stats.bucket_of(&ann);

    // Where the other writer's write through went, and what the entry then
    // serves: her like once, or nothing (dropped, refilled by the next read).
    for (id, through, entry) in [("moved", Some(&cache), Some(1)), ("moved_bare", None, None)] {
        let target = TargetId::parse(id)?;
        // ann's like commits, and her vote's cache step leaves it pending.
        let reply = app.vote("ann", new_key(), id, "like").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(served_likes(&cache, &target).await?, Some(1));
        // A writer without Redis counts her durably: nothing takes her change out.
        tally::reconcile::Reconciler::new(store.clone(), None)
            .target(&target, false)
            .await?;
        assert_eq!(store.stats.totals(&target).await?.get(Reaction::Like), 1);
        assert_eq!(served_likes(&cache, &target).await?, Some(1));
        // Another writer's write through gives the entry a base that counts
        // her, and takes out only its own users' changes.
        tally::fence::write(
            &store.stats,
            Some(&cache),
            (&target, bucket),
            &[],
            &mut MoveFence,
        )
        .await?;
        assert_eq!(
            served_likes(&cache, &target).await?,
            Some(2),
            "{id}: her change pending beside a base that counts it"
        );

        let mut replay = CountedWhileMoved {
            stats: &store.stats,
            through,
            user: &ann,
        };
        let settled = tally::fence::write(
            &store.stats,
            Some(&cache),
            (&target, bucket),
            &[&ann],
            &mut replay,
        )
        .await?;
        assert_eq!(settled.ending, Ending::Settled);
        assert_eq!(served_likes(&cache, &target).await?, entry, "{id}");
        let reply = app.summary("reader", id).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            reply.json()["items"][id]["likes"],
            1,
            "{id}: {}",
            reply.body
        );
    }
    Ok(())
}

/// A read's miss filling `target`'s entry with `heads`, its fence armed
/// first, as a reader armed it.
async fn fill(
    cache: &tally::cache::Cache,
    target: &tally::domain::TargetId,
    heads: &tally::store::stats::Heads,
) -> anyhow::Result<()> {
    let fences = cache.arm_many(&[target]).await?;
    let filled = cache.fill(target, &fences[0], heads).await?;
    anyhow::ensure!(filled.is_some(), "the fill found its fence gone");
    Ok(())
}

/// `user`'s first like (row version 1), as a vote's cache step counts it.
fn first_like(user: &tally::domain::UserId) -> tally::cache::Pending<'_> {
    tally::cache::Pending {
        user,
        version: 1,
        from: Reaction::None,
        to: Reaction::Like,
    }
}

/// A vote's cache step for `user`'s first like (row version 1), ahead of
/// the consumer.
async fn count_first_like(
    cache: &tally::cache::Cache,
    target: &tally::domain::TargetId,
    user: &tally::domain::UserId,
    layout: tally::domain::Layout,
) -> anyhow::Result<()> {
    cache
        .apply(
            target,
            &first_like(user),
            layout,
            None,
            cache.change_deadline(),
        )
        .await?;
    Ok(())
}

/// The API and the consumer, both on the Redis at `url`, each call to it
/// bounded by `timeout`.
async fn on_redis(
    env: &TestEnv,
    url: &str,
    timeout: Duration,
) -> (crate::support::TestApp, crate::support::RunningConsumer) {
    let mut config = env.api_config();
    config.stores.redis.url = url.to_owned();
    config.stores.redis.timeout = timeout;
    let app = env.spawn_app_with(config).await;
    let mut consumer = env.consumer_config();
    consumer.stores.redis.url = url.to_owned();
    consumer.stores.redis.timeout = timeout;
    (app, env.start_consumer_with(consumer))
}

/// The names of a cache entry's fields, as Redis holds them.
async fn fields_of(
    conn: &mut impl redis::aio::ConnectionLike,
    key: &str,
) -> redis::RedisResult<Vec<String>> {
    redis::cmd("HKEYS").arg(key).query_async(conn).await
}

/// The likes an entry serves, if it serves any.
async fn served_likes(
    cache: &tally::cache::Cache,
    target: &tally::domain::TargetId,
) -> anyhow::Result<Option<i64>> {
    let got = cache.get_many(std::slice::from_ref(target)).await?;
    Ok(got
        .first()
        .copied()
        .flatten()
        .map(|t| t.get(Reaction::Like)))
}

/// A Redis at its `maxmemory`, under the default `noeviction`, answers
/// reads and refuses every write: the votes' cache steps and the
/// consumer's writes through. An entry they could not move would serve
/// its old count until it expired. Once the pipeline drains, the served
/// count is the truth all the same, and so it stays when Redis takes
/// writes again.
#[tokio::test]
async fn a_redis_that_refuses_writes_for_want_of_memory_serves_the_votes_it_refused() -> TestResult
{
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let (app, consumer) = on_redis(&env, &url, env.redis.timeout).await;
    let served = async || totals_served(&app, "full").await;
    let like = |n: usize| Totals::count(std::iter::repeat_n(Reaction::Like, n));
    let vote = async |user: &str, action: &str| {
        let reply = app.vote(user, new_key(), "full", action).await;
        assert_eq!(reply.status, 200, "{user} {action}: {}", reply.body);
    };
    vote("ida", "like").await;
    eventually("the first like served", Duration::from_secs(30), || async {
        (served().await? == like(1)).then_some(())
    })
    .await;

    let client = redis::Client::open(url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let maxmemory = async |bytes: &str| -> redis::RedisResult<()> {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query_async(&mut conn)
            .await
    };
    let served_as = async |what: &str, likes: usize| {
        eventually(what, Duration::from_secs(20), || async {
            (served().await? == like(likes)).then_some(())
        })
        .await
    };
    maxmemory("1").await?;
    let refused: redis::RedisResult<()> = redis::cmd("SET")
        .arg("probe")
        .arg("x")
        .query_async(&mut conn)
        .await;
    assert!(
        refused.as_ref().is_err_and(|e| e.code() == Some("OOM")),
        "Redis still takes writes: {refused:?}"
    );
    vote("jon", "like").await;
    vote("kim", "like").await;
    vote("ida", "none").await;
    served_as(
        "the served count to follow the votes Redis would not store",
        2,
    )
    .await;
    let metrics = crate::ops::scrape(&app.client, &format!("{}/metrics", app.ops)).await;
    let refused = crate::ops::sample_sum(
        &metrics,
        "tally_cache_writes_refused_total",
        &["step=\"vote\""],
    );
    assert!(
        refused.is_some_and(|n| n >= 3.0),
        "the three votes' refused cache steps counted: {refused:?}"
    );

    maxmemory("0").await?;
    vote("lea", "like").await;
    served_as("the served count once Redis takes writes again", 3).await;
    consumer.stop().await;
    let truth = env.recount().await;
    assert_eq!(
        truth.get("full").map(|t| t.totals).unwrap_or_default(),
        like(3)
    );
    assert_eq!(served().await, Some(like(3)));
    Ok(())
}

#[tokio::test]
async fn a_redis_frozen_while_the_consumer_counts_serves_the_truth_soon_after_it_thaws()
-> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let (app, consumer) = on_redis(&env, &url, Duration::from_millis(300)).await;
    // The votes' cache steps go to a Redis of their own, so that only the
    // consumer's drops can bring the served entry up to date: the vote API
    // owes drops of its own for the steps a frozen Redis does not take (see
    // `a_consumer_killed_while_it_owes_drops_leaves_no_entry_behind`).
    let elsewhere = PrivateRedis::start(free_port());
    let mut config = env.api_config();
    config.stores.redis.url = format!("redis://127.0.0.1:{}", elsewhere.port);
    let voter = env.spawn_app_with(config).await;
    let served = async || totals_served(&app, "frozen").await;
    let first = voter.vote("ida", new_key(), "frozen", "like").await;
    assert_eq!(first.status, 200, "{}", first.body);
    let one_like = Totals::count([Reaction::Like]);
    eventually("the first like served", Duration::from_secs(30), || async {
        (served().await? == one_like).then_some(())
    })
    .await;

    // Frozen, Redis holds the entry at one like and takes nothing: the
    // consumer's writes through of the dislikes it counts durably run out
    // their deadlines.
    redis.freeze();
    let voters = ["f1", "f2", "f3", "f4", "f5", "f6"];
    for user in voters {
        let reply = voter.vote(user, new_key(), "frozen", "dislike").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    eventually(
        "the consumer to be past the dislikes' writes through",
        Duration::from_secs(60),
        || async { (consumer.processed() > voters.len() as u64).then_some(()) },
    )
    .await;
    redis.thaw();

    // Well within the entry's TTL (60 s), which is what would end a base
    // left behind by the lost writes through.
    serves_a_like_and_the_dislikes_after_the_thaw(&env, "frozen", &voters, served).await;
    consumer.stop().await;
    Ok(())
}

/// Polls for 15 s until `served` answers one like and a dislike of each
/// voter, and checks that the durable recount of `target` says the same.
async fn serves_a_like_and_the_dislikes_after_the_thaw(
    env: &TestEnv,
    target: &str,
    voters: &[&str],
    served: impl AsyncFn() -> Option<Totals>,
) {
    let truth = Totals::count(
        std::iter::once(Reaction::Like).chain(voters.iter().map(|_| Reaction::Dislike)),
    );
    eventually(
        "the served count to catch up with the durable one after the thaw",
        Duration::from_secs(15),
        || async { (served().await? == truth).then_some(()) },
    )
    .await;
    assert_eq!(
        env.recount()
            .await
            .get(target)
            .map(|t| t.totals)
            .unwrap_or_default(),
        truth
    );
}

/// The vote API on `redis`, whose calls there time out after 300 ms, and
/// that Redis's URL.
async fn api_on_redis_of_its_own(
    env: &TestEnv,
    redis: &PrivateRedis,
) -> (crate::support::TestApp, String) {
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let mut config = env.api_config();
    config.stores.redis.url = url.clone();
    config.stores.redis.timeout = Duration::from_millis(300);
    (env.spawn_app_with(config).await, url)
}

/// `tally consumer` as a process of the test's on the Redis at `url` (its
/// calls time out after 300 ms), serving its /metrics on `ops`.
fn consumer_process(env: &TestEnv, url: &str, ops: u16) -> std::io::Result<Proc> {
    Ok(Proc(
        env.tally()
            .arg("consumer")
            .env("TALLY_REDIS_URL", url)
            .env("TALLY_REDIS_TIMEOUT", "300ms")
            .env("TALLY_CONSUMER_LISTEN", format!("127.0.0.1:{ops}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    ))
}

/// Ida likes `target`; returns once it is counted durably and `served`.
async fn a_like_counted_and_served(
    env: &TestEnv,
    app: &crate::support::TestApp,
    target: &str,
    served: &impl AsyncFn() -> Option<Totals>,
) {
    let reply = app.vote("ida", new_key(), target, "like").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let one_like = Totals::count([Reaction::Like]);
    eventually("the first like served", Duration::from_secs(30), || async {
        (served().await? == one_like).then_some(())
    })
    .await;
}

/// The totals `GET /v1/votes/summary` serves for `target`, if it answers
/// with them.
async fn totals_served(app: &crate::support::TestApp, target: &str) -> Option<Totals> {
    let summary = app.summary("reader", target).await.json();
    serde_json::from_value::<Totals>(summary["items"][target].clone()).ok()
}

/// The sum of a metric's samples on the /metrics served on `ops`, if it
/// answers and has them.
async fn metric_at(client: &reqwest::Client, ops: u16, name: &str) -> Option<f64> {
    let metrics = client
        .get(format!("http://127.0.0.1:{ops}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    crate::ops::sample_sum(&metrics, name, &[])
}

/// The consumer's drops owed live in its memory, and die with it. Here the
/// votes' own cache steps and the consumer's writes through both time out
/// on a frozen Redis, and the consumer is killed with -9 before Redis
/// thaws: no write through will reach the entry it left at one like. The
/// vote API owes a drop for every step Redis did not take, so the entry
/// goes and the next read fills it from the durable totals, long before
/// its TTL (60 s) would end it.
#[tokio::test]
async fn a_consumer_killed_while_it_owes_drops_leaves_no_entry_behind() -> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let (app, url) = api_on_redis_of_its_own(&env, &redis).await;
    let ops = free_port();
    let mut consumer = consumer_process(&env, &url, ops)?;
    let owed = async || metric_at(&app.client, ops, "tally_cache_drops_owed").await;
    let served = async || totals_served(&app, "killed").await;
    a_like_counted_and_served(&env, &app, "killed", &served).await;

    redis.freeze();
    let voters = ["k1", "k2", "k3", "k4", "k5", "k6"];
    for user in voters {
        let reply = app.vote(user, new_key(), "killed", "dislike").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    eventually(
        "the consumer to owe the entry a drop",
        Duration::from_secs(60),
        || async { owed().await.filter(|&n| n >= 1.0) },
    )
    .await;
    consumer.kill9();
    redis.thaw();
    serves_a_like_and_the_dislikes_after_the_thaw(&env, "killed", &voters, served).await;
    Ok(())
}

/// Votes whose cache steps land leave pending changes in the entry, until
/// the consumer's write through takes them into its base. Here the
/// consumer's write through times out on a frozen Redis, and the consumer is
/// killed with -9 while it owes the entry a drop; the API owes none, since
/// its steps landed. The entry then holds a base without the dislikes and
/// the dislikes pending: right, until the bucket's next write through gives
/// it a base that counts them while they are still pending. The consumer
/// stores a batch's offsets only once the drops its writes owe are sent, so
/// the next consumer counts the dislikes again, finds them counted, and
/// drops the entry behind the head or takes out what it counts.
#[tokio::test]
async fn a_consumer_killed_while_it_owes_drops_leaves_its_batch_to_be_replayed() -> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let (app, url) = api_on_redis_of_its_own(&env, &redis).await;
    let ops = free_port();
    let mut first = consumer_process(&env, &url, ops)?;
    let metric = async |name: &str| metric_at(&app.client, ops, name).await;
    let served = async || totals_served(&app, "replayed").await;
    a_like_counted_and_served(&env, &app, "replayed", &served).await;

    // The dislikes' cache steps land while the consumer cannot count them.
    assert!(
        signal("-STOP", first.0.id()),
        "could not pause the consumer"
    );
    let voters = ["r1", "r2", "r3", "r4", "r5", "r6"];
    for user in voters {
        let reply = app.vote(user, new_key(), "replayed", "dislike").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let pending = Totals::count(
        std::iter::once(Reaction::Like).chain(voters.iter().map(|_| Reaction::Dislike)),
    );
    assert_eq!(served().await, Some(pending), "the steps landed");
    redis.freeze();
    assert!(
        signal("-CONT", first.0.id()),
        "could not resume the consumer"
    );
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    eventually(
        "the consumer to owe the entry a drop",
        Duration::from_secs(60),
        || async { metric("tally_cache_drops_owed").await.filter(|&n| n >= 1.0) },
    )
    .await;
    // The dislikes' offsets are decided: committed (the group's lag is
    // nothing) or held for the drop, as `tally status` tells an operator.
    let consumer_ops = format!("http://127.0.0.1:{ops}");
    eventually(
        "the group to commit the dislikes or the consumer to hold them",
        Duration::from_secs(30),
        || async {
            let out = env.status(&app.ops, &consumer_ops, "100ms").ok()?;
            let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let lag = status["lag"].as_array()?;
            let committed = !lag.is_empty() && lag.iter().all(|l| l["messages"] == 0);
            let held = status["batches_held"].as_f64()? >= 1.0
                && status["drops_owed_consumer"].as_f64()? >= 1.0;
            (committed || held).then_some(())
        },
    )
    .await;
    first.kill9();
    redis.thaw();

    // The next consumer, and a later dislike in r1's bucket: its write
    // through gives that bucket's base every dislike of the bucket.
    let _next = consumer_process(&env, &url, free_port())?;
    let late = (0..)
        .map(|i| format!("late{i}"))
        .find(|u| env.place_of(u).0 == env.place_of("r1").0)
        .unwrap_or_default();
    let reply = app.vote(&late, new_key(), "replayed", "dislike").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    let mut voters = voters.to_vec();
    voters.push(&late);
    serves_a_like_and_the_dislikes_after_the_thaw(&env, "replayed", &voters, served).await;
    Ok(())
}

/// A key of the prefix that is not a hash (something else wrote it) made
/// every read of a page holding its id fail whole, its fills too: each such
/// page read all its ids from Cassandra, for as long as the key lived. The
/// first page that meets it drops it, and the pages after it fill and hit.
#[tokio::test]
async fn a_key_that_is_not_an_entry_is_dropped_by_the_first_page_that_meets_it() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let mut conn = redis::Client::open(env.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let (junk, plain) = (
        format!("{}:d:junk", env.redis.prefix),
        format!("{}:d:plain", env.redis.prefix),
    );
    let _: () = redis::cmd("SET")
        .arg(&junk)
        .arg("not an entry")
        .query_async(&mut conn)
        .await?;

    let nothing = Totals::default();
    let page = async || {
        let reply = app.summary("reader", "junk,plain").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let items = &reply.json()["items"];
        for id in ["junk", "plain"] {
            let totals: Totals = serde_json::from_value(items[id].clone())
                .unwrap_or_else(|e| panic!("{id}: {e} in {}", reply.body));
            assert_eq!(totals, nothing, "{id}");
        }
    };
    page().await;
    let kind = async |key: &str| -> redis::RedisResult<String> {
        redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
    };
    eventually(
        "both ids of the page filled as entries",
        Duration::from_secs(10),
        || async {
            page().await;
            (kind(&junk).await.ok()? == "hash" && kind(&plain).await.ok()? == "hash").then_some(())
        },
    )
    .await;
    Ok(())
}

#[tokio::test]
async fn more_entries_owed_a_drop_than_are_remembered_drop_every_entry_once_redis_answers()
-> TestResult {
    use tally::cache::{Cache, RedisConfig, Written};
    use tally::domain::{Bucket, Layout, TargetId};

    let redis = PrivateRedis::start(free_port());
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let mut config = RedisConfig::local("owed");
    config.url = url.clone();
    config.timeout = Duration::from_millis(300);
    let cache = Cache::new(&config, Duration::from_secs(60))?.remembering_drops(1);
    let one = Layout::new(1)?;
    let written = |seq| Written {
        buckets: one,
        bucket: Bucket::FIRST,
        seq,
        totals: Totals::count([Reaction::Like]),
        users: &[],
        ahead: &[],
    };
    let targets = [
        TargetId::parse("a")?,
        TargetId::parse("b")?,
        TargetId::parse("c")?,
    ];
    let head = tally::store::stats::Head {
        seq: Some(1),
        totals: Totals::count([Reaction::Like]),
        target_type: None,
    };
    for target in &targets {
        eventually("Redis to take a fill", Duration::from_secs(10), || async {
            fill(&cache, target, &tally::store::stats::Heads(vec![head]))
                .await
                .ok()
        })
        .await;
    }
    let mut conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    // Another deployment's entry, in the same Redis.
    let _: () = redis::cmd("SET")
        .arg("other:d:a")
        .arg("x")
        .query_async(&mut conn)
        .await?;

    redis.freeze();
    for target in &targets[..2] {
        assert!(cache.write_through(target, &written(2)).await.is_err());
    }
    assert!(cache.owes_drops());
    redis.thaw();

    eventually("the drops owed sent", Duration::from_secs(10), || async {
        cache.drop_owed().await.ok()
    })
    .await;
    assert!(!cache.owes_drops());
    let conn = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let exists = async |key: &str| -> redis::RedisResult<bool> {
        redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
    };
    for target in ["a", "b", "c"] {
        assert!(
            !exists(&format!("owed:d:{target}")).await?,
            "{target}: one entry more than remembered drops them all"
        );
    }
    assert!(exists("other:d:a").await?, "another prefix's entry is kept");
    Ok(())
}

/// A durable write can land without its write through: a writer that runs
/// without Redis (reconcile, when it cannot reach it), one killed between
/// the two, one whose write timed out and landed anyway. The consumer's
/// round for that transition then finds it counted and writes nothing, and
/// the entry would serve the older base until the bucket's next write or
/// the TTL.
#[tokio::test]
async fn a_count_that_landed_without_its_write_through_is_served_once_the_consumer_has_it()
-> TestResult {
    use tally::cache::Cache;
    use tally::domain::TargetId;

    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let store = Arc::new(tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?);
    let target = TargetId::parse("unwritten")?;
    let served = async || {
        let reply = app.summary("reader", "unwritten").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["items"]["unwritten"]["likes"].as_i64()
    };
    let reply = app.vote("ann", new_key(), "unwritten", "like").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // Her change out of the entry, as a drop takes it; the refill has
    // nothing counted durably yet.
    cache.invalidate(&target).await?;
    assert_eq!(served().await, Some(0));
    // Counted durably by a writer with no cache: nothing written through.
    tally::reconcile::Reconciler::new(store.clone(), None)
        .target(&target, false)
        .await?;
    assert_eq!(store.stats.totals(&target).await?.get(Reaction::Like), 1);
    assert_eq!(
        served().await,
        Some(0),
        "the entry is behind the durable totals"
    );

    let consumer = env.start_consumer();
    eventually(
        "the like served once the consumer has her transition",
        Duration::from_secs(15),
        || async { (served().await == Some(1)).then_some(()) },
    )
    .await;
    consumer.stop().await;
    assert_eq!(served().await, Some(1));
    Ok(())
}

/// A vote whose write timed out learns its outcome by a SERIAL read, which
/// can take until its deadline (a replica paused). Meanwhile the same user
/// votes again from another tab, and that later vote's event is counted
/// first, past the version the consumer never counted. The earlier vote's
/// cache step then comes, and its process dies before it publishes (here:
/// its Kafka and Redis unreachable, its step made by the test once the
/// later version is counted).
/// The write that counted past the gap marked the user, so the late step
/// counts nothing; before, the summary served the like that had been
/// taken back until a later write found the change 30 s old, or the TTL.
#[tokio::test]
async fn a_late_cache_step_of_a_vote_a_later_one_was_counted_past_counts_nothing() -> TestResult {
    use tally::cache::{Cache, Pending};
    use tally::domain::{TargetId, UserId};

    let env = TestEnv::new().await;
    let mut stalled = env.api_config();
    stalled.stores.kafka.brokers = format!("127.0.0.1:{}", free_port());
    stalled.publish_timeout = Duration::from_millis(500);
    stalled.stores.redis.url = format!("redis://127.0.0.1:{}", free_port());
    let stalled = env.spawn_app_with(stalled).await;
    let app = env.spawn_app().await;
    let counts = tally::counts::Counts::new(
        Cache::new(&env.redis, Duration::from_secs(60))?,
        Arc::new(tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?),
    );
    let (vera, target) = (UserId::parse("vera")?, TargetId::parse("gapped")?);
    let served = async || {
        let reply = app.summary("reader", "gapped").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()["items"]["gapped"]["likes"].as_i64()
    };

    let like = stalled.vote("vera", new_key(), "gapped", "like").await;
    assert_eq!(like.status, 200, "{}", like.body);
    assert_eq!(served().await, Some(0), "nothing has counted the like");
    let consumer = env.start_consumer();
    let undo = app.vote("vera", new_key(), "gapped", "none").await;
    assert_eq!(undo.status, 200, "{}", undo.body);
    assert_eq!(
        env.reaction("vera", "gapped").await,
        Some(("none".into(), 2))
    );
    eventually(
        "the consumer to count her second version",
        Duration::from_secs(30),
        || async { (consumer.processed() >= 1).then_some(()) },
    )
    .await;
    assert_eq!(served().await, Some(0));

    // The like's late cache step, seconds after its commit: well within the
    // longest a vote may take.
    let late_step = Pending {
        user: &vera,
        version: 1,
        from: Reaction::None,
        to: Reaction::Like,
    };
    counts.apply_committed(&target, &late_step).await;
    assert_eq!(served().await, Some(0), "the late step counted the like");

    env.wait_until_no_drift(Duration::from_secs(30)).await;
    consumer.stop().await;
    assert_eq!(served().await, Some(0));
    Ok(())
}

/// A Redis that comes back from a snapshot (or a replica promoted after it
/// missed the last writes through) holds entries older than writes whose
/// writes through it never saw, fence and all: no fill is wrong there,
/// the entry is.
#[tokio::test]
async fn a_redis_restarted_from_an_older_snapshot_serves_the_truth_soon_after() -> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start_keeping_snapshots(free_port());
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let (app, consumer) = on_redis(&env, &url, env.redis.timeout).await;
    let client = redis::Client::open(url.as_str())?;
    let entry = format!("{}:d:restored", env.redis.prefix);
    // Served, and held by the entry as its bases alone: every like written
    // through by the consumer, none pending. (A read that finds its
    // connection gone serves the durable totals, so the summary alone
    // could pass.)
    let served_from_bases = async |likes: usize| -> Option<()> {
        let summary = app.summary("reader", "restored").await.json();
        let served: Totals = serde_json::from_value(summary["items"]["restored"].clone()).ok()?;
        let expected = Totals::count(std::iter::repeat_n(Reaction::Like, likes));
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&entry)
            .query_async(&mut conn)
            .await
            .ok()?;
        let held = fields
            .get("v")?
            .split('|')
            .map(str::parse)
            .collect::<Result<Vec<i64>, _>>()
            .ok()?;
        let pending = fields.keys().any(|f| f.starts_with("p:"));
        (served == expected && held == expected.values() && !pending).then_some(())
    };
    let like = async |user: &str, likes: usize| {
        let reply = app.vote(user, new_key(), "restored", "like").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        eventually(
            &format!("{likes} served, {user}'s like written through"),
            Duration::from_secs(30),
            || served_from_bases(likes),
        )
        .await;
    };
    let run_key = format!("{}:run", env.redis.prefix);
    eventually(
        "the consumer to record which Redis it writes to",
        Duration::from_secs(30),
        || async {
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let run: Option<String> = redis::cmd("GET")
                .arg(&run_key)
                .query_async(&mut conn)
                .await
                .ok()?;
            run
        },
    )
    .await;
    like("ann", 1).await;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let _: () = redis::cmd("SAVE").query_async(&mut conn).await?;
    drop(conn);
    like("bob", 2).await;

    // Back from the snapshot: the entry holds ann's like only, and no
    // bucket sees another write.
    let _redis = redis.restart();
    eventually(
        "both likes served from the entry after the restart",
        Duration::from_secs(15),
        || served_from_bases(2),
    )
    .await;
    consumer.stop().await;
    assert_eq!(served_from_bases(2).await, Some(()));
    Ok(())
}

/// A write through that finds no entry writes no base: the read or vote
/// that fills the entry reads every bucket's head, this write's or newer,
/// and a write through that arrived after a drop (one that had timed out)
/// would otherwise make a one-bucket entry at a base older than the write
/// the drop took. Reconcile's marks are still written, so a vote's late
/// cache step is not counted on top of the fill.
#[tokio::test]
async fn a_write_through_that_finds_no_entry_writes_only_its_marks() -> TestResult {
    use tally::cache::{Cache, Counted, Written};
    use tally::domain::{Applied, Bucket, Layout, TargetId, UserId};
    use tally::store::stats::{Head, Heads};

    let env = TestEnv::new().await;
    let cache = Cache::new(&env.redis, Duration::from_secs(60))?;
    let pool = tally::cache::pool(&env.redis)?;
    let mut conn = pool.get().await?;
    let one = Layout::new(1)?;
    let ann = UserId::parse("ann")?;
    let users = [(
        ann.clone(),
        Applied {
            version: 1,
            state: Reaction::Like,
        },
    )];
    let ahead = [(ann.clone(), 1)];
    let written = |ahead| Written {
        buckets: one,
        bucket: Bucket::FIRST,
        seq: 2,
        totals: Totals::count([Reaction::Like]),
        users: &users,
        ahead,
    };

    let unmarked = TargetId::parse("unmarked")?;
    cache.write_through(&unmarked, &written(&[])).await?;
    let exists: bool = redis::cmd("EXISTS")
        .arg(format!("{}:d:unmarked", env.redis.prefix))
        .query_async(&mut conn)
        .await?;
    assert!(!exists, "no entry made for a base alone");

    let marked = TargetId::parse("marked")?;
    cache.write_through(&marked, &written(&ahead)).await?;
    let key = format!("{}:d:marked", env.redis.prefix);
    let fields = fields_of(&mut conn, &key).await?;
    assert_eq!(fields, ["c:ann"], "only the mark");
    // Nor does a write through that finds the marks alone.
    cache.write_through(&marked, &written(&[])).await?;
    let fields = fields_of(&mut conn, &key).await?;
    assert_eq!(fields, ["c:ann"], "still only the mark");
    let ttl: i64 = redis::cmd("TTL").arg(&key).query_async(&mut conn).await?;
    assert!(ttl > 0, "the mark expires: {ttl}");
    // ann's vote's cache step, late: it fills the entry from the heads,
    // which count her, and finds her marked.
    let change = first_like(&ann);
    let Counted::NeedsHeads(fence) = cache
        .apply(&marked, &change, one, None, cache.change_deadline())
        .await?
    else {
        anyhow::bail!("an entry without a base asks for the heads");
    };
    let heads = Heads(vec![Head {
        seq: Some(2),
        totals: Totals::count([Reaction::Like]),
        target_type: None,
    }]);
    cache
        .apply(
            &marked,
            &change,
            one,
            Some((&fence, &heads)),
            cache.change_deadline(),
        )
        .await?;
    assert_eq!(served_likes(&cache, &marked).await?, Some(1));
    Ok(())
}

/// An entry every page holds, missing (expired, or Redis back empty): the
/// pages that miss it at once are served by one read of its heads, not a
/// read each, and each serves the like. The gate holds every page's lookup
/// until all have sent theirs, so they miss together, as a crowd's do.
#[tokio::test]
async fn pages_that_miss_one_entry_together_read_its_heads_once_and_serve_the_truth() -> TestResult
{
    const PAGES: usize = 40;
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let link = GatedLink::start(redis.port, b"HGET").await;
    let url = format!("redis://127.0.0.1:{}", link.port);
    // A process of its own, so its /metrics count only this test's reads;
    // its Redis deadline outlasts the gate. One HTTP worker: a second one's
    // first connection to Redis would wait at the shut gate, and its pages
    // with it.
    let (_process, app) = env
        .spawn_vote_process(|cmd| {
            cmd.env("TALLY_REDIS_URL", &url)
                .env("TALLY_WORKERS", "1")
                .env("TALLY_REDIS_TIMEOUT", "8s")
                .env("TALLY_CASSANDRA_TIMEOUT_MS", "2000")
                .env("TALLY_RELAY_SETTLE", "3m");
        })
        .await?;
    let vote = app.vote("liker", new_key(), "crowded", "like").await;
    assert_eq!(vote.status, 200, "{}", vote.body);
    // Counted durably, so the heads hold the like; then every entry gone.
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(
            &mut redis::Client::open(format!("redis://127.0.0.1:{}", redis.port))?
                .get_multiplexed_async_connection()
                .await?,
        )
        .await?;
    let metrics = async || crate::ops::scrape(&app.client, &format!("{}/metrics", app.ops)).await;
    let fills = |text: &str, read: &str| {
        crate::ops::sample_sum(
            text,
            "tally_cache_fills_total",
            &[&format!("read=\"{read}\"")],
        )
        .unwrap_or(0.0)
    };
    let misses = |text: &str| {
        crate::ops::sample_sum(text, "tally_cache_lookups_total", &["result=\"miss\""])
            .unwrap_or(0.0)
    };
    let before = metrics().await;

    link.shut();
    let pages: Vec<_> = (0..PAGES)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { app.summary(&format!("reader{i}"), "crowded").await })
        })
        .collect();
    eventually(
        "every page's lookup held at the gate",
        Duration::from_secs(30),
        || async { (link.held() >= PAGES).then_some(()) },
    )
    .await;
    link.open();
    let one_like = Totals::count([Reaction::Like]);
    for page in pages {
        let reply = page.await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let served: Totals = serde_json::from_value(reply.json()["items"]["crowded"].clone())?;
        assert_eq!(served, one_like);
    }

    let after = metrics().await;
    let read = fills(&after, "buckets") - fills(&before, "buckets");
    let joined = fills(&after, "joined") - fills(&before, "joined");
    let looked_again = fills(&after, "cache") - fills(&before, "cache");
    assert_eq!(misses(&after) - misses(&before), PAGES as f64);
    // The pages wake together when the gate opens: one read, and a
    // straggler or two, is what sharing allows. Without it, every page
    // reads.
    assert!(
        read <= 4.0,
        "{read} reads of the heads for {PAGES} pages that missed together ({joined} joined)"
    );
    assert_eq!(read + joined + looked_again, PAGES as f64);
    Ok(())
}

/// The vote API owes a drop for every cache step a frozen Redis did not
/// take, shows it in `tally_cache_drops_owed`, and pays it once Redis
/// answers: the entry, left at one like, goes, and the next read fills it
/// from the durable totals, long before its TTL (60 s) would end it.
#[tokio::test]
async fn the_vote_api_shows_the_drops_it_owes_a_frozen_redis_and_pays_them_after_the_thaw()
-> TestResult {
    let env = TestEnv::new().await;
    let redis = PrivateRedis::start(free_port());
    let url = format!("redis://127.0.0.1:{}", redis.port);
    // A process of its own, so its /metrics are this test's alone. The
    // consumer writes through to the shared Redis, not to this one: only
    // the API's drops can bring this entry up to date.
    let (_process, app) = env
        .spawn_vote_process(|cmd| {
            cmd.env("TALLY_REDIS_URL", &url)
                .env("TALLY_REDIS_TIMEOUT", "300ms");
        })
        .await?;
    let consumer = env.start_consumer();
    let owed = async || {
        let text = crate::ops::scrape(&app.client, &format!("{}/metrics", app.ops)).await;
        crate::ops::sample_sum(&text, "tally_cache_drops_owed", &[])
    };
    let served = async || totals_served(&app, "owed").await;
    a_like_counted_and_served(&env, &app, "owed", &served).await;
    assert_eq!(
        owed().await.unwrap_or(0.0),
        0.0,
        "nothing owed while Redis answers"
    );

    redis.freeze();
    let voters = ["o1", "o2", "o3"];
    for user in voters {
        let reply = app.vote(user, new_key(), "owed", "dislike").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    eventually(
        "the vote API to owe the entry a drop",
        Duration::from_secs(30),
        || async { owed().await.filter(|&n| n >= 1.0) },
    )
    .await;
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    redis.thaw();

    eventually(
        "the vote API to pay what it owes",
        Duration::from_secs(15),
        || async { owed().await.filter(|&n| n == 0.0) },
    )
    .await;
    serves_a_like_and_the_dislikes_after_the_thaw(&env, "owed", &voters, served).await;
    consumer.stop().await;
    Ok(())
}
