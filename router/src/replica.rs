//! Replica choice within one tier: least in-flight requests among healthy replicas, bounded by
//! each replica's maximum concurrency, with passive health: a per-replica circuit breaker trips
//! on consecutive failures or on an error ratio over a sliding window (the two breakers of
//! linkerd2-proxy), cools down, then is half-open and exactly one request probes it (success
//! closes the breaker, failure trips another cooldown) while every other request keeps going
//! elsewhere. Each replica's concurrency limit is fixed (`max_concurrency`) or adaptive
//! ([`crate::limit`]: it falls as the replica's time to first token grows).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::limit::{AdaptiveLimit, Change, LimitPolicy, Signal};
use crate::window::{Buckets, SlidingCounts};

/// How passive health checking reacts to failures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthPolicy {
    /// Consecutive failures that take a replica out of rotation.
    pub failure_threshold: u32,
    /// How long a tripped replica stays out before one probe request is let through (half-open).
    pub cooldown: Duration,
    /// Share of failed requests over [`HealthPolicy::ratio_window`] that takes a replica out
    /// (a replica failing every other request never fails 3 times in a row).
    pub error_ratio: f64,
    /// The sliding window the error ratio is measured over.
    pub ratio_window: Duration,
    /// Requests the window must hold before the ratio can trip the breaker.
    pub min_requests: u32,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            cooldown: Duration::from_secs(10),
            error_ratio: 0.5,
            ratio_window: Duration::from_secs(10),
            min_requests: 20,
        }
    }
}

/// Why a replica's breaker opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trip {
    /// [`HealthPolicy::failure_threshold`] failures in a row.
    ConsecutiveFailures,
    /// At least [`HealthPolicy::error_ratio`] of the window's requests failed.
    ErrorRatio,
    /// The half-open probe failed.
    ProbeFailed,
}

impl Trip {
    /// Every reason.
    pub const ALL: [Trip; 3] = [
        Self::ConsecutiveFailures,
        Self::ErrorRatio,
        Self::ProbeFailed,
    ];

    /// Lowercase name (metrics label, admin API).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConsecutiveFailures => "consecutive_failures",
            Self::ErrorRatio => "error_ratio",
            Self::ProbeFailed => "probe_failed",
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::ConsecutiveFailures => 1,
            Self::ErrorRatio => 2,
            Self::ProbeFailed => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::ConsecutiveFailures),
            2 => Some(Self::ErrorRatio),
            3 => Some(Self::ProbeFailed),
            _ => None,
        }
    }
}

/// A replica's outcomes over the error-ratio window: (successes, failures) per bucket.
#[derive(Debug, Default)]
struct Outcomes(SlidingCounts);

impl Outcomes {
    fn record(&mut self, slot: u64, failed: bool) {
        self.0.add(slot, u32::from(!failed), u32::from(failed));
    }

    /// (requests, failures) in the window ending at bucket `slot`.
    fn totals(&self, slot: u64) -> (u32, u32) {
        let (ok, failed) = self.0.totals(slot);
        (ok + failed, failed)
    }
}

/// One upstream replica's live routing state. Identity and limits are fixed; counters are atomics
/// so the hot path never takes a lock.
#[derive(Debug)]
pub struct Replica {
    name: String,
    max_concurrency: u32,
    /// Adaptive limit under `max_concurrency`, when enabled.
    adaptive: Option<AdaptiveLimit>,
    in_flight: AtomicU32,
    /// Leases ended so far (the tier's drain rate is read from it).
    completed: AtomicU64,
    consecutive_failures: AtomicU32,
    /// Nanoseconds after the set's epoch until which the replica is out; 0 = not tripped.
    down_until_ns: AtomicU64,
    /// The token of the lease probing a half-open replica; 0 = no probe in flight.
    probe: AtomicU64,
    /// Outcomes over the error-ratio window.
    outcomes: Mutex<Outcomes>,
    /// Why the breaker last opened ([`Trip::code`]); 0 while closed.
    tripped_by: AtomicU8,
}

impl Replica {
    /// The replica's configured name (used in logs, metrics and headers).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Requests currently being served by this replica through this gateway.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests it may have in flight now: its adaptive limit, or `max_concurrency`.
    pub fn limit(&self) -> u32 {
        self.adaptive
            .as_ref()
            .map_or(self.max_concurrency, AdaptiveLimit::current)
    }

    /// Reserve one concurrency slot unless the replica is full.
    fn try_acquire(&self) -> bool {
        let limit = self.limit();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }
}

/// Where a replica's circuit breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breaker {
    /// Taking requests.
    Closed,
    /// Tripped, cooling down: no requests.
    Open,
    /// Cooled down: one probe request at a time.
    HalfOpen,
}

impl Breaker {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// A point-in-time view of one replica, for metrics and the admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSnapshot {
    /// Replica name.
    pub name: String,
    /// Requests in flight.
    pub in_flight: u32,
    /// Whether the replica is currently eligible for new requests.
    pub healthy: bool,
    /// Consecutive failures seen so far.
    pub consecutive_failures: u32,
    /// Its breaker.
    pub breaker: Breaker,
    /// Why the breaker last opened (`None` while closed).
    pub tripped_by: Option<Trip>,
    /// Requests and failures in the error-ratio window.
    pub window: (u32, u32),
    /// Requests it may have in flight now (its adaptive limit, or `max_concurrency`).
    pub limit: u32,
    /// Its configured `max_concurrency`.
    pub max_concurrency: u32,
    /// Whether its limit adapts to its latency.
    pub adaptive: bool,
    /// Whether a probe of its unloaded latency holds the limit at the floor now.
    pub probing: bool,
}

/// The replicas of one tier.
#[derive(Debug)]
pub struct ReplicaSet {
    replicas: Vec<Arc<Replica>>,
    policy: HealthPolicy,
    epoch: Instant,
    /// Bucket numbers of the error-ratio window.
    buckets: Buckets,
    /// Rotates the starting point of the scan so ties spread round-robin.
    next: AtomicUsize,
    /// Source of probe tokens (never 0).
    probes: AtomicU64,
}

/// A concurrency slot on one replica. Dropping it frees the slot; report the outcome with
/// [`ReplicaSet::record_success`] / [`ReplicaSet::record_failure`].
#[derive(Debug)]
pub struct Lease {
    replica: Arc<Replica>,
    index: usize,
    /// When the slot was taken (the start of the latency the adaptive limit measures).
    acquired: Instant,
    /// Non-zero when this lease is the probe of a half-open replica.
    probe: u64,
}

impl Lease {
    /// The leased replica.
    pub fn replica(&self) -> &Replica {
        &self.replica
    }

    /// Index of the replica within its set (stable for the life of the set).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this lease is the one probe of a half-open replica.
    pub fn is_probe(&self) -> bool {
        self.probe != 0
    }

    /// Give up the probe slot, if this lease holds it.
    fn end_probe(&self) {
        if self.probe != 0 {
            let _ = self.replica.probe.compare_exchange(
                self.probe,
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A probe that ended without an outcome (the request was abandoned) frees the slot for
        // the next one.
        self.end_probe();
        self.replica.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.replica.completed.fetch_add(1, Ordering::Relaxed);
    }
}

impl ReplicaSet {
    /// Build a set from `(name, max_concurrency)` pairs.
    pub fn new(replicas: impl IntoIterator<Item = (String, u32)>, policy: HealthPolicy) -> Self {
        let replicas = replicas
            .into_iter()
            .map(|(name, max_concurrency)| {
                Arc::new(Replica {
                    name,
                    max_concurrency: max_concurrency.max(1),
                    adaptive: None,
                    in_flight: AtomicU32::new(0),
                    completed: AtomicU64::new(0),
                    consecutive_failures: AtomicU32::new(0),
                    down_until_ns: AtomicU64::new(0),
                    probe: AtomicU64::new(0),
                    outcomes: Mutex::new(Outcomes::default()),
                    tripped_by: AtomicU8::new(0),
                })
            })
            .collect();
        let epoch = Instant::now();
        Self {
            replicas,
            buckets: Buckets::new(policy.ratio_window, epoch),
            policy,
            epoch,
            next: AtomicUsize::new(0),
            probes: AtomicU64::new(1),
        }
    }

    /// Give every replica an adaptive concurrency limit under its `max_concurrency`, its policy
    /// made from that maximum by `policy`. Call before the set is shared.
    pub fn with_adaptive_limits(mut self, policy: impl Fn(u32) -> LimitPolicy) -> Self {
        for replica in &mut self.replicas {
            if let Some(r) = Arc::get_mut(replica) {
                r.adaptive = Some(AdaptiveLimit::new(policy(r.max_concurrency)));
            }
        }
        self
    }

    /// Leases ended so far on all its replicas (requests that freed a slot).
    pub fn completed(&self) -> u64 {
        self.replicas
            .iter()
            .map(|r| r.completed.load(Ordering::Relaxed))
            .sum()
    }

    /// Number of replicas in the set.
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// Whether the set has no replicas.
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    fn nanos_since_epoch(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The error-ratio window's bucket at `now`.
    fn slot(&self, now: Instant) -> u64 {
        self.buckets.slot(now)
    }

    fn is_healthy(&self, replica: &Replica, now: Instant) -> bool {
        self.state(replica, now) != Breaker::Open
    }

    fn state(&self, replica: &Replica, now: Instant) -> Breaker {
        let down_until = replica.down_until_ns.load(Ordering::Acquire);
        if down_until == 0 {
            Breaker::Closed
        } else if self.nanos_since_epoch(now) >= down_until {
            Breaker::HalfOpen
        } else {
            Breaker::Open
        }
    }

    /// Whether replica `index` may take a request now: not in `exclude`, circuit not open, a
    /// half-open one's probe not taken, below its concurrency limit.
    fn eligible(&self, index: usize, now: Instant, exclude: &[usize]) -> bool {
        let replica = &self.replicas[index];
        if exclude.contains(&index) {
            return false;
        }
        let open = match self.state(replica, now) {
            Breaker::Closed => false,
            Breaker::Open => true,
            Breaker::HalfOpen => replica.probe.load(Ordering::Acquire) != 0,
        };
        !open && replica.in_flight() < replica.limit()
    }

    /// Take a slot on replica `index` (and its probe, when half-open); `None` when another
    /// request took the last slot or the probe first.
    fn lease(&self, index: usize, now: Instant) -> Option<Lease> {
        let replica = &self.replicas[index];
        let probe = if self.state(replica, now) == Breaker::HalfOpen {
            let token = self.probes.fetch_add(1, Ordering::Relaxed);
            replica
                .probe
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
                .ok()?;
            token
        } else {
            0
        };
        if replica.try_acquire() {
            return Some(Lease {
                replica: Arc::clone(replica),
                index,
                acquired: now,
                probe,
            });
        }
        if probe != 0 {
            let _ = replica
                .probe
                .compare_exchange(probe, 0, Ordering::AcqRel, Ordering::Acquire);
        }
        None
    }

    /// Lease the healthy replica with the fewest requests in flight, skipping replicas whose
    /// index is in `exclude` (already tried for this request), replicas at their concurrency
    /// limit, and half-open replicas whose one probe is already in flight. Ties go round-robin.
    /// `None` when no replica can take the request.
    pub fn choose(&self, now: Instant, exclude: &[usize]) -> Option<Lease> {
        self.scan(now, exclude, |eligible| {
            eligible.min_by_key(|&index| self.replicas[index].in_flight())
        })
    }

    /// Lease the next eligible replica in turn, whatever its load (a baseline for comparisons;
    /// the same eligibility as [`ReplicaSet::choose`]).
    pub fn choose_in_turn(&self, now: Instant, exclude: &[usize]) -> Option<Lease> {
        self.scan(now, exclude, |eligible| eligible.next())
    }

    /// Lease the replica `pick` takes from the eligible ones, listed from a starting point that
    /// rotates with every call.
    fn scan(
        &self,
        now: Instant,
        exclude: &[usize],
        pick: impl Fn(&mut dyn Iterator<Item = usize>) -> Option<usize>,
    ) -> Option<Lease> {
        let n = self.replicas.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        // A concurrent request may fill the picked replica between the scan and the acquire;
        // rescan a bounded number of times instead of failing the request.
        for _ in 0..n {
            let mut eligible = (0..n)
                .map(|offset| (start + offset) % n)
                .filter(|&index| self.eligible(index, now, exclude));
            let index = pick(&mut eligible)?;
            if let Some(lease) = self.lease(index, now) {
                return Some(lease);
            }
        }
        None
    }

    /// Lease the replica `pick` names among the candidates (one per replica, in set order:
    /// eligibility as [`ReplicaSet::choose`] decides it, load = requests in flight, then
    /// `describe` adds what the caller knows: the replica's stable id, the server's own load),
    /// such as a prefix-affinity choice; the least loaded ([`ReplicaSet::choose`]) when `pick`
    /// names none or its replica filled up meanwhile.
    pub fn choose_by(
        &self,
        now: Instant,
        exclude: &[usize],
        describe: impl Fn(usize, &mut crate::affinity::Candidate),
        pick: impl FnOnce(&[crate::affinity::Candidate]) -> Option<usize>,
    ) -> Option<Lease> {
        let candidates: Vec<crate::affinity::Candidate> = (0..self.replicas.len())
            .map(|i| {
                let mut c = crate::affinity::Candidate {
                    load: self.replicas[i].in_flight(),
                    kv_usage: None,
                    eligible: self.eligible(i, now, exclude),
                    id: i as u64,
                };
                describe(i, &mut c);
                c
            })
            .collect();
        if let Some(index) = pick(&candidates).filter(|&i| i < self.replicas.len()) {
            if candidates[index].eligible {
                if let Some(lease) = self.lease(index, now) {
                    return Some(lease);
                }
            }
        }
        self.choose(now, exclude)
    }

    /// Whether a replica not in `exclude` would take a request but is at its concurrency limit
    /// (so waiting for a slot makes sense; `false` when every candidate is out of rotation).
    pub fn at_capacity(&self, now: Instant, exclude: &[usize]) -> bool {
        self.replicas.iter().enumerate().any(|(i, r)| {
            !exclude.contains(&i)
                && self.state(r, now) != Breaker::Open
                && r.in_flight() >= r.limit()
        })
    }

    /// Whether a replica not in `exclude` is in rotation (its breaker not open), full or not.
    pub fn in_rotation(&self, now: Instant, exclude: &[usize]) -> bool {
        self.replicas
            .iter()
            .enumerate()
            .any(|(i, r)| !exclude.contains(&i) && self.state(r, now) != Breaker::Open)
    }

    /// The request on `lease` got its first token (a stream) or its whole answer at `now`
    /// (or timed out then: the wait is a lower bound of its latency, which is what an
    /// overloaded server's queue makes it). Feeds the replica's adaptive limit, if it has one;
    /// the change when the limit moved.
    pub fn record_latency(&self, lease: &Lease, now: Instant, signal: Signal) -> Option<Change> {
        let replica = &self.replicas[lease.index];
        replica
            .adaptive
            .as_ref()?
            .record(signal, lease.acquired, now, replica.in_flight())
    }

    /// The request on `lease` succeeded: the replica is healthy again.
    pub fn record_success(&self, lease: &Lease, now: Instant) {
        let replica = &self.replicas[lease.index];
        replica
            .outcomes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(self.slot(now), false);
        replica.consecutive_failures.store(0, Ordering::Release);
        replica.down_until_ns.store(0, Ordering::Release);
        replica.tripped_by.store(0, Ordering::Release);
        lease.end_probe();
    }

    /// The request on `lease` failed at the replica (connect error, 5xx, timeout). Returns why,
    /// when this failure took the replica out of rotation.
    pub fn record_failure(&self, lease: &Lease, now: Instant) -> Option<Trip> {
        let replica = &self.replicas[lease.index];
        let failures = replica.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        let (requests, failed) = {
            let mut outcomes = replica.outcomes.lock().unwrap_or_else(|p| p.into_inner());
            let slot = self.slot(now);
            outcomes.record(slot, true);
            outcomes.totals(slot)
        };
        let trip = if lease.is_probe() {
            Trip::ProbeFailed
        } else if failures >= self.policy.failure_threshold {
            Trip::ConsecutiveFailures
        } else if requests >= self.policy.min_requests
            && f64::from(failed) >= self.policy.error_ratio * f64::from(requests)
        {
            Trip::ErrorRatio
        } else {
            return None;
        };
        let until = self.nanos_since_epoch(now + self.policy.cooldown).max(1);
        replica.down_until_ns.store(until, Ordering::Release);
        replica.tripped_by.store(trip.code(), Ordering::Release);
        // The next window starts after the cooldown: old failures do not trip it again.
        *replica.outcomes.lock().unwrap_or_else(|p| p.into_inner()) = Outcomes::default();
        lease.end_probe();
        Some(trip)
    }

    /// Current state of every replica.
    pub fn snapshot(&self, now: Instant) -> Vec<ReplicaSnapshot> {
        self.replicas
            .iter()
            .map(|r| ReplicaSnapshot {
                name: r.name.clone(),
                in_flight: r.in_flight(),
                healthy: self.is_healthy(r, now),
                consecutive_failures: r.consecutive_failures.load(Ordering::Relaxed),
                breaker: self.state(r, now),
                tripped_by: Trip::from_code(r.tripped_by.load(Ordering::Acquire)),
                window: r
                    .outcomes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .totals(self.slot(now)),
                limit: r.limit(),
                max_concurrency: r.max_concurrency,
                adaptive: r.adaptive.is_some(),
                probing: r.adaptive.as_ref().is_some_and(AdaptiveLimit::probing),
            })
            .collect()
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    fn set(n: usize, max: u32) -> ReplicaSet {
        ReplicaSet::new(
            (0..n).map(|i| (format!("r{i}"), max)),
            HealthPolicy {
                failure_threshold: 2,
                cooldown: Duration::from_secs(5),
                ..HealthPolicy::default()
            },
        )
    }

    #[test]
    fn least_in_flight_replica_is_chosen() {
        let s = set(3, 10);
        let now = Instant::now();
        let a = s.choose(now, &[]).unwrap();
        let b = s.choose(now, &[]).unwrap();
        let c = s.choose(now, &[]).unwrap();
        let mut idx = vec![a.index(), b.index(), c.index()];
        idx.sort_unstable();
        assert_eq!(
            idx,
            vec![0, 1, 2],
            "three requests spread over three idle replicas"
        );
        drop(b);
        let d = s.choose(now, &[]).unwrap();
        assert_eq!(d.index(), idx_of_dropped(&[a.index(), c.index()]));
    }

    fn idx_of_dropped(kept: &[usize]) -> usize {
        (0..3).find(|i| !kept.contains(i)).unwrap()
    }

    #[test]
    fn full_replicas_are_skipped_and_slots_return_on_drop() {
        let s = set(1, 2);
        let now = Instant::now();
        let a = s.choose(now, &[]).unwrap();
        let _b = s.choose(now, &[]).unwrap();
        assert!(s.choose(now, &[]).is_none(), "replica at max concurrency");
        assert_eq!(s.completed(), 0);
        drop(a);
        assert_eq!(s.completed(), 1);
        assert!(s.choose(now, &[]).is_some());
        assert_eq!(s.completed(), 2, "the lease above was dropped at once");
    }

    #[test]
    fn a_full_healthy_replica_is_at_capacity_an_open_one_is_not() {
        let s = set(1, 1);
        let now = Instant::now();
        assert!(!s.at_capacity(now, &[]));
        let lease = s.choose(now, &[]).unwrap();
        assert!(s.at_capacity(now, &[]), "full: worth waiting for");
        assert!(!s.at_capacity(now, &[0]), "excluded");
        s.record_failure(&lease, now);
        s.record_failure(&lease, now);
        assert!(!s.at_capacity(now, &[]), "open: not worth waiting for");
    }

    #[test]
    fn excluded_replicas_are_not_chosen() {
        let s = set(2, 10);
        let now = Instant::now();
        let lease = s.choose(now, &[0]).unwrap();
        assert_eq!(lease.index(), 1);
        assert!(s.choose(now, &[0, 1]).is_none());
    }

    #[test]
    fn consecutive_failures_trip_a_cooldown_then_half_open() {
        let s = set(2, 10);
        let now = Instant::now();
        let lease = s.choose(now, &[1]).unwrap();
        assert_eq!(s.record_failure(&lease, now), None);
        assert_eq!(
            s.record_failure(&lease, now),
            Some(Trip::ConsecutiveFailures),
            "second failure trips"
        );
        drop(lease);
        for _ in 0..4 {
            assert_eq!(s.choose(now, &[]).unwrap().index(), 1);
        }
        assert!(!s.snapshot(now)[0].healthy);
        let later = now + Duration::from_secs(6);
        assert!(s.snapshot(later)[0].healthy, "cooldown over: half-open");
        let probe = s.choose(later, &[1]).unwrap();
        assert_eq!(
            s.record_failure(&probe, later),
            Some(Trip::ProbeFailed),
            "a failed probe trips again at once"
        );
        let probe = s.choose(later + Duration::from_secs(6), &[1]).unwrap();
        s.record_success(&probe, later + Duration::from_secs(6));
        assert_eq!(s.snapshot(later)[0].consecutive_failures, 0);
        assert!(s.snapshot(later)[0].healthy);
    }

    #[test]
    fn an_error_ratio_over_the_window_trips_a_replica_that_never_fails_twice_in_a_row() {
        let s = set(2, 100);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // Every other request fails, never two in a row: 19 requests are under min_requests.
        for i in 0..19u64 {
            let lease = s.choose(ms(i), &[1]).unwrap();
            if i % 2 == 0 {
                assert_eq!(s.record_failure(&lease, ms(i)), None, "request {i}");
            } else {
                s.record_success(&lease, ms(i));
            }
        }
        assert_eq!(s.snapshot(ms(19))[0].window, (19, 10));
        // A 20th that succeeds (half failed: the ratio is checked on failures), then a failure:
        // 11 of 21 failed, over the 50% ratio.
        let lease = s.choose(ms(19), &[1]).unwrap();
        s.record_success(&lease, ms(19));
        let lease = s.choose(ms(20), &[1]).unwrap();
        assert_eq!(s.record_failure(&lease, ms(20)), Some(Trip::ErrorRatio));
        drop(lease);
        let snap = &s.snapshot(ms(21))[0];
        assert_eq!(
            (snap.breaker, snap.tripped_by),
            (Breaker::Open, Some(Trip::ErrorRatio))
        );
        assert_eq!(snap.window, (0, 0), "a trip starts a fresh window");
        // Closed again by the probe's success, reason cleared.
        let later = ms(20) + Duration::from_secs(6);
        let probe = s.choose(later, &[1]).unwrap();
        assert!(probe.is_probe());
        s.record_success(&probe, later);
        let snap = &s.snapshot(later)[0];
        assert_eq!((snap.breaker, snap.tripped_by), (Breaker::Closed, None));
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let s = set(1, 100);
        let t0 = Instant::now();
        for i in 0..16u64 {
            let at = t0 + Duration::from_millis(i);
            let lease = s.choose(at, &[]).unwrap();
            if i % 2 == 0 {
                s.record_failure(&lease, at);
            } else {
                s.record_success(&lease, at);
            }
        }
        // 11 s later (the window is 10 s) those 16 are gone: 10 more outcomes, half failed, are
        // under min_requests and do not trip.
        let later = t0 + Duration::from_secs(11);
        for i in 0..10u64 {
            let at = later + Duration::from_millis(i);
            let lease = s.choose(at, &[]).unwrap();
            if i % 2 == 0 {
                assert_eq!(s.record_failure(&lease, at), None);
            } else {
                s.record_success(&lease, at);
            }
        }
        assert_eq!(s.snapshot(later)[0].window.0, 10);
    }

    #[test]
    fn a_half_open_replica_takes_one_probe_at_a_time() {
        let s = set(2, 10);
        let now = Instant::now();
        let lease = s.choose(now, &[1]).unwrap();
        s.record_failure(&lease, now);
        assert!(s.record_failure(&lease, now).is_some());
        drop(lease);
        let later = now + Duration::from_secs(6);
        let probe = s.choose(later, &[1]).unwrap();
        assert_eq!(probe.index(), 0);
        assert!(probe.is_probe());
        // While the probe is out, everyone else goes to replica 1, however loaded it is.
        let others: Vec<_> = (0..5).map(|_| s.choose(later, &[]).unwrap()).collect();
        assert!(others.iter().all(|l| l.index() == 1 && !l.is_probe()));
        assert!(s.choose(later, &[1]).is_none(), "no second probe");
        // A probe abandoned without an outcome frees the slot for the next one.
        drop(probe);
        let probe = s.choose(later, &[1]).unwrap();
        assert!(probe.is_probe());
        s.record_success(&probe, later);
        drop(probe);
        let a = s.choose(later, &[1]).unwrap();
        let b = s.choose(later, &[1]).unwrap();
        assert!(!a.is_probe() && !b.is_probe(), "closed again: no probing");
    }

    #[test]
    fn a_failed_probe_opens_the_breaker_for_another_cooldown() {
        let s = ReplicaSet::new(
            [("r0".to_owned(), 10)],
            HealthPolicy {
                failure_threshold: 5,
                cooldown: Duration::from_secs(5),
                ..HealthPolicy::default()
            },
        );
        let now = Instant::now();
        let lease = s.choose(now, &[]).unwrap();
        for _ in 0..5 {
            s.record_failure(&lease, now);
        }
        drop(lease);
        // Tripped; once cooled down, the probe's failure trips it again on its own.
        let later = now + Duration::from_secs(6);
        let probe = s.choose(later, &[]).unwrap();
        assert_eq!(s.record_failure(&probe, later), Some(Trip::ProbeFailed));
        drop(probe);
        assert!(s.choose(later, &[]).is_none(), "open for another cooldown");
        assert!(s.choose(later + Duration::from_secs(6), &[]).is_some());
    }

    #[test]
    fn an_adaptive_limit_takes_a_slow_replica_below_its_maximum_and_choice_follows_it() {
        let s = set(2, 32).with_adaptive_limits(|max| LimitPolicy {
            min: 2,
            ..LimitPolicy::new(max)
        });
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // Each replica's first answer starts a probe at the floor (2); eight answers sent since,
        // in 50 ms each, measure its baseline and end it.
        for index in [0, 1] {
            let other = [1 - index];
            let first = s.choose(t0, &other).unwrap();
            s.record_latency(&first, t0 + ms(50), Signal::FirstToken);
            drop(first);
            assert_eq!(s.snapshot(t0)[index].limit, 2, "probing");
            for i in 0..8 {
                let at = t0 + ms(100 * (i + 1));
                let lease = s.choose(at, &other).unwrap();
                s.record_latency(&lease, at + ms(50), Signal::FirstToken);
            }
            assert_eq!(s.snapshot(t0)[index].limit, 32, "probed");
        }
        // Both busy at 32; replica 0's queue grows: its first tokens take 400 ms.
        let t1 = t0 + Duration::from_secs(2);
        let mut held: Vec<Lease> = (0..64).map(|_| s.choose(t1, &[]).unwrap()).collect();
        assert!(s.choose(t1, &[]).is_none(), "both full at 32");
        for lease in held.iter().filter(|l| l.index() == 0).take(8) {
            s.record_latency(lease, t1 + ms(400), Signal::FirstToken);
        }
        let snap = s.snapshot(t1);
        assert!(snap[0].adaptive && snap[0].limit == 16, "{snap:?}");
        assert_eq!((snap[1].limit, snap[1].max_concurrency), (32, 32));
        // Free a slot on each: only replica 1 takes new work (replica 0 is over its limit).
        for index in [0, 1] {
            let at = held.iter().position(|l| l.index() == index).unwrap();
            held.swap_remove(at);
        }
        let taken = s.choose(t1, &[]).unwrap();
        assert_eq!(taken.index(), 1);
        assert!(s.choose(t1, &[]).is_none());
        assert!(s.at_capacity(t1, &[]), "worth waiting for a slot");
        // A fixed set ignores latency.
        let fixed = set(1, 4);
        let lease = fixed.choose(t0, &[]).unwrap();
        assert_eq!(fixed.record_latency(&lease, t1, Signal::Whole), None);
        assert_eq!(fixed.snapshot(t1)[0].limit, 4);
        assert!(!fixed.snapshot(t1)[0].adaptive);
    }

    #[test]
    fn concurrent_leases_never_exceed_max_concurrency() {
        let s = Arc::new(set(2, 3));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for _ in 0..100 {
                        if let Some(l) = s.choose(Instant::now(), &[]) {
                            held.push(l);
                        }
                        for r in s.snapshot(Instant::now()) {
                            assert!(r.in_flight <= 3);
                        }
                        if held.len() > 1 {
                            held.clear();
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(s.snapshot(Instant::now()).iter().all(|r| r.in_flight == 0));
    }
}
