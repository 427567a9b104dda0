//! An adaptive concurrency limit per replica, driven by its measured time to first token: a
//! gradient limiter in the spirit of Netflix's `Gradient2Limit` and Envoy's adaptive
//! concurrency filter, as pure logic with time passed in.
//!
//! A GPU model server batches up to a fixed number of sequences and queues the rest, so once the
//! gateway sends it more than it can batch, every extra request only waits in the server's queue
//! and its time to first token (TTFT) climbs. The limiter compares each replica's recent latency
//! with its unloaded baseline:
//!
//! - **baseline**: per [`Signal`] (a stream's TTFT and a whole non-streamed answer are
//!   different quantities), the lowest median of [`RECENT`] consecutive answers seen over the
//!   last [`LimitPolicy::baseline_window`], as Envoy's filter takes its minimum RTT: the limiter
//!   itself keeps bringing the queue down, so some batch in the window saw it short, and an
//!   overload, however long, does not creep into the baseline (an EWMA of every answer, as in
//!   Gradient2, learns the overload as normal within a few hundred answers). A server that
//!   really got slower is learnt once the window has passed.
//! - **recent**: the median of up to [`RECENT`] answers' ratios to their baseline (a median,
//!   so one long answer among short ones does not move it; a queue at the server delays every
//!   request, so it moves all of them);
//! - **gradient** = `clamp(tolerance / recent, 0.5, 1)`: 1 while the server answers within
//!   `tolerance` × its baseline, down to 0.5 as its queue grows;
//! - **limit**, between [`LimitPolicy::min`] and [`LimitPolicy::max`] (the replica's configured
//!   `max_concurrency`), moves at most once per round, like TCP's window: a decrease to
//!   `limit · gradient` once [`RECENT`]/2 answers came since the last move (from what is in
//!   flight, when that is under the limit: a limit far above the load does not bind), an
//!   increase by `√limit` once a whole limit's worth of answers came in time while the
//!   replica was busy (at least half the limit in flight: an idle replica's latency says
//!   nothing about more load). Only answers to requests sent after the last move count towards
//!   the next (an answer reports the queue as it was when it was sent), and the limit moves
//!   once per such round, not per answer: that is what keeps it from overshooting.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Answers whose median is a recent latency (and one batch of the baseline).
pub const RECENT: usize = 16;

/// What a latency sample measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// A streamed answer's time to its first token.
    FirstToken,
    /// A non-streamed answer's time to its whole body (the server sends nothing before).
    Whole,
}

impl Signal {
    fn index(self) -> usize {
        match self {
            Self::FirstToken => 0,
            Self::Whole => 1,
        }
    }
}

/// How the limit adapts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitPolicy {
    /// The limit never falls below this.
    pub min: u32,
    /// Nor rises above this (the replica's configured maximum; also the starting point).
    pub max: u32,
    /// How much slower than its baseline a replica may answer before the limit falls (2.0:
    /// twice the baseline TTFT).
    pub tolerance: f64,
    /// How long a batch's median may stand as the baseline.
    pub baseline_window: Duration,
}

impl LimitPolicy {
    /// Defaults for a replica allowed at most `max` requests in flight.
    pub fn new(max: u32) -> Self {
        Self {
            min: 4.min(max.max(1)),
            max: max.max(1),
            tolerance: 2.0,
            baseline_window: Duration::from_secs(60),
        }
    }
}

/// A change of the limit, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Change {
    /// The limit before.
    pub from: u32,
    /// The limit now.
    pub to: u32,
    /// The recent latency over its baseline that moved it.
    pub ratio: f64,
}

/// Up to [`RECENT`] values.
#[derive(Debug, Clone, Copy)]
struct Batch {
    values: [f64; RECENT],
    len: usize,
    /// Where the next value goes once full, as a ring.
    next: usize,
}

impl Batch {
    const EMPTY: Self = Self {
        values: [0.0; RECENT],
        len: 0,
        next: 0,
    };

    /// Add a value; a full batch starts over.
    fn push(&mut self, value: f64) {
        if self.len == RECENT {
            self.len = 0;
        }
        self.values[self.len] = value;
        self.len += 1;
    }

    /// Add a value; a full batch drops its oldest.
    fn push_ring(&mut self, value: f64) {
        self.values[self.next] = value;
        self.next = (self.next + 1) % RECENT;
        self.len = (self.len + 1).min(RECENT);
    }

    fn is_full(&self) -> bool {
        self.len == RECENT
    }

    fn median(&self) -> f64 {
        median(&self.values[..self.len])
    }
}

/// One [`Signal`]'s baseline: batches of raw answers, and the lowest batch median of each
/// tenth of the window (bounded memory at any answer rate).
#[derive(Debug)]
struct Baseline {
    batch: Batch,
    /// (start of a tenth of the window, lowest batch median completed in it), oldest first.
    lows: VecDeque<(Instant, f64)>,
}

impl Baseline {
    /// Add an answer at `now`; the baseline then, `None` until a first batch is complete.
    fn add(&mut self, sample: f64, now: Instant, window: Duration) -> Option<f64> {
        self.batch.push(sample);
        if self.batch.is_full() {
            let median = self.batch.median();
            match self.lows.back_mut() {
                Some((start, low)) if now.saturating_duration_since(*start) < window / 10 => {
                    *low = low.min(median);
                }
                _ => self.lows.push_back((now, median)),
            }
        }
        // Tenths older than the window go, but the latest always stands.
        while self.lows.len() > 1
            && self
                .lows
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            self.lows.pop_front();
        }
        self.lows.iter().map(|(_, m)| *m).reduce(f64::min)
    }
}

#[derive(Debug)]
struct State {
    limit: f64,
    /// Per [`Signal`].
    baseline: [Baseline; 2],
    /// Ratios to the baseline of the latest answers to requests sent since the limit last
    /// moved.
    recent: Batch,
    /// Those answers (not capped at [`RECENT`]).
    since_change: u32,
    /// When the limit last moved.
    changed_at: Option<Instant>,
}

/// One replica's adaptive concurrency limit. The current limit is an atomic read on the hot
/// path; answers take a short lock.
#[derive(Debug)]
pub struct AdaptiveLimit {
    policy: LimitPolicy,
    limit: AtomicU32,
    state: Mutex<State>,
}

impl AdaptiveLimit {
    /// A limit starting at `policy.max`.
    pub fn new(policy: LimitPolicy) -> Self {
        let policy = LimitPolicy {
            min: policy.min.clamp(1, policy.max.max(1)),
            max: policy.max.max(1),
            tolerance: policy.tolerance.max(1.0),
            baseline_window: policy.baseline_window,
        };
        let baseline = || Baseline {
            batch: Batch::EMPTY,
            lows: VecDeque::new(),
        };
        Self {
            limit: AtomicU32::new(policy.max),
            state: Mutex::new(State {
                limit: f64::from(policy.max),
                baseline: [baseline(), baseline()],
                recent: Batch::EMPTY,
                since_change: 0,
                changed_at: None,
            }),
            policy,
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> LimitPolicy {
        self.policy
    }

    /// Requests the replica may have in flight now.
    pub fn current(&self) -> u32 {
        self.limit.load(Ordering::Acquire)
    }

    /// Record one answer: the request was sent at `sent` and answered (its first token, or
    /// the whole of it) at `now`, with `in_flight` requests out to the replica then (this one
    /// included). Returns the change when the whole-number limit moved.
    pub fn record(
        &self,
        signal: Signal,
        sent: Instant,
        now: Instant,
        in_flight: u32,
    ) -> Option<Change> {
        let sample = now.saturating_duration_since(sent).as_secs_f64().max(1e-6);
        let p = self.policy;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let base = s.baseline[signal.index()].add(sample, now, p.baseline_window)?;
        if s.changed_at.is_some_and(|at| sent < at) {
            // Sent before the limit last moved: it reports the queue of the old limit.
            return None;
        }
        s.recent.push_ring(sample / base);
        s.since_change = s.since_change.saturating_add(1);
        let round = (RECENT / 2) as u32;
        if s.since_change < round {
            // Too few answers under this limit to tell a queue from one slow answer.
            return None;
        }
        let recent = s.recent.median();
        let gradient = (p.tolerance / recent).clamp(0.5, 1.0);
        let limit = s.limit;
        let load = f64::from(in_flight.max(1));
        let next = if gradient < 1.0 {
            limit.min(load) * gradient
        } else if s.since_change >= (limit as u32).max(round) && load >= limit / 2.0 {
            limit + limit.sqrt()
        } else {
            // Not a whole limit's worth of answers yet, or not used enough to learn whether
            // more would be fine.
            return None;
        };
        let limit = next.clamp(f64::from(p.min), f64::from(p.max));
        if limit == s.limit {
            // Pinned at the floor or the ceiling: no move, so the round goes on.
            return None;
        }
        s.limit = limit;
        s.since_change = 0;
        s.recent = Batch::EMPTY;
        s.changed_at = Some(now);
        let (from, to) = (self.current(), limit.round() as u32);
        if from == to {
            return None;
        }
        self.limit.store(to, Ordering::Release);
        Some(Change {
            from,
            to,
            ratio: recent,
        })
    }
}

/// The median of a few values (the mean of the two middle ones for an even count).
fn median(values: &[f64]) -> f64 {
    let mut v = [0.0; RECENT];
    let v = &mut v[..values.len()];
    v.copy_from_slice(values);
    v.sort_unstable_by(f64::total_cmp);
    match v.len() {
        0 => 1.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    thread_local! {
        /// The tests' clock (starting an hour in, so answers can have been sent before the
        /// first).
        static CLOCK: Cell<Instant> = Cell::new(Instant::now() + Duration::from_secs(3_600));
    }

    /// One answer of `signal`, now, to a request sent `latency` ago, with `in_flight` out: a
    /// replica kept that busy answers one every `latency / in_flight` (Little's law).
    fn answer(
        l: &AdaptiveLimit,
        signal: Signal,
        latency: Duration,
        in_flight: u32,
    ) -> Option<Change> {
        let now = CLOCK.get() + latency / in_flight.max(1);
        CLOCK.set(now);
        l.record(signal, now - latency, now, in_flight)
    }

    /// Feed `n` answers of `latency` with `in_flight` requests out; the last change.
    fn feed(l: &AdaptiveLimit, n: usize, latency: Duration, in_flight: u32) -> Option<Change> {
        let mut last = None;
        for _ in 0..n {
            if let Some(c) = answer(l, Signal::FirstToken, latency, in_flight) {
                last = Some(c);
            }
        }
        last
    }

    #[test]
    fn the_limit_holds_while_the_replica_answers_at_its_baseline() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        assert_eq!(l.current(), 64);
        assert_eq!(feed(&l, 200, ms(100), 64), None);
        assert_eq!(l.current(), 64, "already at max");
    }

    #[test]
    fn a_growing_ttft_brings_the_limit_down_to_near_what_the_server_batches() {
        let l = AdaptiveLimit::new(LimitPolicy::new(256));
        feed(&l, 100, ms(100), 8);
        assert_eq!(l.current(), 256, "a lightly used replica's limit stays");
        // A server that batches 8: TTFT 100 ms up to 8 in flight, then growing with its queue.
        // Demand is unbounded: the replica always has as many in flight as its limit allows.
        let ttft = |n: u32| ms(100 * u64::from(n.max(8)) / 8);
        let mut seen = Vec::new();
        for _ in 0..2_000 {
            let n = l.current();
            answer(&l, Signal::FirstToken, ttft(n), n);
            seen.push(l.current());
        }
        // It halves once per round trip (answers to requests sent before a move are not
        // counted again): 256 of them, then 128, ...
        assert!(seen[..700].iter().any(|&n| n < 40), "falls fast: {seen:?}");
        // It settles where TTFT stays within about twice the unloaded one.
        let tail = &seen[1_000..];
        assert!(tail.iter().all(|&n| (8..=32).contains(&n)), "{tail:?}");
    }

    #[test]
    fn one_slow_answer_among_fast_ones_does_not_move_the_limit() {
        let l = AdaptiveLimit::new(LimitPolicy::new(32));
        feed(&l, 50, ms(100), 32);
        for i in 0..200 {
            let latency = if i % 5 == 0 { ms(900) } else { ms(100) };
            assert_eq!(
                answer(&l, Signal::FirstToken, latency, 32),
                None,
                "sample {i}"
            );
        }
        assert_eq!(l.current(), 32);
    }

    #[test]
    fn the_limit_climbs_back_once_latency_recovers_while_the_replica_is_busy() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        feed(&l, 40, ms(100), 64);
        feed(&l, 300, ms(600), 64);
        let low = l.current();
        assert!(low < 20, "{low}");
        // Recovered and fully used: the limit grows step by step.
        for _ in 0..1_500 {
            let n = l.current();
            answer(&l, Signal::FirstToken, ms(100), n);
        }
        assert_eq!(l.current(), 64);
        // A lightly used replica does not grow its limit.
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        feed(&l, 40, ms(100), 64);
        feed(&l, 300, ms(600), 64);
        feed(&l, 20, ms(100), 1);
        let low = l.current();
        assert!(low < 20, "{low}");
        feed(&l, 400, ms(100), 1);
        assert_eq!(l.current(), low, "one in flight says nothing about more");
    }

    #[test]
    fn the_limit_stays_within_its_floor_and_ceiling() {
        let l = AdaptiveLimit::new(LimitPolicy {
            min: 6,
            ..LimitPolicy::new(16)
        });
        feed(&l, 40, ms(10), 16);
        feed(&l, 200, ms(1_000), 16);
        assert_eq!(l.current(), 6, "the floor");
        let one = AdaptiveLimit::new(LimitPolicy::new(1));
        assert_eq!((one.policy().min, one.current()), (1, 1));
    }

    #[test]
    fn streams_and_whole_answers_keep_their_own_baselines() {
        let l = AdaptiveLimit::new(LimitPolicy::new(32));
        // Short TTFTs and long whole answers, interleaved: each is at its own baseline.
        for _ in 0..200 {
            assert_eq!(answer(&l, Signal::FirstToken, ms(50), 32), None);
            assert_eq!(answer(&l, Signal::Whole, ms(2_000), 32), None);
        }
        assert_eq!(l.current(), 32);
    }

    #[test]
    fn a_baseline_learnt_during_an_overload_is_forgotten_when_the_server_recovers() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        // The first answers come from an overloaded server (baseline 1 s).
        feed(&l, 50, ms(1_000), 64);
        assert_eq!(l.current(), 64);
        // It recovers to 100 ms: the baseline falls with the first batch, so a later return
        // to 1 s reads as the overload it is.
        feed(&l, 32, ms(100), 64);
        feed(&l, 30, ms(1_000), 64);
        assert!(l.current() < 64, "limit {}", l.current());
    }

    #[test]
    fn a_long_overload_does_not_creep_into_the_baseline_but_a_slower_server_is_learnt() {
        let l = AdaptiveLimit::new(LimitPolicy {
            min: 1,
            ..LimitPolicy::new(64)
        });
        feed(&l, 32, ms(100), 64);
        // Five thousand answers at four times the baseline (half a minute of them): the
        // limit stays at its floor.
        feed(&l, 5_000, ms(400), 64);
        assert_eq!(l.current(), 1);
        // Past the baseline window (a minute) with nothing faster, 400 ms is the new normal:
        // a busy replica's limit climbs again.
        for _ in 0..2_000 {
            let n = l.current();
            answer(&l, Signal::FirstToken, ms(400), n);
        }
        assert_eq!(l.current(), 64);
    }

    #[test]
    fn answers_to_requests_sent_before_the_limit_moved_do_not_move_it_again() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        feed(&l, 40, ms(100), 64);
        let t = CLOCK.get();
        // 64 requests sent at t, all answered late: the first 8 move the limit once.
        let mut changes = 0;
        for i in 0..64u64 {
            let at = t + ms(800 + i);
            changes += usize::from(l.record(Signal::FirstToken, t, at, 64).is_some());
        }
        assert_eq!((changes, l.current()), (1, 32), "one move: 64 × 0.5");
        // Requests sent after the move count again.
        let later = t + ms(2_000);
        for i in 0..8u64 {
            l.record(Signal::FirstToken, later, later + ms(800 + i), 32);
        }
        assert_eq!(l.current(), 16);
    }

    #[test]
    fn the_median_of_a_few_values() {
        assert_eq!(median(&[]), 1.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
