//! The outbox relay: publishes every committed transition that did not reach
//! Kafka when it was cast (the process died, the client left, Kafka was
//! down), so the totals never need reconcile to heal a lost publish.
//!
//! It runs inside every `tally vote`, not as a process of its own: wherever
//! votes are taken, their transitions are looked after, and an instance that
//! never comes back strands nothing, because every relay reads every shard.
//! Two relays publishing one transition is harmless: the consumer counts each
//! version once.
//!
//! A pass walks the outbox's time buckets from the checkpoint up to the last
//! one that has settled (older than `settle`, which is longer than a vote may
//! take). For each unresolved intent it reads the key's record at
//! LOCAL_SERIAL (SERIAL with `--serial-consistency serial`), which completes any Paxos round still in flight, so the
//! answer is final: no record, or a record without a transition, means
//! nothing to publish; a transition the consumer has already applied needs
//! nothing either; anything else is published. Resolved intents are marked,
//! and the checkpoint moves past every bucket with nothing left.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::bus::publisher::Publisher;
use crate::domain::{Transition, UserId};
use crate::store::outbox::{Intent, SHARDS, Slot, bucket_at, bucket_start};
use crate::store::{Store, StoreError};
use futures::StreamExt;

/// Settings of the relay, part of `tally vote`'s.
#[derive(clap::Args, Debug, Clone)]
pub struct RelayConfig {
    /// How old an intent must be before the relay checks it: longer than a
    /// vote may take (`CastConfig::longest_vote`: its deadline, two request
    /// timeouts, and counting the change in the cache), so the relay never
    /// overtakes the vote.
    #[arg(long = "relay-settle", env = "TALLY_RELAY_SETTLE", default_value = "25s", value_parser = crate::cli::values::duration_above_zero)]
    pub settle: Duration,

    /// How often the relay makes a pass.
    #[arg(long = "relay-interval", env = "TALLY_RELAY_INTERVAL", default_value = "2s", value_parser = crate::cli::values::duration_above_zero)]
    pub interval: Duration,

    /// How far back a relay with no checkpoint starts.
    #[arg(long = "relay-horizon", env = "TALLY_RELAY_HORIZON", default_value = "15m", value_parser = crate::cli::values::duration_above_zero)]
    pub horizon: Duration,

    /// Run no relay in this process (another instance must run one).
    #[arg(long = "no-relay", env = "TALLY_NO_RELAY")]
    pub disabled: bool,
}

/// Intents a relay checks at once.
const SETTLING: usize = 16;

/// Where every relay resumes; they share one, since each reads every shard.
const CHECKPOINT: &str = "relay";

/// What one pass found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Intents still unresolved (Kafka or Cassandra did not answer).
    pub backlog: u64,
    /// The oldest bucket with an unresolved intent.
    pub oldest: Option<i64>,
    pub published: u64,
    /// The first bucket not yet fully resolved.
    pub frontier: i64,
}

pub struct Relay {
    store: Arc<Store>,
    publisher: Publisher,
    config: RelayConfig,
}

impl Relay {
    pub fn new(store: Arc<Store>, publisher: Publisher, config: RelayConfig) -> Relay {
        Relay {
            store,
            publisher,
            config,
        }
    }

    /// Makes a pass every `interval`, forever. A pass that fails is logged
    /// and the next one starts again from the checkpoint.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut frontier = None;
        loop {
            tick.tick().await;
            match self.pass(frontier).await {
                Ok(pass) => {
                    frontier = Some(pass.frontier);
                    let age = pass.oldest.map_or(0.0, |b| {
                        SystemTime::now()
                            .duration_since(bucket_start(b))
                            .map_or(0.0, |d| d.as_secs_f64())
                    });
                    metrics::gauge!(crate::metrics::OUTBOX_BACKLOG).set(pass.backlog as f64);
                    metrics::gauge!(crate::metrics::OUTBOX_OLDEST_SECONDS).set(age);
                    if pass.published > 0 || pass.backlog > 0 {
                        tracing::info!(
                            published = pass.published,
                            backlog = pass.backlog,
                            oldest_seconds = age,
                            "outbox relay pass"
                        );
                    }
                }
                Err(e) => {
                    frontier = None;
                    tracing::warn!(
                        error = format!("{:#}", anyhow::Error::new(e)),
                        "outbox relay pass failed; retrying"
                    );
                }
            }
        }
    }

    /// One pass, from `frontier` (or the stored checkpoint) to the last
    /// settled bucket.
    pub async fn pass(&self, frontier: Option<i64>) -> Result<Pass, StoreError> {
        let now = SystemTime::now();
        let start = match frontier {
            Some(b) => b,
            None => match self.store.outbox.checkpoint(CHECKPOINT).await? {
                Some(b) => b,
                None => bucket_at(now.checked_sub(self.config.horizon).unwrap_or(now)),
            },
        };
        // Bucket b has settled once all of it is older than `settle`.
        let settled = bucket_at(now.checked_sub(self.config.settle).unwrap_or(now));
        let mut pass = Pass {
            frontier: start,
            ..Pass::default()
        };
        for bucket in start..settled {
            let mut unresolved = 0;
            for shard in 0..SHARDS {
                let open: Vec<Intent> = self
                    .store
                    .outbox
                    .intents(Slot { bucket, shard })
                    .await?
                    .into_iter()
                    .filter(|i| !i.resolved)
                    .collect();
                // Several at once: after an outage the backlog is every vote
                // taken meanwhile, and each check waits on a Paxos read.
                let mut settling = futures::stream::iter(open)
                    .map(|intent| self.settle_and_resolve(intent))
                    .buffer_unordered(SETTLING);
                while let Some(settled) = settling.next().await {
                    match settled? {
                        Ok(published) => pass.published += u64::from(published),
                        Err((user, e)) => {
                            unresolved += 1;
                            tracing::debug!(user = %user, error = format!("{e:#}"), "intent left for the next pass");
                        }
                    }
                }
            }
            if unresolved > 0 {
                pass.backlog += unresolved;
                pass.oldest.get_or_insert(bucket);
            } else if pass.oldest.is_none() {
                pass.frontier = bucket + 1;
            }
        }
        if pass.frontier != start {
            self.store
                .outbox
                .save_checkpoint(CHECKPOINT, pass.frontier)
                .await?;
        }
        Ok(pass)
    }

    /// `settle`, then marks the intent resolved. A failed check leaves the
    /// intent for the next pass (the inner error); a failed mark fails the
    /// pass.
    async fn settle_and_resolve(
        &self,
        intent: Intent,
    ) -> Result<Result<bool, (UserId, anyhow::Error)>, StoreError> {
        match self.settle(&intent).await {
            Ok(published) => {
                self.store
                    .outbox
                    .resolve_now(intent.slot, &intent.user, &intent.key)
                    .await?;
                Ok(Ok(published))
            }
            Err(e) => Ok(Err((intent.user, e))),
        }
    }

    /// Makes sure one intent's transition, if it committed one, is published
    /// or counted. Returns whether it published; an error leaves the intent
    /// for the next pass.
    async fn settle(&self, intent: &Intent) -> anyhow::Result<bool> {
        let record = self
            .store
            .reactions
            .record_serial(&intent.user, &intent.key)
            .await?;
        // The record of a later attempt with the same key (a retry after a
        // 409 or a 503): that attempt's own intent is checked when it has
        // settled, and this one, older, says nothing of when it ends. Taking
        // it from here could publish while that vote is still in flight.
        if let Some(slot) = record.as_ref().and_then(|r| r.intent_slot(&intent.user))
            && slot != intent.slot
        {
            return Ok(false);
        }
        // No record: the vote never committed. No transition: it changed nothing.
        let Some(json) = record.and_then(|r| r.transition) else {
            return Ok(false);
        };
        let transition = match Transition::from_json(json.as_bytes()) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(user = %intent.user, error = %e, "a stored transition does not parse; reconcile repairs its target");
                return Ok(false);
            }
        };
        let bucket = self.store.stats.bucket_of(&transition.user_id);
        let applied = self
            .store
            .stats
            .applied_of(&transition.target_id, bucket, &[&transition.user_id])
            .await?;
        if applied
            .get(&transition.user_id)
            .is_some_and(|a| a.version >= transition.version)
        {
            return Ok(false);
        }
        self.publisher.publish(&transition, "outbox-relay").await?;
        metrics::counter!(crate::metrics::RELAY_PUBLISHED).increment(1);
        Ok(true)
    }
}
