//! `[cache]`: the exact and semantic response cache.

use serde::{Deserialize, Serialize};

use crate::types::cache::CacheMode;

/// The response cache. A tenant without its own policy gets [`CacheConfig::mode`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Default for tenants without their own policy: `off`, `exact` or `semantic` (exact first,
    /// then semantic).
    pub mode: CacheMode,
    /// Most bytes of cached responses held by this replica.
    pub max_bytes: u64,
    /// Responses larger than this are not cached.
    pub max_entry_bytes: u64,
    /// Default time to live of a cached response, seconds.
    pub ttl_secs: u64,
    /// Default point on the verifier's held-out curve: the precision a semantic hit must have.
    pub min_precision: f64,
    /// Also share exact answers through Redis (one URL, or several cluster seed nodes), so a
    /// repeat hits on every replica. Empty: each replica caches on its own.
    pub redis_urls: Vec<String>,
    /// Longest wait for the shared layer before a lookup counts as a miss, ms.
    pub redis_timeout_ms: u64,
    /// The semantic layer's model and limits.
    pub semantic: SemanticConfig,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            mode: CacheMode::Semantic,
            max_bytes: 256 << 20,
            max_entry_bytes: 1 << 20,
            ttl_secs: 3600,
            min_precision: 0.9,
            redis_urls: Vec::new(),
            redis_timeout_ms: 50,
            semantic: SemanticConfig::default(),
        }
    }
}

/// Where the semantic layer computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedDevice {
    /// The GPU when usable, else the CPU.
    Auto,
    /// Always the CPU.
    Cpu,
    /// The GPU, or refuse to start.
    Cuda,
}

/// How the transformer keeps its matrices on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpuPrecision {
    /// `int8` where the CPU has AVX-512 VNNI, else `f16`.
    Auto,
    /// Half-precision floats (vectors within a cosine of 1e-6 of the checkpoint's `f32`).
    F16,
    /// 8-bit integers (AMX or AVX-512 VNNI, else AVX2 at ~15% faster than `f16`, else a
    /// plain integer loop ten times slower).
    Int8,
}

/// The semantic cache layer: embedding model, index and verifier.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SemanticConfig {
    /// Where embeddings and the vector index run: `auto` (the GPU when this build has the `cuda`
    /// feature and a GPU is present, else the CPU), `cpu`, or `cuda` (a startup error when no
    /// GPU can be used).
    pub device: EmbedDevice,
    /// How the transformer keeps its matrices when it runs on the CPU: `auto` (`int8` where
    /// the CPU has AVX-512 VNNI, else `f16`), `f16` or `int8`. On Zen 4 `int8` runs a 16-token
    /// question's pass in about half the time; its vectors are within a cosine of ~6e-4 of the
    /// checkpoint's for a question (1e-6 with `f16`), which changes the verifier's decision
    /// for 0.4–0.7% of dev pairs, the precision within 0.25 points (docs/cache.md).
    pub precision: CpuPrecision,
    /// Directory of all-MiniLM-L6-v2 (`scripts/fetch-model.sh`). Without it the semantic layer
    /// is off (logged at start); the exact layer still works.
    pub model_dir: std::path::PathBuf,
    /// A verifier artefact from `gateway embed train-verifier` (default: the shipped one).
    pub verifier: Option<std::path::PathBuf>,
    /// Most questions held in the vector index (each ~2 KB for its vector plus ~0.4 KB per
    /// token for the verifier: ~8 KB for a 15-token question).
    pub capacity: usize,
    /// Nearest neighbours handed to the verifier.
    pub candidates: usize,
    /// Least cosine similarity for a neighbour to be a candidate at all.
    pub min_cosine: f32,
    /// The first stage: a question whose rarity-weighted token overlap (weighted Jaccard of the
    /// token sets) with every stored question of its namespace is below this is a miss without
    /// running the transformer (microseconds instead of milliseconds on a CPU). 0 (the
    /// default) turns it off: at 0.15 it keeps 99.8% of the verifier's hits on Quora questions
    /// but only about two thirds on reworded chat instructions, which share few words
    /// (docs/cache.md).
    pub gate_overlap: f32,
    /// The learned first stage: a question whose student vector (the static table's sentence
    /// vector mapped to predict the transformer's) has a cosine below this with every stored
    /// question of its namespace is a miss without the transformer. 0 (the default) turns it
    /// off. Held out by source at 0.45, it keeps 98.8% of the verifier's hits on Quora
    /// questions, 96.6% on reworded chat instructions and all on the other two corpora, and
    /// decides ~57% of the misses in a namespace of 500 varied questions (docs/cache.md).
    /// At most one of `gate_overlap` and `gate_student` may be set.
    pub gate_student: f32,
    /// The embedding threads' scheduling niceness on Linux (0–19): the model's work (lookups
    /// and indexing answers) yields the CPU to the threads answering requests, so a request
    /// the first stage decided, or one with no semantic lookup at all, does not wait behind an
    /// embedding. 0 gives them the requests' priority.
    pub nice: i32,
    /// Run the model's threads in Linux's idle scheduling class (`SCHED_IDLE`) while the model
    /// runs on the CPU: they get a core only when no other thread wants it, and a request's
    /// thread that wakes takes the core back at once (niceness only shares it out by weight).
    /// Where the kernel refuses, or on a GPU (whose feeding thread must not starve), `nice`
    /// applies.
    pub idle_class: bool,
    /// Most requests embedded in one batch.
    pub batch: usize,
    /// Longest a request waits for the semantic lookup before it is treated as a miss, ms.
    pub lookup_timeout_ms: u64,
    /// Lookups queued beyond this are skipped (a miss) rather than queued: the embedding model
    /// must not become the gateway's bottleneck. Answers waiting to be indexed have their own
    /// bound of the same size (past it they are not indexed).
    pub max_queue: usize,
    /// Load the model when the gateway starts (when `cache.mode` is `semantic`) instead of on
    /// the first request that needs the semantic layer. Off by default: a gateway whose traffic
    /// never uses it stays small (~200 MB less resident), and until the model is loaded (about
    /// two seconds on a CPU) requests are served by the exact layer alone.
    pub preload: bool,
}

impl Default for SemanticConfig {
    fn default() -> Self {
        Self {
            device: EmbedDevice::Auto,
            precision: CpuPrecision::Auto,
            model_dir: "models/all-MiniLM-L6-v2".into(),
            verifier: None,
            capacity: 50_000,
            candidates: 4,
            min_cosine: 0.7,
            gate_overlap: 0.0,
            gate_student: 0.0,
            nice: 10,
            idle_class: true,
            batch: 16,
            lookup_timeout_ms: 250,
            max_queue: 32,
            preload: false,
        }
    }
}
