//! Serving totals: the Redis cache first, the durable totals on a miss,
//! refilling the cache without ever lowering an entry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::{Shared, try_join_all};
use tokio::sync::oneshot;

use crate::cache::{Cache, Counted, Fence, Pending};
use crate::domain::{TargetId, Totals};
use crate::store::Store;
use crate::store::StoreError;
use crate::store::stats::Heads;

#[derive(Clone)]
pub struct Counts {
    pub cache: Cache,
    store: Arc<Store>,
    /// Cassandra reads for cache misses, at most `MISS_READS` at once in
    /// the process: a flood of misses (a cold cache, a Redis outage, pages
    /// of never-seen ids) queues here instead of taking every stream the
    /// driver has, which votes need too.
    misses: Arc<tokio::sync::Semaphore>,
    /// Fills in flight in the process, by target and fence: a miss armed
    /// with the fence a fill in flight read under waits for that fill
    /// instead of reading the same heads again. When a popular entry
    /// expires or Redis comes back empty, every page holding it misses at
    /// once, and each read 17 partitions of Cassandra for one answer.
    flights: Arc<Mutex<HashMap<(TargetId, Fence), Flight>>>,
}

/// What a page's lookup in the cache told of its misses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lookup {
    /// Redis answered, and the entry had no value.
    FoundEmpty,
    /// Redis did not answer: the entry may have been filled already.
    Failed,
}

/// What a miss does about the fill of its entry in flight, if any.
enum Turn {
    Join(Flight),
    Alone,
    /// Fills the entry, and tells the misses that join what it served.
    Lead(oneshot::Sender<Totals>),
}

/// What the fill in flight served, for the misses that joined it; its
/// sender is dropped unsent when the fill did not land in the entry.
type Flight = Shared<oneshot::Receiver<Totals>>;

/// Cache misses read from Cassandra at once, per process.
pub const MISS_READS: usize = 64;

/// Fills a vote's change tries when the entry is dropped between its fence
/// and its fill, within the change's budget: the voter should read their
/// own vote, which the next read's fill may not count until the consumer
/// has.
const FILL_TRIES: usize = 3;

impl Counts {
    pub fn new(cache: Cache, store: Arc<Store>) -> Counts {
        Counts::with_miss_reads(cache, store, MISS_READS)
    }

    /// At most `miss_reads` Cassandra reads for misses at once.
    pub fn with_miss_reads(cache: Cache, store: Arc<Store>, miss_reads: usize) -> Counts {
        Counts {
            cache,
            store,
            misses: Arc::new(tokio::sync::Semaphore::new(miss_reads)),
            flights: Arc::default(),
        }
    }

    /// Slots for miss reads not taken at the moment.
    pub fn idle_miss_reads(&self) -> usize {
        self.misses.available_permits()
    }

    /// The same counts over other clients (an HTTP worker's own), under the
    /// same process-wide limit on miss reads.
    pub fn on(&self, cache: Cache, store: Arc<Store>) -> Counts {
        Counts {
            cache,
            store,
            misses: self.misses.clone(),
            flights: self.flights.clone(),
        }
    }

    /// Totals for many targets: one Redis round trip, then, per miss, the
    /// target's registry row and, if it has one, every bucket's head (an IN
    /// over that target's own partitions, the statics only, never the
    /// voters). With Redis down every target is read from Cassandra.
    pub async fn get_many(&self, targets: &[TargetId]) -> Result<Vec<Totals>, StoreError> {
        let (cached, seen) = match self.cache.get_many(targets).await {
            Ok(c) => {
                let hits = c.iter().filter(|h| h.is_some()).count() as u64;
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "hit").increment(hits);
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "miss")
                    .increment(c.len() as u64 - hits);
                (c, Lookup::FoundEmpty)
            }
            Err(e) => {
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "error")
                    .increment(targets.len() as u64);
                tracing::warn!(error = %e, "count cache unreadable; serving durable totals");
                (vec![None; targets.len()], Lookup::Failed)
            }
        };
        // Only the misses become futures: a page of hits is served with no
        // more work than copying them out.
        let misses: Vec<usize> = (0..targets.len())
            .filter(|&i| cached[i].is_none())
            .collect();
        if misses.is_empty() {
            return Ok(cached.into_iter().map(Option::unwrap_or_default).collect());
        }
        // Every miss's fence, armed before its heads are read (see
        // `Cache::fill`); with Redis out of reach nothing is filled.
        let missed: Vec<&TargetId> = misses.iter().map(|&i| &targets[i]).collect();
        let fences = self.cache.arm_many(&missed).await.ok();
        let filled = try_join_all(
            missed
                .iter()
                .enumerate()
                .map(|(j, t)| self.fill(t, fences.as_ref().map(|f| &f[j]), seen)),
        )
        .await?;
        let mut totals: Vec<Totals> = cached.into_iter().map(Option::unwrap_or_default).collect();
        for (i, t) in misses.into_iter().zip(filled) {
            totals[i] = t;
        }
        Ok(totals)
    }

    /// A miss: every bucket's head from Cassandra, then into the cache
    /// under the entry's fence, or what a fill in flight under the same
    /// fence put there. An entry dropped since the fence was armed is left
    /// alone, and this read is served the heads.
    async fn fill(
        &self,
        target: &TargetId,
        fence: Option<&Fence>,
        seen: Lookup,
    ) -> Result<Totals, StoreError> {
        let Some(fence) = fence else {
            return Ok(self.read_heads(target).await?.totals());
        };
        let key = (target.clone(), fence.clone());
        let turn = {
            let mut flights = self.flights.lock().unwrap_or_else(|e| e.into_inner());
            match flights.get(&key) {
                // Only a miss that found the entry empty may join: one whose
                // lookup failed may come after the fill in flight landed,
                // and after a vote counted on top of it.
                Some(flight) if seen == Lookup::FoundEmpty => Turn::Join(flight.clone()),
                Some(_) => Turn::Alone,
                None => {
                    let (landed, flight) = oneshot::channel();
                    flights.insert(key.clone(), flight.shared());
                    Turn::Lead(landed)
                }
            }
        };
        match turn {
            // The same fence means no drop came between the fill's arming
            // and this miss's, and the fill lands after this miss found the
            // entry empty: what it serves counts every write through that
            // reached the entry before this page could be answered.
            Turn::Join(flight) => match flight.await {
                Ok(served) => {
                    metrics::counter!(crate::metrics::CACHE_FILLS, "read" => "joined").increment(1);
                    Ok(served)
                }
                // That fill failed, was cut short, found the entry dropped
                // or found it filled: look again, then read on this miss's
                // own.
                Err(_) => match self.filled_meanwhile(target).await {
                    Some(served) => Ok(served),
                    None => Ok(self.fill_alone(target, fence).await?.0),
                },
            },
            Turn::Alone => Ok(self.fill_alone(target, fence).await?.0),
            Turn::Lead(landed) => {
                let _leaving = Leaving {
                    flights: &self.flights,
                    key,
                };
                let (served, in_entry) = self.fill_alone(target, fence).await?;
                if in_entry {
                    let _ = landed.send(served);
                }
                Ok(served)
            }
        }
    }

    /// A fill of this miss's own: what it serves, and whether that is what
    /// the entry holds (the fence held). A miss that had to wait for a slot
    /// looks in the cache again first: in a flood of misses (Redis restarted
    /// empty, a cold page everyone opens) another page, here or in another
    /// process, has often filled the entry meanwhile, and that answer is as
    /// good as a hit. It is not passed to the misses that joined this one:
    /// the entry may expire after this look, and a miss that finds it empty
    /// then would be handed a value older than its lookup. They look again
    /// themselves.
    async fn fill_alone(
        &self,
        target: &TargetId,
        fence: &Fence,
    ) -> Result<(Totals, bool), StoreError> {
        let turn = match self.misses.try_acquire() {
            Ok(turn) => Some(turn),
            Err(_) => {
                let turn = self.misses.acquire().await.ok();
                if let Some(served) = self.filled_meanwhile(target).await {
                    return Ok((served, false));
                }
                turn
            }
        };
        let heads = self.durable_heads(target).await?;
        drop(turn);
        match self.cache.fill(target, fence, &heads).await {
            Ok(Some(served)) => Ok((served, true)),
            Ok(None) => {
                metrics::counter!(crate::metrics::CACHE_FILLS_FENCED, "step" => "read")
                    .increment(1);
                Ok((heads.totals(), false))
            }
            Err(_) => Ok((heads.totals(), false)),
        }
    }

    /// The entry's value, if a fill or a vote put one there since this
    /// miss's lookup; `None` if it is still empty or Redis did not answer.
    async fn filled_meanwhile(&self, target: &TargetId) -> Option<Totals> {
        let found = self
            .cache
            .get_many(std::slice::from_ref(target))
            .await
            .ok()?
            .pop()
            .flatten()?;
        metrics::counter!(crate::metrics::CACHE_FILLS, "read" => "cache").increment(1);
        Some(found)
    }

    /// The durable heads, under the process's limit on miss reads.
    async fn read_heads(&self, target: &TargetId) -> Result<Heads, StoreError> {
        let _turn = self.misses.acquire().await;
        self.durable_heads(target).await
    }

    /// Every bucket's head, or, for a target the registry has no row for,
    /// empty heads without reading a bucket: most ids on a page were never
    /// reacted to, and one partition read costs a sixteenth of the heads'.
    /// Empty heads are what the buckets held when the registry was read
    /// (see `Targets::has_reactions`); like any heads, they fill with seq 0,
    /// below every write of a bucket, so a write through since is kept.
    async fn durable_heads(&self, target: &TargetId) -> Result<Heads, StoreError> {
        if !self.store.targets.has_reactions(target).await? {
            metrics::counter!(crate::metrics::CACHE_FILLS, "read" => "registry").increment(1);
            return Ok(Heads::empty(self.store.layout));
        }
        metrics::counter!(crate::metrics::CACHE_FILLS, "read" => "buckets").increment(1);
        self.store.stats.heads(target).await
    }

    pub async fn get(&self, target: &TargetId) -> Result<Totals, StoreError> {
        let mut all = self.get_many(std::slice::from_ref(target)).await?;
        Ok(all.pop().unwrap_or_default())
    }

    /// Counts a committed change in the cache, ahead of the consumer. Runs
    /// before the change is published, and Redis refuses it once its
    /// deadline has passed, so the consumer's write of the same change can
    /// never land before it: if the step failed, it returns the moment
    /// before which a command of it may still land, and the change must not
    /// be published before it. A miss fills from the durable heads first,
    /// under the entry's fence (see `Cache::apply`). A cache failure never
    /// costs the vote: the entry is owed a drop, so that it is filled again
    /// from the durable totals even if the consumer's write through of the
    /// change fails as well and its process dies.
    pub async fn apply_committed(
        &self,
        target: &TargetId,
        change: &Pending<'_>,
    ) -> Option<tokio::time::Instant> {
        // One deadline for the whole step, which Redis enforces too: after
        // it the change may be published, and the consumer's write of it may
        // land before a late command would.
        let deadline = self.cache.change_deadline();
        let started = tokio::time::Instant::now();
        let layout = self.store.layout;
        let step = async {
            for _ in 0..FILL_TRIES {
                let fence = match self
                    .cache
                    .apply(target, change, layout, None, deadline)
                    .await?
                {
                    Counted::NeedsHeads(fence) => fence,
                    Counted::Yes | Counted::Dropped => return Ok(()),
                };
                let heads = match self.store.stats.heads(target).await {
                    Ok(heads) => heads,
                    Err(e) => {
                        tracing::warn!(target_id = %target, error = %e, "no durable totals to fill the cache from");
                        return Ok(());
                    }
                };
                if self
                    .cache
                    .apply(target, change, layout, Some((&fence, &heads)), deadline)
                    .await?
                    != Counted::Dropped
                {
                    return Ok(());
                }
                metrics::counter!(crate::metrics::CACHE_FILLS_FENCED, "step" => "vote")
                    .increment(1);
            }
            // Left to the next read, which fills the entry from heads read
            // after the drops, and to the consumer's write of this change.
            Ok(())
        };
        let budget = self.cache.change_budget();
        let result = match tokio::time::timeout(budget, step).await {
            Ok(result) => result,
            Err(_) => {
                // Cut short, maybe with a Redis call in flight that may yet land.
                self.cache.owe(target);
                Err(crate::cache::CacheError::Timeout(budget))
            }
        };
        match result {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(target_id = %target, error = %e, "count cache not updated; the entry is dropped once Redis answers, and the consumer's write of this change corrects it");
                // A call that timed out on this side (each has its own
                // timeout, shorter than the budget) may still run in Redis
                // until the deadline, which Redis reads on its own clock:
                // the whole budget covers both.
                Some(started + budget)
            }
        }
    }
}

/// Takes a fill's flight out of the map when the fill ends, however it ends
/// (a page whose client hung up drops it mid-read): misses after it arm
/// and read again.
struct Leaving<'a> {
    flights: &'a Mutex<HashMap<(TargetId, Fence), Flight>>,
    key: (TargetId, Fence),
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.flights
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}
