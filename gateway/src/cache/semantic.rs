//! The semantic layer's worker: one dedicated thread owns the embedding model, the static table,
//! the vector index and the verifier. Requests hand it jobs over a channel and await a oneshot
//! reply, so no async task ever blocks on the model; lookups that arrive together are embedded
//! in one batch.
//!
//! Overload never slows the gateway down: when more than `max_queue` jobs are waiting, when the
//! wait a new lookup would have (the jobs ahead of it at the worker's measured time per text)
//! already passes half of `lookup_timeout_ms`, or when a reply takes longer than
//! `lookup_timeout_ms`, the request goes on as a miss.
//!
//! A question whose namespace holds nothing yet (a new system prompt, new sampling parameters)
//! cannot hit, so it is not embedded on the request's path: [`Semantic::maybe_populated`] says
//! so without asking the thread, and the answer's question is embedded afterwards, off the
//! request path, when it is indexed.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use embedder::bert::{BertEmbedder, Embed, TextVectors};
use embedder::index::{CpuIndex, VectorIndex};
use embedder::semantic::{Search, SemanticIndex, Verdict, SHIPPED_VERIFIER};
use embedder::static_embed::StaticEmbedder;
use embedder::verifier::Verifier;
use tokio::sync::oneshot;

use crate::config::{EmbedDevice, SemanticConfig};
use crate::metrics::Metrics;

/// What a lookup found: the question's vectors (to index the fresh answer later) and the best
/// verified match, if any.
#[derive(Debug)]
pub struct Looked {
    /// Sentence and token vectors of the question.
    pub vectors: Arc<TextVectors>,
    /// The verified match.
    pub verdict: Option<Verdict>,
    /// The highest verifier probability among the candidates (`None`: no candidate).
    pub top_probability: Option<f32>,
}

enum Job {
    Lookup {
        ns: u64,
        text: String,
        threshold: f32,
        reply: oneshot::Sender<Looked>,
    },
    Insert {
        ns: u64,
        text: String,
        /// The question's vectors when its lookup computed them; else embedded by the worker.
        vectors: Option<Arc<TextVectors>>,
        key: u128,
        at: Instant,
    },
}

/// Namespaces that may hold entries: a fixed bitset indexed by the namespace hash, set when an
/// entry is indexed and never cleared (a stale bit only costs a lookup that finds nothing; a
/// clear bit is always right).
#[derive(Debug)]
struct Populated(Vec<AtomicU64>);

impl Populated {
    const BITS: u64 = 1 << 20;

    fn new() -> Self {
        Self((0..Self::BITS / 64).map(|_| AtomicU64::new(0)).collect())
    }

    fn slot(ns: u64) -> (usize, u64) {
        let bit = ns % Self::BITS;
        ((bit / 64) as usize, 1 << (bit % 64))
    }

    fn mark(&self, ns: u64) {
        let (word, mask) = Self::slot(ns);
        self.0[word].fetch_or(mask, Ordering::Relaxed);
    }

    fn may_hold(&self, ns: u64) -> bool {
        let (word, mask) = Self::slot(ns);
        self.0[word].load(Ordering::Relaxed) & mask != 0
    }
}

/// Handle to the worker thread.
#[derive(Debug)]
pub struct Semantic {
    tx: mpsc::Sender<Job>,
    populated: Populated,
    queued: Arc<AtomicUsize>,
    /// The worker's recent time per embedded text, microseconds (a moving average).
    per_text_us: Arc<AtomicU64>,
    verifier: Arc<OnceLock<Verifier>>,
    max_queue: usize,
    timeout: Duration,
}

/// Index entries outlive nothing: an answer's lifetime is the exact layer's, which the index
/// entry points into. This only bounds how long a stale vector is kept.
const INDEX_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// The GPU `config.device` asks for (`None`: the CPU); an error when it names `cuda` and no GPU
/// can be used. Loads no model.
pub fn check_device(config: &SemanticConfig) -> Result<Option<usize>, String> {
    Ok(match config.device {
        EmbedDevice::Cpu => None,
        EmbedDevice::Cuda => Some(gpu_ordinal().map_err(|e| {
            format!("cache.semantic.device = \"cuda\", but no GPU can be used: {e}")
        })?),
        EmbedDevice::Auto => gpu_ordinal().ok(),
    })
}

impl Semantic {
    /// Start the worker, or return `None` (with a log line saying why the semantic layer is
    /// off) when the model is missing. `device = "cuda"` without a usable GPU is an error.
    pub fn start(config: &SemanticConfig, metrics: Metrics) -> Result<Option<Self>, String> {
        let gpu = check_device(config)?;
        if !BertEmbedder::present(&config.model_dir) {
            tracing::warn!(
                model_dir = %config.model_dir.display(),
                "semantic cache off: no embedding model (run scripts/fetch-model.sh); the exact cache still works"
            );
            return Ok(None);
        }
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let per_text_us = Arc::new(AtomicU64::new(0));
        let verifier = Arc::new(OnceLock::new());
        let worker = Worker {
            gpu,
            config: config.clone(),
            queued: Arc::clone(&queued),
            per_text_us: Arc::clone(&per_text_us),
            verifier: Arc::clone(&verifier),
            metrics,
        };
        let spawned = std::thread::Builder::new()
            .name("gw-semantic".into())
            .spawn(move || worker.run(&rx));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "semantic cache off: could not start its thread");
            return Ok(None);
        }
        Ok(Some(Self {
            tx,
            populated: Populated::new(),
            queued,
            per_text_us,
            verifier,
            max_queue: config.max_queue,
            timeout: Duration::from_millis(config.lookup_timeout_ms),
        }))
    }

    /// Whether the model, table and verifier are loaded.
    pub fn ready(&self) -> bool {
        self.verifier.get().is_some()
    }

    /// The verifier threshold that reaches `precision` on its held-out curve (`None` before
    /// the layer is ready or when the curve never gets there).
    pub fn threshold_for(&self, precision: f64) -> Option<f32> {
        self.curve_point(precision).map(|p| p.threshold)
    }

    /// The held-out curve's point for `precision`.
    pub fn curve_point(&self, precision: f64) -> Option<embedder::verifier::CurvePoint> {
        self.verifier.get()?.threshold_for(precision)
    }

    /// Embed `text` and find its best verified match in `ns`; `None` when skipped (not ready,
    /// queue full, a wait already too long, too slow).
    pub async fn lookup(&self, ns: u64, text: &str, threshold: f32) -> Option<Looked> {
        let queued = self.queued.load(Ordering::Relaxed);
        if !self.ready() || queued >= self.max_queue || self.wait_too_long(queued) {
            return None;
        }
        let (reply, rx) = oneshot::channel();
        self.queued.fetch_add(1, Ordering::Relaxed);
        let job = Job::Lookup {
            ns,
            text: text.to_owned(),
            threshold,
            reply,
        };
        if self.tx.send(job).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        tokio::time::timeout(self.timeout, rx).await.ok()?.ok()
    }

    /// Whether a lookup behind `queued` jobs would wait past half the lookup timeout at the
    /// worker's recent time per text: then it is skipped at once instead of timing out later
    /// (the worker embeds a batch at a time, so this errs on the long side).
    /// An idle worker always takes the lookup, so the time per text is measured again after a
    /// burst however slow the burst made it look.
    fn wait_too_long(&self, queued: usize) -> bool {
        queued > 0
            && predicted_wait(queued, self.per_text_us.load(Ordering::Relaxed)) > self.timeout / 2
    }

    /// Whether namespace `ns` may hold entries (`false`: a lookup cannot hit, skip it).
    pub fn maybe_populated(&self, ns: u64) -> bool {
        self.populated.may_hold(ns)
    }

    /// Index a fresh answer's question (embedded by the worker when `vectors` is `None`).
    /// Best effort: dropped when the worker already has `max_queue` jobs waiting, so a burst of
    /// answers cannot queue without bound.
    pub fn insert(&self, ns: u64, text: String, vectors: Option<Arc<TextVectors>>, key: u128) {
        // Marked even when the insert is dropped: a "may hold" that costs at most a lookup.
        self.populated.mark(ns);
        if self.queued.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let sent = self.tx.send(Job::Insert {
            ns,
            text,
            vectors,
            key,
            at: Instant::now(),
        });
        if sent.is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The wait of a job behind `queued` others at `per_text_us` each (itself included).
fn predicted_wait(queued: usize, per_text_us: u64) -> Duration {
    Duration::from_micros(per_text_us.saturating_mul(queued as u64 + 1))
}

/// `average` moved an eighth of the way to `sample` (the first sample taken as it is).
fn moving_average(average: u64, sample: u64) -> u64 {
    if average == 0 {
        sample
    } else {
        average - average / 8 + sample / 8
    }
}

/// An embedding model and a vector index, on one device.
type Backend = (Box<dyn Embed>, Box<dyn VectorIndex>);

/// The GPU to use, when this build and machine have one.
#[cfg(feature = "cuda")]
fn gpu_ordinal() -> Result<usize, String> {
    embedder::cuda::available()
        .map(|_| 0)
        .map_err(|e| e.to_string())
}

/// The GPU to use, when this build and machine have one.
#[cfg(not(feature = "cuda"))]
fn gpu_ordinal() -> Result<usize, String> {
    Err("this gateway was built without the `cuda` feature (cargo build --features cuda)".into())
}

/// The embedder and index on `gpu`, or on the CPU.
#[cfg(feature = "cuda")]
fn backend(dir: &Path, gpu: Option<usize>, capacity: usize) -> Result<Backend, String> {
    use embedder::cuda::{GpuEmbedder, GpuIndex};
    match gpu {
        Some(ordinal) => Ok((
            Box::new(GpuEmbedder::load(dir, ordinal).map_err(|e| e.to_string())?),
            Box::new(
                GpuIndex::new(embedder::bert::DIM, capacity, INDEX_TTL_MS, ordinal)
                    .map_err(|e| e.to_string())?,
            ),
        )),
        None => cpu_backend(dir, capacity),
    }
}

/// The embedder and index on the CPU (this build has no GPU path).
#[cfg(not(feature = "cuda"))]
fn backend(dir: &Path, _gpu: Option<usize>, capacity: usize) -> Result<Backend, String> {
    cpu_backend(dir, capacity)
}

fn cpu_backend(dir: &Path, capacity: usize) -> Result<Backend, String> {
    Ok((
        Box::new(BertEmbedder::load(dir).map_err(|e| e.to_string())?),
        Box::new(CpuIndex::new(embedder::bert::DIM, capacity, INDEX_TTL_MS)),
    ))
}

struct Worker {
    gpu: Option<usize>,
    config: SemanticConfig,
    queued: Arc<AtomicUsize>,
    per_text_us: Arc<AtomicU64>,
    verifier: Arc<OnceLock<Verifier>>,
    metrics: Metrics,
}

/// Load the static table next to the model, distilling (and saving) it on first use.
pub(crate) fn static_table(dir: &Path) -> Result<StaticEmbedder, String> {
    let table = dir.join("static.bin");
    let tokenizer = dir.join("tokenizer.json");
    if StaticEmbedder::is_current(&table) {
        return StaticEmbedder::load(&table, &tokenizer).map_err(|e| e.to_string());
    }
    // Missing, or written by an older build (a different recipe): distill it again.
    tracing::info!(path = %table.display(), "distilling the static embedding table (once)");
    let bert = BertEmbedder::load(dir).map_err(|e| e.to_string())?;
    let distilled = StaticEmbedder::distill(&bert, |_, _| {}).map_err(|e| e.to_string())?;
    if let Err(e) = distilled.save(&table) {
        tracing::warn!(error = %e, "could not save the static table; it will be distilled again at the next start");
    }
    Ok(distilled)
}

impl Worker {
    fn load(&self) -> Result<(Box<dyn Embed>, SemanticIndex, Verifier), String> {
        let dir = &self.config.model_dir;
        let table = static_table(dir)?;
        let (model, index) = backend(dir, self.gpu, self.config.capacity)?;
        let json = match &self.config.verifier {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("reading verifier {}: {e}", path.display()))?,
            None => SHIPPED_VERIFIER.to_owned(),
        };
        let verifier = Verifier::from_json(&json)?;
        let semantic = SemanticIndex::new(index, verifier.clone(), table);
        Ok((model, semantic, verifier))
    }

    fn run(self, rx: &mpsc::Receiver<Job>) {
        let started = Instant::now();
        let (bert, mut index, verifier) = match self.load() {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!(error = %e, "semantic cache off: could not load it");
                return;
            }
        };
        let epoch = Instant::now();
        let now_ms = |at: Instant| i64::try_from(at.duration_since(epoch).as_millis()).unwrap_or(0);
        let _ = self.verifier.set(verifier);
        self.metrics.cache_semantic_ready.set(1);
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            device = bert.device(),
            "semantic cache ready"
        );
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            while jobs.len() < self.config.batch {
                match rx.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            let mut lookups = Vec::new();
            let mut unembedded = Vec::new();
            for job in jobs {
                match job {
                    Job::Insert {
                        ns,
                        text,
                        vectors: Some(vectors),
                        key,
                        at,
                    } => {
                        self.queued.fetch_sub(1, Ordering::Relaxed);
                        let vectors = Arc::unwrap_or_clone(vectors);
                        index.insert(ns, text, vectors, key, now_ms(at));
                    }
                    Job::Insert {
                        ns,
                        text,
                        vectors: None,
                        key,
                        at,
                    } => {
                        self.queued.fetch_sub(1, Ordering::Relaxed);
                        unembedded.push((ns, text, key, at));
                    }
                    Job::Lookup {
                        ns,
                        text,
                        threshold,
                        reply,
                    } => {
                        self.queued.fetch_sub(1, Ordering::Relaxed);
                        // The caller gave up waiting: skip the work.
                        if !reply.is_closed() {
                            lookups.push((ns, text, threshold, reply));
                        }
                    }
                }
            }
            if lookups.is_empty() && unembedded.is_empty() {
                continue;
            }
            // One batch for both: questions to index first (a lookup queued after them must
            // see them), then the lookups.
            let texts: Vec<&str> = unembedded
                .iter()
                .map(|(_, t, _, _)| t.as_str())
                .chain(lookups.iter().map(|(_, t, _, _)| t.as_str()))
                .collect();
            let embedding = Instant::now();
            let mut embedded = match bert.embed_with_tokens(&texts) {
                Ok(v) => {
                    let per_text = embedding.elapsed().as_micros() / texts.len() as u128;
                    let per_text = u64::try_from(per_text).unwrap_or(u64::MAX);
                    let average = self.per_text_us.load(Ordering::Relaxed);
                    self.per_text_us
                        .store(moving_average(average, per_text), Ordering::Relaxed);
                    v.into_iter()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "semantic cache: embedding failed; treated as misses");
                    continue;
                }
            };
            for ((ns, text, key, at), vectors) in unembedded.into_iter().zip(embedded.by_ref()) {
                index.insert(ns, text, vectors, key, now_ms(at));
            }
            let now = now_ms(Instant::now());
            for ((ns, text, threshold, reply), vectors) in lookups.into_iter().zip(embedded) {
                let search = Search {
                    k: self.config.candidates,
                    min_cosine: self.config.min_cosine,
                    threshold,
                };
                let best = index.best(ns, &text, &vectors, search, now);
                let _ = reply.send(Looked {
                    vectors: Arc::new(vectors),
                    verdict: best.verdict,
                    top_probability: best.top_probability,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_predicted_wait_counts_the_jobs_ahead_and_the_lookup_itself() {
        assert_eq!(predicted_wait(0, 15_000), Duration::from_millis(15));
        assert_eq!(predicted_wait(9, 15_000), Duration::from_millis(150));
        // Before any batch was timed, nothing is predicted: the queue bound still holds.
        assert_eq!(predicted_wait(31, 0), Duration::ZERO);
        // Past half of the default 250 ms timeout from the ninth job ahead at 15 ms a text.
        let half = Duration::from_millis(250) / 2;
        assert!(predicted_wait(7, 15_000) <= half);
        assert!(predicted_wait(8, 15_000) > half);
    }

    #[test]
    fn the_time_per_text_follows_recent_batches() {
        assert_eq!(
            moving_average(0, 12_000),
            12_000,
            "the first sample as it is"
        );
        let mut avg = 12_000;
        for _ in 0..40 {
            avg = moving_average(avg, 2_000);
        }
        assert!((2_000..2_100).contains(&avg), "{avg}");
        assert_eq!(moving_average(8_000, 8_000), 8_000);
    }
}
