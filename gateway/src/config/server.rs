//! `[server]`: the HTTP listener and request limits.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// HTTP listener and request limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Largest accepted request body, in bytes (413 above).
    pub max_body_bytes: usize,
    /// How long graceful shutdown waits for in-flight requests, in seconds.
    pub shutdown_grace_secs: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 4 * 1024 * 1024,
            shutdown_grace_secs: 30,
        }
    }
}
