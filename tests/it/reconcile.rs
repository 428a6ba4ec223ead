//! `tally reconcile` against the real stack: each kind of damage, dry runs,
//! an interrupted sweep over thousands of targets, and a loop racing votes.

use std::collections::HashMap;
use std::time::Duration;

use tally::domain::{Reaction, TargetId};

use anyhow::Context;

use crate::support::{MoveFence, Rng, TestEnv, TestResult, eventually, token};

fn target(s: &str) -> TargetId {
    TargetId::parse(s).unwrap_or_else(|e| panic!("{e}"))
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[tokio::test]
async fn overwritten_totals_are_restored_by_reconcile_target() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(1), 120, 30, 3).await;
    let truth = env.recount().await;

    env.cql(
        "UPDATE target_stats SET likes = 999, dislikes = 7 WHERE target_id = 't1' AND bucket = 0",
    )
    .await;
    // The target's stored totals: the damaged bucket's plus the others'.
    let damaged = env.stats().await["t1"].likes();
    assert!(damaged >= 999);
    let out = env
        .tally()
        .args(["reconcile", "--target", "t1", "--target", "t2", "--json"])
        .output()?;

    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = json_of(&out);
    assert_eq!(summary["targets_checked"], 2);
    assert_eq!(summary["targets_drifted"], 1);
    assert_eq!(summary["corrections"][0]["target_id"], "t1");
    assert_eq!(summary["corrections"][0]["totals_before"]["likes"], damaged);
    assert_eq!(
        summary["corrections"][0]["totals_after"]["likes"],
        truth["t1"].likes()
    );
    assert_eq!(env.stats().await, truth);
    Ok(())
}

#[tokio::test]
async fn a_deleted_user_row_is_recounted_not_off_by_one() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    app.vote("alice", crate::support::new_key(), "video_x", "like")
        .await;
    app.vote("bob", crate::support::new_key(), "video_x", "like")
        .await;
    app.vote("carol", crate::support::new_key(), "video_x", "dislike")
        .await;
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;

    // The totals still include alice, but her applied row is gone.
    let (bucket, token) = env.place_of("alice");
    env.cql(&format!(
        "DELETE FROM target_stats WHERE target_id = 'video_x' AND bucket = {bucket} \
         AND user_token = {token} AND user_id = 'alice'"
    ))
    .await;
    // No lag grace: alice voted seconds ago, and without her applied row
    // she would look in flight; the totals give the damage away regardless.
    let report = env
        .reconciler()
        .await
        .with_lag_grace(Duration::ZERO)
        .target(&target("video_x"), false)
        .await?;

    assert!(report.drifted && report.repaired, "{report:?}");
    assert_eq!(report.users_behind, 1);
    assert_eq!(
        (
            report.totals_after.get(Reaction::Like),
            report.totals_after.get(Reaction::Dislike)
        ),
        (2, 1),
        "not 3 likes"
    );
    assert_eq!(env.stats().await, env.recount().await);
    Ok(())
}

#[tokio::test]
async fn a_transition_committed_but_never_published_is_counted() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    app.vote("alice", crate::support::new_key(), "video_y", "like")
        .await;
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;

    // A vote whose process died between its commit and its publish.
    env.cql("UPDATE reactions SET state = 'dislike', version = 2 WHERE user_id = 'alice' AND target_id = 'video_y'").await;
    env.cql("INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES ('dan', 'video_y', 'video', 'like', 1)").await;
    assert_ne!(env.stats().await, env.recount().await);

    // No lag grace: the rows above changed seconds ago, and this test is
    // about what reconcile counts, not what it calls drift.
    let report = env
        .reconciler()
        .await
        .with_lag_grace(Duration::ZERO)
        .target(&target("video_y"), false)
        .await?;

    assert_eq!(report.users_behind, 2);
    assert_eq!(
        (
            report.totals_after.get(Reaction::Like),
            report.totals_after.get(Reaction::Dislike)
        ),
        (1, 1)
    );
    assert_eq!(env.stats().await, env.recount().await);
    // The event, published late after all, is now a replay.
    env.publish_transition("dan", "video_y", "none", "like", 1)
        .await;
    let consumer = env.start_consumer();
    eventually(
        "the late event to be processed",
        Duration::from_secs(60),
        || async { (consumer.processed() >= 1).then_some(()) },
    )
    .await;
    consumer.stop().await;
    assert_eq!(
        env.stats().await,
        env.recount().await,
        "the late event did not count twice"
    );
    Ok(())
}

#[tokio::test]
async fn a_dry_run_reports_drift_and_changes_nothing() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(2), 60, 20, 2).await;
    env.cql("UPDATE target_stats SET likes = 500 WHERE target_id = 't0' AND bucket = 2")
        .await;
    let damaged = env.stats().await;

    let out = env
        .tally()
        .args([
            "reconcile",
            "--target",
            "t0",
            "--dry-run",
            "--json",
            "--fail-on-drift",
        ])
        .output()?;

    assert_eq!(
        out.status.code(),
        Some(3),
        "--fail-on-drift exits 3 on drift"
    );
    let summary = json_of(&out);
    assert_eq!(summary["dry_run"], true);
    assert_eq!(summary["targets_drifted"], 1);
    assert_eq!(summary["corrections"][0]["repaired"], false);
    assert_eq!(env.stats().await, damaged, "a dry run wrote nothing");
    Ok(())
}

#[tokio::test]
async fn reconcile_all_finds_every_drifted_target_among_thousands_and_resumes_after_a_kill()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    // 2000 targets, one or two votes each.
    let mut rng = Rng(3);
    let n_targets = 2000;
    let plan: Vec<(String, String)> = (0..2400)
        .map(|i| (format!("u{}", rng.below(50)), format!("t{}", i % n_targets)))
        .collect();
    for chunk in plan.chunks(48) {
        let replies = futures::future::join_all(
            chunk
                .iter()
                .map(|(u, t)| app.vote(u, crate::support::new_key(), t, "like")),
        )
        .await;
        assert!(replies.iter().all(|r| r.status == 200));
    }
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(120)).await;
    consumer.stop().await;

    // Three kinds of damage on 30 targets.
    for i in 0..10 {
        env.cql(&format!(
            "UPDATE target_stats SET likes = 77 WHERE target_id = 't{}' AND bucket = {}",
            i * 197,
            i % 4
        ))
        .await;
        let (bucket, token) = env.place_of("u0");
        env.cql(&format!(
            "DELETE FROM target_stats WHERE target_id = 't{}' AND bucket = {bucket} \
             AND user_token = {token} AND user_id = 'u0'",
            i * 193 + 1,
        ))
        .await;
        env.cql(&format!(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES ('late', 't{}', 'video', 'dislike', 1)",
            i * 191 + 2
        ))
        .await;
    }
    let drifted: usize = {
        let (stats, truth) = (env.stats().await, env.recount().await);
        truth
            .iter()
            .filter(|(t, v)| stats.get(*t) != Some(*v))
            .count()
    };
    assert!(drifted >= 20, "the damage shows: {drifted} targets drifted");

    // Interrupt a slow sweep once it has saved a checkpoint.
    let mut first = env
        .tally()
        .args(["reconcile", "--all", "--rate", "300"])
        .spawn()?;
    let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?;
    let saved = eventually("a checkpoint", Duration::from_secs(60), || async {
        store
            .targets
            .checkpoint("all")
            .await
            .ok()
            .flatten()
            .filter(|c| c.checked >= 200)
    })
    .await;
    first.kill()?;
    let _ = first.wait();

    let out = env
        .tally()
        .args(["reconcile", "--all", "--rate", "0", "--json"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = json_of(&out);
    assert_eq!(summary["complete"], true);
    assert!(
        summary["resumed_from_token"].is_i64(),
        "the second run resumed: {summary}"
    );
    let second = summary["targets_checked"].as_u64().unwrap_or(0);
    assert!(
        second < n_targets as u64,
        "resumed, not restarted: checked {second}"
    );
    assert!(
        second + saved.checked as u64 >= n_targets as u64,
        "together the runs covered every target"
    );
    assert_eq!(
        env.stats().await,
        env.recount().await,
        "every drifted target was repaired"
    );
    assert_eq!(
        store.targets.checkpoint("all").await.ok().flatten(),
        None,
        "a complete sweep clears its checkpoint"
    );
    Ok(())
}

#[tokio::test]
async fn reconcile_in_a_loop_while_votes_and_the_consumer_run_ends_with_zero_drift() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let consumer = env.start_consumer();
    let reconciler = env.reconciler().await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sweeping = tokio::spawn(async move {
        let options = tally::reconcile::SweepOptions {
            name: "loop".into(),
            rate: 0.0,
            dry_run: false,
            restart: true,
            page_size: 50,
        };
        let mut rounds = 0u32;
        while !*stop_rx.borrow() {
            reconciler
                .sweep(&options, &stop_rx, |_| {})
                .await
                .context("sweep")?;
            rounds += 1;
        }
        anyhow::Ok(rounds)
    });

    assert_eq!(app.random_votes(&mut Rng(5), 500, 30, 15, 16).await, 500);
    let _ = stop_tx.send(true);
    let rounds = sweeping.await??;
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    consumer.stop().await;
    assert!(rounds >= 1, "reconcile ran while votes flowed");
    Ok(())
}

/// Checks of a target the consumer keeps writing find no drift: a check
/// whose bucket moved between its head and its rows compared totals and
/// rows of two different moments. A dry run took that for damaged totals,
/// and a repair whose write was then refused kept saying so, so the
/// monitor paged on a busy target that had nothing wrong.
#[tokio::test]
async fn checks_of_a_target_the_consumer_keeps_writing_find_no_drift() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let consumer = env.start_consumer();
    let reconciler = env.reconciler().await;
    let target = tally::domain::TargetId::parse("t0")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let checking = tokio::spawn(async move {
        let (mut checks, mut drifted) = (0u32, Vec::new());
        let mut dry_run = true;
        while !*stop_rx.borrow() {
            match reconciler.target(&target, dry_run).await {
                Ok(report) if report.drifted => drifted.push((dry_run, report)),
                Ok(_) | Err(tally::reconcile::ReconcileError::Contention(_)) => {}
                Err(e) => return Err(anyhow::Error::new(e)),
            }
            checks += 1;
            dry_run = !dry_run;
        }
        anyhow::Ok((checks, drifted))
    });
    // One target, its votes spread over every bucket.
    assert_eq!(app.random_votes(&mut Rng(8), 400, 40, 1, 8).await, 400);
    let _ = stop_tx.send(true);
    let (checks, drifted) = checking.await??;
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    consumer.stop().await;
    assert!(checks >= 10, "{checks} checks ran while votes flowed");
    assert!(
        drifted.is_empty(),
        "{} of {checks}: {drifted:?}",
        drifted.len()
    );
    Ok(())
}

/// Rows in a state this release does not know (a newer release's) are
/// left out of a page, but a page they filled is still full: counted as
/// short, it ended the walk of its bucket, and the rows after it were never
/// checked.
#[tokio::test]
async fn rows_this_release_cannot_read_do_not_end_a_walk_early() -> TestResult {
    let env = TestEnv::new().await;
    for i in 0..24 {
        env.cql(&format!(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version) \
             VALUES ('newer{i}', 'video_mixed', 'video', 'love', 1)"
        ))
        .await;
    }
    // Likes nothing has counted: reconcile must find every one.
    for i in 0..12 {
        env.cql(&format!(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version) \
             VALUES ('plain{i}', 'video_mixed', 'video', 'like', 1)"
        ))
        .await;
    }
    let reconciler = env.reconciler().await.with_page_size(2);
    let target = tally::domain::TargetId::parse("video_mixed")?;
    let report = reconciler.target(&target, false).await?;
    assert_eq!(report.users_behind, 12, "{report:?}");
    assert_eq!(env.stats().await["video_mixed"].likes(), 12);
    Ok(())
}

#[tokio::test]
async fn support_can_reconcile_one_target_online_with_an_admin_token() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(9), 40, 10, 1).await;
    env.cql("UPDATE target_stats SET dislikes = 1234 WHERE target_id = 't0' AND bucket = 3")
        .await;
    let damaged = env.stats().await["t0"].dislikes();
    assert!(damaged >= 1234);
    let url = format!("{}/v1/admin/reconcile/t0", app.address);

    let user = app
        .send(app.client.post(&url).bearer_auth(token("mallory")))
        .await;
    let admin_token = tally::auth::mint(
        &tally::auth::AuthConfig::hs256(crate::support::JWT_SECRET),
        "support-1",
        Duration::from_secs(60),
        vec!["admin".into()],
    )?;
    let admin = app
        .send(app.client.post(&url).bearer_auth(admin_token))
        .await;

    assert_eq!(user.status, 403, "{user:?}");
    assert_eq!(
        env.stats().await["t0"].dislikes(),
        env.recount().await["t0"].dislikes(),
        "{admin:?}"
    );
    assert_eq!(admin.status, 200);
    assert_eq!(admin.json()["totals_before"]["dislikes"], damaged);
    assert_eq!(admin.json()["repaired"], true);
    Ok(())
}

#[tokio::test]
async fn reconcile_repairs_a_ghost_applied_row_and_a_wrong_state_at_the_right_version() -> TestResult
{
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    for (user, action) in [("ann", "like"), ("ben", "like"), ("cid", "dislike")] {
        app.vote(user, crate::support::new_key(), "video_g", action)
            .await;
    }
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;
    let truth = env.recount().await;

    // A ghost: a user counted who has no row in `reactions` (an injected
    // event, say), and ben counted at his version but with the wrong state.
    let (ghost_bucket, ghost_token) = env.place_of("ghost");
    env.cql(&format!(
        "UPDATE target_stats SET applied_version = 3, applied_state = 'dislike' \
         WHERE target_id = 'video_g' AND bucket = {ghost_bucket} \
         AND user_token = {ghost_token} AND user_id = 'ghost'",
    ))
    .await;
    let (ben_bucket, ben_token) = env.place_of("ben");
    env.cql(&format!(
        "UPDATE target_stats SET applied_state = 'dislike' \
         WHERE target_id = 'video_g' AND bucket = {ben_bucket} \
         AND user_token = {ben_token} AND user_id = 'ben'",
    ))
    .await;
    env.cql(&format!(
        "UPDATE target_stats SET likes = 1, dislikes = 3 WHERE target_id = 'video_g' \
         AND bucket = {ben_bucket}"
    ))
    .await;
    assert_ne!(env.stats().await, truth);

    let report = env
        .reconciler()
        .await
        .target(&target("video_g"), false)
        .await?;
    assert!(report.drifted && report.repaired, "{report:?}");
    assert_eq!(report.users_behind, 2, "the ghost and ben: {report:?}");
    assert_eq!(env.stats().await, truth);
    // Served too: the repair was written through to the cache.
    let served = app.summary("ann", "video_g").await.json();
    assert_eq!(
        served["items"]["video_g"]["likes"],
        truth["video_g"].likes()
    );
    assert_eq!(
        served["items"]["video_g"]["dislikes"],
        truth["video_g"].dislikes()
    );
    // A second pass finds nothing.
    let again = env
        .reconciler()
        .await
        .target(&target("video_g"), false)
        .await?;
    assert!(!again.drifted, "{again:?}");

    // The forgotten ghost keeps an applied row that says "never counted".
    // When they vote after all, the consumer counts them from that row
    // (a write conditioned on no row at all would be refused for ever).
    app.vote("ghost", crate::support::new_key(), "video_g", "like")
        .await;
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;
    let truth = env.recount().await;
    assert_eq!(truth["video_g"].likes(), 3, "ann's, ben's and the ghost's");
    assert_eq!(env.stats().await, truth);
    let served = app.summary("ann", "video_g").await.json();
    assert_eq!(served["items"]["video_g"]["likes"], 3);
    Ok(())
}

#[tokio::test]
async fn rows_within_the_lag_grace_are_counted_but_are_not_drift() -> TestResult {
    let env = TestEnv::new().await;
    env.cql("INSERT INTO targets (target_id, target_type) VALUES ('video_l', 'video')")
        .await;
    // Committed a moment ago, not yet reached by the consumer: ordinary lag.
    env.cql(
        "INSERT INTO reactions (user_id, target_id, target_type, state, version, updated_at) \
         VALUES ('fay', 'video_l', 'video', 'like', 1, toTimestamp(now()))",
    )
    .await;
    let reconcile = || {
        env.tally()
            .args([
                "reconcile",
                "--target",
                "video_l",
                "--json",
                "--fail-on-drift",
            ])
            .output()
    };

    let lag = reconcile()?;
    assert_eq!(
        lag.status.code(),
        Some(0),
        "lag must not page: {}",
        String::from_utf8_lossy(&lag.stderr)
    );
    let summary = json_of(&lag);
    assert_eq!(summary["targets_drifted"], 0, "{summary}");
    assert_eq!(summary["users_in_flight"], 1, "{summary}");
    assert_eq!(
        env.stats().await,
        env.recount().await,
        "counted all the same"
    );

    // Changed an hour ago and never counted: a lost transition, drift.
    env.cql(
        "INSERT INTO reactions (user_id, target_id, target_type, state, version, updated_at) \
         VALUES ('gus', 'video_l', 'video', 'dislike', 1, '2026-01-01 00:00:00+0000')",
    )
    .await;
    let lost = reconcile()?;
    assert_eq!(
        lost.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&lost.stderr)
    );
    let summary = json_of(&lost);
    assert_eq!(summary["targets_drifted"], 1, "{summary}");
    assert_eq!(summary["corrections"][0]["users_behind"], 1, "{summary}");
    assert_eq!(summary["users_in_flight"], 0, "{summary}");
    assert_eq!(env.stats().await, env.recount().await);
    Ok(())
}

/// A write that lands without its write through (its writer killed between
/// the two, or killed while it still owed the entry a drop) leaves a cache
/// entry older than the durable totals, and no write of the bucket may ever
/// come to fix it. The next check of the target drops it, though it finds
/// no drift; a dry run leaves it. Here one of two buckets is current in the
/// entry and the later one is behind.
#[tokio::test]
async fn a_check_that_finds_no_drift_drops_a_cache_entry_older_than_the_totals() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let voters = two_uncounted_likes(&env, "video_k").await;
    let served = async || likes_served(&app, "video_k").await;
    assert_eq!(served().await, 0, "the entry filled before the repair");

    // A reconcile with no Redis stands for one killed before its drop.
    let store = std::sync::Arc::new(
        tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?,
    );
    let video = target("video_k");
    let repaired = tally::reconcile::Reconciler::new(store.clone(), None)
        .target(&video, false)
        .await?;
    assert!(repaired.drifted, "{repaired:?}");
    assert_eq!(env.stats().await, env.recount().await);
    assert_eq!(env.stats().await["video_k"].likes(), 2);
    // A later write of the first bucket brings that one up to date.
    let first = store
        .stats
        .bucket_of(&tally::domain::UserId::parse(&voters[0])?);
    tally::fence::write(
        &store.stats,
        Some(&cache(&env)?),
        (&video, first),
        &[],
        &mut MoveFence,
    )
    .await?;
    assert_eq!(
        served().await,
        1,
        "the entry behind the totals in one bucket"
    );

    let check = |extra: &'static [&'static str]| {
        let mut args = vec![
            "reconcile",
            "--target",
            "video_k",
            "--json",
            "--fail-on-drift",
        ];
        args.extend(extra);
        env.tally().args(args).output()
    };
    for (extra, likes) in [(&["--dry-run"][..], 1), (&[][..], 2)] {
        let out = check(extra)?;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(json_of(&out)["targets_drifted"], 0, "{extra:?}");
        assert_eq!(served().await, likes, "served after {extra:?}");
    }
    Ok(())
}

#[tokio::test]
async fn a_check_that_fails_on_a_later_bucket_still_drops_an_entry_behind_an_earlier_one()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let voters = two_uncounted_likes(&env, "video_f").await;
    let served = async || likes_served(&app, "video_f").await;
    assert_eq!(served().await, 0, "the entry filled before the repair");

    // A reconcile with no Redis stands for one killed before its drop; then
    // a write of the later bucket brings that one up to date in the entry,
    // which stays behind in the first.
    let store = std::sync::Arc::new(
        tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?,
    );
    let video = target("video_f");
    tally::reconcile::Reconciler::new(store.clone(), None)
        .target(&video, false)
        .await?;
    assert_eq!(env.stats().await["video_f"].likes(), 2);
    let later_user = tally::domain::UserId::parse(&voters[1])?;
    let later = store.stats.bucket_of(&later_user);
    tally::fence::write(
        &store.stats,
        Some(&cache(&env)?),
        (&video, later),
        &[],
        &mut MoveFence,
    )
    .await?;
    assert_eq!(served().await, 1, "the entry behind in the first bucket");

    // The later bucket holds a row no check can get past.
    let (column, token) = env.place_of(&voters[1]);
    env.cql(&format!(
        "INSERT INTO target_stats (target_id, bucket, user_token, user_id, applied_version, applied_state) \
         VALUES ('video_f', {column}, {token}, 'damaged', 1, 'bogus')"
    ))
    .await;
    let out = env
        .tally()
        .args(["reconcile", "--target", "video_f", "--json"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("bogus"), "{stderr}");
    assert_eq!(served().await, 2, "served after the failed check");
    Ok(())
}

/// A target whose check always fails while Cassandra answers (here a row
/// of a state no release wrote) used to stop `--all` where it stood: the
/// run exited 1, and the next resumed just before that target and failed
/// on it again, so no target after it in token order was checked again.
/// Now the sweep passes over it, reports it, and exits 5.
#[tokio::test]
async fn a_sweep_passes_over_a_target_whose_check_fails_and_repairs_the_rest() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    // Likes nothing has counted: every target has drifted.
    for i in 0..6 {
        let reply = app
            .vote(
                "fay",
                crate::support::new_key(),
                &format!("video_s{i}"),
                "like",
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?;
    let in_order = store.targets.page(None, 100).await?;
    assert_eq!(in_order.len(), 6);
    // The first in token order: before, the sweep stopped before all the rest.
    let damaged = in_order[0].0.to_string();
    let (bucket, token) = env.place_of("fay");
    env.cql(&format!(
        "INSERT INTO target_stats (target_id, bucket, user_token, user_id, applied_version, applied_state) \
         VALUES ('{damaged}', {bucket}, {token}, 'damaged', 1, 'bogus')"
    ))
    .await;

    let out = env
        .tally()
        .args(["reconcile", "--all", "--rate", "0", "--json"])
        .output()?;
    let summary = json_of(&out);
    assert_eq!(out.status.code(), Some(5), "{summary}");
    assert_eq!(summary["targets_failed"], 1, "{summary}");
    assert_eq!(summary["failed"][0]["target_id"], damaged.as_str());
    assert!(
        summary["failed"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("bogus")),
        "{summary}"
    );
    assert_eq!(summary["targets_checked"], 5, "{summary}");
    assert_eq!(summary["complete"], true);
    let (stats, truth) = (env.stats().await, env.recount().await);
    for (id, _) in &in_order[1..] {
        let id = id.as_str();
        assert_eq!(stats.get(id), truth.get(id), "{id} repaired");
    }
    Ok(())
}

/// Two voters of `target` in two buckets, the first bucket's first, each
/// with a like in `reactions` that nothing has counted.
async fn two_uncounted_likes(env: &TestEnv, target: &str) -> Vec<String> {
    let mut voters: Vec<String> = vec!["gus".into()];
    voters.extend(
        (0..1_000)
            .map(|i| format!("v{i}"))
            .find(|u| env.place_of(u).0 != env.place_of("gus").0),
    );
    voters.sort_by_key(|u| env.place_of(u).0);
    env.cql(&format!(
        "INSERT INTO targets (target_id, target_type) VALUES ('{target}', 'video')"
    ))
    .await;
    for user in &voters {
        env.cql(&format!(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version, updated_at) \
             VALUES ('{user}', '{target}', 'video', 'like', 1, '2026-01-01 00:00:00+0000')"
        ))
        .await;
    }
    voters
}

/// The likes `GET /v1/votes/summary` serves for `target`.
async fn likes_served(app: &crate::support::TestApp, target: &str) -> serde_json::Value {
    let reply = app.summary("reader", target).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["items"][target]["likes"].clone()
}

fn cache(env: &TestEnv) -> anyhow::Result<tally::cache::Cache> {
    tally::cache::Cache::new(&env.redis, Duration::from_secs(60))
}

#[tokio::test]
async fn the_sweep_skips_a_target_another_writer_keeps_writing_and_finishes_the_rest() -> TestResult
{
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(12), 60, 20, 3).await;
    // A target with enough voters that one recount round (head, the rows by
    // index, the applied rows) takes far longer than one fence move.
    env.cql("INSERT INTO targets (target_id, target_type) VALUES ('hot', 'video')")
        .await;
    let insert = env
        .session
        .prepare(
            "INSERT INTO reactions (user_id, target_id, target_type, state, version) \
             VALUES (?, 'hot', 'video', 'like', 1)",
        )
        .await?;
    for chunk in (0..600).collect::<Vec<u32>>().chunks(50) {
        let writes = chunk
            .iter()
            .map(|i| env.session.execute_unpaged(&insert, (format!("voter{i}"),)));
        for done in futures::future::join_all(writes).await {
            done?;
        }
    }

    let store = std::sync::Arc::new(
        tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?,
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let hot = target("hot");
    let nobody = tally::domain::UserId::parse("nobody")?;
    let mut writers = Vec::new();
    for _ in 0..2 {
        let (store, hot, nobody, stop) =
            (store.clone(), hot.clone(), nobody.clone(), stop_rx.clone());
        writers.push(tokio::spawn(async move {
            let mut moves = 0u64;
            while !*stop.borrow() {
                let bucket = store.stats.bucket_of(&nobody);
                let done = tally::fence::write(
                    &store.stats,
                    None,
                    (&hot, bucket),
                    &[&nobody],
                    &mut MoveFence,
                )
                .await?;
                moves += u64::from(done.writes);
            }
            anyhow::Ok(moves)
        }));
    }

    let reconciler = env.reconciler().await.with_max_fence_losses(3);
    let options = tally::reconcile::SweepOptions {
        name: "skip".into(),
        rate: 0.0,
        dry_run: false,
        restart: true,
        page_size: 50,
    };
    let (_never, no_stop) = tokio::sync::watch::channel(false);
    let summary = reconciler.sweep(&options, &no_stop, |_| {}).await?;
    let _ = stop_tx.send(true);
    let mut moves = 0;
    for w in writers {
        moves += w.await??;
    }

    assert!(summary.complete, "{summary:?}");
    assert_eq!(summary.skipped, vec!["hot".to_owned()], "{summary:?}");
    assert_eq!(summary.targets_skipped, 1, "{summary:?}");
    assert_eq!(
        summary.targets_checked, 3,
        "the others were checked: {summary:?}"
    );
    assert!(moves > 3, "the other writer kept writing ({moves} moves)");
    // Once the other writer stops, the next pass counts the hot target.
    let again = reconciler.sweep(&options, &no_stop, |_| {}).await?;
    assert_eq!(again.targets_skipped, 0, "{again:?}");
    assert_eq!(env.stats().await, env.recount().await);
    Ok(())
}

/// A fenced write is conditioned on the view its writer read, head and rows
/// both. A view whose rows are older than its head is what a replica that a
/// commit had not reached gives a LOCAL_QUORUM read of the rows when the
/// head's read came from one it had; on one node the same view comes from
/// reading the rows before another writer lands and the head after. Driven
/// step by step against the real `target_stats`, so the interleaving is
/// certain: the stale rows are refused as a stale head is, and a like is
/// never counted twice.
#[tokio::test]
async fn a_view_older_than_the_store_in_its_head_or_in_its_rows_is_refused() -> TestResult {
    use tally::domain::{Applied, Ledger, UserId};
    use tally::store::Cas;
    use tally::store::stats::{FencedWrite, ReadAt};

    let env = TestEnv::new().await;
    let store = tally::store::Store::open(&env.cassandra, Duration::from_secs(60)).await?;
    let stats = &store.stats;
    let ann = UserId::parse("ann")?;
    let b = stats.bucket_of(&ann);
    let liked = Applied {
        version: 1,
        state: Reaction::Like,
    };
    // A ledger's changes, written on the head and rows it was built from.
    let write = |t: TargetId, seq: Option<i64>, ledger: Ledger, read: Option<Applied>| async move {
        let users = ledger.changed_rows();
        let before = vec![read; users.len()];
        let w = FencedWrite {
            read_seq: seq,
            totals: ledger.totals,
            target_type: None,
            users: &users,
            before: &before,
        };
        stats.write(&t, b, &w).await
    };
    // The other writer (reconcile, or the partition's previous owner)
    // counts ann's like at version 1.
    let other_writer = |t: TargetId| {
        let ann = ann.clone();
        async move {
            let head = stats.head(&t, b, ReadAt::Quorum).await?;
            let mut ledger = Ledger::new(head.totals, Default::default());
            ledger.apply_row(&ann, 1, Reaction::Like);
            anyhow::Ok(write(t, head.seq, ledger, None).await)
        }
    };
    // This writer applies the same transition, published once, from the
    // view it read.
    let this_writer = |t: TargetId, head: tally::store::stats::Head, rows: HashMap<_, _>| {
        let read = rows.get(&ann).copied();
        let mut ledger = Ledger::new(head.totals, rows);
        ledger.apply_event(&ann, 1, Reaction::None, Reaction::Like);
        write(t, head.seq, ledger, read)
    };

    // Rows older than the head: without ann's like, beside a head with it.
    let t = target("stale_rows");
    let rows = stats.applied_of(&t, b, &[&ann]).await?;
    assert!(matches!(other_writer(t.clone()).await?, Cas::Applied));
    let head = stats.head(&t, b, ReadAt::Quorum).await?;
    assert_eq!(head.totals.get(Reaction::Like), 1, "the head has the like");
    assert!(
        matches!(this_writer(t.clone(), head, rows).await, Cas::NotApplied),
        "rows without the like beside a head with it are refused"
    );
    assert_eq!(stats.totals(&t).await?.get(Reaction::Like), 1);

    // A head older than the rows: the fence moved between the two reads.
    let t = target("stale_head");
    let head = stats.head(&t, b, ReadAt::Quorum).await?;
    assert!(matches!(other_writer(t.clone()).await?, Cas::Applied));
    let rows = stats.applied_of(&t, b, &[&ann]).await?;
    assert_eq!(rows.get(&ann), Some(&liked));
    assert!(
        matches!(this_writer(t.clone(), head, rows).await, Cas::NotApplied),
        "a stale head is refused"
    );
    assert_eq!(stats.totals(&t).await?.get(Reaction::Like), 1);
    Ok(())
}

/// A target counted but missing from the registry (counted by an earlier
/// release's trusted consumer, say) is served as zeros once its cache entry
/// goes: a miss that finds no registry row reads no bucket. `tally
/// reconcile --target` finds its rows and registers it again, and its
/// count is served.
#[tokio::test]
async fn reconcile_target_registers_a_counted_target_missing_from_the_registry() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    for user in ["un1", "un2"] {
        let reply = app
            .vote(user, crate::support::new_key(), "unlisted", "like")
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;
    env.cql("DELETE FROM targets WHERE target_id = 'unlisted'")
        .await;
    let cache = tally::cache::Cache::new(&env.redis, Duration::from_secs(60))?;
    let likes = async |app: &crate::support::TestApp| {
        cache.invalidate(&target("unlisted")).await?;
        let summary = app.summary("reader", "unlisted").await.json();
        summary["items"]["unlisted"]["likes"]
            .as_i64()
            .with_context(|| format!("{summary}"))
    };
    // A process that never registered it, so it asks the registry.
    let unaware = env.spawn_app().await;
    assert_eq!(likes(&unaware).await?, 0, "served as zeros without its row");

    let out = env
        .tally()
        .args(["reconcile", "--target", "unlisted", "--dry-run"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(likes(&unaware).await?, 0, "a dry run registers nothing");
    let out = env
        .tally()
        .args(["reconcile", "--target", "unlisted"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        likes(&unaware).await?,
        2,
        "served as counted once registered"
    );
    Ok(())
}
