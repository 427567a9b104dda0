//! What the tier classifier reads from a prompt: TF-IDF of its words and word pairs (the
//! vocabulary fitted on the training prompts) and a few cheap markers of what kind of question
//! it is ([`HAND`]). Everything here is a function of the text alone, microseconds per prompt: no
//! model files, so the router works wherever the gateway runs.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// The cheap markers, in column order (an artefact trained on other columns does not load).
pub const HAND: &[&str] = &[
    "log_question_chars",
    "log_mean_option_chars",
    "option_length_spread",
    "options",
    "numeric_options",
    "digit_share",
    "math_symbol_density",
    "negated_question",
    "statement_pair",
    "which_of_the_following",
    "code_markers",
    "question_lines",
    "ends_with_question_mark",
    "combined_options",
    "capitalised_words",
    "roman_numeral_items",
    "blank_to_fill",
];

/// How much the standardised markers weigh against the unit-length TF-IDF vector.
pub const HAND_WEIGHT: f32 = 0.3;

/// A term must appear in this many training prompts to enter the vocabulary.
pub const MIN_DF: usize = 3;

/// Lowercased words of two or more word characters (letters, digits, `_`), in order.
pub fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' {
            cur.extend(c.to_lowercase());
        } else if !cur.is_empty() {
            if cur.chars().nth(1).is_some() {
                out.push(std::mem::take(&mut cur));
            } else {
                cur.clear();
            }
        }
    }
    if cur.chars().nth(1).is_some() {
        out.push(cur);
    }
    out
}

/// The words and the adjacent word pairs of `text` ("a b"), with repeats.
pub fn terms(text: &str) -> Vec<String> {
    let w = words(text);
    let mut t = Vec::with_capacity(w.len() * 2);
    for pair in w.windows(2) {
        t.push(format!("{} {}", pair[0], pair[1]));
    }
    t.extend(w);
    t
}

/// The vocabulary and inverse document frequencies fitted on the training prompts.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Vocabulary {
    /// Terms, sorted.
    pub terms: Vec<String>,
    /// `ln((1 + n) / (1 + df)) + 1` per term.
    pub idf: Vec<f32>,
    #[serde(skip)]
    index: HashMap<String, u32>,
}

impl Vocabulary {
    /// Fit on the prompts' term lists: terms in at least [`MIN_DF`] of them.
    pub fn fit<'a>(docs: impl Iterator<Item = &'a [String]>) -> Self {
        let mut df: HashMap<&str, usize> = HashMap::new();
        let mut n = 0usize;
        for doc in docs {
            n += 1;
            let mut seen: Vec<&str> = doc.iter().map(String::as_str).collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                *df.entry(t).or_default() += 1;
            }
        }
        let mut kept: Vec<(&str, usize)> = df.into_iter().filter(|&(_, d)| d >= MIN_DF).collect();
        kept.sort_unstable();
        let idf = kept
            .iter()
            .map(|&(_, d)| (((1 + n) as f64 / (1 + d) as f64).ln() + 1.0) as f32)
            .collect();
        Self {
            terms: kept.into_iter().map(|(t, _)| t.to_owned()).collect(),
            idf,
            index: HashMap::new(),
        }
        .indexed()
    }

    /// Build the term lookup (after deserialising).
    pub fn indexed(mut self) -> Self {
        self.index = self
            .terms
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        self
    }

    /// Columns of the TF-IDF part.
    pub fn len(&self) -> usize {
        self.terms.len()
    }

    /// Whether no term was kept.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }

    /// The unit-length sublinear TF-IDF vector of a term list, as sorted `(column, value)`.
    pub fn tfidf(&self, terms: &[String]) -> Vec<(u32, f32)> {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for t in terms {
            if let Some(&i) = self.index.get(t.as_str()) {
                *counts.entry(i).or_default() += 1;
            }
        }
        let mut row: Vec<(u32, f32)> = counts
            .into_iter()
            .map(|(i, c)| (i, (1.0 + (c as f32).ln()) * self.idf[i as usize]))
            .collect();
        row.sort_unstable_by_key(|&(i, _)| i);
        let norm = row.iter().map(|(_, v)| v * v).sum::<f32>().sqrt();
        if norm > 0.0 {
            row.iter_mut().for_each(|(_, v)| *v /= norm);
        }
        row
    }
}

/// Split a multiple-choice prompt into its question and its options (`\nA. …` to `\nD. …`, any
/// trailing `Answer:` dropped); a prompt without options is all question.
fn split_options(prompt: &str) -> (&str, Vec<&str>) {
    let bytes = prompt.as_bytes();
    let mut cuts = Vec::new();
    for i in 0..bytes.len().saturating_sub(3) {
        if bytes[i] == b'\n'
            && (b'A'..=b'D').contains(&bytes[i + 1])
            && bytes[i + 2] == b'.'
            && bytes[i + 3] == b' '
        {
            cuts.push(i);
        }
    }
    let Some(&first) = cuts.first() else {
        return (prompt, Vec::new());
    };
    let mut options = Vec::with_capacity(cuts.len());
    for (k, &at) in cuts.iter().enumerate() {
        let end = cuts.get(k + 1).copied().unwrap_or(prompt.len());
        let mut opt = &prompt[at + 4..end];
        if let Some(a) = opt.find("\nAnswer:") {
            opt = &opt[..a];
        }
        options.push(opt);
    }
    (&prompt[..first], options)
}

/// Whether `word` occurs in `text` between non-word characters.
fn has_word(text: &str, word: &str) -> bool {
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    text.match_indices(word).any(|(i, _)| {
        !is_word(text[..i].chars().next_back()) && !is_word(text[i + word.len()..].chars().next())
    })
}

fn numeric_option(o: &str) -> bool {
    let o = o.trim_end_matches(['\n', ' ']);
    o.chars().count() <= 12
        && o.chars().any(|c| c.is_ascii_digit())
        && o.chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_whitespace() || "$-.,/%^()=+*".contains(c))
}

/// The [`HAND`] markers of a prompt, unscaled.
pub fn hand(prompt: &str) -> Vec<f32> {
    let (q, options) = split_options(prompt);
    let chars = q.chars().count() as f32;
    let lens: Vec<f32> = options.iter().map(|o| o.chars().count() as f32).collect();
    let mean = if lens.is_empty() {
        0.0
    } else {
        lens.iter().sum::<f32>() / lens.len() as f32
    };
    let spread = if lens.is_empty() {
        0.0
    } else {
        (lens.iter().map(|l| (l - mean).powi(2)).sum::<f32>() / lens.len() as f32).sqrt()
            / (mean + 1.0)
    };
    let numeric = if options.is_empty() {
        0.0
    } else {
        options.iter().filter(|o| numeric_option(o)).count() as f32 / options.len() as f32
    };
    let digits = q.chars().filter(char::is_ascii_digit).count() as f32;
    let symbols = q.chars().filter(|c| "=+^*/<>".contains(*c)).count()
        + q.matches("sqrt").count()
        + q.matches("\\frac").count();
    let negated = ["NOT", "EXCEPT", "LEAST", "FALSE"]
        .iter()
        .any(|w| has_word(q, w));
    let code = ["def", "return", "int", "printf", "for", "while"]
        .iter()
        .any(|w| has_word(q, w))
        || q.contains(['{', '}', ';']);
    let joined = options.join(" ").to_lowercase();
    let combined = ["all of the above", "none of the above", "both"]
        .iter()
        .any(|w| has_word(&joined, w));
    let ws: Vec<&str> = q.split_whitespace().collect();
    let capitalised = ws
        .iter()
        .skip(1)
        .filter(|w| w.chars().next().is_some_and(char::is_uppercase))
        .count() as f32
        / (ws.len() as f32 + 1.0);
    let roman = has_word(prompt, "I and II")
        || ["I.", "II.", "III.", "IV."].iter().any(|w| {
            prompt.match_indices(w).any(|(i, _)| {
                !prompt[..i]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric())
            })
        });
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    vec![
        chars.ln_1p(),
        mean.ln_1p(),
        spread,
        options.len() as f32,
        numeric,
        digits / (chars + 1.0),
        symbols as f32 / (chars + 1.0) * 10.0,
        flag(negated),
        flag(prompt.starts_with("Statement 1")),
        flag(q.contains("which of the following") || q.contains("Which of the following")),
        flag(code),
        q.matches('\n').count() as f32,
        flag(q.trim_end().ends_with('?')),
        flag(combined),
        capitalised,
        flag(roman),
        flag(q.contains("__")),
    ]
}

/// Standardised markers are clipped to this many standard deviations. A marker that barely
/// varies in training (every MMLU prompt has four options) would otherwise standardise a prompt
/// unlike the training ones (a chat turn with no options) to dozens of deviations, and that one
/// weight would decide its tier alone.
pub const CLIP: f32 = 3.0;

/// Per-column mean and scale of the markers, fitted on the training prompts.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Scaler {
    /// Means.
    pub mean: Vec<f32>,
    /// Standard deviations (1 where a column is constant).
    pub scale: Vec<f32>,
    /// Standardised values are clipped to `±clip` (an artefact without it predates clipping
    /// and does not load: its weights were fitted on unclipped markers).
    pub clip: f32,
}

impl Scaler {
    /// Fit on rows of markers.
    pub fn fit<'a>(rows: impl Iterator<Item = &'a [f32]>) -> Self {
        let (mean, scale) = crate::learn::linear::column_stats(rows, HAND.len());
        Self {
            mean,
            scale,
            clip: CLIP,
        }
    }

    /// Marker `j`'s value standardised, clipped and weighted as the classifier reads it.
    pub fn scaled(&self, j: usize, v: f32) -> f32 {
        ((v - self.mean[j]) / self.scale[j]).clamp(-self.clip, self.clip) * HAND_WEIGHT
    }
}

/// The classifier's input row for a prompt: TF-IDF columns, then the scaled markers.
pub fn row(vocab: &Vocabulary, scaler: &Scaler, prompt: &str) -> Vec<(u32, f32)> {
    row_of(vocab, scaler, &terms(prompt), &hand(prompt))
}

/// The input row from a prompt's [`terms`] and [`hand`] markers (training computes them once
/// and builds each fold's rows from them).
pub fn row_of(
    vocab: &Vocabulary,
    scaler: &Scaler,
    terms: &[String],
    hand: &[f32],
) -> Vec<(u32, f32)> {
    let mut r = vocab.tfidf(terms);
    let base = vocab.len() as u32;
    for (j, &v) in hand.iter().enumerate() {
        r.push((base + j as u32, scaler.scaled(j, v)));
    }
    r
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn words_and_terms_follow_the_tfidf_tokeniser() {
        assert_eq!(
            words("What's 2+2? A x-ray, Ünïcode_ok 42."),
            ["what", "ray", "ünïcode_ok", "42"]
        );
        assert_eq!(
            terms("big red dog"),
            ["big red", "red dog", "big", "red", "dog"]
        );
    }

    #[test]
    fn options_are_split_and_markers_read_them() {
        let p = "Which of the following is NOT a prime?\nA. 2\nB. 3\nC. 9\nD. 5\nAnswer:";
        let (q, o) = split_options(p);
        assert_eq!(q, "Which of the following is NOT a prime?");
        assert_eq!(o, ["2", "3", "9", "5"]);
        let h = hand(p);
        assert_eq!(h.len(), HAND.len());
        assert_eq!(h[3], 4.0, "options");
        assert_eq!(h[4], 1.0, "numeric options");
        assert_eq!(h[7], 1.0, "negated");
        assert_eq!(h[9], 1.0, "which of the following");
        assert_eq!(h[12], 1.0, "question mark");
        let plain = hand("hello");
        assert_eq!(plain[3], 0.0);
        assert!(plain.iter().all(|v| v.is_finite()));
        assert!(
            hand("").iter().all(|v| v.is_finite()),
            "an empty prompt has markers"
        );
    }

    #[test]
    fn a_marker_far_outside_the_training_range_is_clipped() {
        // Options: always 4 in training but one prompt; a prompt without options is far out.
        let rows: Vec<Vec<f32>> = (0..100)
            .map(|i| {
                let mut h = vec![1.0; HAND.len()];
                h[3] = if i == 0 { 5.0 } else { 4.0 };
                h
            })
            .collect();
        let s = Scaler::fit(rows.iter().map(Vec::as_slice));
        assert_eq!(s.scaled(3, 0.0), -CLIP * HAND_WEIGHT);
        assert_eq!(s.scaled(3, 40.0), CLIP * HAND_WEIGHT);
        assert!(
            (s.scaled(3, 4.0) - (-0.1005 * HAND_WEIGHT)).abs() < 1e-3,
            "{}",
            s.scaled(3, 4.0)
        );
        assert_eq!(
            s.scaled(0, 1.0),
            0.0,
            "a constant column is centred, scale 1"
        );
    }

    #[test]
    fn tfidf_rows_are_unit_length_over_known_terms() {
        let docs: Vec<Vec<String>> = ["a cat sat", "the cat sat", "cat sat down", "dog"]
            .iter()
            .map(|d| terms(d))
            .collect();
        let v = Vocabulary::fit(docs.iter().map(Vec::as_slice));
        assert_eq!(v.terms, ["cat", "cat sat", "sat"]);
        let r = v.tfidf(&terms("cat sat sat unknown"));
        let norm: f32 = r.iter().map(|(_, x)| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5);
        assert!(v.tfidf(&terms("unknown words only")).is_empty());
    }
}
