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
    let tokens = serde_json::Value::Object(tokens).to_string();
    crate::support::node::run_tests(
        "test/client.test.mjs",
        vec![("TALLY_URL", app.address.clone()), ("TALLY_TOKENS", tokens)],
        8,
    )
    .await;
    Ok(())
}
