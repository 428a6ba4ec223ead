//! The shared stack of `scripts/stack.sh`, for the runs that inject faults
//! into it: the checkout's own script, and signals to one of its servers.

use std::process::{Command, Stdio};

/// The checkout being tested: cargo names it when it runs the test (a binary
/// built from another checkout of the same sources would not know it).
pub fn root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}

/// Runs `scripts/stack.sh` with `args`, and returns what it printed.
pub fn stack(args: &[&str]) -> String {
    let out = Command::new(root().join("scripts/stack.sh"))
        .args(args)
        // A node restarted under load, on cores it shares with the load and
        // the other nodes, can take minutes to answer.
        .env("TALLY_STACK_START_TIMEOUT", "600")
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success(), "scripts/stack.sh {args:?} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Sends `sig` (kill(1) syntax: -KILL, -STOP, -CONT) to one server the
/// script started, by the pid it recorded.
pub fn signal_server(name: &str, sig: &str) {
    let pid: u32 = stack(&["pid", name])
        .parse()
        .unwrap_or_else(|e| panic!("pid of {name}: {e}"));
    assert!(super::signal(sig, pid), "kill {sig} {name}");
}

/// A number from the environment, or `default`.
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
