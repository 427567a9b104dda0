//! The ledger writer: a bounded queue in front of one task that writes batches (what arrives
//! within `flush_ms` of a batch's first row, at most `batch_rows`) and never slows or loses a
//! request's row.
//!
//! - `record` (on the request path) only `try_send`s; if the queue is full the row goes straight
//!   to the spool file instead of waiting.
//! - A batch that the database refuses or does not take within `write_timeout_ms` is appended to
//!   the spool (fsynced). While the spool holds rows, new batches are appended behind them, so
//!   rows reach the database in order; every second the writer tries to replay the spool.
//! - Shutdown drains the queue and writes (or spools) what is left.
//! - With `ledger.journal` (default), `record` first appends the row to the journal, and a
//!   row's journal entry is dropped only once the row is in the database or the spool, so a
//!   process killed mid-way loses nothing: the next start spools what the journal holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, IntCounterVec, IntGauge};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::journal::Journal;
use super::spool::Spool;
use super::LedgerStore;
use crate::config::LedgerConfig;
use crate::metrics::Metrics;
use crate::usage::{UsageEvent, UsageSink};

/// The metrics the writer keeps.
#[derive(Debug, Clone)]
struct WriterMetrics {
    queue: IntGauge,
    spooled: IntGauge,
    rows: IntCounterVec,
    write: Histogram,
}

impl WriterMetrics {
    fn new(m: &Metrics) -> Self {
        Self {
            queue: m.ledger_queue.clone(),
            spooled: m.ledger_spooled.clone(),
            rows: m.ledger_rows.clone(),
            write: m.ledger_write.clone(),
        }
    }

    fn count(&self, outcome: &str, n: usize) {
        self.rows.with_label_values(&[outcome]).inc_by(n as u64);
    }
}

/// A queued row and the journal segment it was appended to (none without a journal, or when
/// the append failed).
type Queued = (Option<u64>, UsageEvent);

/// The request path's side of the ledger: journal and queue a row, never wait.
#[derive(Debug)]
pub struct LedgerSink {
    tx: mpsc::Sender<Queued>,
    spool: Arc<Spool>,
    journal: Option<Arc<Journal>>,
    metrics: WriterMetrics,
}

impl UsageSink for LedgerSink {
    fn record(&self, event: UsageEvent) {
        let segment = self.journal.as_ref().and_then(|j| match j.append(&event) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(error = %e, request_id = %event.request_id,
                    "ledger journal append failed: this row is only in memory until written");
                None
            }
        });
        match self.tx.try_send((segment, event)) {
            Ok(()) => self.metrics.queue.inc(),
            Err(
                mpsc::error::TrySendError::Full((segment, e))
                | mpsc::error::TrySendError::Closed((segment, e)),
            ) => {
                // No fsync on the request path: the writer's next spool append or replay syncs.
                match self.spool.append_unsynced(std::slice::from_ref(&e)) {
                    Ok(()) => {
                        self.metrics.count("overflow_spooled", 1);
                        self.metrics.spooled.set(self.spool.rows() as i64);
                        if let Some(j) = &self.journal {
                            j.done(segment);
                        }
                    }
                    Err(err) => {
                        self.metrics.count("lost", 1);
                        tracing::error!(error = %err, request_id = %e.request_id, event = ?e,
                            "ledger queue full and spool unwritable: row only in this log line");
                    }
                }
            }
        }
    }
}

/// Handle on the writer task.
#[derive(Debug)]
pub struct LedgerWriter {
    handle: JoinHandle<()>,
    stop: CancellationToken,
}

impl LedgerWriter {
    /// Start the writer; returns the sink for the request path.
    pub fn start(
        store: Arc<dyn LedgerStore>,
        config: &LedgerConfig,
        metrics: &Metrics,
    ) -> std::io::Result<(Arc<LedgerSink>, Self)> {
        let spool = Arc::new(Spool::open(&config.spool_dir)?);
        let journal = if config.journal {
            let (journal, left) = Journal::open(&config.spool_dir)?;
            if !left.is_empty() {
                // A previous run died with these rows unconfirmed: they go to the spool (whose
                // replay skips the ones the database has) before anything new.
                spool.append(&left)?;
                tracing::warn!(
                    rows = left.len(),
                    "ledger journal of a previous run recovered into the spool"
                );
            }
            journal.recovered()?;
            Some(Arc::new(journal))
        } else {
            None
        };
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let metrics = WriterMetrics::new(metrics);
        metrics.spooled.set(spool.rows() as i64);
        let stop = CancellationToken::new();
        let task = Arc::new(Task {
            replay_lock: tokio::sync::Mutex::new(()),
            store,
            spool: Arc::clone(&spool),
            journal: journal.clone(),
            metrics: metrics.clone(),
            batch_rows: config.batch_rows,
            flush: Duration::from_millis(config.flush_ms),
            write_timeout: Duration::from_millis(config.write_timeout_ms),
        });
        let handle = tokio::spawn(task.run(rx, stop.clone()));
        Ok((
            Arc::new(LedgerSink {
                tx,
                spool,
                journal,
                metrics,
            }),
            Self { handle, stop },
        ))
    }

    /// Drain the queue, write or spool what is left, and stop.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.handle.await;
    }
}

struct Task {
    replay_lock: tokio::sync::Mutex<()>,
    store: Arc<dyn LedgerStore>,
    spool: Arc<Spool>,
    journal: Option<Arc<Journal>>,
    metrics: WriterMetrics,
    batch_rows: usize,
    flush: Duration,
    write_timeout: Duration,
}

/// Database writes in flight at once: one can be in Postgres while the next batch is built.
const IN_FLIGHT: usize = 2;

impl Task {
    async fn run(self: Arc<Self>, mut rx: mpsc::Receiver<Queued>, stop: CancellationToken) {
        let mut replay_tick = tokio::time::interval(Duration::from_secs(1));
        replay_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut inflight = tokio::task::JoinSet::new();
        loop {
            let mut batch = Vec::new();
            tokio::select! {
                biased;
                _ = stop.cancelled() => {
                    while let Ok(e) = rx.try_recv() {
                        batch.push(e);
                    }
                    self.metrics.queue.set(0);
                    while inflight.join_next().await.is_some() {}
                    self.settle(batch).await;
                    if self.spool.rows() > 0 {
                        self.replay().await;
                    }
                    return;
                }
                next = rx.recv() => match next {
                    Some(e) => batch.push(e),
                    None => return,
                },
                _ = replay_tick.tick() => {
                    if let Some(j) = &self.journal {
                        if let Err(e) = j.rotate() {
                            tracing::warn!(error = %e, "ledger journal rotation failed");
                        }
                    }
                    if self.spool.rows() > 0 {
                        while inflight.join_next().await.is_some() {}
                        self.replay().await;
                    }
                    continue;
                }
            }
            // The batch is what arrives within `flush` of its first row: one timer, then the
            // queue drained at once. Waiting on the queue row by row instead woke this task
            // and re-armed its timer for every row the request path queued. A queue already
            // holding a full batch is written at once, so the batch size caps nothing.
            // A shutdown ends the wait: the batch is written now and the next turn drains the rest.
            if rx.len() + 1 < self.batch_rows {
                tokio::select! {
                    () = tokio::time::sleep(self.flush) => {}
                    () = stop.cancelled() => {}
                }
            }
            while batch.len() < self.batch_rows {
                match rx.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) => break,
                }
            }
            self.metrics.queue.set(rx.len() as i64);
            while inflight.len() >= IN_FLIGHT {
                inflight.join_next().await;
            }
            if self.spool.rows() > 0 {
                // Rows are waiting on disk: settle what is in flight, then keep disk order.
                while inflight.join_next().await.is_some() {}
                self.settle(batch).await;
            } else {
                let task = Arc::clone(&self);
                inflight.spawn(async move { task.settle(batch).await });
            }
        }
    }

    /// Write or spool `batch`; once its rows are safe there, drop their journal entries.
    async fn settle(&self, batch: Vec<Queued>) {
        let (segments, rows): (Vec<Option<u64>>, Vec<UsageEvent>) = batch.into_iter().unzip();
        if self.write_or_spool(rows).await {
            if let Some(j) = &self.journal {
                j.done(segments.into_iter().flatten());
            }
        }
    }

    /// Write `rows` to the database within the write timeout.
    async fn write(&self, rows: &[UsageEvent]) -> bool {
        let started = Instant::now();
        match tokio::time::timeout(self.write_timeout, self.store.insert(rows)).await {
            Ok(Ok(_)) => {
                self.metrics.write.observe(started.elapsed().as_secs_f64());
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, rows = rows.len(), "ledger write failed; spooling");
                false
            }
            Err(_) => {
                tracing::warn!(rows = rows.len(), "ledger write timed out; spooling");
                false
            }
        }
    }

    /// Write `batch` (in chunks of `batch_rows`), or spool what could not be written. While the
    /// spool holds rows, it is replayed first and new rows queue behind it on disk. Whether every
    /// row is now in the database or the spool.
    async fn write_or_spool(&self, mut batch: Vec<UsageEvent>) -> bool {
        if batch.is_empty() {
            return true;
        }
        if self.spool.rows() > 0 {
            self.replay().await;
        }
        if self.spool.rows() == 0 {
            let mut written = 0;
            for chunk in batch.chunks(self.batch_rows) {
                if !self.write(chunk).await {
                    break;
                }
                written += chunk.len();
            }
            self.metrics.count("written", written);
            if written == batch.len() {
                return true;
            }
            batch.drain(..written);
        }
        self.to_spool(batch).await
    }

    async fn to_spool(&self, batch: Vec<UsageEvent>) -> bool {
        let spool = Arc::clone(&self.spool);
        let n = batch.len();
        let result =
            tokio::task::spawn_blocking(move || spool.append(&batch).map(|()| batch)).await;
        let safe = match result {
            Ok(Ok(_)) => {
                self.metrics.count("spooled", n);
                true
            }
            Ok(Err(e)) => {
                let kept = if self.journal.is_some() {
                    "kept in the journal for the next start"
                } else {
                    "lost"
                };
                self.metrics.count("lost", n);
                tracing::error!(error = %e, rows = n, "ledger spool append failed: rows {kept}");
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "ledger spool task failed");
                false
            }
        };
        self.metrics.spooled.set(self.spool.rows() as i64);
        safe
    }

    /// Replay the spool in order; drop what was written. One replay at a time (the truncation
    /// offset must come from the read it follows).
    async fn replay(&self) {
        let _one_at_a_time = self.replay_lock.lock().await;
        let spool = Arc::clone(&self.spool);
        let Ok(Ok((rows, offset))) = tokio::task::spawn_blocking(move || spool.read()).await else {
            tracing::error!("ledger spool unreadable");
            return;
        };
        for chunk in rows.chunks(self.batch_rows) {
            if !self.write(chunk).await {
                return;
            }
        }
        let spool = Arc::clone(&self.spool);
        let n = rows.len() as u64;
        match tokio::task::spawn_blocking(move || spool.consume(offset, n)).await {
            Ok(Ok(())) => {
                self.metrics.count("replayed", rows.len());
                tracing::info!(rows = rows.len(), "ledger spool replayed");
            }
            _ => tracing::error!(
                "ledger spool truncation failed; rows will be replayed again (idempotent)"
            ),
        }
        self.metrics.spooled.set(self.spool.rows() as i64);
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shutdown_writes_a_waiting_batch_without_waiting_out_the_flush() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
        let ledger = super::super::open(&url).await.unwrap();
        let config = LedgerConfig {
            spool_dir: dir.path().join("spool"),
            flush_ms: 60_000,
            ..LedgerConfig::default()
        };
        let metrics = Metrics::new().unwrap();
        let (sink, writer) = LedgerWriter::start(Arc::clone(&ledger), &config, &metrics).unwrap();
        sink.record(super::super::journal::tests::event("r1"));
        // The writer has the row and waits for the rest of its batch (a minute).
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ledger.count().await.unwrap(), 0, "nothing written yet");
        let started = Instant::now();
        writer.shutdown().await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "shutdown waited {:?}",
            started.elapsed()
        );
        assert_eq!(
            ledger.count().await.unwrap(),
            1,
            "the waiting row was written"
        );
    }
}
