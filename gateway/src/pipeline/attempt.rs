//! Attempts with failover: the tiers to try in order, a replica of each, and what counts as a
//! failure worth trying elsewhere (connect errors, timeouts, 5xx; never a 4xx).

use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::{ms_since, respond, settle, Call};
use crate::error::ApiError;
use crate::state::AppState;
use crate::types::Tier;
use crate::upstream::{self, AttemptError, TierPool, UpstreamResponse};

/// The tiers to try, in order: the first tier once plus `retries_same_tier` more replicas of it,
/// then the other tier once when fallback is allowed (by the config, and by the request: a
/// request downgraded by a budget never falls back to the large tier).
pub(super) fn plan(state: &AppState, first: Tier, fallback: bool) -> impl Iterator<Item = Tier> {
    let up = state.upstreams.config();
    let same = std::iter::repeat_n(first, 1 + up.retries_same_tier as usize);
    same.chain((up.fallback_to_other_tier && fallback).then(|| first.other()))
}

/// Outcome of reading a whole non-streamed response within the attempt.
enum Buffered {
    Done(StatusCode, HeaderMap, Bytes),
    Failed(AttemptError),
}

async fn read_all(resp: UpstreamResponse, deadline: Instant, limit: usize) -> Buffered {
    match upstream::read_body(resp, deadline, limit).await {
        Ok((parts, body)) => Buffered::Done(parts.status, parts.headers, body),
        Err(e) => Buffered::Failed(e),
    }
}

/// Try the planned tiers until one answers; respond with its answer (and the tier that gave
/// it), or settle the last error. An answer from the other tier than the one chosen is
/// recorded with the routing reason `unhealthy`.
///
/// Time limits: each attempt waits for response headers up to its first-byte timeout
/// (`upstream.stream_first_byte_timeout_ms` for streams, `first_byte_timeout_ms` otherwise),
/// but never beyond what is left of the first-byte budget the attempts share
/// (`first_byte_budget_ms`); the whole exchange ends at `total_timeout_ms`.
pub(super) async fn forward(mut call: Box<Call>) -> (Response, Option<Tier>) {
    // The pools are borrowed from this handle while the call itself moves on to respond.
    let state = call.state.clone();
    let up = state.upstreams.config();
    let deadline = call.ctx.started + up.total_timeout();
    let mut first_byte_left = up.first_byte_budget();
    let limit = up.max_response_bytes;
    // The replicas tried: room for every attempt a plan makes (`retries_same_tier` is at most
    // 1), on the stack.
    let mut tried = [(Tier::Small, usize::MAX); 3];
    let mut n_tried = 0;
    // The prompt's prefix blocks, hashed the first time a tier choosing by affinity asks.
    let chain: std::cell::OnceCell<Vec<u64>> = std::cell::OnceCell::new();
    let mut last_error: Option<ApiError> = None;
    let mut attempts = 0u32;
    // Active on its first tier until answered: the base of that tier's retry budget.
    let _active = state
        .upstreams
        .tier(call.tier)
        .map(|p| p.retry_budget.request());
    // The key outlives `call` (moved into the response below); its tenant names the counts.
    let key = std::sync::Arc::clone(&call.ctx.key);
    let tenant = key.tenant_name.as_str();
    if state.upstreams.fallbacks().request(tenant, Instant::now()) {
        // The tenant's fallback counters exist from its first request (at 0).
        for tier in [Tier::Small, Tier::Large] {
            for outcome in ["answered", "over_share"] {
                state
                    .metrics
                    .fallbacks
                    .with_label_values(&[tenant, tier.as_str(), outcome]);
            }
        }
    }
    let mut shed: Vec<Tier> = Vec::new();
    for tier in plan(&state, call.tier, call.fallback) {
        let Some(pool) = state.upstreams.tier(tier) else {
            continue;
        };
        if shed.contains(&tier) {
            continue;
        }
        // The attempt's decisions up to the send are made at one instant.
        let now = Instant::now();
        if tier != call.tier && !state.upstreams.fallbacks().try_take(tenant, now) {
            // The tenant's share of fallback (the other tier's price) is spent for now.
            state
                .metrics
                .fallbacks
                .with_label_values(&[tenant, tier.as_str(), "over_share"])
                .inc();
            break;
        }
        if pool.throttle.reject(now, rand::random()) {
            // Its servers are rejecting as overloaded: turn part of the traffic away here.
            state
                .metrics
                .upstream_throttled
                .with_label_values(&[tier.as_str()])
                .inc();
            last_error = Some(ApiError::Unavailable {
                message: format!(
                    "the {tier} tier's model servers are rejecting requests as overloaded; the \
                     gateway is turning away {:.0}% of the requests to them (adaptive throttling)",
                    pool.throttle.reject_probability(now) * 100.0
                ),
                retry_after: 1,
            });
            continue;
        }
        let _retry = if attempts > 0 {
            let Some(retry) = pool.retry_budget.try_retry() else {
                // Retries already in flight use this tier's budget: do not add load.
                state
                    .metrics
                    .retries
                    .with_label_values(&[tier.as_str(), "budget_exhausted"])
                    .inc();
                break;
            };
            state
                .metrics
                .retries
                .with_label_values(&[tier.as_str(), "sent"])
                .inc();
            Some(retry)
        } else {
            None
        };
        let exclude: Vec<usize> = tried[..n_tried]
            .iter()
            .filter(|(t, _)| *t == tier)
            .map(|(_, i)| *i)
            .collect();
        let hashed = || {
            chain
                .get_or_init(|| {
                    router::prefix_byte_hashes(&call.req.prefix_bytes(), up.affinity_block_bytes)
                })
                .as_slice()
        };
        // Requests already waiting for this tier go first: a newcomer queues behind them.
        let behind = !pool.queue.is_empty() && pool.set.in_rotation(now, &exclude);
        let (picked, chose) = if behind {
            (None, None)
        } else {
            pool.choose(now, &exclude, hashed, up.scrape_interval() * 3)
        };
        let lease = match picked {
            Some(lease) => Some(lease),
            None if behind || pool.set.at_capacity(now, &exclude) => {
                let wait = Duration::from_millis(up.queue_wait_ms)
                    .min(first_byte_left)
                    .min(deadline.saturating_duration_since(now));
                match queued(&state, pool, &exclude, up.queue_depth, wait).await {
                    Ok(lease) => lease,
                    Err(e) => {
                        // Shed from this tier: its other attempts would be shed too.
                        shed.push(tier);
                        last_error = Some(e);
                        continue;
                    }
                }
            }
            None => None,
        };
        let Some(lease) = lease else {
            continue;
        };
        if let (Some(aff), Some(chain)) = (&pool.affinity, chain.get()) {
            if !chain.is_empty() {
                note_choice(&state, &mut call.event, pool, &lease, aff, chain, chose);
            }
        }
        if let Some(slot) = tried.get_mut(n_tried) {
            *slot = (tier, lease.index());
            n_tried += 1;
        }
        attempts += 1;
        let target = pool.target(&lease);
        let body = call.req.upstream_body(&target.model);
        let sent = Instant::now();
        let wait = up
            .first_byte_timeout(call.req.stream)
            .min(first_byte_left)
            .min(deadline.saturating_duration_since(sent));
        let outcome = state
            .upstreams
            .send(
                target,
                call.req.endpoint,
                body,
                call.ctx.request_id_header.as_ref(),
                wait,
            )
            .await;
        // One clock read for what the answer's arrival updates (each is a vDSO call).
        let headed = Instant::now();
        first_byte_left = first_byte_left.saturating_sub(headed.saturating_duration_since(sent));
        // What the throttle counts as a rejection: the server says it is overloaded, or refuses
        // the connection.
        let rejected = match &outcome {
            Ok(resp) => matches!(resp.status().as_u16(), 429 | 503),
            Err(e) => matches!(e, upstream::AttemptError::Connect(_)),
        };
        pool.throttle.record(headed, !rejected);
        // A failure: what happened, its metric label, what the client gets, and whether it was
        // a timeout (the replica may be queueing).
        let failure: Result<(), (String, &'static str, ApiError, bool)> = match outcome {
            Ok(resp) if resp.status().is_server_error() => {
                let status = resp.status();
                // Read (and discard) the error body so the connection can be reused.
                let _ = read_all(resp, deadline, limit).await;
                Err((
                    format!("status {status}"),
                    "status_5xx",
                    ApiError::BadGateway {
                        message: format!("the model server answered {status}"),
                    },
                    false,
                ))
            }
            Ok(resp) if call.req.stream && resp.status().is_success() => {
                pool.set.record_success(&lease, headed);
                answered_by(&mut call, tier, attempts);
                return (
                    respond::streamed(call, pool, lease, resp, deadline),
                    Some(tier),
                );
            }
            Ok(resp) => match read_all(resp, deadline, limit).await {
                Buffered::Done(status, headers, body) => {
                    pool.set.record_success(&lease, Instant::now());
                    pool.record_latency(&lease, router::Signal::Whole);
                    answered_by(&mut call, tier, attempts);
                    let usage = if status.is_success() {
                        Some(respond::answer_usage(&call.req, &pool.tokenizer, &body).await)
                    } else {
                        None
                    };
                    let response =
                        respond::buffered(call, pool, &lease, status, &headers, body, usage);
                    return (response, Some(tier));
                }
                Buffered::Failed(e) if !e.is_replica_failure() => {
                    // Any replica would answer the same: no failover, and no mark against it.
                    pool.set.record_success(&lease, Instant::now());
                    tracing::warn!(
                        request_id = %call.ctx.request_id,
                        replica = %target.name,
                        error = %e,
                        "upstream answer refused"
                    );
                    last_error = Some(attempt_error(&e));
                    break;
                }
                Buffered::Failed(e) => Err(failed(&e)),
            },
            Err(e) => Err(failed(&e)),
        };
        if let Err((detail, kind, api_error, timed_out)) = failure {
            if timed_out {
                // No answer within the wait: at least that slow, which the limit should know.
                let signal = if call.req.stream {
                    router::Signal::FirstToken
                } else {
                    router::Signal::Whole
                };
                pool.record_latency(&lease, signal);
            }
            let tripped = pool.set.record_failure(&lease, Instant::now());
            state
                .metrics
                .upstream_errors
                .with_label_values(&[&*target.name, kind])
                .inc();
            if let Some(trip) = tripped {
                state
                    .metrics
                    .breaker_trips
                    .with_label_values(&[tier.as_str(), &*target.name, trip.as_str()])
                    .inc();
            }
            tracing::warn!(
                request_id = %call.ctx.request_id,
                tier = %tier,
                replica = %target.name,
                error = %detail,
                taken_out = tripped.map(router::Trip::as_str),
                "upstream attempt failed"
            );
            last_error = Some(api_error);
        }
        if Instant::now() >= deadline || first_byte_left.is_zero() {
            break;
        }
    }
    let error = last_error.unwrap_or_else(|| ApiError::Unavailable {
        message: format!(
            "no replica can take a request for model `{}` right now (all unhealthy or at capacity)",
            call.req.model
        ),
        retry_after: 1,
    });
    let Call {
        mut event,
        ctx,
        reservation,
        ..
    } = *call;
    event.retries = attempts.saturating_sub(1);
    event.status = error.status().as_u16();
    event.error_kind = Some(error.kind().to_owned());
    event.latency_ms = ms_since(ctx.started);
    settle(&state, event, reservation);
    (error.into_response(), None)
}

/// Wait up to `wait` for a slot on `pool`'s replicas (all at their concurrency limit), in turn
/// behind at most `depth` waiting requests: `Ok(None)` when none freed in time, `Err` when the
/// queue is full or, at the rate the tier has been freeing slots, the requests already waiting
/// would take longer than `wait` (the request is shed at once, not after the wait).
async fn queued(
    state: &AppState,
    pool: &crate::upstream::TierPool,
    exclude: &[usize],
    depth: u32,
    wait: Duration,
) -> Result<Option<router::Lease>, ApiError> {
    let tier = pool.tier.as_str();
    let rate = pool.drain.observe(Instant::now(), pool.set.completed());
    let ahead = u32::try_from(pool.queue.len()).unwrap_or(u32::MAX);
    // Half the wait is kept as a margin for the rate's error (it falls for a while each time a
    // replica's adaptive limit does): a request told to wait is then rarely refused after all,
    // and a refusal after the wait costs the client the whole wait.
    let expected = router::Drain::expected_wait(ahead + 1, rate);
    if let Some(expected) = expected.filter(|e| *e > wait / 2) {
        return Err(shed(
            state,
            tier,
            "expected_wait",
            format!(
                "the {tier} tier is at capacity: {ahead} requests already wait and it frees \
                 about {:.0} slots a second, so this one would wait about {} ms, longer than \
                 the {} ms a request may (upstream.queue_wait_ms); try again shortly",
                rate.unwrap_or_default(),
                expected.as_millis(),
                wait.as_millis()
            ),
        ));
    }
    let Some(place) = pool.queue.join(depth as usize) else {
        return Err(shed(
            state,
            tier,
            "queue_full",
            format!(
                "the {tier} tier is at capacity and {depth} requests already wait for it \
                 (upstream.queue_depth); try again shortly"
            ),
        ));
    };
    let until = Instant::now() + wait;
    let lease = loop {
        let turn = pool.queue.turn();
        tokio::pin!(turn);
        turn.as_mut().enable();
        let head = place.is_head();
        if head {
            if let Some(lease) = pool.set.choose(Instant::now(), exclude) {
                break Some(lease);
            }
        }
        let now = Instant::now();
        if now >= until {
            break None;
        }
        pool.drain.observe(now, pool.set.completed());
        // The head looks for a freed slot every millisecond; the others wait for their turn
        // (or, in case a wake-up is missed, look again after 50 ms).
        let pause = if head { 1 } else { 50 };
        tokio::select! {
            () = &mut turn, if !head => {}
            () = tokio::time::sleep(Duration::from_millis(pause).min(until - now)) => {}
        }
    };
    drop(place);
    if lease.is_none() {
        return Err(shed(
            state,
            tier,
            "queue_timeout",
            format!(
                "the {tier} tier stayed at capacity for the {} ms a request may wait \
                 (upstream.queue_wait_ms); try again shortly",
                wait.as_millis()
            ),
        ));
    }
    Ok(lease)
}

/// A request shed from `tier` for `reason` (counted): a 503 saying `message`, retry in 1 s.
fn shed(state: &AppState, tier: &str, reason: &str, message: String) -> ApiError {
    state.metrics.shed.with_label_values(&[tier, reason]).inc();
    ApiError::Unavailable {
        message,
        retry_after: 1,
    }
}

/// Record that `tier` answered after `attempts` attempts: a tier other than the chosen one means
/// the chosen one was unhealthy.
fn answered_by(call: &mut Call, tier: Tier, attempts: u32) {
    call.event.retries = attempts - 1;
    if tier != call.tier {
        call.event.route_reason = Some(router::tier::Reason::Unhealthy.as_str().into());
        call.state
            .metrics
            .fallbacks
            .with_label_values(&[call.ctx.key.tenant_name.as_str(), tier.as_str(), "answered"])
            .inc();
    }
}

/// An attempt's failure as the attempt loop handles it.
fn failed(e: &AttemptError) -> (String, &'static str, ApiError, bool) {
    (
        e.to_string(),
        e.kind(),
        attempt_error(e),
        matches!(e, AttemptError::Timeout),
    )
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
        AttemptError::TooLarge(limit) => ApiError::BadGateway {
            message: format!(
                "the model server's answer is larger than upstream.max_response_bytes = {limit} \
                 bytes"
            ),
        },
    }
}

/// Remember that `chain` went to the leased replica, and say how it was chosen (the event's
/// `replica_choice` and `matched_blocks`, the metrics). A lease on another replica than the
/// affinity choice (it filled up meanwhile, or the request queued) counts as least-loaded.
fn note_choice(
    state: &AppState,
    event: &mut crate::usage::UsageEvent,
    pool: &TierPool,
    lease: &router::Lease,
    aff: &std::sync::Mutex<router::Affinity>,
    chain: &[u64],
    chose: Option<router::Choice>,
) {
    let index = lease.index();
    let mut memory = upstream::lock(aff);
    let (reason, matched) = match chose.filter(|c| c.index == index) {
        Some(c) => (c.reason, c.matched_blocks),
        None => (
            router::AffinityReason::LeastLoaded,
            memory.matched(index, chain),
        ),
    };
    memory.record(index, chain);
    drop(memory);
    event.replica_choice = Some(reason.as_str().to_owned());
    event.matched_blocks = Some(u32::try_from(matched).unwrap_or(u32::MAX));
    let (tier, replica) = (pool.tier.as_str(), &*pool.target(lease).name);
    let m = &state.metrics;
    m.replica_choices
        .with_label_values(&[tier, replica, reason.as_str()])
        .inc();
    m.prefix_blocks
        .with_label_values(&[tier, replica, "sent"])
        .inc_by(chain.len() as u64);
    m.prefix_blocks
        .with_label_values(&[tier, replica, "matched"])
        .inc_by(matched as u64);
}
