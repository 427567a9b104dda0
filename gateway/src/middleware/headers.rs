//! Header limits answered in OpenAI shape: hyper refuses oversized header sections itself with an
//! empty 431, so the listener lets through more than this layer accepts, and the client learns
//! which limit it hit from a JSON body.

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Most header fields a request may carry (hyper's own cap is set above it).
pub const MAX_HEADERS: usize = 100;
/// Largest total size of a request's header names and values, bytes (hyper's own buffer limit is
/// larger).
pub const MAX_HEADER_BYTES: usize = 32 * 1024;

/// The 431 for a request with more than [`MAX_HEADERS`] headers or more than
/// [`MAX_HEADER_BYTES`] of them; `None` when they are within the limits.
pub fn oversized(headers: &HeaderMap) -> Option<Response> {
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return Some(
            ApiError::HeadersTooLarge(format!(
                "the request's headers are too large: {} fields, {bytes} bytes (at most \
                 {MAX_HEADERS} fields and {MAX_HEADER_BYTES} bytes)",
                headers.len()
            ))
            .into_response(),
        );
    }
    None
}
