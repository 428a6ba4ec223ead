//! tally: vote and likes counting. See ARCHITECTURE.md for the codemap.

pub mod api;
pub mod auth;
pub mod bus;
pub mod cache;
pub mod cast;
pub mod cli;
pub mod consumer;
pub mod counts;
pub mod domain;
pub mod fence;
pub mod metrics;
pub mod ops;
pub mod reconcile;
pub mod relay;
pub mod secret;
pub mod store;
pub mod telemetry;
