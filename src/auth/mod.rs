//! Bearer tokens: who is voting. The user is the verified token's `sub`,
//! never a field of the request. `verify` checks tokens; `mint` makes them
//! for development (`tally token`). Both read keys through `read_pem`.

mod jwks;
mod mint;
mod verify;

pub use mint::{TokenArgs, mint};
pub use verify::Verifier;

pub use crate::secret::Secret;

use std::path::PathBuf;

use anyhow::Context;
use jsonwebtoken::Algorithm;
use serde::{Deserialize, Serialize};

use crate::domain::UserId;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtAlgorithm {
    #[value(name = "HS256")]
    Hs256,
    #[value(name = "RS256")]
    Rs256,
    #[value(name = "ES256")]
    Es256,
}

impl JwtAlgorithm {
    fn algorithm(self) -> Algorithm {
        match self {
            JwtAlgorithm::Hs256 => Algorithm::HS256,
            JwtAlgorithm::Rs256 => Algorithm::RS256,
            JwtAlgorithm::Es256 => Algorithm::ES256,
        }
    }
}

/// The shortest HS256 secret accepted: 256 bits, the size of the HMAC's
/// hash (RFC 7518, section 3.2).
pub const MIN_SECRET: usize = 32;

/// How tokens are checked (and, for `tally token`, made).
#[derive(clap::Args, Debug, Clone)]
pub struct AuthConfig {
    /// Token algorithm. Tokens signed any other way (including `alg: none`) are refused.
    #[arg(long = "jwt-algorithm", env = "TALLY_JWT_ALGORITHM", value_enum, default_value_t = JwtAlgorithm::Hs256)]
    pub algorithm: JwtAlgorithm,

    /// HS256 shared secret, at least 32 bytes. Never printed.
    #[arg(long = "jwt-secret", env = "TALLY_JWT_SECRET", hide_env_values = true)]
    pub secret: Option<Secret>,

    /// Accept an HS256 secret shorter than 32 bytes: for local development
    /// only (`scripts/dev.sh` sets it). A short secret can be brute-forced
    /// from one token.
    #[arg(long = "insecure-dev-secret", env = "TALLY_INSECURE_DEV_SECRET")]
    pub insecure_dev_secret: bool,

    /// PEM public key file that verifies RS256/ES256 tokens.
    #[arg(long = "jwt-public-key", env = "TALLY_JWT_PUBLIC_KEY")]
    pub public_key: Option<PathBuf>,

    /// The identity provider's JWK set that verifies RS256/ES256 tokens by
    /// their `kid`: an `https://` URL or a file, read at start and again
    /// every `--jwt-jwks-refresh`, and soon after a token names an unknown
    /// key id (a rotation).
    #[arg(
        long = "jwt-jwks",
        env = "TALLY_JWT_JWKS",
        value_name = "URL|FILE",
        conflicts_with = "public_key"
    )]
    pub jwks: Option<String>,

    #[arg(long = "jwt-jwks-refresh", env = "TALLY_JWT_JWKS_REFRESH", default_value = "5m", value_parser = crate::cli::values::duration_above_zero)]
    pub jwks_refresh: std::time::Duration,

    /// PEM private key file that `tally token` signs RS256/ES256 tokens with.
    #[arg(long = "jwt-private-key", env = "TALLY_JWT_PRIVATE_KEY")]
    pub private_key: Option<PathBuf>,

    /// Required `iss` claim. Required with RS256/ES256, whose tokens come
    /// from an identity provider that serves other audiences too.
    #[arg(long = "jwt-issuer", env = "TALLY_JWT_ISSUER")]
    pub issuer: Option<String>,

    /// Required `aud` claim (a token's `aud` may be a string or an array
    /// that contains it). Required with RS256/ES256.
    #[arg(long = "jwt-audience", env = "TALLY_JWT_AUDIENCE")]
    pub audience: Option<String>,
}

impl AuthConfig {
    pub fn hs256(secret: &str) -> AuthConfig {
        AuthConfig {
            algorithm: JwtAlgorithm::Hs256,
            secret: Some(Secret::new(secret)),
            insecure_dev_secret: false,
            public_key: None,
            jwks: None,
            jwks_refresh: std::time::Duration::from_secs(300),
            private_key: None,
            issuer: None,
            audience: None,
        }
    }

    /// The HS256 shared secret, which both verifying and signing need. One
    /// shorter than `MIN_SECRET` bytes is refused unless
    /// `--insecure-dev-secret` says this is a developer's machine.
    fn hs256_secret(&self) -> anyhow::Result<&[u8]> {
        let secret = self
            .secret
            .as_ref()
            .context("HS256 needs --jwt-secret (TALLY_JWT_SECRET)")?
            .expose()
            .as_bytes();
        if secret.len() < MIN_SECRET && !self.insecure_dev_secret {
            anyhow::bail!(
                "the HS256 secret (--jwt-secret, TALLY_JWT_SECRET) is {} bytes; it must be at \
                 least {MIN_SECRET} (for local development only: --insecure-dev-secret)",
                secret.len()
            );
        }
        Ok(secret)
    }
}

/// The claims tally reads. Others are allowed and ignored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<Audience>,
    /// Roles; `admin` may run the online reconcile.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
}

/// A token's `aud`: one audience, or several (RFC 7519, section 4.1.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Audience {
    One(String),
    Many(Vec<String>),
}

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub user: UserId,
    pub admin: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("missing bearer token")]
    Missing,
    #[error("the Authorization header must be `Bearer <token>`")]
    Malformed,
    #[error("invalid token: {0}")]
    Invalid(String),
}

/// Reads a PEM key file named by a flag.
fn read_pem(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("Failed to read {}", path.display()))
}
