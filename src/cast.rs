//! Casting a vote: one conditional, versioned write per change, the
//! idempotency key and the transition committed with it, then the cache and
//! Kafka.
//!
//! A vote reads nothing first. It writes the change conditioned on a guess
//! of the user's row (what this process last saw, else no row) together with
//! `IF NOT EXISTS` on the key's record, so one Paxos round either commits,
//! or is refused with the row and the record as they are: a replay answers
//! from the record, a wrong guess tries again with the row it was shown.
//! An unknown outcome is read at SERIAL. All within a deadline.
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
use crate::store::reactions::{Change, Current, KeyRecord, Snapshot, Written};
use crate::store::{Store, StoreError};

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

/// Why a vote that never committed stopped trying: other votes of the
/// user kept moving its row (409: a retry may go through at once), or its
/// attempts or its deadline ran out with no other vote in its way (503: the
/// stores were too slow, their writes' outcomes unknown and then found not
/// applied, or the reads ahead of the write took the time), which a client
/// must not take for a conflict.
fn gave_up(raced: u32, deadline: Duration) -> CastError {
    if raced > 0 {
        return CastError::Contention;
    }
    CastError::Store(StoreError::Request(anyhow::anyhow!(
        "no conditional write of the vote applied within its attempts and its deadline ({deadline:?}), and no other vote moved its row"
    )))
}

/// The longest `tally vote` lets a vote take (`CastConfig::longest_vote`,
/// 20 s with the default timeouts): what the cache's marks and reconcile's
/// look at recently changed rows are sized for, each with room for the
/// hosts' clocks to disagree.
pub const LONGEST_VOTE: Duration = Duration::from_secs(30);

/// Room on top of `LONGEST_VOTE` for the clocks of the hosts (the vote's,
/// the consumer's or reconcile's, Redis's) to disagree.
pub const CLOCK_ROOM: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct CastConfig {
    /// Conditional writes tried before giving up (`gave_up`).
    pub max_attempts: u32,
    /// No new conditional write starts after this long. The relay waits
    /// longer than this before it decides a vote never committed.
    pub deadline: Duration,
    /// How long an answer waits for Kafka's acknowledgement of its
    /// transition; zero (the default) not at all. The transition is durable
    /// in the key's record before the answer, and the relay publishes what
    /// the vote's own task could not, so the answer need not hold on Kafka.
    pub publish_wait: Duration,
    /// Cassandra's request timeout: how long one conditional write or
    /// SERIAL read may take beyond the deadline.
    pub request_timeout: Duration,
}

impl Default for CastConfig {
    fn default() -> Self {
        CastConfig {
            max_attempts: 8,
            deadline: Duration::from_secs(8),
            publish_wait: Duration::ZERO,
            request_timeout: Duration::from_millis(crate::store::REQUEST_TIMEOUT_MS),
        }
    }
}

impl CastConfig {
    /// The longest a vote can take from its outbox intent to the end of its
    /// cache step, given the cache's `change_budget`. A write may start just
    /// before the deadline and time out, and the SERIAL read that learns its
    /// outcome takes up to another request; Redis refuses the cache step
    /// once its budget has passed. Whatever publishes a committed vote's
    /// transition without that vote (the relay, a replay) waits this long
    /// first: a transition counted before the vote's own cache step would
    /// leave that step's change beside a base that counts it, and served
    /// twice, if the vote then never published to take it out.
    pub fn longest_vote(&self, change_budget: Duration) -> Duration {
        self.deadline + self.request_timeout * 2 + change_budget
    }
}

pub struct Caster {
    store: Arc<Store>,
    counts: Counts,
    after: Arc<AfterCommit>,
    config: CastConfig,
    /// Shared by every copy in the process (see `Caster::on`).
    hints: Arc<Hints>,
}

/// What this process last saw of users' rows, the first attempt's guess of
/// what a row holds. Only ever a guess: a wrong one (another instance's
/// vote, a hash collision, a forgotten entry) costs one refused round.
#[derive(Default)]
pub struct Hints {
    seen: std::sync::Mutex<std::collections::HashMap<u64, Current>>,
    hasher: std::collections::hash_map::RandomState,
}

/// Entries kept before the hints start over: a few MB.
const HINTS: usize = 100_000;

impl Hints {
    fn slot(&self, user: &UserId, target: &TargetId) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one((user.as_str(), target.as_str()))
    }

    /// The row this process last saw, if it remembers one.
    pub fn get(&self, user: &UserId, target: &TargetId) -> Option<Current> {
        let slot = self.slot(user, target);
        self.seen.lock().ok()?.get(&slot).copied()
    }

    /// Remembers a row seen at `version`, unless a newer one is known.
    pub fn remember(&self, user: &UserId, target: &TargetId, state: Reaction, version: i64) {
        self.remember_all(user, [(target, Current { state, version })]);
    }

    /// Remembers each of a user's rows seen, under one lock (a page's
    /// worth at a time), unless a newer one is known.
    fn remember_all<'a>(
        &self,
        user: &UserId,
        rows: impl IntoIterator<Item = (&'a TargetId, Current)>,
    ) {
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        for (target, current) in rows {
            if seen.len() >= HINTS {
                seen.clear();
            }
            let slot = self.slot(user, target);
            if seen.get(&slot).is_none_or(|c| c.version < current.version) {
                seen.insert(slot, current);
            }
        }
    }
}

/// What one attempt writes: the change it commits (none when the user
/// already holds the reaction) and the key's record.
struct Attempt {
    transition: Option<Transition>,
    record: KeyRecord,
    intent: Slot,
}

/// What runs after a commit, in its own task: nothing the request does
/// (a disconnect, a timeout) can cancel it.
struct AfterCommit {
    store: Arc<Store>,
    counts: Counts,
    publisher: Publisher,
    /// How long a replay waits before publishing its record's transition
    /// (`CastConfig::longest_vote`).
    republish_after: Duration,
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
            republish_after: config.longest_vote(counts.cache.change_budget()),
            counts: counts.clone(),
            publisher,
        });
        Caster {
            store,
            counts,
            after,
            config,
            hints: Arc::default(),
        }
    }

    /// The same caster over other clients of the same stores (an HTTP
    /// worker's own), with the same publisher and the same hints, so a
    /// user's next vote guesses as well whichever worker takes it.
    pub fn on(&self, store: Arc<Store>, counts: Counts) -> Caster {
        let after = Arc::new(AfterCommit {
            store: store.clone(),
            counts: counts.clone(),
            publisher: self.after.publisher.clone(),
            republish_after: self.after.republish_after,
        });
        Caster {
            store,
            counts,
            after,
            config: self.config.clone(),
            hints: self.hints.clone(),
        }
    }

    /// What a read of the user's rows found (a page's summary): the
    /// user's next vote on one of them then guesses right, even when no
    /// vote of theirs went through this process before.
    pub fn saw(&self, user: &UserId, rows: &std::collections::HashMap<TargetId, Current>) {
        self.hints
            .remember_all(user, rows.iter().map(|(t, c)| (t, *c)));
    }

    /// Whether this process registered the target, or found it registered,
    /// recently, so a vote on it writes nothing to the registry.
    pub fn knows_target(&self, target: &TargetId) -> bool {
        self.store.targets.remembers(target)
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
        // Written into the key's record, so a refusal or a SERIAL read tells
        // whether this request's own batch is the one that applied.
        let owner = Uuid::new_v4();
        // Together rather than in turn: the totals the answer shows, with
        // the target registered if it may not be yet, and the outbox intent
        // (before the change can commit, so the relay can find it).
        let (before, intent) = tokio::try_join!(
            self.totals_of_registered(vote),
            self.store.outbox.intend(user, key),
        )?;
        // Optimistic: what this process last saw of the row, else no row. A
        // wrong guess costs one refused round, which returns the truth.
        let mut current = self.hints.get(user, &vote.target_id);
        let mut refusals = 0u32;
        // Attempts that found the row moved by another vote of this user.
        let mut raced = 0u32;

        for n in 0..self.config.max_attempts {
            if started.elapsed() >= self.config.deadline {
                break;
            }
            let attempt = self.attempt(user, vote, current, before, &hash, owner, intent)?;
            let written = match &attempt.transition {
                Some(_) => {
                    let change = Change {
                        user,
                        target: &vote.target_id,
                        target_type: vote.target_type,
                        expected: current,
                        to: vote.action,
                        key,
                        record: &attempt.record,
                    };
                    self.store.reactions.commit(&change).await
                }
                // Already in that state: nothing changes, but the key is
                // recorded so a late retry of it cannot undo a later click,
                // if the row still holds that state (the guess may be stale).
                None => {
                    self.store
                        .reactions
                        .record_unchanged(user, &vote.target_id, current, key, &attempt.record)
                        .await
                }
            };
            crate::metrics::cas_outcome("vote", written.label());
            let refused = matches!(written, Written::Refused(_));
            let snap = match written {
                Written::Applied => {
                    if let Some(t) = &attempt.transition {
                        self.hints.remember(user, &vote.target_id, t.to, t.version);
                    }
                    return Ok(self.after_commit(attempt, user, key, request_id).await);
                }
                Written::Refused(snap) => snap,
                Written::Unknown(e) => {
                    tracing::warn!(user = %user, target_id = %vote.target_id, error = format!("{e:#}"), "conditional write outcome unknown; reading at SERIAL");
                    let snap = self
                        .learn_outcome(user, &vote.target_id, key, started)
                        .await?;
                    let applied = snap.record.as_ref().is_some_and(|r| r.owner == owner);
                    crate::metrics::unknown_resolved(if applied {
                        "applied"
                    } else {
                        "not_applied"
                    });
                    snap
                }
                Written::Failed(e) => return Err(StoreError::Request(e).into()),
            };
            if let Some(record) = snap.record {
                return self
                    .answer_recorded(record, owner, &hash, user, key, intent, request_id)
                    .await;
            }
            if let Some(c) = snap.current {
                self.hints
                    .remember(user, &vote.target_id, c.state, c.version);
            }
            if refused && snap.current == current {
                // Refused with the row as expected and no record: only a
                // record that is not whole explains it, and it will not heal.
                return Err(CastError::Unexpected(anyhow::anyhow!(
                    "the key's row exists but holds no whole record"
                )));
            }
            // A race: the row moved from what the store itself last told
            // this vote. The first attempt's guess may be merely wrong (a
            // hint from another instance's day, or none), and a write whose
            // outcome was unknown is a race too if the row moved meanwhile.
            raced += u32::from(n > 0 && snap.current != current);
            current = snap.current;
            refusals += 1;
            if refusals > 1 {
                tracing::debug!(user = %user, target_id = %vote.target_id, attempt = n, "conditional write lost a race; retrying");
                // Another vote of this user keeps moving the row: spread out.
                tokio::time::sleep(Duration::from_millis(
                    2 + u64::from(n) * 5 + u64::from(owner.as_bytes()[n as usize % 16] % 8),
                ))
                .await;
            }
        }
        Err(gave_up(raced, self.config.deadline))
    }

    /// The target's served totals, with the target in the registry before
    /// this vote can commit (so the sweep finds it, and a cache miss knows it
    /// has reactions). A target this process registered, or found in the
    /// registry, writes nothing. Nor does one whose served totals count
    /// anyone, where every registration is seen by every read
    /// (`Targets::sees_every_registration`): a count means a reaction
    /// committed, or this release's trusted consumer counted an event, and
    /// either registered the target first; nothing deletes a registry row.
    /// (Targets an earlier release's trusted consumer counted have no row;
    /// `tally reconcile --target` registers a target it finds rows for.) That
    /// spares a Cassandra write a target for each process after a restart,
    /// or when its memory of targets is full: the long tail of targets of a
    /// vote or two each.
    async fn totals_of_registered(&self, vote: &Vote) -> Result<Totals, StoreError> {
        let targets = &self.store.targets;
        let target = &vote.target_id;
        let before = self.counts.get(target).await?;
        // Asked after the read, whose miss may have found the row.
        if targets.remembers(target) {
            return Ok(before);
        }
        if before.is_zero() || !targets.sees_every_registration() {
            targets.register(target, vote.target_type).await?;
        } else {
            targets.remember(target);
        }
        Ok(before)
    }

    /// The change (or none) and the record one attempt writes, given what it
    /// expects the user's row to hold.
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        user: &UserId,
        vote: &Vote,
        current: Option<Current>,
        before: Totals,
        hash: &str,
        owner: Uuid,
        intent: Slot,
    ) -> Result<Attempt, CastError> {
        let from = current.map_or(Reaction::None, |c| c.state);
        let transition = (from != vote.action).then(|| Transition {
            target_id: vote.target_id.clone(),
            target_type: vote.target_type,
            user_id: user.clone(),
            from,
            to: vote.action,
            version: current.map_or(1, |c| c.version + 1),
            occurred_at: now_rfc3339(),
        });
        let json = match &transition {
            Some(t) => Some(
                String::from_utf8(t.to_json().map_err(|e| CastError::Unexpected(e.into()))?)
                    .map_err(|e| CastError::Unexpected(e.into()))?,
            ),
            None => None,
        };
        let body = body(
            &vote.target_id,
            before.apply(Delta::between(from, vote.action)),
            vote.action,
        )?;
        Ok(Attempt {
            record: KeyRecord {
                request_hash: hash.to_owned(),
                owner,
                status: 200,
                body,
                intent_bucket: json.as_ref().map(|_| intent.bucket),
                intent_shard: json.as_ref().map(|_| intent.shard),
                transition: json,
            },
            transition,
            intent,
        })
    }

    /// The answer when the key's record exists: this request's own write
    /// (whose outcome was unknown) applied, or the key was used before.
    #[allow(clippy::too_many_arguments)]
    async fn answer_recorded(
        &self,
        record: KeyRecord,
        owner: Uuid,
        hash: &str,
        user: &UserId,
        key: &IdempotencyKey,
        intent: Slot,
        request_id: &str,
    ) -> Result<Answer, CastError> {
        if record.owner == owner {
            // The record says what the write that applied was.
            let transition = match &record.transition {
                Some(json) => Some(
                    Transition::from_json(json.as_bytes())
                        .map_err(|e| CastError::Unexpected(anyhow::anyhow!("{e}")))?,
                ),
                None => None,
            };
            let attempt = Attempt {
                transition,
                record,
                intent,
            };
            return Ok(self.after_commit(attempt, user, key, request_id).await);
        }
        // The request that wrote the record wrote an intent of its own, which
        // the relay follows; this request's is spare. Unless it is the same
        // row (both written in one group): then it is the one that counts.
        if record.intent_slot(user) != Some(intent) {
            self.after.resolve_later(intent, user, key);
        }
        if record.request_hash != hash {
            return Err(CastError::KeyReused);
        }
        self.after.republish(&record, user, key, request_id);
        Ok(Answer {
            status: record.status,
            body: record.body,
            replayed: true,
        })
    }

    /// What `key` already answers, which needs no new write: its stored
    /// answer when a vote with it committed and this is the same request
    /// again, `KeyReused` when it was another request's. What a request
    /// gets while its user is over a limit. One read at LOCAL_QUORUM;
    /// `None` on no record or a failed read (the caller answers 429 then).
    pub async fn recorded(
        &self,
        user: &UserId,
        key: &IdempotencyKey,
        vote: &Vote,
        request_id: &str,
    ) -> Option<Result<Answer, CastError>> {
        let snap = self
            .store
            .reactions
            .snapshot(user, &vote.target_id, key, false)
            .await
            .ok()?;
        let record = snap.record?;
        if record.request_hash != vote.hash() {
            return Some(Err(CastError::KeyReused));
        }
        self.after.republish(&record, user, key, request_id);
        Some(Ok(Answer {
            status: record.status,
            body: record.body,
            replayed: true,
        }))
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
        request_id: &str,
    ) -> Answer {
        let intent = Some(attempt.intent);
        if let Some(transition) = attempt.transition {
            let (cached, cache_done) = tokio::sync::oneshot::channel();
            let (published, publish_done) = tokio::sync::oneshot::channel();
            let after = self.after.clone();
            let (user, key, request_id) = (user.clone(), key.clone(), request_id.to_owned());
            // Boxed: some 8 KB, copied on each move into tokio otherwise.
            tokio::spawn(Box::pin(async move {
                let change = Pending {
                    user: &user,
                    version: transition.version,
                    from: transition.from,
                    to: transition.to,
                };
                let in_flight_until = after
                    .counts
                    .apply_committed(&transition.target_id, &change)
                    .await;
                let _ = cached.send(());
                // The answer need not wait for this; the publish must: a
                // step that lands after the consumer counted the change
                // would count it again beside a base that has it.
                if let Some(until) = in_flight_until {
                    tokio::time::sleep_until(until).await;
                }
                let taken = after.publish(&transition, &user, &request_id).await;
                let _ = published.send(());
                // After the answer may have gone: the mark lingers.
                if let (true, Some(slot)) = (taken, intent) {
                    after.resolve(slot, &user, &key).await;
                }
            }));
            // Only a panic in the task can drop a sender; the vote stands.
            let _ = cache_done.await;
            if !self.config.publish_wait.is_zero() {
                let _ = tokio::time::timeout(self.config.publish_wait, publish_done).await;
            }
        } else if let Some(slot) = intent {
            // Nothing to publish: the relay need not look.
            self.after.resolve_later(slot, user, key);
        }
        Answer {
            status: 200,
            body: attempt.record.body,
            replayed: false,
        }
    }
}

impl AfterCommit {
    /// Marks an intent resolved in the background. Every intent left
    /// unresolved costs the relay a SERIAL read, and under load those add up
    /// to more than a relay can check.
    fn resolve_later(self: &Arc<Self>, slot: Slot, user: &UserId, key: &IdempotencyKey) {
        let (after, user, key) = (self.clone(), user.clone(), key.clone());
        tokio::spawn(async move { after.resolve(slot, &user, &key).await });
    }

    /// Marks an intent resolved. Losing the mark costs the relay one check.
    async fn resolve(&self, slot: Slot, user: &UserId, key: &IdempotencyKey) {
        if let Err(e) = self.store.outbox.resolve(slot, user, key).await {
            tracing::debug!(
                error = format!("{:#}", anyhow::Error::new(e)),
                "intent not marked resolved; the relay will check it"
            );
        }
    }

    /// Offers the transition to Kafka once; whether Kafka took it. If not,
    /// the vote still stands and the relay publishes it from the outbox.
    async fn publish(&self, transition: &Transition, user: &UserId, request_id: &str) -> bool {
        match self.publisher.publish(transition, request_id).await {
            Ok(()) => true,
            Err(e) => {
                metrics::counter!(crate::metrics::PUBLISH_DEFERRED).increment(1);
                tracing::warn!(
                    user = %user, target_id = %transition.target_id, version = transition.version,
                    error = format!("{e:#}"), "transition not published now; the relay will publish it"
                );
                false
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
        let (Some(json), Some(slot)) = (&record.transition, record.intent_slot(user)) else {
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
            // The request that committed it may not have counted it in the
            // cache yet: it may still be learning its outcome. Once the
            // longest a vote takes has passed, publishing cannot overtake it.
            tokio::time::sleep(after.republish_after).await;
            if let Ok(true) = after.store.outbox.is_resolved(slot, &user, &key).await {
                return;
            }
            if after
                .publisher
                .publish(&transition, &request_id)
                .await
                .is_ok()
            {
                metrics::counter!(crate::metrics::REPLAYS_REPUBLISHED).increment(1);
                after.resolve(slot, &user, &key).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vote whose deadline passed before any write of it was refused by
    /// another vote (its intent write or its read of the totals took the
    /// time) was answered 409, "too many concurrent changes": a client
    /// told of a conflict that never happened. Only a race is a conflict.
    #[test]
    fn a_vote_out_of_time_without_a_race_is_unavailable_not_a_conflict() {
        let slow = crate::api::error::ApiError::from(gave_up(0, Duration::from_secs(8)));
        assert_eq!(
            actix_web::ResponseError::status_code(&slow),
            actix_web::http::StatusCode::SERVICE_UNAVAILABLE
        );
        let raced = crate::api::error::ApiError::from(gave_up(3, Duration::from_secs(8)));
        assert_eq!(
            actix_web::ResponseError::status_code(&raced),
            actix_web::http::StatusCode::CONFLICT
        );
    }
}
