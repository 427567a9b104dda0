//! Logging set-up for the binaries (never called by the library itself).

use tracing_subscriber::{fmt, EnvFilter};

/// Install a `tracing` subscriber reading `RUST_LOG` (default `info`). Colours only on a
/// terminal: a log file or collector gets plain text (and each line is cheaper to write).
/// Safe to call twice.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let _ = fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi)
        .try_init();
}

/// Install the process-wide TLS crypto provider (ring) for HTTPS upstreams and Postgres TLS.
/// Safe to call more than once.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
