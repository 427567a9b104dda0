//! Pure routing logic for the gateway: which replica of a tier serves a request.
//!
//! This crate knows nothing about HTTP or storage. The gateway owns one [`ReplicaSet`] per tier,
//! asks it for a [`Lease`] on the least-loaded healthy replica, and reports the outcome back so
//! passive health checking can take failing replicas out for a cooldown.
//!
//! Time is always passed in by the caller (`now: Instant`) so behaviour is testable without sleeps.

pub mod replica;

pub use replica::{HealthPolicy, Lease, Replica, ReplicaSet, ReplicaSnapshot};
