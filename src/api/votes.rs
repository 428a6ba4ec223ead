//! `POST /v1/votes`: set the caller's reaction to one target.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderMap};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use futures::StreamExt;
use serde::Deserialize;
use tracing::Instrument;

use super::error::ApiError;
use super::{AppState, Clients, RequestId, Worker};
use crate::auth::Caller;
use crate::cache::CountedToday;
use crate::cast::{CastError, Vote};
use crate::domain::{IdempotencyKey, Reaction, TargetId, TargetType, UserId};

/// Largest accepted body. A vote is about 100 bytes.
pub const MAX_BODY: usize = 4096;

/// The body as sent; every field is parsed into its domain type below, so
/// each one gets its own error message. Unknown fields (a `user_id`, say) are
/// ignored: the user comes from the token.
#[derive(Deserialize)]
struct VoteBody {
    target_id: String,
    target_type: String,
    action: String,
}

pub async fn cast(
    caller: Caller,
    req: HttpRequest,
    state: web::Data<AppState>,
    worker: web::Data<Worker>,
    payload: web::Payload,
    request_id: web::ReqData<RequestId>,
) -> Result<HttpResponse, ApiError> {
    let key = idempotency_key(req.headers())?;
    let vote = parse_vote(req.headers(), payload).await?;
    if let Some(why) = state.targets.refuses(&vote.target_id, vote.target_type) {
        return Err(ApiError::bad_request("target_not_allowed", why));
    }
    let clients = worker.clients().await?;
    let counted = match over_a_limit(&state, &clients, &caller.user, &vote).await {
        Ok(counted) => counted,
        Err(refusal) => {
            // A retry of a vote that already committed still gets its answer,
            // and a key used for another request its 422: the limits are on
            // new votes, not on learning what happened to one. One read, and
            // only for a user who is over a limit.
            return match clients
                .caster
                .recorded(&caller.user, &key, &vote, &request_id.0)
                .await
            {
                Some(answer) => respond(answer?),
                None => Err(refusal),
            };
        }
    };
    // The vote runs in a task of its own: a client that hangs up (actix
    // then drops this handler) cannot stop it between a conditional write
    // whose outcome is unknown and the SERIAL read that learns it. The
    // task holds the admission permit until it ends, within its deadline.
    super::at_work(&req);
    let permit = req.extensions_mut().remove::<super::Admitted>();
    let task = clients.clone();
    let (user, request_id) = (caller.user, request_id.0.clone());
    let vote_task = async move {
        let _permit = permit;
        let answer = task.caster.cast(&user, &key, &vote, &request_id).await;
        if let Some(counted) = counted
            && !left_a_record(&answer)
        {
            task.cache.uncount_vote(counted).await;
        }
        answer.map_err(ApiError::from)
    };
    // The task keeps the request's span, so its log lines carry the request id.
    // Boxed once here: the vote's future is some 12 KB, which every move on
    // the way into tokio's task cell (and its output into the same cell)
    // would copy again.
    let answer = tokio::spawn(Box::pin(vote_task).instrument(tracing::Span::current()))
        .await
        // A task that died may have died after its write committed.
        .map_err(|e| {
            ApiError::OutcomeUnknown(anyhow::Error::new(e).context("the vote's task failed"))
        })??;
    respond(answer)
}

/// Whether a vote may have written a new record to its user's partition,
/// which is what the day's limit bounds: not a replay, and not a vote
/// refused or failed before it could commit. An unknown outcome may have.
fn left_a_record(answer: &Result<crate::cast::Answer, CastError>) -> bool {
    match answer {
        Ok(answer) => !answer.replayed,
        Err(CastError::KeyReused | CastError::Contention | CastError::Store(_)) => false,
        Err(CastError::OutcomeUnknown(_) | CastError::Unexpected(_)) => true,
    }
}

/// The first limit this vote would pass, if any: the user's rate, their
/// rate of votes on targets this process has not registered, and their
/// votes of the day. A Redis that does not answer leaves the day's count
/// unchecked rather than refusing votes. The vote counted against the day,
/// if it was, to be given back if it leaves no record.
async fn over_a_limit(
    state: &AppState,
    clients: &Clients,
    user: &UserId,
    vote: &Vote,
) -> Result<Option<CountedToday>, ApiError> {
    state.limiter.check(user).map_err(ApiError::RateLimited)?;
    if !clients.caster.knows_target(&vote.target_id) {
        state
            .new_targets
            .check(user)
            .map_err(ApiError::NewTargetsLimited)?;
    }
    match clients.cache.count_vote_today(user).await {
        Ok((count, until_tomorrow, counted)) if count > state.daily_votes => {
            // A refused vote is not one of the day's: the count stays at the limit.
            clients.cache.uncount_vote(counted).await;
            Err(ApiError::DailyLimit(state.daily_votes, until_tomorrow))
        }
        Ok((_, _, counted)) => Ok(Some(counted)),
        Err(e) => {
            metrics::counter!(crate::metrics::DAILY_UNCHECKED).increment(1);
            tracing::debug!(error = %anyhow::Error::new(e), "the day's vote count is unchecked");
            Ok(None)
        }
    }
}

/// The HTTP answer to a vote, marked when it is a stored one given again.
fn respond(answer: crate::cast::Answer) -> Result<HttpResponse, ApiError> {
    let status = StatusCode::from_u16(answer.status).map_err(|e| {
        ApiError::Unavailable(anyhow::Error::new(e).context("a stored answer has a bad status"))
    })?;
    let mut res = HttpResponse::build(status);
    res.content_type("application/json");
    if answer.replayed {
        res.insert_header((REPLAYED, "true"));
    }
    Ok(res.body(answer.body))
}

/// Marks an answer given again for a repeated Idempotency-Key.
pub const REPLAYED: &str = "Idempotent-Replayed";

fn header_str(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn idempotency_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let mut values = headers.get_all("Idempotency-Key");
    let value = values.next().ok_or_else(|| {
        ApiError::bad_request(
            "missing_idempotency_key",
            "the Idempotency-Key header is required",
        )
    })?;
    if values.next().is_some() {
        return Err(ApiError::bad_request(
            "invalid_idempotency_key",
            "send one Idempotency-Key header",
        ));
    }
    let value = value.to_str().map_err(|_| {
        ApiError::bad_request(
            "invalid_idempotency_key",
            "Idempotency-Key must be visible ASCII",
        )
    })?;
    IdempotencyKey::parse(value)
        .map_err(|e| ApiError::bad_request("invalid_idempotency_key", e.to_string()))
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = header_str(headers, header::CONTENT_TYPE) else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// A body, read whole, or 413 as soon as it passes `MAX_BODY`.
pub(super) async fn read_capped(
    mut payload: actix_web::dev::Payload,
) -> Result<web::Bytes, ApiError> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request("bad_body", format!("could not read the body: {e}"))
        })?;
        if body.len() + chunk.len() > MAX_BODY {
            return Err(ApiError::TooLarge(MAX_BODY));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

async fn parse_vote(headers: &HeaderMap, payload: web::Payload) -> Result<Vote, ApiError> {
    if !is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    let declared =
        header_str(headers, header::CONTENT_LENGTH).and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY) {
        return Err(ApiError::TooLarge(MAX_BODY));
    }
    let body = read_capped(payload.into_inner()).await?;
    let raw: VoteBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request("malformed_json", format!("invalid JSON body: {e}")))?;
    Ok(Vote {
        target_id: TargetId::parse(&raw.target_id)
            .map_err(|e| ApiError::bad_request("invalid_target_id", e.to_string()))?,
        target_type: TargetType::parse(&raw.target_type).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_target_type",
                "target_type must be video or comment",
            )
        })?,
        action: raw
            .action
            .parse::<Reaction>()
            .map_err(|e| ApiError::bad_request("invalid_action", e.to_string()))?,
    })
}
