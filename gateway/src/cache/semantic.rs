//! The semantic layer's worker: one dedicated thread owns the embedding model, the static table,
//! the vector index and the verifier. Requests hand it jobs over a channel and await a oneshot
//! reply, so no async task ever blocks on the model; lookups that arrive together are embedded
//! in one batch.
//!
//! Overload never slows the gateway down: when more than `max_queue` jobs are waiting, when the
//! wait a new lookup would have (the jobs ahead of it at the worker's measured time per text)
//! already passes half of `lookup_timeout_ms` or, behind other lookups, the time its model's
//! answers take upstream (what a hit would save), or when a reply takes longer than
//! `lookup_timeout_ms`, the request goes on as a miss.
//!
//! A question whose namespace holds nothing yet (a new system prompt, new sampling parameters)
//! cannot hit, so it is not embedded on the request's path: [`Semantic::maybe_populated`] says
//! so without asking the thread, and the answer's question is embedded afterwards, off the
//! request path, when it is indexed. Nor is one the first stage finds far from every stored
//! question of its namespace (its student vector, or its rare words: [`Semantic::gate_near`],
//! [`embedder::gate`]), decided on the request's own thread in microseconds.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use embedder::bert::{BertEmbedder, Embed, TextVectors};
use embedder::forward::{Paused, Precision, Progress};
use embedder::gate::{FirstStage, Near, TokenGate};
use embedder::index::{CpuIndex, VectorIndex};
use embedder::semantic::{Search, SemanticIndex, Verdict, SHIPPED_VERIFIER};
use embedder::static_embed::StaticEmbedder;
use embedder::student::{Projection, StudentGate};
use embedder::verifier::Verifier;
use prometheus::IntCounter;
use tokio::sync::oneshot;

use crate::config::{CpuPrecision, EmbedDevice, SemanticConfig};
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
    Lookup(LookupJob),
    Insert {
        ns: u64,
        /// The entry's id: increasing in the order inserts are sent.
        id: u64,
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

/// What a hit saves for each model: a moving average of how long its answers took to come from
/// the upstream (microseconds; 0 until one is seen), in [`AnswerTimes::SLOTS`] slots by the hash
/// of tenant, endpoint and model (`SemanticQuery::model_key`), which take few values: two
/// models sharing a slot (rare) share an average.
#[derive(Debug)]
struct AnswerTimes(Vec<AtomicU64>);

impl AnswerTimes {
    const SLOTS: u64 = 4096;

    fn new() -> Self {
        Self((0..Self::SLOTS).map(|_| AtomicU64::new(0)).collect())
    }

    fn slot(&self, model: u64) -> &AtomicU64 {
        &self.0[(model % Self::SLOTS) as usize]
    }

    fn record(&self, model: u64, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1);
        let slot = self.slot(model);
        // Two answers recorded at once may lose one sample: an average, not a count.
        slot.store(
            moving_average(slot.load(Ordering::Relaxed), us),
            Ordering::Relaxed,
        );
    }

    fn get(&self, model: u64) -> Option<Duration> {
        let us = self.slot(model).load(Ordering::Relaxed);
        (us > 0).then(|| Duration::from_micros(us))
    }
}

/// Handle to the worker thread.
#[derive(Debug)]
pub struct Semantic {
    tx: mpsc::Sender<Job>,
    populated: Populated,
    queued: Arc<Queued>,
    /// The worker's recent time per embedded text, microseconds (a moving average).
    per_text_us: Arc<AtomicU64>,
    /// How long each model's answers take upstream: what a lookup may wait for.
    answer_times: AnswerTimes,
    verifier: Arc<OnceLock<Verifier>>,
    /// The first stage, once the layer is loaded (absent when `gate_overlap` and
    /// `gate_student` are 0).
    gate: Arc<OnceLock<Arc<FirstStage>>>,
    /// The next entry id; held while an insert is recorded in the gate and sent, so the worker
    /// sees ids in increasing order.
    next_id: Mutex<u64>,
    max_queue: usize,
    timeout: Duration,
    /// Answers not indexed because the queue was full (or the worker gone).
    dropped: IntCounter,
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
        let queued = Arc::new(Queued::default());
        let per_text_us = Arc::new(AtomicU64::new(0));
        let verifier = Arc::new(OnceLock::new());
        let gate = Arc::new(OnceLock::new());
        let dropped = metrics
            .cache_semantic_answers
            .with_label_values(&["dropped"]);
        let worker = Worker {
            gpu,
            config: config.clone(),
            queued: Arc::clone(&queued),
            per_text_us: Arc::clone(&per_text_us),
            verifier: Arc::clone(&verifier),
            gate: Arc::clone(&gate),
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
            answer_times: AnswerTimes::new(),
            verifier,
            gate,
            next_id: Mutex::new(1),
            max_queue: config.max_queue,
            timeout: Duration::from_millis(config.lookup_timeout_ms),
            dropped,
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

    /// Embed `text` and find its best verified match in `ns` (whose answers come from
    /// `model`, a [`super::SemanticQuery::model_key`]; `near`: what the first stage found,
    /// [`Semantic::gate_near`]); `None` when skipped (not ready, queue full, a wait already too
    /// long, too slow).
    pub async fn lookup(
        &self,
        ns: u64,
        model: u64,
        text: &str,
        threshold: f32,
        near: Near,
    ) -> Option<Looked> {
        let lookups = self.queued.lookups.load(Ordering::Relaxed);
        let inserts = self.queued.inserts.load(Ordering::Relaxed);
        let ahead = texts_ahead(lookups, inserts, &near);
        if !self.ready() || lookups >= self.max_queue || self.wait_too_long(ahead, lookups, model) {
            return None;
        }
        let (reply, rx) = oneshot::channel();
        self.queued.lookups.fetch_add(1, Ordering::Relaxed);
        let job = Job::Lookup(LookupJob {
            ns,
            text: text.to_owned(),
            threshold,
            near: match near {
                Near::Only(mut ids) => {
                    ids.sort_unstable();
                    Some(ids)
                }
                Near::Nothing | Near::Unknown => None,
            },
            reply,
        });
        if self.tx.send(job).is_err() {
            self.queued.lookups.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        tokio::time::timeout(self.timeout, rx).await.ok()?.ok()
    }

    /// Whether a lookup for `model` behind `ahead` texts, `lookups` of them other lookups,
    /// would wait longer than it may at the worker's recent time per text: half the lookup
    /// timeout, and, once other lookups are queued (the embedding model is the bottleneck), no
    /// longer than `model`'s answers take upstream: a hit saves no more than that, so in front
    /// of a fast server a busy model is skipped, not queued for. Behind nothing but an answer
    /// being indexed it keeps the half timeout: that answer is the one a paraphrase sent right
    /// after it would hit. A skipped lookup is skipped at once instead of timing out later (the worker embeds
    /// a batch at a time, so this errs on the long side).
    /// An idle worker always takes the lookup, so the time per text is measured again after a
    /// burst however slow the burst made it look.
    fn wait_too_long(&self, ahead: usize, lookups: usize, model: u64) -> bool {
        let answer = if lookups > 0 {
            self.answer_times.get(model)
        } else {
            None
        };
        let budget = wait_budget(self.timeout, answer);
        ahead > 0 && predicted_wait(ahead, self.per_text_us.load(Ordering::Relaxed)) > budget
    }

    /// Whether namespace `ns` may hold entries (`false`: a lookup cannot hit, skip it).
    pub fn maybe_populated(&self, ns: u64) -> bool {
        self.populated.may_hold(ns)
    }

    /// The question's distinct token ids for the first stage (`None` when it is off, or the
    /// text cannot be tokenised): computed once per request, for its check and its insert.
    pub fn gate_tokens(&self, text: &str) -> Option<Vec<u32>> {
        self.gate.get()?.tokens(text)
    }

    /// What the first stage finds for the question (its [`Semantic::gate_tokens`]) in `ns`:
    /// that no stored question is close enough to be a hit ([`Near::Nothing`]), or which may
    /// be (the lookup then takes those of them still waiting to be indexed into its batch).
    pub fn gate_near(&self, ns: u64, tokens: &[u32]) -> Near {
        self.gate
            .get()
            .map_or(Near::Unknown, |gate| gate.near(ns, tokens))
    }

    /// Index a fresh answer's question (embedded by the worker when `vectors` is `None`; its
    /// gate tokens computed here when `tokens` is `None`); `answered`: the model key
    /// ([`super::SemanticQuery::model_key`]) and how long the answer took upstream.
    /// Best effort: dropped when `max_queue` inserts are already waiting, so a burst of answers
    /// cannot queue without bound.
    pub fn insert(
        &self,
        ns: u64,
        text: String,
        vectors: Option<Arc<TextVectors>>,
        tokens: Option<Vec<u32>>,
        key: u128,
        answered: (u64, Duration),
    ) {
        // Marked even when the insert is dropped: a "may hold" that costs at most a lookup.
        self.populated.mark(ns);
        self.answer_times.record(answered.0, answered.1);
        let inserts = &self.queued.inserts;
        if inserts.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            inserts.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        let gate = self.gate.get();
        let tokens = gate.and_then(|g| tokens.or_else(|| g.tokens(&text)));
        let Ok(mut next_id) = self.next_id.lock() else {
            inserts.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        };
        let id = *next_id;
        *next_id += 1;
        // In the gate before the worker indexes it: a lookup sent after this insert, which
        // the worker answers after indexing it, must not be stopped by the gate.
        if let (Some(gate), Some(tokens)) = (gate, tokens) {
            gate.insert(ns, id, tokens);
        }
        let sent = self.tx.send(Job::Insert {
            ns,
            id,
            text,
            vectors,
            key,
            at: Instant::now(),
        });
        drop(next_id);
        if sent.is_err() {
            inserts.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
        }
    }
}

/// Jobs sent to the worker and not yet taken into a batch, by kind.
#[derive(Debug, Default)]
struct Queued {
    lookups: AtomicUsize,
    inserts: AtomicUsize,
}

/// How long a lookup may wait: half the lookup `timeout`, and no longer than its model's
/// answers take upstream (`answer`, when one was seen).
fn wait_budget(timeout: Duration, answer: Option<Duration>) -> Duration {
    let half = timeout / 2;
    answer.map_or(half, |t| t.min(half))
}

/// The texts a lookup's answer waits for besides its own, with `lookups` lookups and `inserts`
/// answers queued and what its first stage found (`near`). The worker takes lookups before
/// answers, and on the CPU an answer being embedded gives way within a layer to a lookup unless
/// it is the newest or one the lookup may match; the lookup's batch takes the newest answer
/// and up to [`ALONG`] older ones it may match (at most as many as its first stage named).
fn texts_ahead(lookups: usize, inserts: usize, near: &Near) -> usize {
    let along = match near {
        Near::Only(ids) => ids.len().min(ALONG),
        Near::Nothing | Near::Unknown => 0,
    };
    lookups + inserts.min(1 + along)
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

/// What the worker loads: the model, the index with its verifier, and the first stage.
type Loaded = (
    Box<dyn Embed>,
    SemanticIndex,
    Verifier,
    Option<Arc<FirstStage>>,
);

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
fn backend(config: &SemanticConfig, gpu: Option<usize>) -> Result<Backend, String> {
    use embedder::cuda::{GpuEmbedder, GpuIndex};
    match gpu {
        Some(ordinal) => Ok((
            Box::new(GpuEmbedder::load(&config.model_dir, ordinal).map_err(|e| e.to_string())?),
            Box::new(
                GpuIndex::new(embedder::bert::DIM, config.capacity, INDEX_TTL_MS, ordinal)
                    .map_err(|e| e.to_string())?,
            ),
        )),
        None => cpu_backend(config),
    }
}

/// The embedder and index on the CPU (this build has no GPU path).
#[cfg(not(feature = "cuda"))]
fn backend(config: &SemanticConfig, _gpu: Option<usize>) -> Result<Backend, String> {
    cpu_backend(config)
}

fn cpu_backend(config: &SemanticConfig) -> Result<Backend, String> {
    let precision = match config.precision {
        CpuPrecision::Auto => Precision::fastest(),
        CpuPrecision::F16 => Precision::F16,
        CpuPrecision::Int8 => Precision::Int8,
    };
    // Which integer kernel runs the product (none for floats).
    let kernel = (precision == Precision::Int8).then(embedder::matmul::int8::kernel_name);
    if kernel == Some("portable") {
        tracing::warn!(
            "cache.semantic.precision = \"int8\" on a CPU without AVX2: the portable integer \
             loop is about ten times slower than \"f16\""
        );
    }
    tracing::info!(
        ?precision,
        kernel,
        "the semantic layer's model runs on the CPU"
    );
    let model = BertEmbedder::load_with(&config.model_dir, precision).map_err(|e| e.to_string())?;
    Ok((
        Box::new(model),
        Box::new(CpuIndex::new(
            embedder::bert::DIM,
            config.capacity,
            INDEX_TTL_MS,
        )),
    ))
}

struct Worker {
    gpu: Option<usize>,
    config: SemanticConfig,
    queued: Arc<Queued>,
    per_text_us: Arc<AtomicU64>,
    verifier: Arc<OnceLock<Verifier>>,
    gate: Arc<OnceLock<Arc<FirstStage>>>,
    metrics: Metrics,
}

/// Lower the calling thread's scheduling priority (on Linux both are per thread), so the
/// model's work yields the CPU to the threads answering requests: into the idle class when
/// `idle_class` is set and the kernel allows it, otherwise to niceness `nice`, never raising it.
/// Best effort.
fn yield_to_requests(nice: i32, idle_class: bool) {
    #[cfg(target_os = "linux")]
    {
        if idle_class && idle_scheduling() {
            return;
        }
        let thread = Some(rustix::thread::gettid());
        // Only ever lower it: a gateway started under `nice` keeps its threads' niceness.
        let now = rustix::process::getpriority_process(thread).unwrap_or(0);
        if nice > now {
            if let Err(e) = rustix::process::setpriority_process(thread, nice) {
                tracing::debug!(error = %e, "could not lower an embedding thread's priority");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (nice, idle_class);
}

/// Put the calling thread in Linux's idle scheduling class (`SCHED_IDLE`); whether it is now.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn idle_scheduling() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` only reads the `sched_param` it is given, which lives for the
    // call; pid 0 names the calling thread. rustix has no wrapper for it.
    let done = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0;
    if !done {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "could not put an embedding thread in the idle class; lowering its niceness instead"
        );
    }
    done
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
    fn load(&self) -> Result<Loaded, String> {
        let dir = &self.config.model_dir;
        let table = Arc::new(static_table(dir)?);
        let (model, index) = backend(&self.config, self.gpu)?;
        let json = match &self.config.verifier {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| format!("reading verifier {}: {e}", path.display()))?,
            None => SHIPPED_VERIFIER.to_owned(),
        };
        let verifier = Verifier::from_json(&json)?;
        let gate = if self.config.gate_student > 0.0 {
            // A map that does not fit the table leaves the lookups to the transformer (slower,
            // never wrong) rather than the whole layer off.
            match Projection::shipped().and_then(|projection| {
                StudentGate::new(Arc::clone(&table), projection, self.config.gate_student)
            }) {
                Ok(student) => Some(Arc::new(FirstStage::Student(student))),
                Err(e) => {
                    tracing::error!(error = %e, "cache.semantic.gate_student: the learned first stage is off");
                    None
                }
            }
        } else {
            (self.config.gate_overlap > 0.0).then(|| {
                Arc::new(FirstStage::Overlap(Box::new(TokenGate::new(
                    table.tokenizer().clone(),
                    &verifier.stats.idf,
                    self.config.gate_overlap,
                ))))
            })
        };
        let semantic = SemanticIndex::new(index, verifier.clone(), table);
        Ok((model, semantic, verifier, gate))
    }

    fn run(self, rx: &mpsc::Receiver<Job>) {
        let started = Instant::now();
        // This thread and the pool the model's matrix products run on when on the CPU (rayon's
        // global pool, built here, before the model's first use). This thread joins the idle
        // class only once the model is known to run on the CPU: on a GPU it feeds the device.
        let (nice, idle_class) = (self.config.nice, self.config.idle_class);
        yield_to_requests(nice, false);
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("gw-embed-{i}"))
            .start_handler(move |_| yield_to_requests(nice, idle_class))
            .build_global();
        if let Err(e) = pool {
            tracing::debug!(error = %e, "the model's thread pool was already built; its threads keep their priority");
        }
        let (bert, mut index, verifier, gate) = match self.load() {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!(error = %e, "semantic cache off: could not load it");
                return;
            }
        };
        if bert.device() == "cpu" {
            yield_to_requests(nice, idle_class);
        }
        let epoch = Instant::now();
        let now_ms = |at: Instant| i64::try_from(at.duration_since(epoch).as_millis()).unwrap_or(0);
        let results = &self.metrics.cache_semantic_answers;
        let (indexed, failed) = (
            results.with_label_values(&["indexed"]),
            results.with_label_values(&["failed"]),
        );
        // Answers' questions indexed with their vectors.
        let index_answers =
            |index: &mut SemanticIndex, answers: Vec<InsertJob>, vectors: Vec<TextVectors>| {
                for ((ns, id, text, key, at), vectors) in answers.into_iter().zip(vectors) {
                    index.insert(ns, id, text, vectors, key, now_ms(at));
                    indexed.inc();
                }
            };
        if let Some(gate) = &gate {
            let _ = self.gate.set(Arc::clone(gate));
        }
        // The metrics first: whoever sees the layer ready sees them set.
        self.metrics
            .cache_semantic_model
            .with_label_values(&[bert.device(), bert.precision()])
            .set(1);
        self.metrics.cache_semantic_ready.set(1);
        let _ = self.verifier.set(verifier);
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            device = bert.device(),
            precision = bert.precision(),
            "semantic cache ready"
        );
        let mut queue = WorkQueue::default();
        // Answers whose pass gave way to a lookup, and where that pass stands.
        let mut paused: Option<(Paused, Vec<InsertJob>)> = None;
        // Whether an answer's pass should stop at its next layer (on the CPU): a lookup waits,
        // and a newer answer too (one the lookup may take along, or one that came with its
        // vectors). With no newer answer the one under way is the newest, the one a paraphrase
        // sent right after it would match: it is finished first, as the lookup would have it.
        let lookup_waits = || {
            self.queued.lookups.load(Ordering::Relaxed) > 0
                && self.queued.inserts.load(Ordering::Relaxed) > 0
        };
        loop {
            // Nothing to do, or a paused answer and a lookup on its way (counted, not yet on
            // the channel): wait for a job.
            let idle = queue.is_empty() && paused.is_none();
            if idle || (queue.lookups.is_empty() && paused.is_some() && lookup_waits()) {
                match rx.recv() {
                    Ok(job) => queue.push(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                queue.push(job);
            }
            // Inserts whose vectors their lookup computed cost nothing to index.
            for (ns, id, text, vectors, key, at) in queue.embedded.drain(..) {
                self.queued.inserts.fetch_sub(1, Ordering::Relaxed);
                index.insert(ns, id, text, vectors, key, now_ms(at));
                indexed.inc();
            }
            if let Some(gate) = &gate {
                // Entries the index no longer holds (evicted, or never embedded) leave the gate
                // from time to time; those still on their way to the index stay.
                if gate.len() > 2 * index.len() + 64 {
                    let paused_ids = paused.iter().flat_map(|(_, answers)| answers.iter());
                    let done = paused_ids.map(|a| a.1).fold(queue.done_below(), u64::min);
                    gate.retain(|id| id >= done || index.contains(id));
                }
            }
            // A paused answer goes on once no lookup waits, or at once, to the end, when a
            // waiting lookup may match it (the first stage says so): that lookup must see it.
            if let Some((pass, answers)) = paused.take() {
                let wanted = queue
                    .lookups
                    .iter()
                    .any(|l| answers.iter().any(|a| l.may_match(a.1)));
                if queue.lookups.is_empty() || wanted {
                    let never = || false;
                    let stop: &dyn Fn() -> bool = if wanted { &never } else { &lookup_waits };
                    match bert.resume(pass, stop) {
                        Ok(Progress::Done(vectors)) => index_answers(&mut index, answers, vectors),
                        Ok(Progress::Paused(pass)) => paused = Some((*pass, answers)),
                        Err(e) => {
                            tracing::warn!(error = %e, "semantic cache: embedding failed; answers not indexed");
                            failed.inc_by(answers.len() as u64);
                        }
                    }
                    continue;
                }
                paused = Some((pass, answers));
            }
            let (lookups, unembedded) = queue.next_batch(self.config.batch);
            self.queued
                .lookups
                .fetch_sub(lookups.len(), Ordering::Relaxed);
            self.queued
                .inserts
                .fetch_sub(unembedded.len(), Ordering::Relaxed);
            // The caller gave up waiting: skip the work.
            let lookups: Vec<_> = lookups
                .into_iter()
                .filter(|l| !l.reply.is_closed())
                .collect();
            if lookups.is_empty() && unembedded.is_empty() {
                continue;
            }
            // One batch for both: the question to index first (a lookup sent right after its
            // answer must see it), then the lookups.
            let texts: Vec<&str> = unembedded
                .iter()
                .map(|(_, _, t, _, _)| t.as_str())
                .chain(lookups.iter().map(|l| l.text.as_str()))
                .collect();
            // An answer embedded alone gives way to a lookup; lookups never pause, nor does an
            // answer while another is paused (one paused pass at a time).
            let yields = lookups.is_empty() && paused.is_none();
            let embedding = Instant::now();
            let mut embedded = match bert
                .embed_with_tokens_until(&texts, &|| yields && lookup_waits())
            {
                Ok(Progress::Paused(pass)) => {
                    paused = Some((*pass, unembedded));
                    continue;
                }
                Ok(Progress::Done(v)) => {
                    let per_text = embedding.elapsed().as_micros() / texts.len() as u128;
                    let per_text = u64::try_from(per_text).unwrap_or(u64::MAX);
                    let average = self.per_text_us.load(Ordering::Relaxed);
                    self.per_text_us
                        .store(moving_average(average, per_text), Ordering::Relaxed);
                    v.into_iter()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "semantic cache: embedding failed; treated as misses");
                    failed.inc_by(unembedded.len() as u64);
                    continue;
                }
            };
            let answers = embedded.by_ref().take(unembedded.len()).collect();
            index_answers(&mut index, unembedded, answers);
            let now = now_ms(Instant::now());
            for (
                LookupJob {
                    ns,
                    text,
                    threshold,
                    reply,
                    ..
                },
                vectors,
            ) in lookups.into_iter().zip(embedded)
            {
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

/// Most older answers a lookup's batch takes along (besides the newest): those its first stage
/// found near it, the newest first.
const ALONG: usize = 4;

/// A lookup sent to the worker.
struct LookupJob {
    ns: u64,
    text: String,
    threshold: f32,
    /// The stored questions it may match, ascending (`None`: the first stage could not say).
    near: Option<Vec<u64>>,
    reply: oneshot::Sender<Looked>,
}

impl LookupJob {
    /// Whether it still waits and its first stage found stored question `id` near it.
    fn may_match(&self, id: u64) -> bool {
        !self.reply.is_closed()
            && self
                .near
                .as_ref()
                .is_some_and(|near| near.binary_search(&id).is_ok())
    }
}
/// An insert to embed: namespace, entry id, question, answer key, when it was answered.
type InsertJob = (u64, u64, String, u128, Instant);

/// The worker's own queue: it takes every job waiting on the channel, then embeds the lookups
/// first, so answers waiting to be indexed make a request wait for little more than its own
/// batch (the newest answer and at most [`ALONG`] older ones it may match go in that batch; on
/// the CPU an older answer's pass under way pauses for it at its next layer, unless the lookup
/// may match it; on a GPU the answer under way is finished first).
#[derive(Default)]
struct WorkQueue {
    lookups: VecDeque<LookupJob>,
    /// Inserts to embed, oldest first (ids increasing).
    inserts: VecDeque<InsertJob>,
    /// Inserts that came with their vectors.
    embedded: Vec<(u64, u64, String, TextVectors, u128, Instant)>,
    /// The newest insert id taken off the channel (they are sent in increasing order).
    newest: u64,
}

impl WorkQueue {
    fn is_empty(&self) -> bool {
        self.lookups.is_empty() && self.inserts.is_empty() && self.embedded.is_empty()
    }

    fn push(&mut self, job: Job) {
        if let Job::Insert { id, .. } = &job {
            self.newest = self.newest.max(*id);
        }
        match job {
            Job::Lookup(lookup) => self.lookups.push_back(lookup),
            Job::Insert {
                ns,
                id,
                text,
                vectors: Some(vectors),
                key,
                at,
            } => self
                .embedded
                .push((ns, id, text, Arc::unwrap_or_clone(vectors), key, at)),
            Job::Insert {
                ns,
                id,
                text,
                vectors: None,
                key,
                at,
            } => self.inserts.push_back((ns, id, text, key, at)),
        }
    }

    /// What to embed next: up to `batch` lookups with the newest waiting answer and the older
    /// ones the first stage found they may match (at most [`ALONG`], and `batch` answers in
    /// all), or, with no lookup
    /// waiting, the oldest answer alone. The newest is the one a paraphrase sent right after it
    /// would match (when the first stage decides lookups faster than their answers can be
    /// embedded, the oldest waiting answer is seldom that one), and it rides along whatever
    /// the lookups may match: indexed in a pass that runs anyway, while answers wait.
    fn next_batch(&mut self, batch: usize) -> (Vec<LookupJob>, Vec<InsertJob>) {
        let batch = batch.max(1);
        let take = self.lookups.len().min(batch);
        let lookups: Vec<LookupJob> = self.lookups.drain(..take).collect();
        if lookups.is_empty() {
            return (lookups, self.inserts.pop_front().into_iter().collect());
        }
        let mut answers: Vec<InsertJob> = self.inserts.pop_back().into_iter().collect();
        let wanted = |id: u64| lookups.iter().any(|l| l.may_match(id));
        let mut i = self.inserts.len();
        while i > 0 && answers.len() <= ALONG.min(batch - 1) {
            i -= 1;
            if wanted(self.inserts[i].1) {
                answers.extend(self.inserts.remove(i));
            }
        }
        (lookups, answers)
    }

    /// Every insert id below this one is done (indexed, or failed to embed) but those of a
    /// paused pass, which the worker holds: the oldest still to embed, or the next one the
    /// channel can bring. Only right after the last batch.
    fn done_below(&self) -> u64 {
        self.inserts
            .front()
            .map_or(self.newest + 1, |(_, id, _, _, _)| *id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy and niceness, from `/proc/thread-self/stat`
    /// (fields 41 and 19; the command name in parentheses may hold spaces).
    #[cfg(target_os = "linux")]
    fn policy_and_nice() -> (u32, i32) {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).copied().unwrap_or_default();
        (
            field(41).parse().unwrap_or(u32::MAX),
            field(19).parse().unwrap_or(i32::MIN),
        )
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_embedding_threads_yield_to_requests_by_class_or_by_niceness() {
        const SCHED_OTHER: u32 = 0;
        const SCHED_IDLE: u32 = 5;
        // Each in a thread of its own: a thread cannot take back the priority it gave up.
        let run = |idle_class: bool| {
            std::thread::spawn(move || {
                yield_to_requests(10, idle_class);
                policy_and_nice()
            })
            .join()
            .unwrap_or((u32::MAX, i32::MIN))
        };
        assert_eq!(run(true).0, SCHED_IDLE);
        let (policy, nice) = run(false);
        assert_eq!(policy, SCHED_OTHER);
        assert!(nice >= 10, "niceness {nice}");
    }

    #[test]
    fn a_queued_lookup_waits_no_longer_than_its_models_answers_take_upstream() {
        let timeout = Duration::from_millis(250);
        let times = AnswerTimes::new();
        // No answer seen yet: half the timeout.
        assert_eq!(wait_budget(timeout, times.get(7)), timeout / 2);
        // A fast server (a fraction of a millisecond): a lookup behind another at 6 ms a text
        // is skipped, where half the timeout would have let it wait.
        times.record(7, Duration::from_micros(300));
        let fast = wait_budget(timeout, times.get(7));
        assert_eq!(fast, Duration::from_micros(300));
        assert!(predicted_wait(1, 6_000) > fast);
        assert!(predicted_wait(1, 6_000) <= timeout / 2);
        // A slow model keeps half the timeout; the average follows its answers.
        times.record(8, Duration::from_secs(2));
        assert_eq!(wait_budget(timeout, times.get(8)), timeout / 2);
        times.record(7, Duration::from_micros(1_100));
        assert_eq!(times.get(7), Some(Duration::from_micros(400)));
        // Another model in another slot is not affected.
        assert_eq!(times.get(9), None);
    }

    #[test]
    fn a_lookup_counts_the_answers_its_batch_takes_along() {
        let near = |n: u64| Near::Only((0..n).collect());
        // Nothing queued; lookups ahead count one each.
        assert_eq!(texts_ahead(0, 0, &near(9)), 0);
        assert_eq!(texts_ahead(3, 0, &Near::Unknown), 3);
        // The newest answer rides with any lookup; older ones only when found near it.
        assert_eq!(texts_ahead(0, 10, &Near::Unknown), 1);
        assert_eq!(texts_ahead(0, 10, &near(2)), 3);
        assert_eq!(texts_ahead(1, 10, &near(100)), 2 + ALONG);
        // Never more answers than are queued.
        assert_eq!(texts_ahead(0, 2, &near(100)), 2);
    }

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

    fn insert(id: u64) -> Job {
        Job::Insert {
            ns: 1,
            id,
            text: format!("q{id}"),
            vectors: None,
            key: u128::from(id),
            at: Instant::now(),
        }
    }

    fn lookup(text: &str) -> Job {
        near_lookup(text, None).0
    }

    /// A lookup and the receiver of its answer (while it is kept, the lookup still waits).
    fn near_lookup(text: &str, near: Option<Vec<u64>>) -> (Job, oneshot::Receiver<Looked>) {
        let (reply, rx) = oneshot::channel();
        let job = Job::Lookup(LookupJob {
            ns: 1,
            text: text.into(),
            threshold: 0.5,
            near,
            reply,
        });
        (job, rx)
    }

    #[test]
    fn lookups_go_first_with_at_most_the_newest_insert() {
        let mut q = WorkQueue::default();
        assert_eq!(q.done_below(), 1);
        for job in [
            insert(1),
            insert(2),
            lookup("a"),
            insert(3),
            lookup("b"),
            lookup("c"),
            insert(4),
        ] {
            q.push(job);
        }
        let (lookups, inserts) = q.next_batch(2);
        let texts: Vec<&str> = lookups.iter().map(|l| l.text.as_str()).collect();
        assert_eq!(texts, ["a", "b"]);
        assert_eq!(inserts.iter().map(|i| i.1).collect::<Vec<_>>(), [4]);
        assert_eq!(q.done_below(), 1, "insert 1 still waits");
        let (lookups, inserts) = q.next_batch(2);
        assert_eq!(lookups.len(), 1);
        assert_eq!(inserts[0].1, 3);
        // No lookup waiting: one insert at a time, the oldest first.
        let (lookups, inserts) = q.next_batch(2);
        assert!(lookups.is_empty());
        assert_eq!(inserts[0].1, 1);
        assert_eq!(q.done_below(), 2, "insert 2 still waits");
        let (_, inserts) = q.next_batch(2);
        assert_eq!(inserts[0].1, 2);
        assert!(q.is_empty());
        assert_eq!(
            q.done_below(),
            5,
            "everything taken off the channel is done"
        );
    }

    #[test]
    fn lookups_take_the_waiting_answers_the_first_stage_found_near_them() {
        let mut q = WorkQueue::default();
        let mut waiting = Vec::new();
        let mut ask = |q: &mut WorkQueue, text: &str, near: Vec<u64>| {
            let (job, rx) = near_lookup(text, Some(near));
            waiting.push(rx);
            q.push(job);
        };
        for id in 1..=4 {
            q.push(insert(id));
        }
        ask(&mut q, "a", vec![2, 9]);
        ask(&mut q, "b", vec![1]);
        // A lookup whose caller gave up takes nothing along.
        q.push(near_lookup("gone", Some(vec![3])).0);
        // The newest (4), and 1 and 2, older, which the lookups may match; not 3.
        let (lookups, answers) = q.next_batch(8);
        assert_eq!(lookups.len(), 3);
        let mut ids: Vec<u64> = answers.iter().map(|a| a.1).collect();
        ids.sort_unstable();
        assert_eq!(ids, [1, 2, 4]);
        assert_eq!(q.done_below(), 3);
        // Nothing waiting that it may match: the newest alone rides along.
        ask(&mut q, "c", vec![1, 2]);
        q.push(insert(5));
        let (lookups, answers) = q.next_batch(8);
        assert_eq!(lookups.len(), 1);
        assert_eq!(answers.iter().map(|a| a.1).collect::<Vec<_>>(), [5]);
        // At most `batch` answers.
        for id in 6..10 {
            q.push(insert(id));
        }
        ask(&mut q, "d", vec![3, 6, 7, 8]);
        let (_, answers) = q.next_batch(2);
        assert_eq!(answers.iter().map(|a| a.1).collect::<Vec<_>>(), [9, 8]);
        let (_, answers) = q.next_batch(2);
        assert_eq!(answers.iter().map(|a| a.1).collect::<Vec<_>>(), [3]);
        // At most `ALONG` older ones with the newest, the newest first.
        for id in 10..20 {
            q.push(insert(id));
        }
        ask(&mut q, "e", (10..19).collect());
        let (_, answers) = q.next_batch(16);
        let ids: Vec<u64> = answers.iter().map(|a| a.1).collect();
        assert_eq!(ids, [19, 18, 17, 16, 15]);
        assert_eq!(ids.len(), 1 + ALONG);
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
