//! `[tiers.small]`, `[tiers.large]`: the replicas of each tier.

use secrecy::SecretString;
use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};
use crate::types::TokenizerKind;

/// One tier: a list of interchangeable replicas serving the same model.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// Tokenizer used to count tokens when the upstream reports none (`cl100k_base`,
    /// `o200k_base`).
    pub tokenizer: Option<TokenizerKind>,
    /// The replicas.
    pub replicas: Vec<ReplicaConfig>,
}

/// One upstream replica.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Name used in logs, metrics and the `x-gateway-replica` header.
    pub name: String,
    /// OpenAI-compatible base URL, including `/v1` (e.g. `http://10.0.0.5:8000/v1`).
    pub url: String,
    /// Model name the upstream expects.
    pub model: String,
    /// Environment variable holding the upstream API key (sent as a bearer token).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Most requests in flight to this replica from this gateway.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
    /// The server's Prometheus endpoint (vLLM, SGLang: `http://10.0.0.5:8000/metrics`),
    /// scraped every `upstream.scrape_interval_ms` for its running and waiting requests and
    /// KV-cache use, which prefix-affinity choice weighs; unset: not scraped (hosted providers).
    #[serde(default)]
    pub metrics_url: Option<String>,
}

fn default_max_concurrency() -> u32 {
    256
}

impl ReplicaConfig {
    /// The upstream API key, read from the environment variable the config names.
    pub fn api_key(&self, field: &str) -> Result<Option<SecretString>, ConfigError> {
        let Some(var) = &self.api_key_env else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Some(SecretString::from(v))),
            _ => Err(invalid(
                format!("{field}.api_key_env"),
                format!("environment variable {var} is not set"),
            )),
        }
    }
}
