//! Settlement: every call ends here exactly once, answered or refused. The event is priced, its
//! usage committed to the budgets it reserved on (releasing the rest), counted in the metrics
//! and handed to the sink (the ledger writer's queue).

use std::sync::Arc;

use axum::response::{IntoResponse, Response};

use super::{ms_since, RequestContext};
use crate::budget::engine::Reservation;
use crate::error::ApiError;
use crate::openai::Usage;
use crate::state::AppState;
use crate::types::Tier;
use crate::usage::{CacheStatus, UsageEvent};

/// Answer an error produced before any upstream call, and settle it (a reservation, if one was
/// made, is released).
pub(super) fn reject(
    state: &AppState,
    ctx: &RequestContext,
    mut event: UsageEvent,
    e: ApiError,
    reservation: Option<Reservation>,
) -> Response {
    state.metrics.rejected.with_label_values(&[e.kind()]).inc();
    event.status = e.status().as_u16();
    event.error_kind = Some(e.kind().to_owned());
    event.latency_ms = ms_since(ctx.started);
    settle(state, event, reservation);
    e.into_response()
}

/// What a routed request's usage would have cost on the large tier (the price of its first
/// replica's model, at the request's start): the baseline the reports' router savings are
/// measured against. Its own cost when the large tier served it; `None` without a large tier.
fn all_large(state: &AppState, event: &UsageEvent, usage: &Usage) -> Option<i64> {
    if event.tier.as_deref() == Some(Tier::Large.as_str()) {
        return Some(event.cost_micros);
    }
    let large = state.upstreams.tier(Tier::Large)?.targets.first()?;
    Some(
        state
            .prices
            .book()
            .cost(&large.model, usage, event.started_at),
    )
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
        if event.routed {
            event.all_large_micros = all_large(state, &event, &usage);
        }
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
    if let Some(session) = event.session().filter(|_| state.guard.loops_enabled()) {
        // The guard's observe: the turn answered (or not) and what it cost.
        let (guard, key) = (
            Arc::clone(&state.guard),
            crate::guard::store::SessionKey::new(&event.tenant_id, session),
        );
        let (request, ok, cost) = (
            crate::guard::request_hash(&event.fingerprint),
            (200..300).contains(&event.status),
            event.cost_micros,
        );
        let mut observe = Box::pin(async move { guard.observe(&key, request, ok, cost).await });
        if futures_util::FutureExt::now_or_never(observe.as_mut()).is_none() {
            state.tasks.spawn(observe);
        }
    }
    let upstream_trouble =
        crate::guard::retries::Signal::retried_after(event.status, event.error_kind.as_deref());
    if upstream_trouble && !event.fingerprint.is_empty() {
        // An error a client retries: the same request again soon after is a client retry.
        let guard = Arc::clone(&state.guard);
        let (tenant, key, fingerprint) = (
            event.tenant_id.clone(),
            event.key_id.clone(),
            event.fingerprint.clone(),
        );
        let mut mark = Box::pin(async move { guard.failed(&tenant, &key, &fingerprint).await });
        if futures_util::FutureExt::now_or_never(mark.as_mut()).is_none() {
            state.tasks.spawn(mark);
        }
    }
    let m = &state.metrics;
    if event.loop_flag {
        m.guard_loop_cost
            .with_label_values(&[event.tenant_name.as_str(), "burned"])
            .inc_by(u64::try_from(event.cost_micros).unwrap_or(0));
    }
    let tier = event.tier.as_deref().unwrap_or("none");
    // The status's digits without formatting them (any `u16` a status can be is in 100..=999).
    let code = axum::http::StatusCode::from_u16(event.status).ok();
    let status = code.as_ref().map_or("000", axum::http::StatusCode::as_str);
    // Only names the configuration knows become label values: anything a client can type
    // would grow /metrics without bound.
    let requested = if state.config.resolve_model(&event.requested_model).is_some() {
        event.requested_model.as_str()
    } else {
        "unknown"
    };
    m.requests
        .with_label_values(&[event.tenant_name.as_str(), requested, tier, status])
        .inc();
    let model = event.served_model.as_deref().unwrap_or(requested);
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
