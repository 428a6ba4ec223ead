//! The caller as an extractor: a handler that names `Caller` (or `Admin`) in
//! its arguments gets a verified identity, or the request is answered 401
//! (or 403) before the handler runs.

use std::future::{Ready, ready};

use actix_web::dev::Payload;
use actix_web::http::header;
use actix_web::{FromRequest, HttpRequest, web};

use super::error::ApiError;
use crate::auth::{Caller, Verifier};

impl FromRequest for Caller {
    type Error = ApiError;
    type Future = Ready<Result<Caller, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(verify(req))
    }
}

/// A caller with the `admin` role.
#[derive(Debug, Clone)]
pub struct Admin(pub Caller);

impl FromRequest for Admin {
    type Error = ApiError;
    type Future = Ready<Result<Admin, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(verify(req).and_then(|caller| {
            if caller.admin {
                Ok(Admin(caller))
            } else {
                Err(ApiError::Forbidden)
            }
        }))
    }
}

fn verify(req: &HttpRequest) -> Result<Caller, ApiError> {
    let verifier = req
        .app_data::<web::Data<Verifier>>()
        .ok_or_else(|| ApiError::Unavailable(anyhow::anyhow!("no token verifier configured")))?;
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    Ok(verifier.verify_header(header)?)
}
