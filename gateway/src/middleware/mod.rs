//! Request middleware, one file per concern.

pub mod auth;
pub mod request_id;
