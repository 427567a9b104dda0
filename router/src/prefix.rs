//! Chained hashes of fixed-size token blocks, and a bounded LRU set of them.

use std::collections::{HashMap, VecDeque};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of the first block in every chain; any fixed value works, it only has to be the same on
/// every replica and every release.
const CHAIN_SEED: u64 = 0x6c6c_6d67_7731_0001;

/// Hash every *full* block of `block_size` tokens, each hash seeded with the previous block's hash,
/// so hash `i` identifies the whole prefix `tokens[..(i + 1) * block_size]`. A trailing partial
/// block is not hashed (model servers cache whole blocks only). `block_size == 0` yields nothing.
///
/// The result is stable across processes, machines and releases: replicas of the gateway agree.
pub fn prefix_block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    let mut seed = CHAIN_SEED;
    let mut bytes = Vec::with_capacity(block_size * 4);
    for block in tokens.chunks_exact(block_size) {
        bytes.clear();
        for t in block {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        seed = xxh3_64_with_seed(&bytes, seed);
        hashes.push(seed);
    }
    hashes
}

/// The same chain over bytes: every full block of `block_size` bytes, each hash seeded with the
/// previous one. The gateway hashes a prompt's text this way (it has no access to the server's
/// token ids, and needs none: the same prefix text gives the same leading hashes).
pub fn prefix_byte_hashes(bytes: &[u8], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut seed = CHAIN_SEED;
    bytes
        .chunks_exact(block_size)
        .map(|block| {
            seed = xxh3_64_with_seed(block, seed);
            seed
        })
        .collect()
}

/// A bounded set of block hashes with least-recently-used eviction, the shape of a model server's
/// prefix cache (and of the router's per-replica memory of what it sent where).
#[derive(Debug)]
pub struct PrefixLru {
    capacity: usize,
    /// hash -> generation of its latest touch.
    entries: HashMap<u64, u64>,
    /// (generation, hash) in touch order; stale pairs are skipped on eviction.
    order: VecDeque<(u64, u64)>,
    generation: u64,
}

impl PrefixLru {
    /// An empty set that holds at most `capacity` hashes.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            order: VecDeque::new(),
            generation: 0,
        }
    }

    /// Number of leading hashes of `chain` present in the set (the cached prefix, in blocks).
    pub fn matched_prefix(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// Mark every hash of `chain` as recently used, inserting missing ones and evicting the least
    /// recently used hashes beyond capacity.
    pub fn touch(&mut self, chain: &[u64]) {
        if self.capacity == 0 {
            return;
        }
        for &h in chain {
            self.generation += 1;
            self.entries.insert(h, self.generation);
            self.order.push_back((self.generation, h));
        }
        while self.entries.len() > self.capacity {
            let Some((generation, h)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&h) == Some(&generation) {
                self.entries.remove(&h);
            }
        }
        // Keep the touch log from growing without bound when the same hashes repeat.
        if self.order.len() > self.capacity.saturating_mul(4).max(64) {
            let entries = &self.entries;
            self.order.retain(|(g, h)| entries.get(h) == Some(g));
        }
    }

    /// Number of hashes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_leading_hashes_only() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[25] = 999;
        let ha = prefix_block_hashes(&a, 8);
        let hb = prefix_block_hashes(&b, 8);
        assert_eq!(ha.len(), 5);
        assert_eq!(ha[..3], hb[..3], "blocks 0..3 identical");
        assert_ne!(ha[3], hb[3], "block 3 differs");
        assert_ne!(ha[4], hb[4], "the chain carries the difference forward");
    }

    #[test]
    fn same_block_at_another_position_hashes_differently() {
        let h = prefix_block_hashes(&[1, 2, 1, 2], 2);
        assert_ne!(h[0], h[1]);
    }

    #[test]
    fn byte_chains_share_the_leading_hashes_of_a_shared_prefix() {
        let a = b"You are a helpful assistant. The user asks: what is 2 + 2?";
        let b = b"You are a helpful assistant. The user asks: what is 3 + 3?";
        let (ha, hb) = (prefix_byte_hashes(a, 8), prefix_byte_hashes(b, 8));
        assert_eq!(ha.len(), a.len() / 8);
        let same = a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count() / 8;
        assert_eq!(ha[..same], hb[..same]);
        assert_ne!(ha[same], hb[same]);
        assert!(prefix_byte_hashes(b"short", 8).is_empty());
    }

    #[test]
    fn partial_blocks_and_zero_block_size_hash_nothing() {
        assert!(prefix_block_hashes(&[1, 2, 3], 4).is_empty());
        assert!(prefix_block_hashes(&[1, 2, 3], 0).is_empty());
    }

    #[test]
    fn hashes_are_stable_across_releases() {
        // Replicas of different versions must agree; pin one value.
        let h = prefix_block_hashes(&[1, 2, 3, 4], 4);
        assert_eq!(h, prefix_block_hashes(&[1, 2, 3, 4, 5], 4));
        assert_eq!(h.len(), 1);
        assert_eq!(
            h[0],
            xxh3_64_with_seed(
                &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0],
                CHAIN_SEED
            )
        );
    }

    #[test]
    fn lru_matches_prefixes_and_evicts_least_recent() {
        let mut lru = PrefixLru::new(4);
        lru.touch(&[1, 2, 3]);
        assert_eq!(lru.matched_prefix(&[1, 2, 3, 4]), 3);
        assert_eq!(lru.matched_prefix(&[2, 3]), 2);
        assert_eq!(lru.matched_prefix(&[9, 1]), 0);
        lru.touch(&[1]); // 1 is now the most recent
        lru.touch(&[7, 8]); // evicts 2 and then 3
        assert_eq!(lru.len(), 4);
        assert_eq!(lru.matched_prefix(&[1]), 1);
        assert_eq!(lru.matched_prefix(&[2]), 0);
        assert_eq!(lru.matched_prefix(&[7, 8]), 2);
        for _ in 0..1000 {
            lru.touch(&[7]);
        }
        assert!(lru.order.len() <= 64 + 1, "touch log stays bounded");
    }
}
