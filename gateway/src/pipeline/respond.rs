//! Answers: from the cache, a buffered upstream body, or a stream passed through event by event
//! (a driver task reads the upstream to the end, or stops it on hang-up, and settles).

use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use chrono::SecondsFormat;
use futures_util::StreamExt;
use router::Lease;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{ms_since, settle, Call};
use crate::budget::decision::Tightest;
use crate::budget::{Admission, Scope, Window};
use crate::config::DisconnectPolicy;
use crate::error::ApiError;
use crate::headers;
use crate::openai::{
    completion_text, usage_in_body, ParsedRequest, SseRewriter, StreamAssembler, Usage,
};
use crate::tokens::{self, Tokenizer};
use crate::types::price::Usd;
use crate::upstream::{Target, TierPool, UpstreamResponse};
use crate::usage::{UsageEvent, UsageSource};

/// Status recorded when the client disconnected before the end of a stream (nginx's convention).
const CLIENT_CLOSED: u16 = 499;

/// Answer from the cache: cost 0, the saved cost recorded. `None` when the stored answer cannot
/// be replayed in the form asked for (the request then goes upstream).
pub(super) fn cache_hit(call: &mut Call, found: crate::cache::Found) -> Option<Response> {
    let (state, ctx, req) = (&call.state, &call.ctx, &call.req);
    let entry = &found.entry;
    let body = if req.stream {
        crate::openai::replay_sse(&entry.body, req.endpoint, req.client_wants_usage)?
    } else {
        entry.body.clone()
    };
    // The call ends here: this is its one event.
    let mut event = call.event.clone();
    event.cache_status = found.status;
    event.served_model = Some(entry.served_model.as_str().into());
    event.tier = Some(entry.tier.clone().into());
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
        crate::headers::CACHE,
        HeaderValue::from_static(found.status.header_value()),
    );
    // What the earlier steps said (the guard's loop flag).
    headers.extend(call.headers.iter().cloned());
    for (name, value) in [
        (crate::headers::TIER, entry.tier.as_str()),
        (crate::headers::SERVED_MODEL, entry.served_model.as_str()),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.insert(name, v);
        }
    }
    if let Some((cosine, probability)) = found.similarity {
        for (name, value) in [
            (crate::headers::CACHE_SIMILARITY, cosine),
            (crate::headers::CACHE_CONFIDENCE, probability),
        ] {
            if let Ok(v) = HeaderValue::from_str(&format!("{value:.4}")) {
                headers.insert(name, v);
            }
        }
    }
    settle(state, event, None);
    Some(response)
}

/// What the budget step tells the client: the action taken, budgets past their warning, flag
/// budgets exceeded, and the tightest budget's room and reset.
pub(super) fn budget_headers(a: &Admission) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::with_capacity(a.warnings.len() + 7);
    let text = |out: &mut Vec<_>, name: HeaderName, value: &str| {
        if let Ok(v) = HeaderValue::from_str(value) {
            out.push((name, v));
        }
    };
    if a.downgraded {
        out.push((
            headers::BUDGET_ACTION,
            HeaderValue::from_static("downgraded"),
        ));
    }
    if let Some(m) = a.clamped_to {
        out.push((headers::BUDGET_CLAMPED, HeaderValue::from(m)));
    }
    for w in &a.warnings {
        let value = format!("{} {:.0}% used", w.policy_id, w.used_percent);
        text(&mut out, headers::BUDGET_WARNING, &value);
    }
    if !a.flagged.is_empty() {
        text(&mut out, headers::BUDGET_EXCEEDED, &a.flagged.join(","));
    }
    if let Some(t) = &a.tightest {
        let (policy, reset) = TIGHTEST.with_borrow_mut(|last| last.values(t));
        out.extend(policy.map(|v| (headers::BUDGET_POLICY, v)));
        if let Some(tokens) = t.remaining_tokens {
            out.push((headers::BUDGET_REMAINING_TOKENS, HeaderValue::from(tokens)));
        }
        if let Some(m) = t.remaining_micros {
            text(&mut out, headers::BUDGET_REMAINING_USD, &Usd(m).to_string());
        }
        out.extend(reset.map(|v| (headers::BUDGET_RESET, v)));
    }
    if a.fail_open {
        out.push((headers::BUDGET_MODE, HeaderValue::from_static("fail-open")));
    }
    out
}

/// The tightest budget's policy and reset headers as last made on this thread. The same
/// policy answers request after request until its window ends, so on each worker the two
/// values are formatted (the time as RFC 3339) once per policy and window, not per request.
#[derive(Default)]
struct LastTightest {
    made: Option<(String, Scope, Window, i64)>,
    policy: Option<HeaderValue>,
    reset: Option<HeaderValue>,
}

impl LastTightest {
    fn values(&mut self, t: &Tightest) -> (Option<HeaderValue>, Option<HeaderValue>) {
        let at = t.resets_at.timestamp();
        let same = self
            .made
            .as_ref()
            .is_some_and(|(id, scope, window, reset)| {
                *id == t.policy_id && *scope == t.scope && *window == t.window && *reset == at
            });
        if !same {
            let policy = format!("{} {} {}", t.policy_id, t.scope.label(), t.window.as_str());
            let reset = t.resets_at.to_rfc3339_opts(SecondsFormat::Secs, true);
            self.policy = HeaderValue::from_str(&policy).ok();
            self.reset = HeaderValue::from_str(&reset).ok();
            self.made = Some((t.policy_id.clone(), t.scope.clone(), t.window, at));
        }
        (self.policy.clone(), self.reset.clone())
    }
}

thread_local! {
    static TIGHTEST: std::cell::RefCell<LastTightest> = std::cell::RefCell::default();
}

fn gateway_headers(
    out: &mut HeaderMap,
    pool: &TierPool,
    target: &Target,
    event: &crate::usage::UsageEvent,
) {
    out.insert(headers::TIER, HeaderValue::from_static(pool.tier.as_str()));
    for (name, value) in [
        (headers::REPLICA, target.name_header()),
        (headers::SERVED_MODEL, target.model_header()),
    ] {
        if let Some(v) = value {
            out.insert(name, v);
        }
    }
    out.insert(headers::RETRIES, retries_header(event.retries));
    if let Some(reason) = &event.replica_choice {
        let value = format!(
            "reason={reason} matched_blocks={}",
            event.matched_blocks.unwrap_or(0)
        );
        if let Ok(v) = HeaderValue::from_str(&value) {
            out.insert(headers::REPLICA_CHOICE, v);
        }
    }
}

/// `x-gateway-retries`: the usual counts without an allocation.
fn retries_header(retries: u32) -> HeaderValue {
    match retries {
        0 => HeaderValue::from_static("0"),
        1 => HeaderValue::from_static("1"),
        2 => HeaderValue::from_static("2"),
        n => HeaderValue::from(n),
    }
}

/// The usage of a whole successful answer: as the upstream reported it in `body`, or (when it
/// did not) the prompt and the answer's text counted with the tier's tokenizer
/// ([`counted_usage`]; reading a body of [`crate::tokens::SCAN_INLINE_BYTES`] or more for its
/// text runs off the async workers).
pub(super) async fn answer_usage(
    req: &ParsedRequest,
    tokenizer: &Tokenizer,
    body: &Bytes,
) -> (Usage, UsageSource) {
    if let Some(u) = usage_in_body(body) {
        return (u, UsageSource::Upstream);
    }
    // Rare (the upstream omits `usage`): boxed, so its state does not grow every request's.
    let counted = Box::pin(async {
        let text = tokens::off_workers(body.len(), tokens::SCAN_INLINE_BYTES, || {
            let mut text = String::new();
            if let Ok(v) = serde_json::from_slice::<Value>(body) {
                completion_text(&v, &mut text);
            }
            text
        })
        .await;
        counted_usage(req, tokenizer, &text).await
    });
    (counted.await, UsageSource::Tokenizer)
}

/// An answer's usage counted with the tier's tokenizer (the upstream reported none), bounded
/// as the budget step counts a prompt ([`tokens::count_bounded`]; an agent's earlier messages
/// are remembered), so that a long prompt or answer never stalls the other requests of its
/// lane.
async fn counted_usage(req: &ParsedRequest, tokenizer: &Tokenizer, completion: &str) -> Usage {
    let usage = |prompt_tokens| Usage {
        prompt_tokens,
        completion_tokens: tokenizer.count(completion) as u64,
        cached_tokens: 0,
    };
    tokens::count_bounded(
        |fresh| {
            // The answer's text takes its share of the allowance first.
            *fresh = fresh.checked_sub(completion.len())?;
            req.count_prompt_tokens_within(tokenizer, fresh).map(usage)
        },
        || usage(req.count_prompt_tokens(tokenizer)),
    )
    .await
}

/// A whole (non-streamed) upstream answer with its usage (from [`answer_usage`] when it
/// succeeded): cache fill, settle, respond.
pub(super) fn buffered(
    call: Box<Call>,
    pool: &TierPool,
    lease: &Lease,
    status: StatusCode,
    upstream_headers: &HeaderMap,
    body: Bytes,
    usage: Option<(Usage, UsageSource)>,
) -> Response {
    let Call {
        state,
        ctx,
        mut event,
        reservation,
        cache,
        ..
    } = *call;
    let target = pool.target(lease);
    served_by(&mut event, pool, target);
    event.status = status.as_u16();
    event.latency_ms = ms_since(ctx.started);
    event.ttft_ms = Some(event.latency_ms);
    if status.is_success() {
        if let Some((usage, source)) = usage {
            apply_usage(&mut event, usage, source);
        }
        if let (Some(lookup), true) = (cache, status == StatusCode::OK) {
            let entry = cache_entry(&event, pool, target, body.clone(), lookup.ttl);
            state.cache.fill(lookup, entry, ctx.started.elapsed());
        }
    } else {
        event.error_kind = Some(format!("upstream_{}", status.as_u16()));
    }
    let length = body.len();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    // Room for what this answer and the layers around it add, allocated once.
    headers.reserve(16);
    // The body goes on as it came: the upstream's length header is its length (a shared
    // copy; the framework would write the number out again).
    let same_length = upstream_headers
        .get(header::CONTENT_LENGTH)
        .filter(|v| v.to_str().ok().and_then(|s| s.parse::<usize>().ok()) == Some(length));
    if let Some(v) = same_length {
        headers.insert(header::CONTENT_LENGTH, v.clone());
    }
    let content_type = upstream_headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/json"));
    headers.insert(header::CONTENT_TYPE, content_type);
    // Back-off hints from the upstream are for the client.
    for (name, value) in upstream_headers {
        if name == header::RETRY_AFTER || name.as_str().starts_with("x-ratelimit-") {
            headers.insert(name.clone(), value.clone());
        }
    }
    gateway_headers(headers, pool, target, &event);
    settle(&state, event, reservation);
    response
}

/// A fresh answer as the cache keeps it.
fn cache_entry(
    event: &UsageEvent,
    pool: &TierPool,
    target: &Target,
    body: Bytes,
    ttl: std::time::Duration,
) -> crate::cache::Entry {
    crate::cache::Entry {
        body,
        served_model: target.model.to_string(),
        tier: pool.tier.as_str().to_owned(),
        usage: Usage {
            prompt_tokens: event.prompt_tokens,
            completion_tokens: event.completion_tokens,
            cached_tokens: event.cached_tokens,
        },
        ttl,
    }
}

/// Who answered, on the event: tier, replica and served model.
fn served_by(event: &mut UsageEvent, pool: &TierPool, target: &Target) {
    event.tier = Some(pool.tier.as_str().into());
    event.replica = Some(target.name.clone());
    event.served_model = Some(target.model.clone());
}

fn apply_usage(event: &mut UsageEvent, usage: Usage, source: UsageSource) {
    event.prompt_tokens = usage.prompt_tokens;
    event.completion_tokens = usage.completion_tokens;
    event.cached_tokens = usage.cached_tokens;
    event.usage_source = source;
}

/// A streamed upstream answer: the response streams what a driver task on the tracker forwards;
/// the task settles when the upstream ends (or the client left and the stream was cancelled).
pub(super) fn streamed(
    call: Box<Call>,
    pool: &TierPool,
    lease: Lease,
    resp: UpstreamResponse,
    deadline: Instant,
) -> Response {
    let Call {
        state,
        ctx,
        req,
        mut event,
        reservation,
        cache,
        stream_log,
        ..
    } = *call;
    // Retries that join this stream replay what its client is sent (the log ends with the
    // driver, however it ends).
    let log = stream_log.map(|log| {
        log.attach();
        super::coalesce::LogWriter(log)
    });
    let target = pool.target(&lease);
    served_by(&mut event, pool, target);
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        resp.headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("text/event-stream")),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    gateway_headers(&mut headers, pool, target, &event);

    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let tier = pool.tier;
    let task_state = state.clone();
    state.tasks.spawn(async move {
        let state = task_state;
        let Some(pool) = state.upstreams.tier(tier) else {
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
                    if let (Some(log), false) = (&log, tail.is_empty()) {
                        log.0.push(tail.clone());
                    }
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
                Ok(Some(Ok(chunk))) => match rewriter.push(&chunk) {
                    Ok(out) => out,
                    Err(e) => {
                        tracing::warn!(request_id = %ctx.request_id, error = %e, "upstream stream refused");
                        failure = Some("event_too_large");
                        break;
                    }
                },
            };
            if event.ttft_ms.is_none() && rewriter.events > 0 {
                event.ttft_ms = Some(ms_since(ctx.started));
                pool.record_latency(&lease, router::Signal::FirstToken);
            }
            if out.is_empty() {
                continue;
            }
            if let Some(log) = &log {
                log.0.push(out.clone());
            }
            if client_gone {
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
            let target = pool.target(&lease);
            state
                .metrics
                .upstream_errors
                .with_label_values(&[&*target.name, kind])
                .inc();
            // Tell the client the stream ended abnormally, in the OpenAI error shape.
            let e = ApiError::BadGateway {
                message: format!("the model server stream ended early ({kind})"),
            };
            let chunk = Bytes::from(format!("data: {}\n\n", e.body()));
            if let Some(log) = &log {
                log.0.push(chunk.clone());
            }
            let _ = tx.send(Ok(chunk)).await;
            event.error_kind = Some(format!("stream_{kind}"));
            event.status = StatusCode::BAD_GATEWAY.as_u16();
        }
        // The client's stream ends (`tx` dropped) only once the call is settled: a client that
        // sends its next request as soon as this one ends finds this turn answered in the
        // guard's session (a repeat, not a retry) and, with in-process budgets, its cost
        // committed (a Redis commit may still be on its way).
        let usage = match rewriter.usage {
            Some(u) => (u, UsageSource::Upstream),
            None => (
                counted_usage(&req, &pool.tokenizer, &rewriter.text).await,
                UsageSource::Tokenizer,
            ),
        };
        apply_usage(&mut event, usage.0, usage.1);
        let assembled = match (failure, rewriter.done, rewriter.assembler.take()) {
            (None, true, Some(a)) => a.finish(),
            _ => None,
        };
        if let (Some(lookup), Some(body)) = (cache, assembled) {
            let target = pool.target(&lease);
            let entry = cache_entry(&event, pool, target, body, lookup.ttl);
            state.cache.fill(lookup, entry, ctx.started.elapsed());
        }
        if client_gone {
            event.client_disconnected = true;
            event.status = CLIENT_CLOSED;
        }
        event.latency_ms = ms_since(ctx.started);
        // Joined retries end with the stream, before its settlement.
        drop(log);
        drop(lease);
        settle(&state, event, reservation);
        drop(tx);
    });

    let mut response = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn header<'a>(out: &'a [(HeaderName, HeaderValue)], name: &HeaderName) -> Option<&'a str> {
        out.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.to_str().ok())
    }

    /// An answer without `usage` to a long prompt: counting it leaves the lane's one worker
    /// free for its other tasks (here a ticker), and counts what the tokenizer counts.
    #[test]
    fn a_long_count_for_an_answer_without_usage_leaves_the_async_worker() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // Made-up words (each needs BPE merges), new to this process's remembered counts.
        let mut x = u64::from(std::process::id());
        let prompt: String = (0..60_000)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                format!("{:x} ", x >> 36)
            })
            .collect();
        let body = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": prompt}]});
        let req = ParsedRequest::parse_bytes(
            crate::openai::Endpoint::Chat,
            Bytes::from(body.to_string()),
        )
        .unwrap();
        let answer = Bytes::from_static(
            br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"four words of answer"}}]}"#,
        );
        // The vocabulary loaded (once per process, ~0.2 s in a debug build) before the clock.
        let tokenizer = Tokenizer::default();
        assert_eq!(tokenizer.count("warm"), 1);
        let (usage, source, took, worst) = rt.block_on(async move {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let ticker = tokio::spawn({
                let stop = stop.clone();
                async move {
                    let mut worst = std::time::Duration::ZERO;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        let t = Instant::now();
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        worst = worst.max(t.elapsed());
                    }
                    worst
                }
            });
            // Counted on the worker (a task), as the pipeline counts.
            let counted = tokio::spawn(async move {
                let started = Instant::now();
                let (usage, source) = answer_usage(&req, &tokenizer, &answer).await;
                let took = started.elapsed();
                assert_eq!(usage.prompt_tokens, req.count_prompt_tokens(&tokenizer));
                (usage, source, took)
            })
            .await
            .unwrap();
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let worst = ticker.await.unwrap();
            (counted.0, counted.1, counted.2, worst)
        });
        assert_eq!(source, UsageSource::Tokenizer);
        assert_eq!(usage.completion_tokens, 4);
        assert!(usage.prompt_tokens > 60_000, "{usage:?}");
        assert!(
            worst < took / 2,
            "the ticker waited up to {worst:?} while the count took {took:?}"
        );
    }

    #[test]
    fn the_tightest_budgets_headers_follow_its_policy_and_window_request_after_request() {
        let day = |d: u32| chrono::Utc.with_ymd_and_hms(2026, 12, d, 0, 0, 0).unwrap();
        let admission = |id: &str, scope: Scope, window: Window, resets_at, tokens| Admission {
            clamped_to: Some(64),
            tightest: Some(Tightest {
                policy_id: id.to_owned(),
                scope,
                window,
                remaining_tokens: tokens,
                remaining_micros: Some(1_500_000),
                resets_at,
            }),
            ..Admission::default()
        };
        let key = Scope::Key("k1".to_owned());
        // Each change of policy, scope, window or reset is seen; the same one again reads the
        // values made the first time.
        let cases = [
            (
                admission("p1", Scope::Tenant, Window::Day, day(6), Some(10)),
                "p1 tenant day",
                "2026-12-06T00:00:00Z",
                Some("10"),
            ),
            (
                admission("p1", Scope::Tenant, Window::Day, day(6), Some(9)),
                "p1 tenant day",
                "2026-12-06T00:00:00Z",
                Some("9"),
            ),
            (
                admission("p1", Scope::Tenant, Window::Day, day(7), None),
                "p1 tenant day",
                "2026-12-07T00:00:00Z",
                None,
            ),
            (
                admission("p2", Scope::Tenant, Window::Day, day(7), None),
                "p2 tenant day",
                "2026-12-07T00:00:00Z",
                None,
            ),
            (
                admission("p2", key.clone(), Window::Day, day(7), None),
                "p2 key:k1 day",
                "2026-12-07T00:00:00Z",
                None,
            ),
            (
                admission("p2", key, Window::Month, day(7), None),
                "p2 key:k1 month",
                "2026-12-07T00:00:00Z",
                None,
            ),
            (
                admission("p1", Scope::Tenant, Window::Day, day(6), Some(8)),
                "p1 tenant day",
                "2026-12-06T00:00:00Z",
                Some("8"),
            ),
        ];
        for (a, policy, reset, tokens) in cases {
            let out = budget_headers(&a);
            assert_eq!(header(&out, &headers::BUDGET_POLICY), Some(policy));
            assert_eq!(header(&out, &headers::BUDGET_RESET), Some(reset));
            assert_eq!(header(&out, &headers::BUDGET_REMAINING_TOKENS), tokens);
            assert_eq!(
                header(&out, &headers::BUDGET_REMAINING_USD),
                Some("1.500000")
            );
            assert_eq!(header(&out, &headers::BUDGET_CLAMPED), Some("64"));
        }
        assert!(budget_headers(&Admission::default()).is_empty());
    }
}
