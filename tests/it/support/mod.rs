//! The test harness, one file per concern, shared by `tests/it`, the chaos
//! run (`tests/chaos.rs`) and, for its generator, the benches:
//!
//! - `env`: every test gets its own keyspace, topics, consumer group and
//!   Redis key prefix, migrated with the product's own `migrate`, and dropped
//!   again when the test ends (also when it panics);
//! - `app`: the vote API in-process, and one helper per endpoint;
//! - `pipeline`: the consumer in-process, and the transitions topic;
//! - `truth`: what `target_stats` holds against what `reactions` says;
//! - `history`: a linearizability checker for one (user, target) register;
//! - `stack`: `scripts/stack.sh` and signals to its servers, for fault runs;
//! - `rng`: the one deterministic generator (and Zipf), so a failing run can
//!   be repeated from its seed;
//! - `writers`: writers of a bucket's fence that the product does not have.

// Each binary that includes this module uses a different part of it.
#![allow(dead_code, unused_imports)]

mod app;
mod env;
pub mod history;
pub mod node;
mod pipeline;
pub mod rng;
mod servers;
pub mod stack;
mod truth;
mod writers;

use std::time::Duration;

pub use app::{Reply, TestApp, new_key, post_vote, token, until_serving, wait_until_healthy};
pub use env::{CLUSTER_HOSTS, TEST_BUCKETS, TEST_PARTITIONS, TestEnv, secure_vars};
pub use pipeline::RunningConsumer;
pub use rng::{Rng, Zipf};
pub use servers::{GatedLink, LateLink, PrivateRedis, Proc, SkewedLink, free_port, signal};
pub use truth::{Tallies, Tally, served_mismatches};
pub use writers::MoveFence;

pub const JWT_SECRET: &str = "integration-test-secret-of-32-bytes-or-more";

/// What a test returns: a failing step is an error with its cause, and the
/// test reads as the scenario it checks.
pub type TestResult = anyhow::Result<()>;

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = tokio::time::Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
