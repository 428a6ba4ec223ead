//! Offsets held back while the cache owes drops for their batches.
//!
//! A write through or a settle that Redis did not answer owes its entry a
//! drop (`cache::owed`), and the drops owed live in this process. Killed
//! before it sends them, it would leave an entry serving an older base, or
//! pending changes its base counts already, with nothing to fix it before
//! the TTL: the batch's offsets were stored, so nobody counts its events
//! again. A replay is what fixes such an entry: a round that finds its
//! events counted drops an entry whose base is behind the durable head, and
//! takes out pending changes the head counts (`fence::settle`). So a batch's
//! offsets are stored only once every drop owed up to the end of its writes
//! has been sent. Until then they wait here, in order; a process killed
//! meanwhile leaves those batches to the partitions' next owner, which
//! replays them.
//!
//! The group's committed lag grows while Redis is out of reach, though the
//! counting goes on: the consumer's own lag (`tally_consumer_lag_*`) does not.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use crate::bus::source::{Next, Source};
use crate::cache::Cache;

/// How often batches waiting for their drops are looked at, besides after
/// every batch: the consumer sends its drops owed as often.
pub const RELEASE_EVERY: Duration = Duration::from_millis(250);

/// Batches remembered apart at most. Past it, a batch's offsets join the
/// last one's, which then waits for the later batch's drops too: later
/// stored, never earlier.
const MOST_WAITING: usize = 1_000;

/// Written batches whose offsets wait for drops owed, oldest first, each
/// with the mark of the last failure its writes could have owed a drop for.
#[derive(Default)]
pub struct Held {
    waiting: Mutex<VecDeque<(u64, Next)>>,
}

impl Held {
    /// A batch is written: its offsets are stored once every drop owed up
    /// to `mark` is paid, and after every batch before it.
    pub fn written(&self, mark: u64, next: Next) {
        let mut waiting = self.waiting();
        let full = waiting.len() >= MOST_WAITING;
        match waiting.back_mut() {
            Some((last, offsets)) if *last == mark || full => {
                *last = (*last).max(mark);
                offsets.merge(next);
            }
            _ => waiting.push_back((mark, next)),
        }
    }

    /// Hands `store` the offsets of every batch at the front whose drops
    /// are all paid (`paid_through` a batch's mark), merged. Answers how
    /// many batches still wait.
    pub fn release(&self, paid_through: impl Fn(u64) -> bool, store: impl FnOnce(&Next)) -> usize {
        let mut waiting = self.waiting();
        let mut ready: Option<Next> = None;
        while let Some(&(mark, _)) = waiting.front() {
            if !paid_through(mark) {
                break;
            }
            let Some((_, next)) = waiting.pop_front() else {
                break;
            };
            match ready.as_mut() {
                Some(r) => r.merge(next),
                None => ready = Some(next),
            }
        }
        // Stored under the lock, so no later batch's offsets overtake these.
        if let Some(ready) = ready {
            store(&ready);
        }
        metrics::gauge!(crate::metrics::CONSUMER_BATCHES_HELD).set(waiting.len() as f64);
        waiting.len()
    }

    /// Stores what `cache` has paid for into `source`.
    pub fn release_paid(&self, cache: &Cache, source: &Source) -> usize {
        self.release(|mark| cache.paid_through(mark), |next| source.store(next))
    }

    /// Looks at the waiting batches every `RELEASE_EVERY`, for a consumer
    /// whose next batch may be long in coming.
    pub async fn keep_releasing(self: std::sync::Arc<Self>, cache: Cache, source: Source) {
        let mut tick = tokio::time::interval(RELEASE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.release_paid(&cache, &source);
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, Next)>> {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::source::Received;

    fn at(partition: i32, offset: i64) -> Next {
        Next::after(&[Received {
            topic: "t".into(),
            partition,
            offset,
            key: None,
            payload: Vec::new(),
            signature: None,
            timestamp_ms: None,
        }])
    }

    /// What `release` stores, with every drop owed up to `paid` sent.
    fn release(held: &Held, paid: u64) -> (Option<Next>, usize) {
        let mut stored = None;
        let left = held.release(|mark| mark <= paid, |next| stored = Some(next.clone()));
        (stored, left)
    }

    #[test]
    fn a_batch_with_nothing_owed_is_stored_at_once() {
        let held = Held::default();
        held.written(0, at(0, 9));
        assert_eq!(release(&held, 0), (Some(at(0, 9)), 0));
        assert_eq!(release(&held, 0), (None, 0), "stored once");
    }

    #[test]
    fn a_batch_waits_for_its_drops_and_every_batch_after_it_waits_too() {
        let held = Held::default();
        held.written(3, at(0, 9));
        // Written after the failures up to 3 were paid, but behind the batch
        // that owes them: storing it first would store the first one too.
        held.written(5, at(1, 4));
        assert_eq!(release(&held, 2), (None, 2));
        let mut both = at(0, 9);
        both.merge(at(1, 4));
        assert_eq!(release(&held, 5), (Some(both), 0));
    }

    #[test]
    fn the_front_goes_while_a_later_batch_still_waits() {
        let held = Held::default();
        held.written(3, at(0, 9));
        held.written(7, at(0, 20));
        assert_eq!(release(&held, 4), (Some(at(0, 9)), 1));
        assert_eq!(release(&held, 7), (Some(at(0, 20)), 0));
    }

    #[test]
    fn past_the_most_a_batch_joins_the_last_and_waits_for_both() {
        let held = Held::default();
        for mark in 1..=MOST_WAITING as u64 {
            held.written(mark, at(0, mark as i64));
        }
        held.written(5_000, at(0, 5_000));
        let (stored, left) = release(&held, MOST_WAITING as u64);
        assert_eq!(stored, Some(at(0, MOST_WAITING as i64 - 1)));
        assert_eq!(left, 1, "the last batch waits for the newcomer's drops");
        assert_eq!(release(&held, 5_000), (Some(at(0, 5_000)), 0));
    }
}
