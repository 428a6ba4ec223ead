//! Identifiers parsed once at the edge. A value of these types is valid
//! everywhere it travels: no other code re-checks it.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{what} must be 1 to {max} characters long")]
    Length { what: &'static str, max: usize },
    #[error("{what} may contain only {allowed}")]
    Charset {
        what: &'static str,
        allowed: &'static str,
    },
}

/// A video or comment id: 1..=128 of `[A-Za-z0-9_.:-]`. The charset keeps ids
/// safe as Redis keys, Kafka keys and CQL clustering values, and leaves `#`
/// free to mark idempotency rows in `reactions` (see `store::reactions`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct TargetId(String);

impl TargetId {
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<TargetId, IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError::Length {
                what: "target_id",
                max: Self::MAX_LEN,
            });
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
        {
            return Err(IdError::Charset {
                what: "target_id",
                allowed: "letters, digits, '_', '.', ':' and '-'",
            });
        }
        Ok(TargetId(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for TargetId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        TargetId::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The voter, taken from a verified token's `sub`: 1..=128 characters with
/// no control characters. Never read from a request body.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct UserId(String);

impl UserId {
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<UserId, IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError::Length {
                what: "user id",
                max: Self::MAX_LEN,
            });
        }
        if s.chars().any(char::is_control) {
            return Err(IdError::Charset {
                what: "user id",
                allowed: "printable characters",
            });
        }
        Ok(UserId(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for UserId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        UserId::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetType {
    Video,
    Comment,
}

impl TargetType {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetType::Video => "video",
            TargetType::Comment => "comment",
        }
    }

    pub fn parse(s: &str) -> Option<TargetType> {
        match s {
            "video" => Some(TargetType::Video),
            "comment" => Some(TargetType::Comment),
            _ => None,
        }
    }
}

/// The client's name for one user action, reused on every retry of it:
/// 1..=255 visible ASCII characters (a UUID is recommended).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub const MAX_LEN: usize = 255;

    pub fn parse(s: &str) -> Result<IdempotencyKey, IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError::Length {
                what: "Idempotency-Key",
                max: Self::MAX_LEN,
            });
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(IdError::Charset {
                what: "Idempotency-Key",
                allowed: "visible ASCII characters",
            });
        }
        Ok(IdempotencyKey(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn target_ids_accept_the_documented_charset_only() {
        assert!(TargetId::parse("video_abc123").is_ok());
        assert!(TargetId::parse("comment:xyz.1-2").is_ok());
        assert!(TargetId::parse(&"a".repeat(128)).is_ok());
        for bad in ["", "has space", "#idem", "ümlaut", "a/b", &"a".repeat(129)] {
            assert!(TargetId::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn idempotency_keys_are_visible_ascii() {
        assert!(IdempotencyKey::parse("3f2c-uuid-like").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in ["", "with space", "tab\t", "é", &"k".repeat(256)] {
            assert!(
                IdempotencyKey::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn user_ids_reject_control_characters() {
        assert!(UserId::parse("alice").is_ok());
        assert!(UserId::parse("a\nb").is_err());
        assert!(UserId::parse("").is_err());
    }

    proptest! {
        #[test]
        fn a_parsed_target_id_never_starts_with_the_idempotency_marker(s in "\\PC{0,140}") {
            if let Ok(id) = TargetId::parse(&s) {
                prop_assert!(!id.as_str().starts_with('#'));
                prop_assert!(id.as_str().len() <= TargetId::MAX_LEN);
            }
        }
    }
}
