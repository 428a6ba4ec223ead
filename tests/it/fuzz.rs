//! Schemathesis (from PyPI, installed by scripts/test.sh) against the served
//! /openapi.json: generated valid and invalid requests, checked for 5xx, for
//! statuses and bodies the document does not describe, and for ignored auth.

use std::time::Duration;

use crate::support::{TestEnv, TestResult};

#[tokio::test]
async fn schemathesis_finds_no_server_error_and_no_response_that_breaks_the_schema() -> TestResult {
    let env = TestEnv::new().await;
    let mut config = env.api_config();
    // Schemathesis sends everything as one user; the per-user limit is
    // tested elsewhere and would turn valid requests into 429s here.
    config.user_rate = 1_000_000.0;
    config.user_burst = 1_000_000;
    let app = tally::api::Application::build(config).await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until_stopped());
    let admin = tally::auth::mint(
        &tally::auth::AuthConfig::hs256(crate::support::JWT_SECRET),
        "fuzzer",
        Duration::from_secs(3600),
        vec!["admin".into()],
    )?;
    let report = std::env::temp_dir().join(format!("tally-schemathesis-{}.xml", env.id));

    // 60 per operation in CI; TALLY_FUZZ_EXAMPLES for a longer run.
    let examples = std::env::var("TALLY_FUZZ_EXAMPLES").unwrap_or_else(|_| "60".into());
    // On a blocking thread: this runtime also drives the app's Cassandra connections.
    let report_path = report.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args([
                "-m",
                "schemathesis.cli",
                "run",
                &format!("{base}/openapi.json"),
                "--checks",
                "all",
                "--max-examples",
                &examples,
                "--seed",
                "20261129",
            ])
            // A key reused with another body is a 422 by contract, a rule about
            // two requests that no schema can express; every other check runs.
            .args(["--exclude-checks", "positive_data_acceptance"])
            .args(["--header", &format!("Authorization: Bearer {admin}")])
            .args(["--report", "junit", "--report-junit-path"])
            .arg(&report_path)
            .env("NO_COLOR", "1")
            .output()
    })
    .await?
    .unwrap_or_else(|e| panic!("schemathesis: {e} (scripts/test.sh installs it)"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let junit = std::fs::read_to_string(&report).unwrap_or_default();
    let _ = std::fs::remove_file(&report);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "schemathesis found failures:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        junit.matches("<testcase").count() >= 3,
        "every operation was exercised:\n{junit}"
    );
    Ok(())
}
