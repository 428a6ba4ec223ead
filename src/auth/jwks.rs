//! Public keys from an identity provider's JWKS (RFC 7517), at a URL or in
//! a file: read at start (tally does not start without them), read again
//! every `--jwt-jwks-refresh`, and sooner when a token names a key id this
//! process has not seen, which is how a provider's rotation shows. Keys are
//! looked up by `kid`; only keys for the pinned algorithm are kept.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use jsonwebtoken::DecodingKey;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, PublicKeyUse};
use tokio::sync::Notify;

use super::JwtAlgorithm;

/// The shortest time between two reads of the set: a flood of tokens with
/// made-up key ids costs the provider one request a second at most.
const MIN_GAP: Duration = Duration::from_secs(1);

/// Longest one read of a JWKS URL may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Jwks {
    source: Source,
    algorithm: JwtAlgorithm,
    keys: RwLock<HashMap<String, DecodingKey>>,
    /// How many times the keys changed: a token verified with keys of an
    /// earlier set is verified again (its key may be gone).
    generation: AtomicU64,
    /// The keys as text (see `usable`), to tell a changed set from the same
    /// one read again.
    fingerprint: RwLock<String>,
    /// Woken by a token with an unknown key id.
    unknown: Notify,
}

enum Source {
    Url(reqwest::Client, String),
    File(PathBuf),
}

impl Jwks {
    /// Reads the set at `spec` (an `http(s)://` URL or a file) once; fails
    /// when it cannot be read or holds no key for `algorithm`.
    pub async fn load(spec: &str, algorithm: JwtAlgorithm) -> anyhow::Result<Arc<Jwks>> {
        let source = if spec.starts_with("https://") || spec.starts_with("http://") {
            if spec.starts_with("http://") {
                tracing::warn!(
                    jwks = spec,
                    "the JWKS is fetched without TLS: keys can be forged in transit; use https:// outside a test"
                );
            }
            let client = reqwest::Client::builder()
                .timeout(FETCH_TIMEOUT)
                .build()
                .context("Failed to build the JWKS client")?;
            Source::Url(client, spec.to_owned())
        } else {
            Source::File(spec.into())
        };
        let jwks = Jwks {
            source,
            algorithm,
            keys: RwLock::default(),
            generation: AtomicU64::new(0),
            fingerprint: RwLock::default(),
            unknown: Notify::new(),
        };
        let (keys, fingerprint) = jwks.read().await?;
        anyhow::ensure!(
            !keys.is_empty(),
            "the JWKS at {spec} holds no {algorithm:?} key with a key id"
        );
        jwks.replace(keys, fingerprint);
        Ok(Arc::new(jwks))
    }

    /// The key named `kid`, if the set held it at its last read. An unknown
    /// id wakes the refresher.
    pub fn key(&self, kid: &str) -> Option<DecodingKey> {
        let key = self.keys.read().ok()?.get(kid).cloned();
        if key.is_none() {
            self.unknown.notify_one();
        }
        key
    }

    /// Reads the set again every `every`, and on an unknown key id (at most
    /// once per `MIN_GAP`), for as long as the runtime runs. A failed read
    /// keeps the keys of the last good one.
    pub fn keep_fresh(self: &Arc<Self>, every: Duration) {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = this.unknown.notified() => {}
                }
                match this.read().await {
                    Ok((keys, fingerprint)) if !keys.is_empty() => this.replace(keys, fingerprint),
                    Ok(_) => {
                        tracing::warn!("the JWKS holds no usable key now; keeping the last ones")
                    }
                    Err(e) => tracing::warn!(
                        error = format!("{e:#}"),
                        "could not read the JWKS; keeping the last keys"
                    ),
                }
                tokio::time::sleep(MIN_GAP).await;
            }
        });
    }

    fn replace(&self, keys: HashMap<String, DecodingKey>, fingerprint: String) {
        if let Ok(mut current) = self.keys.write() {
            let mut ids: Vec<&String> = keys.keys().collect();
            ids.sort();
            tracing::debug!(kids = ?ids, "JWKS keys");
            *current = keys;
            // The same set read again keeps the tokens verified with it: a
            // flood of made-up key ids rereads the set every second.
            if let Ok(mut last) = self.fingerprint.write() {
                if *last != fingerprint {
                    *last = fingerprint;
                    self.generation.fetch_add(1, Ordering::Release);
                }
            }
        }
    }

    /// Which read of the set the keys are from (see `generation`).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    async fn read(&self) -> anyhow::Result<(HashMap<String, DecodingKey>, String)> {
        let set: JwkSet = match &self.source {
            Source::Url(client, url) => client
                .get(url)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .with_context(|| format!("Failed to fetch the JWKS at {url}"))?
                .json()
                .await
                .with_context(|| format!("The JWKS at {url} is not a JWK set"))?,
            Source::File(path) => {
                // A few KB, read rarely: a blocking read is fine here.
                let text = std::fs::read(path)
                    .with_context(|| format!("Failed to read the JWKS {}", path.display()))?;
                serde_json::from_slice(&text)
                    .with_context(|| format!("{} is not a JWK set", path.display()))?
            }
        };
        Ok(usable(&set, self.algorithm))
    }
}

/// The keys of a set that can verify `algorithm`, by key id: signing keys
/// of the matching type, with an id. And those keys as text, in key id
/// order: the same text, the same keys.
fn usable(set: &JwkSet, algorithm: JwtAlgorithm) -> (HashMap<String, DecodingKey>, String) {
    let mut kept: Vec<(&String, &Jwk, DecodingKey)> = set
        .keys
        .iter()
        .filter(|jwk| fits(jwk, algorithm))
        .filter_map(|jwk| {
            let kid = jwk.common.key_id.as_ref()?;
            DecodingKey::from_jwk(jwk).ok().map(|key| (kid, jwk, key))
        })
        .collect();
    kept.sort_by(|a, b| a.0.cmp(b.0));
    let fingerprint = kept
        .iter()
        .map(|(_, jwk, _)| serde_json::to_string(jwk).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let keys = kept
        .into_iter()
        .map(|(kid, _, key)| (kid.clone(), key))
        .collect();
    (keys, fingerprint)
}

fn fits(jwk: &Jwk, algorithm: JwtAlgorithm) -> bool {
    if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
        return false;
    }
    if let Some(alg) = jwk.common.key_algorithm {
        if format!("{alg:?}") != format!("{:?}", algorithm.algorithm()) {
            return false;
        }
    }
    match (&jwk.algorithm, algorithm) {
        (AlgorithmParameters::RSA(_), JwtAlgorithm::Rs256) => true,
        (AlgorithmParameters::EllipticCurve(ec), JwtAlgorithm::Es256) => {
            ec.curve == EllipticCurve::P256
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(json: serde_json::Value) -> JwkSet {
        serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"))
    }

    const N: &str = "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw";

    #[test]
    fn the_same_keys_in_another_order_read_alike_and_a_changed_key_does_not() {
        let key =
            |kid: &str, n: &str| serde_json::json!({"kty": "RSA", "kid": kid, "n": n, "e": "AQAB"});
        let other_n = format!("{}A", &N[..N.len() - 1]);
        let print = |keys: Vec<serde_json::Value>| {
            usable(
                &set(serde_json::json!({ "keys": keys })),
                JwtAlgorithm::Rs256,
            )
            .1
        };
        let ab = print(vec![key("a", N), key("b", N)]);
        assert_eq!(ab, print(vec![key("b", N), key("a", N)]));
        assert_ne!(ab, print(vec![key("a", N), key("b", &other_n)]));
        assert_ne!(ab, print(vec![key("a", N)]));
    }

    #[test]
    fn only_signing_keys_of_the_pinned_algorithm_with_an_id_are_kept() {
        let jwks = set(serde_json::json!({"keys": [
            {"kty": "RSA", "kid": "a", "use": "sig", "alg": "RS256", "n": N, "e": "AQAB"},
            {"kty": "RSA", "kid": "no-alg", "n": N, "e": "AQAB"},
            {"kty": "RSA", "n": N, "e": "AQAB"},
            {"kty": "RSA", "kid": "enc", "use": "enc", "n": N, "e": "AQAB"},
            {"kty": "RSA", "kid": "ps", "alg": "PS256", "n": N, "e": "AQAB"},
            {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"}
        ]}));
        let mut kept: Vec<String> = usable(&jwks, JwtAlgorithm::Rs256).0.into_keys().collect();
        kept.sort();
        assert_eq!(kept, ["a", "no-alg"]);
        assert!(usable(&jwks, JwtAlgorithm::Es256).0.is_empty());
        assert!(usable(&jwks, JwtAlgorithm::Hs256).0.is_empty());
    }
}
