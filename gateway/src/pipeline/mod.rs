//! The request pipeline, in one place. [`run`] reads top to bottom as the whole path of a proxied
//! request:
//!
//! parse → resolve model → *guard* → cache → *route* → budget → attempts with failover
//! ([`attempt`]) → buffered or streamed response ([`respond`]) → settle ([`settle`]).
//!
//! Every step takes and fills one per-request [`Call`]: who asks, what was asked, the usage event
//! being built, the tier, the budget reservation and the cache lookup. The guard seat (agent
//! loops) and the route seat (the tier router for `auto`; prefix affinity next) sit between
//! the parse and the budget.
//!
//! [`run`] is spawned on the app's task tracker by the handlers, so a client hang-up never cancels
//! it: a non-streamed request still completes and settles, and a streamed one keeps reading the
//! upstream (or cancels it, per `upstream.on_client_disconnect`) and settles what was consumed.
//! Exactly one [`UsageEvent`] is produced per call.

mod attempt;
pub mod coalesce;
mod respond;
mod settle;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use chrono::{DateTime, Utc};

use crate::budget::engine::{AdmitInput, Reservation, ReservePrice};
use crate::cache::Lookup;
use crate::error::ApiError;
use crate::openai::{Endpoint, ParsedRequest};
use crate::state::AppState;
use crate::store::ApiKey;
use crate::types::{ModelTarget, Tier};
use crate::usage::{CacheStatus, UsageEvent, UsageSource};

pub use settle::settle;

/// Who is asking, established by the middleware before the pipeline runs.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// Gateway request id.
    pub request_id: Arc<str>,
    /// The same id as the edge's header value (shared: sent upstream without a copy).
    pub request_id_header: Option<HeaderValue>,
    /// The authenticated key.
    pub key: Arc<ApiKey>,
    /// Key tags merged with the request's `x-gateway-tags`.
    pub tags: BTreeMap<String, String>,
    /// Arrival time (monotonic).
    pub started: Instant,
    /// Arrival time (wall clock).
    pub started_at: DateTime<Utc>,
    /// The client's `Cache-Control` directives.
    pub cache_control: crate::cache::Directives,
    /// The client's `x-session-id`, checked.
    pub session: Option<String>,
    /// What the client said about the request being a retry (`x-stainless-retry-count`,
    /// `Idempotency-Key`).
    pub retry: crate::guard::retries::ClientRetry,
}

/// One request on its way through the pipeline: each step reads what the earlier ones decided
/// and adds its own decision.
pub struct Call {
    /// The gateway's shared state.
    pub state: AppState,
    /// Who is asking.
    pub ctx: RequestContext,
    /// The parsed request (its `max_tokens` clamped by the budget step when needed).
    pub req: ParsedRequest,
    /// The usage event this call settles exactly once.
    pub event: UsageEvent,
    /// The tier tried first.
    pub tier: Tier,
    /// Whether the other tier may answer when this one fails (not after a budget downgrade).
    pub fallback: bool,
    /// Room reserved in the tenant's budgets, committed at settle.
    pub reservation: Option<Reservation>,
    /// The cache lookup, when the tenant's policy makes the request cacheable; filled from the
    /// answer at the end.
    pub cache: Option<Lookup>,
    /// Headers the steps add to the answer (budget warnings and clamps).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The guard step recognised the request as a client retry.
    pub retry: bool,
    /// Where a streamed answer's chunks go for retries that join it (it leads).
    pub stream_log: Option<Arc<coalesce::StreamLog>>,
}

/// Run one proxied request to completion and settle it.
pub async fn run(
    state: AppState,
    ctx: RequestContext,
    endpoint: Endpoint,
    body: Bytes,
) -> Response {
    let mut event = new_event(&ctx, endpoint);
    // Parsing and fingerprinting read the whole body: a very large one off the async workers.
    let parsed = crate::tokens::off_workers(body.len(), crate::tokens::SCAN_INLINE_BYTES, || {
        match ParsedRequest::parse_bytes(endpoint, body.clone()) {
            Ok(req) => {
                record_request(&mut event, &ctx.key, &req);
                Ok(req)
            }
            Err(e) => {
                event.fingerprint = crate::openai::fingerprint_bytes(&body);
                Err(e)
            }
        }
    })
    .await;
    let req = match parsed {
        Ok(r) => r,
        Err(e) => return refuse(&state, &ctx, event, e).await,
    };
    let Some(target) = state.config.resolve_model(&req.model) else {
        let e = ApiError::ModelNotFound(req.model.clone());
        return refuse(&state, &ctx, event, e).await;
    };
    // Boxed: the steps below take the call by value, and an `async fn` keeps a by-value
    // argument twice in its future (as the argument and as the body's local), so a 1.4 KB
    // `Call` passed down two levels made the request's future ~10 KB, copied whole into its
    // box on every request.
    let mut call = Box::new(Call::new(state, ctx, req, event, target));
    // Guard: agent loops (and, next, client retries) are checked here, before any cost.
    if let Err(e) = call.guard().await {
        let Call {
            state, ctx, event, ..
        } = *call;
        return refuse(&state, &ctx, event, e).await;
    }
    // A client retry of a request still running joins it (a stream from its first chunk).
    let inflight = Arc::clone(&call.state.inflight);
    let join = inflight.join(&call.ctx.key.id, &call.event.fingerprint, call.retry);
    let mut leader = match join {
        coalesce::Join::Follow(slot) => match coalesce::follow(slot).await {
            Some(response) => return call.coalesced(response),
            None => None,
        },
        coalesce::Join::Lead(leader) => Some(leader),
        coalesce::Join::Alone => None,
    };
    if call.req.stream {
        call.stream_log = leader.as_mut().map(coalesce::Leader::log);
    }
    let limit = call
        .state
        .config
        .upstream
        .max_response_bytes
        .saturating_mul(2);
    let response = answer(call, target).await;
    match leader {
        Some(leader) => leader.publish(response, limit).await,
        None => response,
    }
}

/// The steps after the guard: cache, route, budget, attempts.
async fn answer(mut call: Box<Call>, target: ModelTarget) -> Response {
    if let Some(hit) = call.cache_lookup().await {
        return hit;
    }
    call.route(target).await;
    if let Err(e) = call.admit().await {
        return call.reject(e);
    }
    let cache_status = call.event.cache_status;
    let mut headers = std::mem::take(&mut call.headers);
    let chosen = call.tier;
    let (mut response, served) = attempt::forward(call).await;
    if let Some(served) = served.filter(|t| *t != chosen) {
        // The other tier answered: say so instead of the route step's choice.
        headers.retain(|(name, _)| *name != crate::headers::ROUTE);
        let why = format!("tier={served} reason=unhealthy chosen={chosen}");
        if let Ok(v) = HeaderValue::from_str(&why) {
            headers.push((crate::headers::ROUTE, v));
        }
    }
    response.headers_mut().extend(headers);
    response.headers_mut().insert(
        crate::headers::CACHE,
        HeaderValue::from_static(cache_status.header_value()),
    );
    response
}

/// Answer an error found before the body was parsed (unreadable or late body, bad tags header).
pub async fn reject_early(
    state: &AppState,
    ctx: &RequestContext,
    endpoint: Endpoint,
    e: ApiError,
) -> Response {
    refuse(state, ctx, new_event(ctx, endpoint), e).await
}

/// Answer a request refused before admission, and settle it. It still counts against the
/// tenant's request-rate limits (one request, no tokens), so malformed or unknown-model requests
/// cannot be sent without limit: once the limit is spent they get its 429 instead. A budget
/// store that cannot be reached never turns the refusal into anything else.
async fn refuse(
    state: &AppState,
    ctx: &RequestContext,
    event: UsageEvent,
    mut e: ApiError,
) -> Response {
    let mut reservation = None;
    let plan = state
        .budgets
        .plan(&ctx.key, &event.tags)
        .and_then(crate::budget::engine::Plan::requests_only);
    if let Some(plan) = plan {
        let input = AdmitInput {
            rid: ctx.request_id.to_string(),
            prompt_tokens: 0,
            max_tokens: None,
            generates: false,
            choices: 1,
            price: ReservePrice::default(),
            small_price: ReservePrice::default(),
            primary_is_small: true,
        };
        match state.budgets.admit(&plan, input).await {
            Ok(mut admission) => reservation = admission.reservation.take(),
            Err(refusal @ crate::budget::Refusal::RateLimited { .. }) => e = refusal.into(),
            Err(_) => {}
        }
    }
    settle::reject(state, ctx, event, e, reservation)
}

impl Call {
    /// Start a call for a parsed request whose model resolved to `target`: plan its cache
    /// lookup and pick the tier tried first.
    fn new(
        state: AppState,
        ctx: RequestContext,
        req: ParsedRequest,
        event: UsageEvent,
        target: ModelTarget,
    ) -> Self {
        let cache = state.cache.plan(
            &ctx.key.tenant_id,
            &req,
            &event.fingerprint,
            ctx.cache_control,
        );
        Self {
            state,
            ctx,
            req,
            event,
            tier: target.tier().unwrap_or(Tier::Large),
            fallback: true,
            reservation: None,
            cache,
            headers: Vec::new(),
            retry: false,
            stream_log: None,
        }
    }

    /// The guard step: the request's session (recorded as its `session` tag), and a loop the
    /// conversation or the session's window shows, decided by the tenant's policy: flagged on
    /// the answer (`x-gateway-loop`, the ledger's `loop_flag`), or refused (429
    /// `loop_detected`).
    async fn guard(&mut self) -> Result<(), ApiError> {
        let tagged = self.event.tags.get("session").cloned();
        let client = self.ctx.session.as_deref().or(tagged.as_deref());
        // A derived session hashes the conversation's root: a very large one off the async
        // workers.
        let inline = crate::tokens::SCAN_INLINE_BYTES;
        let session = crate::tokens::off_workers(self.req.body_bytes, inline, || {
            crate::guard::session::of(client, &self.ctx.key.id, &self.req)
        })
        .await;
        if !self.event.tags.contains_key("session") {
            self.event
                .tags
                .insert("session".to_owned(), session.id.clone());
        }
        // The conversation is read only by the loop check (borrowed from the client's text
        // where the body was read that way).
        let messages = match self.req.endpoint {
            Endpoint::Chat if self.state.guard.enabled() => self.req.messages(),
            _ => None,
        };
        let check = crate::guard::Check {
            tenant_id: &self.ctx.key.tenant_id,
            tenant_name: &self.ctx.key.tenant_name,
            session: &session.id,
            messages: messages.as_deref(),
            request: crate::guard::request_hash(&self.event.fingerprint),
        };
        let retry = crate::guard::RetryCheck {
            key: &self.ctx.key,
            client: &self.ctx.retry,
            fingerprint: &self.event.fingerprint,
        };
        let (decision, verdict) = self.state.guard.step(check, retry).await;
        self.client_retry(verdict)?;
        let (found, verb) = match decision {
            crate::guard::Decision::Allow => return Ok(()),
            crate::guard::Decision::Flag { found, throttled } => {
                (found, if throttled { "throttled" } else { "flagged" })
            }
            crate::guard::Decision::Refuse(r) => {
                self.event.loop_flag = true;
                self.event.loop_steps = r.steps;
                self.event.avoided_micros = if r.last_cost_micros > 0 {
                    r.last_cost_micros
                } else {
                    self.estimated_cost().await
                };
                self.state
                    .metrics
                    .guard_loop_cost
                    .with_label_values(&[self.ctx.key.tenant_name.as_str(), "avoided"])
                    .inc_by(u64::try_from(self.event.avoided_micros).unwrap_or(0));
                tracing::info!(
                    request_id = %self.ctx.request_id,
                    session = %session.id,
                    blocked = r.blocked,
                    "agent loop refused"
                );
                return Err(ApiError::LoopDetected {
                    message: r.message,
                    retry_after: r.retry_after_secs,
                });
            }
        };
        self.event.loop_flag = true;
        self.event.loop_steps = u32::try_from(found.steps()).unwrap_or(u32::MAX);
        tracing::info!(
            request_id = %self.ctx.request_id,
            session = %session.id,
            repeats = found.repeats,
            period = found.period,
            what = %found.what,
            "agent loop flagged"
        );
        let value = format!(
            "{verb}; session={}; repeats={}; period={}",
            session.id, found.repeats, found.period
        );
        let value = HeaderValue::from_str(&value).unwrap_or_else(|_| {
            HeaderValue::from_str(&format!("{verb}; repeats={}", found.repeats))
                .unwrap_or(HeaderValue::from_static("flagged"))
        });
        self.headers.push((crate::headers::LOOP, value));
        Ok(())
    }

    /// The retry budget: a client retry beyond the tenant's budget is flagged
    /// (`retry_storm_flag`) and, unless `guard.retry_action = "flag"`, refused at once.
    fn client_retry(&mut self, verdict: crate::guard::RetryVerdict) -> Result<(), ApiError> {
        let guard = &self.state.guard;
        self.retry = verdict.signal.is_some();
        if !verdict.over_budget {
            return Ok(());
        }
        self.event.retry_storm_flag = true;
        let rule = self.state.config.guard.retry_rule();
        if guard.retry_action() == crate::config::RetryAction::Refuse {
            return Err(ApiError::RetryBudgetExceeded {
                message: format!(
                    "too many retries from tenant {:?}: beyond its retry budget ({:.0}% of its \
                     requests over the last {} s, at least {}); wait and send the request once",
                    self.ctx.key.tenant_name,
                    rule.share * 100.0,
                    rule.window.as_secs(),
                    rule.floor
                ),
                retry_after: rule.window.as_secs().clamp(1, 10),
            });
        }
        Ok(())
    }

    /// What answering the request would cost by its prompt alone (the first tier's tokenizer
    /// and dearest price): the estimate of what refusing it saves, when its session has no
    /// answered request to go by.
    async fn estimated_cost(&self) -> i64 {
        let input = self.admit_input().await;
        let micros = i128::from(input.price.input) * i128::from(input.prompt_tokens) / 1_000_000;
        i64::try_from(micros).unwrap_or(i64::MAX)
    }

    /// Answer a client retry with the answer of the identical request it joined, and settle it
    /// at cost 0 (that request is the one billed).
    fn coalesced(self, response: Response) -> Response {
        let Call {
            state,
            ctx,
            mut event,
            ..
        } = self;
        event.cache_status = CacheStatus::Coalesced;
        event.status = response.status().as_u16();
        event.latency_ms = ms_since(ctx.started);
        settle::settle(&state, event, None);
        response
    }

    /// The route step: an explicit model keeps its tier; a routed one (`auto`) gets the tier
    /// the classifier and the tenant's policy pick, said in `x-gateway-route` and recorded in
    /// the ledger's `route_reason`.
    async fn route(&mut self, target: ModelTarget) {
        if let Some(tier) = target.tier() {
            self.tier = tier;
            self.event.route_reason = Some(router::tier::Reason::Explicit.as_str().into());
            return;
        }
        self.event.routed = true;
        let router = Arc::clone(&self.state.routing);
        let req = &self.req;
        let tenant = &self.ctx.key.tenant_id;
        // Budget pressure as this replica last saw it: no round trip.
        let budget_used = self.state.budgets.pressure(&self.ctx.key, &self.event.tags);
        // The prompt: its latest user message, read from the client's text (a body parsed
        // into a tree is walked again: a very large one off the async workers).
        let inline = crate::tokens::SCAN_INLINE_BYTES;
        let (text, special) =
            crate::tokens::off_workers(req.body_bytes, inline, || req.routing_view()).await;
        // Classifying it tokenizes it: a long one off the async workers.
        let inline = crate::tokens::NEW_TEXT_INLINE_BYTES;
        let routed = crate::tokens::off_workers(text.len(), inline, || {
            router.route(tenant, &text, special, budget_used)
        })
        .await;
        self.tier = routed.tier;
        self.event.route_reason = Some(routed.reason.as_str().into());
        if let Ok(v) = HeaderValue::from_str(&routed.header()) {
            self.headers.push((crate::headers::ROUTE, v));
        }
    }

    /// The cache step: a hit is answered (and settled at cost 0) here.
    async fn cache_lookup(&mut self) -> Option<Response> {
        let lookup = self.cache.as_mut()?;
        self.event.cache_status = CacheStatus::Miss;
        let found = self.state.cache.lookup(lookup).await?;
        respond::cache_hit(self, found)
    }

    /// The budget step: reserve room for the request in every budget and rate limit that
    /// applies, clamping `max_tokens` or downgrading to the small tier when the budget says so.
    async fn admit(&mut self) -> Result<(), ApiError> {
        let Some(plan) = self.state.budgets.plan(&self.ctx.key, &self.event.tags) else {
            return Ok(());
        };
        let input = self.admit_input().await;
        let mut admission = self.state.budgets.admit(&plan, input).await?;
        self.headers.extend(respond::budget_headers(&admission));
        if admission.downgraded {
            if self.tier == Tier::Large {
                self.event.route_reason = Some(router::tier::Reason::Budget.as_str().into());
            }
            self.tier = Tier::Small;
            self.fallback = false;
        }
        if let Some(m) = admission.max_tokens {
            if self.req.endpoint != Endpoint::Embeddings {
                self.req.set_max_tokens(m);
            }
        }
        if let Some(lookup) = self.cache.as_mut() {
            // A clamped or downgraded answer is not the answer to the request as asked.
            lookup.write &= !admission.downgraded && admission.clamped_to.is_none();
        }
        self.reservation = admission.reservation.take();
        Ok(())
    }

    /// What the budget step needs to know about a request: its prompt estimate (the first
    /// tier's tokenizer), requested output, and the price it is reserved at: the dearest replica
    /// of the tier it goes to first (the small tier if a `downgrade` budget sends it there). A
    /// failover to the other tier is settled at what it cost, so a dollar budget can be
    /// overshot by the price difference of the requests that failed over while it was nearly
    /// spent; reserving every request at the dearest reachable tier instead refused most
    /// affordable requests.
    async fn admit_input(&self) -> AdmitInput {
        let (state, req) = (&self.state, &self.req);
        // Counted here unless that would tokenize much new text (an agent's history was
        // counted on its earlier steps); then off the async workers.
        let prompt_tokens = match state.upstreams.tier(self.tier) {
            Some(t) => {
                crate::tokens::count_bounded(
                    |fresh| req.count_prompt_tokens_within(&t.tokenizer, fresh),
                    || req.count_prompt_tokens(&t.tokenizer),
                )
                .await
            }
            None => 0,
        };
        let max_tokens = match (req.max_tokens, req.endpoint) {
            (Some(m), _) => Some(u64::from(m)),
            // OpenAI's (and vLLM's) default for the legacy completions endpoint.
            (None, Endpoint::Completions) => Some(16),
            (None, _) => None,
        };
        let at = self.ctx.started_at;
        AdmitInput {
            rid: self.ctx.request_id.to_string(),
            prompt_tokens,
            max_tokens,
            generates: req.endpoint != Endpoint::Embeddings,
            choices: req.choices(),
            price: tier_price(state, &[self.tier], at),
            small_price: tier_price(state, &[Tier::Small], at),
            primary_is_small: self.tier == Tier::Small,
        }
    }

    /// Answer an error found before any upstream call, and settle the call (releasing what it
    /// reserved).
    fn reject(self, e: ApiError) -> Response {
        settle::reject(&self.state, &self.ctx, self.event, e, self.reservation)
    }
}

/// The highest input and output prices among the replicas of `tiers` at `at`.
fn tier_price(state: &AppState, tiers: &[Tier], at: DateTime<Utc>) -> ReservePrice {
    let book = state.prices.book();
    let mut price = ReservePrice::default();
    for tier in tiers {
        let Some(pool) = state.upstreams.tier(*tier) else {
            continue;
        };
        for target in &pool.targets {
            if let Some(p) = book.price_at(&target.model, at) {
                price.input = price.input.max(p.input);
                price.output = price.output.max(p.output);
            }
        }
    }
    price
}

/// What was asked, on the event: the request's fingerprint, model, streaming, and its `user` as
/// a tag (unless the key or header set one, or the key does not allow clients a `user` tag).
fn record_request(event: &mut UsageEvent, key: &ApiKey, req: &ParsedRequest) {
    event.fingerprint = req.fingerprint();
    if let Some(user) = req.end_user().filter(|_| key.allows_client_tag("user")) {
        event
            .tags
            .entry("user".to_owned())
            .or_insert_with(|| user.to_owned());
    }
    event.requested_model = req.model.clone();
    event.stream = req.stream;
}

fn new_event(ctx: &RequestContext, endpoint: Endpoint) -> UsageEvent {
    UsageEvent {
        request_id: ctx.request_id.clone(),
        started_at: ctx.started_at,
        tenant_id: ctx.key.tenant_id.clone(),
        tenant_name: ctx.key.tenant_name.clone(),
        key_id: ctx.key.id.clone(),
        tags: ctx.tags.clone(),
        endpoint: endpoint.label().into(),
        requested_model: String::new(),
        served_model: None,
        tier: None,
        replica: None,
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_tokens: 0,
        usage_source: UsageSource::None,
        status: 200,
        error_kind: None,
        stream: false,
        client_disconnected: false,
        latency_ms: 0.0,
        ttft_ms: None,
        retries: 0,
        cache_status: CacheStatus::Bypass,
        cost_micros: 0,
        output_cost_micros: 0,
        saved_micros: 0,
        loop_flag: false,
        retry_storm_flag: false,
        loop_steps: 0,
        avoided_micros: 0,
        route_reason: None,
        routed: false,
        all_large_micros: None,
        replica_choice: None,
        matched_blocks: None,
        fingerprint: String::new(),
    }
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}
