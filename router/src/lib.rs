//! Pure routing logic for the gateway: which tier and which replica of it serve a request.
//!
//! This crate knows nothing about HTTP or storage. The gateway owns one [`ReplicaSet`] per tier,
//! asks it for a [`Lease`] on the least-loaded healthy replica, and reports the outcome back so
//! passive health checking can take failing replicas out for a cooldown.
//!
//! Time is always passed in by the caller (`now: Instant`) so behaviour is testable without sleeps.
//!
//! - [`tier`]: the small/large decision for `model: "auto"` (a classifier score against a
//!   threshold read off its held-out curve for the tenant's policy, moved by budget pressure).
//! - [`replica`]: replica choice (least in flight, under max concurrency) and passive health
//!   (a circuit breaker per replica).
//! - [`limit`]: an adaptive concurrency limit per replica, driven by its time to first token
//!   (a gradient limiter: the limit falls as the server's queue makes TTFT grow).
//! - [`overload`]: a tier's retry budget, adaptive throttling when its servers reject, and a
//!   per-tenant share budget (for fallback to the other tier).
//! - [`prefix`]: prefix block hashing. The gateway cannot see a model server's KV cache, but it
//!   can describe a prompt as a chain of hashes of fixed-size token blocks, the same way the
//!   servers key their prefix caches. Two prompts that share their first `k` blocks share their
//!   first `k` hashes, so a replica that recently saw a hash likely still holds that prefix
//!   (the simulator's prefix cache uses it too).
//! - [`affinity`]: prefix-affinity replica choice over those chains (SGLang's imbalance gate or
//!   llm-d's weighted score), with rendezvous hashing so independent gateways agree.

pub mod affinity;
pub mod limit;
pub mod overload;
pub mod prefix;
pub mod replica;
pub mod tier;
pub mod window;

pub use affinity::{
    Affinity, Candidate, Choice, Policy as AffinityPolicy, Reason as AffinityReason,
};
pub use limit::{AdaptiveLimit, LimitPolicy, Signal};
pub use overload::{Drain, RetryBudget, ShareBudget, Throttle};
pub use prefix::{prefix_block_hashes, prefix_byte_hashes, PrefixLru};
pub use replica::{Breaker, HealthPolicy, Lease, Replica, ReplicaSet, ReplicaSnapshot, Trip};
