//! `tally reconcile` against the real stack: each kind of damage, dry runs,
//! an interrupted sweep over thousands of targets, and a loop racing votes.

use std::time::Duration;

use tally::domain::{Reaction, TargetId};

use anyhow::Context;

use crate::support::{Rng, TestEnv, TestResult, eventually, token};

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

    env.cql("UPDATE target_stats SET likes = 999, dislikes = 7 WHERE target_id = 't1'")
        .await;
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
    assert_eq!(summary["corrections"][0]["totals_before"]["likes"], 999);
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
    env.cql("DELETE FROM target_stats WHERE target_id = 'video_x' AND user_id = 'alice'")
        .await;
    let report = env
        .reconciler()
        .await
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

    let report = env
        .reconciler()
        .await
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
    env.cql("UPDATE target_stats SET likes = 500 WHERE target_id = 't0'")
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
            "UPDATE target_stats SET likes = 77 WHERE target_id = 't{}'",
            i * 197
        ))
        .await;
        env.cql(&format!(
            "DELETE FROM target_stats WHERE target_id = 't{}' AND user_id = 'u{}'",
            i * 193 + 1,
            0
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

#[tokio::test]
async fn support_can_reconcile_one_target_online_with_an_admin_token() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(9), 40, 10, 1).await;
    env.cql("UPDATE target_stats SET dislikes = 1234 WHERE target_id = 't0'")
        .await;
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
    assert_eq!(admin.json()["totals_before"]["dislikes"], 1234);
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
    env.cql(
        "UPDATE target_stats SET applied_version = 3, applied_state = 'dislike' \
         WHERE target_id = 'video_g' AND user_id = 'ghost'",
    )
    .await;
    env.cql(
        "UPDATE target_stats SET applied_state = 'dislike' \
         WHERE target_id = 'video_g' AND user_id = 'ben'",
    )
    .await;
    env.cql("UPDATE target_stats SET likes = 1, dislikes = 3 WHERE target_id = 'video_g'")
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
    Ok(())
}
