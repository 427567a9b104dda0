//! HTTP handlers, one file per resource. Handlers are thin: extract, call a domain function,
//! respond.

pub mod admin;
pub mod budgets;
pub mod dashboard;
pub mod guard;
pub mod health;
pub mod openai;
pub mod policy;
pub mod routing;

use axum::body::Body;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::ledger::report::IsoWeek;
use crate::ledger::LedgerStore;
use crate::state::AppState;
use crate::store::{StoreError, Tenant};

/// A query string read as `T`. Axum's own `Query` answers a malformed one with plain text;
/// this one with a 400 in OpenAI's shape that says what is wrong.
#[derive(Debug, Clone)]
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> axum::extract::FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Self(q.0))
            .map_err(|e| ApiError::InvalidRequest {
                message: e.body_text(),
                param: None,
            })
    }
}

/// Read a request body up to `limit` bytes (413 in OpenAI shape beyond it; 408 when it does not
/// arrive within `server.body_read_timeout_ms`, see [`crate::server::DeadlineBody`]).
pub async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            if c.is::<http_body_util::LengthLimitError>() {
                return ApiError::PayloadTooLarge { limit };
            }
            if let Some(d) = c.downcast_ref::<crate::server::BodyDeadline>() {
                return ApiError::RequestTimeout {
                    secs: d.0.as_secs_f64(),
                };
            }
            cause = c.source();
        }
        ApiError::InvalidRequest {
            message: format!("could not read the request body: {e}"),
            param: None,
        }
    })
}

/// Parse a JSON body into `T`, naming the failing field.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    crate::openai::from_value(&value)
}

/// The `object` of a list body: always `"list"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ListObject {
    /// `"list"`.
    #[default]
    List,
}

/// An admin list body: `{"object": "list", "data": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    /// Always `"list"`.
    pub object: ListObject,
    /// The items.
    pub data: Vec<T>,
}

impl<T> List<T> {
    /// A list of `data`.
    pub fn new(data: Vec<T>) -> Self {
        Self {
            object: ListObject::List,
            data,
        }
    }
}

/// Admin request bodies are small.
pub(crate) const ADMIN_BODY_LIMIT: usize = 64 * 1024;

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict(m) => ApiError::Conflict(m),
            StoreError::NotFound(m) => ApiError::NotFound(m),
            other => ApiError::internal(other),
        }
    }
}

/// The tenant named by id or name, or 404.
pub(crate) async fn tenant(state: &AppState, id_or_name: &str) -> Result<Tenant, ApiError> {
    state
        .store
        .find_tenant(id_or_name)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no tenant {id_or_name:?}")))
}

/// The ledger, or 404 when it is disabled.
pub(crate) fn ledger(state: &AppState) -> Result<&dyn LedgerStore, ApiError> {
    state
        .ledger
        .as_deref()
        .ok_or_else(|| ApiError::NotFound("the ledger is disabled (ledger.enabled = false)".into()))
}

/// Parse the ISO week in query parameter `param` (400 naming it when malformed).
pub(crate) fn week(
    param: &str,
    value: Option<&str>,
    default: IsoWeek,
) -> Result<IsoWeek, ApiError> {
    match value {
        None => Ok(default),
        Some(v) => IsoWeek::parse(v, chrono::Utc::now()).ok_or_else(|| {
            ApiError::invalid(
                param,
                format!("`{param}` must be an ISO week like 2026-W48, got {v:?}"),
            )
        }),
    }
}
