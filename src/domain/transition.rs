//! The event the vote API publishes for every committed change of state.

use serde::{Deserialize, Serialize};

use super::ids::{TargetId, TargetType, UserId};
use super::reaction::Reaction;

/// One committed change of one user's reaction to one target. `version` is
/// the row version the change created; the consumer applies each version of
/// a (target, user) at most once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    pub target_id: TargetId,
    pub target_type: TargetType,
    pub user_id: UserId,
    pub from: Reaction,
    pub to: Reaction,
    pub version: i64,
    /// RFC 3339, UTC, milliseconds.
    pub occurred_at: String,
}

#[derive(Debug, thiserror::Error)]
pub enum InvalidTransition {
    #[error("not a transition: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("version must be at least 1, got {0}")]
    Version(i64),
    #[error("from and to are both {0}: a transition must change the state")]
    NoChange(Reaction),
}

impl Transition {
    /// Parses and checks an event from the wire. Anything this rejects goes
    /// to the dead-letter topic with the error as its reason.
    pub fn from_json(bytes: &[u8]) -> Result<Transition, InvalidTransition> {
        let t: Transition = serde_json::from_slice(bytes)?;
        if t.version < 1 {
            return Err(InvalidTransition::Version(t.version));
        }
        if t.from == t.to {
            return Err(InvalidTransition::NoChange(t.to));
        }
        Ok(t)
    }

    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Transition {
        Transition {
            target_id: TargetId::parse("video_abc123").unwrap_or_else(|e| panic!("{e}")),
            target_type: TargetType::Video,
            user_id: UserId::parse("u_9931").unwrap_or_else(|e| panic!("{e}")),
            from: Reaction::None,
            to: Reaction::Like,
            version: 7,
            occurred_at: "2026-11-30T12:00:00.000Z".into(),
        }
    }

    #[test]
    fn a_transition_round_trips_through_json() {
        let t = sample();
        let back = Transition::from_json(&t.to_json().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, t);
    }

    #[test]
    fn the_wire_format_names_from_to_and_version() {
        let v: serde_json::Value =
            serde_json::from_slice(&sample().to_json().unwrap_or_else(|e| panic!("{e}")))
                .unwrap_or_default();
        assert_eq!(v["target_id"], "video_abc123");
        assert_eq!(v["from"], "none");
        assert_eq!(v["to"], "like");
        assert_eq!(v["version"], 7);
    }

    #[test]
    fn invalid_events_are_rejected_with_a_reason() {
        let cases: [(&str, &str); 5] = [
            ("not json", "not a transition"),
            (
                r#"{"target_id":"v","target_type":"video","user_id":"u","from":"none","to":"like","version":0,"occurred_at":"x"}"#,
                "version",
            ),
            (
                r#"{"target_id":"v","target_type":"video","user_id":"u","from":"like","to":"like","version":3,"occurred_at":"x"}"#,
                "must change",
            ),
            (
                r#"{"target_id":"bad id","target_type":"video","user_id":"u","from":"none","to":"like","version":1,"occurred_at":"x"}"#,
                "target_id",
            ),
            (
                r#"{"target_id":"v","target_type":"video","user_id":"u","from":"none","to":"meh","version":1,"occurred_at":"x"}"#,
                "unknown variant",
            ),
        ];
        for (input, reason) in cases {
            match Transition::from_json(input.as_bytes()) {
                Ok(t) => panic!("{input} parsed as {t:?}"),
                Err(e) => assert!(e.to_string().contains(reason), "{input}: {e}"),
            }
        }
    }
}
