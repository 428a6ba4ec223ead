//! `GET /v1/votes/summary?target_ids=a,b,c`: counts and the caller's own
//! state for up to 100 targets in one call.

use std::collections::BTreeMap;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::ser::{Serialize, SerializeMap, Serializer};

use super::error::ApiError;
use super::{AppState, Worker};
use crate::auth::Caller;
use crate::domain::{Reaction, TargetId, Totals};

pub const MAX_IDS: usize = 100;

/// `{"likes": 3, "dislikes": 1, "user_state": "like"}`: written by hand, as
/// serde's `flatten` of the totals buffers what it writes.
struct Item {
    totals: Totals,
    user_state: Reaction,
}

impl Serialize for Item {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        self.totals.serialize_entries(&mut map)?;
        map.serialize_entry("user_state", &self.user_state)?;
        map.end()
    }
}

#[derive(serde::Serialize)]
struct Summary<'a> {
    items: BTreeMap<&'a str, Item>,
}

pub async fn summary(
    caller: Caller,
    req: HttpRequest,
    state: web::Data<AppState>,
    worker: web::Data<Worker>,
) -> Result<HttpResponse, ApiError> {
    let targets = parse_target_ids(req.query_string())?;
    state
        .readers
        .check(&caller.user)
        .map_err(ApiError::ReadsLimited)?;
    super::at_work(&req);
    let clients = worker.clients().await?;

    let (totals, states) = futures::try_join!(
        async {
            clients
                .counts
                .get_many(&targets)
                .await
                .map_err(|e| ApiError::Unavailable(e.into()))
        },
        async {
            clients
                .store
                .reactions
                .states(&caller.user, &targets)
                .await
                .map_err(|e| ApiError::Unavailable(e.into()))
        },
    )?;
    // A page is read before its buttons are pressed: a vote after it then
    // costs one Paxos round, not a refused one first.
    clients.caster.saw(&caller.user, &states);
    let items = targets
        .iter()
        .zip(totals)
        .map(|(t, totals)| {
            let user_state = states.get(t).map_or(Reaction::None, |c| c.state);
            (t.as_str(), Item { totals, user_state })
        })
        .collect();
    Ok(HttpResponse::Ok().json(Summary { items }))
}

/// `target_ids` once, comma separated, 1..=100 distinct valid ids after
/// collapsing duplicates.
pub fn parse_target_ids(query: &str) -> Result<Vec<TargetId>, ApiError> {
    let bad = |m: String| ApiError::bad_request("invalid_target_ids", m);
    // Borrowed where nothing is escaped, as ids never are.
    let mut lists = form_urlencoded::parse(query.as_bytes())
        .filter(|(k, _)| k == "target_ids")
        .map(|(_, v)| v);
    let list = lists
        .next()
        .ok_or_else(|| bad("target_ids is required".into()))?;
    if lists.next().is_some() {
        return Err(bad("give target_ids once, comma separated".into()));
    }
    // Counted before any is parsed: a list of one id repeated tens of
    // thousands of times, up to the request line's limit, cost a worker
    // milliseconds of parsing for one read, or for none at all once a
    // 101st distinct id at its end refused it before the read limiter.
    if list.split(',').nth(MAX_ENTRIES).is_some() {
        return Err(bad(format!(
            "at most {MAX_ENTRIES} target_ids, repeats included"
        )));
    }
    let mut ids: Vec<TargetId> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for raw in list.split(',') {
        let id = TargetId::parse(raw).map_err(|e| bad(format!("{raw:?}: {e}")))?;
        if seen.insert(id.clone()) {
            ids.push(id);
        }
        if ids.len() > MAX_IDS {
            return Err(bad(format!("at most {MAX_IDS} distinct target_ids")));
        }
    }
    Ok(ids)
}

/// Most entries a list may hold, repeats included: a page repeats few.
pub const MAX_ENTRIES: usize = 4 * MAX_IDS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_ids_are_parsed_collapsed_and_bounded() {
        let ids = parse_target_ids("target_ids=a,b,a").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ids.iter().map(TargetId::as_str).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let hundred = (0..100)
            .map(|i| format!("v{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            parse_target_ids(&format!("target_ids={hundred}"))
                .map(|v| v.len())
                .ok(),
            Some(100)
        );
        let repeated = vec!["a"; MAX_ENTRIES].join(",");
        assert_eq!(
            parse_target_ids(&format!("target_ids={repeated}"))
                .map(|v| v.len())
                .ok(),
            Some(1)
        );
        let too_many = (0..101)
            .map(|i| format!("v{i}"))
            .collect::<Vec<_>>()
            .join(",");
        for bad in [
            "",
            "target_ids=",
            "target_ids=a,,b",
            "target_ids=a%20b",
            "target_ids=a&target_ids=b",
            "x=1",
            &format!("target_ids={too_many}"),
            &format!("target_ids={}", vec!["a"; MAX_ENTRIES + 1].join(",")),
        ] {
            assert!(parse_target_ids(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
