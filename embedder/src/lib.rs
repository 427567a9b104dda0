//! Embedding models, the vector index and the learned models of the gateway's cache.
//!
//! - [`bert`]: the transformer sentence embedder (all-MiniLM-L6-v2 on the CPU).
//! - [`forward`]: its forward pass on the CPU, on [`matmul`]'s few-row products; [`model`]: the
//!   model's files as the CPU and GPU passes read them.
//! - `cuda` (feature `cuda`): the transformer, the static table and the vector index on an
//!   NVIDIA GPU (CUDA libraries loaded at run time; NVRTC kernels, cuBLAS products).
//! - [`eval`]: precision / recall / hit rate of a similarity threshold on labelled pairs.
//! - [`gate`]: the semantic cache's first stage (rarity-weighted token overlap with stored
//!   questions; a lookup sharing too little with all of them is a miss without the transformer).
//! - [`student`]: the learned first stage (the static vector mapped to predict the transformer's;
//!   a lookup far from every stored question is a miss without the transformer).
//! - [`index`]: the semantic cache's vector index (namespaced, LRU + TTL, brute-force scan).
//! - [`verifier`]: the second-stage verifier of cache hits (pair features, linear models stacked
//!   under gradient-boosted trees, grouped cross-validation).
//! - [`learn`]: the learners it is built from (trees, logistic regression, PCA, grouped folds).
//! - [`semantic`]: the semantic cache's decision (nearest stored questions, then the verifier).
//! - [`static_embed`]: the static embedding table distilled from the transformer (microseconds).
//! - [`tier`]: the small/large tier classifier behind `model: "auto"` (text features, two
//!   logistic regressions, a held-out curve grouped by subject; RouteLLM's figures).
//!
//! No HTTP, no storage: a pure library.

pub mod bert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod eval;
pub mod forward;
pub mod gate;
pub mod index;
pub mod learn;
pub mod matmul;
pub mod model;
pub mod semantic;
pub mod static_embed;
pub mod student;
pub mod tier;
pub mod verifier;
