//! The response cache: an exact layer (hash of the canonical request) and a semantic layer
//! (nearest stored question in the same namespace, confirmed by the verifier).
//!
//! - Only what the tenant's [`CachePolicy`] marks cacheable is looked up or stored (default:
//!   `temperature: 0`, no tools); `Cache-Control: no-cache` skips the lookup (the fresh answer
//!   is still stored), `no-store` bypasses the cache both ways.
//! - Nothing is shared across tenants: the tenant id is part of every key and namespace.
//! - The semantic layer only ever matches within a namespace: tenant, endpoint, client model,
//!   every parameter but the last user message (so system prompt, tools, sampling parameters and
//!   the earlier conversation must be identical), and answers only above the verifier threshold
//!   for the tenant's precision target.
//! - With `cache.redis_urls`, answers are also shared through Redis ([`shared`]), so a repeat
//!   hits on every replica.
//! - Responses live in the exact layer (bounded in bytes, per-entry time to live); the semantic
//!   index points at exact-layer keys, so an expired answer is gone for both layers.
//!
//! The pipeline calls [`Cache::plan`], then [`Cache::lookup`] before the budget step, and
//! [`Cache::fill`] when a fresh answer completed.

pub mod calibration;
pub mod semantic;
pub mod shared;
pub mod tools;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use embedder::gate::Near;
use serde_json::{Map, Value};

use crate::config::CacheConfig;
use crate::metrics::Metrics;
use crate::openai::{Endpoint, ParsedRequest, Usage};
use crate::store::{Store, StoreError, TenantPolicies};
use crate::tasks::Background;
use crate::usage::CacheStatus;

pub use crate::types::cache::{CacheMode, CachePolicy};

/// What the client said in `Cache-Control`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Directives {
    /// `no-cache`: do not answer from the cache (a fresh answer is still stored).
    pub no_cache: bool,
    /// `no-store`: neither answer from nor store into the cache.
    pub no_store: bool,
}

impl Directives {
    /// Read `Cache-Control` directives (case-insensitive, comma-separated).
    pub fn parse(value: Option<&str>) -> Self {
        let mut d = Self::default();
        for part in value.unwrap_or_default().split(',') {
            match part.trim().to_ascii_lowercase().as_str() {
                "no-cache" => d.no_cache = true,
                "no-store" => d.no_store = true,
                _ => {}
            }
        }
        d
    }
}

/// A cached answer.
#[derive(Debug)]
pub struct Entry {
    /// The non-streamed response body.
    pub body: Bytes,
    /// The model that produced it.
    pub served_model: String,
    /// Its tier.
    pub tier: String,
    /// What producing it consumed (what a hit saves).
    pub usage: Usage,
    /// Time to live.
    pub ttl: Duration,
}

/// A stored answer's share of memory beyond its body and names: the map's node and key and the
/// entry's own allocations (~433 bytes requested per answer, measured with a counting allocator
/// over 50,000 answers of 100 to 8,000 bytes), plus the allocator's rounding, ~8% of it all
/// (the body's share counted as a sixteenth of it). The gateway's resident size under load grew
/// within ~3% of this count (`MEMORY=1 bench/cache-throughput.sh`, docs/benchmarks.md);
/// `tests/tests/cache_memory.rs` checks it against the heap the real layer holds.
const ENTRY_OVERHEAD: usize = 480;

impl Entry {
    /// The entry with its body in an allocation of its own. The body as read is a view into
    /// the connection's read buffer (kilobytes for an answer of a few hundred bytes), which a
    /// cached entry would keep alive for its whole life while its [`Entry::weight`] counts the
    /// body's length, not the buffer's (measured: 1.0 GB resident for 52 MB counted); copied,
    /// the cache's weight is the memory it holds.
    fn owned(self) -> Self {
        Self {
            body: Bytes::copy_from_slice(&self.body),
            ..self
        }
    }

    /// The bytes `cache.max_bytes` counts for this answer: what it holds in memory, not just
    /// its body (an answer of a few hundred bytes holds about twice that).
    pub fn weight(&self) -> u32 {
        let body = self.body.len();
        let held = body + body / 16 + self.served_model.len() + self.tier.len() + ENTRY_OVERHEAD;
        u32::try_from(held).unwrap_or(u32::MAX)
    }
}

/// The exact layer: answers by key, at most `max_bytes` of them as [`Entry::weight`] counts,
/// each expiring at its own time to live.
pub fn exact_layer(max_bytes: u64) -> moka::sync::Cache<u128, Arc<Entry>> {
    moka::sync::Cache::builder()
        .max_capacity(max_bytes)
        .weigher(|_k: &u128, e: &Arc<Entry>| e.weight())
        .expire_after(PerEntryTtl)
        .build()
}

/// The semantic part of a lookup: the namespace and the text.
#[derive(Debug, Clone)]
pub struct SemanticQuery {
    /// Hash of everything that must match exactly.
    pub ns: u64,
    /// Hash of the tenant, endpoint and model: what sets how long an answer takes upstream.
    pub model_key: u64,
    /// The question.
    pub text: String,
    /// Verifier probability a hit needs (from the tenant's precision target).
    pub threshold: f32,
    /// The question's vectors, once embedded (kept to index the fresh answer).
    pub vectors: Option<Arc<embedder::bert::TextVectors>>,
    /// The question's token ids, once the first stage read them (kept to record the fresh
    /// answer in it).
    pub tokens: Option<Vec<u32>>,
    /// How long the semantic lookup took (zero when none was made), so that the answer's own
    /// time upstream can be told from the request's.
    pub waited: Duration,
}

/// A request's cache plan, from [`Cache::plan`] to [`Cache::fill`].
#[derive(Debug, Clone)]
pub struct Lookup {
    /// The tenant (the shared layer's keys carry it as their hash tag).
    pub tenant_id: String,
    /// Exact-layer key (tenant + canonical request).
    pub key: u128,
    /// Answer from the cache (not with `no-cache`).
    pub read: bool,
    /// Store the fresh answer (cleared when a budget clamped or downgraded the request: that
    /// answer is not what the request asked for).
    pub write: bool,
    /// Time to live of the answer.
    pub ttl: Duration,
    /// The semantic layer's part, when it applies.
    pub semantic: Option<SemanticQuery>,
}

/// A cache hit.
#[derive(Debug)]
pub struct Found {
    /// The answer.
    pub entry: Arc<Entry>,
    /// `HitExact` or `HitSemantic`.
    pub status: CacheStatus,
    /// Cosine similarity and verifier probability, for semantic hits.
    pub similarity: Option<(f32, f32)>,
}

/// The cache of one gateway replica.
pub struct Cache {
    config: CacheConfig,
    policies: TenantPolicies<CachePolicy>,
    exact: moka::sync::Cache<u128, Arc<Entry>>,
    shared: Option<shared::Shared>,
    /// Started on first need (the default mode, or a tenant's policy, is `semantic`); `None`
    /// inside when the model is missing. Until then no model is loaded (~200 MB resident).
    semantic: std::sync::OnceLock<Option<semantic::Semantic>>,
    /// What each tenant's semantic lookups would have answered at other settings.
    calibration: calibration::Calibration,
    metrics: Metrics,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("entries", &self.exact.entry_count())
            .finish_non_exhaustive()
    }
}

struct PerEntryTtl;

impl moka::Expiry<u128, Arc<Entry>> for PerEntryTtl {
    fn expire_after_create(&self, _: &u128, entry: &Arc<Entry>, _: Instant) -> Option<Duration> {
        Some(entry.ttl)
    }
}

fn sha128(parts: &[&[u8]]) -> u128 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    u128::from_le_bytes(b)
}

/// A message's text when it is a plain text message (a string, or text parts only).
fn message_text(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                if p.get("type").and_then(Value::as_str) != Some("text") {
                    return None;
                }
                out.push_str(p.get("text")?.as_str()?);
            }
            Some(out)
        }
        _ => None,
    }
}

/// Longest question the semantic layer embeds and indexes, bytes: the model reads its first 256
/// tokens anyway, and the index then holds at most `capacity` × (vector + this) bytes. Longer
/// questions are cached exactly only.
pub const MAX_QUESTION_BYTES: usize = 4096;

/// The question a semantic lookup embeds, and the rest of the request (which must match
/// exactly): for chat the last message when it is a user's text, for completions a single
/// string prompt; `None` for anything else, and for a question over [`MAX_QUESTION_BYTES`]
/// (checked before anything is copied).
fn split_question(req: &ParsedRequest) -> Option<(String, Map<String, Value>)> {
    let question = match req.endpoint {
        Endpoint::Chat => match req.body().get("messages") {
            Some(Value::Array(m)) => m.last().and_then(|l| l.get("content")),
            _ => None,
        },
        Endpoint::Completions => req.body().get("prompt"),
        Endpoint::Embeddings => None,
    }?;
    let size = match question {
        Value::String(s) => s.len(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(str::len)
            .sum(),
        _ => return None,
    };
    if size > MAX_QUESTION_BYTES {
        return None;
    }
    let mut rest = req.body().clone();
    for k in ["stream", "stream_options", "user", "model"] {
        rest.remove(k);
    }
    let text = match req.endpoint {
        Endpoint::Chat => {
            let Some(Value::Array(messages)) = rest.get_mut("messages") else {
                return None;
            };
            let last = messages.pop()?;
            if last.get("role").and_then(Value::as_str) != Some("user") {
                return None;
            }
            message_text(last.get("content"))?
        }
        Endpoint::Completions => match rest.remove("prompt")? {
            Value::String(s) => s,
            _ => return None,
        },
        Endpoint::Embeddings => return None,
    };
    (!text.trim().is_empty()).then_some((text, rest))
}

/// What the precision settings would have answered of one tenant's semantic lookups.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CalibrationView {
    /// Semantic lookups this replica ran for the tenant (recent ones weigh most).
    pub lookups: u64,
    /// Of those, the ones with no stored question close enough to be a candidate.
    pub without_candidate: u64,
    /// One line per setting.
    pub settings: Vec<SettingView>,
}

/// One precision setting, applied to a tenant's own lookups.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SettingView {
    /// The setting (`gatewayctl cache set --min-precision`).
    pub min_precision: f64,
    /// Its point on the verifier's held-out curve (`None`: the curve never reaches it).
    pub point: Option<embedder::verifier::CurvePoint>,
    /// Lookups whose best candidate reached that point's threshold.
    pub semantic_hits: u64,
    /// `semantic_hits / lookups` (`None` without lookups).
    pub semantic_hit_rate: Option<f64>,
}

impl Cache {
    /// Build the cache; the semantic layer starts on the first request whose policy needs it
    /// (at start with `cache.semantic.preload`, or when a tenant's policy names it), when the
    /// model is present.
    pub async fn new(
        config: CacheConfig,
        store: Arc<dyn Store>,
        metrics: Metrics,
        background: &Background,
    ) -> anyhow::Result<Self> {
        let exact = exact_layer(config.max_bytes);
        let shared = if config.redis_urls.is_empty() {
            None
        } else {
            Some(shared::Shared::new(
                config.redis_urls.clone(),
                Duration::from_millis(config.redis_timeout_ms),
                metrics.clone(),
                background.clone(),
            )?)
        };
        let cache = Self {
            config,
            policies: TenantPolicies::new(store),
            exact,
            shared,
            semantic: std::sync::OnceLock::new(),
            calibration: calibration::Calibration::default(),
            metrics,
        };
        if cache.config.mode == CacheMode::Semantic {
            if cache.config.semantic.preload {
                cache.start_semantic().map_err(anyhow::Error::msg)?;
            } else {
                // A bad `cache.semantic.device` fails the start here, not on a first request.
                semantic::check_device(&cache.config.semantic).map_err(anyhow::Error::msg)?;
            }
        }
        cache.refresh().await?;
        Ok(cache)
    }

    /// The semantic layer, once started.
    fn semantic(&self) -> Option<&semantic::Semantic> {
        self.semantic.get().and_then(Option::as_ref)
    }

    /// Start the semantic layer unless it is started (its thread loads the model).
    fn start_semantic(&self) -> Result<(), String> {
        if self.semantic.get().is_none() {
            let started = semantic::Semantic::start(&self.config.semantic, self.metrics.clone())?;
            // A concurrent start that lost the race drops its worker (its channel closes).
            let _ = self.semantic.set(started);
        }
        Ok(())
    }

    /// Reload the policies every `every` until `background` stops.
    pub fn start(self: &Arc<Self>, background: &Background, every: Duration) {
        let cache = Arc::clone(self);
        background.every("cache policies", every, move || {
            let cache = Arc::clone(&cache);
            async move { cache.refresh().await }
        });
    }

    /// Reload every tenant's policy (called every `store.key_refresh_ms`).
    pub async fn refresh(&self) -> Result<(), StoreError> {
        self.policies.refresh().await?;
        if self.policies.any(|p| p.mode == Some(CacheMode::Semantic)) {
            if let Err(e) = self.start_semantic() {
                tracing::error!(error = %e, "a tenant's cache policy is semantic, but the semantic layer cannot start");
            }
        }
        self.metrics
            .cache_entries
            .set(i64::try_from(self.exact.entry_count()).unwrap_or(i64::MAX));
        self.metrics
            .cache_bytes
            .set(i64::try_from(self.exact.weighted_size()).unwrap_or(i64::MAX));
        Ok(())
    }

    /// The policy in force for `tenant_id`, defaults filled in.
    pub fn policy(&self, tenant_id: &str) -> CachePolicy {
        let own = self.policies.get(tenant_id).unwrap_or_default();
        CachePolicy {
            mode: Some(own.mode.unwrap_or(self.config.mode)),
            ttl_secs: Some(own.ttl_secs.unwrap_or(self.config.ttl_secs)),
            min_precision: Some(own.min_precision.unwrap_or(self.config.min_precision)),
            ..own
        }
    }

    /// Whether the semantic layer has been started (its model loaded or loading).
    pub fn semantic_started(&self) -> bool {
        self.semantic().is_some()
    }

    /// Whether the semantic layer is loaded and answering.
    pub fn semantic_ready(&self) -> bool {
        self.semantic().is_some_and(semantic::Semantic::ready)
    }

    /// The verifier curve's point for `precision` (`None` before the semantic layer is ready
    /// or when the curve never reaches it).
    pub fn curve_point(&self, precision: f64) -> Option<embedder::verifier::CurvePoint> {
        self.semantic()?.curve_point(precision)
    }

    /// What each precision setting (`settings`, on the verifier's held-out curve) would have
    /// answered of `tenant_id`'s semantic lookups on this replica; `None` before the semantic
    /// layer is ready.
    pub fn calibration(&self, tenant_id: &str, settings: &[f64]) -> Option<CalibrationView> {
        let s = self.semantic().filter(|s| s.ready())?;
        let points: Vec<(f64, Option<embedder::verifier::CurvePoint>)> =
            settings.iter().map(|p| (*p, s.curve_point(*p))).collect();
        let thresholds: Vec<f32> = points
            .iter()
            .map(|(_, c)| c.map_or(f32::INFINITY, |c| c.threshold))
            .collect();
        let (seen, hits) = self.calibration.expected(tenant_id, &thresholds);
        let settings = points
            .into_iter()
            .zip(hits)
            .map(|((min_precision, point), hits)| SettingView {
                min_precision,
                point,
                semantic_hits: hits,
                semantic_hit_rate: (seen.lookups > 0).then(|| hits as f64 / seen.lookups as f64),
            })
            .collect();
        Some(CalibrationView {
            lookups: seen.lookups,
            without_candidate: seen.without_candidate,
            settings,
        })
    }

    /// Decide whether (and how) `req` of `tenant_id` uses the cache. `None`: bypass.
    /// `fingerprint` is the request's canonical hash ([`ParsedRequest::fingerprint`]), computed
    /// once by the pipeline.
    pub fn plan(
        &self,
        tenant_id: &str,
        req: &ParsedRequest,
        fingerprint: &str,
        directives: Directives,
    ) -> Option<Lookup> {
        let policy = self.policy(tenant_id);
        let mode = policy.mode.unwrap_or(CacheMode::Off);
        if mode == CacheMode::Off || directives.no_store {
            return None;
        }
        let tools = req.has_tools();
        if req.endpoint != Endpoint::Embeddings {
            if tools && !policy.tools {
                return None;
            }
            if !policy.any_temperature && !req.deterministic() {
                return None;
            }
        }
        let key = sha128(&[tenant_id.as_bytes(), fingerprint.as_bytes()]);
        let read = !directives.no_cache;
        if mode == CacheMode::Semantic && self.semantic.get().is_none() {
            // The first request that needs the semantic layer loads it (in its own thread; this
            // request and those until it is ready use the exact layer alone).
            if let Err(e) = self.start_semantic() {
                tracing::error!(error = %e, "the semantic layer cannot start");
            }
        }
        let semantic = match (self.semantic(), mode) {
            (Some(s), CacheMode::Semantic) if read && !tools && req.choices() == 1 => {
                let threshold = s.threshold_for(policy.min_precision.unwrap_or(1.0));
                match (threshold, split_question(req)) {
                    (Some(threshold), Some((text, rest))) => {
                        let mut rest = Value::Object(rest);
                        crate::openai::canonical_numbers(&mut rest);
                        let rest = serde_json::to_vec(&rest).unwrap_or_default();
                        let model = [
                            tenant_id.as_bytes(),
                            req.endpoint.label().as_bytes(),
                            req.model.as_bytes(),
                        ];
                        let ns = sha128(&[model[0], model[1], model[2], &rest]) as u64;
                        Some(SemanticQuery {
                            ns,
                            model_key: sha128(&model) as u64,
                            text,
                            threshold,
                            vectors: None,
                            tokens: None,
                            waited: Duration::ZERO,
                        })
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        Some(Lookup {
            tenant_id: tenant_id.to_owned(),
            key,
            read,
            write: true,
            ttl: Duration::from_secs(policy.ttl_secs.unwrap_or(self.config.ttl_secs)),
            semantic,
        })
    }

    /// Look `lookup` up: the exact layer, then the semantic one. Keeps the question's vectors
    /// in `lookup` for [`Cache::fill`].
    pub async fn lookup(&self, lookup: &mut Lookup) -> Option<Found> {
        if !lookup.read {
            return None;
        }
        let lookups = &self.metrics.cache_lookups;
        if let Some(entry) = self.exact.get(&lookup.key) {
            lookups.with_label_values(&["exact", "hit"]).inc();
            return Some(Found {
                entry,
                status: CacheStatus::HitExact,
                similarity: None,
            });
        }
        lookups.with_label_values(&["exact", "miss"]).inc();
        if let Some(shared) = &self.shared {
            if let Some(entry) = shared.get(&lookup.tenant_id, lookup.key).await {
                lookups.with_label_values(&["shared", "hit"]).inc();
                let entry = Arc::new(entry);
                self.exact.insert(lookup.key, Arc::clone(&entry));
                return Some(Found {
                    entry,
                    status: CacheStatus::HitExact,
                    similarity: None,
                });
            }
            lookups.with_label_values(&["shared", "miss"]).inc();
        }
        let (Some(s), Some(q)) = (self.semantic(), lookup.semantic.as_mut()) else {
            return None;
        };
        if !s.maybe_populated(q.ns) {
            // Nothing stored in this namespace: a certain miss, not worth an embedding now.
            lookups.with_label_values(&["semantic", "miss"]).inc();
            self.calibration.record(&lookup.tenant_id, None);
            return None;
        }
        q.tokens = s.gate_tokens(&q.text);
        let near = q
            .tokens
            .as_deref()
            .map_or(Near::Unknown, |t| s.gate_near(q.ns, t));
        if near == Near::Nothing {
            // No stored question is close enough to its student vector (or shares enough of
            // its rare words) to be a hit.
            lookups.with_label_values(&["semantic", "gated"]).inc();
            self.calibration.record(&lookup.tenant_id, None);
            return None;
        }
        let started = Instant::now();
        let looked = s
            .lookup(q.ns, q.model_key, &q.text, q.threshold, near)
            .await;
        q.waited = started.elapsed();
        let Some(result) = looked else {
            lookups.with_label_values(&["semantic", "skipped"]).inc();
            return None;
        };
        self.metrics
            .cache_semantic_seconds
            .observe(started.elapsed().as_secs_f64());
        q.vectors = Some(result.vectors);
        self.calibration
            .record(&lookup.tenant_id, result.top_probability);
        let found = result.verdict.and_then(|v| {
            self.exact.get(&v.key).map(|entry| Found {
                entry,
                status: CacheStatus::HitSemantic,
                similarity: Some((v.cosine, v.probability)),
            })
        });
        let outcome = if found.is_some() { "hit" } else { "miss" };
        lookups.with_label_values(&["semantic", outcome]).inc();
        found
    }

    /// Store a fresh answer under `lookup` (when it may be stored and is not too large);
    /// `elapsed`: the request's time until the answer was complete.
    pub fn fill(&self, lookup: Lookup, entry: Entry, elapsed: Duration) {
        if !lookup.write || entry.body.len() as u64 > self.config.max_entry_bytes {
            return;
        }
        let entry = entry.owned();
        if let Some(shared) = &self.shared {
            shared.put(&lookup.tenant_id, lookup.key, &entry);
        }
        self.exact.insert(lookup.key, Arc::new(entry));
        if let (Some(s), Some(q)) = (self.semantic(), lookup.semantic) {
            let upstream = elapsed.saturating_sub(q.waited);
            let answered = (q.model_key, upstream);
            s.insert(q.ns, q.text, q.vectors, q.tokens, lookup.key, answered);
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> ParsedRequest {
        ParsedRequest::parse(Endpoint::Chat, v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_stored_body_does_not_keep_the_buffer_it_was_read_from() {
        let buffer = Bytes::from(vec![b'x'; 16 * 1024]);
        let entry = Entry {
            body: buffer.slice(100..600),
            served_model: "m".into(),
            tier: "small".into(),
            usage: Usage::default(),
            ttl: Duration::from_secs(1),
        };
        let stored = entry.owned();
        assert_eq!(stored.body.len(), 500);
        assert!(stored.body.iter().all(|&b| b == b'x'));
        let range = buffer.as_ptr_range();
        assert!(
            !range.contains(&stored.body.as_ptr()),
            "the stored body still points into the read buffer"
        );
    }

    #[test]
    fn cache_control_directives() {
        assert_eq!(
            Directives::parse(Some("No-Cache, max-age=0")),
            Directives {
                no_cache: true,
                no_store: false
            }
        );
        assert!(Directives::parse(Some("no-store")).no_store);
        assert_eq!(Directives::parse(None), Directives::default());
    }

    #[test]
    fn the_question_is_the_last_user_text_and_the_rest_must_match() {
        let a = chat(json!({"model": "fast", "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "How do I boil an egg?"}]}]}));
        let (text, rest) = split_question(&a).unwrap();
        assert_eq!(text, "How do I boil an egg?");
        assert_eq!(
            rest["messages"],
            json!([{"role": "system", "content": "Be brief."}])
        );
        assert!(!rest.contains_key("model"));
        let b = chat(json!({"model": "fast", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}));
        assert!(
            split_question(&b).is_none(),
            "last message is not the user's"
        );
        let c = chat(
            json!({"model": "fast", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
        );
        assert!(split_question(&c).is_none(), "not text");
        let long = "word ".repeat(MAX_QUESTION_BYTES / 5 + 1);
        let d = chat(json!({"model": "fast", "messages": [{"role": "user", "content": long}]}));
        assert!(split_question(&d).is_none(), "too long to embed and index");
    }
}
