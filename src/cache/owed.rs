//! The entries the cache owes a drop. A vote's change, a write through, a
//! settle or a check against the head (`DROP_BEHIND`) that Redis did not
//! answer (a timeout, a lost connection) may leave its entry serving a base
//! older than the durable totals, or a pending change the base already
//! counts, and nothing else brings that entry up to date before the
//! bucket's next write or the TTL. A drop is always safe (every fill is
//! fenced), and the next read fills the entry from the durable totals, so
//! each such entry is dropped once Redis answers again.
//!
//! This is the bookkeeping only; `Cache` sends the drops.

use std::collections::HashMap;

/// Most entries remembered by key. An outage long and busy enough to owe
/// more is paid by dropping every entry instead: one key is about a hundred
/// bytes here, and a process must not grow without bound while Redis is away.
pub const MOST_OWED: usize = 100_000;

/// Keys owed a drop, each numbered by the failure that owed it last. A drop
/// sent before a later failure of the same key must not forgive that one:
/// the failed write may have been sent after the drop.
#[derive(Debug)]
pub struct Owed {
    keys: HashMap<String, Unpaid>,
    failures: u64,
    most: usize,
    /// Set when a key did not fit: every entry is owed a drop, for the
    /// failures up to this one.
    everything: Option<u64>,
}

/// One key's failures not yet paid for by a drop: numbered from `first` to
/// `last`. `first` is what `paid_through` asks about: a key that fails again
/// is still owed for its earlier failure, whose batch must wait as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unpaid {
    first: u64,
    last: u64,
}

impl Default for Owed {
    fn default() -> Owed {
        Owed::with_most(MOST_OWED)
    }
}

impl Owed {
    /// Remembering at most `most` keys.
    pub fn with_most(most: usize) -> Owed {
        Owed {
            keys: HashMap::new(),
            failures: 0,
            most,
            everything: None,
        }
    }

    /// A write to `key` failed without an answer.
    pub fn owe(&mut self, key: String) {
        self.failures += 1;
        let failure = self.failures;
        if let Some(unpaid) = self.keys.get_mut(&key) {
            unpaid.last = failure;
        } else if self.keys.len() < self.most {
            self.keys.insert(
                key,
                Unpaid {
                    first: failure,
                    last: failure,
                },
            );
        } else {
            self.everything = Some(self.failures);
        }
    }

    /// Whether anything is owed.
    pub fn any(&self) -> bool {
        !self.keys.is_empty() || self.everything.is_some()
    }

    /// The number of the last failure so far: what `paid_through` is asked
    /// about once everything up to it should be paid.
    pub fn last_failure(&self) -> u64 {
        self.failures
    }

    /// Whether no failure numbered up to `mark` is still owed a drop. An
    /// owed sweep holds every mark: it stands for failures it no longer
    /// tells apart.
    pub fn paid_through(&self, mark: u64) -> bool {
        self.everything.is_none() && self.keys.values().all(|unpaid| unpaid.first > mark)
    }

    /// Keys owed, for the gauge: all the keys remembered, however many
    /// more an owed sweep stands for.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether every entry must be dropped, and the last failure a sweep
    /// that starts now pays for.
    pub fn sweep_due(&self) -> Option<u64> {
        self.everything.map(|_| self.failures)
    }

    /// Every entry was dropped by a sweep that started after failure
    /// `as_of`: forgives everything owed up to it.
    pub fn swept(&mut self, as_of: u64) {
        self.keys.retain(|_, unpaid| unpaid.last > as_of);
        for unpaid in self.keys.values_mut() {
            unpaid.first = unpaid.first.max(as_of + 1);
        }
        if self.everything.is_some_and(|failure| failure <= as_of) {
            self.everything = None;
        }
    }

    /// Up to `n` keys to drop next, each with the failure it is owed for.
    pub fn due(&self, n: usize) -> Vec<(String, u64)> {
        self.keys
            .iter()
            .take(n)
            .map(|(key, unpaid)| (key.clone(), unpaid.last))
            .collect()
    }

    /// These keys were dropped: each is forgiven unless it failed again
    /// since it was handed out, and then still for the failures up to the
    /// one it was handed out for.
    pub fn paid(&mut self, dropped: &[(String, u64)]) {
        for (key, failure) in dropped {
            match self.keys.get_mut(key) {
                Some(unpaid) if unpaid.last == *failure => {
                    self.keys.remove(key);
                }
                Some(unpaid) => unpaid.first = unpaid.first.max(failure + 1),
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_key_is_forgiven() {
        let mut owed = Owed::default();
        owed.owe("a".into());
        owed.owe("b".into());
        let due = owed.due(10);
        assert_eq!(due.len(), 2);
        owed.paid(&due);
        assert!(!owed.any());
    }

    #[test]
    fn a_key_that_failed_again_after_it_was_handed_out_stays_owed() {
        let mut owed = Owed::default();
        owed.owe("a".into());
        let due = owed.due(10);
        owed.owe("a".into());
        owed.paid(&due);
        assert!(owed.any());
        assert_eq!(owed.due(10).len(), 1);
    }

    #[test]
    fn keys_are_handed_out_a_batch_at_a_time() {
        let mut owed = Owed::default();
        for i in 0..5 {
            owed.owe(format!("k{i}"));
        }
        let first = owed.due(2);
        assert_eq!(first.len(), 2);
        owed.paid(&first);
        assert_eq!(owed.len(), 3);
    }

    #[test]
    fn a_mark_is_paid_once_every_failure_up_to_it_is() {
        let mut owed = Owed::default();
        assert!(owed.paid_through(owed.last_failure()), "nothing failed");
        owed.owe("a".into());
        let first = owed.last_failure();
        owed.owe("b".into());
        let second = owed.last_failure();
        assert!(!owed.paid_through(first));
        let due: Vec<_> = owed.due(10).into_iter().filter(|(k, _)| k == "a").collect();
        owed.paid(&due);
        assert!(owed.paid_through(first), "a is paid, b failed after");
        assert!(!owed.paid_through(second));
        // A key that fails again is still owed for its earlier failure.
        owed.owe("b".into());
        assert!(!owed.paid_through(second));
        let handed = owed.due(10);
        owed.owe("b".into());
        owed.paid(&handed);
        assert!(owed.paid_through(handed[0].1), "paid up to the drop");
        assert!(!owed.paid_through(owed.last_failure()), "failed after it");
        owed.paid(&owed.due(10));
        assert!(owed.paid_through(owed.last_failure()));
    }

    #[test]
    fn an_owed_sweep_holds_every_mark_until_it_is_swept() {
        let mut owed = Owed::with_most(1);
        owed.owe("a".into());
        owed.owe("b".into());
        let mark = owed.last_failure();
        assert!(!owed.paid_through(0) && !owed.paid_through(mark));
        let Some(as_of) = owed.sweep_due() else {
            panic!("a sweep owed")
        };
        owed.swept(as_of);
        assert!(owed.paid_through(mark));
    }

    #[test]
    fn a_key_past_the_most_owes_a_sweep_of_everything() {
        let mut owed = Owed::with_most(2);
        owed.owe("a".into());
        owed.owe("b".into());
        assert_eq!(owed.sweep_due(), None);
        // A key already owed still fits.
        owed.owe("a".into());
        assert_eq!(owed.sweep_due(), None);
        owed.owe("c".into());
        let Some(as_of) = owed.sweep_due() else {
            panic!("a sweep owed")
        };
        owed.swept(as_of);
        assert!(!owed.any());
    }

    #[test]
    fn a_sweep_forgives_nothing_that_failed_after_it_started() {
        let mut owed = Owed::with_most(1);
        owed.owe("a".into());
        owed.owe("b".into());
        let Some(as_of) = owed.sweep_due() else {
            panic!("a sweep owed")
        };
        owed.owe("a".into());
        owed.owe("c".into());
        owed.swept(as_of);
        assert_eq!(owed.due(10), vec![("a".to_owned(), 3)]);
        assert!(
            owed.sweep_due().is_some(),
            "c failed after the sweep started"
        );
    }

    #[test]
    fn a_sweep_pays_a_key_up_to_where_it_started() {
        let mut owed = Owed::with_most(2);
        owed.owe("a".into());
        owed.owe("b".into());
        owed.owe("c".into());
        let Some(as_of) = owed.sweep_due() else {
            panic!("a sweep owed")
        };
        owed.owe("a".into());
        owed.swept(as_of);
        assert!(owed.paid_through(as_of), "a's first failure was swept");
        assert!(!owed.paid_through(owed.last_failure()), "not its second");
    }
}
