//! The request pipeline, in one place: parse → resolve model → route → forward (with failover) →
//! respond (buffered or streamed) → settle.
//!
//! [`run`] is spawned on the app's task tracker by the handlers, so a client hang-up never cancels
//! it: a non-streamed request still completes and settles, and a streamed one keeps reading the
//! upstream (or cancels it, per `upstream.on_client_disconnect`) and settles what was consumed.
//! Exactly one [`UsageEvent`] is produced per call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use router::Lease;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::budget::engine::{AdmitInput, Reservation, ReservePrice};
use crate::budget::Admission;
use crate::cache::Lookup;
use crate::config::DisconnectPolicy;
use crate::error::ApiError;
use crate::openai::{
    completion_text, usage_in_body, Endpoint, ParsedRequest, SseRewriter, StreamAssembler, Usage,
};
use crate::state::AppState;
use crate::store::ApiKey;
use crate::types::Tier;
use crate::upstream::{self, AttemptError, Target, TierPool, UpstreamResponse};
use crate::usage::{CacheStatus, UsageEvent, UsageSource};

/// Who is asking, established by the middleware before the pipeline runs.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// Gateway request id.
    pub request_id: String,
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
}

/// Status recorded when the client disconnected before the end of a stream (nginx's convention).
const CLIENT_CLOSED: u16 = 499;

fn new_event(ctx: &RequestContext, endpoint: Endpoint) -> UsageEvent {
    UsageEvent {
        request_id: ctx.request_id.clone(),
        started_at: ctx.started_at,
        tenant_id: ctx.key.tenant_id.clone(),
        tenant_name: ctx.key.tenant_name.clone(),
        key_id: ctx.key.id.clone(),
        tags: ctx.tags.clone(),
        endpoint: endpoint.label().to_owned(),
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
        fingerprint: String::new(),
    }
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

/// Run one proxied request to completion and settle it.
pub async fn run(
    state: AppState,
    ctx: RequestContext,
    endpoint: Endpoint,
    body: Bytes,
) -> Response {
    let mut event = new_event(&ctx, endpoint);
    let req = match ParsedRequest::parse(endpoint, &body) {
        Ok(r) => r,
        Err(e) => {
            event.fingerprint = crate::openai::fingerprint_bytes(&body);
            return reject(&state, &ctx, event, e);
        }
    };
    event.fingerprint = req.fingerprint();
    if let Some(user) = req.end_user() {
        event
            .tags
            .entry("user".to_owned())
            .or_insert_with(|| user.to_owned());
    }
    event.requested_model = req.model.clone();
    event.stream = req.stream;
    let Some(target) = state.config.resolve_model(&req.model) else {
        let e = ApiError::ModelNotFound(req.model.clone());
        return reject(&state, &ctx, event, e);
    };
    // `auto` goes to the large tier until the tier router decides.
    let mut primary = target.tier().unwrap_or(Tier::Large);
    let mut cache = state.cache.plan(
        &ctx.key.tenant_id,
        &req,
        &event.fingerprint,
        ctx.cache_control,
    );
    if let Some(lookup) = cache.as_mut() {
        event.cache_status = CacheStatus::Miss;
        if let Some(found) = state.cache.lookup(lookup).await {
            match cache_hit(&state, &ctx, &req, event, found) {
                Ok(response) => return response,
                Err(e) => event = *e,
            }
        }
    }
    let cache_status = event.cache_status;
    let mut req = req;
    let mut admission = Admission::default();
    if let Some(plan) = state.budgets.plan(&ctx.key, &event.tags) {
        let input = admit_input(&state, &ctx, &req, primary);
        match state.budgets.admit(&plan, input).await {
            Ok(a) => admission = a,
            Err(e) => return reject(&state, &ctx, event, e),
        }
        if admission.downgraded {
            primary = Tier::Small;
        }
        if let Some(m) = admission.max_tokens {
            if req.endpoint != Endpoint::Embeddings {
                req.set_max_tokens(m);
            }
        }
    }
    if let Some(lookup) = cache.as_mut() {
        // A clamped or downgraded answer is not the answer to the request as asked.
        lookup.write &= !admission.downgraded && !admission.clamped;
    }
    let headers = std::mem::take(&mut admission.headers);
    let fallback = !admission.downgraded;
    let mut response = forward(
        state,
        ctx,
        req,
        event,
        primary,
        fallback,
        admission.reservation.take(),
        cache,
    )
    .await;
    response.headers_mut().extend(headers);
    response.headers_mut().insert(
        crate::cache::CACHE_HEADER,
        HeaderValue::from_static(cache_status.header_value()),
    );
    response
}

/// Answer from the cache: cost 0, the saved cost recorded. `Err` gives the event back when the
/// stored answer cannot be replayed in the form asked for (the request then goes upstream).
fn cache_hit(
    state: &AppState,
    ctx: &RequestContext,
    req: &ParsedRequest,
    mut event: UsageEvent,
    found: crate::cache::Found,
) -> Result<Response, Box<UsageEvent>> {
    let entry = &found.entry;
    let body = if req.stream {
        match crate::openai::replay_sse(&entry.body, req.endpoint, req.client_wants_usage) {
            Some(b) => b,
            None => return Err(Box::new(event)),
        }
    } else {
        entry.body.clone()
    };
    event.cache_status = found.status;
    event.served_model = Some(entry.served_model.clone());
    event.tier = Some(entry.tier.clone());
    let (input, output) =
        state
            .prices
            .book()
            .cost_split(&entry.served_model, &entry.usage, ctx.started_at);
    event.saved_micros = input + output;
    event.latency_ms = ms_since(ctx.started);
    event.ttft_ms = Some(event.latency_ms);
    state
        .metrics
        .cache_saved
        .with_label_values(&[event.tenant_name.as_str()])
        .inc_by(u64::try_from(event.saved_micros).unwrap_or(0));
    let mut response = Response::new(Body::from(body));
    let headers = response.headers_mut();
    let content_type = if req.stream {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        "text/event-stream"
    } else {
        "application/json"
    };
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        crate::cache::CACHE_HEADER,
        HeaderValue::from_static(found.status.header_value()),
    );
    for (name, value) in [
        ("x-gateway-tier", entry.tier.as_str()),
        ("x-gateway-served-model", entry.served_model.as_str()),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.insert(name, v);
        }
    }
    if let Some((cosine, probability)) = found.similarity {
        for (name, value) in [
            ("x-gateway-cache-similarity", cosine),
            ("x-gateway-cache-confidence", probability),
        ] {
            if let Ok(v) = HeaderValue::from_str(&format!("{value:.4}")) {
                headers.insert(name, v);
            }
        }
    }
    settle(state, event, None);
    Ok(response)
}

/// What the budget step needs to know about a request: its prompt estimate (the primary tier's
/// tokenizer), requested output, and the prices it may be served at (the dearest replica of the
/// tiers it may reach; the small tier alone if a `downgrade` budget sends it there).
fn admit_input(
    state: &AppState,
    ctx: &RequestContext,
    req: &ParsedRequest,
    primary: Tier,
) -> AdmitInput {
    let prompt_tokens = state
        .upstreams
        .tier(primary)
        .map_or(0, |t| req.count_prompt_tokens(&t.tokenizer));
    let max_tokens = match (req.max_tokens, req.endpoint) {
        (Some(m), _) => Some(u64::from(m)),
        // OpenAI's (and vLLM's) default for the legacy completions endpoint.
        (None, Endpoint::Completions) => Some(16),
        (None, _) => None,
    };
    AdmitInput {
        rid: ctx.request_id.clone(),
        prompt_tokens,
        max_tokens,
        generates: req.endpoint != Endpoint::Embeddings,
        choices: req.choices(),
        price: tier_price(state, &attempt_plan(state, primary, true), ctx.started_at),
        small_price: tier_price(state, &[Tier::Small], ctx.started_at),
        primary_is_small: primary == Tier::Small,
    }
}

/// The highest input and output prices among the replicas of `tiers` at `at`.
fn tier_price(state: &AppState, tiers: &[Tier], at: DateTime<Utc>) -> ReservePrice {
    let book = state.prices.book();
    let mut price = ReservePrice::default();
    for name in tiers {
        let Some(tier) = state.upstreams.tier(*name) else {
            continue;
        };
        for target in &tier.targets {
            if let Some(p) = book.price_at(&target.model, at) {
                price.input = price.input.max(p.input);
                price.output = price.output.max(p.output);
            }
        }
    }
    price
}

/// Answer an error found before the body was parsed (unreadable body, bad tags header).
pub fn reject_early(
    state: &AppState,
    ctx: &RequestContext,
    endpoint: Endpoint,
    e: ApiError,
) -> Response {
    reject(state, ctx, new_event(ctx, endpoint), e)
}

/// Answer an error produced before any upstream call, and settle it.
fn reject(state: &AppState, ctx: &RequestContext, mut event: UsageEvent, e: ApiError) -> Response {
    state.metrics.rejected.with_label_values(&[e.kind()]).inc();
    event.status = e.status().as_u16();
    event.error_kind = Some(e.kind().to_owned());
    event.latency_ms = ms_since(ctx.started);
    settle(state, event, None);
    e.into_response()
}

/// The tiers to try, in order: the primary tier once plus `retries_same_tier` more replicas of
/// it, then the other tier once when fallback is allowed (by the config, and by the request: a
/// request downgraded by a budget never falls back to the large tier).
fn attempt_plan(state: &AppState, primary: Tier, fallback: bool) -> Vec<Tier> {
    let up = state.upstreams.config();
    let mut plan = vec![primary; 1 + up.retries_same_tier as usize];
    if up.fallback_to_other_tier && fallback {
        plan.push(primary.other());
    }
    plan
}

/// Outcome of reading a whole non-streamed response within the attempt.
enum Buffered {
    Done(StatusCode, HeaderMap, Bytes),
    Failed(AttemptError),
}

async fn read_all(resp: UpstreamResponse, deadline: Instant) -> Buffered {
    match upstream::read_body(resp, deadline).await {
        Ok((parts, body)) => Buffered::Done(parts.status, parts.headers, body),
        Err(e) => Buffered::Failed(e),
    }
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    state: AppState,
    ctx: RequestContext,
    mut req: ParsedRequest,
    mut event: UsageEvent,
    primary: Tier,
    fallback: bool,
    reservation: Option<Reservation>,
    cache: Option<Lookup>,
) -> Response {
    let deadline = ctx.started + state.upstreams.config().total_timeout();
    let mut tried: Vec<(Tier, usize)> = Vec::new();
    let mut last_error: Option<ApiError> = None;
    let mut attempts = 0u32;
    for tier_name in attempt_plan(&state, primary, fallback) {
        let Some(tier) = state.upstreams.tier(tier_name) else {
            continue;
        };
        let exclude: Vec<usize> = tried
            .iter()
            .filter(|(t, _)| *t == tier_name)
            .map(|(_, i)| *i)
            .collect();
        let Some(lease) = tier.set.choose(Instant::now(), &exclude) else {
            continue;
        };
        tried.push((tier_name, lease.index()));
        attempts += 1;
        let target = tier.target(&lease);
        let body = req.upstream_body(&target.model);
        let outcome = state
            .upstreams
            .send(target, req.endpoint, body, &ctx.request_id)
            .await;
        let failure: Result<(), (String, &'static str, ApiError)> = match outcome {
            Ok(resp) if resp.status().is_server_error() => {
                let status = resp.status();
                // Read (and discard) the error body so the connection can be reused.
                let _ = read_all(resp, deadline).await;
                Err((
                    format!("status {status}"),
                    "status_5xx",
                    ApiError::BadGateway {
                        message: format!("the model server answered {status}"),
                    },
                ))
            }
            Ok(resp) if req.stream && resp.status().is_success() => {
                tier.set.record_success(&lease);
                event.retries = attempts - 1;
                return stream_response(
                    state.clone(),
                    ctx,
                    req,
                    event,
                    tier,
                    lease,
                    resp,
                    deadline,
                    reservation,
                    cache,
                );
            }
            Ok(resp) => match read_all(resp, deadline).await {
                Buffered::Done(status, headers, body) => {
                    tier.set.record_success(&lease);
                    event.retries = attempts - 1;
                    return buffered_response(
                        &state,
                        &ctx,
                        &req,
                        event,
                        tier,
                        &lease,
                        status,
                        &headers,
                        body,
                        reservation,
                        cache,
                    );
                }
                Buffered::Failed(e) => Err((e.to_string(), e.kind(), attempt_error(&e))),
            },
            Err(e) => Err((e.to_string(), e.kind(), attempt_error(&e))),
        };
        if let Err((detail, kind, api_error)) = failure {
            let tripped = tier.set.record_failure(&lease, Instant::now());
            state
                .metrics
                .upstream_errors
                .with_label_values(&[target.name.as_str(), kind])
                .inc();
            tracing::warn!(
                request_id = %ctx.request_id,
                tier = %tier_name,
                replica = %target.name,
                error = %detail,
                taken_out = tripped,
                "upstream attempt failed"
            );
            last_error = Some(api_error);
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    let error = last_error.unwrap_or_else(|| ApiError::Unavailable {
        message: format!(
            "no replica can take a request for model `{}` right now (all unhealthy or at capacity)",
            req.model
        ),
        retry_after: 1,
    });
    event.retries = attempts.saturating_sub(1);
    event.status = error.status().as_u16();
    event.error_kind = Some(error.kind().to_owned());
    event.latency_ms = ms_since(ctx.started);
    settle(&state, event, reservation);
    error.into_response()
}

fn attempt_error(e: &AttemptError) -> ApiError {
    match e {
        AttemptError::Timeout => {
            ApiError::GatewayTimeout("no response from the model server in time".into())
        }
        AttemptError::Connect(_) => ApiError::BadGateway {
            message: "could not connect to the model server".into(),
        },
        AttemptError::Transport(_) => ApiError::BadGateway {
            message: "the connection to the model server failed".into(),
        },
    }
}

fn gateway_headers(headers: &mut HeaderMap, tier: &TierPool, target: &Target, retries: u32) {
    for (name, value) in [
        ("x-gateway-tier", tier.tier.as_str()),
        ("x-gateway-replica", target.name.as_str()),
        ("x-gateway-served-model", target.model.as_str()),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.insert(name, v);
        }
    }
    headers.insert("x-gateway-retries", HeaderValue::from(retries));
}

#[allow(clippy::too_many_arguments)]
fn buffered_response(
    state: &AppState,
    ctx: &RequestContext,
    req: &ParsedRequest,
    mut event: UsageEvent,
    tier: &TierPool,
    lease: &Lease,
    status: StatusCode,
    upstream_headers: &HeaderMap,
    body: Bytes,
    reservation: Option<Reservation>,
    cache: Option<Lookup>,
) -> Response {
    let target = tier.target(lease);
    event.tier = Some(tier.tier.as_str().to_owned());
    event.replica = Some(target.name.clone());
    event.served_model = Some(target.model.clone());
    event.status = status.as_u16();
    event.latency_ms = ms_since(ctx.started);
    event.ttft_ms = Some(event.latency_ms);
    if status.is_success() {
        match usage_in_body(&body) {
            Some(u) => apply_usage(&mut event, u, UsageSource::Upstream),
            None => {
                let mut text = String::new();
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    completion_text(&v, &mut text);
                }
                let counted = Usage {
                    prompt_tokens: req.count_prompt_tokens(&tier.tokenizer),
                    completion_tokens: tier.tokenizer.count(&text) as u64,
                    cached_tokens: 0,
                };
                apply_usage(&mut event, counted, UsageSource::Tokenizer);
            }
        }
        if let (Some(lookup), true) = (cache, status == StatusCode::OK) {
            let entry = cache_entry(&event, tier, target, body.clone(), lookup.ttl);
            state.cache.fill(lookup, entry);
        }
    } else {
        event.error_kind = Some(format!("upstream_{}", status.as_u16()));
    }
    settle(state, event.clone(), reservation);
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let content_type = upstream_headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/json"));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, content_type);
    // Back-off hints from the upstream are for the client.
    for (name, value) in upstream_headers {
        if name == header::RETRY_AFTER || name.as_str().starts_with("x-ratelimit-") {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    gateway_headers(response.headers_mut(), tier, target, event.retries);
    response
}

/// A fresh answer as the cache keeps it.
fn cache_entry(
    event: &UsageEvent,
    tier: &TierPool,
    target: &Target,
    body: Bytes,
    ttl: std::time::Duration,
) -> crate::cache::Entry {
    crate::cache::Entry {
        body,
        served_model: target.model.clone(),
        tier: tier.tier.as_str().to_owned(),
        usage: Usage {
            prompt_tokens: event.prompt_tokens,
            completion_tokens: event.completion_tokens,
            cached_tokens: event.cached_tokens,
        },
        ttl,
    }
}

fn apply_usage(event: &mut UsageEvent, usage: Usage, source: UsageSource) {
    event.prompt_tokens = usage.prompt_tokens;
    event.completion_tokens = usage.completion_tokens;
    event.cached_tokens = usage.cached_tokens;
    event.usage_source = source;
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    state: AppState,
    ctx: RequestContext,
    req: ParsedRequest,
    mut event: UsageEvent,
    tier: &TierPool,
    lease: Lease,
    resp: UpstreamResponse,
    deadline: Instant,
    reservation: Option<Reservation>,
    cache: Option<Lookup>,
) -> Response {
    let target = tier.target(&lease);
    event.tier = Some(tier.tier.as_str().to_owned());
    event.replica = Some(target.name.clone());
    event.served_model = Some(target.model.clone());
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        resp.headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("text/event-stream")),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    gateway_headers(&mut headers, tier, target, event.retries);

    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let tier_name = tier.tier;
    let task_state = state.clone();
    state.tasks.spawn(async move {
        let state = task_state;
        let Some(tier) = state.upstreams.tier(tier_name) else {
            return;
        };
        let idle = state.upstreams.config().idle_timeout();
        let policy = state.upstreams.config().on_client_disconnect;
        let mut rewriter = SseRewriter::new(req.client_wants_usage);
        if cache.as_ref().is_some_and(|c| c.write) {
            rewriter.assembler = Some(StreamAssembler::new(req.endpoint));
        }
        let mut upstream = http_body_util::BodyDataStream::new(resp.into_body());
        let mut client_gone = false;
        let mut failure: Option<&'static str> = None;
        loop {
            let wait = idle.min(deadline.saturating_duration_since(Instant::now()));
            let next = tokio::time::timeout(wait, upstream.next()).await;
            let out = match next {
                Err(_) => {
                    failure = Some("timeout");
                    break;
                }
                Ok(None) => {
                    let tail = rewriter.finish();
                    if !client_gone && !tail.is_empty() {
                        let _ = tx.send(Ok(tail)).await;
                    }
                    break;
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(request_id = %ctx.request_id, error = %e, "upstream stream broke");
                    failure = Some("transport");
                    break;
                }
                Ok(Some(Ok(chunk))) => rewriter.push(&chunk),
            };
            if event.ttft_ms.is_none() && rewriter.events > 0 {
                event.ttft_ms = Some(ms_since(ctx.started));
            }
            if client_gone || out.is_empty() {
                continue;
            }
            if tx.send(Ok(out)).await.is_err() {
                client_gone = true;
                tracing::info!(request_id = %ctx.request_id, ?policy, "client disconnected mid-stream");
                if policy == DisconnectPolicy::Cancel {
                    break;
                }
            }
        }
        if let Some(kind) = failure {
            let target = tier.target(&lease);
            state
                .metrics
                .upstream_errors
                .with_label_values(&[target.name.as_str(), kind])
                .inc();
            // Tell the client the stream ended abnormally, in the OpenAI error shape.
            let e = ApiError::BadGateway {
                message: format!("the model server stream ended early ({kind})"),
            };
            let _ = tx
                .send(Ok(Bytes::from(format!("data: {}\n\n", e.body()))))
                .await;
            event.error_kind = Some(format!("stream_{kind}"));
            event.status = StatusCode::BAD_GATEWAY.as_u16();
        }
        drop(tx);
        let usage = match rewriter.usage {
            Some(u) => (u, UsageSource::Upstream),
            None => (
                Usage {
                    prompt_tokens: req.count_prompt_tokens(&tier.tokenizer),
                    completion_tokens: tier.tokenizer.count(&rewriter.text) as u64,
                    cached_tokens: 0,
                },
                UsageSource::Tokenizer,
            ),
        };
        apply_usage(&mut event, usage.0, usage.1);
        let assembled = match (failure, rewriter.done, rewriter.assembler.take()) {
            (None, true, Some(a)) => a.finish(),
            _ => None,
        };
        if let (Some(lookup), Some(body)) = (cache, assembled) {
            let target = tier.target(&lease);
            let entry = cache_entry(&event, tier, target, body, lookup.ttl);
            state.cache.fill(lookup, entry);
        }
        if client_gone {
            event.client_disconnected = true;
            event.status = CLIENT_CLOSED;
        }
        event.latency_ms = ms_since(ctx.started);
        drop(lease);
        settle(&state, event, reservation);
    });

    let mut response = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *response.headers_mut() = headers;
    response
}

/// Price the event, commit its usage to the budgets it reserved on, record metrics and hand the
/// event to the sink. Never blocks (a commit that must wait for Redis runs on the task tracker).
pub fn settle(state: &AppState, mut event: UsageEvent, reservation: Option<Reservation>) {
    if let Some(model) = event.served_model.as_deref() {
        let usage = Usage {
            prompt_tokens: event.prompt_tokens,
            completion_tokens: event.completion_tokens,
            cached_tokens: event.cached_tokens,
        };
        let (input, output) = state
            .prices
            .book()
            .cost_split(model, &usage, event.started_at);
        event.cost_micros = input + output;
        event.output_cost_micros = output;
    }
    if let Some(reservation) = reservation {
        let tokens = match event.cache_status {
            CacheStatus::HitExact | CacheStatus::HitSemantic => 0,
            _ => event.prompt_tokens + event.completion_tokens,
        };
        let (budgets, cost) = (Arc::clone(&state.budgets), event.cost_micros);
        let mut commit = Box::pin(async move { budgets.commit(reservation, tokens, cost).await });
        // The in-process store commits at once; Redis finishes on the tracker.
        if futures_util::FutureExt::now_or_never(commit.as_mut()).is_none() {
            state.tasks.spawn(commit);
        }
    }
    let m = &state.metrics;
    let tier = event.tier.as_deref().unwrap_or("none");
    let status = event.status.to_string();
    m.requests
        .with_label_values(&[
            event.tenant_name.as_str(),
            event.requested_model.as_str(),
            tier,
            status.as_str(),
        ])
        .inc();
    let model = event
        .served_model
        .as_deref()
        .unwrap_or(event.requested_model.as_str());
    for (kind, n) in [
        ("prompt", event.prompt_tokens),
        ("completion", event.completion_tokens),
        ("cached", event.cached_tokens),
    ] {
        if n > 0 {
            m.tokens
                .with_label_values(&[event.tenant_name.as_str(), model, kind])
                .inc_by(n);
        }
    }
    if let Some(replica) = event.replica.as_deref() {
        m.duration
            .with_label_values(&[tier, replica])
            .observe(event.latency_ms / 1000.0);
        if let Some(ttft) = event.ttft_ms {
            m.ttft
                .with_label_values(&[tier, replica])
                .observe(ttft / 1000.0);
        }
    }
    state.sink.record(event);
}
