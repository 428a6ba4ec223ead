//! What `target_stats` holds, against the truth recounted from `reactions`.

use std::collections::BTreeMap;
use std::time::Duration;

use tally::domain::{Reaction, Totals};

use super::rng::Rng;
use super::{TestApp, TestEnv};

/// One target as a table says it: its totals, and every user's (version,
/// state). Users at `none` are kept, because their version matters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub totals: Totals,
    pub users: BTreeMap<String, (i64, String)>,
}

impl Tally {
    pub fn likes(&self) -> i64 {
        self.totals.get(Reaction::Like)
    }

    pub fn dislikes(&self) -> i64 {
        self.totals.get(Reaction::Dislike)
    }
}

/// Every target's tally, by target id.
pub type Tallies = BTreeMap<String, Tally>;

impl TestEnv {
    /// What `target_stats` holds.
    pub async fn stats(&self) -> Tallies {
        use futures::TryStreamExt;
        use scylla::value::CqlValue;
        let columns: Vec<&str> = Reaction::total_names().collect();
        let query = format!(
            "SELECT target_id, bucket, user_id, applied_version, applied_state, {} FROM target_stats",
            columns.join(", ")
        );
        let rows: Vec<scylla::value::Row> = self
            .session
            .query_iter(query, ())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .rows_stream::<scylla::value::Row>()
            .unwrap_or_else(|e| panic!("{e}"))
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut out = Tallies::new();
        let mut buckets: BTreeMap<(String, i32), Totals> = BTreeMap::new();
        for row in rows {
            let text = |i: usize| match row.columns.get(i) {
                Some(Some(CqlValue::Text(t))) => Some(t.clone()),
                _ => None,
            };
            let bigint = |i: usize| match row.columns.get(i) {
                Some(Some(CqlValue::BigInt(n))) => Some(*n),
                _ => None,
            };
            let (Some(target), Some(Some(CqlValue::Int(bucket)))) = (text(0), row.columns.get(1))
            else {
                continue;
            };
            // The totals are static: the same on every row of a bucket.
            buckets.insert(
                (target.clone(), *bucket),
                Totals::from_values(std::array::from_fn(|i| bigint(5 + i).unwrap_or(0))),
            );
            let e = out.entry(target).or_default();
            // Version 0 is "never counted": the same as no applied row.
            if let (Some(u), Some(v), Some(s)) = (text(2), bigint(3), text(4)) {
                if v > 0 {
                    e.users.insert(u, (v, s));
                }
            }
        }
        for ((target, _), totals) in buckets {
            let e = out.entry(target).or_default();
            e.totals = e.totals.plus(totals);
        }
        out
    }

    /// The truth: totals recounted from `reactions`, with every user's
    /// version and state.
    pub async fn recount(&self) -> Tallies {
        use futures::TryStreamExt;
        type Row = (String, String, Option<String>, Option<i64>);
        let rows: Vec<Row> = self
            .session
            .query_iter(
                "SELECT user_id, target_id, state, version FROM reactions",
                (),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .rows_stream::<Row>()
            .unwrap_or_else(|e| panic!("{e}"))
            .try_collect()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut out = Tallies::new();
        for (user, target, state, version) in rows {
            // Rows without a state are idempotency records.
            let (Some(state), Some(version)) = (state, version) else {
                continue;
            };
            let e = out.entry(target).or_default();
            let reaction: Reaction = state.parse().unwrap_or_else(|e| panic!("{e}"));
            e.totals = e
                .totals
                .apply(tally::domain::Delta::between(Reaction::None, reaction));
            e.users.insert(user, (version, state));
        }
        out
    }

    /// Waits until `target_stats` says exactly what `reactions` says.
    pub async fn wait_until_no_drift(&self, deadline: Duration) {
        let start = tokio::time::Instant::now();
        loop {
            let (stats, truth) = (self.stats().await, self.recount().await);
            if stats == truth {
                return;
            }
            if start.elapsed() > deadline {
                let drifted: Vec<_> = truth
                    .iter()
                    .filter(|(t, v)| stats.get(*t) != Some(*v))
                    .map(|(t, v)| (t, v, stats.get(t)))
                    .take(5)
                    .collect();
                panic!("drift after {deadline:?}: (target, truth, stats) {drifted:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    /// The user's reaction row: (state, version), if any.
    pub async fn reaction(&self, user: &str, target: &str) -> Option<(String, i64)> {
        self.session
            .query_unpaged(
                "SELECT state, version FROM reactions WHERE user_id = ? AND target_id = ?",
                (user, target),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_rows_result()
            .unwrap_or_else(|e| panic!("{e}"))
            .maybe_first_row::<(String, i64)>()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// How many rows (reactions and idempotency records) the user has.
    pub async fn rows_of(&self, user: &str) -> i64 {
        let (n,): (i64,) = self
            .session
            .query_unpaged("SELECT count(*) FROM reactions WHERE user_id = ?", (user,))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_rows_result()
            .unwrap_or_else(|e| panic!("{e}"))
            .single_row()
            .unwrap_or_else(|e| panic!("{e}"));
        n
    }
    /// Casts votes and runs a consumer until target_stats agrees with reactions.
    pub async fn votes_counted(
        &self,
        app: &TestApp,
        rng: &mut Rng,
        n: usize,
        users: u64,
        targets: u64,
    ) {
        assert_eq!(app.random_votes(rng, n, users, targets, 32).await, n);
        let consumer = self.start_consumer();
        self.wait_until_no_drift(Duration::from_secs(90)).await;
        consumer.stop().await;
    }
}

/// Every target of `truth` that `GET /v1/votes/summary` (the cache
/// included) does not serve its totals for, as "id: served X, truth Y",
/// read a page of 100 ids at a time by the user `checker`; the error of a
/// page that got no answer.
pub async fn served_mismatches(
    client: &reqwest::Client,
    base: &str,
    truth: &Tallies,
) -> reqwest::Result<Vec<String>> {
    let ids: Vec<&String> = truth.keys().collect();
    let mut mismatches = Vec::new();
    for chunk in ids.chunks(100) {
        let list = chunk
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let body: serde_json::Value = client
            .get(format!("{base}/v1/votes/summary?target_ids={list}"))
            .bearer_auth(super::token("checker"))
            .send()
            .await?
            .json()
            .await
            .unwrap_or_default();
        for t in chunk {
            let want = truth[*t].totals;
            let item = &body["items"][t.as_str()];
            if serde_json::from_value::<Totals>(item.clone()).ok() != Some(want) {
                mismatches.push(format!("{t}: served {item}, truth {want}"));
            }
        }
    }
    Ok(mismatches)
}
