//! `tally vote --demo`: a page of one video and its twenty comments with like
//! and dislike buttons, drawn by the reference JavaScript client
//! (`clients/js`), and a development login that signs a token for any name
//! it is given. Both exist only under the flag: without it `/demo` is 404
//! like any unknown path.

use std::time::Duration;

use actix_web::http::header;
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use crate::auth::{self, AuthConfig};

/// How long a demo login's token lasts.
const TOKEN_TTL: Duration = Duration::from_secs(3600);

const PAGE: &str = include_str!("../../clients/demo/index.html");
const PAGE_SCRIPT: &str = include_str!("../../clients/demo/page.mjs");
const CLIENT: &str = include_str!("../../clients/js/tally.mjs");

/// The page's own files only; styles inline in the page, scripts from here.
const POLICY: &str = "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:";

/// What the dev login signs with: the API's own token settings.
#[derive(Clone)]
pub struct Demo {
    auth: AuthConfig,
}

impl Demo {
    /// Refuses to start when these settings cannot sign a token (keys from
    /// an identity provider's JWKS alone, say): the login would only fail.
    pub fn new(auth: &AuthConfig) -> anyhow::Result<Demo> {
        auth::mint(auth, "demo", TOKEN_TTL, vec![]).map_err(|e| {
            e.context(
                "--demo signs development tokens, which needs --jwt-secret or --jwt-private-key",
            )
        })?;
        Ok(Demo { auth: auth.clone() })
    }

    /// The page, its script, the client module and the login.
    pub fn routes(&self, cfg: &mut web::ServiceConfig) {
        cfg.app_data(web::Data::new(self.clone()))
            .route("/demo", web::get().to(page))
            .route("/demo/page.mjs", web::get().to(page_script))
            .route("/demo/tally.mjs", web::get().to(client))
            .route("/demo/login", web::post().to(login));
    }
}

fn file(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((header::CONTENT_SECURITY_POLICY, POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .body(body)
}

async fn page() -> HttpResponse {
    file("text/html; charset=utf-8", PAGE)
}

async fn page_script() -> HttpResponse {
    file("text/javascript; charset=utf-8", PAGE_SCRIPT)
}

async fn client() -> HttpResponse {
    file("text/javascript; charset=utf-8", CLIENT)
}

#[derive(Deserialize)]
struct Login {
    user: String,
}

#[derive(Serialize)]
struct Signed {
    user: String,
    token: String,
}

/// `POST /demo/login {"user": "alice"}`: a token for that user, signed with
/// the API's key. A development convenience that must never face the public.
async fn login(demo: web::Data<Demo>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    // Read as a vote's body is, so one too large is a 413 in JSON like
    // every other error, not actix's plain-text one.
    let body = super::votes::read_capped(payload.into_inner()).await?;
    let login: Login = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            "malformed_json",
            format!("expected {{\"user\": \"...\"}}: {e}"),
        )
    })?;
    crate::domain::UserId::parse(&login.user)
        .map_err(|e| ApiError::bad_request("invalid_user", e.to_string()))?;
    let token = auth::mint(&demo.auth, &login.user, TOKEN_TTL, vec![])
        .map_err(|e| ApiError::Unavailable(e.context("the demo login could not sign a token")))?;
    Ok(HttpResponse::Ok().json(Signed {
        user: login.user,
        token,
    }))
}
