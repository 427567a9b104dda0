//! Commit and replay: actual usage goes to the store in batches, leases settle, and commits the
//! shared store could not take wait in a backlog that is replayed when it is back.

use super::*;

impl Budgets {
    pub(super) async fn settle_leases(&self, all: bool) {
        let Some(leases) = &self.leases else {
            return;
        };
        let now_ms = ms(self.clock.now());
        let due = leases.settlements(now_ms, all);
        self.metrics.budget_leases_live.set(leases.live() as i64);
        if due.is_empty() {
            return;
        }
        if self.store_available(now_ms) {
            for batch in due.chunks(COMMIT_BATCH) {
                self.commit_now(batch.to_vec()).await;
            }
        } else {
            for req in due {
                self.enqueue(req);
            }
        }
    }

    /// Commit actual usage and release the rest of the reservation. Never fails: a commit the
    /// shared store cannot take now is queued for replay.
    pub async fn commit(&self, reservation: Reservation, tokens: u64, micros: i64) {
        if let Some((lease, need)) = &reservation.lease {
            // Settled with the lease.
            lease.finish(*need, tokens, micros);
            return;
        }
        let now_ms = ms(self.clock.now());
        let refund = reservation.reserved_tokens.saturating_sub(tokens);
        let req = CommitRequest {
            tenant_id: reservation.tenant_id,
            rid: reservation.rid,
            now_ms,
            dedupe_ms: self.ttl_ms * 2,
            unreserved: false,
            tokens,
            micros,
            counters: reservation.counters,
            lease: None,
            refunds: reservation
                .token_rates
                .into_iter()
                .map(|(k, pm)| (k, pm, refund))
                .collect(),
        };
        if reservation.local {
            let _ = self.local.commit(&req).await;
            // The spend happened: add it to the shared counters once they are reachable.
            let mut replay = req;
            replay.refunds.clear();
            replay.unreserved = true;
            self.enqueue(replay);
            return;
        }
        if !self.shared {
            let _ = self.store.commit(&req).await;
            return;
        }
        if !self.store_available(now_ms) {
            self.enqueue(req);
            return;
        }
        self.pending.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::error::SendError(req)) = self.commits.send(req) {
            // No batcher (it only stops with the process): commit directly.
            self.pending.fetch_sub(1, Ordering::SeqCst);
            self.commit_now(vec![req]).await;
        }
    }

    /// Send commits to the shared store in batches: one script call per tenant for whatever
    /// accumulated while the previous batch was in flight (under load, many requests per round
    /// trip; at low load, one). Ends when `stop` fires, after sending what is queued.
    pub(super) async fn run_commits(self: Arc<Self>, stop: CancellationToken) {
        let Some(mut rx) = self
            .commits_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        loop {
            let first = tokio::select! {
                first = rx.recv() => first,
                _ = stop.cancelled() => rx.try_recv().ok(),
            };
            let Some(first) = first else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < COMMIT_BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let n = batch.len();
            self.commit_now(batch).await;
            self.pending.fetch_sub(n, Ordering::SeqCst);
        }
    }

    pub(super) async fn commit_now(&self, batch: Vec<CommitRequest>) {
        let started = Instant::now();
        let result = self.store.commit_batch(&batch).await;
        self.metrics
            .budget_store_seconds
            .with_label_values(&["commit"])
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            let now_ms = ms(self.clock.now());
            self.down_until_ms
                .store(now_ms + STORE_BACKOFF_MS, Ordering::Relaxed);
            tracing::warn!(error = %e, commits = batch.len(), "budget commit failed; queued for replay");
            for req in batch {
                self.enqueue(req);
            }
        }
    }

    /// Wait (up to `grace`) until every commit sent to the shared store was answered, so a
    /// shutdown leaves no reservation to expire.
    pub async fn flush(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        self.settle_leases(true).await;
        while self.pending.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if self.shared && self.backlog_len() > 0 {
            self.replay_backlog().await;
        }
    }

    pub(super) fn enqueue(&self, req: CommitRequest) {
        let mut q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_BACKLOG {
            if let Some(dropped) = q.pop_front() {
                tracing::error!(rid = %dropped.rid, "budget commit backlog full; dropping the oldest commit");
            }
        }
        q.push_back(req);
        self.metrics.budget_backlog.set(q.len() as i64);
    }

    /// Replay queued commits into the shared store, oldest first, until it fails again.
    pub async fn replay_backlog(&self) {
        loop {
            let next: Vec<CommitRequest> = {
                let q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
                q.iter().take(COMMIT_BATCH).cloned().collect()
            };
            if next.is_empty() {
                return;
            }
            match self.store.commit_batch(&next).await {
                Ok(_) => {
                    let mut q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
                    let n = next.len().min(q.len());
                    q.drain(..n);
                    self.metrics.budget_backlog.set(q.len() as i64);
                    self.down_until_ms.store(0, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "budget store still unreachable");
                    return;
                }
            }
        }
    }

    /// Commits waiting for the shared store.
    pub fn backlog_len(&self) -> usize {
        self.backlog.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}
