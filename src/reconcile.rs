//! `tally reconcile`: makes `target_stats` agree with `reactions`, the truth.
//!
//! One target: read its stats (fence, totals, applied rows), read its rows in
//! `reactions` through the SAI index, and fold those rows into the applied
//! rows with the same apply rule the consumer uses. Damaged totals are
//! replaced by the sum of the applied states; applied rows that are missing
//! or behind (a lost event) are brought up to the row's version. The writes
//! are the consumer's fenced writes, so a consumer or a vote running at the
//! same time can neither be overwritten nor counted twice: if the fence moved,
//! the whole recount starts again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use crate::cache::Cache;
use crate::domain::{Ledger, TargetId, Totals, UserId};
use crate::store::Store;
use crate::store::reactions::{Cas, Unavailable};
use crate::store::stats::MAX_USERS_PER_WRITE;
use crate::store::targets::Checkpoint;

/// Fence conflicts tolerated for one target before giving up on it for now.
const MAX_ROUNDS: u32 = 20;

/// What reconciling one target found and did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub target_id: String,
    pub drifted: bool,
    /// The totals `target_stats` held.
    pub totals_before: Totals,
    /// The totals the per-user rows add up to.
    pub totals_after: Totals,
    /// Users whose applied version was missing or behind `reactions`.
    pub users_behind: usize,
    /// Whether the repair was written (false on a dry run or without drift).
    pub repaired: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    #[error("target {0}: the fence kept moving; try again")]
    Contention(String),
}

#[derive(Clone)]
pub struct Reconciler {
    store: Arc<Store>,
    cache: Option<Cache>,
}

impl Reconciler {
    pub fn new(store: Arc<Store>, cache: Option<Cache>) -> Reconciler {
        Reconciler { store, cache }
    }

    pub async fn target(&self, target: &TargetId, dry_run: bool) -> Result<Report, ReconcileError> {
        let mut serial = false;
        'round: for _ in 0..MAX_ROUNDS {
            // Stats first, then the truth: an applied version can then never
            // be ahead of the row it came from.
            let read = self.store.stats.read(target, None, serial).await?;
            let truth: HashMap<UserId, _> = self
                .store
                .reactions
                .by_target(target)
                .await?
                .into_iter()
                .collect();
            serial = true;

            let before = read.ledger.totals;
            let base = read.ledger.applied;
            let mut plan = Ledger::new(Totals::count(base.values().map(|a| a.state)), base.clone());
            let totals_damaged = plan.totals != before;
            for (user, row) in &truth {
                plan.apply(user, row.version, None, row.state);
            }
            let behind: Vec<&UserId> = plan.changed.iter().collect();
            if !totals_damaged && behind.is_empty() {
                metrics::counter!(crate::metrics::RECONCILE_CHECKED).increment(1);
            }
            let mut report = Report {
                target_id: target.to_string(),
                drifted: totals_damaged || !behind.is_empty(),
                totals_before: before,
                totals_after: plan.totals,
                users_behind: behind.len(),
                repaired: false,
            };
            if report.drifted {
                metrics::counter!(crate::metrics::RECONCILE_CHECKED).increment(1);
                metrics::counter!(crate::metrics::DRIFT_FOUND).increment(1);
            }
            if !report.drifted || dry_run {
                if report.drifted {
                    tracing::warn!(target_id = %target, ?before, after = ?plan.totals, users_behind = behind.len(), "drift found (dry run: not repaired)");
                }
                return Ok(report);
            }

            // Written in chunks, each self-consistent: its totals are the
            // recounted base plus exactly the users written so far.
            let mut ledger = Ledger::new(Totals::count(base.values().map(|a| a.state)), base);
            let mut seq = read.seq;
            let chunks: Vec<&[&UserId]> = if behind.is_empty() {
                vec![&[]]
            } else {
                behind.chunks(MAX_USERS_PER_WRITE).collect()
            };
            for chunk in chunks {
                for user in chunk {
                    if let Some(row) = truth.get(*user) {
                        ledger.apply(user, row.version, None, row.state);
                    }
                }
                match self
                    .store
                    .stats
                    .write(target, None, seq, &ledger, chunk)
                    .await
                {
                    Cas::Applied => seq = Some(seq.unwrap_or(0) + 1),
                    Cas::NotApplied | Cas::Unknown(_) => continue 'round,
                    Cas::Failed(e) => return Err(Unavailable(e).into()),
                }
            }
            report.repaired = true;
            metrics::counter!(crate::metrics::DRIFT_REPAIRED).increment(1);
            if let Some(cache) = &self.cache {
                if let Err(e) = cache.invalidate(target).await {
                    tracing::warn!(target_id = %target, error = %e, "cached totals not dropped; they expire with their TTL");
                }
            }
            tracing::warn!(
                target_id = %target, ?before, after = ?report.totals_after, users_behind = report.users_behind,
                "drift found and repaired"
            );
            return Ok(report);
        }
        Err(ReconcileError::Contention(target.to_string()))
    }

    /// Sweeps every target in the registry, in token order, at most `rate`
    /// per second, from the checkpoint `name` (unless `restart`). Saves the
    /// checkpoint after every page, and clears it when the sweep completes.
    pub async fn sweep(
        &self,
        options: &SweepOptions,
        stop: &watch::Receiver<bool>,
        mut on_progress: impl FnMut(&SweepStatus),
    ) -> Result<SweepSummary, ReconcileError> {
        let targets = &self.store.targets;
        let resumed = if options.restart {
            None
        } else {
            targets.checkpoint(&options.name).await?
        };
        let mut cp = resumed.unwrap_or_default();
        let mut summary = SweepSummary {
            resumed_from: resumed.and_then(|c| c.last_token),
            ..SweepSummary::default()
        };
        let interval = (options.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / options.rate));
        let mut tick = interval.map(|i| {
            let mut t = tokio::time::interval(i);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let page = targets.page(cp.last_token, options.page_size).await?;
            if page.is_empty() {
                targets.clear_checkpoint(&options.name).await?;
                summary.complete = true;
                return Ok(summary);
            }
            for (target, token) in page {
                if *stop.borrow() {
                    targets.save_checkpoint(&options.name, &cp).await?;
                    return Ok(summary);
                }
                if let Some(t) = tick.as_mut() {
                    t.tick().await;
                }
                let report = self.target(&target, options.dry_run).await?;
                summary.targets_checked += 1;
                cp.checked += 1;
                if report.drifted {
                    summary.targets_drifted += 1;
                    cp.drifted += 1;
                    if summary.corrections.len() < MAX_LISTED {
                        summary.corrections.push(report);
                    }
                }
                cp.last_token = Some(token);
                on_progress(&SweepStatus {
                    checkpoint: cp,
                    fraction: token_fraction(token),
                });
            }
            targets.save_checkpoint(&options.name, &cp).await?;
        }
    }
}

/// Corrections listed in a summary; the counts cover all of them.
const MAX_LISTED: usize = 1000;

#[derive(Debug, Clone)]
pub struct SweepOptions {
    pub name: String,
    /// Targets per second; 0 or less means as fast as possible.
    pub rate: f64,
    pub dry_run: bool,
    pub restart: bool,
    pub page_size: i32,
}

#[derive(Debug, Clone, Copy)]
pub struct SweepStatus {
    pub checkpoint: Checkpoint,
    /// How far through the token ring the sweep is, 0 to 1.
    pub fraction: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SweepSummary {
    pub targets_checked: u64,
    pub targets_drifted: u64,
    pub corrections: Vec<Report>,
    /// The token this run resumed after, if it resumed.
    pub resumed_from: Option<i64>,
    /// False when the sweep was stopped before the end.
    pub complete: bool,
}

/// Murmur3 tokens span the whole i64 range; a token's place in it tells how
/// far a token-ordered sweep has come.
pub fn token_fraction(token: i64) -> f64 {
    (token as f64 - i64::MIN as f64) / (u64::MAX as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_fraction_spans_zero_to_one() {
        assert!(token_fraction(i64::MIN).abs() < 1e-9);
        assert!((token_fraction(0) - 0.5).abs() < 1e-9);
        assert!((token_fraction(i64::MAX) - 1.0).abs() < 1e-9);
    }
}
