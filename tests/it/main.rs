//! Integration tests against the real local stack (scripts/stack.sh up).
//! One binary for all of them, so the heavy crates link once.

mod browser;
mod buckets;
mod consumer;
mod fuzz;
mod js_client;
mod ops;
mod outbox;
mod reactions;
mod reconcile;
mod rejections;
mod served;
mod smoke;
mod support;
mod tokens;
mod votes;
