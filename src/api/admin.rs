//! `POST /v1/admin/reconcile/{target_id}`: support repairs one target's
//! totals online. Admins only (a token with the `admin` role).

use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};

use super::AppState;
use super::error::ApiError;
use crate::domain::TargetId;
use crate::reconcile::ReconcileError;

pub async fn reconcile(req: HttpRequest, state: web::Data<AppState>, path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let auth = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let caller = state.verifier.verify_header(auth)?;
    if !caller.admin {
        return Err(ApiError::Forbidden);
    }
    let target = TargetId::parse(&path).map_err(|e| ApiError::bad_request("invalid_target_id", e.to_string()))?;
    let dry_run = req.query_string().split('&').any(|kv| kv == "dry_run=true");
    let report = state.reconciler.target(&target, dry_run).await.map_err(|e| match e {
        ReconcileError::Unavailable(e) => ApiError::Unavailable(e.into()),
        ReconcileError::Contention(_) => ApiError::Contention,
    })?;
    tracing::info!(user = %caller.user, target_id = %target, drifted = report.drifted, repaired = report.repaired, "online reconcile");
    Ok(HttpResponse::Ok().json(report))
}
