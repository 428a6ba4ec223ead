//! A linearizability checker for single registers: one (user, target)
//! reaction, written by votes and read by summaries.
//!
//! A vote is a blind write of its action (the API takes the final state,
//! never a toggle); a summary's `user_state` is a read. Each operation has
//! the time it was invoked and the time its answer arrived. A write whose
//! answer never came (a timeout, a reset, a 503 `outcome_unknown`) may have
//! happened at any time after its invocation, or never: it is optional and
//! open-ended. The search is Wing and Gong's, with the memo of Lowe's
//! refinement (the one Porcupine uses): linearize, one at a time, an
//! operation that no pending operation's answer precedes, and remember every
//! (set linearized, register value) already explored.

use std::collections::HashSet;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Write(String),
    Read(String),
}

/// One operation on one register, in microseconds of one clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub kind: Kind,
    pub invoked: u64,
    /// None: the outcome stayed unknown (writes only; an unanswered read
    /// says nothing and is left out).
    pub answered: Option<u64>,
}

/// Checks one register's history, starting from `initial`. On failure,
/// says how far the longest linearization got.
pub fn check(ops: &[Op], initial: &str) -> Result<(), String> {
    let n = ops.len();
    let required: Vec<usize> = (0..n).filter(|i| ops[*i].answered.is_some()).collect();
    let mut search = Search {
        ops,
        seen: HashSet::new(),
        done: vec![false; n],
        best: 0,
        budget: 2_000_000,
    };
    match search.dfs(initial.to_owned(), &required, 0) {
        Some(true) => Ok(()),
        Some(false) => Err(format!(
            "not linearizable: at most {} of {} answered operations could be ordered; history {ops:?}",
            search.best,
            required.len()
        )),
        None => Err(format!(
            "search budget exhausted after {} of {} operations",
            search.best,
            required.len()
        )),
    }
}

struct Search<'a> {
    ops: &'a [Op],
    seen: HashSet<(Vec<bool>, String)>,
    done: Vec<bool>,
    best: usize,
    budget: u64,
}

impl Search<'_> {
    /// Some(true) when the answered operations not yet done can all be
    /// linearized from `value`; None when the budget ran out.
    fn dfs(&mut self, value: String, required: &[usize], placed: usize) -> Option<bool> {
        self.best = self.best.max(placed);
        if required.iter().all(|i| self.done[*i]) {
            return Some(true);
        }
        if self.budget == 0 {
            return None;
        }
        self.budget -= 1;
        if !self.seen.insert((self.done.clone(), value.clone())) {
            return Some(false);
        }
        // Nothing can be linearized after an answer it was invoked after.
        let horizon = (0..self.ops.len())
            .filter(|i| !self.done[*i])
            .filter_map(|i| self.ops[i].answered)
            .min()
            .unwrap_or(u64::MAX);
        for i in 0..self.ops.len() {
            if self.done[i] || self.ops[i].invoked > horizon {
                continue;
            }
            let next = match &self.ops[i].kind {
                Kind::Write(v) => v.clone(),
                Kind::Read(v) if *v == value => value.clone(),
                Kind::Read(_) => continue,
            };
            self.done[i] = true;
            let answered = self.ops[i].answered.is_some();
            let found = self.dfs(next, required, placed + usize::from(answered));
            self.done[i] = false;
            match found {
                Some(false) => {}
                other => return other,
            }
        }
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(v: &str, invoked: u64, answered: Option<u64>) -> Op {
        Op {
            kind: Kind::Write(v.into()),
            invoked,
            answered,
        }
    }

    fn r(v: &str, invoked: u64, answered: u64) -> Op {
        Op {
            kind: Kind::Read(v.into()),
            invoked,
            answered: Some(answered),
        }
    }

    #[test]
    fn a_read_after_a_write_sees_it() {
        assert!(check(&[w("like", 0, Some(10)), r("like", 20, 30)], "none").is_ok());
        assert!(check(&[w("like", 0, Some(10)), r("none", 20, 30)], "none").is_err());
    }

    #[test]
    fn a_read_concurrent_with_a_write_may_see_either() {
        for seen in ["none", "like"] {
            assert!(check(&[w("like", 0, Some(10)), r(seen, 5, 15)], "none").is_ok());
        }
    }

    #[test]
    fn reads_cannot_go_back_in_time() {
        // Two writes in sequence; a read sees the second, a later read the
        // first again: a stale read, which no order explains.
        let history = [
            w("like", 0, Some(10)),
            w("dislike", 20, Some(30)),
            r("dislike", 40, 50),
            r("like", 60, 70),
        ];
        assert!(check(&history, "none").is_err());
    }

    #[test]
    fn concurrent_writes_are_ordered_one_way_for_every_reader() {
        // Two clicks at once; readers afterwards disagree forever.
        let history = [
            w("like", 0, Some(10)),
            w("dislike", 0, Some(10)),
            r("like", 20, 30),
            r("dislike", 40, 50),
            r("like", 60, 70),
        ];
        assert!(check(&history, "none").is_err());
        let agreed = [
            w("like", 0, Some(10)),
            w("dislike", 0, Some(10)),
            r("like", 20, 30),
            r("like", 40, 50),
        ];
        assert!(check(&agreed, "none").is_ok());
    }

    #[test]
    fn an_unknown_write_may_land_late_or_never() {
        // Its answer never came: a read long after may or may not see it.
        for seen in ["none", "like"] {
            assert!(check(&[w("like", 0, None), r(seen, 1_000, 1_010)], "none").is_ok());
        }
        // But once seen, it stays: it cannot be undone by nothing.
        let flicker = [w("like", 0, None), r("like", 100, 110), r("none", 200, 210)];
        assert!(check(&flicker, "none").is_err());
    }

    #[test]
    fn an_acknowledged_write_is_never_lost() {
        let lost = [
            w("like", 0, Some(10)),
            w("dislike", 5, None),
            r("like", 20, 30),
            r("none", 40, 50),
        ];
        assert!(check(&lost, "none").is_err());
    }
}
