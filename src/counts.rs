//! Serving totals: the Redis cache first, the durable totals on a miss,
//! refilling the cache without ever lowering an entry.

use std::sync::Arc;

use futures::future::try_join_all;

use crate::cache::Cache;
use crate::domain::{Delta, TargetId, Totals};
use crate::store::Store;
use crate::store::StoreError;

#[derive(Clone)]
pub struct Counts {
    pub cache: Cache,
    store: Arc<Store>,
}

impl Counts {
    pub fn new(cache: Cache, store: Arc<Store>) -> Counts {
        Counts { cache, store }
    }

    /// Totals for many targets: one Redis round trip, then one durable read
    /// per miss, in parallel (one partition each, never a multi-partition IN).
    /// With Redis down every target is read from Cassandra.
    pub async fn get_many(&self, targets: &[TargetId]) -> Result<Vec<Totals>, StoreError> {
        let cached = match self.cache.get_many(targets).await {
            Ok(c) => {
                let hits = c.iter().filter(|h| h.is_some()).count() as u64;
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "hit").increment(hits);
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "miss")
                    .increment(c.len() as u64 - hits);
                c
            }
            Err(e) => {
                metrics::counter!(crate::metrics::CACHE_LOOKUPS, "result" => "error")
                    .increment(targets.len() as u64);
                tracing::warn!(error = %e, "count cache unreadable; serving durable totals");
                vec![None; targets.len()]
            }
        };
        let fills = targets.iter().zip(cached).map(|(target, hit)| async move {
            match hit {
                Some(t) => Ok(t),
                None => {
                    let durable = self.store.stats.totals(target).await?;
                    Ok(self
                        .cache
                        .fill_then_apply(target, durable, Delta::default())
                        .await
                        .unwrap_or(durable))
                }
            }
        });
        try_join_all(fills).await
    }

    pub async fn get(&self, target: &TargetId) -> Result<Totals, StoreError> {
        let mut all = self.get_many(std::slice::from_ref(target)).await?;
        Ok(all.pop().unwrap_or_default())
    }

    /// Applies a committed change to the cache. Must run before the change is
    /// published: a miss refills from the durable totals, which cannot yet
    /// include this change, so the delta is counted exactly once. A cache
    /// failure costs freshness until the entry expires, never the vote.
    pub async fn apply_committed(&self, target: &TargetId, delta: Delta) {
        if delta.is_zero() {
            return;
        }
        let result = match self.cache.apply(target, delta).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => match self.store.stats.totals(target).await {
                Ok(durable) => self
                    .cache
                    .fill_then_apply(target, durable, delta)
                    .await
                    .map(|_| ()),
                Err(e) => {
                    tracing::warn!(target_id = %target, error = %e, "no durable totals to refill the cache from");
                    Ok(())
                }
            },
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::warn!(target_id = %target, error = %e, "count cache not updated; it catches up when the entry expires");
        }
    }
}
