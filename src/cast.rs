//! Casting a vote: one conditional, versioned write per change, the
//! idempotency key and the transition committed with it, then the cache and
//! Kafka.
//!
//! The loop reads the user's row and the key's record, and either replays the
//! recorded answer or writes the change conditioned on the version it read.
//! A lost race re-reads at SERIAL and tries again, within a deadline.
//!
//! Publication is durable: before its first conditional batch a vote writes
//! an intent to the outbox, and the batch stores the transition in the key's
//! record. What happens after the commit (the cache delta, the publish) runs
//! in a task of its own, so a client that leaves cannot cancel it; whatever
//! still does not reach Kafka (a crash, an outage) the relay publishes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::bus::publisher::Publisher;
use crate::cache::Pending;
use crate::counts::Counts;
use crate::domain::{
    Delta, IdempotencyKey, Reaction, TargetId, TargetType, Totals, Transition, UserId,
};
use crate::store::outbox::Slot;
use crate::store::reactions::{Change, KeyRecord, Snapshot};
use crate::store::{Cas, Store, StoreError};

/// One parsed vote.
#[derive(Debug, Clone)]
pub struct Vote {
    pub target_id: TargetId,
    pub target_type: TargetType,
    pub action: Reaction,
}

impl Vote {
    /// Names the request, so a key reused with another body is caught.
    fn hash(&self) -> String {
        let canonical = format!(
            "{}\n{}\n{}",
            self.target_id,
            self.target_type.as_str(),
            self.action
        );
        hex::encode(Sha256::digest(canonical.as_bytes()))
    }
}

/// The answer to a vote: the exact bytes every repeat of its key gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
    pub replayed: bool,
}

#[derive(Serialize)]
struct Body<'a> {
    target_id: &'a str,
    #[serde(flatten)]
    totals: Totals,
    user_state: Reaction,
}

/// Now, as the RFC 3339 string transitions carry.
fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

fn body(target: &TargetId, totals: Totals, state: Reaction) -> Result<String, CastError> {
    let b = Body {
        target_id: target.as_str(),
        totals,
        user_state: state,
    };
    serde_json::to_string(&b).map_err(|e| CastError::Unexpected(e.into()))
}

#[derive(Debug, thiserror::Error)]
pub enum CastError {
    #[error("this Idempotency-Key was already used for a different request")]
    KeyReused,
    #[error("too many concurrent changes to this user's reactions; retry")]
    Contention,
    #[error("Cassandra failed before the vote could commit")]
    Store(#[from] StoreError),
    /// A conditional write may have applied, and the read that would tell
    /// failed too. The client must retry with the same key to learn which.
    #[error("the vote's outcome could not be learned")]
    OutcomeUnknown(#[source] StoreError),
    #[error("the vote could not be cast")]
    Unexpected(#[source] anyhow::Error),
}

#[derive(Debug, Clone)]
pub struct CastConfig {
    /// Conditional writes tried before answering `Contention`.
    pub max_attempts: u32,
    /// No new conditional write starts after this long. The relay waits
    /// longer than this before it decides a vote never committed.
    pub deadline: Duration,
    /// How long an answer waits for Kafka's acknowledgement of its
    /// transition. A healthy Kafka answers in milliseconds, so the answer
    /// follows it; a Kafka that does not answer delays a vote this long and
    /// no longer, and the relay publishes the transition later.
    pub publish_wait: Duration,
}

impl Default for CastConfig {
    fn default() -> Self {
        CastConfig {
            max_attempts: 8,
            deadline: Duration::from_secs(8),
            publish_wait: Duration::from_millis(500),
        }
    }
}

pub struct Caster {
    store: Arc<Store>,
    counts: Counts,
    after: Arc<AfterCommit>,
    config: CastConfig,
}

/// The change the current attempt is trying to commit.
struct Attempt {
    transition: Option<Transition>,
    body: String,
}

/// What runs after a commit, in its own task: nothing the request does
/// (a disconnect, a timeout) can cancel it.
struct AfterCommit {
    store: Arc<Store>,
    counts: Counts,
    publisher: Publisher,
}

impl Caster {
    pub fn new(
        store: Arc<Store>,
        counts: Counts,
        publisher: Publisher,
        config: CastConfig,
    ) -> Caster {
        let after = Arc::new(AfterCommit {
            store: store.clone(),
            counts: counts.clone(),
            publisher,
        });
        Caster {
            store,
            counts,
            after,
            config,
        }
    }

    pub async fn cast(
        &self,
        user: &UserId,
        key: &IdempotencyKey,
        vote: &Vote,
        request_id: &str,
    ) -> Result<Answer, CastError> {
        let hash = vote.hash();
        let started = Instant::now();
        // Written into the key's record, so after an unknown outcome a SERIAL
        // read tells whether this request's own batch is the one that applied.
        let owner = Uuid::new_v4();
        let mut serial = false;
        // Whether the last attempt's outcome is still unknown.
        let mut unknown = false;
        let mut attempt: Option<Attempt> = None;
        let mut intent: Option<Slot> = None;

        for n in 0..=self.config.max_attempts {
            let snap = if unknown {
                let snap = self
                    .learn_outcome(user, &vote.target_id, key, started)
                    .await?;
                let applied = snap.record.as_ref().is_some_and(|r| r.owner == owner);
                crate::metrics::unknown_resolved(if applied { "applied" } else { "not_applied" });
                snap
            } else {
                self.store
                    .reactions
                    .snapshot(user, &vote.target_id, key, serial)
                    .await?
            };

            if let Some(record) = snap.record {
                if record.owner == owner {
                    // Our own write, whose outcome was unknown, did apply.
                    return match attempt {
                        Some(a) => Ok(self.after_commit(a, user, key, intent, request_id).await),
                        None => Err(CastError::Unexpected(anyhow::anyhow!(
                            "lost track of an applied write"
                        ))),
                    };
                }
                if record.request_hash != hash {
                    return Err(CastError::KeyReused);
                }
                self.after.republish(&record, user, key, request_id);
                return Ok(Answer {
                    status: record.status,
                    body: record.body,
                    replayed: true,
                });
            }
            // The read was at SERIAL after any attempt: none of ours applied.
            unknown = false;
            if n == self.config.max_attempts || started.elapsed() >= self.config.deadline {
                break;
            }

            let from = snap.current.map_or(Reaction::None, |c| c.state);
            let before = self.counts.get(&vote.target_id).await?;
            let delta = Delta::between(from, vote.action);
            let version = snap.current.map_or(1, |c| c.version + 1);
            let a = Attempt {
                transition: (from != vote.action).then(|| Transition {
                    target_id: vote.target_id.clone(),
                    target_type: vote.target_type,
                    user_id: user.clone(),
                    from,
                    to: vote.action,
                    version,
                    occurred_at: now_rfc3339(),
                }),
                body: body(&vote.target_id, before.apply(delta), vote.action)?,
            };
            if a.transition.is_some() && intent.is_none() {
                // Before the change can commit, so the relay can find it.
                intent = Some(self.store.outbox.intend(user, key).await?);
            }
            let transition = match &a.transition {
                Some(t) => Some(
                    String::from_utf8(t.to_json().map_err(|e| CastError::Unexpected(e.into()))?)
                        .map_err(|e| CastError::Unexpected(e.into()))?,
                ),
                None => None,
            };
            let record = KeyRecord {
                request_hash: hash.clone(),
                owner,
                status: 200,
                body: a.body.clone(),
                transition,
                intent_bucket: intent.map(|slot| slot.bucket),
            };

            let outcome = if a.transition.is_some() {
                if snap.current.is_none() {
                    // Before the first reaction commits, so the sweep can find it.
                    self.store
                        .targets
                        .register(&vote.target_id, vote.target_type)
                        .await?;
                }
                let change = Change {
                    user,
                    target: &vote.target_id,
                    target_type: vote.target_type,
                    expected: snap.current.map(|c| c.version),
                    to: vote.action,
                    key,
                    record: &record,
                };
                self.store.reactions.commit(&change).await
            } else {
                // Already in that state: nothing changes, but the key is
                // recorded so a late retry of it cannot undo a later click.
                self.store.reactions.record(user, key, &record).await
            };
            crate::metrics::cas("vote", &outcome);
            match outcome {
                Cas::Applied => {
                    return Ok(self.after_commit(a, user, key, intent, request_id).await);
                }
                Cas::NotApplied => {
                    tracing::debug!(user = %user, target_id = %vote.target_id, attempt = n, "conditional write lost a race; retrying");
                }
                Cas::Unknown(e) => {
                    unknown = true;
                    tracing::warn!(user = %user, target_id = %vote.target_id, error = format!("{e:#}"), "conditional write outcome unknown; reading at SERIAL");
                }
                Cas::Failed(e) => return Err(StoreError::Request(e).into()),
            }
            attempt = Some(a);
            serial = true;
            // Spread out contending retries of one user.
            tokio::time::sleep(Duration::from_millis(
                2 + u64::from(n) * 5 + u64::from(owner.as_bytes()[n as usize % 16] % 8),
            ))
            .await;
        }
        Err(CastError::Contention)
    }

    /// After a conditional write whose outcome is unknown, reads at SERIAL
    /// until the read answers or the vote's deadline passes. A SERIAL read
    /// completes any Paxos round in flight, so its answer is final; it fails
    /// only while no quorum answers (a replica paused or cut off), which is
    /// often shorter than the deadline.
    async fn learn_outcome(
        &self,
        user: &UserId,
        target: &TargetId,
        key: &IdempotencyKey,
        started: Instant,
    ) -> Result<Snapshot, CastError> {
        let mut pause = Duration::from_millis(50);
        loop {
            match self.store.reactions.snapshot(user, target, key, true).await {
                Ok(snap) => return Ok(snap),
                Err(e) if started.elapsed() + pause >= self.config.deadline => {
                    crate::metrics::unknown_resolved("unresolved");
                    return Err(CastError::OutcomeUnknown(e));
                }
                Err(e) => {
                    tracing::warn!(user = %user, target_id = %target, error = format!("{:#}", anyhow::Error::new(e)), "SERIAL read failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Moves the cache and publishes, in a task of its own. The answer waits
    /// for the cache (so the voter's next read counts the vote), and for
    /// Kafka only up to `publish_wait`: the transition is already durable in
    /// the outbox.
    async fn after_commit(
        &self,
        attempt: Attempt,
        user: &UserId,
        key: &IdempotencyKey,
        intent: Option<Slot>,
        request_id: &str,
    ) -> Answer {
        if let Some(transition) = attempt.transition {
            let (cached, cache_done) = tokio::sync::oneshot::channel();
            let (published, publish_done) = tokio::sync::oneshot::channel();
            let after = self.after.clone();
            let (user, key, request_id) = (user.clone(), key.clone(), request_id.to_owned());
            tokio::spawn(async move {
                let change = Pending {
                    user: &user,
                    version: transition.version,
                    from: transition.from,
                    to: transition.to,
                };
                after
                    .counts
                    .apply_committed(&transition.target_id, &change)
                    .await;
                let _ = cached.send(());
                after
                    .publish(&transition, &user, &key, intent, &request_id)
                    .await;
                let _ = published.send(());
            });
            // Only a panic in the task can drop a sender; the vote stands.
            let _ = cache_done.await;
            let _ = tokio::time::timeout(self.config.publish_wait, publish_done).await;
        }
        Answer {
            status: 200,
            body: attempt.body,
            replayed: false,
        }
    }
}

impl AfterCommit {
    /// Offers the transition to Kafka once. If Kafka does not take it, the
    /// vote still stands and the relay publishes it from the outbox.
    async fn publish(
        &self,
        transition: &Transition,
        user: &UserId,
        key: &IdempotencyKey,
        intent: Option<Slot>,
        request_id: &str,
    ) {
        match self.publisher.publish(transition, request_id).await {
            Ok(()) => {
                if let Some(slot) = intent {
                    // Spares the relay a check; losing it costs only that.
                    if let Err(e) = self.store.outbox.resolve(slot, user, key).await {
                        tracing::debug!(
                            error = format!("{:#}", anyhow::Error::new(e)),
                            "intent not marked resolved; the relay will check it"
                        );
                    }
                }
            }
            Err(e) => {
                metrics::counter!(crate::metrics::PUBLISH_DEFERRED).increment(1);
                tracing::warn!(
                    user = %user, target_id = %transition.target_id, version = transition.version,
                    error = format!("{e:#}"), "transition not published now; the relay will publish it"
                );
            }
        }
    }

    /// A replay may be the retry of a vote whose process died before it
    /// published. Unless its intent is known resolved, it publishes again:
    /// harmless (the consumer counts each version once), and it spares
    /// waiting for the relay.
    fn republish(
        self: &Arc<Self>,
        record: &KeyRecord,
        user: &UserId,
        key: &IdempotencyKey,
        request_id: &str,
    ) {
        let (Some(json), Some(bucket)) = (&record.transition, record.intent_bucket) else {
            return;
        };
        let transition = match Transition::from_json(json.as_bytes()) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "a stored transition does not parse; reconcile repairs its target");
                return;
            }
        };
        let (after, user, key, request_id) = (
            self.clone(),
            user.clone(),
            key.clone(),
            request_id.to_owned(),
        );
        tokio::spawn(async move {
            // The request that committed it may still be counting it in the
            // cache; once that is over, publishing cannot overtake it.
            tokio::time::sleep(after.counts.cache.change_budget()).await;
            if let Ok(true) = after.store.outbox.is_resolved(bucket, &user, &key).await {
                return;
            }
            let slot = Slot {
                bucket,
                shard: crate::store::outbox::shard_of(&user),
            };
            if after
                .publisher
                .publish(&transition, &request_id)
                .await
                .is_ok()
            {
                metrics::counter!(crate::metrics::REPLAYS_REPUBLISHED).increment(1);
                let _ = after.store.outbox.resolve(slot, &user, &key).await;
            }
        });
    }
}
