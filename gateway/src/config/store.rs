//! `[store]`: where tenants, keys and policies live.

use serde::{Deserialize, Serialize};

/// Where tenants and keys live.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite://path/to/file.db` (embedded default, created and migrated at start) or
    /// `postgres://…` (migrated by `gateway migrate`).
    pub url: String,
    /// How often each replica reloads the key table, in milliseconds (revocation latency).
    pub key_refresh_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://gateway.db".into(),
            key_refresh_ms: 1000,
        }
    }
}
