//! `[ledger]`: the cost ledger's writer.

use serde::{Deserialize, Serialize};

/// The cost ledger: one row per request, written in batches off the request path.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Write the ledger (into the store's database). Off: usage events are only logged.
    pub enabled: bool,
    /// Directory of the append-only spool used while the database is unreachable.
    pub spool_dir: std::path::PathBuf,
    /// Most rows per database write.
    pub batch_rows: usize,
    /// Longest a row waits before its batch is written, ms.
    pub flush_ms: u64,
    /// Rows queued in memory before overflow goes straight to the spool.
    pub queue_capacity: usize,
    /// A database write slower than this is treated as failed and spooled, ms.
    pub write_timeout_ms: u64,
    /// Append every row to a local journal before queueing it, so a killed process loses no
    /// row (see `ledger::journal`). Off: a kill -9 loses the rows queued and in flight.
    pub journal: bool,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            spool_dir: "spool".into(),
            batch_rows: 16000,
            flush_ms: 200,
            queue_capacity: 100_000,
            write_timeout_ms: 2_000,
            journal: true,
        }
    }
}
