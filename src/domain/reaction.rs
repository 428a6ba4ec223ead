//! A user's reaction to one target, the deltas between reactions, and the
//! rule that applies a versioned transition exactly once.
//!
//! Everything here is pure: the vote API, the consumer and reconcile all move
//! totals through these functions, so they agree by construction.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Declares the reactions tally counts. Each line names the variant, its
/// name on the wire and in storage, and the name of its total. Everything
/// else (`Totals`, the JSON bodies, the cache fields, the `target_stats`
/// columns, the OpenAPI document, the CLI report) is derived from the list,
/// so adding a reaction is one line here and one migration that adds its
/// column to `target_stats`.
macro_rules! declare_reactions {
    ($( $(#[$attr:meta])* $variant:ident = $name:literal, total $total:literal; )+) => {
        /// The final state a user wants for one target. `None` is a state,
        /// not the absence of one: removing a reaction is a transition like
        /// any other.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Reaction {
            None,
            $( $(#[$attr])* $variant, )+
        }

        impl Reaction {
            /// Every state, `None` first.
            pub const ALL: &'static [Reaction] = &[Reaction::None, $( $(#[$attr])* Reaction::$variant, )+];

            /// The counted reactions, in the order of `Totals`, the cache
            /// fields and the `target_stats` columns.
            pub const COUNTED: &'static [Reaction] = &[$( $(#[$attr])* Reaction::$variant, )+];

            const NAMES: &'static [&'static str] = &["none", $( $(#[$attr])* $name, )+];

            pub fn as_str(self) -> &'static str {
                match self {
                    Reaction::None => "none",
                    $( $(#[$attr])* Reaction::$variant => $name, )+
                }
            }

            /// The name of this reaction's total (`likes`), which is also its
            /// `target_stats` column; `None` counts nowhere.
            pub fn total_name(self) -> Option<&'static str> {
                match self {
                    Reaction::None => None,
                    $( $(#[$attr])* Reaction::$variant => Some($total), )+
                }
            }
        }
    };
}

declare_reactions! {
    Like = "like", total "likes";
    Dislike = "dislike", total "dislikes";
    // A third reaction, compiled in only by the `third-reaction` feature:
    // the build that proves a new reaction needs nothing but its line here
    // and its migration.
    #[cfg(feature = "third-reaction")]
    Love = "love", total "loves";
}

/// How many reactions are counted: the width of `Totals` and `Delta`.
pub const N_COUNTED: usize = Reaction::COUNTED.len();

impl Reaction {
    /// Where this reaction's total sits in `Totals`; `None` for `None`.
    fn slot(self) -> Option<usize> {
        // `None` is the first variant; the counted ones follow in order.
        (self as usize).checked_sub(1)
    }

    /// The names of the totals, in `COUNTED` order.
    pub fn total_names() -> impl Iterator<Item = &'static str> {
        Reaction::COUNTED.iter().filter_map(|r| r.total_name())
    }

    /// What this state adds to the totals: one in its own slot.
    fn contribution(self) -> Delta {
        let mut d = Delta::default();
        if let Some(i) = self.slot() {
            d.0[i] = 1;
        }
        d
    }
}

impl fmt::Display for Reaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reaction must be one of {}, not {got:?}", Reaction::NAMES.join(", "))]
pub struct UnknownReaction {
    pub got: String,
}

impl FromStr for Reaction {
    type Err = UnknownReaction;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Reaction::ALL
            .iter()
            .copied()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownReaction { got: s.to_owned() })
    }
}

impl Serialize for Reaction {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Reaction {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        name.parse()
            .map_err(|_| de::Error::unknown_variant(&name, Reaction::NAMES))
    }
}

/// How far each total moves, one entry per counted reaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Delta([i64; N_COUNTED]);

impl Delta {
    /// The table of deltas, derived rather than listed: the totals move by
    /// what the new state contributes minus what the old one did.
    pub fn between(from: Reaction, to: Reaction) -> Delta {
        let (f, t) = (from.contribution(), to.contribution());
        Delta(std::array::from_fn(|i| t.0[i] - f.0[i]))
    }

    pub fn is_zero(self) -> bool {
        self == Delta::default()
    }

    /// How far `reaction`'s total moves (0 for `None`).
    pub fn get(self, reaction: Reaction) -> i64 {
        reaction.slot().map_or(0, |i| self.0[i])
    }

    /// The moves in `COUNTED` order.
    pub fn values(self) -> [i64; N_COUNTED] {
        self.0
    }
}

impl std::ops::AddAssign for Delta {
    fn add_assign(&mut self, rhs: Delta) {
        for (a, b) in self.0.iter_mut().zip(rhs.0) {
            *a += b;
        }
    }
}

/// Per-target totals, one per counted reaction. On the wire they are
/// fields named after the totals: `{"likes": 3, "dislikes": 1}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals([i64; N_COUNTED]);

impl Totals {
    /// Totals from values in `COUNTED` order (as stored).
    pub fn from_values(values: [i64; N_COUNTED]) -> Totals {
        Totals(values)
    }

    /// The total of one reaction (0 for `None`).
    pub fn get(self, reaction: Reaction) -> i64 {
        reaction.slot().map_or(0, |i| self.0[i])
    }

    /// The totals in `COUNTED` order.
    pub fn values(self) -> [i64; N_COUNTED] {
        self.0
    }

    /// Whether nothing is counted.
    pub fn is_zero(self) -> bool {
        self.0.iter().all(|v| *v == 0)
    }

    /// Moves the totals by a delta. A total that would go negative means the
    /// delta was computed from a state the totals never counted; clamping at
    /// zero keeps the served number sane while reconcile repairs the cause.
    pub fn apply(self, delta: Delta) -> Totals {
        Totals(std::array::from_fn(|i| (self.0[i] + delta.0[i]).max(0)))
    }

    /// Two disjoint sets of voters' totals together: a target's from its
    /// buckets'.
    pub fn plus(self, other: Totals) -> Totals {
        Totals(std::array::from_fn(|i| self.0[i] + other.0[i]))
    }

    /// These totals without some voters' (never below zero: totals that
    /// did not count them were damaged, and reconcile replaces them).
    pub fn minus(self, other: Totals) -> Totals {
        Totals(std::array::from_fn(|i| (self.0[i] - other.0[i]).max(0)))
    }

    /// The totals that a set of per-user states adds up to.
    pub fn count<I: IntoIterator<Item = Reaction>>(states: I) -> Totals {
        states.into_iter().fold(Totals::default(), |acc, state| {
            acc.apply(Delta::between(Reaction::None, state))
        })
    }
}

/// As an operator reads it: `likes=66 dislikes=70`.
impl fmt::Display for Totals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, n)) in Reaction::total_names().zip(self.0).enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{name}={n}")?;
        }
        Ok(())
    }
}

impl Totals {
    /// The totals as entries of a map being written: an object that holds
    /// them beside fields of its own (a summary's item) writes them so.
    pub fn serialize_entries<M: SerializeMap>(&self, map: &mut M) -> Result<(), M::Error> {
        for (name, n) in Reaction::total_names().zip(self.0) {
            map.serialize_entry(name, &n)?;
        }
        Ok(())
    }
}

impl Serialize for Totals {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(N_COUNTED))?;
        self.serialize_entries(&mut map)?;
        map.end()
    }
}

impl<'de> Deserialize<'de> for Totals {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Totals;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "an object with {}",
                    Reaction::total_names().collect::<Vec<_>>().join(", ")
                )
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Totals, A::Error> {
                let mut values = [None; N_COUNTED];
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match Reaction::total_names().position(|n| n == key) {
                        Some(i) => values[i] = Some(map.next_value::<i64>()?),
                        None => {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                let mut out = [0; N_COUNTED];
                for (i, (v, name)) in values.into_iter().zip(Reaction::total_names()).enumerate() {
                    out[i] = v.ok_or_else(|| de::Error::missing_field(name))?;
                }
                Ok(Totals(out))
            }
        }
        d.deserialize_map(Fields)
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
        for ((from, to), moves) in table {
            let d = Delta::between(from, to);
            assert_eq!((d.get(Like), d.get(Dislike)), moves, "{from} -> {to}");
        }
    }

    #[test]
    fn reaction_round_trips_through_its_name() {
        for &r in Reaction::ALL {
            assert_eq!(r.as_str().parse::<Reaction>(), Ok(r));
            let json = serde_json::to_string(&r).unwrap_or_default();
            assert_eq!(json, format!("\"{r}\""));
            assert_eq!(serde_json::from_str::<Reaction>(&json).ok(), Some(r));
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
                delta: Delta::between(Reaction::None, Reaction::Dislike),
                gap: true
            }
        );
    }

    #[test]
    fn every_declared_reaction_has_its_own_total() {
        assert_eq!(Reaction::ALL.len(), N_COUNTED + 1);
        let names: std::collections::BTreeSet<_> = Reaction::total_names().collect();
        assert_eq!(names.len(), N_COUNTED, "total names must be distinct");
        for &r in Reaction::COUNTED {
            let one = Totals::count([r]);
            for &other in Reaction::COUNTED {
                assert_eq!(
                    one.get(other),
                    i64::from(r == other),
                    "{r} counted into {other}"
                );
            }
            assert_eq!(Delta::between(r, Reaction::None).get(r), -1);
        }
        assert_eq!(Totals::count([Reaction::None]), Totals::default());
    }

    #[test]
    fn totals_are_named_fields_on_the_wire_and_plain_for_operators() {
        let t = Totals::count([Reaction::Like, Reaction::Like, Reaction::Dislike]);
        let json = serde_json::to_value(t).unwrap_or_default();
        assert_eq!(json["likes"], 2);
        assert_eq!(json["dislikes"], 1);
        assert_eq!(json.as_object().map(|o| o.len()), Some(N_COUNTED));
        assert_eq!(serde_json::from_value::<Totals>(json).ok(), Some(t));
        assert!(t.to_string().starts_with("likes=2 dislikes=1"), "{t}");
        assert!(serde_json::from_str::<Totals>(r#"{"likes": 1}"#).is_err());
    }

    fn reaction() -> impl Strategy<Value = Reaction> {
        prop::sample::select(Reaction::ALL)
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
                    prop_assert!(raw.values().iter().all(|n| *n >= 0), "raw sums went negative: {:?}", raw);
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
