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
    /// Most client connections open at once; at the cap the listener stops accepting (new
    /// connections wait in the kernel's backlog) until one closes.
    pub max_connections: usize,
    /// Deadline for a request's headers, in milliseconds, counted from when the connection
    /// starts waiting for them; so it is also how long an idle keep-alive connection stays open.
    pub header_read_timeout_ms: u64,
    /// Deadline for a request's whole body, in milliseconds, from when the handler starts
    /// reading it (408 after).
    pub body_read_timeout_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 4 * 1024 * 1024,
            shutdown_grace_secs: 30,
            max_connections: 4096,
            header_read_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
        }
    }
}
