//! What the upstream protections cost a request that meets no trouble (the tier has room): p50 /
//! p99 per request over many, each piece the way the request path calls it.
//!
//! - replica choice and outcome on a fixed-limit set (the baseline) and on an adaptive one (a
//!   lease, its latency sample, the success, the release);
//! - the tier's retry budget (counted active) and adaptive throttling (a draw and a record);
//! - the guard's client-retry check on the in-process store (the budget's counts and the
//!   after-error look-up, one call);
//! - coalescing (registered as the leader, then gone).
//!
//! ```sh
//! cargo run --release -p gateway --example overload_bench
//! ```

#![expect(
    clippy::expect_used,
    reason = "a benchmark program: a failure is a bug to see"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway::guard::memory::MemoryGuard;
use gateway::guard::store::{GuardStore, Known};
use gateway::pipeline::coalesce::Inflight;
use router::{HealthPolicy, LimitPolicy, ReplicaSet, RetryBudget, Signal, Throttle};

const N: usize = 200_000;

fn percentiles(times: &mut [f64]) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    (at(0.5), at(0.99))
}

/// Time `step` N times; p50 and p99 in microseconds.
fn time(name: &str, mut step: impl FnMut(usize)) -> (f64, f64) {
    for i in 0..N / 10 {
        step(i);
    }
    let mut times = Vec::with_capacity(N);
    for i in 0..N {
        let t = Instant::now();
        step(i);
        times.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    let (p50, p99) = percentiles(&mut times);
    println!("{name:<58} p50 {p50:>6.2} us   p99 {p99:>6.2} us");
    (p50, p99)
}

fn replicas(adaptive: bool) -> ReplicaSet {
    let set = ReplicaSet::new(
        (0..2).map(|i| (format!("r{i}"), 256)),
        HealthPolicy::default(),
    );
    if adaptive {
        set.with_adaptive_limits(LimitPolicy::new)
    } else {
        set
    }
}

fn main() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    for adaptive in [false, true] {
        let set = replicas(adaptive);
        let name = if adaptive {
            "replica choice + outcome, adaptive limit"
        } else {
            "replica choice + outcome, fixed limit (baseline)"
        };
        time(name, |i| {
            let now = t0 + ms(i as u64);
            let lease = set.choose(now, &[]).expect("room");
            if adaptive {
                set.record_latency(&lease, now + ms(40), Signal::Whole);
            }
            set.record_success(&lease, now + ms(40));
        });
    }
    let budget = RetryBudget::new(0.2, 3);
    let throttle = Throttle::new(2.0, Duration::from_secs(60), 20, t0);
    time("retry budget (active) + throttle (draw, record)", |i| {
        let active = budget.request();
        let now = t0 + ms(i as u64);
        let rejected = throttle.reject(now, 0.5);
        throttle.record(now, !rejected);
        drop(active);
    });
    let store = MemoryGuard::new(100_000, Duration::from_secs(3_600));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let fingerprints: Vec<String> = (0..10_000).map(|i| format!("{i:016x}")).collect();
    time(
        "guard: client-retry counts + after-error look-up (memory)",
        |i| {
            let known = Known::IfFailed {
                key_id: "key_bench",
                fingerprint: &fingerprints[i % fingerprints.len()],
                now_ms: 1_000_000 + i as i64,
                ttl_ms: 10_000,
            };
            let slot = (i / 1_000) as u64;
            std::hint::black_box(
                rt.block_on(store.retry_counts("tenant_bench", known, slot, 60_000))
                    .expect("memory store"),
            );
        },
    );
    let inflight = Arc::new(Inflight::default());
    time("coalescing: lead, then leave", |i| {
        let join = inflight.join("key_bench", &fingerprints[i % fingerprints.len()], false);
        drop(join);
    });
}
