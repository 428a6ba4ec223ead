//! The architecture's invariants, checked by reading the source. An invariant
//! that no test checks drifts; ARCHITECTURE.md names the test for each.
//!
//! These tests need no server and run before anything else in `.ci/run`.

use std::fs;
use std::path::PathBuf;

/// Which crate may be named only under which folder of `src/`.
const OWNERS: [(&str, &str); 4] = [
    ("rdkafka", "src/bus/"),
    ("scylla", "src/store/"),
    ("redis", "src/cache/"),
    ("deadpool_redis", "src/cache/"),
];

/// What code under `src/domain/` must not name: a clock, the network, files,
/// a runtime or a store. The domain is pure so that it can be property-tested.
const IMPURE: [&str; 9] = [
    "SystemTime",
    "Instant",
    "std::fs",
    "std::net",
    "tokio",
    "rdkafka",
    "scylla",
    "redis",
    "std::env",
];

#[test]
fn each_external_system_is_spoken_to_by_one_module_only() {
    let violations = violations(&rust_files("src"), |path, text| {
        let code = code_of(text);
        OWNERS
            .iter()
            .filter(|(krate, owner)| !path.starts_with(owner) && uses_crate(&code, krate))
            .map(|(krate, owner)| format!("uses `{krate}`, which only {owner} may"))
            .collect()
    });
    assert!(violations.is_empty(), "\n{}", violations.join("\n"));
}

#[test]
fn the_domain_reads_no_clock_and_does_no_io() {
    let violations = violations(&rust_files("src/domain"), |_, text| {
        let code = code_of(text);
        IMPURE
            .iter()
            .filter(|word| names(&code, word))
            .map(|word| format!("names `{word}`; the domain must stay pure"))
            .collect()
    });
    assert!(violations.is_empty(), "\n{}", violations.join("\n"));
}

#[test]
fn every_source_file_says_what_it_is_for() {
    let violations = violations(&rust_files("src"), |path, text| {
        let documented = text.trim_start().starts_with("//!") || path.ends_with("main.rs");
        if documented {
            vec![]
        } else {
            vec!["has no `//!` module comment".into()]
        }
    });
    assert!(violations.is_empty(), "\n{}", violations.join("\n"));
}

#[test]
fn no_test_is_ignored_and_nothing_stands_in_for_a_real_store() {
    let mut files = rust_files("src");
    files.extend(rust_files("tests"));
    files.extend(rust_files("benches"));
    let ignore = ["#[", "ignore"].concat();
    let stand_ins = ["in_memory_", "fake_", "mock_", "InMemory", "Fake", "Mock"];
    let violations = violations(&files, |_, text| {
        let mut found = Vec::new();
        if text.contains(&ignore) {
            found.push("ignores a test".to_owned());
        }
        for word in stand_ins {
            for system in [
                "store",
                "Store",
                "cassandra",
                "Cassandra",
                "kafka",
                "Kafka",
                "redis",
                "Redis",
                "bus",
                "Bus",
                "cache",
                "Cache",
            ] {
                if text.contains(&format!("{word}{system}")) {
                    found.push(format!("defines a stand-in `{word}{system}`"));
                }
            }
        }
        found
    });
    assert!(violations.is_empty(), "\n{}", violations.join("\n"));
}

#[test]
fn source_comments_speak_in_the_projects_own_words() {
    // The design documents live outside the repository; a comment that cites
    // them points a reader at something they do not have.
    let cited = ["the seed", "seed 00", "the seeds"];
    let violations = violations(&rust_files("src"), |_, text| {
        let lower = text.to_lowercase();
        cited
            .iter()
            .filter(|c| lower.contains(*c))
            .map(|c| format!("cites {c:?}; say the reason instead"))
            .collect()
    });
    assert!(violations.is_empty(), "\n{}", violations.join("\n"));
}

/// Whether code (comments stripped) names `word` as a whole path segment.
#[test]
fn every_alert_in_the_operations_guide_is_a_rule_and_every_rule_is_in_the_guide() {
    let read = |path: &str| {
        fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let guide = read("docs/operations.md");
    let table = guide
        .split("## Alert rules")
        .nth(1)
        .unwrap_or_else(|| panic!("docs/operations.md has no `## Alert rules` section"));
    let table = table.split("\n## ").next().unwrap_or_default();
    let mut documented: Vec<&str> = table
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let rules = read("docker/prometheus/alerts.yml");
    let mut defined: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::trim)
        .collect();
    documented.sort_unstable();
    defined.sort_unstable();
    assert!(
        !defined.is_empty(),
        "no rules in docker/prometheus/alerts.yml"
    );
    assert_eq!(
        documented, defined,
        "docs/operations.md and alerts.yml disagree"
    );
    let tests = read("docker/prometheus/alerts_test.yml");
    for rule in &defined {
        assert!(
            tests.contains(&format!("alertname: {rule}")),
            "{rule} has no promtool test in alerts_test.yml"
        );
    }
}

fn names(code: &str, word: &str) -> bool {
    code.match_indices(word).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + word.len()..].chars().next();
        let boundary = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        boundary(before) && boundary(after)
    })
}

/// Whether code names a path into `krate` (`krate::...`), as a `use` or
/// inline. A field or variable of the same name (`config.redis`) is not one.
fn uses_crate(code: &str, krate: &str) -> bool {
    code.match_indices(&format!("{krate}::")).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.' || c == ':')
    })
}

/// Runs `check` on every file's path and text, and collects
/// `path: problem` lines.
fn violations(files: &[PathBuf], check: impl Fn(&str, &str) -> Vec<String>) -> Vec<String> {
    let root = root();
    let mut out = Vec::new();
    for file in files {
        let path = file.to_string_lossy().replace('\\', "/");
        match fs::read_to_string(root.join(file)) {
            Ok(text) => out.extend(
                check(&path, &text)
                    .into_iter()
                    .map(|p| format!("{path}: {p}")),
            ),
            Err(e) => out.push(format!("{path}: unreadable: {e}")),
        }
    }
    out
}

/// The text without its line comments, so prose can name anything. Naive
/// about `//` inside strings, which can only hide a use, never invent one.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate being checked: cargo names it when it runs the test, which a
/// binary built from another checkout of the same sources would not know.
fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// Every `.rs` file under `dir` (relative to the crate), sorted.
fn rust_files(dir: &str) -> Vec<PathBuf> {
    let root = root();
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::from(dir)];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(root.join(&d)) else {
            continue;
        };
        for entry in entries.flatten() {
            let rel = d.join(entry.file_name());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(rel);
            } else if rel.extension().is_some_and(|e| e == "rs") {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn uses_crate_sees_paths_not_fields() {
    assert!(uses_crate("use rdkafka::Message;", "rdkafka"));
    assert!(uses_crate("let c = redis::cmd(\"PING\");", "redis"));
    assert!(uses_crate("use {redis::Script};", "redis"));
    assert!(!uses_crate("use deadpool_redis::Pool;", "redis"));
    assert!(!uses_crate("let r = config.redis;", "redis"));
    assert!(!uses_crate("use crate::cache::RedisConfig;", "redis"));
    assert!(!uses_crate("use crate::redis::x;", "redis"));
}

#[test]
fn names_matches_whole_segments_only() {
    assert!(names("use rdkafka::Message;", "rdkafka"));
    assert!(names("let c: redis::Cmd", "redis"));
    assert!(!names("use deadpool_redis::Pool;", "redis"));
    assert!(!names("let tokio_free = 1;", "tokio"));
    assert!(names("tokio::spawn(x)", "tokio"));
}
