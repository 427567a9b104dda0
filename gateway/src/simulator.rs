//! **Backend simulator**: an OpenAI-compatible server that behaves like a GPU model server, for
//! demos, tests and benchmarks. It is not a model: its text is filler.
//!
//! Timing follows a model server's shape: time to first token grows with the prompt tokens *not*
//! already in its prefix cache (an LRU of chained prompt block hashes, as vLLM keys its KV
//! blocks), then a steady per-token decode time. Usage is reported like vLLM does, including
//! `prompt_tokens_details.cached_tokens`. Faults (5xx, latency spikes) can be injected at random,
//! on demand through `POST /sim/faults`, or on a schedule ([`FaultWindow`]: from a time after the
//! start, for a while, answer a status, answer slowly, or hang), so a storm can be reproduced;
//! `GET /sim/stats` reports the requests received, those a fault answered, the batch's running
//! and waiting requests (and the deepest its queue got), and the last request body.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use router::{prefix_block_hashes, PrefixLru};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::tokens::{push_text, Tokenizer};

/// Timing and cache shape of a simulated model server.
#[derive(Debug, Clone, PartialEq)]
pub struct SimProfile {
    /// Profile name (`small`, `large`, `zero`).
    pub name: String,
    /// Model name served (requests naming another model get 404).
    pub model: String,
    /// Fixed overhead before the first token, ms.
    pub base_ms: f64,
    /// Prefill time per uncached prompt token, µs.
    pub prefill_us_per_token: f64,
    /// Decode time per generated token, ms.
    pub decode_ms_per_token: f64,
    /// Tokens per prefix-cache block.
    pub block_size: usize,
    /// Blocks the prefix cache holds.
    pub cache_blocks: usize,
    /// Completion length when the request sets no `max_tokens`.
    pub default_max_tokens: u32,
    /// Sequences generated at once (continuous batching); more requests wait in a queue, as
    /// vLLM's `max_num_seqs`.
    pub max_running: usize,
    /// How much slower prefill and each decode step get with a full batch: the time is
    /// multiplied by `1 + batch_slowdown × running / max_running`.
    pub batch_slowdown: f64,
}

impl SimProfile {
    /// A small, fast model (think 8B on one GPU).
    pub fn small() -> Self {
        Self {
            name: "small".into(),
            model: "sim-small".into(),
            base_ms: 8.0,
            prefill_us_per_token: 60.0,
            decode_ms_per_token: 8.0,
            block_size: 16,
            cache_blocks: 4096,
            default_max_tokens: 24,
            max_running: 64,
            batch_slowdown: 1.0,
        }
    }

    /// A large, slower model (think 70B).
    pub fn large() -> Self {
        Self {
            name: "large".into(),
            model: "sim-large".into(),
            base_ms: 20.0,
            prefill_us_per_token: 250.0,
            decode_ms_per_token: 25.0,
            block_size: 16,
            cache_blocks: 4096,
            default_max_tokens: 24,
            max_running: 64,
            batch_slowdown: 1.0,
        }
    }

    /// No latency at all: for measuring the gateway's own overhead.
    pub fn zero() -> Self {
        Self {
            name: "zero".into(),
            model: "sim-zero".into(),
            base_ms: 0.0,
            prefill_us_per_token: 0.0,
            decode_ms_per_token: 0.0,
            block_size: 16,
            cache_blocks: 4096,
            default_max_tokens: 16,
            max_running: 4096,
            batch_slowdown: 0.0,
        }
    }

    /// Profile by name.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "small" => Some(Self::small()),
            "large" => Some(Self::large()),
            "zero" => Some(Self::zero()),
            _ => None,
        }
    }
}

/// What a scheduled fault does to each request in its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduledFault {
    /// Answer this HTTP status (an OpenAI-style error body).
    Status(u16),
    /// Answer normally, after this extra delay.
    Slow(Duration),
    /// Never answer (until the client gives up and closes the connection).
    Hang,
}

/// A window of the simulator's life in which every request gets `fault`: from `after` (since
/// the simulator started, or since a `POST /sim/faults` that set it) for `length`. Written
/// `5s+10s=503`, `20s+15s=slow:3s`, `40s+5s=hang` (durations in `ms`, `s` or `m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultWindow {
    /// When it starts.
    pub after: Duration,
    /// How long it lasts.
    pub length: Duration,
    /// What it does.
    pub fault: ScheduledFault,
}

/// Parse `500ms`, `5s`, `1.5s` or `2m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => return Err(format!("`{s}`: give a unit (ms, s or m)")),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("`{s}`: not a number of {unit}"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("`{s}`: the unit must be ms, s or m")),
    };
    if !(0.0..=86_400.0 * 365.0).contains(&secs) {
        return Err(format!("`{s}`: out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl std::str::FromStr for FaultWindow {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let form = "write AFTER+FOR=WHAT, e.g. 5s+10s=503, 20s+15s=slow:3s or 40s+5s=hang";
        let (when, what) = s.split_once('=').ok_or_else(|| format!("`{s}`: {form}"))?;
        let (after, length) = when
            .split_once('+')
            .ok_or_else(|| format!("`{s}`: {form}"))?;
        let fault = match what.trim() {
            "hang" => ScheduledFault::Hang,
            w => match w.strip_prefix("slow:") {
                Some(d) => ScheduledFault::Slow(parse_duration(d)?),
                None => match w.parse::<u16>() {
                    Ok(code) if (400..=599).contains(&code) => ScheduledFault::Status(code),
                    _ => {
                        return Err(format!(
                            "`{s}`: the fault is a status 400-599, slow:DURATION or hang"
                        ))
                    }
                },
            },
        };
        Ok(Self {
            after: parse_duration(after)?,
            length: parse_duration(length)?,
            fault,
        })
    }
}

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Timing profile.
    pub profile: SimProfile,
    /// Report `usage` (off: behave like a server that never reports it).
    pub report_usage: bool,
    /// Probability of answering 500 instead of serving.
    pub error_rate: f64,
    /// Probability of an added latency spike.
    pub spike_rate: f64,
    /// Size of a latency spike, ms.
    pub spike_ms: u64,
    /// Fault windows, from the simulator's start.
    pub schedule: Vec<FaultWindow>,
}

impl SimOptions {
    /// Defaults for a profile: usage on, no faults.
    pub fn new(profile: SimProfile) -> Self {
        Self {
            profile,
            report_usage: true,
            error_rate: 0.0,
            spike_rate: 0.0,
            spike_ms: 0,
            schedule: Vec::new(),
        }
    }
}

/// A scheduled fault window in absolute time.
#[derive(Debug, Clone, Copy)]
struct Window {
    from: Instant,
    until: Instant,
    fault: ScheduledFault,
}

fn windows(start: Instant, schedule: &[FaultWindow]) -> Vec<Window> {
    schedule
        .iter()
        .map(|w| Window {
            from: start + w.after,
            until: start + w.after + w.length,
            fault: w.fault,
        })
        .collect()
}

/// The fault a request received at `now` gets from the schedule: the first window it falls in.
fn scheduled(windows: &[Window], now: Instant) -> Option<ScheduledFault> {
    windows
        .iter()
        .find(|w| w.from <= now && now < w.until)
        .map(|w| w.fault)
}

/// A running simulator's state.
#[derive(Debug)]
pub struct Simulator {
    options: SimOptions,
    tokenizer: Tokenizer,
    cache: Mutex<PrefixLru>,
    requests: AtomicU64,
    fail_next: AtomicU32,
    fail_status: AtomicU32,
    delay_next: AtomicU32,
    delay_ms: AtomicU64,
    last_request: Mutex<Value>,
    schedule: Mutex<Vec<Window>>,
    /// Requests a fault answered (injected status, scheduled status, slow, hang).
    faulted: [AtomicU64; 4],
    /// Batch slots (`max_running`).
    slots: Arc<tokio::sync::Semaphore>,
    /// Requests generating now.
    running: Arc<AtomicU64>,
    /// Requests waiting for a batch slot.
    waiting: AtomicU64,
    /// The most requests that waited at once (how deep the server's queue got).
    peak_waiting: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
}

/// A batch slot held for one request's generation.
struct Running {
    _permit: tokio::sync::OwnedSemaphorePermit,
    running: Arc<AtomicU64>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Indexes of [`Simulator::faulted`].
const FAULT_KINDS: [&str; 4] = ["status", "scheduled_status", "slow", "hang"];

const WORDS: &[&str] = &[
    " The",
    " gateway",
    " simulator",
    " returns",
    " filler",
    " text",
    " so",
    " that",
    " tests",
    " and",
    " demos",
    " can",
    " measure",
    " timing",
    " tokens",
    " and",
    " cost",
    " without",
    " a",
    " real",
    " model",
    ".",
];

impl Simulator {
    /// A simulator with empty caches.
    pub fn new(options: SimOptions) -> Arc<Self> {
        let tokenizer = Tokenizer::default();
        tokenizer.warm();
        let schedule = Mutex::new(windows(Instant::now(), &options.schedule));
        let options_slots = options.profile.max_running.max(1);
        Arc::new(Self {
            cache: Mutex::new(PrefixLru::new(options.profile.cache_blocks)),
            options,
            tokenizer,
            requests: AtomicU64::new(0),
            fail_next: AtomicU32::new(0),
            fail_status: AtomicU32::new(500),
            delay_next: AtomicU32::new(0),
            delay_ms: AtomicU64::new(0),
            last_request: Mutex::new(Value::Null),
            schedule,
            faulted: Default::default(),
            slots: Arc::new(tokio::sync::Semaphore::new(options_slots)),
            running: Arc::new(AtomicU64::new(0)),
            waiting: AtomicU64::new(0),
            peak_waiting: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
        })
    }

    /// Replace the fault schedule, its windows counted from now.
    pub fn set_schedule(&self, schedule: &[FaultWindow]) {
        *self.schedule.lock().unwrap_or_else(|p| p.into_inner()) =
            windows(Instant::now(), schedule);
    }

    /// Requests a fault answered, by kind (`status` injected by `fail_next` or `error_rate`,
    /// `scheduled_status`, `slow`, `hang`).
    pub fn faulted(&self) -> Vec<(&'static str, u64)> {
        FAULT_KINDS
            .iter()
            .zip(&self.faulted)
            .map(|(k, n)| (*k, n.load(Ordering::Relaxed)))
            .collect()
    }

    fn count_fault(&self, kind: usize) {
        self.faulted[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests received so far (all endpoints but `/sim/*`).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Tokens of the prompt already in the prefix cache; the prompt's blocks become most recent.
    fn prefill(&self, tokens: &[u32]) -> usize {
        let chain = prefix_block_hashes(tokens, self.options.profile.block_size);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let hit = cache.matched_prefix(&chain);
        cache.touch(&chain);
        let hit = hit * self.options.profile.block_size;
        self.prefix_queries
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        self.prefix_hits.fetch_add(hit as u64, Ordering::Relaxed);
        hit
    }

    /// Wait for a batch slot (counted as waiting meanwhile), then hold it while generating.
    async fn run(&self) -> Running {
        let waiting = self.waiting.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak_waiting.fetch_max(waiting, Ordering::AcqRel);
        let permit = Arc::clone(&self.slots).acquire_owned().await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        self.running.fetch_add(1, Ordering::AcqRel);
        Running {
            // The semaphore is never closed.
            _permit: permit.unwrap_or_else(|_| unreachable!("simulator slots closed")),
            running: Arc::clone(&self.running),
        }
    }

    /// The batch's slowdown factor now.
    fn slowdown(&self) -> f64 {
        let p = &self.options.profile;
        let running = self.running.load(Ordering::Acquire) as f64;
        1.0 + p.batch_slowdown.max(0.0) * running / p.max_running.max(1) as f64
    }

    /// vLLM-compatible metrics (`/metrics`): running and waiting requests, KV-cache use (the
    /// prefix cache's share of its blocks), prefix-cache queries and hits in tokens.
    pub fn metrics_text(&self) -> String {
        let model = &self.options.profile.model;
        let used = self.cache.lock().map(|c| c.len()).unwrap_or_default() as f64
            / self.options.profile.cache_blocks.max(1) as f64;
        let mut out = String::new();
        for (name, kind, help, value) in [
            (
                "vllm:num_requests_running",
                "gauge",
                "Requests in the batch.",
                self.running.load(Ordering::Acquire).to_string(),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Requests waiting for a batch slot.",
                self.waiting.load(Ordering::Acquire).to_string(),
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "KV-cache usage (1 = full).",
                format!("{used:.6}"),
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                self.prefix_queries.load(Ordering::Relaxed).to_string(),
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                self.prefix_hits.load(Ordering::Relaxed).to_string(),
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help} (SIMULATED)\n# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {value}\n"
            ));
        }
        out
    }

    /// Injected fault for this request, if any: `Err(status)` to fail, `Ok(extra delay)` (a
    /// hang is a delay of a day: the client gives up first).
    fn fault(&self) -> Result<Duration, StatusCode> {
        let take = |counter: &AtomicU32| {
            counter
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
        };
        let status =
            |code: u16| StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if take(&self.fail_next) {
            self.count_fault(0);
            let code = u16::try_from(self.fail_status.load(Ordering::Relaxed)).unwrap_or(500);
            return Err(status(code));
        }
        let o = &self.options;
        if o.error_rate > 0.0 && rand::random::<f64>() < o.error_rate {
            self.count_fault(0);
            return Err(StatusCode::INTERNAL_SERVER_ERROR);
        }
        let now = Instant::now();
        let planned = scheduled(
            &self.schedule.lock().unwrap_or_else(|p| p.into_inner()),
            now,
        );
        let mut delay = Duration::ZERO;
        match planned {
            Some(ScheduledFault::Status(code)) => {
                self.count_fault(1);
                return Err(status(code));
            }
            Some(ScheduledFault::Slow(d)) => {
                self.count_fault(2);
                delay += d;
            }
            Some(ScheduledFault::Hang) => {
                self.count_fault(3);
                return Ok(Duration::from_secs(86_400));
            }
            None => {}
        }
        if take(&self.delay_next) {
            delay += Duration::from_millis(self.delay_ms.load(Ordering::Relaxed));
        }
        if o.spike_rate > 0.0 && rand::random::<f64>() < o.spike_rate {
            delay += Duration::from_millis(o.spike_ms);
        }
        Ok(delay)
    }

    fn ttft(&self, prompt_tokens: usize, cached: usize) -> Duration {
        let p = &self.options.profile;
        let ms = p.base_ms
            + (prompt_tokens.saturating_sub(cached) as f64) * p.prefill_us_per_token / 1000.0
                * self.slowdown();
        Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }

    fn decode_step(&self) -> Duration {
        let ms = self.options.profile.decode_ms_per_token.max(0.0) * self.slowdown();
        Duration::from_secs_f64(ms / 1000.0)
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "simulator_error", "param": null, "code": null}})))
        .into_response()
}

/// The simulator's routes.
pub fn router(sim: Arc<Simulator>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/sim/faults", post(set_faults))
        .route("/sim/stats", get(stats))
        .route(
            "/metrics",
            get(|State(sim): State<Arc<Simulator>>| async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    sim.metrics_text(),
                )
            }),
        )
        .route("/health", get(|| async { "ok" }))
        // Prompts as long as the gateway accepts (axum's default stops at 2 MiB; vLLM has no
        // such limit of its own).
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(sim)
}

/// Serve the simulator on `listener` until the process ends.
pub async fn serve(listener: TcpListener, sim: Arc<Simulator>) -> std::io::Result<()> {
    axum::serve(listener, router(sim)).await
}

/// Bind `127.0.0.1:port` (0 = any free port) and serve in the background; returns the address.
pub async fn spawn(
    options: SimOptions,
    port: u16,
) -> std::io::Result<(std::net::SocketAddr, Arc<Simulator>)> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    let sim = Simulator::new(options);
    let served = Arc::clone(&sim);
    tokio::spawn(async move {
        if let Err(e) = serve(listener, served).await {
            tracing::error!(error = %e, "simulator stopped");
        }
    });
    Ok((addr, sim))
}

#[derive(Deserialize)]
struct Faults {
    #[serde(default)]
    fail_next: u32,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    delay_next: u32,
    #[serde(default)]
    delay_ms: u64,
    /// Replace the fault schedule (windows counted from now): `["0s+10s=503", "10s+5s=hang"]`.
    #[serde(default)]
    schedule: Option<Vec<String>>,
}

async fn set_faults(
    State(sim): State<Arc<Simulator>>,
    Json(f): Json<Faults>,
) -> Result<Json<Value>, Response> {
    if let Some(schedule) = &f.schedule {
        let parsed: Result<Vec<FaultWindow>, String> = schedule.iter().map(|w| w.parse()).collect();
        let parsed =
            parsed.map_err(|e| error(StatusCode::BAD_REQUEST, &format!("schedule: {e}")))?;
        sim.set_schedule(&parsed);
    }
    sim.fail_next.store(f.fail_next, Ordering::Release);
    sim.fail_status
        .store(u32::from(f.status.unwrap_or(500)), Ordering::Release);
    sim.delay_ms.store(f.delay_ms, Ordering::Release);
    sim.delay_next.store(f.delay_next, Ordering::Release);
    Ok(Json(json!({"ok": true})))
}

async fn stats(State(sim): State<Arc<Simulator>>) -> Json<Value> {
    let last = sim
        .last_request
        .lock()
        .map(|v| v.clone())
        .unwrap_or(Value::Null);
    let faulted: serde_json::Map<String, Value> = sim
        .faulted()
        .into_iter()
        .map(|(k, n)| (k.to_owned(), json!(n)))
        .collect();
    Json(json!({
        "requests": sim.requests(),
        "faulted": faulted,
        "running": sim.running.load(Ordering::Acquire),
        "waiting": sim.waiting.load(Ordering::Acquire),
        "peak_waiting": sim.peak_waiting.load(Ordering::Acquire),
        "prefix_cache_queries": sim.prefix_queries.load(Ordering::Relaxed),
        "prefix_cache_hits": sim.prefix_hits.load(Ordering::Relaxed),
        "profile": sim.options.profile.name,
        "last_request": last,
    }))
}

async fn models(State(sim): State<Arc<Simulator>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": sim.options.profile.model, "object": "model", "created": 0, "owned_by": "simulator"}]}),
    )
}

/// Checks shared by the generating endpoints; returns the parsed body.
async fn admit(sim: &Simulator, body: &Bytes) -> Result<Value, Response> {
    sim.requests.fetch_add(1, Ordering::Relaxed);
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")))?;
    if let Ok(mut last) = sim.last_request.lock() {
        *last = value.clone();
    }
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if model != sim.options.profile.model {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
        ));
    }
    match sim.fault() {
        Err(status) => Err(error(status, "injected fault")),
        Ok(delay) => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            Ok(value)
        }
    }
}

fn words(n: u32, seed: usize) -> Vec<&'static str> {
    (0..n as usize)
        .map(|i| WORDS[(seed + i) % WORDS.len()])
        .collect()
}

struct Generation {
    prompt_tokens: usize,
    cached: usize,
    pieces: Vec<&'static str>,
    stream: bool,
    include_usage: bool,
}

impl Generation {
    fn usage(&self, tokenizer: &Tokenizer) -> Value {
        let completion = tokenizer.count(&self.pieces.concat());
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

fn plan(sim: &Simulator, body: &Value, prompt_tokens: Vec<u32>, counted: usize) -> Generation {
    let cached = sim.prefill(&prompt_tokens).min(counted);
    let max = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(sim.options.profile.default_max_tokens, |m| {
            u32::try_from(m).unwrap_or(u32::MAX)
        })
        .min(sim.options.profile.default_max_tokens.max(1) * 8);
    Generation {
        prompt_tokens: counted,
        cached,
        pieces: words(max, counted),
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    }
}

async fn chat(State(sim): State<Arc<Simulator>>, body: Bytes) -> Response {
    let body = match admit(&sim, &body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut text = String::new();
    for m in &messages {
        if let Some(c) = m.get("content") {
            push_text(c, &mut text);
        }
    }
    let counted = sim
        .tokenizer
        .count_chat(&crate::openai::Message::of_values(&messages));
    let g = plan(&sim, &body, sim.tokenizer.encode(&text), counted);
    generate(sim, g, true).await
}

async fn completions(State(sim): State<Arc<Simulator>>, body: Bytes) -> Response {
    let body = match admit(&sim, &body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let mut text = String::new();
    if let Some(p) = body.get("prompt") {
        push_text(p, &mut text);
    }
    let tokens = sim.tokenizer.encode(&text);
    let counted = tokens.len();
    let g = plan(&sim, &body, tokens, counted);
    generate(sim, g, false).await
}

async fn generate(sim: Arc<Simulator>, g: Generation, chat: bool) -> Response {
    let id = format!("sim-{}", sim.requests());
    let model = sim.options.profile.model.clone();
    let created = chrono::Utc::now().timestamp();
    let usage = sim.options.report_usage.then(|| g.usage(&sim.tokenizer));
    // Continuous batching: wait for a slot, then prefill and decode at the batch's pace.
    let slot = sim.run().await;
    let ttft = sim.ttft(g.prompt_tokens, g.cached);
    if !g.stream {
        tokio::time::sleep(ttft).await;
        for _ in 0..g.pieces.len() {
            let step = sim.decode_step();
            if !step.is_zero() {
                tokio::time::sleep(step).await;
            }
        }
        drop(slot);
        let text = g.pieces.concat();
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        let mut out = json!({
            "id": id, "object": if chat { "chat.completion" } else { "text_completion" },
            "created": created, "model": model, "choices": [choice],
        });
        if let Some(u) = usage {
            out["usage"] = u;
        }
        return Json(out).into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        let _slot = slot;
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choices: Value, usage: Option<&Value>| {
            let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
            if g.include_usage {
                c["usage"] = usage.cloned().unwrap_or(Value::Null);
            }
            Bytes::from(format!("data: {c}\n\n"))
        };
        tokio::time::sleep(ttft).await;
        if chat {
            let first = chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
                None,
            );
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
        }
        let last = g.pieces.len().saturating_sub(1);
        for (i, piece) in g.pieces.iter().enumerate() {
            let step = sim.decode_step();
            if i > 0 && !step.is_zero() {
                tokio::time::sleep(step).await;
            }
            let finish = if i == last {
                json!("length")
            } else {
                Value::Null
            };
            let choice = if chat {
                json!([{"index": 0, "delta": {"content": piece}, "finish_reason": finish}])
            } else {
                json!([{"index": 0, "text": piece, "finish_reason": finish}])
            };
            if tx.send(Ok(chunk(choice, None))).await.is_err() {
                return; // client went away: stop generating, like vLLM aborts the request
            }
        }
        if g.include_usage {
            if let Some(u) = &usage {
                let _ = tx.send(Ok(chunk(json!([]), Some(u)))).await;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed"))
}

/// Dimensions of simulated embeddings.
const EMBED_DIM: usize = 32;

fn pseudo_embedding(tokens: &[u32]) -> Vec<f32> {
    let mut v = vec![0f32; EMBED_DIM];
    for &t in tokens {
        let mut x = u64::from(t).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for slot in v.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *slot += ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
        }
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

async fn embeddings(State(sim): State<Arc<Simulator>>, body: Bytes) -> Response {
    let body = match admit(&sim, &body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let inputs: Vec<Vec<u32>> = match body.get("input") {
        Some(Value::String(s)) => vec![sim.tokenizer.encode(s)],
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![items
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| t as u32)
                .collect()]
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => sim.tokenizer.encode(s),
                Value::Array(ts) => ts
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect(),
                _ => Vec::new(),
            })
            .collect(),
        _ => return error(StatusCode::BAD_REQUEST, "`input` is required"),
    };
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"object": "embedding", "index": i, "embedding": pseudo_embedding(t)}))
        .collect();
    let mut out = json!({"object": "list", "data": data, "model": sim.options.profile.model});
    if sim.options.report_usage {
        out["usage"] = json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens});
    }
    Json(out).into_response()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn a_cached_prefix_shortens_time_to_first_token() {
        let sim = Simulator::new(SimOptions::new(SimProfile::large()));
        let prompt: Vec<u32> = (0..320).collect();
        assert_eq!(sim.prefill(&prompt), 0, "cold cache");
        let cold = sim.ttft(320, 0);
        assert_eq!(sim.prefill(&prompt), 320, "all 20 blocks cached");
        let warm = sim.ttft(320, 320);
        assert!(warm < cold / 2, "warm {warm:?} vs cold {cold:?}");
    }

    #[tokio::test]
    async fn a_full_batch_queues_requests_and_slows_decoding_and_metrics_say_so() {
        let mut p = SimProfile::small();
        p.max_running = 2;
        p.batch_slowdown = 1.0;
        let sim = Simulator::new(SimOptions::new(p));
        let alone = sim.decode_step();
        let a = sim.run().await;
        let b = sim.run().await;
        // A full batch: each step takes twice as long, and the next request waits.
        assert_eq!(sim.decode_step(), alone * 2);
        let waiter = {
            let sim = Arc::clone(&sim);
            tokio::spawn(async move { sim.run().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let text = sim.metrics_text();
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"sim-small\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("vllm:num_requests_waiting{model_name=\"sim-small\"} 1"),
            "{text}"
        );
        drop(a);
        let c = waiter.await.unwrap();
        assert!(sim
            .metrics_text()
            .contains("vllm:num_requests_waiting{model_name=\"sim-small\"} 0"));
        drop((b, c));
        assert_eq!(sim.running.load(Ordering::Acquire), 0);
        // Prefix-cache counters and KV-cache use, in tokens and as a share of the blocks.
        let prompt: Vec<u32> = (0..320).collect();
        sim.prefill(&prompt);
        sim.prefill(&prompt);
        let text = sim.metrics_text();
        assert!(
            text.contains("vllm:prefix_cache_queries_total{model_name=\"sim-small\"} 640"),
            "{text}"
        );
        assert!(
            text.contains("vllm:prefix_cache_hits_total{model_name=\"sim-small\"} 320"),
            "{text}"
        );
        assert!(
            text.contains("vllm:gpu_cache_usage_perc{model_name=\"sim-small\"} 0.004883"),
            "{text}"
        );
    }

    #[test]
    fn fault_windows_parse_and_say_what_is_wrong() {
        let w: FaultWindow = "5s+10s=503".parse().unwrap();
        assert_eq!(
            w,
            FaultWindow {
                after: Duration::from_secs(5),
                length: Duration::from_secs(10),
                fault: ScheduledFault::Status(503),
            }
        );
        let w: FaultWindow = "1.5s+500ms=slow:2m".parse().unwrap();
        assert_eq!(w.after, Duration::from_millis(1500));
        assert_eq!(w.fault, ScheduledFault::Slow(Duration::from_secs(120)));
        assert_eq!(
            "0s+1m=hang".parse::<FaultWindow>().unwrap().fault,
            ScheduledFault::Hang
        );
        for (bad, says) in [
            ("5s=503", "AFTER+FOR=WHAT"),
            ("5+10s=503", "unit"),
            ("5s+10s=200", "400-599"),
            ("5s+10s=slow:fast", "not a number"),
            ("5h+1s=hang", "ms, s or m"),
        ] {
            let e = bad.parse::<FaultWindow>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn a_schedule_fails_slows_and_hangs_requests_in_its_windows_only() {
        let sim = Simulator::new(SimOptions::new(SimProfile::zero()));
        sim.set_schedule(&[
            "0ms+150ms=503".parse().unwrap(),
            "150ms+150ms=slow:40ms".parse().unwrap(),
            "300ms+150ms=hang".parse().unwrap(),
        ]);
        assert_eq!(sim.fault(), Err(StatusCode::SERVICE_UNAVAILABLE));
        tokio::time::sleep(Duration::from_millis(170)).await;
        assert_eq!(sim.fault(), Ok(Duration::from_millis(40)));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(
            sim.fault().unwrap() >= Duration::from_secs(3600),
            "a hang never answers"
        );
        tokio::time::sleep(Duration::from_millis(170)).await;
        assert_eq!(sim.fault(), Ok(Duration::ZERO), "after the schedule");
        let counts: std::collections::BTreeMap<_, _> = sim.faulted().into_iter().collect();
        assert_eq!(counts["scheduled_status"], 1);
        assert_eq!(counts["slow"], 1);
        assert_eq!(counts["hang"], 1);
        assert_eq!(counts["status"], 0);
    }

    #[test]
    fn pseudo_embeddings_are_unit_length_and_deterministic() {
        let a = pseudo_embedding(&[1, 2, 3]);
        assert_eq!(a, pseudo_embedding(&[1, 2, 3]));
        let n: f32 = a.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
    }
}
