//! The semantic cache's first stage: a question shares no rare words with any stored question of
//! its namespace, so no stored question can be a hit, and the transformer is not run for it.
//!
//! The verifier accepts a pair only when the two questions share most of their rare words (its
//! features weigh tokens by rarity), so a lookup whose rarity-weighted token overlap with every
//! stored question is low is a miss the transformer would only confirm. Measured on the dev pairs
//! (`bench/semantic-prefilter.py gate`, docs/benchmarks.md), a threshold well below what the
//! verifier ever accepts keeps its hits and still decides most misses among varied questions in
//! microseconds.
//!
//! The overlap is the weighted Jaccard of the two token *sets*, each token weighted by its
//! inverse document frequency (the verifier's own table): shared weight over the union's weight.
//! Candidates are found by prefix filtering: a stored question reaching overlap `t` shares at
//! least `t` of the query's weight, so it must share one of the query's rarest tokens, those
//! whose weight adds up to more than `1 - t` of the whole; only their postings are read. Work is
//! bounded: past [`MAX_CANDIDATES`] candidates the gate lets the lookup through.
//!
//! The gate only ever errs towards the transformer: an entry it still holds after the index
//! dropped it, a query it cannot tokenise, or postings being written at that moment let the
//! lookup through.

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;

use tokenizers::Tokenizer;

use crate::index::EntryId;
use crate::student::StudentGate;
use crate::verifier::features::TokenIdf;

/// Most stored questions whose overlap one lookup computes before letting it through.
pub const MAX_CANDIDATES: usize = 2048;

/// A stored question: its namespace, its distinct token ids (sorted) and their total weight.
#[derive(Debug)]
struct Entry {
    ns: u64,
    tokens: Box<[u32]>,
    weight: f32,
}

#[derive(Debug, Default)]
struct Postings {
    /// (namespace, token) -> the entries holding that token.
    by_token: HashMap<(u64, u32), Vec<EntryId>>,
    entries: HashMap<EntryId, Entry>,
}

/// Token postings of every stored question, shared between the thread that indexes answers and
/// the requests that look them up.
pub struct TokenGate {
    tokenizer: Tokenizer,
    /// Each token id's weight (rarity); ids beyond it weigh `unseen`.
    weights: Vec<f32>,
    unseen: f32,
    threshold: f32,
    postings: RwLock<Postings>,
}

impl std::fmt::Debug for TokenGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenGate")
            .field("threshold", &self.threshold)
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

/// What the gate decided for one lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Some stored question overlaps enough (or the gate could not tell): run the lookup.
    Through,
    /// No stored question of the namespace overlaps enough: a miss.
    Miss,
}

/// What the first stage knows of the stored questions a lookup may match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Near {
    /// None can: the lookup is a miss.
    Nothing,
    /// Only these may, as far as the stage can tell (it errs like [`Gate::Miss`]: a reworded
    /// paraphrase may fall below its threshold), among those stored when it looked.
    Only(Vec<EntryId>),
    /// Some may, or it could not tell which (not asked, a namespace too large to scan,
    /// entries being pruned).
    Unknown,
}

impl Near {
    /// The decision alone.
    pub fn gate(&self) -> Gate {
        match self {
            Self::Nothing => Gate::Miss,
            Self::Only(_) | Self::Unknown => Gate::Through,
        }
    }
}

/// The first stage a semantic cache runs: rarity-weighted token overlap ([`TokenGate`]) or the
/// learned student vector ([`StudentGate`]). Both decide from a question's token ids, computed
/// once per request ([`FirstStage::tokens`]) for its check and its insert.
#[derive(Debug)]
pub enum FirstStage {
    /// Token overlap.
    Overlap(Box<TokenGate>),
    /// Student cosine.
    Student(StudentGate),
}

impl FirstStage {
    fn stage(&self) -> &dyn Stage {
        match self {
            Self::Overlap(g) => g.as_ref(),
            Self::Student(g) => g,
        }
    }

    /// The question's token ids as this stage wants them (`None`: it could not be tokenised).
    pub fn tokens(&self, text: &str) -> Option<Vec<u32>> {
        self.stage().tokens(text)
    }

    /// Whether a lookup of the question whose [`FirstStage::tokens`] are `tokens` may hit in `ns`.
    pub fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate {
        self.stage().check_tokens(ns, tokens)
    }

    /// [`FirstStage::check_tokens`], with the stored questions that passed when the stage
    /// can say which (the learned stage; the overlap stage stops at the first).
    pub fn near(&self, ns: u64, tokens: &[u32]) -> Near {
        match self {
            Self::Overlap(g) => match g.check_tokens(ns, tokens) {
                Gate::Miss => Near::Nothing,
                Gate::Through => Near::Unknown,
            },
            Self::Student(g) => g.near(ns, tokens),
        }
    }

    /// Record stored question `id` of `ns` by its [`FirstStage::tokens`].
    pub fn insert(&self, ns: u64, id: EntryId, tokens: Vec<u32>) {
        match self {
            Self::Overlap(g) => g.insert(ns, id, tokens),
            Self::Student(g) => g.insert(ns, id, &tokens),
        }
    }

    /// Forget every stored question `keep` says no.
    pub fn retain(&self, keep: impl FnMut(EntryId) -> bool) {
        match self {
            Self::Overlap(g) => g.retain(keep),
            Self::Student(g) => g.retain(keep),
        }
    }

    /// Stored questions.
    pub fn len(&self) -> usize {
        match self {
            Self::Overlap(g) => g.len(),
            Self::Student(g) => g.len(),
        }
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What both first stages do from a question's text.
pub trait Stage {
    /// The question's token ids as the stage wants them (`None`: it could not be tokenised).
    fn tokens(&self, text: &str) -> Option<Vec<u32>>;
    /// Whether a lookup of the question whose tokens are `tokens` may hit in `ns`.
    fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate;
    /// Whether a lookup of `text` in namespace `ns` may find a hit (one it cannot tokenise
    /// goes through).
    fn check(&self, ns: u64, text: &str) -> Gate {
        match self.tokens(text) {
            Some(tokens) => self.check_tokens(ns, &tokens),
            None => Gate::Through,
        }
    }
}

impl Stage for TokenGate {
    fn tokens(&self, text: &str) -> Option<Vec<u32>> {
        TokenGate::tokens(self, text)
    }
    fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate {
        TokenGate::check_tokens(self, ns, tokens)
    }
}

impl TokenGate {
    /// A gate that lets through lookups overlapping a stored question by at least `threshold`
    /// (0 lets every lookup through), with token rarities from `idf`.
    pub fn new(tokenizer: Tokenizer, idf: &TokenIdf, threshold: f32) -> Self {
        let weights = (0..idf.df.len())
            .map(|id| idf.idf(u32::try_from(id).unwrap_or(u32::MAX)))
            .collect();
        Self {
            tokenizer,
            weights,
            unseen: idf.idf(u32::MAX),
            threshold,
            postings: RwLock::new(Postings::default()),
        }
    }

    fn weight(&self, id: u32) -> f32 {
        self.weights
            .get(id as usize)
            .copied()
            .unwrap_or(self.unseen)
    }

    /// The distinct token ids of `text`, sorted (`None`: it could not be tokenised).
    pub fn tokens(&self, text: &str) -> Option<Vec<u32>> {
        let enc = self.tokenizer.encode_fast(text, false).ok()?;
        let mut ids = enc.get_ids().to_vec();
        ids.sort_unstable();
        ids.dedup();
        Some(ids)
    }

    /// Stored questions.
    pub fn len(&self) -> usize {
        self.postings.read().map_or(0, |p| p.entries.len())
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record stored question `id` of namespace `ns`, whose distinct sorted token ids
    /// ([`TokenGate::tokens`]) are `tokens`.
    pub fn insert(&self, ns: u64, id: EntryId, tokens: Vec<u32>) {
        let weight = tokens.iter().map(|&t| self.weight(t)).sum();
        let Ok(mut p) = self.postings.write() else {
            return;
        };
        for &t in &tokens {
            p.by_token.entry((ns, t)).or_default().push(id);
        }
        p.entries.insert(
            id,
            Entry {
                ns,
                tokens: tokens.into_boxed_slice(),
                weight,
            },
        );
    }

    /// Forget every stored question `keep` says no.
    pub fn retain(&self, mut keep: impl FnMut(EntryId) -> bool) {
        let Ok(mut p) = self.postings.write() else {
            return;
        };
        let gone: Vec<EntryId> = p.entries.keys().copied().filter(|&id| !keep(id)).collect();
        for id in gone {
            let Some(entry) = p.entries.remove(&id) else {
                continue;
            };
            for &t in entry.tokens.iter() {
                if let Some(list) = p.by_token.get_mut(&(entry.ns, t)) {
                    list.retain(|&e| e != id);
                    if list.is_empty() {
                        p.by_token.remove(&(entry.ns, t));
                    }
                }
            }
        }
    }

    /// Whether a lookup of the question whose [`TokenGate::tokens`] are `tokens` may hit.
    pub fn check_tokens(&self, ns: u64, tokens: &[u32]) -> Gate {
        if self.threshold <= 0.0 {
            return Gate::Through;
        }
        let mut weighted: Vec<(f32, u32)> = tokens.iter().map(|&t| (self.weight(t), t)).collect();
        let total: f32 = weighted.iter().map(|w| w.0).sum();
        if total <= 0.0 {
            return Gate::Through;
        }
        weighted.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        // Never wait on a request's thread: while the postings are being pruned, let it through.
        let Ok(p) = self.postings.try_read() else {
            return Gate::Through;
        };
        // A stored question sharing none of the prefix shares at most the rest of the weight,
        // which is below `threshold * total`: its overlap is below the threshold.
        let mut rest = total;
        let mut seen: HashSet<EntryId> = HashSet::new();
        for &(w, t) in &weighted {
            if rest < self.threshold * total {
                break;
            }
            rest -= w;
            for id in p.by_token.get(&(ns, t)).map_or(&[][..], Vec::as_slice) {
                if !seen.insert(*id) {
                    continue;
                }
                if seen.len() > MAX_CANDIDATES {
                    return Gate::Through;
                }
                let Some(entry) = p.entries.get(id) else {
                    continue;
                };
                if self.overlap(tokens, total, entry) >= self.threshold {
                    return Gate::Through;
                }
            }
        }
        Gate::Miss
    }

    /// Weighted Jaccard of `tokens` (sorted, distinct, weighing `total`) and `entry`'s.
    fn overlap(&self, tokens: &[u32], total: f32, entry: &Entry) -> f32 {
        let (mut i, mut j, mut shared) = (0, 0, 0.0f32);
        while i < tokens.len() && j < entry.tokens.len() {
            match tokens[i].cmp(&entry.tokens[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    shared += self.weight(tokens[i]);
                    i += 1;
                    j += 1;
                }
            }
        }
        let union = total + entry.weight - shared;
        if union > 0.0 {
            shared / union
        } else {
            0.0
        }
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use std::str::FromStr;

    use super::*;

    const WORDS: &[&str] = &[
        "[UNK]", "how", "do", "i", "the", "a", "?", "cook", "italian", "food", "at", "home",
        "learn", "python", "fix", "bike", "flat", "tyre", "paris", "rome", "fly", "to", "from",
    ];

    /// A word-level tokenizer over `WORDS`, and rarities where function words are common.
    fn gate(threshold: f32) -> TokenGate {
        let vocab: serde_json::Map<String, serde_json::Value> = WORDS
            .iter()
            .enumerate()
            .map(|(i, w)| ((*w).to_owned(), serde_json::json!(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        let tokenizer = Tokenizer::from_str(&json.to_string()).expect("tokenizer");
        let common = ["how", "do", "i", "the", "a", "?", "to", "at", "from"];
        let df = WORDS
            .iter()
            .map(|w| if common.contains(w) { 900 } else { 10 })
            .collect();
        TokenGate::new(tokenizer, &TokenIdf { docs: 1000, df }, threshold)
    }

    fn store(g: &TokenGate, ns: u64, id: EntryId, text: &str) {
        g.insert(ns, id, g.tokens(text).unwrap());
    }

    #[test]
    fn a_question_sharing_its_rare_words_goes_through_and_an_unrelated_one_is_a_miss() {
        let g = gate(0.15);
        assert_eq!(
            g.check(1, "how do i cook italian food ?"),
            Gate::Miss,
            "empty"
        );
        store(&g, 1, 1, "how do i cook italian food at home ?");
        assert_eq!(g.check(1, "how do i cook italian food ?"), Gate::Through);
        assert_eq!(g.check(1, "how do i learn italian ?"), Gate::Through);
        // Only function words in common: a miss, decided without the model.
        assert_eq!(g.check(1, "how do i fix a flat tyre ?"), Gate::Miss);
        // Another namespace holds nothing.
        assert_eq!(g.check(2, "how do i cook italian food ?"), Gate::Miss);
        // Off: everything goes through.
        assert_eq!(
            gate(0.0).check(1, "how do i fix a flat tyre ?"),
            Gate::Through
        );
    }

    #[test]
    fn forgotten_entries_no_longer_let_lookups_through() {
        let g = gate(0.15);
        store(&g, 1, 1, "how do i cook italian food ?");
        store(&g, 1, 2, "fly from paris to rome");
        assert_eq!(g.len(), 2);
        g.retain(|id| id != 1);
        assert_eq!(g.len(), 1);
        assert_eq!(g.check(1, "cook italian food"), Gate::Miss);
        assert_eq!(g.check(1, "fly to rome from paris"), Gate::Through);
    }

    #[test]
    fn the_prefix_filter_agrees_with_every_overlap_computed_in_full() {
        // Pseudo-random questions over the vocabulary: the gate's answer must be exactly
        // whether some stored question's overlap reaches the threshold.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let text = |next: &mut dyn FnMut(usize) -> usize| {
            let len = 1 + next(7);
            (0..len)
                .map(|_| WORDS[1 + next(WORDS.len() - 1)])
                .collect::<Vec<_>>()
                .join(" ")
        };
        for threshold in [0.1, 0.3, 0.5, 0.8] {
            let g = gate(threshold);
            let stored: Vec<String> = (0..12).map(|_| text(&mut next)).collect();
            for (id, s) in stored.iter().enumerate() {
                store(&g, 7, id as EntryId, s);
            }
            for _ in 0..300 {
                let q = text(&mut next);
                let tokens = g.tokens(&q).unwrap();
                let total: f32 = tokens.iter().map(|&t| g.weight(t)).sum();
                let p = g.postings.read().unwrap();
                let full = p
                    .entries
                    .values()
                    .any(|e| g.overlap(&tokens, total, e) >= threshold);
                drop(p);
                let want = if full { Gate::Through } else { Gate::Miss };
                assert_eq!(g.check(7, &q), want, "{q:?} at {threshold}");
            }
        }
    }

    #[test]
    fn too_many_candidates_let_the_lookup_through() {
        let g = gate(0.4);
        // Every stored question shares "python" but none is close to the query.
        for id in 0..=MAX_CANDIDATES as EntryId {
            store(&g, 1, id, "python fix bike flat tyre paris rome");
        }
        assert_eq!(g.check(1, "learn python"), Gate::Through);
        let g = gate(0.4);
        store(&g, 1, 1, "python fix bike flat tyre paris rome");
        assert_eq!(g.check(1, "learn python"), Gate::Miss);
    }
}
