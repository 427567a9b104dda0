//! Which cache layers a tenant uses, and its cache policy as stored.

use serde::{Deserialize, Serialize};

/// Which layers a tenant uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// No caching.
    Off,
    /// Exact repeats only.
    Exact,
    /// Exact repeats, then paraphrases (the semantic layer).
    Semantic,
}

impl CacheMode {
    /// Lowercase name, as stored and typed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Exact => "exact",
            Self::Semantic => "semantic",
        }
    }
}

/// A tenant's cache policy; fields left out take the config's defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CachePolicy {
    /// Which layers to use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<CacheMode>,
    /// Time to live of this tenant's cached answers, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_secs: Option<u64>,
    /// The point on the verifier's held-out curve: the precision a semantic hit must have
    /// (higher: fewer, safer hits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_precision: Option<f64>,
    /// Also cache sampled requests (temperature absent or above 0): a repeat then gets the same
    /// sample instead of a new one.
    #[serde(default)]
    pub any_temperature: bool,
    /// Also cache requests with tools (exact layer only; the tools are part of the key).
    #[serde(default)]
    pub tools: bool,
}
