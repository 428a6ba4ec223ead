//! Signed transitions. With `--event-signing-key`, every transition the
//! vote API publishes (from a vote or from the relay) carries an
//! HMAC-SHA256 of its payload in the `tally-signature` header, and a
//! consumer given the same key counts an event whose signature verifies
//! without reading the user's row behind it.
//!
//! The read exists to refuse events the vote API did not make, and the API
//! publishes a transition only once its row has committed; a valid
//! signature proves the first, so it stands in for the read. It is an
//! optimisation and never a reason to refuse: an event unsigned, signed
//! with another key or altered after signing is checked against the rows as
//! it would be without a key. A key can therefore change at any time: while
//! the vote API and the consumer disagree, events cost a read each, nothing
//! more. Someone holding the key and write access to the topic can make
//! events the consumer counts, which is why the key is a secret.

use std::fmt;

use ring::hmac;

use crate::secret::Secret;

/// The header that carries a transition's signature, as lowercase hex.
pub const HEADER: &str = "tally-signature";

/// The shortest key accepted: 256 bits, the size of the HMAC's output.
pub const MIN_KEY: usize = 32;

/// An HMAC-SHA256 key shared by the vote API and the consumer. Never prints.
#[derive(Clone)]
pub struct EventKey(hmac::Key);

impl EventKey {
    /// The key a secret makes, refused when shorter than `MIN_KEY`. Checked
    /// here rather than when the flag is parsed: a parser's refusal prints
    /// the value it refused.
    pub fn new(secret: &Secret) -> Result<EventKey, String> {
        let bytes = secret.expose().as_bytes();
        if bytes.len() < MIN_KEY {
            return Err(format!(
                "the event signing key (--event-signing-key, TALLY_EVENT_SIGNING_KEY) is {} bytes; it must be at least {MIN_KEY} (e.g. `openssl rand -hex 32`)",
                bytes.len()
            ));
        }
        Ok(EventKey(hmac::Key::new(hmac::HMAC_SHA256, bytes)))
    }

    /// The signature of `payload`, as the header carries it.
    pub fn sign(&self, payload: &[u8]) -> String {
        hex::encode(hmac::sign(&self.0, payload).as_ref())
    }

    /// Whether `signature` (a header's value) is this key's signature of
    /// `payload`. The comparison takes the same time however much matches.
    pub fn verifies(&self, payload: &[u8], signature: &[u8]) -> bool {
        let Ok(tag) = hex::decode(signature) else {
            return false;
        };
        hmac::verify(&self.0, payload, &tag).is_ok()
    }
}

impl fmt::Debug for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EventKey(***)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> EventKey {
        EventKey::new(&Secret::new(s)).unwrap_or_else(|e| panic!("{e}"))
    }

    const PAYLOAD: &[u8] =
        br#"{"target_id":"video_1","user_id":"u1","from":"none","to":"like","version":1}"#;

    #[test]
    fn a_signature_verifies_with_its_key_only() {
        let a = key("a-key-of-thirty-two-bytes-at-least");
        let b = key("another-key-of-thirty-two-bytes-ok");
        let sig = a.sign(PAYLOAD);
        assert_eq!(sig.len(), 64, "hex of 32 bytes");
        assert!(a.verifies(PAYLOAD, sig.as_bytes()));
        assert!(!b.verifies(PAYLOAD, sig.as_bytes()));
    }

    #[test]
    fn an_altered_payload_or_signature_does_not_verify() {
        let a = key("a-key-of-thirty-two-bytes-at-least");
        let sig = a.sign(PAYLOAD);
        let mut altered = PAYLOAD.to_vec();
        altered[40] ^= 1;
        assert!(!a.verifies(&altered, sig.as_bytes()));
        let mut flipped = sig.clone().into_bytes();
        flipped[0] = if flipped[0] == b'0' { b'1' } else { b'0' };
        assert!(!a.verifies(PAYLOAD, &flipped));
        assert!(!a.verifies(PAYLOAD, &sig.as_bytes()[..62]));
        assert!(!a.verifies(PAYLOAD, b"not hex at all"));
        assert!(!a.verifies(PAYLOAD, b""));
    }

    #[test]
    fn a_short_key_is_refused_without_printing_it_and_a_key_never_prints() {
        let e = EventKey::new(&Secret::new("short-but-secret"))
            .err()
            .unwrap_or_default();
        assert!(e.contains("at least 32"), "{e}");
        assert!(!e.contains("short-but-secret"), "{e}");
        let a = key("a-key-of-thirty-two-bytes-at-least");
        assert_eq!(format!("{a:?}"), "EventKey(***)");
    }
}
