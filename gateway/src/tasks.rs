//! Background work that components own: a component starts its loops on a [`Background`] it is
//! handed, each loop ends when the background is stopped, and shutdown waits for them (as
//! mini-redis's `DbDropGuard` and zero2prod's `run_worker_until_stopped` do). Nothing is spawned
//! bare, so nothing outlives the server.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The components' loops (refreshers, commit and lease loops, fire-and-forget writes) and the
/// signal that stops them.
#[derive(Debug, Clone, Default)]
pub struct Background {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Background {
    /// No tasks yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fires when the background is stopped: loops select on it and return.
    pub fn stopping(&self) -> &CancellationToken {
        &self.stop
    }

    /// Run `task` on the tracker (it must end soon after [`Background::stopping`] fires).
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(task);
    }

    /// Run `job` every `period` until stopped, the first time one period from now (components
    /// load their first state when they are built); a failure is logged (naming `what`) and the
    /// job runs again at the next tick.
    pub fn every<F, Fut, E>(&self, what: &'static str, period: Duration, mut job: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send,
        E: std::fmt::Display,
    {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {
                        if let Err(e) = job().await {
                            tracing::warn!(error = %e, what, "background job failed; retrying at the next tick");
                        }
                    }
                }
            }
        });
    }

    /// Tasks still running.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }

    /// Stop every loop and wait up to `grace` for them to end; `false` when some did not.
    pub async fn stop(&self, grace: Duration) -> bool {
        self.stop.cancel();
        self.tracker.close();
        tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn periodic_jobs_run_until_stopped_and_then_end() {
        let bg = Background::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&runs);
        bg.every("test", Duration::from_secs(1), move || {
            let r = Arc::clone(&r);
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>("always fails, keeps running")
            }
        });
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "at 1, 2 and 3 s");
        assert_eq!(bg.running(), 1);
        assert!(bg.stop(Duration::from_secs(1)).await);
        assert_eq!(bg.running(), 0);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "no runs after the stop");
    }
}
