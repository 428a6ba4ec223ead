//! One target's totals and the per-user versions they include, moved only by
//! the apply rule. The consumer folds transitions into it; reconcile folds
//! the per-user rows into it. Both then write what changed.

use std::collections::{BTreeSet, HashMap};

use super::ids::UserId;
use super::reaction::{Applied, Delta, Outcome, Reaction, Totals, apply};

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

    /// Makes the applied row of `user` say what their row in `reactions`
    /// says: a recount's repair. A newer row is applied like any other; an
    /// applied row at the same version with another state, or ahead of the
    /// row (a version that never happened), is corrected to the row.
    pub fn correct_row(&mut self, user: &UserId, version: i64, state: Reaction) {
        let current = self.applied.get(user).copied().unwrap_or(Applied::NEVER);
        if current.version < version {
            self.apply_row(user, version, state);
        } else if current != (Applied { version, state }) {
            self.set(user, current, Applied { version, state });
        }
    }

    /// Forgets a user counted here who has no row in `reactions`: as if they
    /// had never been counted.
    pub fn forget(&mut self, user: &UserId) {
        if let Some(current) = self.applied.get(user).copied() {
            if current != Applied::NEVER {
                self.set(user, current, Applied::NEVER);
            }
        }
    }

    fn set(&mut self, user: &UserId, current: Applied, next: Applied) {
        self.totals = self.totals.apply(Delta::between(current.state, next.state));
        self.applied.insert(user.clone(), next);
        self.changed.insert(user.clone());
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

    #[test]
    fn a_recount_corrects_a_wrong_state_a_future_version_and_a_ghost() {
        let applied = HashMap::from([
            (
                user(1),
                Applied {
                    version: 3,
                    state: Reaction::Like,
                },
            ),
            (
                user(2),
                Applied {
                    version: 1 << 62,
                    state: Reaction::Like,
                },
            ),
            (
                user(3),
                Applied {
                    version: 2,
                    state: Reaction::Dislike,
                },
            ),
        ]);
        let mut l = Ledger::new(
            Totals::count([Reaction::Like, Reaction::Like, Reaction::Dislike]),
            applied,
        );
        l.correct_row(&user(1), 3, Reaction::Dislike);
        l.correct_row(&user(2), 4, Reaction::None);
        l.forget(&user(3));
        l.forget(&user(9));
        assert_eq!(l.totals, Totals::count([Reaction::Dislike]));
        assert_eq!(l.recount(), l.totals);
        assert_eq!(
            l.applied[&user(2)],
            Applied {
                version: 4,
                state: Reaction::None
            }
        );
        assert_eq!(l.applied[&user(3)], Applied::NEVER);
        assert_eq!(l.changed.len(), 3);
        // A row the ledger already agrees with changes nothing.
        let mut same = Ledger::new(
            Totals::count([Reaction::Like]),
            HashMap::from([(
                user(1),
                Applied {
                    version: 2,
                    state: Reaction::Like,
                },
            )]),
        );
        same.correct_row(&user(1), 2, Reaction::Like);
        assert!(same.changed.is_empty());
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
