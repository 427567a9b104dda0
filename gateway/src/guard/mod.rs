//! The guard step: agent loops (and, next, client retries) found on the request path, before
//! any cost. Today: the request's session and the loop signal inside one request, flagged (the
//! `x-gateway-loop` header, the ledger's `loop_flag`, `gateway_guard_loops_total`); the
//! cross-request window, per-tenant policies and the throttle and block actions follow.

pub mod session;
pub mod signals;

pub use session::Session;
pub use signals::Loop;
