//! Protection of the upstreams when they struggle, as pure logic (time and randomness passed
//! in): a retry budget (Envoy's `retry_budget`: retries in flight at most a share of the active
//! requests, never fewer than a floor) and adaptive client-side throttling (the SRE book's: once
//! the backends reject, reject locally with probability `max(0, (requests − K·accepts) /
//! (requests + 1))` over a sliding window), and [`Drain`], the rate at which a tier frees slots,
//! so a request that would wait longer than it may is refused at once instead of after the wait.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::window::{allowance, Buckets, SlidingCounts};

/// Retries in flight at most `ratio` of the active requests, never fewer than `min`.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min: u32,
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    active: AtomicU32,
    retries: AtomicU32,
}

/// One active request, counted until dropped.
#[derive(Debug)]
pub struct Active(Arc<Counts>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One retry in flight, counted until dropped.
#[derive(Debug)]
pub struct Retry(Arc<Counts>);

impl Drop for Retry {
    fn drop(&mut self) {
        self.0.retries.fetch_sub(1, Ordering::AcqRel);
    }
}

impl RetryBudget {
    /// A budget of `ratio` (0..=1) of the active requests, at least `min` retries.
    pub fn new(ratio: f64, min: u32) -> Self {
        Self {
            ratio: ratio.clamp(0.0, 1.0),
            min,
            counts: Arc::default(),
        }
    }

    /// Count a request as active until the guard is dropped.
    pub fn request(&self) -> Active {
        self.counts.active.fetch_add(1, Ordering::AcqRel);
        Active(Arc::clone(&self.counts))
    }

    /// The retries the budget allows now.
    pub fn allowed(&self) -> u32 {
        let active = self.counts.active.load(Ordering::Acquire);
        allowance(active, self.ratio, self.min)
    }

    /// A retry, if the budget has room for one more in flight.
    pub fn try_retry(&self) -> Option<Retry> {
        let allowed = self.allowed();
        self.counts
            .retries
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < allowed).then_some(n + 1)
            })
            .ok()
            .map(|_| Retry(Arc::clone(&self.counts)))
    }

    /// (active requests, retries in flight).
    pub fn in_flight(&self) -> (u32, u32) {
        (
            self.counts.active.load(Ordering::Acquire),
            self.counts.retries.load(Ordering::Acquire),
        )
    }
}

/// Adaptive throttling of one upstream group: requests (all, including those rejected here)
/// and accepts (not rejected by the upstream as overloaded) over a sliding window.
#[derive(Debug)]
pub struct Throttle {
    /// `K`: how many requests per accept are let through before rejecting locally (2: the
    /// upstream may reject up to half; 0 turns throttling off).
    k: f64,
    /// Requests the window must hold before anything is rejected (a handful of rejections on a
    /// quiet tier is no overload).
    min_requests: u32,
    buckets: Buckets,
    counts: Mutex<SlidingCounts>,
}

impl Throttle {
    /// A throttle with multiplier `k` over `window`, acting once the window holds
    /// `min_requests`.
    pub fn new(k: f64, window: Duration, min_requests: u32, now: Instant) -> Self {
        Self {
            k: k.max(0.0),
            min_requests,
            buckets: Buckets::new(window, now),
            counts: Mutex::new(SlidingCounts::default()),
        }
    }

    fn slot(&self, now: Instant) -> u64 {
        self.buckets.slot(now)
    }

    /// The probability of rejecting a request locally now.
    pub fn reject_probability(&self, now: Instant) -> f64 {
        if self.k == 0.0 {
            return 0.0;
        }
        let (requests, accepts) = self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .totals(self.slot(now));
        if requests < self.min_requests {
            return 0.0;
        }
        let (requests, accepts) = (f64::from(requests), f64::from(accepts));
        ((requests - self.k * accepts) / (requests + 1.0)).max(0.0)
    }

    /// Whether to reject a request locally, given `draw` uniform in [0, 1). A rejected request
    /// counts as a request (not an accept), as the SRE book's throttle counts them.
    pub fn reject(&self, now: Instant, draw: f64) -> bool {
        let reject = draw < self.reject_probability(now);
        if reject {
            self.record(now, false);
        }
        reject
    }

    /// Record a request the upstream answered: `accepted` unless it rejected it as overloaded.
    pub fn record(&self, now: Instant, accepted: bool) {
        if self.k == 0.0 {
            return;
        }
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).add(
            self.slot(now),
            1,
            u32::from(accepted),
        );
    }
}

/// How fast a tier's replicas free slots: completions per second over roughly the last
/// [`Drain::WINDOW`], from the replicas' running completion count read at times passed in.
/// With it, a request arriving at a full tier behind `queued` others can be told at once that
/// it would wait about `queued / rate`, and be refused then rather than after the whole wait.
#[derive(Debug, Default)]
pub struct Drain {
    /// (time, completed count) readings, oldest first, at least [`Drain::STEP`] apart.
    readings: Mutex<std::collections::VecDeque<(Instant, u64)>>,
}

impl Drain {
    /// The span the rate is measured over.
    pub const WINDOW: Duration = Duration::from_secs(3);
    /// The least time between two readings kept.
    pub const STEP: Duration = Duration::from_millis(100);

    /// Note that `completed` requests had completed by `now`; returns the completion rate per
    /// second over the readings kept (`None` until they span [`Drain::STEP`]).
    pub fn observe(&self, now: Instant, completed: u64) -> Option<f64> {
        let mut r = self.readings.lock().unwrap_or_else(|p| p.into_inner());
        if r.back()
            .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= Self::STEP)
        {
            r.push_back((now, completed));
        }
        // Readings older than the window go (all of them after a quiet spell: the last
        // saturation's rate says nothing about this one).
        while r.len() > 1
            && r.front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > Self::WINDOW)
        {
            r.pop_front();
        }
        let (at, then) = *r.front()?;
        let span = now.saturating_duration_since(at).as_secs_f64();
        (span >= Self::STEP.as_secs_f64()).then(|| completed.saturating_sub(then) as f64 / span)
    }

    /// How long a request behind `ahead` others would wait at `rate` completions per second
    /// (`None` for no rate: nothing completed lately, which tells nothing).
    pub fn expected_wait(ahead: u32, rate: Option<f64>) -> Option<Duration> {
        let rate = rate.filter(|r| *r > 0.0)?;
        Some(Duration::from_secs_f64(f64::from(ahead) / rate))
    }
}

/// A share of each key's requests (a tenant's) that may take a costlier path (falling back to
/// the large tier), never fewer than a floor, over a sliding window.
#[derive(Debug)]
pub struct ShareBudget {
    share: f64,
    floor: u32,
    buckets: Buckets,
    /// Per key: (requests, takes) per bucket.
    counts: Mutex<HashMap<String, SlidingCounts>>,
}

impl ShareBudget {
    /// `share` (0..=1) of a key's requests over `window`, at least `floor`.
    pub fn new(share: f64, floor: u32, window: Duration, now: Instant) -> Self {
        Self {
            share: share.clamp(0.0, 1.0),
            floor,
            buckets: Buckets::new(window, now),
            counts: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, now: Instant) -> u64 {
        self.buckets.slot(now)
    }

    /// Count one request of `key`; whether it is the first one seen of `key`.
    pub fn request(&self, key: &str, now: Instant) -> bool {
        let slot = self.slot(now);
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        match counts.get_mut(key) {
            Some(c) => {
                c.add(slot, 1, 0);
                false
            }
            None => {
                let mut c = SlidingCounts::default();
                c.add(slot, 1, 0);
                counts.insert(key.to_owned(), c);
                true
            }
        }
    }

    /// Take one from `key`'s budget if it has room: takes in the window, this one included, at
    /// most `max(floor, share × requests)`.
    pub fn try_take(&self, key: &str, now: Instant) -> bool {
        let slot = self.slot(now);
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let c = counts.entry(key.to_owned()).or_default();
        let (requests, taken) = c.totals(slot);
        if taken < allowance(requests, self.share, self.floor) {
            c.add(slot, 0, 1);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn retries_in_flight_stay_within_a_share_of_active_requests_with_a_floor() {
        let b = RetryBudget::new(0.2, 3);
        let active: Vec<Active> = (0..10).map(|_| b.request()).collect();
        assert_eq!(b.allowed(), 3, "20% of 10 is 2: the floor of 3 applies");
        let r: Vec<Retry> = (0..3).map(|_| b.try_retry().unwrap()).collect();
        assert!(b.try_retry().is_none(), "a fourth retry waits");
        drop(r);
        let more: Vec<Active> = (0..40).map(|_| b.request()).collect();
        assert_eq!(b.allowed(), 10, "20% of 50");
        let r: Vec<Retry> = (0..10).map(|_| b.try_retry().unwrap()).collect();
        assert!(b.try_retry().is_none());
        assert_eq!(b.in_flight(), (50, 10));
        drop((r, more, active));
        assert_eq!(b.in_flight(), (0, 0));
        let none = RetryBudget::new(0.0, 0);
        let _a = none.request();
        assert!(none.try_retry().is_none(), "a zero budget never retries");
    }

    #[test]
    fn the_drain_rate_is_completions_per_second_over_the_recent_window() {
        let d = Drain::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(d.observe(t0, 0), None, "one reading is no rate");
        assert_eq!(d.observe(at(50), 5), None, "under one step");
        // 40 per second for a second.
        let rate = d.observe(at(1_000), 40).unwrap();
        assert!((rate - 40.0).abs() < 1e-9, "{rate}");
        for ms in (1_100..=6_000).step_by(100) {
            d.observe(at(ms), 40 + (ms - 1_000) / 100);
        }
        // Then 10 per second: the old readings are gone after the window.
        let rate = d.observe(at(6_000), 90).unwrap();
        assert!((rate - 10.0).abs() < 0.5, "{rate}");
        // A minute of quiet: the old readings say nothing about the next saturation.
        assert_eq!(d.observe(at(66_000), 95), None);
        assert!(d
            .observe(at(66_500), 100)
            .is_some_and(|r| (r - 10.0).abs() < 1e-9));
        assert_eq!(
            Drain::expected_wait(20, Some(10.0)),
            Some(Duration::from_secs(2))
        );
        assert_eq!(Drain::expected_wait(20, Some(0.0)), None);
        assert_eq!(Drain::expected_wait(20, None), None);
    }

    #[test]
    fn a_share_budget_allows_its_floor_then_a_share_of_requests_per_key() {
        let t0 = Instant::now();
        let b = ShareBudget::new(0.25, 2, Duration::from_secs(10), t0);
        assert!(b.request("acme", t0), "the first of its key");
        for _ in 0..3 {
            assert!(!b.request("acme", t0));
        }
        assert!(
            b.try_take("acme", t0) && b.try_take("acme", t0),
            "the floor"
        );
        assert!(
            !b.try_take("acme", t0),
            "25% of 4 is 1, under the floor of 2"
        );
        for _ in 0..8 {
            b.request("acme", t0);
        }
        assert!(b.try_take("acme", t0), "25% of 12 is 3");
        assert!(!b.try_take("acme", t0));
        assert!(b.try_take("other", t0), "per key");
        assert!(
            b.try_take("acme", t0 + Duration::from_secs(11)),
            "the window forgets"
        );
    }

    #[test]
    fn the_throttle_rejects_as_the_upstream_stops_accepting_and_forgets_after_the_window() {
        let t0 = Instant::now();
        let t = Throttle::new(2.0, Duration::from_secs(10), 10, t0);
        assert_eq!(t.reject_probability(t0), 0.0);
        let quiet = Throttle::new(2.0, Duration::from_secs(10), 10, t0);
        for _ in 0..9 {
            quiet.record(t0, false);
        }
        assert_eq!(quiet.reject_probability(t0), 0.0, "under min_requests");
        quiet.record(t0, false);
        assert!(quiet.reject_probability(t0) > 0.9);
        // Healthy: every request accepted; p stays 0.
        for _ in 0..100 {
            t.record(t0, true);
        }
        assert_eq!(t.reject_probability(t0), 0.0);
        // The upstream starts rejecting everything: p rises once requests exceed 2 × accepts.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..100 {
            t.record(t1, false);
        }
        assert_eq!(
            t.reject_probability(t1),
            0.0,
            "200 requests, 100 accepts: at 2×"
        );
        for _ in 0..200 {
            t.record(t1, false);
        }
        let p = t.reject_probability(t1);
        assert!((p - 200.0 / 401.0).abs() < 1e-9, "{p}");
        assert!(
            t.reject(t1, 0.0) && !t.reject(t1, 0.99),
            "a draw under p rejects"
        );
        // 11 s later the window holds nothing: no rejection.
        let later = t1 + Duration::from_secs(11);
        assert_eq!(t.reject_probability(later), 0.0);
        let off = Throttle::new(0.0, Duration::from_secs(10), 0, t0);
        for _ in 0..10 {
            off.record(t0, false);
        }
        assert_eq!(off.reject_probability(t0), 0.0, "K = 0 turns it off");
    }
}
