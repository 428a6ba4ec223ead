//! The demo page and the reference client in a real headless Chromium
//! (`clients/js/test/browser.test.mjs`, run by Node with playwright-core
//! over the DevTools protocol) against `tally vote --demo` on the real
//! stack. Each user may vote twice a second in bursts of 3, so the page
//! meets 429s. The last test's page is saved to
//! `$CARGO_TARGET_DIR/tally-demo.png` (docs/demo.png is one such).

use crate::support::{TestEnv, TestResult};

#[tokio::test]
async fn the_demo_page_in_a_real_browser_counts_each_click_once_and_draws_what_the_api_serves()
-> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        demo: true,
        user_rate: 2.0,
        user_burst: 3,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let root = crate::support::stack::root();
    let screenshot = std::path::PathBuf::from(
        std::env::var("CARGO_TARGET_DIR")
            .unwrap_or_else(|_| root.join("target").display().to_string()),
    )
    .join("tally-demo.png");
    let _ = std::fs::remove_file(&screenshot);
    crate::support::node::run_tests(
        "test/browser.test.mjs",
        vec![
            ("TALLY_URL", app.address.clone()),
            ("TALLY_SCREENSHOT", screenshot.display().to_string()),
        ],
        5,
    )
    .await;
    assert!(
        std::fs::metadata(&screenshot).is_ok_and(|m| m.len() > 10_000),
        "the page was saved to {}",
        screenshot.display()
    );
    Ok(())
}

#[tokio::test]
async fn without_the_demo_flag_there_is_no_demo_page_and_no_login() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    for (method, path) in [
        (reqwest::Method::GET, "/demo"),
        (reqwest::Method::GET, "/demo/tally.mjs"),
        (reqwest::Method::POST, "/demo/login"),
    ] {
        let res = app
            .client
            .request(method.clone(), format!("{}{path}", app.address))
            .json(&serde_json::json!({"user": "mallory"}))
            .send()
            .await?;
        assert_eq!(res.status(), 404, "{method} {path}");
    }
    Ok(())
}

#[tokio::test]
async fn the_demo_login_refuses_a_bad_name_and_a_bad_body_with_400_and_a_huge_one_with_413()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env
        .spawn_app_with(tally::api::ApiConfig {
            demo: true,
            ..env.api_config()
        })
        .await;
    let login = format!("{}/demo/login", app.address);
    let too_long = format!(r#"{{"user": "{}"}}"#, "x".repeat(129));
    for (body, code) in [
        (r#"{"user": "bell\u0007"}"#, "invalid_user"),
        (r#"{"user": ""}"#, "invalid_user"),
        (too_long.as_str(), "invalid_user"),
        (r#"{"name": "alice"}"#, "malformed_json"),
        ("not json", "malformed_json"),
    ] {
        let res = app.client.post(&login).body(body.to_owned()).send().await?;
        assert_eq!(res.status(), 400, "{body}");
        let error: serde_json::Value = res.json().await?;
        assert_eq!(error["error"]["code"], code, "{body}");
    }
    // Too large: refused in JSON as every error is, not in actix's plain text.
    let huge = format!(r#"{{"user": "{}"}}"#, "x".repeat(5_000));
    let res = app.client.post(&login).body(huge).send().await?;
    assert_eq!(res.status(), 413);
    let error: serde_json::Value = res.json().await?;
    assert_eq!(error["error"]["code"], "payload_too_large");
    let res = app
        .client
        .post(&login)
        .json(&serde_json::json!({"user": "alice"}))
        .send()
        .await?;
    assert_eq!(res.status(), 200);
    let token = res.json::<serde_json::Value>().await?["token"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_default();
    let summary = app
        .client
        .get(format!("{}/v1/votes/summary?target_ids=v1", app.address))
        .bearer_auth(&token)
        .send()
        .await?;
    assert_eq!(summary.status(), 200, "the demo's token is the API's own");
    Ok(())
}
