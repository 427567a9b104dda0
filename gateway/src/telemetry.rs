//! Logging set-up for the binaries (never called by the library itself).

use tracing_subscriber::{fmt, EnvFilter};

/// Install a `tracing` subscriber reading `RUST_LOG` (default `info`). Safe to call twice.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = fmt().with_env_filter(filter).with_target(false).try_init();
}

/// Install the process-wide TLS crypto provider (ring) for HTTPS upstreams and Postgres TLS.
/// Safe to call more than once.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
