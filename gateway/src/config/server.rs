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
    /// How connections are served: `per-core` (default), one single-worker runtime per thread,
    /// each accepting from its own socket on `listen` and running the requests of its
    /// connections with its own upstream connections; `shared`, one work-stealing runtime for
    /// all.
    pub runtime: Runtime,
    /// Threads serving requests in the `per-core` runtime; 0 (default) is one per core.
    pub threads: usize,
}

/// `server.runtime`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// One single-worker runtime per thread: a connection and every request on it stay on one
    /// thread, with no hand-offs between workers (measured: 3–17% less CPU per request at saturation, ~15% more latency at one
    /// connection; docs/benchmarks.md).
    PerCore,
    /// One work-stealing runtime (the process's own): connections and requests move between
    /// its workers, so one connection's streams (HTTP/2) spread over every core.
    Shared,
}

impl ServerConfig {
    /// Threads that serve requests on the `per-core` runtime, each with its own connection
    /// pools: `threads`, or the number of cores; 0 for the `shared` runtime (no lanes).
    pub fn lanes(&self) -> usize {
        match self.runtime {
            Runtime::Shared => 0,
            Runtime::PerCore if self.threads > 0 => self.threads,
            Runtime::PerCore => {
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
            }
        }
    }
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
            runtime: Runtime::PerCore,
            threads: 0,
        }
    }
}
