//! Casting a vote: one conditional, versioned write per change, the
//! idempotency key committed with it, then the cache and the transition.
//!
//! The loop reads the user's row and the key's record, and either replays the
//! recorded answer or writes the change conditioned on the version it read.
//! A lost race re-reads at SERIAL and tries again, a bounded number of times.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::bus::publisher::Publisher;
use crate::counts::Counts;
use crate::domain::{
    Delta, IdempotencyKey, Reaction, TargetId, TargetType, Totals, Transition, UserId,
};
use crate::store::reactions::{Change, KeyRecord};
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
    #[error("Cassandra failed before the vote was known to commit")]
    Store(#[from] StoreError),
    #[error("the vote could not be cast")]
    Unexpected(#[source] anyhow::Error),
}

#[derive(Debug, Clone)]
pub struct CastConfig {
    /// Conditional writes tried before answering `Contention`.
    pub max_attempts: u32,
    /// Times a committed transition is offered to Kafka before giving up
    /// (the vote stands; reconcile repairs the count).
    pub publish_attempts: u32,
}

impl Default for CastConfig {
    fn default() -> Self {
        CastConfig {
            max_attempts: 8,
            publish_attempts: 3,
        }
    }
}

pub struct Caster {
    store: Arc<Store>,
    counts: Counts,
    publisher: Publisher,
    config: CastConfig,
}

/// The change the current attempt is trying to commit.
struct Attempt {
    transition: Option<(Transition, Delta)>,
    body: String,
}

impl Caster {
    pub fn new(
        store: Arc<Store>,
        counts: Counts,
        publisher: Publisher,
        config: CastConfig,
    ) -> Caster {
        Caster {
            store,
            counts,
            publisher,
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
        // Written into the key's record, so after an unknown outcome a SERIAL
        // read tells whether this request's own batch is the one that applied.
        let owner = Uuid::new_v4();
        let mut serial = false;
        let mut attempt: Option<Attempt> = None;

        for n in 0..=self.config.max_attempts {
            let snap = self
                .store
                .reactions
                .snapshot(user, &vote.target_id, key, serial)
                .await?;

            if let Some(record) = snap.record {
                if record.owner == owner {
                    // Our own write, whose outcome was unknown, did apply.
                    return match attempt {
                        Some(a) => Ok(self.after_commit(a, user, request_id).await),
                        None => Err(CastError::Unexpected(anyhow::anyhow!(
                            "lost track of an applied write"
                        ))),
                    };
                }
                if record.request_hash != hash {
                    return Err(CastError::KeyReused);
                }
                return Ok(Answer {
                    status: record.status,
                    body: record.body,
                    replayed: true,
                });
            }
            if n == self.config.max_attempts {
                break;
            }

            let from = snap.current.map_or(Reaction::None, |c| c.state);
            let before = self.counts.get(&vote.target_id).await?;
            let delta = Delta::between(from, vote.action);
            let version = snap.current.map_or(1, |c| c.version + 1);
            let a = Attempt {
                transition: (from != vote.action).then(|| {
                    let t = Transition {
                        target_id: vote.target_id.clone(),
                        target_type: vote.target_type,
                        user_id: user.clone(),
                        from,
                        to: vote.action,
                        version,
                        occurred_at: now_rfc3339(),
                    };
                    (t, delta)
                }),
                body: body(&vote.target_id, before.apply(delta), vote.action)?,
            };
            let record = KeyRecord {
                request_hash: hash.clone(),
                owner,
                status: 200,
                body: a.body.clone(),
            };

            if snap.current.is_none() && a.transition.is_some() {
                // Before the first reaction commits, so the sweep can find it.
                self.store
                    .targets
                    .register(&vote.target_id, vote.target_type)
                    .await?;
            }
            let outcome = if a.transition.is_some() {
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
                Cas::Applied => return Ok(self.after_commit(a, user, request_id).await),
                Cas::NotApplied => {
                    tracing::debug!(user = %user, target_id = %vote.target_id, attempt = n, "conditional write lost a race; retrying");
                }
                Cas::Unknown(e) => {
                    tracing::warn!(user = %user, target_id = %vote.target_id, error = %e, "conditional write outcome unknown; reading at SERIAL");
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

    async fn after_commit(&self, attempt: Attempt, user: &UserId, request_id: &str) -> Answer {
        if let Some((transition, delta)) = &attempt.transition {
            self.counts
                .apply_committed(&transition.target_id, *delta)
                .await;
            self.publish(transition, user, request_id).await;
        }
        Answer {
            status: 200,
            body: attempt.body,
            replayed: false,
        }
    }

    /// Offers the transition to Kafka a few times. If it never gets there the
    /// vote still stands (it is committed); the per-user row keeps the truth
    /// and reconcile puts it into the totals.
    async fn publish(&self, transition: &Transition, user: &UserId, request_id: &str) {
        let mut backoff = Duration::from_millis(100);
        for n in 1..=self.config.publish_attempts {
            match self.publisher.publish(transition, request_id).await {
                Ok(()) => return,
                Err(e) if n < self.config.publish_attempts => {
                    tracing::warn!(error = %e, attempt = n, "publish failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff *= 4;
                }
                Err(e) => {
                    metrics::counter!(crate::metrics::PUBLISH_FAILURES).increment(1);
                    tracing::error!(
                        user = %user, target_id = %transition.target_id, version = transition.version, error = %e,
                        "committed transition not published; reconcile will repair this target"
                    );
                }
            }
        }
    }
}
