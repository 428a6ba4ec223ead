//! Runs a file of `node --test` tests from `clients/js` against an API this
//! test started, and checks that every one of them ran and passed.

/// Runs `file` (relative to `clients/js`) with `envs`, on a blocking thread
/// (the test's runtime also serves the API), and asserts that Node's runner
/// counted `passes` passes and no failure.
pub async fn run_tests(file: &str, envs: Vec<(&'static str, String)>, passes: usize) {
    let dir = super::stack::root().join("clients/js");
    let file = file.to_owned();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("node")
            .args(["--test", "--test-concurrency=1", &file])
            .current_dir(dir)
            .envs(envs)
            .output()
    })
    .await
    .unwrap_or_else(|e| panic!("node's thread: {e}"))
    .unwrap_or_else(|e| panic!("node: {e} (scripts/stack.sh install installs it)"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "the tests failed (clients/js needs `npm ci`, Node and Chromium `scripts/stack.sh install`):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("# fail 0"), "{stdout}");
    assert!(
        stdout.contains(&format!("# pass {passes}\n")),
        "every test ran:\n{stdout}"
    );
}
