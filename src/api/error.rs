//! The vote API's errors and their HTTP form. Every error is JSON in one
//! shape: `{"error": {"code": "...", "message": "..."}}`.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::auth::AuthError;
use crate::cast::CastError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error(transparent)]
    Unauthorized(#[from] AuthError),
    #[error("only admins may do this")]
    Forbidden,
    #[error("no such resource")]
    NotFound,
    #[error("method not allowed; this resource supports {0}")]
    MethodNotAllowed(&'static str),
    #[error("the request body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("the request body must be application/json")]
    UnsupportedMediaType,
    #[error("the request body did not arrive within {} s; nothing was changed", .0.as_secs_f64())]
    BodyTimeout(std::time::Duration),
    #[error("this Idempotency-Key was already used for a different request")]
    KeyReused,
    #[error("too many concurrent changes to this user's reactions; retry")]
    Contention,
    #[error("too many votes from this user; retry after {} s", .0.as_secs().max(1))]
    RateLimited(std::time::Duration),
    #[error("too many reads from this user; retry after {} s", .0.as_secs().max(1))]
    ReadsLimited(std::time::Duration),
    #[error("too many votes on targets new to this service from this user; retry after {} s", .0.as_secs().max(1))]
    NewTargetsLimited(std::time::Duration),
    #[error("this user reached the day's vote limit ({0}); it resets at 00:00 UTC")]
    DailyLimit(u64, std::time::Duration),
    #[error("the service is at capacity; nothing was changed, retry")]
    Overloaded,
    #[error(
        "a dependency is unavailable; nothing was changed, retry with the same Idempotency-Key"
    )]
    Unavailable(#[source] anyhow::Error),
    #[error(
        "the vote may or may not have been recorded; retry with the same Idempotency-Key to learn which"
    )]
    OutcomeUnknown(#[source] anyhow::Error),
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest { code, .. } => code,
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::Forbidden => "forbidden",
            ApiError::NotFound => "not_found",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::TooLarge(_) => "payload_too_large",
            ApiError::UnsupportedMediaType => "unsupported_media_type",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::KeyReused => "idempotency_key_reused",
            ApiError::Contention => "contention",
            ApiError::RateLimited(_) | ApiError::ReadsLimited(_) => "rate_limited",
            ApiError::NewTargetsLimited(_) => "new_targets_limited",
            ApiError::DailyLimit(..) => "daily_limit",
            ApiError::Overloaded => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::OutcomeUnknown(_) => "outcome_unknown",
        }
    }
}

impl From<CastError> for ApiError {
    fn from(e: CastError) -> Self {
        match e {
            CastError::KeyReused => ApiError::KeyReused,
            CastError::Contention => ApiError::Contention,
            CastError::Store(e) => ApiError::Unavailable(e.into()),
            CastError::OutcomeUnknown(e) => ApiError::OutcomeUnknown(e.into()),
            CastError::Unexpected(e) => ApiError::Unavailable(e),
        }
    }
}

/// The code of the error a response carries, for the middleware that
/// labels latency by outcome.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden => StatusCode::FORBIDDEN,
            ApiError::NotFound => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Contention => StatusCode::CONFLICT,
            ApiError::RateLimited(_)
            | ApiError::ReadsLimited(_)
            | ApiError::NewTargetsLimited(_)
            | ApiError::DailyLimit(..) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unavailable(_) | ApiError::OutcomeUnknown(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    fn error_response(&self) -> HttpResponse {
        // The log gets the whole cause chain; the client a clean message.
        if let ApiError::Unavailable(cause) | ApiError::OutcomeUnknown(cause) = self {
            tracing::warn!(
                code = self.code(),
                error = format!("{cause:#}"),
                "answered 503"
            );
        }
        let mut res = HttpResponse::build(self.status_code());
        match self {
            ApiError::Unauthorized(e) => {
                let challenge = match e {
                    AuthError::Missing => r#"Bearer realm="tally""#.to_owned(),
                    other => format!(
                        r#"Bearer realm="tally", error="invalid_token", error_description="{}""#,
                        other.to_string().replace('"', "'")
                    ),
                };
                if let Ok(v) = HeaderValue::from_str(&challenge) {
                    res.insert_header((header::WWW_AUTHENTICATE, v));
                }
            }
            ApiError::Contention
            | ApiError::Unavailable(_)
            | ApiError::OutcomeUnknown(_)
            | ApiError::Overloaded => {
                res.insert_header((header::RETRY_AFTER, "1"));
            }
            ApiError::MethodNotAllowed(allow) => {
                res.insert_header((header::ALLOW, *allow));
            }
            ApiError::RateLimited(wait)
            | ApiError::ReadsLimited(wait)
            | ApiError::NewTargetsLimited(wait)
            | ApiError::DailyLimit(_, wait) => {
                res.insert_header((header::RETRY_AFTER, wait.as_secs().max(1).to_string()));
            }
            _ => {}
        }
        let mut res =
            res.json(json!({ "error": { "code": self.code(), "message": self.to_string() } }));
        res.extensions_mut().insert(ErrorCode(self.code()));
        res
    }
}
