//! The fenced write: how the consumer and reconcile change one bucket of a
//! target's durable totals without ever interleaving with another writer.
//!
//! One round reads the head (the `seq` fence and the totals), then the
//! applied rows, lets the writer fold what it knows into them, and writes the
//! result conditioned on the `seq` it read and on each row it changes holding
//! what it read there. Any view older than the store is refused instead of
//! written: one with a writer landing between its two reads, and one whose
//! rows came from replicas a commit had not yet reached while its head came
//! from one it had (see `FencedWrite`). A lost fence, or a write whose
//! outcome is unknown, starts a new round at SERIAL, which completes
//! any Paxos round still in flight; a write that did land shows up there as
//! versions already applied.

use std::collections::HashMap;

use crate::cache::{Behind, Cache, Written};
use crate::domain::{Applied, Bucket, Layout, TargetId, TargetType, Totals, UserId};
use crate::store::stats::{FencedWrite, Head, ReadAt, Stats};
use crate::store::{Cas, StoreError};

/// Most users one fenced write may carry, keeping the batch well under
/// Cassandra's batch size limits. A writer with more writes in chunks, each
/// self-consistent (its totals include exactly the users it records).
pub const MAX_USERS_PER_WRITE: usize = 200;

/// What one round read: the bucket's head, then the writer's users' applied
/// rows.
#[derive(Debug, Clone)]
pub struct Read {
    pub head: Head,
    pub applied: HashMap<UserId, Applied>,
}

/// What a writer decided, given a round's read.
#[derive(Debug, Clone)]
pub enum Step {
    /// Nothing to write: the read already says what the writer knows.
    Settled,
    /// Write these totals and rows.
    Write {
        totals: Totals,
        target_type: Option<TargetType>,
        users: Vec<(UserId, Applied)>,
    },
}

/// A writer folds its knowledge into a round's read. `fold` runs once per
/// round, so whatever it learns must be recomputed from each read. The rows
/// it writes are conditioned on what `read.applied` says of them, so a writer
/// must compute their change from that, not from rows it read elsewhere.
pub trait Fold {
    fn fold(
        &mut self,
        target: &TargetId,
        read: Read,
    ) -> impl Future<Output = Result<Step, StoreError>>;
}

/// How a fenced write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The last step was a write, and it landed.
    Written,
    /// A round found nothing (more) to write.
    Settled,
}

/// How a fenced write went: its ending and what it cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fenced {
    pub ending: Ending,
    /// Writes that landed.
    pub writes: u32,
    /// Rounds that lost the fence or could not tell whether they landed.
    pub lost: u32,
    /// CQL requests made: two reads per round and one per write attempt,
    /// and a SERIAL read of the head when a round that settles finds its
    /// users' changes still pending in the cache (see `settle`).
    pub requests: u64,
    /// The bucket's seq and totals as the last round left them (read, or
    /// written): what a writer may take as current until someone else
    /// writes.
    pub left: Option<Left>,
}

/// A bucket's seq (`None` if never written) and totals, as a writer left
/// them.
pub type Left = (Option<i64>, Totals);

/// Runs rounds on one bucket, reading the applied rows of `users` (all in
/// that bucket), until the writer settles or its write lands; after a few
/// rounds lost in a row, it backs off between them (`lost_backoff`). A store
/// error ends it at once. A write that lands is written through to `cache`
/// (with its seq), so served counts follow the durable ones.
pub async fn write(
    stats: &Stats,
    cache: Option<&Cache>,
    (target, bucket): (&TargetId, Bucket),
    users: &[&UserId],
    writer: &mut impl Fold,
) -> Result<Fenced, StoreError> {
    let mut at = ReadAt::Quorum;
    let mut done = Fenced {
        ending: Ending::Settled,
        writes: 0,
        lost: 0,
        requests: 0,
        left: None,
    };
    loop {
        if let Some(pause) = lost_backoff(done.lost) {
            if done.lost.is_power_of_two() {
                tracing::warn!(target_id = %target, %bucket, lost = done.lost, "stats write lost its fence round after round; backing off");
            }
            tokio::time::sleep(pause).await;
        }
        let head = stats.head(target, bucket, at).await?;
        let applied = stats.applied_of(target, bucket, users).await?;
        done.requests += 2;
        let read = Read {
            head,
            applied: applied.clone(),
        };
        let Step::Write {
            totals,
            target_type,
            users: rows,
        } = writer.fold(target, read).await?
        else {
            done.ending = Ending::Settled;
            done.left = Some((head.seq, head.totals));
            done.requests += settle(stats, cache, (target, bucket), head, &applied).await;
            return Ok(done);
        };
        let before: Vec<Option<Applied>> =
            rows.iter().map(|(u, _)| applied.get(u).copied()).collect();
        let proposal = FencedWrite {
            read_seq: head.seq,
            totals,
            target_type,
            users: &rows,
            before: &before,
        };
        let outcome = land(stats, cache, (target, bucket), &proposal, &[]).await;
        if let (Cas::Applied, Some(cache)) = (&outcome, cache) {
            // The rows it read and left as they were (their events replays)
            // are counted in the new base too, at their versions or later.
            let replayed: Vec<(&UserId, i64)> = applied
                .iter()
                .filter(|(u, _)| !rows.iter().any(|(r, _)| r == *u))
                .map(|(u, a)| (u, a.version))
                .collect();
            let place = (target, (stats.layout(), bucket));
            settle_pending(cache, place, head.seq.unwrap_or(0) + 1, &replayed).await;
        }
        done.requests += 1;
        match outcome {
            Cas::Applied => {
                done.writes += 1;
                done.ending = Ending::Written;
                done.left = Some((Some(head.seq.unwrap_or(0) + 1), totals));
                return Ok(done);
            }
            Cas::NotApplied => {
                done.lost += 1;
                at = ReadAt::Serial;
            }
            Cas::Unknown(e) => {
                tracing::warn!(target_id = %target, error = format!("{e:#}"), "stats write outcome unknown; re-reading at SERIAL");
                done.lost += 1;
                at = ReadAt::Serial;
            }
            Cas::Failed(e) => return Err(StoreError::Request(e)),
        }
    }
}

/// Rounds lost in a row before a writer pauses between rounds. Two writers
/// that collide settle it in a round or two: the loser re-reads at SERIAL
/// and finds its events counted or the fence free. More means a view that
/// keeps losing, which must not spin on Paxos and starve the bucket's other
/// writers.
const LOST_BEFORE_BACKOFF: u32 = 3;

/// The pause before the next round after `lost` rounds lost in a row: none
/// at first, then a random share (so writers that lost together do not come
/// back together) of 5 ms doubling up to 640 ms.
fn lost_backoff(lost: u32) -> Option<std::time::Duration> {
    let over = lost.checked_sub(LOST_BEFORE_BACKOFF)?;
    let cap = std::time::Duration::from_millis(5) * 2u32.pow(over.min(7));
    let share = (uuid::Uuid::new_v4().as_u128() % 1_001) as f64 / 1_000.0;
    Some(cap.mul_f64(share))
}

/// Writes one fenced write, and writes it through to `cache` (with its seq)
/// if it landed, so served counts follow the durable ones. `ahead` are the
/// users it counts at a version whose vote may not have counted it in the
/// cache yet (see `Written::ahead`).
pub async fn land(
    stats: &Stats,
    cache: Option<&Cache>,
    (target, bucket): (&TargetId, Bucket),
    proposal: &FencedWrite<'_>,
    ahead: &[(UserId, i64)],
) -> Cas {
    let outcome = stats.write(target, bucket, proposal).await;
    crate::metrics::cas("stats", &outcome);
    write_through(stats, cache, (target, bucket), proposal, ahead, &outcome).await;
    outcome
}

/// `land` for a writer that read nothing, only believes what the head and
/// rows hold (counted apart in the metrics: its refusals are expected).
pub async fn land_unread(
    stats: &Stats,
    cache: Option<&Cache>,
    (target, bucket): (&TargetId, Bucket),
    proposal: &FencedWrite<'_>,
) -> Cas {
    let outcome = stats.write(target, bucket, proposal).await;
    crate::metrics::cas("stats_unread", &outcome);
    write_through(stats, cache, (target, bucket), proposal, &[], &outcome).await;
    outcome
}

async fn write_through(
    stats: &Stats,
    cache: Option<&Cache>,
    (target, bucket): (&TargetId, Bucket),
    proposal: &FencedWrite<'_>,
    ahead: &[(UserId, i64)],
    outcome: &Cas,
) {
    if let (Cas::Applied, Some(cache)) = (outcome, cache) {
        let mut ahead = ahead.to_vec();
        ahead.extend(past_a_gap(proposal));
        let written = Written {
            buckets: stats.layout(),
            bucket,
            seq: proposal.read_seq.unwrap_or(0) + 1,
            totals: proposal.totals,
            users: proposal.users,
            ahead: &ahead,
        };
        if let Err(e) = cache.write_through(target, &written).await {
            tracing::warn!(target_id = %target, %bucket, error = format!("{:#}", anyhow::Error::new(e)), "durable totals not written through to the cache");
        }
    }
}

/// The users a write counts past a version it never counted: a later vote
/// of theirs reached the writer first. The earlier vote may still be
/// learning its outcome, its cache step to come; if it then died before
/// publishing, nothing would take that step's change out of an entry whose
/// base counts the later vote. Marked as counted ahead, its step counts
/// nothing.
fn past_a_gap(proposal: &FencedWrite<'_>) -> impl Iterator<Item = (UserId, i64)> {
    proposal
        .users
        .iter()
        .zip(proposal.before)
        .filter(|((_, now), before)| now.version > before.map_or(0, |b| b.version) + 1)
        .map(|((user, now), _)| (user.clone(), now.version))
}

/// A round that found its events counted already writes nothing, so
/// nothing would take a pending change of theirs out of the cache. There is
/// one when reconcile counted a row ahead of its vote and a drop took the
/// mark that kept the vote's late cache step from counting it again (the
/// step then counts it on top of heads that count it). Only if the entry
/// holds a pending change of the round's users, the head is read again at
/// SERIAL, which completes any write in flight. That head counts every row
/// the round read: a row and the head that counts it are written in one
/// conditional batch on one partition, the rows were read before it, and
/// each later write is fenced on the head before it. Returns the CQL
/// requests made.
async fn settle(
    stats: &Stats,
    cache: Option<&Cache>,
    (target, bucket): (&TargetId, Bucket),
    head: Head,
    applied: &HashMap<UserId, Applied>,
) -> u64 {
    let (Some(cache), Some(seq)) = (cache, head.seq) else {
        return 0;
    };
    // The head may hold a write that landed without its write through (a
    // writer without Redis, or one that died or timed out between the
    // two): an entry behind it would serve the older base until the
    // bucket's next write or the TTL. A dropped entry holds nothing to
    // settle. Replays after a rebalance settle round after round, and their
    // changes are long gone from the cache: a Paxos read each would be
    // wasted, so the same call asks whether the entry holds one. An entry
    // Redis did not answer for is owed a drop, and then holds nothing either.
    let users: Vec<(&UserId, i64)> = applied.iter().map(|(u, a)| (u, a.version)).collect();
    if !pending_at(cache, (target, bucket), seq, &users).await {
        return 0;
    }
    let now = match stats.head(target, bucket, ReadAt::Serial).await {
        Ok(again) => again.seq.unwrap_or(seq).max(seq),
        Err(e) => {
            // Nothing else will take those changes out before the bucket's
            // next write or the TTL.
            tracing::warn!(target_id = %target, %bucket, error = format!("{:#}", anyhow::Error::new(e)), "could not read the head again to settle the cache entry; dropping it");
            cache.owe(target);
            return 1;
        }
    };
    if now != seq {
        // Another writer landed after the round's reads. Its write through
        // takes out only its own users' changes, so this round's users'
        // changes would stay beside a base that counts them. An entry whose
        // base is older than that head is dropped instead.
        if !pending_at(cache, (target, bucket), now, &users).await {
            return 1;
        }
    }
    settle_pending(cache, (target, (stats.layout(), bucket)), now, &users).await;
    1
}

/// Drops the entry if its base of `bucket` is older than the head at
/// `seq`, and answers whether the entry it keeps holds a pending change of
/// `users` (one Redis did not answer is owed a drop, and then holds none).
async fn pending_at(
    cache: &Cache,
    (target, bucket): (&TargetId, Bucket),
    seq: i64,
    users: &[(&UserId, i64)],
) -> bool {
    match cache.drop_if_behind(target, &[(bucket, seq)], users).await {
        Ok(Behind::Pending) => true,
        Ok(Behind::Dropped | Behind::Settled) => false,
        Err(e) => {
            tracing::warn!(target_id = %target, %bucket, error = format!("{:#}", anyhow::Error::new(e)), "could not check the cache entry against the durable head");
            false
        }
    }
}

/// Takes out of the cache the pending changes of `users` (each at most at
/// its version) that the bucket's base counts, if the entry's base is at
/// `seq` or newer, which counts each user at that version or a later one.
async fn settle_pending(
    cache: &Cache,
    (target, (buckets, bucket)): (&TargetId, (Layout, Bucket)),
    seq: i64,
    users: &[(&UserId, i64)],
) {
    if users.is_empty() {
        return;
    }
    if let Err(e) = cache.settle(target, (buckets, bucket), seq, users).await {
        tracing::warn!(target_id = %target, %bucket, error = format!("{:#}", anyhow::Error::new(e)), "pending changes counted durably not taken out of the cache");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{LOST_BEFORE_BACKOFF, lost_backoff, past_a_gap};
    use crate::domain::{Applied, Reaction, Totals, UserId};
    use crate::store::stats::FencedWrite;

    #[test]
    fn users_counted_past_a_version_never_counted_are_marked_at_the_version_counted() {
        let at = |version, state| Applied { version, state };
        let user = |name: &str| UserId::parse(name).unwrap_or_else(|e| panic!("{e}"));
        let users = [
            (user("next"), at(3, Reaction::Like)),
            (user("skipped"), at(4, Reaction::None)),
            (user("first"), at(1, Reaction::Like)),
            (user("first_seen_late"), at(2, Reaction::Dislike)),
            (user("forgotten"), at(2, Reaction::Like)),
        ];
        let before = [
            Some(at(2, Reaction::None)),
            Some(at(2, Reaction::Like)),
            None,
            None,
            Some(Applied::NEVER),
        ];
        let proposal = FencedWrite {
            read_seq: Some(7),
            totals: Totals::default(),
            target_type: None,
            users: &users,
            before: &before,
        };
        let marked: Vec<(String, i64)> = past_a_gap(&proposal)
            .map(|(u, v)| (u.as_str().to_owned(), v))
            .collect();
        assert_eq!(
            marked,
            [
                ("skipped".to_owned(), 4),
                ("first_seen_late".to_owned(), 2),
                ("forgotten".to_owned(), 2)
            ]
        );
    }

    #[test]
    fn the_first_lost_rounds_go_again_at_once() {
        for lost in 0..LOST_BEFORE_BACKOFF {
            assert_eq!(lost_backoff(lost), None, "after {lost} lost");
        }
    }

    #[test]
    fn later_rounds_pause_within_a_doubling_cap_that_stops_at_640_ms() {
        for (over, cap_ms) in [(0, 5), (1, 10), (2, 20), (7, 640), (8, 640), (1_000, 640)] {
            let lost = LOST_BEFORE_BACKOFF + over;
            let pauses: Vec<Duration> = (0..200).filter_map(|_| lost_backoff(lost)).collect();
            assert_eq!(pauses.len(), 200, "after {lost} lost, every round pauses");
            let cap = Duration::from_millis(cap_ms);
            assert!(
                pauses.iter().all(|p| *p <= cap),
                "after {lost} lost: {pauses:?}"
            );
            // Jittered: not all the same, and some near the cap.
            assert!(pauses.iter().any(|p| *p != pauses[0]), "after {lost} lost");
            assert!(pauses.iter().any(|p| *p > cap / 2), "after {lost} lost");
        }
    }
}
