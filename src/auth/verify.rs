//! Verifying bearer tokens with one pinned algorithm and key.

use anyhow::Context;
use jsonwebtoken::{DecodingKey, Validation};

use super::{AuthConfig, AuthError, Caller, Claims, JwtAlgorithm};
use crate::domain::UserId;

/// Verifies tokens with one pinned algorithm and key.
pub struct Verifier {
    key: DecodingKey,
    validation: Validation,
}

impl Verifier {
    pub fn from_config(config: &AuthConfig) -> anyhow::Result<Verifier> {
        let key = match config.algorithm {
            JwtAlgorithm::Hs256 => DecodingKey::from_secret(config.hs256_secret()?),
            alg => {
                let path = config
                    .public_key
                    .as_ref()
                    .context("RS256/ES256 need --jwt-public-key")?;
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
        Ok(Verifier { key, validation })
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
        let data = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation)
            .map_err(|e| AuthError::Invalid(e.to_string()))?;
        let user =
            UserId::parse(&data.claims.sub).map_err(|e| AuthError::Invalid(format!("sub: {e}")))?;
        Ok(Caller {
            user,
            admin: data.claims.roles.iter().any(|r| r == "admin"),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jsonwebtoken::{Algorithm, EncodingKey, Header};

    use super::*;
    use crate::auth::mint;

    const SECRET: &str = "unit-test-secret";

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

    #[test]
    fn a_token_signed_with_another_secret_is_refused() {
        let token = mint(
            &AuthConfig::hs256("another-secret"),
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
            ..AuthConfig::hs256("unused-secret")
        };
        let verifier = Verifier::from_config(&config).unwrap_or_else(|e| panic!("{e:#}"));
        let _ = std::fs::remove_file(&path);
        let claims = serde_json::json!({"sub": "alice", "exp": 99_999_999_999u64});
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
