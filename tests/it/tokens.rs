//! Tokens from an identity provider: RS256 keys from a JWKS that a real
//! HTTP server on 127.0.0.1 serves, rotated by `kid` while tally runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use openssl::rsa::Rsa;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{TestEnv, TestResult, eventually, new_key};

const ISSUER: &str = "https://idp.example.test";
const AUDIENCE: &str = "tally";

/// An RSA key pair: its private PEM, and its public half as a JWK.
struct KeyPair {
    private_pem: Vec<u8>,
    jwk: serde_json::Value,
}

impl KeyPair {
    fn new(kid: &str) -> KeyPair {
        let rsa = Rsa::generate(2048).unwrap_or_else(|e| panic!("{e}"));
        let b64url = |bytes: Vec<u8>| {
            openssl::base64::encode_block(&bytes)
                .replace('+', "-")
                .replace('/', "_")
                .trim_end_matches('=')
                .to_owned()
        };
        let jwk = serde_json::json!({
            "kty": "RSA", "use": "sig", "alg": "RS256", "kid": kid,
            "n": b64url(rsa.n().to_vec()), "e": b64url(rsa.e().to_vec()),
        });
        KeyPair {
            private_pem: rsa.private_key_to_pem().unwrap_or_else(|e| panic!("{e}")),
            jwk,
        }
    }

    /// A token for `sub` signed with this key, naming it `kid`.
    fn token(&self, kid: &str, sub: &str) -> String {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.to_owned());
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            + 600;
        let claims = serde_json::json!({"sub": sub, "exp": exp, "iss": ISSUER, "aud": AUDIENCE});
        let key = EncodingKey::from_rsa_pem(&self.private_pem).unwrap_or_else(|e| panic!("{e}"));
        jsonwebtoken::encode(&header, &claims, &key).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A JWKS over plain HTTP/1.1 on 127.0.0.1: whatever set `keys` holds when
/// asked, and how many times it was asked.
struct JwksServer {
    url: String,
    keys: Arc<Mutex<Vec<serde_json::Value>>>,
    served: Arc<AtomicUsize>,
}

impl JwksServer {
    async fn start(keys: Vec<serde_json::Value>) -> JwksServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let url = format!(
            "http://{}/.well-known/jwks.json",
            listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
        );
        let keys = Arc::new(Mutex::new(keys));
        let served = Arc::new(AtomicUsize::new(0));
        let (k, s) = (keys.clone(), served.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let body =
                    serde_json::json!({ "keys": *k.lock().unwrap_or_else(|e| e.into_inner()) })
                        .to_string();
                s.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(response.as_bytes()).await;
                });
            }
        });
        JwksServer { url, keys, served }
    }

    fn publish(&self, keys: Vec<serde_json::Value>) {
        *self.keys.lock().unwrap_or_else(|e| e.into_inner()) = keys;
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn keys_rotate_by_kid_through_a_jwks_served_over_http_and_unknown_keys_are_refused()
-> TestResult {
    let env = TestEnv::new().await;
    let (a, b) = (KeyPair::new("key-a"), KeyPair::new("key-b"));
    let idp = JwksServer::start(vec![a.jwk.clone()]).await;

    let mut config = env.api_config();
    config.auth.algorithm = tally::auth::JwtAlgorithm::Rs256;
    config.auth.secret = None;
    config.auth.jwks = Some(idp.url.clone());
    config.auth.jwks_refresh = Duration::from_secs(2);
    config.auth.issuer = Some(ISSUER.into());
    config.auth.audience = Some(AUDIENCE.into());
    let app = env.spawn_app_with(config).await;
    let status = |token: String| {
        let app = &app;
        async move {
            app.send(
                app.client
                    .post(format!("{}/v1/votes", app.address))
                    .bearer_auth(token)
                    .header("Idempotency-Key", new_key())
                    .json(&serde_json::json!({"target_id": "video_jwks", "target_type": "video", "action": "like"})),
            )
            .await
            .status
        }
    };

    // Key A is published: its tokens are taken.
    assert_eq!(status(a.token("key-a", "ann")).await, 200);
    // Attacks: a key the set does not hold, B's signature under A's id, no kid.
    assert_eq!(status(b.token("key-b", "eve")).await, 401);
    assert_eq!(status(b.token("key-a", "eve")).await, 401);
    let no_kid = {
        let key = EncodingKey::from_rsa_pem(&a.private_pem)?;
        let claims = serde_json::json!({"sub": "eve", "exp": 9_999_999_999u64, "iss": ISSUER, "aud": AUDIENCE});
        jsonwebtoken::encode(&Header::new(Algorithm::RS256), &claims, &key)?
    };
    assert_eq!(status(no_kid).await, 401);

    // The provider adds key B: a token naming it makes tally read the set
    // again, and is taken soon after.
    idp.publish(vec![a.jwk.clone(), b.jwk.clone()]);
    eventually(
        "a token of the new key B to be taken",
        Duration::from_secs(10),
        || async { (status(b.token("key-b", "bob")).await == 200).then_some(()) },
    )
    .await;
    // The provider retires key A: its tokens stop working at the next read.
    idp.publish(vec![b.jwk.clone()]);
    eventually(
        "tokens of the retired key A to be refused",
        Duration::from_secs(15),
        || async { (status(a.token("key-a", "ann")).await == 401).then_some(()) },
    )
    .await;
    for _ in 0..3 {
        assert_eq!(status(a.token("key-a", "ann")).await, 401);
        assert_eq!(status(b.token("key-b", "bob")).await, 200);
    }

    // A flood of made-up key ids costs the provider a read a second at most.
    let (before, start) = (idp.served(), std::time::Instant::now());
    for i in 0..100 {
        assert_eq!(status(b.token(&format!("made-up-{i}"), "eve")).await, 401);
    }
    let reads = idp.served() - before;
    let allowed = start.elapsed().as_secs() as usize + 2;
    assert!(
        reads <= allowed,
        "{reads} reads of the JWKS in {:?}",
        start.elapsed()
    );

    // What was accepted is what is counted: ann's and bob's likes only.
    let summary = app
        .send(
            app.client
                .get(format!(
                    "{}/v1/votes/summary?target_ids=video_jwks",
                    app.address
                ))
                .bearer_auth(b.token("key-b", "bob")),
        )
        .await;
    assert_eq!(summary.status, 200);
    assert_eq!(summary.json()["items"]["video_jwks"]["likes"], 2);
    Ok(())
}

#[tokio::test]
async fn tally_vote_does_not_start_without_its_jwks() -> TestResult {
    let env = TestEnv::new().await;
    let mut config = env.api_config();
    config.auth.algorithm = tally::auth::JwtAlgorithm::Rs256;
    config.auth.secret = None;
    // Nothing listens on the port of a listener just dropped.
    let port = crate::support::free_port();
    config.auth.jwks = Some(format!("http://127.0.0.1:{port}/jwks.json"));
    config.auth.issuer = Some(ISSUER.into());
    config.auth.audience = Some(AUDIENCE.into());
    let err = match tally::api::Application::build(config).await {
        Ok(_) => panic!("tally vote started without its JWKS"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("JWKS"), "{err}");
    Ok(())
}
