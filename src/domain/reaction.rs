//! A user's reaction to one target, the deltas between reactions, and the
//! rule that applies a versioned transition exactly once.
//!
//! Everything here is pure: the vote API, the consumer and reconcile all move
//! totals through these functions, so they agree by construction.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The final state a user wants for one target. `None` is a state, not the
/// absence of one: removing a reaction is a transition like any other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reaction {
    None,
    Like,
    Dislike,
}

impl Reaction {
    pub const ALL: [Reaction; 3] = [Reaction::None, Reaction::Like, Reaction::Dislike];

    pub fn as_str(self) -> &'static str {
        match self {
            Reaction::None => "none",
            Reaction::Like => "like",
            Reaction::Dislike => "dislike",
        }
    }

    /// What this state adds to the totals: a like is (1, 0), a dislike (0, 1).
    fn contribution(self) -> Delta {
        match self {
            Reaction::None => Delta {
                likes: 0,
                dislikes: 0,
            },
            Reaction::Like => Delta {
                likes: 1,
                dislikes: 0,
            },
            Reaction::Dislike => Delta {
                likes: 0,
                dislikes: 1,
            },
        }
    }
}

impl fmt::Display for Reaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reaction must be one of like, dislike or none, not {0:?}")]
pub struct UnknownReaction(pub String);

impl FromStr for Reaction {
    type Err = UnknownReaction;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Reaction::None),
            "like" => Ok(Reaction::Like),
            "dislike" => Ok(Reaction::Dislike),
            other => Err(UnknownReaction(other.to_owned())),
        }
    }
}

/// How far each total moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Delta {
    pub likes: i64,
    pub dislikes: i64,
}

impl Delta {
    /// The table of deltas, derived rather than listed: the totals move by
    /// what the new state contributes minus what the old one did.
    pub fn between(from: Reaction, to: Reaction) -> Delta {
        let (f, t) = (from.contribution(), to.contribution());
        Delta {
            likes: t.likes - f.likes,
            dislikes: t.dislikes - f.dislikes,
        }
    }

    pub fn is_zero(self) -> bool {
        self == Delta::default()
    }
}

impl std::ops::AddAssign for Delta {
    fn add_assign(&mut self, rhs: Delta) {
        self.likes += rhs.likes;
        self.dislikes += rhs.dislikes;
    }
}

/// Per-target totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Totals {
    pub likes: i64,
    pub dislikes: i64,
}

/// As an operator reads it: `likes=66 dislikes=70`.
impl fmt::Display for Totals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "likes={} dislikes={}", self.likes, self.dislikes)
    }
}

impl Totals {
    /// Moves the totals by a delta. A total that would go negative means the
    /// delta was computed from a state the totals never counted; clamping at
    /// zero keeps the served number sane while reconcile repairs the cause.
    pub fn apply(self, delta: Delta) -> Totals {
        Totals {
            likes: (self.likes + delta.likes).max(0),
            dislikes: (self.dislikes + delta.dislikes).max(0),
        }
    }

    /// The totals that a set of per-user states adds up to.
    pub fn count<I: IntoIterator<Item = Reaction>>(states: I) -> Totals {
        states.into_iter().fold(Totals::default(), |acc, state| {
            acc.apply(Delta::between(Reaction::None, state))
        })
    }
}

/// The last transition counted for one (target, user): its version and the
/// state it left the user in. A user never counted is at version 0, `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub version: i64,
    pub state: Reaction,
}

impl Applied {
    pub const NEVER: Applied = Applied {
        version: 0,
        state: Reaction::None,
    };
}

/// What applying one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The version was already applied (a duplicate or a replay): nothing moves.
    Replay,
    /// The event is newer. `gap` is true when its `from` is not the state we
    /// had counted, which means an earlier transition was lost or reordered.
    Apply {
        next: Applied,
        delta: Delta,
        gap: bool,
    },
}

/// The apply rule. A newer event moves the totals from the state we counted
/// (not from the event's own `from`), so a lost or reordered event still
/// converges to the user's latest state and totals stay the sum of states.
pub fn apply(current: Applied, version: i64, from: Reaction, to: Reaction) -> Outcome {
    if version <= current.version {
        return Outcome::Replay;
    }
    Outcome::Apply {
        next: Applied { version, state: to },
        delta: Delta::between(current.state, to),
        gap: from != current.state || version != current.version + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn deltas_match_the_table_of_transitions() {
        use Reaction::*;
        let table = [
            ((None, Like), (1, 0)),
            ((Like, None), (-1, 0)),
            ((None, Dislike), (0, 1)),
            ((Dislike, None), (0, -1)),
            ((Like, Dislike), (-1, 1)),
            ((Dislike, Like), (1, -1)),
            ((Like, Like), (0, 0)),
            ((None, None), (0, 0)),
        ];
        for ((from, to), (likes, dislikes)) in table {
            assert_eq!(
                Delta::between(from, to),
                Delta { likes, dislikes },
                "{from} -> {to}"
            );
        }
    }

    #[test]
    fn reaction_round_trips_through_its_name() {
        for r in Reaction::ALL {
            assert_eq!(r.as_str().parse::<Reaction>(), Ok(r));
        }
        assert!("Like".parse::<Reaction>().is_err());
        assert!("".parse::<Reaction>().is_err());
    }

    #[test]
    fn an_applied_version_is_a_replay() {
        let at5 = Applied {
            version: 5,
            state: Reaction::Like,
        };
        assert_eq!(
            apply(at5, 5, Reaction::None, Reaction::Like),
            Outcome::Replay
        );
        assert_eq!(
            apply(at5, 3, Reaction::None, Reaction::Dislike),
            Outcome::Replay
        );
    }

    #[test]
    fn a_gap_moves_from_the_counted_state_not_the_events_from() {
        // v5 (none -> like) was lost; v6 says like -> dislike, but we counted none.
        let at4 = Applied {
            version: 4,
            state: Reaction::None,
        };
        let outcome = apply(at4, 6, Reaction::Like, Reaction::Dislike);
        assert_eq!(
            outcome,
            Outcome::Apply {
                next: Applied {
                    version: 6,
                    state: Reaction::Dislike
                },
                delta: Delta {
                    likes: 0,
                    dislikes: 1
                },
                gap: true
            }
        );
    }

    fn reaction() -> impl Strategy<Value = Reaction> {
        prop_oneof![
            Just(Reaction::None),
            Just(Reaction::Like),
            Just(Reaction::Dislike)
        ]
    }

    /// A user's true history: versions 1..=n, each `to` the next `from`.
    fn history() -> impl Strategy<Value = Vec<(i64, Reaction, Reaction)>> {
        prop::collection::vec(reaction(), 1..12).prop_map(|states| {
            let mut from = Reaction::None;
            let mut out = Vec::new();
            for (i, to) in states.into_iter().enumerate() {
                out.push((i as i64 + 1, from, to));
                from = to;
            }
            out
        })
    }

    proptest! {
        /// Any delivery of several users' transitions, duplicated, reordered
        /// and with some lost, ends each user at the state of the highest
        /// version delivered, and the totals equal the count of those states.
        #[test]
        fn any_delivery_converges_to_the_highest_version(
            histories in prop::collection::vec(history(), 1..6),
            duplicates in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
            drops in prop::collection::vec(any::<prop::sample::Index>(), 0..5),
            order in any::<u64>(),
        ) {
            let mut events: Vec<(usize, i64, Reaction, Reaction)> = histories.iter().enumerate()
                .flat_map(|(user, h)| h.iter().map(move |&(v, f, t)| (user, v, f, t)))
                .collect();
            for idx in &duplicates {
                let e = events[idx.index(events.len())];
                events.push(e);
            }
            for idx in &drops {
                if events.len() > 1 {
                    events.remove(idx.index(events.len()));
                }
            }
            // A deterministic shuffle from the generated number.
            let mut rng = order;
            for i in (1..events.len()).rev() {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                events.swap(i, (rng >> 33) as usize % (i + 1));
            }

            let mut applied: HashMap<usize, Applied> = HashMap::new();
            let mut totals = Totals::default();
            // Unclamped running sums: the rule itself must never need the clamp.
            let mut raw = Delta::default();
            for &(user, version, from, to) in &events {
                let current = applied.get(&user).copied().unwrap_or(Applied::NEVER);
                if let Outcome::Apply { next, delta, .. } = apply(current, version, from, to) {
                    totals = totals.apply(delta);
                    raw += delta;
                    prop_assert!(raw.likes >= 0 && raw.dislikes >= 0, "raw sums went negative: {:?}", raw);
                    applied.insert(user, next);
                }
            }

            let mut expected: HashMap<usize, Reaction> = HashMap::new();
            for &(user, version, _, to) in &events {
                let best = events.iter().filter(|e| e.0 == user).map(|e| e.1).max();
                if Some(version) == best {
                    expected.insert(user, to);
                }
            }
            for (user, state) in &expected {
                prop_assert_eq!(applied.get(user).map(|a| a.state), Some(*state));
            }
            prop_assert_eq!(totals, Totals::count(expected.values().copied()));
        }
    }
}
