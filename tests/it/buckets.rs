//! One target whose voters fill every bucket: the consumer writes the
//! buckets in parallel, reconcile walks them a small page at a time, and the
//! totals a reader is served are the sum of the buckets, exact.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;

use crate::support::{Rng, TEST_BUCKETS, TestEnv, TestResult, eventually};

/// Every bucket that holds an applied row of `target`.
async fn buckets_with_voters(env: &TestEnv, target: &str) -> anyhow::Result<BTreeSet<i32>> {
    let mut used = BTreeSet::new();
    for bucket in 0..TEST_BUCKETS as i32 {
        let rows: Vec<(i32,)> = env
            .session
            .query_unpaged(
                "SELECT bucket FROM target_stats WHERE target_id = ? AND bucket = ? \
                 AND user_token >= -9223372036854775808 LIMIT 1",
                (target, bucket),
            )
            .await?
            .into_rows_result()?
            .rows::<(i32,)>()?
            .collect::<Result<_, _>>()?;
        used.extend(rows.into_iter().map(|(b,)| b));
    }
    Ok(used)
}

/// The served totals of one target, as a reader's summary has them.
async fn served(app: &crate::support::TestApp, target: &str) -> (i64, i64) {
    let summary = app.summary("reader", target).await.json();
    let item = &summary["items"][target];
    (
        item["likes"].as_i64().unwrap_or(-1),
        item["dislikes"].as_i64().unwrap_or(-1),
    )
}

#[tokio::test]
async fn one_target_over_every_bucket_with_votes_the_consumer_and_a_paging_reconcile_ends_exact()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let consumer = env.start_consumer();
    // Pages of 5 rows: every bucket's walk crosses many page edges while
    // votes land on both sides of them.
    let reconciler = env
        .reconciler()
        .await
        .with_page_size(5)
        .with_lag_grace(Duration::ZERO);
    let target = tally::domain::TargetId::parse("t0")?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let reconciling = tokio::spawn(async move {
        let mut passes = 0u32;
        while !*stop_rx.borrow() {
            match reconciler.target(&target, false).await {
                Ok(_) => passes += 1,
                // Losing to the consumer on a bucket it keeps writing is
                // expected; the next pass tries again.
                Err(tally::reconcile::ReconcileError::Contention(_)) => {}
                Err(e) => return Err(e).context("reconcile"),
            }
        }
        anyhow::Ok(passes)
    });

    // 200 voters on one target, each changing their mind a few times.
    assert_eq!(app.random_votes(&mut Rng(15), 800, 200, 1, 16).await, 800);
    let _ = stop_tx.send(true);
    let passes = reconciling.await??;
    env.wait_until_no_drift(Duration::from_secs(90)).await;
    // Reconcile may have repaired the totals ahead of the consumer: its
    // events still to come take their votes' changes out of the entry.
    let published = env.published();
    eventually("the consumer to drain", Duration::from_secs(60), || async {
        (consumer.processed() >= published as u64).then_some(())
    })
    .await;
    consumer.stop().await;

    assert!(passes >= 1, "reconcile ran while votes flowed");
    let used = buckets_with_voters(&env, "t0").await?;
    assert_eq!(
        used,
        (0..TEST_BUCKETS as i32).collect(),
        "the voters span every bucket"
    );
    let truth = env.recount().await;
    assert_eq!(
        served(&app, "t0").await,
        (truth["t0"].likes(), truth["t0"].dislikes()),
        "served = the recount, with no cache flush"
    );
    Ok(())
}

#[tokio::test]
async fn reconcile_repairs_rows_on_both_sides_of_page_and_bucket_edges() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(16), 300, 60, 1).await;
    let truth = env.recount().await;

    // Every third voter's applied row goes missing, in all buckets, and one
    // bucket's totals are overwritten.
    let mut lost = 0;
    for user in (0..60).step_by(3).map(|i| format!("u{i}")) {
        if env.reaction(&user, "t0").await.is_some() {
            let (bucket, token) = env.place_of(&user);
            env.cql(&format!(
                "DELETE FROM target_stats WHERE target_id = 't0' AND bucket = {bucket} \
                 AND user_token = {token} AND user_id = '{user}'"
            ))
            .await;
            lost += 1;
        }
    }
    env.cql("UPDATE target_stats SET likes = 1000 WHERE target_id = 't0' AND bucket = 1")
        .await;
    assert_ne!(env.stats().await, truth);

    let report = env
        .reconciler()
        .await
        .with_page_size(3)
        .with_lag_grace(Duration::ZERO)
        .target(&tally::domain::TargetId::parse("t0")?, false)
        .await?;
    assert!(report.drifted && report.repaired, "{report:?}");
    assert_eq!(report.users_behind, lost, "{report:?}");
    assert_eq!(report.totals_after, truth["t0"].totals, "{report:?}");
    assert_eq!(env.stats().await, truth);
    assert_eq!(
        served(&app, "t0").await,
        (truth["t0"].likes(), truth["t0"].dislikes())
    );
    // Nothing left to do: a second walk finds no drift.
    let again = env
        .reconciler()
        .await
        .with_page_size(3)
        .target(&tally::domain::TargetId::parse("t0")?, false)
        .await?;
    assert!(!again.drifted && !again.repaired, "{again:?}");
    Ok(())
}

#[tokio::test]
async fn a_sweep_stopped_inside_a_target_resumes_from_the_bucket_it_was_in() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    env.votes_counted(&app, &mut Rng(17), 200, 60, 1).await;
    let truth = env.recount().await;
    env.cql("UPDATE target_stats SET likes = 500 WHERE target_id = 't0' AND bucket = 0")
        .await;
    env.cql("UPDATE target_stats SET likes = 700 WHERE target_id = 't0' AND bucket = 3")
        .await;
    // Where a sweep stopped inside t0, about to check its bucket 2: just
    // before t0's token, with t0 and bucket 2 named.
    let rows: Vec<(i64,)> = env
        .session
        .query_unpaged(
            "SELECT token(target_id) FROM targets WHERE target_id = 't0'",
            (),
        )
        .await?
        .into_rows_result()?
        .rows::<(i64,)>()?
        .collect::<Result<_, _>>()?;
    let token = rows.first().context("t0 is registered")?.0;
    env.cql(&format!(
        "INSERT INTO reconcile_checkpoints (name, last_token, checked, drifted, in_target, next_bucket) \
         VALUES ('mid', {}, 0, 0, 't0', 2)",
        token - 1
    ))
    .await;

    let reconciler = env.reconciler().await;
    let options = tally::reconcile::SweepOptions {
        name: "mid".into(),
        rate: 0.0,
        dry_run: false,
        restart: false,
        page_size: 50,
    };
    let (_never, no_stop) = tokio::sync::watch::channel(false);
    let resumed = reconciler.sweep(&options, &no_stop, |_| {}).await?;
    assert!(resumed.complete, "{resumed:?}");
    assert_eq!(resumed.targets_drifted, 1, "{resumed:?}");
    let stats = env.stats().await;
    assert_ne!(
        stats["t0"], truth["t0"],
        "bucket 0 was before the resume point: not checked"
    );
    assert_eq!(
        stats["t0"].likes() - truth["t0"].likes(),
        500 - bucket_likes(&env, 0, &truth).await?,
        "only bucket 0's damage is left"
    );

    let whole = reconciler
        .sweep(
            &tally::reconcile::SweepOptions {
                restart: true,
                ..options
            },
            &no_stop,
            |_| {},
        )
        .await?;
    assert_eq!(whole.targets_drifted, 1, "{whole:?}");
    assert_eq!(env.stats().await, truth);
    Ok(())
}

/// What bucket `bucket` of t0 truly counts: its voters' likes in the truth.
async fn bucket_likes(
    env: &TestEnv,
    bucket: i32,
    truth: &crate::support::Tallies,
) -> anyhow::Result<i64> {
    let users = &truth["t0"].users;
    Ok(users
        .iter()
        .filter(|(u, (_, state))| state == "like" && env.place_of(u).0 == bucket)
        .count() as i64)
}
