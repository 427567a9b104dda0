//! What the verifier reads from a candidate pair: lexical and alignment features for the trees,
//! and four vector representations of the pair for the linear models stacked under them.
//!
//! Everything here is symmetric in the two texts (the query and the stored question have no
//! order in training data), and split in two: [`PairBasics`], which needs only the texts, their
//! vectors and the static table, and [`Stats::inputs`], which also needs what is fitted on
//! training texts (token document frequencies, principal components). Training computes the
//! basics once and the rest per fold; serving runs both, through the same code.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::bert::{cosine, MAX_TOKENS};
use crate::index::{dot, normalise};
use crate::learn::pca::Pca;
use crate::static_embed::StaticEmbedder;

/// Names of the pair features the trees read first, in order.
pub const FEATURES: &[&str] = &[
    "cosine_transformer",
    "cosine_static",
    "align_min",
    "align_mean",
    "numbers_differ",
    "numbers_symmetric_difference",
    "entities_differ",
    "negation_differs",
    "question_word_differs",
    "length_ratio",
    "word_jaccard",
    "same_normalised_text",
    "cosine_transformer_x_align_min",
    "context_align_min",
    "context_align_mean",
];

const NEGATIONS: &[&str] = &["not", "no", "never", "without", "none", "cannot", "nor"];
const QUESTION_WORDS: &[&str] = &[
    "what", "how", "why", "which", "who", "whom", "whose", "where", "when", "is", "are", "can",
    "could", "should", "would", "do", "does", "did", "will", "was", "were",
];

fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

fn numbers(ws: &[String]) -> BTreeSet<String> {
    ws.iter()
        .filter(|w| w.chars().any(|c| c.is_ascii_digit()))
        .map(|w| w.to_lowercase())
        .collect()
}

fn entities(ws: &[String]) -> BTreeSet<String> {
    ws.iter()
        .skip(1)
        .filter(|w| w.chars().next().is_some_and(char::is_uppercase))
        .map(|w| w.to_lowercase())
        .collect()
}

fn negated(ws: &[String]) -> bool {
    ws.iter().any(|w| {
        let w = w.to_lowercase();
        NEGATIONS.contains(&w.as_str()) || w.ends_with("n't")
    })
}

fn question_word(ws: &[String]) -> Option<String> {
    ws.iter()
        .map(|w| w.to_lowercase())
        .find(|w| QUESTION_WORDS.contains(&w.as_str()))
}

/// Names of the features that see word order, templates and the form of the request (after
/// [`EXTRA`]).
pub const FORM: &[&str] = &[
    "order_inversions",
    "bigram_jaccard",
    "bigram_minus_word_jaccard",
    "placeholders_differ",
    "question_form_differs",
];

/// Words in `{braces}` (template placeholders), lower-cased.
fn placeholders(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else { break };
        let name = after[..close].trim();
        if !name.is_empty() && name.len() <= 40 {
            out.insert(name.to_lowercase());
        }
        rest = &after[close + 1..];
    }
    out
}

/// Share of discordant pairs among the words that occur once in each text, ordered as in `a`
/// and compared with their order in `b` (0: same order; a swapped "from Paris to Rome" / "from
/// Rome to Paris" reads as out of order although the bags of words agree).
fn order_inversions(la: &[String], lb: &[String]) -> f32 {
    fn once(ws: &[String]) -> std::collections::HashMap<&str, (usize, usize)> {
        let mut seen: std::collections::HashMap<&str, (usize, usize)> = Default::default();
        for (i, w) in ws.iter().enumerate() {
            seen.entry(w.as_str()).or_insert((i, 0)).1 += 1;
        }
        seen
    }
    let (oa, ob) = (once(la), once(lb));
    let mut positions: Vec<(usize, usize)> = oa
        .iter()
        .filter(|(_, (_, n))| *n == 1)
        .filter_map(|(w, (i, _))| ob.get(w).filter(|(_, n)| *n == 1).map(|(j, _)| (*i, *j)))
        .collect();
    if positions.len() < 2 {
        return 0.0;
    }
    positions.sort_unstable();
    let n = positions.len();
    let mut discordant = 0usize;
    for x in 0..n {
        for y in x + 1..n {
            discordant += usize::from(positions[y].1 < positions[x].1);
        }
    }
    discordant as f32 / (n * (n - 1) / 2) as f32
}

fn bigrams(ws: &[String]) -> BTreeSet<(&str, &str)> {
    ws.windows(2)
        .map(|w| (w[0].as_str(), w[1].as_str()))
        .collect()
}

/// A question (ends with "?" or opens with a question word) rather than a statement or an
/// instruction.
fn question_form(text: &str, lower: &[String]) -> bool {
    text.trim_end().ends_with('?')
        || lower
            .first()
            .is_some_and(|w| QUESTION_WORDS.contains(&w.as_str()))
}

/// Names of the features that weigh tokens by rarity (after [`FEATURES`]).
pub const EXTRA: &[&str] = &[
    "idf_unmatched_share",
    "idf_dice",
    "idf_rarest_unmatched",
    "idf_rarest_unmatched_both_sides",
    "idf_unmatched_sum_min",
    "idf_unmatched_sum_max",
    "idf_unmatched_sum",
    "rare_unmatched_tokens",
    "context_idf_match_max",
    "context_idf_match_min",
    "context_idf_match_f",
    "context_weakest_rare_match",
    "context_idf_below_0_5",
    "context_idf_below_0_7",
    "context_rarest_below_0_5",
    "context_second_weakest",
    "context_share_below_0_6",
    "cosine_static_idf",
];

/// Names of the linear models' scores (after [`FORM`]).
pub const BASES: &[&str] = &[
    "linear_bilinear_pca",
    "linear_sentence_product",
    "linear_maxpool_product",
    "linear_unmatched_tokens",
];

/// Principal components of sentence vectors the bilinear representation keeps.
pub const PCA_COMPONENTS: usize = 48;

/// A contextual token counts as unmatched below this best-match similarity.
const UNMATCHED_BELOW: f32 = 0.6;

/// One side of a pair: its text, sentence vector and contextual token vectors (real tokens,
/// without `[CLS]`/`[SEP]`, as the transformer returns them).
#[derive(Debug, Clone, Copy)]
pub struct Text<'a> {
    /// The text.
    pub text: &'a str,
    /// Its L2-normalised sentence vector.
    pub sentence: &'a [f32],
    /// Its contextual token vectors.
    pub tokens: &'a [Vec<f32>],
}

/// Token document frequencies over the training texts (label-free), for rarity weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenIdf {
    /// Texts counted.
    pub docs: u32,
    /// Texts containing each token id.
    pub df: Vec<u32>,
}

impl TokenIdf {
    /// Count the texts `ids` (one token id list per text).
    pub fn fit<'a>(ids: impl Iterator<Item = &'a [u32]>) -> Self {
        let mut df: Vec<u32> = Vec::new();
        let mut docs = 0u32;
        let mut seen = BTreeSet::new();
        for text in ids {
            docs += 1;
            seen.clear();
            seen.extend(text.iter().copied());
            for &id in &seen {
                let at = id as usize;
                if at >= df.len() {
                    df.resize(at + 1, 0);
                }
                df[at] += 1;
            }
        }
        Self { docs, df }
    }

    /// `ln((docs + 1) / (df + 1))`: about 0 for a token in every text, largest for unseen ones.
    pub fn idf(&self, id: u32) -> f32 {
        let df = self.df.get(id as usize).copied().unwrap_or(0);
        ((f64::from(self.docs) + 1.0) / (f64::from(df) + 1.0)).ln() as f32
    }
}

/// What is fitted on training texts and needed to compute a pair's inputs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats {
    /// Token rarity.
    pub idf: TokenIdf,
    /// Leading components of sentence vectors (`None` without the linear models, which alone
    /// read them).
    pub pca: Option<Pca>,
}

/// What a pair's inputs need that depends on nothing fitted.
#[derive(Debug, Clone)]
pub struct PairBasics {
    /// [`FEATURES`] then [`FORM`].
    pub features: Vec<f32>,
    /// `[u∘v, |u−v|]` of the sentence vectors.
    pub sentence_product: Vec<f32>,
    /// The same of the max-pooled contextual token vectors.
    pub maxpool_product: Vec<f32>,
    /// Static-tokenizer ids of each text (whole text).
    ids: [Vec<u32>; 2],
    /// Each contextual token's best match among the other text's tokens.
    best: [Vec<f32>; 2],
    /// The same words in the same order, ignoring case and punctuation: the same question.
    pub same_words: bool,
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    normalise(&mut v);
    v
}

fn product(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = a.iter().zip(b).map(|(x, y)| x * y).collect();
    out.extend(a.iter().zip(b).map(|(x, y)| (x - y).abs()));
    out
}

fn max_pool(tokens: &[Vec<f32>], dim: usize) -> Vec<f32> {
    if tokens.is_empty() {
        return vec![0.0; dim];
    }
    let mut out = vec![f32::NEG_INFINITY; dim];
    for t in tokens {
        out.iter_mut().zip(t).for_each(|(o, x)| *o = o.max(*x));
    }
    unit(out)
}

/// Best-match cosines of each token of `ta` among `tb` and of `tb` among `ta` (0 for every
/// token when the other side has none).
fn best_matches(ta: &[Vec<f32>], tb: &[Vec<f32>]) -> [Vec<f32>; 2] {
    if ta.is_empty() || tb.is_empty() {
        return [vec![0.0; ta.len()], vec![0.0; tb.len()]];
    }
    let norms =
        |t: &[Vec<f32>]| -> Vec<f32> { t.iter().map(|v| dot(v, v).sqrt().max(1e-12)).collect() };
    let (na, nb) = (norms(ta), norms(tb));
    let mut ba = vec![-1.0f32; ta.len()];
    let mut bb = vec![-1.0f32; tb.len()];
    for (i, a) in ta.iter().enumerate() {
        for (j, b) in tb.iter().enumerate() {
            let c = dot(a, b) / (na[i] * nb[j]);
            ba[i] = ba[i].max(c);
            bb[j] = bb[j].max(c);
        }
    }
    [ba, bb]
}

/// Weakest and mean best match over both directions.
fn weakest_and_mean(best: &[Vec<f32>; 2]) -> (f32, f32) {
    let all = best[0].iter().chain(&best[1]);
    let n = best[0].len() + best[1].len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let min = all.clone().copied().fold(1.0f32, f32::min);
    (min, all.sum::<f32>() / n as f32)
}

impl PairBasics {
    /// The static-tokenizer ids of the two texts.
    pub fn ids(&self) -> [&Vec<u32>; 2] {
        [&self.ids[0], &self.ids[1]]
    }

    /// Compute the basics of the pair `(a, b)`.
    pub fn new(a: &Text<'_>, b: &Text<'_>, table: &StaticEmbedder) -> Self {
        // As many tokens as the transformer reads: token alignment costs the product of the
        // two lengths, and a pasted document must not stall the cache's thread.
        let ids = |t: &str| {
            let mut ids = table.ids(t).unwrap_or_default();
            ids.truncate(MAX_TOKENS - 2);
            ids
        };
        let ids = [ids(a.text), ids(b.text)];
        let best = best_matches(a.tokens, b.tokens);
        let statics = |ids: &[u32]| {
            ids.iter()
                .map(|&id| table.embed_ids(&[id]))
                .collect::<Vec<_>>()
        };
        let static_align = weakest_and_mean(&best_matches(&statics(&ids[0]), &statics(&ids[1])));
        let context_align = weakest_and_mean(&best);
        let (wa, wb) = (words(a.text), words(b.text));
        let features = lexical(
            &wa,
            &wb,
            cosine(a.sentence, b.sentence),
            cosine(&table.embed_ids(&ids[0]), &table.embed_ids(&ids[1])),
            static_align,
            context_align,
        );
        let mut features = features;
        features.extend(form(a.text, b.text, &wa, &wb));
        let dim = a.sentence.len();
        Self {
            same_words: wa.len() == wb.len()
                && wa
                    .iter()
                    .zip(&wb)
                    .all(|(x, y)| x.to_lowercase() == y.to_lowercase()),
            features,
            sentence_product: product(a.sentence, b.sentence),
            maxpool_product: product(&max_pool(a.tokens, dim), &max_pool(b.tokens, dim)),
            ids,
            best,
        }
    }
}

/// [`FEATURES`] of a pair, given its cosines and alignments (weakest, mean best match).
fn lexical(
    wa: &[String],
    wb: &[String],
    cosine_transformer: f32,
    cosine_static: f32,
    (align_min, align_mean): (f32, f32),
    (context_min, context_mean): (f32, f32),
) -> Vec<f32> {
    let (na, nb) = (numbers(wa), numbers(wb));
    let (ea, eb) = (entities(wa), entities(wb));
    let lower = |ws: &[String]| ws.iter().map(|w| w.to_lowercase()).collect::<BTreeSet<_>>();
    let (la, lb) = (lower(wa), lower(wb));
    let union = la.union(&lb).count().max(1);
    let (lena, lenb) = (wa.len().max(1) as f32, wb.len().max(1) as f32);
    let flag = |x: bool| if x { 1.0 } else { 0.0 };
    vec![
        cosine_transformer,
        cosine_static,
        align_min,
        align_mean,
        flag(na != nb),
        na.symmetric_difference(&nb).count() as f32,
        ea.symmetric_difference(&eb).count() as f32,
        flag(negated(wa) != negated(wb)),
        flag(question_word(wa) != question_word(wb)),
        lena.min(lenb) / lena.max(lenb),
        la.intersection(&lb).count() as f32 / union as f32,
        flag(la == lb),
        cosine_transformer * align_min,
        context_min,
        context_mean,
    ]
}

/// [`FORM`] of a pair: word order, template placeholders and the form of the request.
fn form(ta: &str, tb: &str, wa: &[String], wb: &[String]) -> Vec<f32> {
    let lower = |ws: &[String]| ws.iter().map(|w| w.to_lowercase()).collect::<Vec<_>>();
    let (la, lb) = (lower(wa), lower(wb));
    let (ba, bb) = (bigrams(&la), bigrams(&lb));
    let bigram = ba.intersection(&bb).count() as f32 / ba.union(&bb).count().max(1) as f32;
    let (sa, sb): (BTreeSet<&String>, BTreeSet<&String>) =
        (la.iter().collect(), lb.iter().collect());
    let word = sa.intersection(&sb).count() as f32 / sa.union(&sb).count().max(1) as f32;
    let flag = |x: bool| if x { 1.0 } else { 0.0 };
    vec![
        order_inversions(&la, &lb),
        bigram,
        word - bigram,
        flag(placeholders(ta) != placeholders(tb)),
        flag(question_form(ta, &la) != question_form(tb, &lb)),
    ]
}

/// A pair's inputs to the stacked model: the trees' features ([`FEATURES`] then [`EXTRA`]) and
/// one vector per linear model ([`BASES`], when the verifier has them).
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The trees' features (the linear models' scores are appended after them).
    pub features: Vec<f32>,
    /// One input vector per [`BASES`] entry (empty without the linear models).
    pub bases: Vec<Vec<f32>>,
}

impl Stats {
    /// Fit on training texts: their static-tokenizer ids and, for the linear models over
    /// vectors (`linear`), their sentence vectors.
    pub fn fit<'a>(
        ids: impl Iterator<Item = &'a [u32]>,
        sentences: impl Iterator<Item = &'a [f32]> + Clone,
        linear: bool,
    ) -> Self {
        Self {
            idf: TokenIdf::fit(ids),
            pca: linear.then(|| Pca::fit(sentences, PCA_COMPONENTS)),
        }
    }

    /// The inputs of the pair `(a, b)` whose basics are `basics`.
    pub fn inputs(
        &self,
        basics: &PairBasics,
        a: &Text<'_>,
        b: &Text<'_>,
        table: &StaticEmbedder,
    ) -> Inputs {
        // Each contextual token's rarity.
        let weights = |side: usize| -> Vec<f32> {
            (0..basics.best[side].len())
                .map(|i| basics.ids[side].get(i).map_or(0.0, |&id| self.idf.idf(id)))
                .collect()
        };
        let weights = [weights(0), weights(1)];
        let mut features = basics.features.clone();
        features.extend(self.rarity(basics, &weights, table));
        let Some(pca) = &self.pca else {
            return Inputs {
                features,
                bases: Vec::new(),
            };
        };
        let (pa, pb) = (pca.project(a.sentence), pca.project(b.sentence));
        let k = pa.len();
        let mut bilinear = Vec::with_capacity(k * (k + 1) / 2);
        for i in 0..k {
            for j in i..k {
                bilinear.push(pa[i] * pb[j] + pb[i] * pa[j]);
            }
        }
        // The idf-weighted direction of each side's unmatched contextual tokens.
        let dim = a.sentence.len();
        let unmatched = |side: usize, t: &Text<'_>| -> (Vec<f32>, usize) {
            let mut sum = vec![0.0f32; dim];
            let mut total = 0.0f32;
            let mut count = 0usize;
            for (i, (v, &w)) in t.tokens.iter().zip(&weights[side]).enumerate() {
                total += w;
                if basics.best[side]
                    .get(i)
                    .is_some_and(|&m| m < UNMATCHED_BELOW)
                {
                    count += 1;
                    sum.iter_mut().zip(v).for_each(|(s, x)| *s += w * x);
                }
            }
            let total = total.max(1e-9);
            sum.iter_mut().for_each(|s| *s /= total);
            (sum, count)
        };
        let ((da, ca), (db, cb)) = (unmatched(0, a), unmatched(1, b));
        let mut direction: Vec<f32> = da.iter().zip(&db).map(|(x, y)| x + y).collect();
        direction.extend(da.iter().zip(&db).map(|(x, y)| (x - y).abs()));
        direction.extend(da.iter().zip(&db).map(|(x, y)| x * y));
        // Token ids (of the contextual span) one side has and the other lacks.
        let span = |side: usize, t: &Text<'_>| {
            &basics.ids[side][..basics.ids[side].len().min(t.tokens.len())]
        };
        let (sa, sb) = (span(0, a), span(1, b));
        let (seta, setb): (BTreeSet<u32>, BTreeSet<u32>) =
            (sa.iter().copied().collect(), sb.iter().copied().collect());
        let lacking = |s: &[u32], other: &BTreeSet<u32>| {
            s.iter().filter(|id| !other.contains(id)).count() as f32
        };
        let (la, lb) = (lacking(sa, &setb), lacking(sb, &seta));
        direction.extend([la.min(lb), la.max(lb), ca.min(cb) as f32, ca.max(cb) as f32]);
        Inputs {
            features,
            bases: vec![
                bilinear,
                basics.sentence_product.clone(),
                basics.maxpool_product.clone(),
                direction,
            ],
        }
    }

    /// [`EXTRA`]: rarity-weighted unmatched tokens, idf-weighted contextual alignment, and the
    /// idf-weighted static cosine.
    fn rarity(
        &self,
        basics: &PairBasics,
        [wa, wb]: &[Vec<f32>; 2],
        table: &StaticEmbedder,
    ) -> Vec<f32> {
        let idf = |id: u32| self.idf.idf(id);
        let [ia, ib] = &basics.ids;
        let (a, b): (BTreeSet<u32>, BTreeSet<u32>) =
            (ia.iter().copied().collect(), ib.iter().copied().collect());
        let sum = |s: &mut dyn Iterator<Item = &u32>| s.map(|&id| idf(id)).sum::<f32>();
        let total = sum(&mut a.iter()) + sum(&mut b.iter()) + 1e-9;
        let shared = sum(&mut a.intersection(&b));
        let ua: Vec<f32> = a.difference(&b).map(|&id| idf(id)).collect();
        let ub: Vec<f32> = b.difference(&a).map(|&id| idf(id)).collect();
        let max = |v: &[f32]| v.iter().copied().fold(0.0f32, f32::max);
        let (ma, mb) = (max(&ua), max(&ub));
        let (sa, sb) = (ua.iter().sum::<f32>(), ub.iter().sum::<f32>());
        let rare = ua.iter().chain(&ub).filter(|&&w| w > 5.0).count() as f32;
        let mut out = vec![
            (sa + sb) / total,
            2.0 * shared / total,
            ma.max(mb),
            ma.min(mb),
            sa.min(sb),
            sa.max(sb),
            sa + sb,
            rare,
        ];
        // Contextual alignment weighted by rarity (BERTScore-like).
        let [ba, bb] = &basics.best;
        if ba.is_empty() || bb.is_empty() {
            out.extend([0.0; 9]);
        } else {
            let weighted = |b: &[f32], w: &[f32]| {
                b.iter().zip(w).map(|(x, y)| x * y).sum::<f32>() / w.iter().sum::<f32>().max(1e-9)
            };
            let (p, r) = (weighted(ba, wa), weighted(bb, wb));
            let all: Vec<(f32, f32)> = ba
                .iter()
                .zip(wa)
                .chain(bb.iter().zip(wb))
                .map(|(m, w)| (*m, *w))
                .collect();
            let mut ws: Vec<f32> = all.iter().map(|x| x.1).collect();
            ws.sort_by(f32::total_cmp);
            let median = if ws.len() % 2 == 1 {
                ws[ws.len() / 2]
            } else {
                (ws[ws.len() / 2 - 1] + ws[ws.len() / 2]) / 2.0
            };
            let weakest_all = all.iter().map(|x| x.0).fold(f32::INFINITY, f32::min);
            let weakest_rare = all
                .iter()
                .filter(|x| x.1 > median)
                .map(|x| x.0)
                .fold(f32::INFINITY, f32::min);
            let mass: f32 = ws.iter().sum::<f32>().max(1e-9);
            let below = |t: f32| all.iter().filter(|x| x.0 < t).map(|x| x.1).sum::<f32>() / mass;
            let mut matches: Vec<f32> = all.iter().map(|x| x.0).collect();
            matches.sort_by(f32::total_cmp);
            out.extend([
                p.max(r),
                p.min(r),
                2.0 * p * r / (p + r + 1e-9),
                if weakest_rare.is_finite() {
                    weakest_rare
                } else {
                    weakest_all
                },
                below(0.5),
                below(0.7),
                all.iter()
                    .filter(|x| x.0 < 0.5)
                    .map(|x| x.1)
                    .fold(0.0, f32::max),
                matches.get(1).copied().unwrap_or(matches[0]),
                all.iter().filter(|x| x.0 < UNMATCHED_BELOW).count() as f32 / all.len() as f32,
            ]);
        }
        let sif = |ids: &[u32]| table.embed_weighted(ids, idf);
        out.push(cosine(&sif(ia), &sif(ib)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_features_see_differing_numbers_entities_and_negations() {
        let (a, b) = (
            words("What is the IIT JEE 2016 cutoff?"),
            words("What is the IIT JEE 2017 cutoff?"),
        );
        assert_ne!(numbers(&a), numbers(&b));
        assert_eq!(entities(&a), entities(&b));
        assert!(negated(&words("Why can't I sleep?")));
        assert!(!negated(&words("Why can I sleep?")));
        assert_eq!(
            question_word(&words("How do I sleep?")).as_deref(),
            Some("how")
        );
    }

    #[test]
    fn form_features_see_swapped_arguments_placeholders_and_questions() {
        let lower = |t: &str| {
            words(t)
                .iter()
                .map(|w| w.to_lowercase())
                .collect::<Vec<_>>()
        };
        let (a, b) = (
            lower("Cheap flights from Paris to Rome"),
            lower("cheap flights from Rome to Paris"),
        );
        // 3 of the 15 pairs of shared words are out of order.
        assert!((order_inversions(&a, &b) - 0.2).abs() < 1e-6);
        assert_eq!(order_inversions(&a, &a), 0.0);
        assert_eq!(
            placeholders("Translate {text} into {Language}"),
            ["language", "text"].map(String::from).into()
        );
        assert!(placeholders("no braces {here").is_empty());
        assert!(question_form("How do I sleep", &lower("How do I sleep")));
        assert!(!question_form(
            "Tell me how to sleep.",
            &lower("Tell me how to sleep.")
        ));
        let f = form("A to B", "B to A", &words("A to B"), &words("B to A"));
        assert_eq!(f.len(), FORM.len());
    }

    #[test]
    fn idf_ranks_rare_tokens_above_common_ones() {
        let texts: Vec<Vec<u32>> = vec![vec![1, 2], vec![1, 3], vec![1, 2, 4]];
        let idf = TokenIdf::fit(texts.iter().map(Vec::as_slice));
        assert_eq!(idf.docs, 3);
        assert!(idf.idf(1) < idf.idf(2));
        assert!(idf.idf(2) < idf.idf(4));
        assert!(idf.idf(4) < idf.idf(999));
    }

    #[test]
    fn best_matches_and_pooling() {
        let ta = vec![vec![1.0, 0.0], vec![0.0, 1.0]];
        let tb = vec![vec![1.0, 0.0]];
        let [ba, bb] = best_matches(&ta, &tb);
        assert_eq!(ba, vec![1.0, 0.0]);
        assert_eq!(bb, vec![1.0]);
        let p = max_pool(&ta, 2);
        assert!(
            (p[0] - p[1]).abs() < 1e-6 && (p[0] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6
        );
        assert_eq!(max_pool(&[], 2), vec![0.0, 0.0]);
        assert_eq!(product(&[1.0, 2.0], &[3.0, 1.0]), vec![3.0, 2.0, 2.0, 1.0]);
    }
}
