//! Header limits answered in OpenAI shape: a header section over [`MAX_HEADER_BYTES`] gets a 431
//! whose JSON body names the limit. The count of fields is capped below this layer, by hyper's
//! own limit of [`MAX_HEADERS`]: past it hyper answers 431 without a body and closes the
//! connection (raising the cap would move hyper's per-request header arrays to the heap).

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Most header fields a request may carry: hyper's default cap, enforced by hyper.
pub const MAX_HEADERS: usize = 100;
/// Largest total size of a request's header names and values, bytes (hyper's own buffer limit is
/// larger).
pub const MAX_HEADER_BYTES: usize = 32 * 1024;

/// The 431 for a request with more than [`MAX_HEADER_BYTES`] of headers (or more than
/// [`MAX_HEADERS`] of them, which hyper refuses before this); `None` when they are within the
/// limits.
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
