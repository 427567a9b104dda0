//! The semantic cache's vector index: namespaced, capacity-bounded (least recently used entries
//! are evicted first), with a time to live, searched by brute force.
//!
//! A namespace is whatever must match exactly for a cached answer to be reusable (the gateway
//! hashes tenant, served model, system prompt, tools and sampling parameters into one `u64`), so
//! a search only ever scans the vectors of its own namespace — never another tenant's. Vectors
//! are L2-normalised, so the dot product is the cosine similarity; the scan keeps the best `k`
//! above a threshold in a small sorted buffer, without writing a score per entry.
//!
//! [`VectorIndex`] is the trait the cache uses; [`CpuIndex`] is the CPU implementation (f32,
//! contiguous rows per namespace, a dot product written so the compiler vectorises it).

use std::collections::HashMap;

/// A cache entry's id (chosen by the caller, unique across namespaces).
pub type EntryId = u64;

/// One search result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// The entry.
    pub id: EntryId,
    /// Cosine similarity to the query.
    pub score: f32,
}

/// What the cache needs from an index (CPU or GPU).
pub trait VectorIndex: Send {
    /// Insert (or replace) `id` in namespace `ns`; `now_ms` starts its time to live. May evict
    /// the least recently used entries to stay within capacity.
    fn insert(&mut self, ns: u64, id: EntryId, vector: &[f32], now_ms: i64);
    /// The best `k` entries of `ns` scoring at least `threshold`, best first; expired entries
    /// are never returned. Returned entries count as used.
    fn search(&mut self, ns: u64, query: &[f32], k: usize, threshold: f32, now_ms: i64)
        -> Vec<Hit>;
    /// Remove an entry; `false` when it was not there.
    fn remove(&mut self, id: EntryId) -> bool;
    /// Whether `id` is held (expired entries may be held until touched).
    fn contains(&self, id: EntryId) -> bool;
    /// Live entries (expired ones may be counted until touched).
    fn len(&self) -> usize;
    /// No entries.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Dot product of two equal-length slices, in 8 independent lanes so it vectorises.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, ra) = a.split_at(a.len() - a.len() % 8);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(8).zip(cb.chunks_exact(8)) {
        for ((a, x), y) in acc.iter_mut().zip(x).zip(y) {
            *a += x * y;
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// Scale `v` to unit length (a zero vector stays zero).
pub fn normalise(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
}

#[derive(Debug, Default)]
struct Shard {
    /// Row-major vectors, `dim` floats per entry.
    data: Vec<f32>,
    ids: Vec<EntryId>,
    expires: Vec<i64>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    ns: u64,
    row: usize,
    used: u64,
}

/// The CPU index.
#[derive(Debug)]
pub struct CpuIndex {
    dim: usize,
    capacity: usize,
    ttl_ms: i64,
    shards: HashMap<u64, Shard>,
    slots: HashMap<EntryId, Slot>,
    /// Monotonic use counter (the LRU clock).
    tick: u64,
}

impl CpuIndex {
    /// An index of `dim`-dimensional vectors holding at most `capacity` entries, each living
    /// `ttl_ms` after insertion.
    pub fn new(dim: usize, capacity: usize, ttl_ms: i64) -> Self {
        Self {
            dim,
            capacity: capacity.max(1),
            ttl_ms,
            shards: HashMap::new(),
            slots: HashMap::new(),
            tick: 0,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn evict_lru(&mut self) {
        // Capacity is reached rarely relative to searches; a scan for the oldest keeps every
        // search and insert free of LRU bookkeeping beyond one counter.
        if let Some((&id, _)) = self.slots.iter().min_by_key(|(_, s)| s.used) {
            self.remove(id);
        }
    }
}

impl VectorIndex for CpuIndex {
    fn insert(&mut self, ns: u64, id: EntryId, vector: &[f32], now_ms: i64) {
        if vector.len() != self.dim {
            return;
        }
        self.remove(id);
        while self.slots.len() >= self.capacity {
            self.evict_lru();
        }
        let used = self.next_tick();
        let shard = self.shards.entry(ns).or_default();
        shard.data.extend_from_slice(vector);
        shard.ids.push(id);
        shard.expires.push(now_ms + self.ttl_ms);
        let row = shard.ids.len() - 1;
        self.slots.insert(id, Slot { ns, row, used });
    }

    fn search(
        &mut self,
        ns: u64,
        query: &[f32],
        k: usize,
        threshold: f32,
        now_ms: i64,
    ) -> Vec<Hit> {
        if query.len() != self.dim || k == 0 {
            return Vec::new();
        }
        let Some(shard) = self.shards.get(&ns) else {
            return Vec::new();
        };
        let mut best: Vec<Hit> = Vec::with_capacity(k + 1);
        let mut expired = Vec::new();
        for (row, v) in shard.data.chunks_exact(self.dim).enumerate() {
            let score = dot(v, query);
            if score < threshold || (best.len() == k && score <= best[k - 1].score) {
                continue;
            }
            if shard.expires[row] <= now_ms {
                expired.push(shard.ids[row]);
                continue;
            }
            let at = best.partition_point(|h| h.score >= score);
            best.insert(
                at,
                Hit {
                    id: shard.ids[row],
                    score,
                },
            );
            best.truncate(k);
        }
        for id in expired {
            self.remove(id);
        }
        for hit in &best {
            let used = self.next_tick();
            if let Some(s) = self.slots.get_mut(&hit.id) {
                s.used = used;
            }
        }
        best
    }

    fn remove(&mut self, id: EntryId) -> bool {
        let Some(slot) = self.slots.remove(&id) else {
            return false;
        };
        let Some(shard) = self.shards.get_mut(&slot.ns) else {
            return true;
        };
        let last = shard.ids.len() - 1;
        if slot.row != last {
            // Move the last row into the hole.
            let (dim, row) = (self.dim, slot.row);
            shard
                .data
                .copy_within(last * dim..(last + 1) * dim, row * dim);
            shard.ids[row] = shard.ids[last];
            shard.expires[row] = shard.expires[last];
            if let Some(moved) = self.slots.get_mut(&shard.ids[row]) {
                moved.row = row;
            }
        }
        shard.data.truncate(last * self.dim);
        shard.ids.truncate(last);
        shard.expires.truncate(last);
        if shard.ids.is_empty() {
            self.shards.remove(&slot.ns);
        }
        true
    }

    fn contains(&self, id: EntryId) -> bool {
        self.slots.contains_key(&id)
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(seed: u64, dim: usize) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut v: Vec<f32> = (0..dim)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        let n = dot(&v, &v).sqrt();
        v.iter_mut().for_each(|a| *a /= n);
        v
    }

    #[test]
    fn dot_matches_the_naive_sum_for_every_length() {
        for len in [0, 1, 7, 8, 9, 384, 385] {
            let a = unit(1, len.max(1))[..len].to_vec();
            let b = unit(2, len.max(1))[..len].to_vec();
            let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - naive).abs() < 1e-5, "{len}");
        }
    }

    #[test]
    fn search_finds_the_nearest_in_its_namespace_only() {
        let mut idx = CpuIndex::new(16, 100, 60_000);
        for i in 0..20 {
            idx.insert(1, i, &unit(i, 16), 0);
        }
        idx.insert(2, 100, &unit(5, 16), 0);
        let hits = idx.search(1, &unit(5, 16), 3, -1.0, 10);
        assert_eq!(hits[0].id, 5);
        assert!((hits[0].score - 1.0).abs() < 1e-5);
        assert_eq!(hits.len(), 3);
        assert!(hits[0].score >= hits[1].score && hits[1].score >= hits[2].score);
        // Namespace 2 holds the same vector under another id; namespace 3 nothing.
        assert_eq!(idx.search(2, &unit(5, 16), 3, -1.0, 10)[0].id, 100);
        assert!(idx.search(3, &unit(5, 16), 3, -1.0, 10).is_empty());
        // The threshold cuts.
        assert_eq!(idx.search(1, &unit(5, 16), 3, 0.999, 10).len(), 1);
    }

    #[test]
    fn entries_expire_and_the_least_recently_used_is_evicted() {
        let mut idx = CpuIndex::new(8, 3, 1_000);
        for i in 0..3 {
            idx.insert(7, i, &unit(i, 8), 0);
        }
        // Use entry 0, then insert a fourth: entry 1 (least recently used) goes.
        assert_eq!(idx.search(7, &unit(0, 8), 1, 0.99, 10)[0].id, 0);
        idx.insert(7, 3, &unit(3, 8), 20);
        assert_eq!(idx.len(), 3);
        assert!(idx.search(7, &unit(1, 8), 1, 0.99, 30).is_empty());
        assert_eq!(idx.search(7, &unit(2, 8), 1, 0.99, 30)[0].id, 2);
        // Past the TTL nothing is returned, and expired entries are dropped.
        assert!(idx.search(7, &unit(3, 8), 1, 0.99, 1_020).is_empty());
        assert!(idx.remove(0) || idx.len() < 3);
        // Replacing an id keeps one entry.
        idx.insert(7, 9, &unit(9, 8), 2_000);
        idx.insert(7, 9, &unit(9, 8), 2_000);
        assert_eq!(idx.search(7, &unit(9, 8), 5, 0.99, 2_001).len(), 1);
    }
}
