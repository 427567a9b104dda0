//! Prefix-affinity replica choice: send a prompt to the replica whose KV cache most likely holds
//! its prefix, unless that would overload it.
//!
//! The router remembers, per replica, the prefix blocks it recently sent there ([`PrefixLru`] of
//! [`prefix_block_hashes`](crate::prefix_block_hashes) chains, bounded like the server's cache).
//! Two decisions are offered:
//!
//! - [`Policy::Gate`] (SGLang's cache-aware router): while load is balanced, the replica with the
//!   longest matched prefix wins when it matched more than `min_match` of the prompt's blocks;
//!   when the busiest and the idlest replica differ by more than `balance_abs` requests *and* by
//!   a factor over `balance_rel`, the least loaded wins (`imbalanced`).
//! - [`Policy::Weighted`] (llm-d's scorer): `prefix · matched share + queue · (1 − load / max
//!   load) + kv · (1 − KV-cache use)`, highest wins (default weights 3 / 2 / 2).
//!
//! A prompt nothing matched (or matched too little) goes by rendezvous hashing of its first block
//! among the replicas within `balance_abs` of the least loaded, so gateway processes that never
//! talk to each other still send the same new prefix to the same replica, and it becomes an
//! affinity there for all of them. Replicas the caller marks ineligible (open circuit, full) are
//! never chosen. Pure logic: loads are passed in, nothing is measured here.

use crate::prefix::PrefixLru;

/// How the choice weighs prefix match against load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Longest matched prefix while load is balanced; least loaded when it is not.
    Gate {
        /// Absolute imbalance (requests) beyond which load decides.
        balance_abs: u32,
        /// ...and relative imbalance (busiest / idlest) beyond which load decides.
        balance_rel: f64,
        /// Least share of the prompt's blocks matched for affinity to count.
        min_match: f64,
    },
    /// A weighted score of prefix match, queue and KV-cache use.
    Weighted {
        /// Weight of the matched share of the prompt's blocks.
        prefix: f64,
        /// Weight of the free queue (1 − load / the busiest's load).
        queue: f64,
        /// Weight of the free KV cache (1 − use; replicas that report none count as half full).
        kv: f64,
    },
}

impl Policy {
    /// SGLang router's defaults (`--cache-threshold 0.5 --balance-abs-threshold 32
    /// --balance-rel-threshold 1.0001`).
    pub const GATE: Self = Self::Gate {
        balance_abs: 32,
        balance_rel: 1.0001,
        min_match: 0.5,
    };
    /// llm-d's default scorer weights (prefix 3, queue 2, KV cache 2).
    pub const WEIGHTED: Self = Self::Weighted {
        prefix: 3.0,
        queue: 2.0,
        kv: 2.0,
    };

    /// Requests within this many of the least loaded replica count as "not busier" for the
    /// rendezvous choice of a new prefix.
    fn slack(&self) -> u32 {
        match self {
            Self::Gate { balance_abs, .. } => *balance_abs,
            Self::Weighted { .. } => 2,
        }
    }
}

/// What the caller knows about one replica now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Requests running or waiting there (the server's own counts when scraped, else the
    /// gateway's in-flight count).
    pub load: u32,
    /// KV-cache use in [0, 1], when the server reports it.
    pub kv_usage: Option<f64>,
    /// Whether it may be chosen (circuit closed, below its concurrency limit).
    pub eligible: bool,
    /// A stable identity for rendezvous hashing (a hash of the replica's name): the same on
    /// every gateway process.
    pub id: u64,
}

/// Why a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds (the longest part of) the prompt's prefix.
    Affinity,
    /// No useful match: the rendezvous hash of the prompt's first block among replicas that are
    /// not busier than the rest.
    Rendezvous,
    /// The least loaded (the prompt is shorter than a block, or the policy's score said so).
    LeastLoaded,
    /// Load was too uneven for affinity to count: the least loaded.
    Imbalanced,
}

impl Reason {
    /// Every reason.
    pub const ALL: [Self; 4] = [
        Self::Affinity,
        Self::Rendezvous,
        Self::LeastLoaded,
        Self::Imbalanced,
    ];

    /// As in the `x-gateway-replica-choice` header and the ledger.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Affinity => "affinity",
            Self::Rendezvous => "rendezvous",
            Self::LeastLoaded => "least-loaded",
            Self::Imbalanced => "imbalanced",
        }
    }
}

/// A choice of replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// Index into the candidates.
    pub index: usize,
    /// Leading blocks of the prompt the router last sent to that replica.
    pub matched_blocks: usize,
    /// Why.
    pub reason: Reason,
}

/// The router's per-replica memory of prefixes, and the policy that reads it.
#[derive(Debug)]
pub struct Affinity {
    policy: Policy,
    lrus: Vec<PrefixLru>,
}

/// Rendezvous weight of `id` for a prompt starting with block `first`.
fn rendezvous(first: u64, id: u64) -> u64 {
    // SplitMix64 finaliser of the pair: cheap, and well mixed for any inputs.
    let mut z = first ^ id.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Affinity {
    /// Memory for `replicas` replicas, each remembering at most `capacity_blocks` blocks (set it
    /// near the server's KV-cache capacity in blocks: a longer memory claims prefixes the server
    /// has already evicted).
    pub fn new(policy: Policy, replicas: usize, capacity_blocks: usize) -> Self {
        Self {
            policy,
            lrus: (0..replicas)
                .map(|_| PrefixLru::new(capacity_blocks))
                .collect(),
        }
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Leading blocks of `chain` last sent to replica `index`.
    pub fn matched(&self, index: usize, chain: &[u64]) -> usize {
        self.lrus.get(index).map_or(0, |l| l.matched_prefix(chain))
    }

    /// Choose among `candidates` (one per replica, in the order given to [`Affinity::new`]) for
    /// a prompt whose block chain is `chain`; `None` when none is eligible.
    pub fn choose(&self, chain: &[u64], candidates: &[Candidate]) -> Option<Choice> {
        let eligible: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].eligible)
            .collect();
        let min = eligible.iter().map(|&i| candidates[i].load).min()?;
        let max = eligible.iter().map(|&i| candidates[i].load).max()?;
        let matched: Vec<usize> = (0..candidates.len())
            .map(|i| self.matched(i, chain))
            .collect();
        let least_loaded = |reason| {
            let index = eligible
                .iter()
                .copied()
                .min_by_key(|&i| {
                    let tie = chain
                        .first()
                        .map_or(0, |&f| rendezvous(f, candidates[i].id));
                    (candidates[i].load, std::cmp::Reverse(tie))
                })
                .unwrap_or(0);
            Choice {
                index,
                matched_blocks: matched[index],
                reason,
            }
        };
        let Some(&first) = chain.first() else {
            return Some(least_loaded(Reason::LeastLoaded));
        };
        let by_rendezvous = || {
            let slack = self.policy.slack();
            let index = eligible
                .iter()
                .copied()
                .filter(|&i| candidates[i].load <= min.saturating_add(slack))
                .max_by_key(|&i| rendezvous(first, candidates[i].id))
                .unwrap_or(0);
            Choice {
                index,
                matched_blocks: matched[index],
                reason: Reason::Rendezvous,
            }
        };
        match self.policy {
            Policy::Gate {
                balance_abs,
                balance_rel,
                min_match,
            } => {
                let imbalanced =
                    max - min > balance_abs && f64::from(max) > balance_rel * f64::from(min);
                if imbalanced {
                    return Some(least_loaded(Reason::Imbalanced));
                }
                let best = eligible.iter().copied().max_by_key(|&i| {
                    (
                        matched[i],
                        std::cmp::Reverse(candidates[i].load),
                        rendezvous(first, candidates[i].id),
                    )
                })?;
                let share = matched[best] as f64 / chain.len() as f64;
                if matched[best] > 0 && share > min_match {
                    Some(Choice {
                        index: best,
                        matched_blocks: matched[best],
                        reason: Reason::Affinity,
                    })
                } else {
                    Some(by_rendezvous())
                }
            }
            Policy::Weighted { prefix, queue, kv } => {
                if eligible.iter().all(|&i| matched[i] == 0) {
                    return Some(by_rendezvous());
                }
                let busiest = f64::from(max.max(1));
                let score = |i: usize| {
                    let c = &candidates[i];
                    prefix * matched[i] as f64 / chain.len() as f64
                        + queue * (1.0 - f64::from(c.load) / busiest)
                        + kv * (1.0 - c.kv_usage.unwrap_or(0.5).clamp(0.0, 1.0))
                };
                let best = eligible.iter().copied().max_by(|&a, &b| {
                    score(a).total_cmp(&score(b)).then(
                        rendezvous(first, candidates[a].id)
                            .cmp(&rendezvous(first, candidates[b].id)),
                    )
                })?;
                let longest = eligible.iter().map(|&i| matched[i]).max().unwrap_or(0);
                let reason = if matched[best] > 0 && matched[best] == longest {
                    Reason::Affinity
                } else {
                    Reason::LeastLoaded
                };
                Some(Choice {
                    index: best,
                    matched_blocks: matched[best],
                    reason,
                })
            }
        }
    }

    /// The prompt `chain` was sent to replica `index`: remember its blocks there.
    pub fn record(&mut self, index: usize, chain: &[u64]) {
        if let Some(l) = self.lrus.get_mut(index) {
            l.touch(chain);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                load: 0,
                kv_usage: None,
                eligible: true,
                id: 1000 + i as u64,
            })
            .collect()
    }

    /// A prompt of `blocks` blocks sharing its first `shared` with prefix family `family`.
    fn chain(family: u64, shared: usize, blocks: usize, tail: u64) -> Vec<u64> {
        (0..blocks as u64)
            .map(|b| {
                if (b as usize) < shared {
                    family * 1_000 + b
                } else {
                    family * 1_000_000 + tail * 1_000 + b
                }
            })
            .collect()
    }

    #[test]
    fn a_shared_prefix_goes_back_to_the_replica_that_holds_it() {
        for policy in [Policy::GATE, Policy::WEIGHTED] {
            let mut a = Affinity::new(policy, 3, 10_000);
            let c = idle(3);
            let first = chain(7, 8, 10, 1);
            let pick = a.choose(&first, &c).unwrap();
            assert_eq!(pick.reason, Reason::Rendezvous, "{policy:?}");
            a.record(pick.index, &first);
            // Same system prompt and history, a different last turn.
            let next = chain(7, 8, 10, 2);
            let again = a.choose(&next, &c).unwrap();
            assert_eq!(again.index, pick.index, "{policy:?}");
            assert_eq!(again.reason, Reason::Affinity);
            assert_eq!(again.matched_blocks, 8);
        }
    }

    #[test]
    fn too_uneven_a_load_overrides_affinity() {
        let mut a = Affinity::new(Policy::GATE, 2, 10_000);
        let p = chain(1, 10, 10, 0);
        a.record(0, &p);
        let mut c = idle(2);
        c[0].load = 40;
        c[1].load = 5;
        let pick = a.choose(&p, &c).unwrap();
        assert_eq!((pick.index, pick.reason), (1, Reason::Imbalanced));
        // Within the absolute gate, affinity holds.
        c[0].load = 30;
        let pick = a.choose(&p, &c).unwrap();
        assert_eq!((pick.index, pick.reason), (0, Reason::Affinity));
    }

    #[test]
    fn ineligible_replicas_are_never_chosen() {
        for policy in [Policy::GATE, Policy::WEIGHTED] {
            let mut a = Affinity::new(policy, 3, 10_000);
            let p = chain(2, 10, 10, 0);
            a.record(1, &p);
            let mut c = idle(3);
            c[1].eligible = false;
            let pick = a.choose(&p, &c).unwrap();
            assert_ne!(pick.index, 1, "{policy:?}");
            for x in &mut c {
                x.eligible = false;
            }
            assert!(a.choose(&p, &c).is_none());
        }
    }

    #[test]
    fn independent_routers_agree_on_new_prefixes_and_spread_them() {
        let (a, b) = (
            Affinity::new(Policy::GATE, 4, 10_000),
            Affinity::new(Policy::GATE, 4, 10_000),
        );
        let c = idle(4);
        let mut per_replica = [0usize; 4];
        for family in 0..400 {
            let p = chain(family, 4, 4, 0);
            let x = a.choose(&p, &c).unwrap();
            assert_eq!(
                x,
                b.choose(&p, &c).unwrap(),
                "same choice without shared state"
            );
            per_replica[x.index] += 1;
        }
        assert!(
            per_replica.iter().all(|&n| (60..=140).contains(&n)),
            "new prefixes spread over the replicas: {per_replica:?}"
        );
    }

    #[test]
    fn a_new_prefix_avoids_a_busier_replica() {
        let a = Affinity::new(Policy::GATE, 2, 10_000);
        let mut c = idle(2);
        c[0].load = 100;
        for family in 0..50 {
            let p = chain(family, 2, 2, 0);
            // 100 vs 0 is imbalanced anyway; at 20 vs 0 (within the gate) the rendezvous
            // choice still only considers replicas within the slack of the least loaded.
            assert_eq!(a.choose(&p, &c).unwrap().index, 1);
        }
        let a = Affinity::new(Policy::WEIGHTED, 2, 10_000);
        c[0].load = 20;
        for family in 0..50 {
            let p = chain(family, 2, 2, 0);
            assert_eq!(a.choose(&p, &c).unwrap().index, 1);
        }
    }

    #[test]
    fn weighted_trades_prefix_against_queue_and_kv_cache() {
        let mut a = Affinity::new(Policy::WEIGHTED, 2, 10_000);
        let p = chain(3, 10, 10, 0);
        a.record(0, &p);
        let mut c = idle(2);
        // Full match (3) against a slightly busier queue: affinity.
        c[0].load = 2;
        c[1].load = 1;
        assert_eq!(a.choose(&p, &c).unwrap().index, 0);
        // A full KV cache and the longest queue outweigh the match: 3 + 0 + 0 < 0 + 2 + 2.
        c[0].load = 10;
        c[0].kv_usage = Some(1.0);
        c[1].kv_usage = Some(0.0);
        let pick = a.choose(&p, &c).unwrap();
        assert_eq!((pick.index, pick.reason), (1, Reason::LeastLoaded));
    }

    #[test]
    fn an_evicted_prefix_is_forgotten_like_the_server_forgets_it() {
        // Room for one 10-block prompt per replica.
        let mut a = Affinity::new(Policy::GATE, 2, 10);
        let c = idle(2);
        let old = chain(1, 10, 10, 0);
        let home = a.choose(&old, &c).unwrap().index;
        a.record(home, &old);
        assert_eq!(a.matched(home, &old), 10);
        // Another prompt sent to the same replica pushes the first out of its memory.
        let newer = chain(2, 10, 10, 0);
        a.record(home, &newer);
        assert_eq!(a.matched(home, &old), 0);
        let again = a.choose(&old, &c).unwrap();
        assert_eq!(again.reason, Reason::Rendezvous, "no stale affinity");
        assert_eq!(again.matched_blocks, 0);
    }

    #[test]
    fn a_prompt_shorter_than_a_block_goes_to_the_least_loaded() {
        let a = Affinity::new(Policy::GATE, 2, 10);
        let mut c = idle(2);
        c[0].load = 3;
        let pick = a.choose(&[], &c).unwrap();
        assert_eq!((pick.index, pick.reason), (1, Reason::LeastLoaded));
    }
}
