//! `[prices.MODEL]`: USD per 1M tokens by served model name.

use serde::{Deserialize, Serialize};

/// One model's prices in USD per 1M tokens (e.g. `input = 0.15`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// Uncached input tokens.
    pub input: f64,
    /// Output tokens.
    pub output: f64,
    /// Cached input tokens (default: the input price).
    #[serde(default)]
    pub cached_input: Option<f64>,
}
