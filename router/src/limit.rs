//! An adaptive concurrency limit per replica, driven by its measured time to first token: a
//! gradient limiter in the spirit of Envoy's adaptive concurrency filter and Netflix's
//! `Gradient2Limit`, as pure logic with time passed in.
//!
//! A GPU model server batches up to a fixed number of sequences and queues the rest, so once the
//! gateway sends it more than it can batch, every extra request only waits in the server's queue
//! and its time to first token (TTFT) climbs. The limiter compares each replica's recent latency
//! with its unloaded baseline:
//!
//! - **baseline**: measured, as Envoy measures its minimum RTT, by a *probe*: on the first answer
//!   and then every [`LimitPolicy::probe_interval`], the limit drops to [`LimitPolicy::min`]
//!   until [`RECENT`]/2 requests sent since have been answered; their median is the baseline
//!   (one per [`Signal`]: a stream's TTFT and a whole non-streamed answer are different
//!   quantities), lowered between probes by any faster median of [`RECENT`] answers. Inferred
//!   from loaded answers alone (an EWMA of every answer, as in Gradient2) the baseline of a
//!   server that has been queueing since it was first seen is the queue itself, and a long
//!   overload creeps into it within a few hundred answers.
//! - **recent**: the median of up to [`RECENT`] answers' ratios to what their baseline allows:
//!   `tolerance` × it, but never less than [`LimitPolicy::slack`] over it (a fast upstream's
//!   answers vary by more than twice with the host's own load; a model server's queue adds at
//!   least a generation). A median, so one long answer among short ones does not move it; a
//!   queue at the server delays every request, so it moves all of them;
//! - **gradient** = `clamp(1 / recent, 0.5, 1)`: 1 while the server answers within what its
//!   baseline allows, down to 0.5 as its queue grows;
//! - **limit**, between [`LimitPolicy::min`] and [`LimitPolicy::max`] (the replica's configured
//!   `max_concurrency`), moves at most once per round, like TCP's window: a decrease to
//!   `limit · gradient` once [`RECENT`]/2 answers came since the last move (from what is in
//!   flight, when that is under the limit: a limit far above the load does not bind), an
//!   increase by `√limit` once a whole limit's worth of answers came in time while the
//!   replica was busy (at least half the limit in flight: an idle replica's latency says
//!   nothing about more load). Only answers to requests sent after the last move count towards
//!   the next (an answer reports the queue as it was when it was sent), and the limit moves
//!   once per such round, not per answer: that is what keeps it from overshooting.
//!
//! The probe sees an empty queue only if this gateway is the server's only client: with several
//! gateways in front of one server, each probes alone and sees the others' load (Envoy's filter
//! has the same blind spot).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Answers whose median is a recent latency (half of them end a probe).
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
    /// How often the baseline is measured afresh by a probe at the floor.
    pub probe_interval: Duration,
    /// Latency over the baseline that never counts as a queue, however small the baseline
    /// (a fast upstream's answers vary by more than `tolerance` × with the host's own load; a
    /// model server's queue adds at least one generation's time).
    pub slack: Duration,
}

impl LimitPolicy {
    /// Defaults for a replica allowed at most `max` requests in flight.
    pub fn new(max: u32) -> Self {
        Self {
            min: 4.min(max.max(1)),
            max: max.max(1),
            tolerance: 2.0,
            probe_interval: Duration::from_secs(60),
            slack: Duration::from_millis(50),
        }
    }
}

/// Why the limit moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The replica is queueing: down.
    Queue,
    /// It answers in time while busy: up.
    Headroom,
    /// A probe of the baseline began: down to the floor.
    Probe,
    /// The probe measured the baseline: back.
    Probed,
}

/// A change of the limit, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Change {
    /// The limit before.
    pub from: u32,
    /// The limit now.
    pub to: u32,
    /// Why.
    pub why: Why,
    /// The recent latency over what its baseline allows (`tolerance` × it, or the slack over
    /// it) that moved it.
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

/// One [`Signal`]'s baseline: the latest probe's median, lowered by any faster batch since.
#[derive(Debug, Clone, Copy)]
struct Baseline {
    batch: Batch,
    low: Option<f64>,
}

impl Baseline {
    const EMPTY: Self = Self {
        batch: Batch::EMPTY,
        low: None,
    };

    /// Add an answer; the baseline then (the first batch's median before any probe).
    fn add(&mut self, sample: f64) -> Option<f64> {
        self.batch.push(sample);
        if self.batch.is_full() {
            let median = self.batch.median();
            self.low = Some(self.low.map_or(median, |low| low.min(median)));
        }
        self.low
    }

    /// A probe measured `median`: the baseline starts over from it.
    fn probed(&mut self, median: f64) {
        *self = Self {
            batch: Batch::EMPTY,
            low: Some(median),
        };
    }
}

/// A probe of the baseline in progress.
#[derive(Debug, Clone, Copy)]
struct Probe {
    /// When it began: only requests sent since see the floor's short queue.
    since: Instant,
    /// Their answers, per [`Signal`].
    answers: [Batch; 2],
}

#[derive(Debug)]
struct State {
    limit: f64,
    /// Per [`Signal`].
    baseline: [Baseline; 2],
    /// Ratios to what the baseline allows of the latest answers to requests sent since the
    /// limit last moved.
    recent: Batch,
    /// Those answers (not capped at [`RECENT`]).
    since_change: u32,
    /// When the limit last moved.
    changed_at: Option<Instant>,
    probe: Option<Probe>,
    /// When the next probe is due (`None`: at the first answer).
    next_probe: Option<Instant>,
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
            probe_interval: policy.probe_interval,
            slack: policy.slack,
        };
        Self {
            limit: AtomicU32::new(policy.max),
            state: Mutex::new(State {
                limit: f64::from(policy.max),
                baseline: [Baseline::EMPTY; 2],
                recent: Batch::EMPTY,
                since_change: 0,
                changed_at: None,
                probe: None,
                next_probe: None,
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

    /// Whether a probe of the baseline holds the limit at the floor now.
    pub fn probing(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .probe
            .is_some()
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
        if let Some(change) = self.probe(&mut s, signal, sent, now, sample) {
            return change;
        }
        let base = s.baseline[signal.index()].add(sample)?;
        if s.changed_at.is_some_and(|at| sent < at) {
            // Sent before the limit last moved: it reports the queue of the old limit.
            return None;
        }
        // Over 1 means queued: beyond both `tolerance` × the baseline and the slack over it.
        let allowed = (p.tolerance * base).max(base + p.slack.as_secs_f64());
        s.recent.push_ring(sample / allowed);
        s.since_change = s.since_change.saturating_add(1);
        let round = (RECENT / 2) as u32;
        if s.since_change < round {
            // Too few answers under this limit to tell a queue from one slow answer.
            return None;
        }
        let recent = s.recent.median();
        let gradient = (1.0 / recent).clamp(0.5, 1.0);
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
        let why = if gradient < 1.0 {
            Why::Queue
        } else {
            Why::Headroom
        };
        self.moved(&mut s, now, limit, why, recent)
    }

    /// Start, feed or end a probe of the baseline; `Some` (with the change, if any) while one
    /// runs or as it starts or ends, `None` when the answer is for the limit to weigh.
    #[allow(clippy::option_option, reason = "probing, and whether the limit moved")]
    fn probe(
        &self,
        s: &mut State,
        signal: Signal,
        sent: Instant,
        now: Instant,
        sample: f64,
    ) -> Option<Option<Change>> {
        let Some(probe) = &mut s.probe else {
            if s.next_probe.is_some_and(|due| now < due) {
                return None;
            }
            s.probe = Some(Probe {
                since: now,
                answers: [Batch::EMPTY; 2],
            });
            let from = self.current();
            self.limit.store(self.policy.min, Ordering::Release);
            return Some((from != self.policy.min).then_some(Change {
                from,
                to: self.policy.min,
                why: Why::Probe,
                ratio: 0.0,
            }));
        };
        // A probe that gets no answers (a hung server) gives up after an interval.
        let expired = now.saturating_duration_since(probe.since) > self.policy.probe_interval;
        if sent >= probe.since {
            probe.answers[signal.index()].push(sample);
        }
        let done = probe.answers.iter().any(|b| b.len >= RECENT / 2);
        if !done && !expired {
            return Some(None);
        }
        let answers = probe.answers;
        for (baseline, batch) in s.baseline.iter_mut().zip(answers) {
            if batch.len >= RECENT / 2 {
                baseline.probed(batch.median());
            }
        }
        s.probe = None;
        s.next_probe = Some(now + self.policy.probe_interval);
        let limit = s.limit;
        Some(self.moved(s, now, limit, Why::Probed, 0.0))
    }

    /// The limit is now `limit` (a new round starts): store it, and say so if its whole
    /// number changed.
    fn moved(
        &self,
        s: &mut State,
        now: Instant,
        limit: f64,
        why: Why,
        ratio: f64,
    ) -> Option<Change> {
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
            why,
            ratio,
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

    fn probing(l: &AdaptiveLimit) -> bool {
        l.state.lock().unwrap().probe.is_some()
    }

    /// A fresh limit's first probe, at the floor's short queue answering in `latency`.
    fn probed(policy: LimitPolicy, latency: Duration) -> AdaptiveLimit {
        let l = AdaptiveLimit::new(policy);
        let c = answer(&l, Signal::FirstToken, latency, 1).unwrap();
        assert_eq!((c.why, c.to), (Why::Probe, policy.min.clamp(1, policy.max)));
        for _ in 0..RECENT {
            answer(&l, Signal::FirstToken, latency, policy.min);
        }
        assert!(!probing(&l));
        l
    }

    #[test]
    fn the_first_answer_starts_a_probe_at_the_floor_and_its_median_is_the_baseline() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        assert_eq!(l.current(), 64);
        assert!(!l.probing());
        let c = answer(&l, Signal::FirstToken, ms(900), 64).unwrap();
        assert_eq!((c.from, c.to, c.why), (64, 4, Why::Probe));
        assert!(l.probing());
        // Answers to requests sent before the probe (the queue of 64) do not count...
        assert_eq!(feed(&l, 63, ms(900), 64), None);
        assert!(probing(&l));
        // ...those sent since, at four in flight, do: the limit is back, the baseline 100 ms.
        let c = feed(&l, 8, ms(100), 4).unwrap();
        assert_eq!((c.from, c.to, c.why), (4, 64, Why::Probed));
        assert!(!probing(&l));
        let base = l.state.lock().unwrap().baseline[0].low.unwrap();
        assert!((base - 0.1).abs() < 1e-9, "{base}");
        // So 900 ms with 64 in flight reads as the queue it is (once answers to requests sent
        // after the probe come).
        let c = feed(&l, 80, ms(900), 64).unwrap();
        assert_eq!((c.to, c.why), (32, Why::Queue));
    }

    #[test]
    fn the_limit_holds_while_the_replica_answers_at_its_baseline() {
        let l = probed(LimitPolicy::new(64), ms(100));
        assert_eq!(feed(&l, 200, ms(100), 64), None);
        assert_eq!(l.current(), 64, "already at max");
    }

    #[test]
    fn a_growing_ttft_brings_the_limit_down_to_near_what_the_server_batches() {
        // A server that batches 8: TTFT 100 ms up to 8 in flight, then growing with its queue.
        let ttft = |n: u32| ms(100 * u64::from(n.max(8)) / 8);
        let l = probed(LimitPolicy::new(256), ttft(4));
        feed(&l, 100, ttft(8), 8);
        assert_eq!(l.current(), 256, "a lightly used replica's limit stays");
        // Demand is unbounded: the replica always has as many in flight as its limit allows.
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
        let l = probed(LimitPolicy::new(32), ms(100));
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
        let l = probed(LimitPolicy::new(64), ms(100));
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
        let l = probed(LimitPolicy::new(64), ms(100));
        feed(&l, 300, ms(600), 64);
        feed(&l, 20, ms(100), 1);
        let low = l.current();
        assert!(low < 20, "{low}");
        feed(&l, 400, ms(100), 1);
        assert_eq!(l.current(), low, "one in flight says nothing about more");
    }

    #[test]
    fn the_limit_stays_within_its_floor_and_ceiling() {
        let policy = LimitPolicy {
            min: 6,
            ..LimitPolicy::new(16)
        };
        let l = probed(policy, ms(10));
        feed(&l, 200, ms(1_000), 16);
        assert_eq!(l.current(), 6, "the floor");
        let one = AdaptiveLimit::new(LimitPolicy::new(1));
        assert_eq!((one.policy().min, one.current()), (1, 1));
    }

    #[test]
    fn a_fast_upstream_whose_answers_vary_with_the_hosts_load_keeps_its_limit() {
        let l = probed(LimitPolicy::new(64), ms(1));
        // Ten to forty times the 1 ms baseline, but within the 50 ms slack: no queue.
        for i in 0..500u64 {
            answer(&l, Signal::FirstToken, ms(10 + i % 30), 64);
        }
        assert_eq!(l.current(), 64);
        feed(&l, 100, ms(200), 64);
        assert!(l.current() < 64, "200 ms over 1 ms is a queue");
    }

    #[test]
    fn streams_and_whole_answers_keep_their_own_baselines() {
        let l = probed(LimitPolicy::new(32), ms(50));
        // Short TTFTs and long whole answers, interleaved: each is at its own baseline (the
        // whole answers' from their first batch, the probe having measured only streams).
        for _ in 0..200 {
            assert_eq!(answer(&l, Signal::FirstToken, ms(50), 32), None);
            assert_eq!(answer(&l, Signal::Whole, ms(2_000), 32), None);
        }
        assert_eq!(l.current(), 32);
    }

    #[test]
    fn a_long_overload_does_not_creep_into_the_baseline_and_the_next_probe_measures_anew() {
        let policy = LimitPolicy {
            min: 1,
            ..LimitPolicy::new(64)
        };
        let l = probed(policy, ms(100));
        // Five thousand answers at four times the baseline (half a minute of them): the limit
        // stays at its floor.
        feed(&l, 5_000, ms(400), 64);
        assert_eq!(l.current(), 1);
        // A minute on, a probe: the server answers in 400 ms even at the floor, so that is its
        // baseline now, and a busy replica's limit climbs again.
        for _ in 0..3_000 {
            let n = l.current();
            answer(&l, Signal::FirstToken, ms(400), n);
        }
        assert_eq!(l.current(), 64);
    }

    #[test]
    fn answers_to_requests_sent_before_the_limit_moved_do_not_move_it_again() {
        let l = probed(LimitPolicy::new(64), ms(100));
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
    fn a_probe_that_gets_no_answers_gives_up_after_an_interval() {
        let l = AdaptiveLimit::new(LimitPolicy::new(64));
        let t = CLOCK.get();
        l.record(Signal::Whole, t, t, 64);
        assert_eq!(l.current(), 4);
        // Only answers sent before it, for longer than the interval: the limit comes back.
        let late = t + Duration::from_secs(61);
        let c = l.record(Signal::Whole, t, late, 64).unwrap();
        assert_eq!((c.to, c.why), (64, Why::Probed));
    }

    #[test]
    fn the_median_of_a_few_values() {
        assert_eq!(median(&[]), 1.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
