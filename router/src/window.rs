//! Two counters over a sliding window of [`SlidingCounts::BUCKETS`] buckets, keyed by bucket
//! number (the caller turns time into bucket numbers, so the logic needs no clock).

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
