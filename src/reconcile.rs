//! `tally reconcile`: makes `target_stats` agree with `reactions`, the truth.
//!
//! A target is checked a bucket at a time, and a bucket a page at a time, so
//! memory stays bounded by the page whatever the number of voters. One pass
//! over a bucket reads its head (fence and totals), then walks the token
//! range of the bucket: each page reads the applied rows, then the rows of
//! `reactions` in the same token range through the SAI index, and folds the
//! rows into the applied rows with the same apply rule the consumer uses.
//! Applied rows that are missing, behind or wrong (a lost event) are brought
//! to the row, and the bucket's totals are moved by exactly what changed.
//! Damaged totals, which only show once the whole bucket is counted, are
//! replaced by the sum of the applied states at the end of the pass. Every
//! write is the consumer's fenced write, chained on the seq of the last one,
//! so a consumer or a vote running at the same time can neither be
//! overwritten nor counted twice: if the fence moved, the pass starts again.
//!
//! A row that changed within the lag grace and is not yet counted is in
//! flight, not drift: the consumer may simply not have reached it. It is
//! counted all the same (the fence makes that safe), but it neither marks
//! the target drifted nor makes `--fail-on-drift` page.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;

use crate::cache::{Behind, Cache};
use crate::domain::{Applied, Bucket, Ledger, TargetId, TargetType, Totals, UserId};
use crate::fence::{self, MAX_USERS_PER_WRITE};
use crate::store::reactions::Counted;
use crate::store::stats::{AppliedRow, FencedWrite, Head, ReadAt};
use crate::store::{Cas, Store, StoreError};

/// Fence conflicts tolerated for one target before giving up on it for now.
pub const DEFAULT_MAX_FENCE_LOSSES: u32 = 20;

/// How recently a row may have changed and still be waiting for the
/// consumer: the relay's settle time (25 s) plus its interval and a
/// consumer's ordinary lag, with room to spare.
pub const DEFAULT_LAG_GRACE: Duration = Duration::from_secs(60);

/// What reconciling a target (all its buckets, or a part of them) found
/// and did.
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

impl Report {
    fn empty(target: &TargetId) -> Report {
        Report {
            target_id: target.to_string(),
            drifted: false,
            totals_before: Totals::default(),
            totals_after: Totals::default(),
            users_behind: 0,
            users_in_flight: 0,
            repaired: false,
        }
    }

    /// Adds one bucket's findings.
    fn add(&mut self, found: Found) {
        self.drifted |= found.behind > 0 || found.damaged_totals;
        self.totals_before = self.totals_before.plus(found.before);
        self.totals_after = self.totals_after.plus(found.after);
        self.users_behind += found.behind;
        self.users_in_flight += found.in_flight;
        self.repaired |= found.writes > 0;
    }

    /// Adds what another part of the same target found.
    fn merge(&mut self, other: Report) {
        self.drifted |= other.drifted;
        self.totals_before = self.totals_before.plus(other.totals_before);
        self.totals_after = self.totals_after.plus(other.totals_after);
        self.users_behind += other.users_behind;
        self.users_in_flight += other.users_in_flight;
        self.repaired |= other.repaired;
    }
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
    page_size: i32,
}

impl Reconciler {
    pub fn new(store: Arc<Store>, cache: Option<Cache>) -> Reconciler {
        Reconciler {
            store,
            cache,
            max_fence_losses: DEFAULT_MAX_FENCE_LOSSES,
            lag_grace: DEFAULT_LAG_GRACE,
            page_size: PAGE_SIZE,
        }
    }

    /// Gives up on a target (for now) after losing a bucket's fence this
    /// many times.
    pub fn with_max_fence_losses(mut self, losses: u32) -> Reconciler {
        self.max_fence_losses = losses.max(1);
        self
    }

    /// Rows that changed less than this long ago are in flight, not drift.
    pub fn with_lag_grace(mut self, grace: Duration) -> Reconciler {
        self.lag_grace = grace;
        self
    }

    /// Rows read at once, of applied rows and of rows of `reactions` each:
    /// what bounds reconcile's memory.
    pub fn with_page_size(mut self, rows: i32) -> Reconciler {
        self.page_size = rows.max(2);
        self
    }

    /// Checks and repairs every bucket of one target, and registers it if
    /// anyone has a row for it. A target counted but missing from the
    /// registry (counted by an earlier release's trusted consumer, say) is
    /// served as zeros once its cache entry goes, and votes that find it
    /// counted do not register it; this is the repair. (The sweep walks the
    /// registry, so its targets are in it already.)
    pub async fn target(&self, target: &TargetId, dry_run: bool) -> Result<Report, ReconcileError> {
        if !dry_run && let Some(kind) = self.store.reactions.kind_of(target).await? {
            self.store.targets.register(target, kind).await?;
        }
        let part = Box::pin(self.target_part(target, Bucket::FIRST, dry_run, || false)).await?;
        Ok(part.report)
    }

    /// Checks the buckets of a target from `from` on, in order, and stops
    /// early (answering where to go on) when `pause` says so between two
    /// buckets.
    pub async fn target_part(
        &self,
        target: &TargetId,
        from: Bucket,
        dry_run: bool,
        pause: impl Fn() -> bool,
    ) -> Result<Part, ReconcileError> {
        let layout = self.store.layout;
        let settled_before = SystemTime::now()
            .checked_sub(self.lag_grace)
            .unwrap_or(UNIX_EPOCH);
        let buckets: Vec<Bucket> = layout.buckets().filter(|b| *b >= from).collect();
        // A small target (the common case) is read whole: every head, then
        // all its rows in one page, instead of a page per bucket.
        let mut heads = Vec::with_capacity(buckets.len());
        for b in &buckets {
            heads.push(self.store.stats.head(target, *b, ReadAt::Quorum).await?);
        }
        let ring = (i64::MIN, i64::MAX);
        let everything = self
            .store
            .reactions
            .by_target(target, ring, self.page_size)
            .await?;
        // A large one's heads are read again, each just before its bucket's
        // walk: by then the ones read here may be long stale.
        let small = everything.read < self.page_size as usize;
        let everything = everything.rows;
        let mut report = Report::empty(target);
        let mut unwritten = Vec::new();
        for (i, (bucket, head)) in buckets.iter().zip(heads).enumerate() {
            if i > 0 && pause() {
                self.drop_entry_behind(target, &unwritten, dry_run).await;
                return Ok(Part {
                    report,
                    next: Some(*bucket),
                });
            }
            let head = small.then_some(head);
            let known = small.then(|| {
                let (lo, hi) = layout.range(*bucket);
                everything
                    .iter()
                    .filter(|(t, _, _)| (lo..=hi).contains(t))
                    .cloned()
                    .collect::<Vec<_>>()
            });
            let mut pass = BucketPass {
                reconciler: self,
                target,
                bucket: *bucket,
                dry_run,
                settled_before,
                found: Found::default(),
            };
            let found = match pass.run(head, known).await {
                Ok(found) => found,
                Err(e) => {
                    // The buckets before this one are checked: an entry
                    // behind them need not wait for a check that gets past
                    // this one, which a damaged bucket may never allow.
                    self.drop_entry_behind(target, &unwritten, dry_run).await;
                    return Err(e);
                }
            };
            unwritten.extend(found.unwritten.map(|seq| (*bucket, seq)));
            report.add(found);
        }
        self.drop_entry_behind(target, &unwritten, dry_run).await;
        self.record(target, &report, dry_run);
        Ok(Part { report, next: None })
    }

    /// Drops the target's cache entry if its base of a bucket reconcile
    /// found counted is older than that bucket's head. A write that landed
    /// without its write through leaves such an entry: its writer was
    /// killed between the two, or owed the entry a drop and was killed
    /// before Redis took it (the drops owed live in the process). No write
    /// of the bucket may ever come to fix it, so every check fixes it, for
    /// the buckets it got through.
    async fn drop_entry_behind(&self, target: &TargetId, heads: &[(Bucket, i64)], dry_run: bool) {
        let Some(cache) = self
            .cache
            .as_ref()
            .filter(|_| !dry_run && !heads.is_empty())
        else {
            return;
        };
        match cache.drop_if_behind_once(target, heads).await {
            Ok(Behind::Dropped) => {
                metrics::counter!(crate::metrics::RECONCILE_ENTRIES_BEHIND).increment(1);
                tracing::info!(target_id = %target, "cache entry behind the durable totals dropped");
            }
            Ok(Behind::Pending | Behind::Settled) => {}
            // The next check makes the same test.
            Err(e) => {
                tracing::warn!(target_id = %target, error = format!("{:#}", anyhow::Error::new(e)), "could not check the cache entry against the durable totals");
            }
        }
    }

    fn record(&self, target: &TargetId, report: &Report, dry_run: bool) {
        metrics::counter!(crate::metrics::RECONCILE_CHECKED).increment(1);
        if report.users_in_flight > 0 {
            // Lag, or a transition lost less than the grace ago: either way
            // it is counted now, and said so.
            tracing::info!(target_id = %target, users_in_flight = report.users_in_flight, counted = report.repaired, "rows within the lag grace counted ahead of the consumer");
        }
        if !report.drifted {
            return;
        }
        metrics::counter!(crate::metrics::DRIFT_FOUND).increment(1);
        if dry_run {
            tracing::warn!(target_id = %target, before = %report.totals_before, after = %report.totals_after, users_behind = report.users_behind, "drift found (dry run: not repaired)");
            return;
        }
        metrics::counter!(crate::metrics::DRIFT_REPAIRED).increment(1);
        tracing::warn!(
            target_id = %target, before = %report.totals_before, after = %report.totals_after,
            users_behind = report.users_behind, "drift found and repaired"
        );
    }

    /// Whether Cassandra answers a read at QUORUM. A check that failed while
    /// it does failed on its target (a damaged row, a partition too costly
    /// to read), and a sweep passes over it rather than stopping there for
    /// good; with a quorum lost, every target would fail alike.
    pub async fn store_answers(&self) -> bool {
        self.store.answers_at_quorum().await
    }

    /// Sweeps every target in the registry, in token order, at most `rate`
    /// per second, from the checkpoint `name` (unless `restart`). Saves the
    /// checkpoint after every page, inside a large target every
    /// `CHECKPOINT_EVERY` and when stopped, and clears it when the sweep
    /// completes. A target whose check fails while a quorum answers is
    /// passed over and reported.
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
        let mut cp = resumed.clone().unwrap_or_default();
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
                // A sweep stopped inside this target goes on from its bucket.
                let mut from = match &cp.in_target {
                    Some((id, b)) if id == target.as_str() => self
                        .store
                        .layout
                        .bucket(i64::from(*b))
                        .unwrap_or(Bucket::FIRST),
                    _ => Bucket::FIRST,
                };
                let mut report = Report::empty(&target);
                let mut saved = Instant::now();
                let ended = loop {
                    let pause = || *stop.borrow() || saved.elapsed() >= CHECKPOINT_EVERY;
                    // Boxed: the walk's future nests deep enough to need the heap.
                    let part = Box::pin(self.target_part(&target, from, options.dry_run, pause));
                    match part.await {
                        Ok(part) => {
                            report.merge(part.report);
                            let Some(next) = part.next else {
                                break Ok(());
                            };
                            cp.in_target = Some((target.to_string(), next.index()));
                            targets.save_checkpoint(&options.name, &cp).await?;
                            saved = Instant::now();
                            if *stop.borrow() {
                                return Ok(summary);
                            }
                            from = next;
                        }
                        Err(e) => break Err(e),
                    }
                };
                cp.in_target = None;
                match ended {
                    Ok(()) => {}
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
                    Err(ReconcileError::Store(e)) if self.store_answers().await => {
                        summary.fail(&target, e);
                        cp.last_token = Some(token);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
                cp.checked += 1;
                if report.drifted {
                    cp.drifted += 1;
                }
                summary.record(report);
                cp.last_token = Some(token);
                on_progress(&SweepStatus {
                    checked: cp.checked,
                    drifted: cp.drifted,
                    fraction: token_fraction(token),
                });
            }
            targets.save_checkpoint(&options.name, &cp).await?;
        }
    }
}

/// How long after its row changed a vote may still be counting the change
/// in the cache: the longest `tally vote` lets a vote take (30 s; 20 s with
/// the default settings: its 8 s deadline, two Cassandra requests of 5 s,
/// the cache step's 2 s), with room for the clocks of the hosts to disagree.
const VOTE_CACHE_WINDOW: Duration =
    crate::cast::LONGEST_VOTE.saturating_add(crate::cast::CLOCK_ROOM);

/// How often a sweep inside one large target saves where it is.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(10);

/// Rows per page, of applied rows and of `reactions` each.
pub const PAGE_SIZE: i32 = 1000;

/// What checking part of a target found, and where it stopped.
#[derive(Debug, Clone)]
pub struct Part {
    pub report: Report,
    /// The bucket to go on from, if it paused before the last.
    pub next: Option<Bucket>,
}

/// What one bucket's passes found and did.
#[derive(Debug, Clone, Copy, Default)]
struct Found {
    before: Totals,
    after: Totals,
    behind: usize,
    in_flight: usize,
    damaged_totals: bool,
    writes: u32,
    /// The bucket's seq, when its passes found it counted and wrote
    /// nothing.
    unwritten: Option<i64>,
}

/// A row of `reactions` as a page reads it: the user's token, the user,
/// and the row.
type TruthRow = (i64, UserId, Counted);

/// One bucket's check: passes over its token range until one completes
/// without losing the fence.
struct BucketPass<'a> {
    reconciler: &'a Reconciler,
    target: &'a TargetId,
    bucket: Bucket,
    dry_run: bool,
    /// Rows changed at or after this are in flight.
    settled_before: SystemTime,
    /// Counts of the pages whose repairs landed, across passes.
    found: Found,
}

/// Where a pass stands: the bucket's fence and totals as our own writes
/// left them, and the sum of the applied states walked so far.
struct Walk {
    seq: Option<i64>,
    stored: Totals,
    target_type: Option<TargetType>,
    recount: Totals,
}

impl BucketPass<'_> {
    /// `head`, if given, was read before `known` (a small target's rows,
    /// read whole); both serve only the first pass, later ones read afresh.
    async fn run(
        &mut self,
        mut head: Option<Head>,
        mut known: Option<Vec<TruthRow>>,
    ) -> Result<Found, ReconcileError> {
        let store = &self.reconciler.store;
        let mut lost = 0;
        let mut at = ReadAt::Quorum;
        let mut first = true;
        loop {
            if lost >= self.reconciler.max_fence_losses {
                return Err(ReconcileError::Contention(self.target.to_string()));
            }
            // A dry run's pass that finds the bucket moved under it is done
            // again from what the passes before it found.
            let found_before = self.found;
            let (h, read_at) = match head.take() {
                Some(h) => (h, ReadAt::Quorum),
                None => (store.stats.head(self.target, self.bucket, at).await?, at),
            };
            if first {
                self.found.before = h.totals;
                first = false;
            }
            // A pass after a lost fence completes any Paxos round in flight.
            at = ReadAt::Serial;
            let mut walk = Walk {
                seq: h.seq,
                stored: h.totals,
                target_type: h.target_type,
                recount: Totals::default(),
            };
            if self.walk(&mut walk, known.take()).await? == Landed::Lost {
                lost += 1;
                continue;
            }
            // The bucket is counted: totals that differ from the sum of its
            // applied states were damaged, and are replaced by that sum.
            // That write is conditioned on the fence alone, so it is decided
            // only by a pass that began at SERIAL: a commit that had
            // reached one replica (seen in the head, missed by a page) is
            // then on a quorum before any row is read. A dry run writes
            // nothing, and a second pass would count its findings twice.
            if walk.recount != walk.stored && read_at == ReadAt::Quorum && !self.dry_run {
                continue;
            }
            // Nothing fences a dry run's findings (rows behind their count,
            // damaged totals): they stand only if the bucket did not move
            // while it was walked, or its head, its rows and its applied
            // rows would be of different moments (a small target's rows are
            // read before its applied rows, and a count landing between
            // looks like a user counted past their row). Read at SERIAL, so
            // a write still in flight is seen.
            let found_any = walk.recount != walk.stored || self.found.behind > found_before.behind;
            if self.dry_run && found_any {
                let now = store
                    .stats
                    .head(self.target, self.bucket, ReadAt::Serial)
                    .await?;
                if now.seq != walk.seq {
                    self.found = found_before;
                    lost += 1;
                    continue;
                }
            }
            if walk.recount != walk.stored {
                if !self.dry_run {
                    let recount = walk.recount;
                    // A real run keeps what its landed pages repaired.
                    if self.write(&mut walk, recount, (&[], &[]), &[]).await? == Landed::Lost {
                        lost += 1;
                        continue;
                    }
                }
                self.found.damaged_totals = true;
            }
            self.found.after = walk.recount;
            // The seq this pass ends at, if it wrote nothing: an earlier
            // pass's write whose outcome was unknown may have landed without
            // its write through, and the entry is then behind this seq.
            if self.found.writes == found_before.writes {
                self.found.unwritten = walk.seq;
            }
            return Ok(self.found);
        }
    }

    /// Walks the bucket's token range a page at a time, repairing as it goes.
    async fn walk(
        &mut self,
        walk: &mut Walk,
        known: Option<Vec<TruthRow>>,
    ) -> Result<Landed, ReconcileError> {
        let store = &self.reconciler.store;
        let limit = self.reconciler.page_size;
        let (lo, hi) = store.layout.range(self.bucket);
        let mut from = lo;
        let full = |n: usize| n >= limit as usize;
        loop {
            let mut applied = store
                .stats
                .applied_page(self.target, self.bucket, (from, hi), limit)
                .await?;
            let (mut truth, truth_end) = match &known {
                Some(rows) => (rows.iter().filter(|r| r.0 >= from).cloned().collect(), None),
                None => {
                    let page = store
                        .reactions
                        .by_target(self.target, (from, hi), limit)
                        .await?;
                    // Where the read stopped, counting rows it could not
                    // read: a page they filled is full all the same.
                    let end = page.last_token.filter(|_| full(page.read));
                    (page.rows, end)
                }
            };
            // A read that filled its page may have stopped inside a token;
            // the page ends before the first token either read may not have
            // finished, and the next one starts there.
            let applied_end = applied
                .last()
                .map(|r| r.token)
                .filter(|_| full(applied.len()));
            let end = applied_end.into_iter().chain(truth_end).min();
            if let Some(e) = end {
                if e == from {
                    return Err(StoreError::Corrupt(format!(
                        "more than {limit} users of target {} share token {e}",
                        self.target
                    ))
                    .into());
                }
                applied.retain(|r| r.token < e);
                truth.retain(|r| r.0 < e);
            }
            if self.page(walk, applied, truth).await? == Landed::Lost {
                return Ok(Landed::Lost);
            }
            match end {
                Some(e) => from = e,
                None => return Ok(Landed::Written),
            }
        }
    }

    /// Folds one page of rows into its applied rows and writes what changed.
    async fn page(
        &mut self,
        walk: &mut Walk,
        applied: Vec<AppliedRow>,
        truth: Vec<TruthRow>,
    ) -> Result<Landed, ReconcileError> {
        let store = &self.reconciler.store;
        let base: HashMap<UserId, Applied> =
            applied.into_iter().map(|r| (r.user, r.applied)).collect();
        let truth: HashMap<UserId, Counted> = truth.into_iter().map(|(_, u, c)| (u, c)).collect();
        // Applied rows of users with no row in `reactions`, confirmed one by
        // one by key (an index read could miss a row; a key read cannot).
        let mut ghosts = Vec::new();
        for (user, a) in &base {
            if !truth.contains_key(user)
                && *a != Applied::NEVER
                && store
                    .reactions
                    .states(user, std::slice::from_ref(self.target))
                    .await?
                    .is_empty()
            {
                ghosts.push(user.clone());
            }
        }
        let mut plan = Ledger::new(Totals::default(), base.clone());
        for (user, row) in &truth {
            plan.correct_row(user, row.current.version, row.current.state);
        }
        for user in &ghosts {
            plan.forget(user);
        }
        let behind: Vec<UserId> = plan.changed.iter().cloned().collect();
        let in_flight = behind
            .iter()
            .filter(|u| {
                truth.get(*u).is_some_and(|row| {
                    // Only a row ahead of its count can be lag; one counted
                    // at its own version with another state is damage.
                    let counted = base.get(*u).map_or(0, |a| a.version);
                    row.current.version > counted
                        && row.updated_at.is_some_and(|t| t >= self.settled_before)
                })
            })
            .count();
        // Rows ahead of their count that changed so recently that their
        // vote may not have counted them in the cache yet: the cache is
        // told, so that the vote's late change does not count them twice.
        let recent = SystemTime::now()
            .checked_sub(VOTE_CACHE_WINDOW)
            .unwrap_or(UNIX_EPOCH);
        let ahead: HashMap<&UserId, i64> = truth
            .iter()
            .filter(|(u, row)| {
                row.current.version > base.get(*u).map_or(0, |a| a.version)
                    && row.updated_at.is_some_and(|t| t >= recent)
            })
            .map(|(u, row)| (u, row.current.version))
            .collect();
        // Chunks, each self-consistent: its totals move by exactly the users
        // it writes. A dry run moves them the same way, unwritten.
        for chunk in plan.changed_rows().chunks(MAX_USERS_PER_WRITE) {
            // The rows as the page read them: what the write is conditioned
            // on, and what the totals move from.
            let before: Vec<Option<Applied>> =
                chunk.iter().map(|(u, _)| base.get(u).copied()).collect();
            let was = Totals::count(before.iter().map(|b| b.unwrap_or(Applied::NEVER).state));
            let now = Totals::count(chunk.iter().map(|(_, a)| a.state));
            let totals = walk.stored.minus(was).plus(now);
            if self.dry_run {
                walk.stored = totals;
            } else {
                let chunk_ahead: Vec<(UserId, i64)> = chunk
                    .iter()
                    .filter_map(|(u, _)| ahead.get(u).map(|v| (u.clone(), *v)))
                    .collect();
                if self
                    .write(walk, totals, (chunk, &before), &chunk_ahead)
                    .await?
                    == Landed::Lost
                {
                    return Ok(Landed::Lost);
                }
            }
        }
        walk.recount = walk.recount.plus(plan.recount());
        self.found.behind += behind.len() - in_flight;
        self.found.in_flight += in_flight;
        Ok(Landed::Written)
    }

    /// One fenced write, chained on the seq of the walk's last one, of
    /// `users` whose applied rows held `before` when the page read them.
    async fn write(
        &mut self,
        walk: &mut Walk,
        totals: Totals,
        (users, before): (&[(UserId, Applied)], &[Option<Applied>]),
        ahead: &[(UserId, i64)],
    ) -> Result<Landed, ReconcileError> {
        let store = &self.reconciler.store;
        let proposal = FencedWrite {
            read_seq: walk.seq,
            totals,
            target_type: walk.target_type,
            users,
            before,
        };
        let place = (self.target, self.bucket);
        match fence::land(
            &store.stats,
            self.reconciler.cache.as_ref(),
            place,
            &proposal,
            ahead,
        )
        .await
        {
            Cas::Applied => {
                walk.seq = Some(walk.seq.unwrap_or(0) + 1);
                walk.stored = totals;
                self.found.writes += 1;
                Ok(Landed::Written)
            }
            Cas::NotApplied => Ok(Landed::Lost),
            Cas::Unknown(e) => {
                tracing::warn!(target_id = %self.target, bucket = %self.bucket, error = format!("{e:#}"), "stats write outcome unknown; starting the bucket again at SERIAL");
                Ok(Landed::Lost)
            }
            Cas::Failed(e) => Err(StoreError::Request(e).into()),
        }
    }
}

/// Whether a step's writes landed, or the fence moved under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Landed {
    Written,
    Lost,
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
    pub checked: i64,
    pub drifted: i64,
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
    /// Targets whose check failed while Cassandra answered, passed over.
    pub targets_failed: u64,
    pub failed: Vec<Failed>,
    /// Users counted ahead of the consumer, within the lag grace (not drift).
    pub users_in_flight: u64,
    pub corrections: Vec<Report>,
    /// The token this run resumed after, if it resumed.
    pub resumed_from: Option<i64>,
    /// False when the sweep was stopped before the end.
    pub complete: bool,
}

/// A target whose check failed, and why.
#[derive(Debug, Clone, Serialize)]
pub struct Failed {
    pub target_id: String,
    pub error: String,
}

impl SweepSummary {
    /// Records a target whose check failed, and logs why.
    pub fn fail(&mut self, target: &TargetId, e: StoreError) {
        let error = format!("{:#}", anyhow::Error::new(e));
        tracing::error!(target_id = %target, error = %error, "target not checked; passed over");
        self.targets_failed += 1;
        if self.failed.len() < MAX_LISTED {
            self.failed.push(Failed {
                target_id: target.to_string(),
                error,
            });
        }
    }

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
