//! Signing development tokens (`tally token`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use jsonwebtoken::{EncodingKey, Header};

use super::{AuthConfig, Claims, JwtAlgorithm};
use crate::domain::UserId;

/// Signs a token for development and tests (`tally token`).
pub fn mint(
    config: &AuthConfig,
    sub: &str,
    ttl: Duration,
    roles: Vec<String>,
) -> anyhow::Result<String> {
    UserId::parse(sub).map_err(|e| anyhow::anyhow!("--sub: {e}"))?;
    let key = match config.algorithm {
        JwtAlgorithm::Hs256 => EncodingKey::from_secret(config.hs256_secret()?),
        alg => {
            let Some(path) = config.private_key.as_ref() else {
                bail!("signing {alg:?} tokens needs --jwt-private-key");
            };
            let pem = super::read_pem(path)?;
            match alg {
                JwtAlgorithm::Rs256 => EncodingKey::from_rsa_pem(&pem),
                _ => EncodingKey::from_ec_pem(&pem),
            }
            .with_context(|| format!("{} is not a PEM private key for {alg:?}", path.display()))?
        }
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let claims = Claims {
        sub: sub.to_owned(),
        exp: (now + ttl).as_secs(),
        nbf: None,
        iss: config.issuer.clone(),
        aud: config.audience.clone().map(super::Audience::One),
        roles,
    };
    jsonwebtoken::encode(&Header::new(config.algorithm.algorithm()), &claims, &key)
        .context("Failed to sign the token")
}

/// `tally token`: prints a development token.
#[derive(clap::Args, Debug)]
pub struct TokenArgs {
    #[command(flatten)]
    pub auth: AuthConfig,

    /// The user the token names (its `sub`).
    #[arg(long)]
    pub sub: String,

    /// How long the token is valid, e.g. `1h`, `30m`, `7d`.
    #[arg(long, default_value = "1h", value_parser = crate::cli::values::duration_above_zero)]
    pub ttl: Duration,

    /// A role to grant, e.g. `admin` (repeatable).
    #[arg(long = "role")]
    pub roles: Vec<String>,
}
