//! Every `x-gateway-*` header name, defined once (as metric names are in [`crate::metrics`]).
//! The request path's steps return typed decisions; the edge renders these headers from them.

use axum::http::HeaderName;

/// Request: attribution tags, `k=v` pairs separated by commas.
pub const TAGS: HeaderName = HeaderName::from_static("x-gateway-tags");
/// The client's session id (an agent run, a conversation), for the guard step.
pub const SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");
/// Set when the guard step found an agent loop: `flagged; session=…; repeats=N; period=P`
/// (`throttled`, `blocked` on a refusal).
pub const LOOP: HeaderName = HeaderName::from_static("x-gateway-loop");
/// Response: `false` on a refusal a retry cannot change (a blocked session); OpenAI's SDKs
/// honour it and stop retrying.
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// Response (and upstream request): the id the gateway minted for the request. A client's
/// `x-request-id` is never used as one: it is kept as the correlation id.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Request and response: the client's own id for the request (from `x-client-request-id`, or
/// the `x-request-id` it sent), echoed back and logged.
pub const CLIENT_REQUEST_ID: HeaderName = HeaderName::from_static("x-client-request-id");

/// Response, on a routed (`auto`) request: why it went to its tier
/// (`tier=small reason=classifier p_large=0.17 policy=balanced`).
pub const ROUTE: HeaderName = HeaderName::from_static("x-gateway-route");
/// Response: the tier that answered (`small`, `large`).
pub const TIER: HeaderName = HeaderName::from_static("x-gateway-tier");
/// Response: the replica that answered.
pub const REPLICA: HeaderName = HeaderName::from_static("x-gateway-replica");
/// Response, under prefix affinity: how the replica was chosen and the prompt blocks it had
/// seen before (`reason=affinity matched_blocks=8`).
pub const REPLICA_CHOICE: HeaderName = HeaderName::from_static("x-gateway-replica-choice");
/// Response: the model name the upstream served.
pub const SERVED_MODEL: HeaderName = HeaderName::from_static("x-gateway-served-model");
/// Response: attempts after the first (failover).
pub const RETRIES: HeaderName = HeaderName::from_static("x-gateway-retries");

/// Response: how the cache answered (`hit-exact`, `hit-semantic`, `miss`, `bypass`).
pub const CACHE: HeaderName = HeaderName::from_static("x-gateway-cache");
/// Response, semantic hits: cosine similarity to the stored question.
pub const CACHE_SIMILARITY: HeaderName = HeaderName::from_static("x-gateway-cache-similarity");
/// Response, semantic hits: the verifier's probability that both ask the same.
pub const CACHE_CONFIDENCE: HeaderName = HeaderName::from_static("x-gateway-cache-confidence");

/// Response: `downgraded` when a budget sent the request to the small tier.
pub const BUDGET_ACTION: HeaderName = HeaderName::from_static("x-gateway-budget-action");
/// Response: the `max_tokens` forwarded when a budget lowered it.
pub const BUDGET_CLAMPED: HeaderName = HeaderName::from_static("x-gateway-budget-clamped");
/// Response, one per budget past its warning percentage: `<policy id> <n>% used`.
pub const BUDGET_WARNING: HeaderName = HeaderName::from_static("x-gateway-budget-warning");
/// Response: `flag` budgets this request is over, comma-separated.
pub const BUDGET_EXCEEDED: HeaderName = HeaderName::from_static("x-gateway-budget-exceeded");
/// Response: the tightest budget, `<policy id> <scope> <window>`.
pub const BUDGET_POLICY: HeaderName = HeaderName::from_static("x-gateway-budget-policy");
/// Response: tokens left in the tightest budget.
pub const BUDGET_REMAINING_TOKENS: HeaderName =
    HeaderName::from_static("x-gateway-budget-remaining-tokens");
/// Response: USD left in the tightest budget.
pub const BUDGET_REMAINING_USD: HeaderName =
    HeaderName::from_static("x-gateway-budget-remaining-usd");
/// Response: when the tightest budget's window resets (RFC 3339).
pub const BUDGET_RESET: HeaderName = HeaderName::from_static("x-gateway-budget-reset");
/// Response: `fail-open` when admitted against the local share (budget store unreachable).
pub const BUDGET_MODE: HeaderName = HeaderName::from_static("x-gateway-budget-mode");
