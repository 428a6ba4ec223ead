//! Integration tests against the real local stack (scripts/stack.sh up).
//! One binary for all of them, so the heavy crates link once.

mod consumer;
mod fuzz;
mod ops;
mod reactions;
mod reconcile;
mod rejections;
mod smoke;
mod support;
mod votes;
