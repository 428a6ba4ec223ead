//! The pure core: ids, reactions, deltas, the apply rule and the transition
//! event. Nothing here does I/O, so all of it is unit- and property-tested.

pub mod bucket;
pub mod ids;
pub mod ledger;
pub mod reaction;
pub mod transition;

pub use bucket::{Bucket, Layout};
pub use ids::{IdError, IdempotencyKey, TargetId, TargetType, UserId};
pub use ledger::Ledger;
pub use reaction::{Applied, Delta, Outcome, Reaction, Totals, apply};
pub use transition::{InvalidTransition, Transition};
