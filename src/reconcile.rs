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
//!
//! A row that changed within the lag grace and is not yet counted is in
//! flight, not drift: the consumer may simply not have reached it. It is
//! counted all the same (the fence makes that safe), but it neither marks
//! the target drifted nor makes `--fail-on-drift` page.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;

use crate::cache::Cache;
use crate::domain::{Applied, Ledger, TargetId, Totals, UserId};
use crate::fence::{self, Ending, Fold, MAX_USERS_PER_WRITE, Read, Scope, Step};
use crate::store::reactions::Counted;
use crate::store::targets::Checkpoint;
use crate::store::{Store, StoreError};

/// Fence conflicts tolerated for one target before giving up on it for now.
pub const DEFAULT_MAX_FENCE_LOSSES: u32 = 20;

/// How recently a row may have changed and still be waiting for the
/// consumer: the relay's settle time (20 s) plus its interval and a
/// consumer's ordinary lag, with room to spare.
pub const DEFAULT_LAG_GRACE: Duration = Duration::from_secs(60);

/// What reconciling one target found and did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub target_id: String,
    pub drifted: bool,
    /// The totals `target_stats` held.
    pub totals_before: Totals,
    /// The totals the per-user rows add up to.
    pub totals_after: Totals,
    /// Users whose applied version or state was missing, behind or wrong,
    /// and whose row changed before the lag grace: drift.
    pub users_behind: usize,
    /// Users not yet counted whose row changed within the lag grace: the
    /// consumer's ordinary lag, counted now but not drift.
    pub users_in_flight: usize,
    /// Whether anything was written: the repair of drift, or rows in flight
    /// counted ahead of the consumer (false on a dry run).
    pub repaired: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("target {0}: the fence kept moving; try again")]
    Contention(String),
}

#[derive(Clone)]
pub struct Reconciler {
    store: Arc<Store>,
    cache: Option<Cache>,
    max_fence_losses: u32,
    lag_grace: Duration,
}

impl Reconciler {
    pub fn new(store: Arc<Store>, cache: Option<Cache>) -> Reconciler {
        Reconciler {
            store,
            cache,
            max_fence_losses: DEFAULT_MAX_FENCE_LOSSES,
            lag_grace: DEFAULT_LAG_GRACE,
        }
    }

    /// Gives up on a target (for now) after losing its fence this many times.
    pub fn with_max_fence_losses(mut self, losses: u32) -> Reconciler {
        self.max_fence_losses = losses.max(1);
        self
    }

    /// Rows that changed less than this long ago are in flight, not drift.
    pub fn with_lag_grace(mut self, grace: Duration) -> Reconciler {
        self.lag_grace = grace;
        self
    }

    pub async fn target(&self, target: &TargetId, dry_run: bool) -> Result<Report, ReconcileError> {
        let mut recount = Recount {
            store: &self.store,
            dry_run,
            settled_before: SystemTime::now()
                .checked_sub(self.lag_grace)
                .unwrap_or(UNIX_EPOCH),
            report: None,
        };
        let done = fence::write(
            &self.store.stats,
            self.cache.as_ref(),
            target,
            Scope::Everyone,
            Some(self.max_fence_losses),
            &mut recount,
        )
        .await?;
        let report = match (done.ending, recount.report) {
            (Ending::Contended, _) | (_, None) => {
                return Err(ReconcileError::Contention(target.to_string()));
            }
            (_, Some(mut report)) => {
                report.repaired = done.writes > 0;
                report
            }
        };
        metrics::counter!(crate::metrics::RECONCILE_CHECKED).increment(1);
        if report.users_in_flight > 0 {
            // Lag, or a transition lost less than the grace ago: either way
            // it is counted now, and said so.
            tracing::info!(target_id = %target, users_in_flight = report.users_in_flight, counted = report.repaired, "rows within the lag grace counted ahead of the consumer");
        }
        if !report.drifted {
            return Ok(report);
        }
        metrics::counter!(crate::metrics::DRIFT_FOUND).increment(1);
        if dry_run {
            tracing::warn!(target_id = %target, before = %report.totals_before, after = %report.totals_after, users_behind = report.users_behind, "drift found (dry run: not repaired)");
            return Ok(report);
        }
        metrics::counter!(crate::metrics::DRIFT_REPAIRED).increment(1);
        tracing::warn!(
            target_id = %target, before = %report.totals_before, after = %report.totals_after,
            users_behind = report.users_behind, "drift found and repaired"
        );
        Ok(report)
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
                let report = match self.target(&target, options.dry_run).await {
                    Ok(report) => report,
                    // A target the consumer keeps writing is left for the
                    // next sweep; the consumer keeps it current meanwhile.
                    Err(ReconcileError::Contention(id)) => {
                        tracing::info!(target_id = %id, "target skipped: the fence kept moving; the next sweep retries it");
                        summary.targets_skipped += 1;
                        if summary.skipped.len() < MAX_LISTED {
                            summary.skipped.push(id);
                        }
                        cp.last_token = Some(token);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                cp.checked += 1;
                if report.drifted {
                    cp.drifted += 1;
                }
                summary.record(report);
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

/// Folds the per-user rows of `reactions` into each round's read of
/// `target_stats`. The rows are read inside the round, after the stats: an
/// applied version can then never be ahead of the row it is compared with.
struct Recount<'a> {
    store: &'a Store,
    dry_run: bool,
    /// Rows changed at or after this are in flight.
    settled_before: SystemTime,
    /// What the first round found; later rounds only finish its repair.
    report: Option<Report>,
}

impl Fold for Recount<'_> {
    async fn fold(&mut self, target: &TargetId, read: Read) -> Result<Step, StoreError> {
        let truth: HashMap<UserId, Counted> = self
            .store
            .reactions
            .by_target(target)
            .await?
            .into_iter()
            .collect();
        let before = read.head.totals;
        let base = read.applied;
        // Damaged totals are replaced by the sum of the applied states.
        let recounted = Totals::count(base.values().map(|a| a.state));
        // Applied rows of users with no row in `reactions`, confirmed one by
        // one by key (an index read could miss a row; a key read cannot).
        let mut ghosts = Vec::new();
        for user in base.keys().filter(|u| !truth.contains_key(*u)) {
            if base.get(user).is_some_and(|a| *a != Applied::NEVER)
                && self
                    .store
                    .reactions
                    .states(user, std::slice::from_ref(target))
                    .await?
                    .is_empty()
            {
                ghosts.push(user.clone());
            }
        }
        let mut plan = Ledger::new(recounted, base.clone());
        for (user, row) in &truth {
            plan.correct_row(user, row.current.version, row.current.state);
        }
        for user in &ghosts {
            plan.forget(user);
        }
        let behind: Vec<&UserId> = plan.changed.iter().collect();
        let in_flight = behind
            .iter()
            .filter(|u| {
                truth.get(**u).is_some_and(|row| {
                    // Only a row ahead of its count can be lag; one counted
                    // at its own version with another state is damage.
                    let counted = base.get(**u).map_or(0, |a| a.version);
                    row.current.version > counted
                        && row.updated_at.is_some_and(|t| t >= self.settled_before)
                })
            })
            .count();
        let drifted = recounted != before || behind.len() > in_flight;
        let first = self.report.get_or_insert_with(|| Report {
            target_id: target.to_string(),
            drifted,
            totals_before: before,
            totals_after: plan.totals,
            users_behind: behind.len() - in_flight,
            users_in_flight: in_flight,
            repaired: false,
        });
        // A later round (after a lost fence, or the next chunk) reports what
        // the first one found, and what the whole repair ends at.
        first.totals_after = plan.totals;
        if (behind.is_empty() && !drifted) || self.dry_run {
            return Ok(Step::Settled);
        }
        // One chunk per round, each self-consistent: its totals are the
        // recounted base plus exactly the users it writes.
        let chunk = &behind[..behind.len().min(MAX_USERS_PER_WRITE)];
        let mut ledger = Ledger::new(recounted, base);
        for user in chunk {
            match truth.get(*user) {
                Some(row) => ledger.correct_row(user, row.current.version, row.current.state),
                None => ledger.forget(user),
            }
        }
        Ok(Step::Write {
            totals: ledger.totals,
            target_type: read.head.target_type,
            users: ledger.changed_rows(),
            more: behind.len() > chunk.len(),
        })
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
    /// Targets whose fence kept moving (a consumer writing them all along),
    /// left for the next sweep.
    pub targets_skipped: u64,
    pub skipped: Vec<String>,
    /// Users counted ahead of the consumer, within the lag grace (not drift).
    pub users_in_flight: u64,
    pub corrections: Vec<Report>,
    /// The token this run resumed after, if it resumed.
    pub resumed_from: Option<i64>,
    /// False when the sweep was stopped before the end.
    pub complete: bool,
}

impl SweepSummary {
    /// Adds one target's report.
    pub fn record(&mut self, report: Report) {
        self.targets_checked += 1;
        self.users_in_flight += report.users_in_flight as u64;
        if report.drifted {
            self.targets_drifted += 1;
            if self.corrections.len() < MAX_LISTED {
                self.corrections.push(report);
            }
        }
    }
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
