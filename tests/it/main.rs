//! Integration tests against the real local stack (scripts/stack.sh up).
//! One binary for all of them, so the heavy crates link once.

mod consumer;
mod fuzz;
mod ops;
mod reconcile;
mod rejections;
mod smoke;
#[allow(dead_code)] // shared with tests/chaos.rs, which uses other parts
mod support;
mod votes;
