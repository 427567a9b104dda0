//! HTTP handlers, one file per resource. Handlers are thin: extract, call a domain function,
//! respond.

pub mod admin;
pub mod budgets;
pub mod dashboard;
pub mod health;
pub mod openai;

use axum::body::Body;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Read a request body up to `limit` bytes (413 in OpenAI shape beyond it).
pub async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::InvalidRequest {
                message: format!("could not read the request body: {e}"),
                param: None,
            }
        }
    })
}

/// Parse a JSON body into `T`, naming the failing field.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    crate::openai::from_value(&value)
}
