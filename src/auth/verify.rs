//! Verifying bearer tokens with one pinned algorithm and key.

use anyhow::Context;
use jsonwebtoken::{DecodingKey, Validation};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::jwks::Jwks;
use super::{AuthConfig, AuthError, Caller, Claims, JwtAlgorithm};
use crate::domain::UserId;

/// Verifies tokens with one pinned algorithm and key, or the keys of a JWKS.
pub struct Verifier {
    keys: Keys,
    validation: Validation,
    verified: Verified,
}

enum Keys {
    One(DecodingKey),
    /// Each token names its key by `kid`.
    Set(Arc<Jwks>),
}

impl Verifier {
    /// The verifier of `config`; with a JWKS, after its first read.
    pub async fn build(config: &AuthConfig) -> anyhow::Result<Verifier> {
        let Some(spec) = &config.jwks else {
            return Verifier::from_config(config);
        };
        anyhow::ensure!(
            config.algorithm != JwtAlgorithm::Hs256,
            "--jwt-jwks holds public keys: use it with --jwt-algorithm RS256 or ES256"
        );
        let jwks = Jwks::load(spec, config.algorithm).await?;
        jwks.keep_fresh(config.jwks_refresh);
        Verifier::with_keys(config, Keys::Set(jwks))
    }

    /// The verifier of `config` with a secret or one public key (no JWKS).
    pub fn from_config(config: &AuthConfig) -> anyhow::Result<Verifier> {
        let key = match config.algorithm {
            JwtAlgorithm::Hs256 => DecodingKey::from_secret(config.hs256_secret()?),
            alg => {
                let path = config
                    .public_key
                    .as_ref()
                    .context("RS256/ES256 need --jwt-public-key or --jwt-jwks")?;
                let pem = super::read_pem(path)?;
                match alg {
                    JwtAlgorithm::Rs256 => DecodingKey::from_rsa_pem(&pem),
                    _ => DecodingKey::from_ec_pem(&pem),
                }
                .with_context(|| {
                    format!("{} is not a PEM public key for {alg:?}", path.display())
                })?
            }
        };
        Verifier::with_keys(config, Keys::One(key))
    }

    fn with_keys(config: &AuthConfig, keys: Keys) -> anyhow::Result<Verifier> {
        match (config.algorithm, &config.issuer, &config.audience) {
            (JwtAlgorithm::Hs256, None, _) | (JwtAlgorithm::Hs256, _, None) => {
                tracing::warn!(
                    "tokens are accepted without an `iss` or `aud` check: a token this secret \
                     signed for another service would be taken here; set --jwt-issuer and \
                     --jwt-audience"
                );
            }
            (alg, None, _) | (alg, _, None) => anyhow::bail!(
                "{alg:?} tokens come from an identity provider that signs for other services \
                 too: set --jwt-issuer and --jwt-audience (TALLY_JWT_ISSUER, TALLY_JWT_AUDIENCE)"
            ),
            _ => {}
        }
        if config.insecure_dev_secret {
            tracing::warn!(
                "--insecure-dev-secret: a short HS256 secret is accepted; never in production"
            );
        }
        // One algorithm only: this is what refuses `alg: none` and an HS256
        // token signed with an RS256 public key.
        let mut validation = Validation::new(config.algorithm.algorithm());
        validation.validate_nbf = true;
        let mut required = vec!["exp", "sub"];
        match &config.issuer {
            Some(iss) => {
                validation.set_issuer(&[iss]);
                required.push("iss");
            }
            None => validation.iss = None,
        }
        match &config.audience {
            Some(aud) => {
                validation.set_audience(&[aud]);
                required.push("aud");
            }
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        Ok(Verifier {
            keys,
            validation,
            verified: Verified::default(),
        })
    }

    /// Checks an `Authorization` header value.
    pub fn verify_header(&self, header: Option<&str>) -> Result<Caller, AuthError> {
        let header = header.ok_or(AuthError::Missing)?;
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::Malformed)?;
        self.verify(token)
    }

    pub fn verify(&self, token: &str) -> Result<Caller, AuthError> {
        // Read before the check: keys replaced during it make the entry stale.
        let keys = match &self.keys {
            Keys::One(_) => 0,
            Keys::Set(jwks) => jwks.generation(),
        };
        let now = (jsonwebtoken::get_current_timestamp(), Instant::now());
        if let Some(caller) = self.verified.get(token, keys, now) {
            return Ok(caller);
        }
        let (caller, exp) = self.verify_fully(token)?;
        self.verified.put(token, &caller, exp, keys, now.1);
        Ok(caller)
    }

    /// The signature, the claims and the caller they name; and the token's
    /// `exp`.
    fn verify_fully(&self, token: &str) -> Result<(Caller, u64), AuthError> {
        let from_set;
        let key = match &self.keys {
            Keys::One(key) => key,
            Keys::Set(jwks) => {
                let header = jsonwebtoken::decode_header(token)
                    .map_err(|e| AuthError::Invalid(e.to_string()))?;
                let kid = header
                    .kid
                    .ok_or_else(|| AuthError::Invalid("the token names no key (kid)".into()))?;
                from_set = jwks
                    .key(&kid)
                    .ok_or_else(|| AuthError::Invalid("the token's key (kid) is unknown".into()))?;
                &from_set
            }
        };
        let data = jsonwebtoken::decode::<Claims>(token, key, &self.validation)
            .map_err(|e| AuthError::Invalid(e.to_string()))?;
        let user =
            UserId::parse(&data.claims.sub).map_err(|e| AuthError::Invalid(format!("sub: {e}")))?;
        let caller = Caller {
            user,
            admin: data.claims.roles.iter().any(|r| r == "admin"),
        };
        Ok((caller, data.claims.exp))
    }
}

/// Tokens verified lately, by their exact text. A client sends one token
/// on every request until it renews it, and checking it was 7% of a page's
/// instructions (BENCHMARKS.md section 13). An entry answers only before its
/// token's `exp` (after it, the full check applies its leeway), for at most
/// `REMEMBER`, and with a JWKS only while the keys are those it was checked
/// with. A refusal is never remembered: it is checked in full every time.
#[derive(Default)]
struct Verified {
    entries: Mutex<HashMap<Box<str>, Remembered>>,
}

struct Remembered {
    caller: Caller,
    exp: u64,
    at: Instant,
    keys: u64,
}

/// How long a verified token is taken on trust.
const REMEMBER: Duration = Duration::from_secs(30);

/// At most this many tokens are remembered (about 5 MB of 300-byte tokens,
/// 35 MB of 2 KB ones); when full, all are forgotten at once.
const MAX_REMEMBERED: usize = 16_384;

impl Verified {
    /// The caller `token` names, if it was verified with keys `keys` less
    /// than `REMEMBER` before `now` (Unix seconds, and the same moment as an
    /// `Instant`) and has not expired by then.
    fn get(&self, token: &str, keys: u64, (unix, at): (u64, Instant)) -> Option<Caller> {
        let entries = self.entries.lock().ok()?;
        let e = entries.get(token)?;
        (e.keys == keys && unix < e.exp && at.saturating_duration_since(e.at) < REMEMBER)
            .then(|| e.caller.clone())
    }

    /// Remembers `token` as naming `caller` until `exp`, checked with keys
    /// `keys` at `at`.
    fn put(&self, token: &str, caller: &Caller, exp: u64, keys: u64, at: Instant) {
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if entries.len() >= MAX_REMEMBERED {
            entries.clear();
        }
        entries.insert(
            token.into(),
            Remembered {
                caller: caller.clone(),
                exp,
                at,
                keys,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jsonwebtoken::{Algorithm, EncodingKey, Header};

    use super::*;
    use crate::auth::mint;

    const SECRET: &str = "unit-test-secret-of-32-bytes-or-more";

    fn verifier() -> Verifier {
        Verifier::from_config(&AuthConfig::hs256(SECRET)).unwrap_or_else(|e| panic!("{e:#}"))
    }

    #[test]
    fn a_minted_token_names_its_user() {
        let token = mint(
            &AuthConfig::hs256(SECRET),
            "alice",
            Duration::from_secs(60),
            vec![],
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let caller = verifier()
            .verify_header(Some(&format!("Bearer {token}")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(caller.user.as_str(), "alice");
        assert!(!caller.admin);
    }

    fn caller(user: &str, admin: bool) -> Caller {
        Caller {
            user: UserId::parse(user).unwrap_or_else(|e| panic!("{e}")),
            admin,
        }
    }

    #[test]
    fn a_remembered_token_answers_only_itself_before_its_exp_for_a_while_with_its_keys() {
        let verified = Verified::default();
        let alice = caller("alice", false);
        let t0 = Instant::now();
        verified.put("token", &alice, 1_000, 7, t0);
        let get = |token: &str, keys, unix, at| {
            verified
                .get(token, keys, (unix, at))
                .map(|c| c.user.as_str().to_owned())
        };
        let just_before = t0 + REMEMBER - Duration::from_millis(1);
        assert_eq!(get("token", 7, 999, just_before).as_deref(), Some("alice"));
        assert_eq!(get("another token", 7, 900, t0), None);
        assert_eq!(get("token", 8, 900, t0), None, "the keys were read again");
        assert_eq!(get("token", 7, 1_000, t0), None, "expired");
        assert_eq!(
            get("token", 7, 900, t0 + REMEMBER),
            None,
            "remembered too long"
        );
    }

    #[test]
    fn remembered_tokens_are_bounded() {
        let verified = Verified::default();
        let bob = caller("bob", true);
        let now = (0, Instant::now());
        for i in 0..=MAX_REMEMBERED {
            verified.put(&format!("t{i}"), &bob, 10, 0, now.1);
        }
        let len = verified
            .entries
            .lock()
            .map(|e| e.len())
            .unwrap_or(usize::MAX);
        assert!(len <= MAX_REMEMBERED, "{len} remembered");
        let last = verified.get(&format!("t{MAX_REMEMBERED}"), 0, now);
        assert!(last.is_some_and(|c| c.admin));
    }

    #[test]
    fn a_token_is_verified_again_to_the_same_caller_and_a_refusal_stays_a_refusal() {
        let v = verifier();
        let token = |sub| {
            mint(
                &AuthConfig::hs256(SECRET),
                sub,
                Duration::from_secs(60),
                vec![],
            )
            .unwrap_or_else(|e| panic!("{e:#}"))
        };
        let (alice, bob) = (token("alice"), token("bob"));
        for _ in 0..2 {
            let users =
                [&alice, &bob].map(|t| v.verify(t).map(|c| c.user.as_str().to_owned()).ok());
            assert_eq!(users, [Some("alice".to_owned()), Some("bob".to_owned())]);
        }
        // One character of the signature changed.
        let mut forged = alice.clone().into_bytes();
        let i = forged.len() - 5;
        forged[i] = if forged[i] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..2 {
            assert!(matches!(v.verify(&forged), Err(AuthError::Invalid(_))));
        }
    }

    #[test]
    fn a_token_signed_with_another_secret_is_refused() {
        let token = mint(
            &AuthConfig::hs256("another-secret-of-32-bytes-or-more"),
            "alice",
            Duration::from_secs(60),
            vec![],
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        assert!(matches!(
            verifier().verify(&token),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn alg_none_is_refused() {
        use base64_like::encode;
        let header = encode(br#"{"alg":"none","typ":"JWT"}"#);
        let body = encode(br#"{"sub":"alice","exp":99999999999}"#);
        let token = format!("{header}.{body}.");
        assert!(matches!(
            verifier().verify(&token),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn headers_without_bearer_are_malformed() {
        assert!(matches!(
            verifier().verify_header(None),
            Err(AuthError::Missing)
        ));
        assert!(matches!(
            verifier().verify_header(Some("Basic abc")),
            Err(AuthError::Malformed)
        ));
        assert!(matches!(
            verifier().verify_header(Some("Bearer ")),
            Err(AuthError::Malformed)
        ));
    }

    #[test]
    fn an_hs256_token_signed_with_the_rs256_public_key_is_refused() {
        // The classic confusion attack: the server verifies RS256 with a
        // public key; the attacker HMACs a token with that public key.
        let pem = include_bytes!("test_rsa.pub.pem");
        let path = std::env::temp_dir().join(format!("tally-rs256-{}.pem", std::process::id()));
        std::fs::write(&path, pem).unwrap_or_else(|e| panic!("{e}"));
        let config = AuthConfig {
            algorithm: JwtAlgorithm::Rs256,
            secret: None,
            public_key: Some(path.clone()),
            issuer: Some("https://id.example".into()),
            audience: Some("tally".into()),
            ..AuthConfig::hs256(SECRET)
        };
        let verifier = Verifier::from_config(&config).unwrap_or_else(|e| panic!("{e:#}"));
        let _ = std::fs::remove_file(&path);
        let claims = serde_json::json!({"sub": "alice", "exp": 99_999_999_999u64,
            "iss": "https://id.example", "aud": "tally"});
        let forged = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(pem),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            verifier.verify(&forged),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn issuer_and_audience_are_required_when_configured() {
        let config = AuthConfig {
            issuer: Some("https://id.example".into()),
            audience: Some("tally".into()),
            ..AuthConfig::hs256(SECRET)
        };
        let verifier = Verifier::from_config(&config).unwrap_or_else(|e| panic!("{e:#}"));
        let sign = |claims: serde_json::Value| {
            jsonwebtoken::encode(
                &Header::default(),
                &claims,
                &EncodingKey::from_secret(SECRET.as_bytes()),
            )
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let exp = 99_999_999_999u64;
        let good = sign(
            serde_json::json!({"sub": "a", "exp": exp, "iss": "https://id.example", "aud": "tally"}),
        );
        assert!(verifier.verify(&good).is_ok());
        for bad in [
            serde_json::json!({"sub": "a", "exp": exp, "iss": "https://evil.example", "aud": "tally"}),
            serde_json::json!({"sub": "a", "exp": exp, "iss": "https://id.example", "aud": "other"}),
            serde_json::json!({"sub": "a", "exp": exp, "aud": "tally"}),
            serde_json::json!({"sub": "a", "exp": exp, "iss": "https://id.example"}),
        ] {
            assert!(
                matches!(
                    verifier.verify(&sign(bad.clone())),
                    Err(AuthError::Invalid(_))
                ),
                "{bad}"
            );
        }
    }

    fn signed(claims: &serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::default(),
            claims,
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn with_audience() -> Verifier {
        let config = AuthConfig {
            issuer: Some("https://id.example".into()),
            audience: Some("tally".into()),
            ..AuthConfig::hs256(SECRET)
        };
        Verifier::from_config(&config).unwrap_or_else(|e| panic!("{e:#}"))
    }

    #[test]
    fn an_audience_may_be_an_array_that_names_ours() {
        let exp = 99_999_999_999u64;
        let iss = "https://id.example";
        let ours = signed(&serde_json::json!({"sub": "a", "exp": exp, "iss": iss,
            "aud": ["billing", "tally"]}));
        assert_eq!(
            with_audience()
                .verify(&ours)
                .map(|c| c.user.as_str().to_owned())
                .ok(),
            Some("a".to_owned())
        );
        let theirs = signed(&serde_json::json!({"sub": "a", "exp": exp, "iss": iss,
            "aud": ["billing", "search"]}));
        assert!(matches!(
            with_audience().verify(&theirs),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn an_admin_of_another_audience_is_refused() {
        let foreign = signed(&serde_json::json!({"sub": "a", "exp": 99_999_999_999u64,
            "iss": "https://id.example", "aud": "billing", "roles": ["admin"]}));
        assert!(matches!(
            with_audience().verify(&foreign),
            Err(AuthError::Invalid(_))
        ));
    }

    #[test]
    fn a_short_hs256_secret_is_refused_at_start_unless_declared_for_development() {
        let short = AuthConfig::hs256("only-24-bytes-of-secret!");
        let refused = Verifier::from_config(&short)
            .err()
            .map(|e| format!("{e:#}"));
        assert!(
            refused
                .as_deref()
                .is_some_and(|e| e.contains("24 bytes") && e.contains("at least 32")),
            "{refused:?}"
        );
        let dev = AuthConfig {
            insecure_dev_secret: true,
            ..short
        };
        assert!(Verifier::from_config(&dev).is_ok());
        assert!(mint(&dev, "alice", Duration::from_secs(60), vec![]).is_ok());
    }

    #[test]
    fn public_key_tokens_need_an_issuer_and_an_audience() {
        let pem = include_bytes!("test_rsa.pub.pem");
        let path = std::env::temp_dir().join(format!("tally-rs256-iss-{}.pem", std::process::id()));
        std::fs::write(&path, pem).unwrap_or_else(|e| panic!("{e}"));
        let open = AuthConfig {
            algorithm: JwtAlgorithm::Rs256,
            secret: None,
            public_key: Some(path.clone()),
            ..AuthConfig::hs256(SECRET)
        };
        let refused = Verifier::from_config(&open).err().map(|e| format!("{e:#}"));
        let pinned = AuthConfig {
            issuer: Some("https://id.example".into()),
            audience: Some("tally".into()),
            ..open
        };
        let accepted = Verifier::from_config(&pinned).is_ok();
        let _ = std::fs::remove_file(&path);
        assert!(
            refused
                .as_deref()
                .is_some_and(|e| e.contains("--jwt-audience")),
            "{refused:?}"
        );
        assert!(accepted);
    }

    /// Unpadded URL-safe base64, enough to forge a header in a test.
    mod base64_like {
        pub fn encode(input: &[u8]) -> String {
            const ALPHABET: &[u8; 64] =
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let mut out = String::new();
            for chunk in input.chunks(3) {
                let b = [
                    chunk[0],
                    *chunk.get(1).unwrap_or(&0),
                    *chunk.get(2).unwrap_or(&0),
                ];
                let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
                for i in 0..=chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                }
            }
            out
        }
    }
}
