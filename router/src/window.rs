//! Two counters over a sliding window of [`SlidingCounts::BUCKETS`] buckets, keyed by bucket
//! number, and [`Buckets`], which turns a time into a bucket number (time is passed in).

use std::time::{Duration, Instant};

/// Bucket numbers of a window: a tenth of it each, counted from an epoch.
#[derive(Debug, Clone, Copy)]
pub struct Buckets {
    epoch: Instant,
    bucket: Duration,
}

impl Buckets {
    /// Buckets of `window` from `epoch`.
    pub fn new(window: Duration, epoch: Instant) -> Self {
        Self {
            epoch,
            bucket: (window / SlidingCounts::BUCKETS as u32).max(Duration::from_millis(1)),
        }
    }

    /// The bucket `now` falls in.
    pub fn slot(&self, now: Instant) -> u64 {
        let b = self.bucket.as_nanos().max(1);
        u64::try_from(now.saturating_duration_since(self.epoch).as_nanos() / b).unwrap_or(u64::MAX)
    }
}

/// What a budget of `share` of `count` allows, never less than `floor`: `max(floor, ⌊share ×
/// count⌋)`. The one formula behind the retry budgets and the fallback share.
pub fn allowance(count: u32, share: f64, floor: u32) -> u32 {
    ((f64::from(count) * share).floor() as u32).max(floor)
}

/// Two counts per bucket over the last [`SlidingCounts::BUCKETS`] buckets.
#[derive(Debug, Default, Clone)]
pub struct SlidingCounts {
    /// (bucket number, first count, second count).
    buckets: [(u64, u32, u32); SlidingCounts::BUCKETS],
}

impl SlidingCounts {
    /// Buckets in the window.
    pub const BUCKETS: usize = 10;

    /// Add `a` and `b` to bucket `slot` (a bucket older than the window is reused).
    pub fn add(&mut self, slot: u64, a: u32, b: u32) {
        let bucket = &mut self.buckets[(slot % Self::BUCKETS as u64) as usize];
        if bucket.0 != slot {
            *bucket = (slot, 0, 0);
        }
        bucket.1 = bucket.1.saturating_add(a);
        bucket.2 = bucket.2.saturating_add(b);
    }

    /// Both counts over the window ending at bucket `slot`.
    pub fn totals(&self, slot: u64) -> (u32, u32) {
        self.buckets
            .iter()
            .filter(|b| b.0 + Self::BUCKETS as u64 > slot && b.0 <= slot)
            .fold((0, 0), |(a, b), x| {
                (a.saturating_add(x.1), b.saturating_add(x.2))
            })
    }
}
