//! One target's totals and the per-user versions they include, moved only by
//! the apply rule. The consumer folds transitions into it; reconcile folds
//! the per-user rows into it. Both then write what changed.

use std::collections::{BTreeSet, HashMap};

use super::ids::UserId;
use super::reaction::{Applied, Outcome, Reaction, Totals, apply};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    pub totals: Totals,
    /// The applied version and state of every user this ledger knows.
    pub applied: HashMap<UserId, Applied>,
    /// Users whose applied version moved: the rows to write.
    pub changed: BTreeSet<UserId>,
    pub replays: u64,
    pub gaps: u64,
}

impl Ledger {
    pub fn new(totals: Totals, applied: HashMap<UserId, Applied>) -> Ledger {
        Ledger {
            totals,
            applied,
            ..Ledger::default()
        }
    }

    /// Applies a published transition of `user` from `from` to `to` at
    /// `version`. A `from` that is not the state counted for the user means
    /// an earlier transition was lost or reordered: a gap.
    pub fn apply_event(&mut self, user: &UserId, version: i64, from: Reaction, to: Reaction) {
        if let Some(gap) = self.apply_from(user, version, Some(from), to) {
            self.gaps += u64::from(gap);
        }
    }

    /// Applies a user's row in `reactions` (its state at `version`), as a
    /// recount does. A row carries no `from`, so a recount finds no gaps.
    pub fn apply_row(&mut self, user: &UserId, version: i64, state: Reaction) {
        self.apply_from(user, version, None, state);
    }

    /// Moves the totals from the state counted for `user`; `None` for a
    /// replay, else whether it was a gap.
    fn apply_from(
        &mut self,
        user: &UserId,
        version: i64,
        from: Option<Reaction>,
        to: Reaction,
    ) -> Option<bool> {
        let current = self.applied.get(user).copied().unwrap_or(Applied::NEVER);
        match apply(current, version, from.unwrap_or(current.state), to) {
            Outcome::Replay => {
                self.replays += 1;
                None
            }
            Outcome::Apply { next, delta, gap } => {
                self.totals = self.totals.apply(delta);
                self.applied.insert(user.clone(), next);
                self.changed.insert(user.clone());
                Some(gap)
            }
        }
    }

    /// The applied rows of the users whose version moved, to be written.
    pub fn changed_rows(&self) -> Vec<(UserId, Applied)> {
        self.changed
            .iter()
            .map(|u| {
                (
                    u.clone(),
                    self.applied.get(u).copied().unwrap_or(Applied::NEVER),
                )
            })
            .collect()
    }

    /// What the applied states add up to. Equal to `totals` unless the
    /// stored totals were damaged.
    pub fn recount(&self) -> Totals {
        Totals::count(self.applied.values().map(|a| a.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn user(n: u8) -> UserId {
        UserId::parse(&format!("u{n}")).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_fold_counts_only_new_versions() {
        let mut l = Ledger::default();
        l.apply_event(&user(1), 1, Reaction::None, Reaction::Like);
        l.apply_event(&user(1), 1, Reaction::None, Reaction::Like);
        l.apply_event(&user(2), 1, Reaction::None, Reaction::Dislike);
        l.apply_event(&user(1), 2, Reaction::Like, Reaction::Dislike);
        assert_eq!(
            l.totals,
            Totals::count([Reaction::Dislike, Reaction::Dislike])
        );
        assert_eq!(l.replays, 1);
        assert_eq!(l.gaps, 0);
        assert_eq!(l.recount(), l.totals);
    }

    #[test]
    fn version_6_before_5_ends_at_6_and_counts_a_gap() {
        let at4 = HashMap::from([(
            user(1),
            Applied {
                version: 4,
                state: Reaction::None,
            },
        )]);
        let mut l = Ledger::new(Totals::default(), at4);
        l.apply_event(&user(1), 6, Reaction::Like, Reaction::Dislike);
        l.apply_event(&user(1), 5, Reaction::None, Reaction::Like);
        assert_eq!(
            l.applied.get(&user(1)),
            Some(&Applied {
                version: 6,
                state: Reaction::Dislike
            })
        );
        assert_eq!(l.totals, Totals::count([Reaction::Dislike]));
        assert_eq!(l.gaps, 1);
        assert_eq!(l.replays, 1);
    }

    proptest! {
        /// Splitting a stream into batches (as the consumer does, with a
        /// write between batches) gives the same ledger as one big fold.
        #[test]
        fn batching_does_not_change_the_result(
            events in prop::collection::vec((0u8..4, 1i64..8, 0usize..3, 0usize..3), 0..60),
            cut in 0usize..60,
        ) {
            let ev = |&(u, v, f, t): &(u8, i64, usize, usize)| (user(u), v, Reaction::ALL[f], Reaction::ALL[t]);
            let mut whole = Ledger::default();
            for e in &events {
                let (u, v, f, t) = ev(e);
                whole.apply_event(&u, v, f, t);
            }
            let cut = cut.min(events.len());
            let mut first = Ledger::default();
            for e in &events[..cut] {
                let (u, v, f, t) = ev(e);
                first.apply_event(&u, v, f, t);
            }
            let mut second = Ledger::new(first.totals, first.applied.clone());
            for e in &events[cut..] {
                let (u, v, f, t) = ev(e);
                second.apply_event(&u, v, f, t);
            }
            prop_assert_eq!(second.totals, whole.totals);
            prop_assert_eq!(&second.applied, &whole.applied);
            prop_assert_eq!(whole.recount(), whole.totals);
        }
    }
}
