//! Request middleware, one file per concern.

pub mod auth;
