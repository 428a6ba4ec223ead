//! Everything a client can get wrong: a clear 4xx JSON error, nothing
//! written, nothing published. And no token but a valid one lets anyone in.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{EncodingKey, Header};
use serde_json::json;

use anyhow::Context;

use crate::support::{JWT_SECRET, TestApp, TestEnv, TestResult, new_key, token};

const VALID: &str = r#"{"target_id":"video_1","target_type":"video","action":"like"}"#;

struct Case {
    name: &'static str,
    status: u16,
    code: &'static str,
    request: fn(&TestApp) -> reqwest::RequestBuilder,
}

fn post(app: &TestApp) -> reqwest::RequestBuilder {
    app.client
        .post(format!("{}/v1/votes", app.address))
        .bearer_auth(token("mallory"))
}

fn with_body(app: &TestApp, body: &'static str) -> reqwest::RequestBuilder {
    post(app)
        .header("Idempotency-Key", new_key())
        .header("Content-Type", "application/json")
        .body(body)
}

#[tokio::test]
async fn every_bad_request_gets_a_json_4xx_and_changes_nothing() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let cases = [
        Case {
            name: "malformed JSON",
            status: 400,
            code: "malformed_json",
            request: |a| with_body(a, "{not json"),
        },
        Case {
            name: "invalid UTF-8",
            status: 400,
            code: "malformed_json",
            request: |a| {
                post(a)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(vec![b'{', 0xff, 0xfe, b'}'])
            },
        },
        Case {
            name: "deeply nested JSON",
            status: 400,
            code: "malformed_json",
            request: |a| {
                let deep = format!("{}{}", "[".repeat(2000), "]".repeat(2000));
                post(a)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(deep)
            },
        },
        Case {
            name: "missing field",
            status: 400,
            code: "malformed_json",
            request: |a| with_body(a, r#"{"target_id":"v","action":"like"}"#),
        },
        Case {
            name: "unknown action",
            status: 400,
            code: "invalid_action",
            request: |a| {
                with_body(
                    a,
                    r#"{"target_id":"video_1","target_type":"video","action":"love"}"#,
                )
            },
        },
        Case {
            name: "unknown target type",
            status: 400,
            code: "invalid_target_type",
            request: |a| {
                with_body(
                    a,
                    r#"{"target_id":"video_1","target_type":"song","action":"like"}"#,
                )
            },
        },
        Case {
            name: "bad target_id",
            status: 400,
            code: "invalid_target_id",
            request: |a| {
                with_body(
                    a,
                    r##"{"target_id":"#idem","target_type":"video","action":"like"}"##,
                )
            },
        },
        Case {
            name: "too long target_id",
            status: 400,
            code: "invalid_target_id",
            request: |a| {
                let body =
                    json!({"target_id": "v".repeat(129), "target_type": "video", "action": "like"})
                        .to_string();
                post(a)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(body)
            },
        },
        Case {
            name: "action of the wrong type",
            status: 400,
            code: "malformed_json",
            request: |a| {
                with_body(
                    a,
                    r#"{"target_id":"video_1","target_type":"video","action":1}"#,
                )
            },
        },
        Case {
            name: "missing Idempotency-Key",
            status: 400,
            code: "missing_idempotency_key",
            request: |a| {
                post(a)
                    .header("Content-Type", "application/json")
                    .body(VALID)
            },
        },
        Case {
            name: "Idempotency-Key with a space",
            status: 400,
            code: "invalid_idempotency_key",
            request: |a| {
                post(a)
                    .header("Idempotency-Key", "two words")
                    .header("Content-Type", "application/json")
                    .body(VALID)
            },
        },
        Case {
            name: "Idempotency-Key too long",
            status: 400,
            code: "invalid_idempotency_key",
            request: |a| {
                post(a)
                    .header("Idempotency-Key", "k".repeat(256))
                    .header("Content-Type", "application/json")
                    .body(VALID)
            },
        },
        Case {
            name: "body over 4 KiB",
            status: 413,
            code: "payload_too_large",
            request: |a| {
                let body = json!({"target_id": "video_1", "target_type": "video", "action": "like", "pad": "x".repeat(5000)}).to_string();
                post(a)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(body)
            },
        },
        Case {
            name: "not JSON",
            status: 415,
            code: "unsupported_media_type",
            request: |a| {
                post(a)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "text/plain")
                    .body(VALID)
            },
        },
        Case {
            name: "no content type",
            status: 415,
            code: "unsupported_media_type",
            request: |a| post(a).header("Idempotency-Key", new_key()).body(VALID),
        },
        Case {
            name: "no token",
            status: 401,
            code: "unauthorized",
            request: |a| {
                a.client
                    .post(format!("{}/v1/votes", a.address))
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(VALID)
            },
        },
        Case {
            name: "summary without ids",
            status: 400,
            code: "invalid_target_ids",
            request: |a| {
                a.client
                    .get(format!("{}/v1/votes/summary", a.address))
                    .bearer_auth(token("mallory"))
            },
        },
        Case {
            name: "summary with 101 ids",
            status: 400,
            code: "invalid_target_ids",
            request: |a| {
                let ids = (0..101)
                    .map(|i| format!("v{i}"))
                    .collect::<Vec<_>>()
                    .join(",");
                a.client
                    .get(format!("{}/v1/votes/summary?target_ids={ids}", a.address))
                    .bearer_auth(token("mallory"))
            },
        },
        Case {
            name: "summary with a bad id",
            status: 400,
            code: "invalid_target_ids",
            request: |a| {
                a.client
                    .get(format!(
                        "{}/v1/votes/summary?target_ids=ok,bad%20id",
                        a.address
                    ))
                    .bearer_auth(token("mallory"))
            },
        },
        Case {
            name: "summary with invalid UTF-8",
            status: 400,
            code: "invalid_target_ids",
            request: |a| {
                a.client
                    .get(format!("{}/v1/votes/summary?target_ids=%ff%fe", a.address))
                    .bearer_auth(token("mallory"))
            },
        },
        Case {
            name: "unknown path",
            status: 404,
            code: "not_found",
            request: |a| a.client.get(format!("{}/v1/nothing", a.address)),
        },
        Case {
            name: "wrong method",
            status: 405,
            code: "method_not_allowed",
            request: |a| {
                a.client
                    .delete(format!("{}/v1/votes", a.address))
                    .bearer_auth(token("mallory"))
            },
        },
    ];

    for case in &cases {
        let reply = app.send((case.request)(&app)).await;
        if case.status == 405 {
            assert_eq!(
                reply.headers.get("allow").map(|v| v.as_bytes()),
                Some(&b"POST"[..]),
                "405 names the allowed method"
            );
        }
        assert_eq!(reply.status, case.status, "{}: {reply:?}", case.name);
        assert_eq!(reply.code(), case.code, "{}: {}", case.name, reply.body);
        assert!(
            reply
                .headers
                .get("content-type")
                .is_some_and(|v| v.as_bytes().starts_with(b"application/json")),
            "{}: errors are JSON",
            case.name
        );
    }
    assert_eq!(
        env.rows_of("mallory").await,
        0,
        "no rejected request wrote a row"
    );
    assert_eq!(env.published(), 0, "no rejected request published");
    Ok(())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn signed(claims: serde_json::Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &Header::default(),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn unsigned(claims: serde_json::Value) -> String {
    use std::fmt::Write;
    fn b64(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for c in bytes.chunks(3) {
            let n = (u32::from(c[0]) << 16)
                | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
                | u32::from(*c.get(2).unwrap_or(&0));
            for i in 0..=c.len() {
                let _ = out.write_char(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }
    format!(
        "{}.{}.",
        b64(br#"{"alg":"none","typ":"JWT"}"#),
        b64(claims.to_string().as_bytes())
    )
}

#[tokio::test]
async fn forged_expired_and_unsigned_tokens_cannot_vote_or_read() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let later = now() + 3600;
    let forged = [
        (
            "wrong secret",
            signed(json!({"sub": "victim", "exp": later}), "not-the-secret"),
        ),
        (
            "expired",
            signed(json!({"sub": "victim", "exp": now() - 3600}), JWT_SECRET),
        ),
        (
            "not yet valid",
            signed(
                json!({"sub": "victim", "exp": later, "nbf": later - 60}),
                JWT_SECRET,
            ),
        ),
        ("alg none", unsigned(json!({"sub": "victim", "exp": later}))),
        ("no sub", signed(json!({"exp": later}), JWT_SECRET)),
        ("no exp", signed(json!({"sub": "victim"}), JWT_SECRET)),
        (
            "empty sub",
            signed(json!({"sub": "", "exp": later}), JWT_SECRET),
        ),
        ("garbage", "not.a.token".to_owned()),
    ];
    for (name, bad) in &forged {
        let vote = app
            .send(
                app.client
                    .post(format!("{}/v1/votes", app.address))
                    .bearer_auth(bad)
                    .header("Idempotency-Key", new_key())
                    .header("Content-Type", "application/json")
                    .body(VALID),
            )
            .await;
        assert_eq!(vote.status, 401, "{name}: {vote:?}");
        let challenge = vote
            .headers
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap_or(""))
            .unwrap_or("");
        assert!(
            challenge.starts_with("Bearer"),
            "{name}: WWW-Authenticate is {challenge:?}"
        );
        let read = app
            .send(
                app.client
                    .get(format!(
                        "{}/v1/votes/summary?target_ids=video_1",
                        app.address
                    ))
                    .bearer_auth(bad),
            )
            .await;
        assert_eq!(read.status, 401, "{name}: {read:?}");
    }
    assert_eq!(env.rows_of("victim").await, 0);
    assert_eq!(env.published(), 0);
    Ok(())
}

#[tokio::test]
async fn a_user_id_in_the_body_is_ignored_and_no_token_reads_another_users_state() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let body =
        r#"{"target_id":"video_9","target_type":"video","action":"like","user_id":"victim"}"#;

    let reply = app
        .send(
            app.client
                .post(format!("{}/v1/votes", app.address))
                .bearer_auth(token("attacker"))
                .header("Idempotency-Key", new_key())
                .header("Content-Type", "application/json")
                .body(body),
        )
        .await;

    assert_eq!(reply.status, 200);
    assert_eq!(
        env.reaction("attacker", "video_9").await,
        Some(("like".into(), 1))
    );
    assert_eq!(
        env.rows_of("victim").await,
        0,
        "the body cannot name the voter"
    );
    let victims_view = app.summary("victim", "video_9").await.json();
    assert_eq!(
        victims_view["items"]["video_9"]["user_state"], "none",
        "the attacker's like is not the victim's state"
    );
    assert_eq!(victims_view["items"]["video_9"]["likes"], 1);
    Ok(())
}

#[tokio::test]
async fn openapi_document_is_valid_3_1_and_lists_every_status() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    let reply = app
        .send(app.client.get(format!("{}/openapi.json", app.address)))
        .await;
    assert_eq!(reply.status, 200);
    let doc = reply.json();
    assert_eq!(doc["openapi"], "3.1.0");
    for status in [
        "200", "400", "401", "405", "408", "409", "413", "415", "422", "429", "503",
    ] {
        assert!(
            doc["paths"]["/v1/votes"]["post"]["responses"][status].is_object(),
            "POST /v1/votes lacks {status}"
        );
    }
    for status in ["200", "400", "401", "405", "429", "503"] {
        assert!(
            doc["paths"]["/v1/votes/summary"]["get"]["responses"][status].is_object(),
            "summary lacks {status}"
        );
    }

    // A real validator: openapi-spec-validator, installed by scripts/test.sh.
    let path = std::env::temp_dir().join(format!("tally-openapi-{}.json", env.id));
    std::fs::write(&path, &reply.body)?;
    let out = std::process::Command::new("python3")
        .args(["-m", "openapi_spec_validator", "--schema", "3.1"])
        .arg(&path)
        .output()
        .context("python3")?;
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "openapi-spec-validator rejected the document:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test]
async fn a_user_voting_too_fast_gets_429_with_retry_after_and_those_votes_change_nothing()
-> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await; // 20 votes/s per user, bursts of 60

    let targets: Vec<String> = (0..100).map(|i| format!("video_{i}")).collect();
    let replies = futures::future::join_all(
        targets
            .iter()
            .map(|t| app.vote("flood", new_key(), t, "like")),
    )
    .await;

    let ok = replies.iter().filter(|r| r.status == 200).count();
    let limited: Vec<_> = replies.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok + limited.len(), 100, "only 200s and 429s");
    assert!(limited.len() >= 30, "{} limited", limited.len());
    for r in &limited {
        assert_eq!(r.code(), "rate_limited");
        let wait: u64 = r
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(wait >= 1, "Retry-After: {wait}");
    }
    assert_eq!(
        env.rows_of("flood").await,
        2 * ok as i64,
        "a reaction and a key per accepted vote, nothing for refused ones"
    );
    assert_eq!(env.published(), ok as i64);
    let other = app.vote("calm", new_key(), "video_0", "like").await;
    assert_eq!(other.status, 200, "the limit is per user");
    Ok(())
}

/// Above the admission limit a vote is refused with 503, `overloaded` and
/// Retry-After before any of its work, and changes nothing; the admitted
/// ones count.
#[tokio::test]
async fn votes_above_the_admission_limit_get_503_with_retry_after_and_change_nothing() -> TestResult
{
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        max_in_flight: 2,
        min_in_flight: 2,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let users: Vec<String> = (0..40).map(|i| format!("crowd{i}")).collect();
    let replies = futures::future::join_all(
        users
            .iter()
            .map(|u| app.vote(u, new_key(), "video_crowded", "like")),
    )
    .await;
    let (mut admitted, mut refused) = (Vec::new(), Vec::new());
    for (user, reply) in users.iter().zip(&replies) {
        match reply.status {
            200 => admitted.push(user),
            503 => {
                assert_eq!(
                    reply.json()["error"]["code"],
                    "overloaded",
                    "{}",
                    reply.body
                );
                assert!(
                    reply.headers.contains_key("retry-after"),
                    "{:?}",
                    reply.headers
                );
                refused.push(user);
            }
            other => anyhow::bail!("{user}: {other} {}", reply.body),
        }
    }
    assert!(
        !admitted.is_empty() && !refused.is_empty(),
        "{} admitted, {} refused",
        admitted.len(),
        refused.len()
    );

    // What users see: the admitted likes, and no state for the refused.
    let served = app.summary("crowd0", "video_crowded").await.json();
    assert_eq!(
        served["items"]["video_crowded"]["likes"],
        admitted.len(),
        "{served}"
    );
    for user in refused {
        let mine = app.summary(user, "video_crowded").await.json();
        assert_eq!(
            mine["items"]["video_crowded"]["user_state"], "none",
            "{user}: {mine}"
        );
    }
    Ok(())
}

/// Clients that vote again the moment they are refused (a closed loop that
/// ignores Retry-After) are refused at a rate paced to the votes admitted,
/// not as fast as the server can answer: the same storm with pacing off
/// (`--admission-refusal-ratio 0`) draws many times more refusals.
#[tokio::test]
async fn a_storm_that_ignores_retry_after_is_refused_at_a_pace_set_by_the_admitted_votes()
-> TestResult {
    let env = TestEnv::new().await;
    let storm = |ratio: f64| tally::api::ApiConfig {
        max_in_flight: 2,
        min_in_flight: 2,
        admission_refusal_ratio: ratio,
        user_rate: 1_000_000.0,
        user_burst: 1_000_000,
        ..env.api_config()
    };
    const CLIENTS: usize = 24;
    const RATIO: f64 = 2.0;
    let secs = 3.0;
    let paced = closed_loop_storm(&env.spawn_app_with(storm(RATIO)).await, CLIENTS, secs).await?;
    let unpaced = closed_loop_storm(&env.spawn_app_with(storm(0.0)).await, CLIENTS, secs).await?;

    // Paced: the allowed rate is the ratio times the average of the last
    // five seconds' completions, or of 50 a second if that is more. Over
    // the storm and the second after it (the longest a refusal waits), that
    // allows at most ratio x (admitted + 50 a second), plus the burst (a
    // second at the highest rate: a fifth of the admitted, or 50), plus one
    // a client for those in flight.
    let bound = RATIO * (paced.admitted as f64 + 50.0 * (secs + 1.0))
        + RATIO * (paced.admitted as f64 / 5.0 + 50.0)
        + CLIENTS as f64;
    eprintln!(
        "storm of {CLIENTS} for {secs}s: paced {paced:?}, unpaced {unpaced:?}, bound {bound:.0}"
    );
    assert!(paced.admitted > 0, "{paced:?}");
    assert!(
        (paced.refused as f64) <= bound,
        "paced: {paced:?}, at most {bound:.0} refusals"
    );
    assert!(
        unpaced.refused as f64 > 3.0 * bound,
        "unpaced: {unpaced:?}, against a paced bound of {bound:.0}: the storm did not storm"
    );
    Ok(())
}

#[derive(Debug, Default)]
struct Storm {
    admitted: u64,
    refused: u64,
}

/// `clients` closed loops of likes, each on a target of its own, for `secs`.
async fn closed_loop_storm(app: &TestApp, clients: usize, secs: f64) -> anyhow::Result<Storm> {
    let until = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    let loops = (0..clients).map(|c| async move {
        let mut seen = Storm::default();
        let mut n = 0u64;
        while tokio::time::Instant::now() < until {
            n += 1;
            let reply = app
                .vote(
                    &format!("storm{c}"),
                    new_key(),
                    &format!("video_storm_{c}_{n}"),
                    "like",
                )
                .await;
            match reply.status {
                200 => seen.admitted += 1,
                503 => seen.refused += 1,
                other => anyhow::bail!("storm{c}: {other} {}", reply.body),
            }
        }
        Ok(seen)
    });
    let mut total = Storm::default();
    for seen in futures::future::try_join_all(loops).await? {
        total.admitted += seen.admitted;
        total.refused += seen.refused;
    }
    Ok(total)
}

#[tokio::test]
async fn bodies_trickled_a_byte_at_a_time_hold_no_place_and_time_out_with_408() -> TestResult {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        max_in_flight: 2,
        min_in_flight: 2,
        body_timeout: Duration::from_secs(2),
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let addr = app.address.trim_start_matches("http://").to_owned();

    // 50 clients send their headers, then a byte of an 80-byte body every
    // 300 ms: without a deadline they would take 24 s each.
    let mut trickling = Vec::new();
    let (started, mut sending) = tokio::sync::mpsc::channel::<()>(50);
    for i in 0..50 {
        let (addr, token) = (addr.clone(), token(&format!("loris{i}")));
        let started = started.clone();
        trickling.push(tokio::spawn(async move {
            let mut conn = tokio::net::TcpStream::connect(&addr).await?;
            let head = format!(
                "POST /v1/votes HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
                 Idempotency-Key: {}\r\nContent-Type: application/json\r\n\
                 Content-Length: 80\r\n\r\n",
                new_key()
            );
            conn.write_all(head.as_bytes()).await?;
            conn.write_all(b" ").await?;
            let _ = started.send(()).await;
            let (mut rx, mut tx) = conn.into_split();
            let writer = tokio::spawn(async move {
                for _ in 1..80 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if tx.write_all(b" ").await.is_err() {
                        break;
                    }
                }
            });
            let mut answer = vec![0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(15), rx.read(&mut answer))
                .await
                .map_err(|_| anyhow::anyhow!("no answer in 15 s"))??;
            writer.abort();
            anyhow::Ok(String::from_utf8_lossy(&answer[..n]).into_owned())
        }));
    }
    // Every one of them has sent its headers and the first byte of its body.
    drop(started);
    for n in 0..50 {
        tokio::time::timeout(Duration::from_secs(10), sending.recv())
            .await
            .map_err(|_| anyhow::anyhow!("{n} of 50 clients started in 10 s"))?;
    }

    // Meanwhile another user's votes go through, one after another.
    for (i, action) in ["like", "dislike", "none", "like", "dislike"]
        .iter()
        .enumerate()
    {
        let reply = app.vote("bystander", new_key(), "video_open", action).await;
        assert_eq!(reply.status, 200, "vote {i}: {}", reply.body);
    }

    for t in trickling {
        let answer = t.await??;
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("body_timeout"),
            "{answer}"
        );
    }
    let served = app.summary("bystander", "video_open").await.json();
    assert_eq!(served["items"]["video_open"]["dislikes"], 1, "{served}");
    assert_eq!(served["items"]["video_open"]["user_state"], "dislike");
    Ok(())
}

/// The router decodes percent escapes, so `/v1/vote%73` is the vote
/// endpoint. The body deadline and admission looked at the path as sent,
/// and such a request went past both: its body was read with no deadline,
/// and it took no place under the admission limit.
#[tokio::test]
async fn a_vote_path_spelled_with_percent_escapes_meets_the_same_body_deadline() -> TestResult {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        body_timeout: Duration::from_secs(2),
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let addr = app.address.trim_start_matches("http://").to_owned();

    // The same endpoint: a well-formed vote spelled this way is taken.
    let reply = app
        .send(
            app.client
                .post(format!("{}/v1/vote%73", app.address))
                .bearer_auth(token("escaped"))
                .header("Idempotency-Key", new_key())
                .json(&serde_json::json!({
                    "target_id": "video_escaped", "target_type": "video", "action": "like"
                })),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);

    // Headers, one byte of an 80-byte body, then nothing.
    let mut conn = tokio::net::TcpStream::connect(&addr).await?;
    let head = format!(
        "POST /v1/vote%73 HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 80\r\n\r\n ",
        token("stalling"),
        new_key()
    );
    conn.write_all(head.as_bytes()).await?;
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(15), conn.read(&mut answer))
        .await
        .map_err(|_| anyhow::anyhow!("no answer in 15 s: no deadline on the body"))??;
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("body_timeout"),
        "{answer}"
    );
    Ok(())
}

#[tokio::test]
async fn a_retry_of_a_committed_vote_gets_its_answer_while_its_user_is_rate_limited() -> TestResult
{
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_rate: 0.01,
        user_burst: 1,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let key = new_key();
    let first = app.vote("hasty", &key, "video_once", "like").await;
    assert_eq!(first.status, 200, "{}", first.body);

    // Over the limit now: a new vote is refused...
    let new = app.vote("hasty", new_key(), "video_once", "dislike").await;
    assert_eq!(new.status, 429, "{}", new.body);
    // ...but the retry of the one that committed gets its answer,
    let retry = app.vote("hasty", &key, "video_once", "like").await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.body, first.body);
    assert!(retry.replayed(), "{:?}", retry.headers);
    // ...and the same key with another body is not a retry of it: it is
    // told so at once, not sent to wait out a limit and be told then.
    let other = app.vote("hasty", &key, "video_once", "dislike").await;
    assert_eq!(other.status, 422, "{}", other.body);
    assert_eq!(other.code(), "idempotency_key_reused", "{}", other.body);
    // A new key is still held to the limit.
    let fresh = app.vote("hasty", new_key(), "video_once", "dislike").await;
    assert_eq!(fresh.status, 429, "{}", fresh.body);

    let served = app.summary("hasty", "video_once").await.json();
    assert_eq!(served["items"]["video_once"]["likes"], 1, "{served}");
    assert_eq!(served["items"]["video_once"]["user_state"], "like");
    Ok(())
}

#[tokio::test]
async fn a_flood_of_reads_from_one_user_gets_429_and_other_users_still_read() -> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_read_rate: 1.0,
        user_read_burst: 5,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let ids = (0..21)
        .map(|i| format!("video_{i}"))
        .collect::<Vec<_>>()
        .join(",");
    let readers: Vec<String> = (0..3).map(|i| format!("reader{i}")).collect();
    let (flood, others) = futures::future::join(
        futures::future::join_all((0..40).map(|_| app.summary("greedy", &ids))),
        futures::future::join_all(readers.iter().map(|u| app.summary(u, &ids))),
    )
    .await;
    let served = flood.iter().filter(|r| r.status == 200).count();
    assert!((1..=6).contains(&served), "{served} of 40 served");
    for r in flood.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 429, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "rate_limited", "{}", r.body);
        assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    }
    for r in &others {
        assert_eq!(r.status, 200, "another user's read: {}", r.body);
    }
    Ok(())
}

#[tokio::test]
async fn votes_on_target_types_or_ids_the_service_does_not_take_are_refused_and_write_nothing()
-> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        targets: tally::api::targets::TargetRules {
            types: vec![tally::domain::TargetType::Video],
            patterns: vec!["video=v_[0-9]{3}".into()],
        },
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let send = |target: &str, kind: &str| {
        app.send(
            app.client
                .post(format!("{}/v1/votes", app.address))
                .bearer_auth(token("picky"))
                .header("Idempotency-Key", new_key())
                .json(&serde_json::json!({"target_id": target, "target_type": kind, "action": "like"})),
        )
    };
    for (target, kind) in [
        ("v_123x", "video"),
        ("xv_123", "video"),
        ("v_123", "comment"),
    ] {
        let r = send(target, kind).await;
        assert_eq!(r.status, 400, "{target} {kind}: {}", r.body);
        assert_eq!(r.code(), "target_not_allowed");
    }
    assert_eq!(send("v_123", "video").await.status, 200);

    let reactions = env.recount().await;
    assert_eq!(reactions.keys().collect::<Vec<_>>(), ["v_123"]);
    let rows = env
        .session
        .query_unpaged("SELECT target_id FROM targets", ())
        .await?
        .into_rows_result()?;
    let registered: Vec<String> = rows
        .rows::<(String,)>()?
        .map(|r| r.map(|(t,)| t))
        .collect::<Result<_, _>>()?;
    assert_eq!(registered, ["v_123"], "nothing else reached the registry");
    Ok(())
}

#[tokio::test]
async fn one_user_cannot_register_new_targets_faster_than_the_limit_and_known_ones_stay_open()
-> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_new_targets_rate: 0.001,
        user_new_targets_burst: 3,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(
            app.vote("sprawler", new_key(), &format!("video_new{i}"), "like")
                .await,
        );
    }
    let ok: Vec<u16> = statuses.iter().map(|r| r.status).collect();
    assert_eq!(ok, [200, 200, 200, 429, 429]);
    assert_eq!(statuses[3].code(), "new_targets_limited");
    assert!(statuses[3].headers.contains_key("retry-after"));
    // A target already registered costs the registry nothing: still open.
    assert_eq!(
        app.vote("sprawler", new_key(), "video_new0", "dislike")
            .await
            .status,
        200
    );
    // Another user's new target is not limited by this one's.
    assert_eq!(
        app.vote("calm", new_key(), "video_new9", "like")
            .await
            .status,
        200
    );
    let reactions = env.recount().await;
    assert!(!reactions.contains_key("video_new3") && !reactions.contains_key("video_new4"));
    Ok(())
}

#[tokio::test]
async fn only_votes_that_leave_a_record_use_up_the_days_limit() -> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_daily_votes: 2,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let first = new_key();
    assert_eq!(
        app.vote("day", &first, "video_e0", "like").await.status,
        200
    );
    // A client retrying as told: a replay, then the key reused for another
    // body. Neither wrote a record.
    let replay = app.vote("day", &first, "video_e0", "like").await;
    assert!(replay.status == 200 && replay.replayed(), "{}", replay.body);
    let reused = app.vote("day", &first, "video_e0", "dislike").await;
    assert_eq!(reused.status, 422, "{}", reused.body);
    assert_eq!(reused.code(), "idempotency_key_reused");
    // The second vote of the day is still the user's to cast...
    let second = app.vote("day", new_key(), "video_e1", "like").await;
    assert_eq!(second.status, 200, "{}", second.body);
    // ...and the third is over the limit.
    let third = app.vote("day", new_key(), "video_e2", "like").await;
    assert_eq!(third.status, 429, "{}", third.body);
    assert_eq!(third.code(), "daily_limit");
    let reactions = env.recount().await;
    assert_eq!(reactions["video_e1"].likes(), 1);
    assert!(!reactions.contains_key("video_e2"));
    Ok(())
}

/// A vote given back to the day's count after the count was lost (evicted,
/// or a failover) leaves nothing: a bare DECR made it -1 with no TTL, for
/// good, and past -1 the count no longer parsed, so the limit went unchecked.
#[tokio::test]
async fn a_vote_given_back_to_a_lost_days_count_leaves_nothing() -> TestResult {
    let env = TestEnv::new().await;
    let cache = tally::cache::Cache::new(&env.redis, Duration::from_secs(60))?;
    let user = tally::domain::UserId::parse("given_back")?;
    let mut redis = redis::Client::open(env.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let pattern = format!("{}:daily:given_back:*", env.redis.prefix);
    let (count, _, counted) = cache.count_vote_today(&user).await?;
    assert_eq!(count, 1);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut redis)
        .await?;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: () = redis::cmd("DEL")
        .arg(&keys[0])
        .query_async(&mut redis)
        .await?;
    cache.uncount_vote(counted).await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut redis)
        .await?;
    assert!(left.is_empty(), "{left:?}");
    // A count still there is given back as before.
    let (_, _, counted) = cache.count_vote_today(&user).await?;
    let (count, _, _) = cache.count_vote_today(&user).await?;
    assert_eq!(count, 2);
    cache.uncount_vote(counted).await;
    let (count, _, _) = cache.count_vote_today(&user).await?;
    assert_eq!(count, 2, "one given back, one more counted");
    Ok(())
}

#[tokio::test]
async fn a_user_past_the_days_vote_limit_gets_429_until_midnight_and_retries_still_get_answers()
-> TestResult {
    let env = TestEnv::new().await;
    let config = tally::api::ApiConfig {
        user_daily_votes: 3,
        ..env.api_config()
    };
    let app = env.spawn_app_with(config).await;
    let first = new_key();
    assert_eq!(
        app.vote("daily", &first, "video_d0", "like").await.status,
        200
    );
    assert_eq!(
        app.vote("daily", new_key(), "video_d1", "like")
            .await
            .status,
        200
    );
    assert_eq!(
        app.vote("daily", new_key(), "video_d2", "like")
            .await
            .status,
        200
    );
    let over = app.vote("daily", new_key(), "video_d3", "like").await;
    assert_eq!(over.status, 429, "{}", over.body);
    assert_eq!(over.code(), "daily_limit");
    let wait: u64 = over
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_default();
    assert!((1..=86_400).contains(&wait), "Retry-After {wait}");
    // A retry of a vote that committed still gets its answer.
    let retry = app.vote("daily", &first, "video_d0", "like").await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert!(retry.replayed());
    // Other users are not counted against this one.
    assert_eq!(
        app.vote("other", new_key(), "video_d3", "like")
            .await
            .status,
        200
    );
    let reactions = env.recount().await;
    assert_eq!(
        reactions["video_d3"].likes(),
        1,
        "only the other user's like"
    );
    Ok(())
}
