//! Which targets may get reactions. Every target a vote names is written to
//! the registry the reconcile sweep walks, so an API that took any id that
//! passes the charset check would let one client grow the registry without
//! bound. Operators can allow only some target types and, per type, only ids
//! that match a pattern (their own id format); votes on anything else are
//! 400 `target_not_allowed`, before anything is written.

use std::collections::HashMap;

use anyhow::Context;

use crate::domain::{TargetId, TargetType};

/// Settings of the policy, as flags of `tally vote`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TargetRules {
    /// Target types that may get reactions, comma separated (default: every
    /// type tally knows).
    #[arg(long = "target-types", env = "TALLY_TARGET_TYPES", value_delimiter = ',', value_parser = parse_type)]
    pub types: Vec<TargetType>,

    /// `TYPE=REGEX`: ids of that type must match the whole pattern, e.g.
    /// `video=[0-9A-Za-z_-]{11}`. Repeat the flag, or separate with `;` in
    /// the variable.
    #[arg(long = "target-id-pattern", env = "TALLY_TARGET_ID_PATTERNS", value_delimiter = ';')]
    pub patterns: Vec<String>,
}

fn parse_type(s: &str) -> Result<TargetType, String> {
    TargetType::parse(s).ok_or_else(|| format!("unknown target type {s:?}"))
}

/// The rules, compiled once at start.
pub struct TargetPolicy {
    /// Empty: every type.
    types: Vec<TargetType>,
    patterns: HashMap<TargetType, regex::Regex>,
}

impl TargetPolicy {
    pub fn new(rules: &TargetRules) -> anyhow::Result<TargetPolicy> {
        let mut patterns = HashMap::new();
        for rule in &rules.patterns {
            let (kind, pattern) = rule
                .split_once('=')
                .with_context(|| format!("--target-id-pattern {rule:?}: write TYPE=REGEX"))?;
            let kind = parse_type(kind.trim())
                .map_err(|e| anyhow::anyhow!("--target-id-pattern {rule:?}: {e}"))?;
            // Anchored: the whole id must match, not a part of it.
            let anchored = format!("^(?:{pattern})$");
            let regex = regex::Regex::new(&anchored)
                .with_context(|| format!("--target-id-pattern {rule:?} is not a regex"))?;
            anyhow::ensure!(
                patterns.insert(kind, regex).is_none(),
                "--target-id-pattern names {} twice",
                kind.as_str()
            );
        }
        Ok(TargetPolicy {
            types: rules.types.clone(),
            patterns,
        })
    }

    /// Why a vote on this target is refused, if it is.
    pub fn refuses(&self, id: &TargetId, kind: TargetType) -> Option<String> {
        if !self.types.is_empty() && !self.types.contains(&kind) {
            return Some(format!(
                "target_type {} does not take reactions here",
                kind.as_str()
            ));
        }
        match self.patterns.get(&kind) {
            Some(pattern) if !pattern.is_match(id.as_str()) => Some(format!(
                "target_id is not a {} id of this service",
                kind.as_str()
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> TargetId {
        TargetId::parse(s).unwrap_or_else(|e| panic!("{e}"))
    }

    fn policy(types: &[TargetType], patterns: &[&str]) -> anyhow::Result<TargetPolicy> {
        TargetPolicy::new(&TargetRules {
            types: types.to_vec(),
            patterns: patterns.iter().map(|p| (*p).to_owned()).collect(),
        })
    }

    #[test]
    fn without_rules_every_target_is_taken() -> anyhow::Result<()> {
        let open = policy(&[], &[])?;
        assert!(open.refuses(&id("anything"), TargetType::Comment).is_none());
        Ok(())
    }

    #[test]
    fn types_and_whole_id_patterns_are_enforced() -> anyhow::Result<()> {
        let p = policy(&[TargetType::Video], &["video=v_[0-9]{3}"])?;
        assert!(p.refuses(&id("v_123"), TargetType::Video).is_none());
        assert!(
            p.refuses(&id("v_1234"), TargetType::Video).is_some(),
            "anchored at the end"
        );
        assert!(
            p.refuses(&id("xv_123"), TargetType::Video).is_some(),
            "anchored at the start"
        );
        assert!(
            p.refuses(&id("v_123"), TargetType::Comment).is_some(),
            "type not allowed"
        );
        Ok(())
    }

    #[test]
    fn bad_rules_stop_the_start() {
        assert!(policy(&[], &["video"]).is_err());
        assert!(policy(&[], &["movie=x"]).is_err());
        assert!(policy(&[], &["video=("]).is_err());
        assert!(policy(&[], &["video=a", "video=b"]).is_err());
    }
}
