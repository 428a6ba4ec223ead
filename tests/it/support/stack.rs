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

/// Restarts the cluster's Cassandra nodes whose schema differs from the one
/// most nodes hold, then waits until every node holds the same. A node
/// starved of CPU can drop a DDL's schema pushes as too old and keep its
/// older schema until it restarts (seen in a CI run: 19 s pauses while three
/// nodes started on 2 cores), and then no DDL reaches agreement.
pub fn restart_nodes_out_of_schema_agreement() {
    for ip in outside_the_schema_majority(&stack(&["nodetool", "describecluster"])) {
        let node = ip.rsplit('.').next().unwrap_or_default();
        eprintln!("cassandra{node} ({ip}) holds another schema than the others; restarting it");
        stack(&["restart", &format!("cassandra{node}")]);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while !outside_the_schema_majority(&stack(&["nodetool", "describecluster"])).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the nodes still disagree on the schema 300 s after a restart"
        );
        std::thread::sleep(std::time::Duration::from_secs(5));
    }
}

/// The nodes that `nodetool describecluster` lists under any schema version
/// but the one held by the most nodes.
fn outside_the_schema_majority(describecluster: &str) -> Vec<String> {
    let mut versions: Vec<Vec<String>> = describecluster
        .lines()
        .skip_while(|l| !l.contains("Schema versions:"))
        .skip(1)
        .take_while(|l| !l.contains("Stats for all nodes"))
        .filter_map(|l| {
            let (_, nodes) = l.split_once(": [")?;
            Some(
                nodes
                    .trim_end_matches(']')
                    .split(',')
                    .map(|n| n.trim().to_owned())
                    .filter(|n| !n.is_empty())
                    .collect(),
            )
        })
        .collect();
    versions.sort_by_key(|nodes| std::cmp::Reverse(nodes.len()));
    versions.into_iter().skip(1).flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::outside_the_schema_majority;

    #[test]
    fn the_nodes_outside_the_schema_most_nodes_hold_are_named() {
        let split = "Cluster Information:\n\tSchema versions:\n\t\tf42a74ee-e2ed-3f14-8ce4-70cc0a3dc55f: [127.0.0.1, 127.0.0.2]\n\n\t\t6c0e04b5-45de-323c-aafe-e6b82c220e48: [127.0.0.3]\n\nStats for all nodes:\n\tLive: 3\n";
        assert_eq!(outside_the_schema_majority(split), ["127.0.0.3"]);
        let agreed = "\tSchema versions:\n\t\tf42a74ee-e2ed-3f14-8ce4-70cc0a3dc55f: [127.0.0.1, 127.0.0.2, 127.0.0.3]\n\nStats for all nodes:\n";
        assert!(outside_the_schema_majority(agreed).is_empty());
    }
}
