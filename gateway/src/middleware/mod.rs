//! Request middleware, one file per concern.

pub mod auth;
pub mod headers;
pub mod request_id;
