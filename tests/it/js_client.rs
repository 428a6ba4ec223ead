//! The JavaScript reference client (`clients/js/`) against the real API:
//! its own tests, run by Node, with the API on the real stack. The API
//! allows each user 2 votes a second (bursts of 3), so the client meets 429s.

use crate::support::{TestEnv, TestResult, token};

#[tokio::test]
async fn the_javascript_client_passes_its_tests_against_the_real_api() -> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_rate: 2.0,
        user_burst: 3,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let users = [
        "js-double",
        "js-lossy",
        "js-tabs",
        "js-eager",
        "js-refused",
        "js-reader",
        "js-refresh",
    ];
    let tokens: serde_json::Map<String, serde_json::Value> = users
        .iter()
        .map(|u| ((*u).to_owned(), serde_json::Value::String(token(u))))
        .collect();
    let root = crate::support::stack::root();
    let address = app.address.clone();
    // On a blocking thread: this runtime also serves the API.
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("node")
            .args(["--test", "clients/js/test/client.test.mjs"])
            .current_dir(root)
            .env("TALLY_URL", address)
            .env(
                "TALLY_TOKENS",
                serde_json::Value::Object(tokens).to_string(),
            )
            .output()
    })
    .await?
    .unwrap_or_else(|e| panic!("node: {e} (scripts/stack.sh install installs it)"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "the client's tests failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("# fail 0"), "{stdout}");
    assert!(stdout.contains("# pass 8"), "every test ran:\n{stdout}");
    Ok(())
}
