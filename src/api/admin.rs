//! `POST /v1/admin/reconcile/{target_id}`: support repairs one target's
//! totals online. Admins only (a token with the `admin` role).

use actix_web::{HttpRequest, HttpResponse, web};

use super::AppState;
use super::caller::Admin;
use super::error::ApiError;
use crate::domain::TargetId;
use crate::reconcile::ReconcileError;

pub async fn reconcile(
    Admin(caller): Admin,
    req: HttpRequest,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let target = TargetId::parse(&path)
        .map_err(|e| ApiError::bad_request("invalid_target_id", e.to_string()))?;
    let dry_run = dry_run(req.query_string())?;
    let report = state
        .reconciler
        .target(&target, dry_run)
        .await
        .map_err(|e| match e {
            ReconcileError::Store(e) => ApiError::Unavailable(e.into()),
            ReconcileError::Contention(_) => ApiError::Contention,
        })?;
    tracing::info!(user = %caller.user, target_id = %target, drifted = report.drifted, repaired = report.repaired, "online reconcile");
    Ok(HttpResponse::Ok().json(report))
}

/// `dry_run=true|false`, once; absent means false. Anything else is refused
/// rather than read as false: a mistyped dry run must not repair.
fn dry_run(query: &str) -> Result<bool, ApiError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query)
        .map_err(|e| ApiError::bad_request("invalid_query", e.to_string()))?;
    let mut values = pairs
        .iter()
        .filter(|(k, _)| k == "dry_run")
        .map(|(_, v)| v.as_str());
    let value = values.next();
    if values.next().is_some() {
        return Err(ApiError::bad_request("invalid_query", "give dry_run once"));
    }
    match value {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(ApiError::bad_request(
            "invalid_query",
            format!("dry_run must be true or false, not {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dry_run_is_true_false_or_refused() {
        assert_eq!(dry_run("").ok(), Some(false));
        assert_eq!(dry_run("dry_run=true").ok(), Some(true));
        assert_eq!(dry_run("dry_run=false").ok(), Some(false));
        for bad in [
            "dry_run=yes",
            "dry_run=",
            "dry_run=true&dry_run=false",
            "dry_run=%ff",
        ] {
            assert!(dry_run(bad).is_err(), "{bad:?}");
        }
    }
}
