//! What the tier classifier reads from a prompt: TF-IDF of its words and word pairs (the
//! vocabulary fitted on the training prompts) and a few cheap markers of what kind of question
//! it is ([`HAND`]). Everything here is a function of the text alone, microseconds per prompt: no
//! model files, so the router works wherever the gateway runs.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// No column / no word id.
const NONE: u32 = u32::MAX;

/// A cheap hash for the scoring lookups (an FxHash-style multiply-rotate per 8 bytes, mixed at
/// the end). The tables it indexes are fixed once built, so crafted text can only make a lookup
/// walk the probe sequence of the fitted table, never lengthen it.
#[derive(Debug, Clone, Copy, Default)]
struct TermHasher(u64);

impl TermHasher {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for TermHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn finish(&self) -> u64 {
        // murmur3's fmix64: every input bit reaches the low bits the table indexes by.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

type TermHash = BuildHasherDefault<TermHasher>;

/// What scoring knows of a word: its column (or [`NONE`]) and its id among the words of the
/// word-pair terms (or [`NONE`] when it is in none of them).
#[derive(Debug, Clone, Copy)]
struct WordEntry {
    col: u32,
    id: u32,
}

impl Default for WordEntry {
    fn default() -> Self {
        Self {
            col: NONE,
            id: NONE,
        }
    }
}

/// A word of at most 15 bytes packed with its length: the table holds the key itself, so a
/// lookup reads no string from the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Packed(u64, u64);

impl Packed {
    /// The key of an ASCII word lowercased.
    fn of_ascii_lowercased(w: &[u8]) -> Option<Self> {
        if w.len() > 15 {
            return None;
        }
        let mut all = [0u8; 16];
        for (to, b) in all.iter_mut().zip(w) {
            *to = b.to_ascii_lowercase();
        }
        all[15] = w.len() as u8;
        Some(Self::from_bytes(all))
    }

    fn from_bytes(all: [u8; 16]) -> Self {
        let (mut lo, mut hi) = ([0u8; 8], [0u8; 8]);
        lo.copy_from_slice(&all[..8]);
        hi.copy_from_slice(&all[8..]);
        Self(u64::from_le_bytes(lo), u64::from_le_bytes(hi))
    }

    fn of(w: &str) -> Option<Self> {
        let b = w.as_bytes();
        if b.len() > 15 {
            return None;
        }
        let mut all = [0u8; 16];
        all[..b.len()].copy_from_slice(b);
        all[15] = b.len() as u8;
        Some(Self::from_bytes(all))
    }
}

/// Scoring's word lookup: every single-word term and every word of a pair term.
#[derive(Debug, Clone, Default)]
struct WordTable {
    short: HashMap<Packed, WordEntry, TermHash>,
    long: HashMap<String, WordEntry, TermHash>,
}

impl WordTable {
    fn get(&self, w: &str) -> Option<&WordEntry> {
        match Packed::of(w) {
            Some(k) => self.short.get(&k),
            None => self.long.get(w),
        }
    }

    fn entry(&mut self, w: &str) -> &mut WordEntry {
        match Packed::of(w) {
            Some(k) => self.short.entry(k).or_default(),
            None => self.long.entry(w.to_owned()).or_default(),
        }
    }
}

/// Scoring's pair lookup: the column of the pair term `"a b"` by the ids of `a` and `b`, as the
/// sorted second-word ids of each first word (compressed rows). The second-word ids of the whole
/// vocabulary take a few tens of kilobytes, so the search stays in cache; the column is read on
/// a hit only.
#[derive(Debug, Clone, Default)]
struct PairTable {
    /// `seconds[starts[a]..starts[a + 1]]` are the ids `b` of the pair terms `"a b"`, ascending.
    starts: Vec<u32>,
    seconds: Vec<u32>,
    cols: Vec<u32>,
}

impl PairTable {
    /// From `(first id, second id, column)` in term order (a later duplicate wins) and the
    /// number of ids.
    fn new(pairs: &[(u32, u32, u32)], ids: u32) -> Self {
        let mut sorted = pairs.to_vec();
        // A stable sort keeps equal pairs in term order; reversed, `dedup_by_key` keeps the
        // first of each run of them: the later term, as in `index`.
        sorted.sort_by_key(|&(a, b, _)| (a, b));
        sorted.reverse();
        sorted.dedup_by_key(|&mut (a, b, _)| (a, b));
        sorted.reverse();
        let mut starts = vec![0u32; ids as usize + 1];
        for &(a, _, _) in &sorted {
            starts[a as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        Self {
            starts,
            seconds: sorted.iter().map(|&(_, b, _)| b).collect(),
            cols: sorted.iter().map(|&(_, _, c)| c).collect(),
        }
    }

    fn get(&self, first: u32, second: u32) -> Option<u32> {
        let from = *self.starts.get(first as usize)? as usize;
        let to = *self.starts.get(first as usize + 1)? as usize;
        let k = self.seconds[from..to].binary_search(&second).ok()?;
        Some(self.cols[from + k])
    }
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
    /// Scoring's word lookup.
    #[serde(skip)]
    word_index: WordTable,
    /// Scoring's pair lookup.
    #[serde(skip)]
    pair_index: PairTable,
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
            ..Self::default()
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
        // The same terms split for scoring ([`Vocabulary::tfidf_of_text`]): words by their text,
        // pairs by the ids of their two words. A later duplicate term wins, as in `index`.
        let mut words = WordTable::default();
        let mut pairs: Vec<(u32, u32, u32)> = Vec::new();
        let mut next_id = 0u32;
        let mut id_of = |words: &mut WordTable, w: &str| {
            let e = words.entry(w);
            if e.id == NONE {
                e.id = next_id;
                next_id += 1;
            }
            e.id
        };
        for (i, t) in self.terms.iter().enumerate() {
            match t.split_once(' ') {
                // A term with more spaces matches no word pair; its second "word" is never
                // looked up with a match, so it does no harm.
                Some((a, b)) => {
                    let (a, b) = (id_of(&mut words, a), id_of(&mut words, b));
                    pairs.push((a, b, i as u32));
                }
                None => words.entry(t).col = i as u32,
            }
        }
        self.word_index = words;
        self.pair_index = PairTable::new(&pairs, next_id);
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

    /// `self.tfidf(&terms(text))`, the same row to the bit, without building the term list:
    /// one walk over the text looks each word up lowercased (an ASCII word of up to 15 bytes as
    /// a [`Packed`] key straight from the text, others spelled into a reused buffer), and looks
    /// its pair with the previous word up by the two words' ids.
    pub fn tfidf_of_text(&self, text: &str) -> Vec<(u32, f32)> {
        let bytes = text.as_bytes();
        // A word and a pair per word at most, and a word takes two bytes and a separator.
        let mut hits: Vec<u32> = Vec::with_capacity(bytes.len() * 2 / 3 + 1);
        // The id of the previous word of two or more characters (one-letter words are dropped
        // before pairing), `NONE` when that word is in no pair term.
        let mut prev = NONE;
        // Words of over 15 bytes or with non-ASCII characters, lowercased.
        let mut spelled = String::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii() && !is_ascii_word_byte(bytes[i]) {
                i += 1;
                continue;
            }
            let mut j = i;
            while j < bytes.len() && is_ascii_word_byte(bytes[j]) {
                j += 1;
            }
            let entry = if bytes.get(j).is_none_or(u8::is_ascii) {
                // An ASCII word, `i..j`, not empty (`bytes[i]` is a word byte).
                let ascii = &bytes[i..j];
                i = j;
                if ascii.len() < 2 {
                    continue;
                }
                match Packed::of_ascii_lowercased(ascii) {
                    Some(k) => self.word_index.short.get(&k),
                    None => {
                        spelled.clear();
                        spelled.extend(ascii.iter().map(|b| char::from(b.to_ascii_lowercase())));
                        self.word_index.long.get(spelled.as_str())
                    }
                }
            } else {
                // A non-ASCII character at `j`: decode from there to the end of the word (and
                // past the character ending it, or past `j` when it is no word character).
                spelled.clear();
                spelled.extend(
                    bytes[i..j]
                        .iter()
                        .map(|b| char::from(b.to_ascii_lowercase())),
                );
                let mut chars = j - i;
                i = bytes.len();
                for (k, c) in text[j..].char_indices() {
                    if !is_word_char(c) {
                        i = j + k + c.len_utf8();
                        break;
                    }
                    for l in c.to_lowercase() {
                        spelled.push(l);
                        chars += 1;
                    }
                }
                if chars < 2 {
                    continue;
                }
                self.word_index.get(&spelled)
            };
            match entry {
                Some(e) => {
                    if e.col != NONE {
                        hits.push(e.col);
                    }
                    if prev != NONE && e.id != NONE {
                        if let Some(col) = self.pair_index.get(prev, e.id) {
                            hits.push(col);
                        }
                    }
                    prev = e.id;
                }
                None => prev = NONE,
            }
        }
        hits.sort_unstable();
        // Room for the markers too ([`row`] appends them).
        let mut row: Vec<(u32, f32)> = Vec::with_capacity(hits.len() + HAND.len());
        for run in hits.chunk_by(|a, b| a == b) {
            let i = run[0];
            row.push((
                i,
                (1.0 + (run.len() as u32 as f32).ln()) * self.idf[i as usize],
            ));
        }
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
    let cuts: Vec<usize> = prompt
        .match_indices('\n')
        .map(|(i, _)| i)
        .filter(|&i| {
            i + 3 < bytes.len()
                && (b'A'..=b'D').contains(&bytes[i + 1])
                && bytes[i + 2] == b'.'
                && bytes[i + 3] == b' '
        })
        .collect();
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
    let is_word = |c: Option<char>| c.is_some_and(is_word_char);
    // `contains` first: a fast scan that rules out most texts before the slower matching.
    text.contains(word)
        && text.match_indices(word).any(|(i, _)| {
            !is_word(text[..i].chars().next_back())
                && !is_word(text[i + word.len()..].chars().next())
        })
}

fn numeric_option(o: &str) -> bool {
    let o = o.trim_end_matches(['\n', ' ']);
    o.chars().count() <= 12
        && o.chars().any(|c| c.is_ascii_digit())
        && o.chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_whitespace() || "$-.,/%^()=+*".contains(c))
}

/// What [`hand`] reads off the question in one walk over it.
#[derive(Debug, Default)]
struct QuestionScan {
    chars: usize,
    digits: usize,
    /// `=+^*/<>` characters, `sqrt`s and `\frac`s.
    symbols: usize,
    /// A negation word (`NOT`, `EXCEPT`, …) between non-word characters.
    negated: bool,
    /// A code keyword between non-word characters, or `{`, `}`, `;`.
    code: bool,
    newlines: usize,
    /// Whitespace-separated words, and those after the first that start upper case.
    ws_words: usize,
    capitalised: usize,
    /// `__` somewhere.
    blank: bool,
}

const NEGATIONS: [&str; 4] = ["NOT", "EXCEPT", "LEAST", "FALSE"];
const CODE_WORDS: [&str; 6] = ["def", "return", "int", "printf", "for", "while"];

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// [`is_word_char`] of an ASCII byte (false for every byte of a non-ASCII character).
fn is_ascii_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Classes of characters for [`QuestionScan`], read from a table for ASCII instead of a branch
/// per class.
const DIGIT: u8 = 1;
const SYMBOL: u8 = 2;
const WORD: u8 = 4;
const SPACE: u8 = 8;
/// `s`, `\`, `{`, `}`, `;`, `\n` and `_`: looked at one by one.
const SPECIAL: u8 = 16;
const UPPER: u8 = 32;

const ASCII_CLASS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        let c = i as u8;
        let mut k = 0;
        if c.is_ascii_digit() {
            k |= DIGIT;
        }
        if matches!(c, b'=' | b'+' | b'^' | b'*' | b'/' | b'<' | b'>') {
            k |= SYMBOL;
        }
        if c.is_ascii_alphanumeric() || c == b'_' {
            k |= WORD;
        }
        // `char::is_whitespace` on ASCII: tab, line feed, vertical tab, form feed, carriage
        // return and space (`u8::is_ascii_whitespace` leaves out the vertical tab).
        if matches!(c, b'\t'..=b'\r' | b' ') {
            k |= SPACE;
        }
        if matches!(c, b's' | b'\\' | b'{' | b'}' | b';' | b'\n' | b'_') {
            k |= SPECIAL;
        }
        if c.is_ascii_uppercase() {
            k |= UPPER;
        }
        t[i] = k;
        i += 1;
    }
    t
};

fn class_of(c: char) -> u8 {
    if c.is_ascii() {
        return ASCII_CLASS[c as usize];
    }
    let mut k = 0;
    if is_word_char(c) {
        k |= WORD;
    }
    if c.is_whitespace() {
        k |= SPACE;
    }
    if c.is_uppercase() {
        k |= UPPER;
    }
    k
}

/// Bit `n` of `KEYWORD_LENGTHS[b]`: some keyword of [`NEGATIONS`] or [`CODE_WORDS`] starts with
/// byte `b` and is `n` bytes long (a cheap test before comparing a run with them).
const KEYWORD_LENGTHS: [u16; 128] = {
    let mut t = [0u16; 128];
    let mut i = 0;
    while i < NEGATIONS.len() + CODE_WORDS.len() {
        let w = if i < NEGATIONS.len() {
            NEGATIONS[i].as_bytes()
        } else {
            CODE_WORDS[i - NEGATIONS.len()].as_bytes()
        };
        t[w[0] as usize] |= 1 << w.len();
        i += 1;
    }
    t
};

/// Whether the run of word characters `run` is a negation word, and whether it is a code
/// keyword.
fn keyword(run: &[u8]) -> (bool, bool) {
    let first = run.first().copied().unwrap_or(0x80);
    let maybe =
        first.is_ascii() && (KEYWORD_LENGTHS[usize::from(first)] >> run.len().min(15)) & 1 != 0;
    if !maybe {
        return (false, false);
    }
    (
        NEGATIONS.iter().any(|w| w.as_bytes() == run),
        CODE_WORDS.iter().any(|w| w.as_bytes() == run),
    )
}

impl QuestionScan {
    /// One walk standing for the separate searches: a keyword made of word characters occurs
    /// between non-word characters exactly where a maximal run of word characters equals it
    /// (what [`has_word`] finds), and `sqrt` and `\frac` cannot overlap themselves, so counting
    /// where they start counts their non-overlapping matches. Counts are added as 0 or 1 rather
    /// than branched on: a branch taken at random (a word ending, a capital) costs more.
    fn of(q: &str) -> Self {
        let bytes = q.as_bytes();
        let (mut chars, mut digits, mut symbols, mut newlines) = (0, 0, 0, 0);
        let (mut ws_words, mut capitalised) = (0, 0);
        let (mut negated, mut code, mut blank) = (false, false, false);
        let (mut in_run, mut in_ws_word, mut after_underscore) = (false, false, false);
        let mut run_start = 0usize;
        for (i, c) in q.char_indices() {
            chars += 1;
            let k = class_of(c);
            digits += usize::from(k & DIGIT != 0);
            symbols += usize::from(k & SYMBOL != 0);
            if k & SPECIAL != 0 {
                match c {
                    's' => symbols += usize::from(q[i..].starts_with("sqrt")),
                    '\\' => symbols += usize::from(q[i..].starts_with("\\frac")),
                    '\n' => newlines += 1,
                    '_' => blank |= after_underscore,
                    _ => code = true, // `{`, `}`, `;`
                }
            }
            after_underscore = c == '_';
            let word = k & WORD != 0;
            if in_run != word {
                if word {
                    run_start = i;
                } else {
                    let (n, c) = keyword(&bytes[run_start..i]);
                    negated |= n;
                    code |= c;
                }
                in_run = word;
            }
            let in_ws = k & SPACE == 0;
            let starts = in_ws & !in_ws_word;
            ws_words += usize::from(starts);
            capitalised += usize::from(starts & (ws_words > 1) & (k & UPPER != 0));
            in_ws_word = in_ws;
        }
        if in_run {
            let (n, c) = keyword(&bytes[run_start..]);
            negated |= n;
            code |= c;
        }
        Self {
            chars,
            digits,
            symbols,
            negated,
            code,
            newlines,
            ws_words,
            capitalised,
            blank,
        }
    }
}

/// Whether a roman-numeral item (`I.`, `II.`, `III.`, `IV.`) starts somewhere not right after
/// a letter or digit. None of them overlaps itself, so every occurrence is a match.
fn roman_item(prompt: &str) -> bool {
    prompt.match_indices('I').any(|(i, _)| {
        let rest = &prompt[i..];
        ["I.", "II.", "III.", "IV."]
            .iter()
            .any(|w| rest.starts_with(w))
            && !prompt[..i]
                .chars()
                .next_back()
                .is_some_and(char::is_alphanumeric)
    })
}

/// The [`HAND`] markers of a prompt, unscaled.
pub fn hand(prompt: &str) -> Vec<f32> {
    let (q, options) = split_options(prompt);
    let scan = QuestionScan::of(q);
    let chars = scan.chars as f32;
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
    let digits = scan.digits as f32;
    let joined = options.join(" ").to_lowercase();
    let combined = ["all of the above", "none of the above", "both"]
        .iter()
        .any(|w| has_word(&joined, w));
    let capitalised = scan.capitalised as f32 / (scan.ws_words as f32 + 1.0);
    let roman = has_word(prompt, "I and II") || roman_item(prompt);
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    vec![
        chars.ln_1p(),
        mean.ln_1p(),
        spread,
        options.len() as f32,
        numeric,
        digits / (chars + 1.0),
        scan.symbols as f32 / (chars + 1.0) * 10.0,
        flag(scan.negated),
        flag(prompt.starts_with("Statement 1")),
        flag(q.contains("which of the following") || q.contains("Which of the following")),
        flag(scan.code),
        scan.newlines as f32,
        flag(q.trim_end().ends_with('?')),
        flag(combined),
        capitalised,
        flag(roman),
        flag(scan.blank),
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
    let mut r = vocab.tfidf_of_text(prompt);
    push_hand(&mut r, vocab, scaler, &hand(prompt));
    r
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
    push_hand(&mut r, vocab, scaler, hand);
    r
}

/// Append an embedding's columns (after the TF-IDF and marker columns), each component times
/// `weight`.
pub fn push_embedding(r: &mut Vec<(u32, f32)>, vocab: &Vocabulary, vector: &[f32], weight: f32) {
    let base = (vocab.len() + HAND.len()) as u32;
    r.reserve(vector.len());
    for (j, &v) in vector.iter().enumerate() {
        r.push((base + j as u32, weight * v));
    }
}

/// Append the scaled markers' columns to a TF-IDF row.
fn push_hand(r: &mut Vec<(u32, f32)>, vocab: &Vocabulary, scaler: &Scaler, hand: &[f32]) {
    let base = vocab.len() as u32;
    r.reserve(hand.len());
    for (j, &v) in hand.iter().enumerate() {
        r.push((base + j as u32, scaler.scaled(j, v)));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod tests {
    use super::*;
    use crate::tier::{TierModel, SHIPPED_TIER_MODEL};

    /// Prompts that stress the tokeniser: empty, unicode whose lowercase is longer than the
    /// letter (`İ` is two characters lowercased, `ß` stays one), punctuation runs, one-letter
    /// words between pairs, code, repeats and a long text.
    fn awkward_prompts() -> Vec<String> {
        let mut p: Vec<String> = [
            "",
            " ",
            "a",
            "İ",
            "Ünïcödé ß İ",
            "İİ ẞ ǅ Σίσυφος ΣΊΣΥΦΟΣ Ⅻ ½ ٣٤ 東京 e\u{301}",
            "...!!!???---,,,;;;:::(((]]]",
            "What's 2+2? A x-ray, Ünïcode_ok 42.",
            "a b c d e f g the a cat b sat c on d the e mat",
            "the the the the the the of of of the of the",
            "which of the following is NOT true\nA. I and II\nB. II. only\nC. III.\nD. IV.\nAnswer:",
            "def f(x):\n    return {x: x ** 2 for x in range(10)}; // int printf while",
            "fn main() { let v: Vec<u32> = (0..10).collect(); println!(\"{v:?}\"); }",
            "__init__ __ _ _x x_ snake_case CamelCase UPPER lower MiXeD",
            "\t\n\r\u{a0}\u{2003}word\u{2003}word\u{200b}word",
            "One\u{b}Two\u{c}Three\u{85}Four\u{a0}Five\u{1c}Six\u{7f}Seven\u{0}Eight",
            "Statement 1 | Every group is abelian. Statement 2 | Z_5 is a field.",
            "tabs\tand\nnewlines\r\nand   spaces",
            "999 1e10 3.14159 0x1F 1,000,000 -42 +7 x^2 sqrt(2) \\frac{1}{2}",
            "ssqrtsqrt \\frac\\frac\\\\frac ___ a__b _ NOTHING NOT_ xNOT NOT\u{e9} ÉNOT NOT",
            "int_x for_ printf( while1 (def) return; LEAST, FALSE? EXCEPT",
            "éI. ßII. 3III. _IV. (I. [II. I.I. III.IV. I and II and III, xI and II",
            "\u{2003}Éclair Über ÇA \u{a0}Ab\u{3000}Cd İstanbul ǅemal 1A",
            "Is it?  \n\t",
            "Q\nA. def f(): return 1\nB. all of the above\nC. Both\nD. NONE OF THE ABOVE\nAnswer:",
            "\nA. \nB. \nC. \nD. ",
            "Statement 1 | x\nA. True, True\nB. 1/2\nC. $3.50\nD. 12345678901234\nAnswer: A",
            // Words of over 15 bytes, alone and in pairs, and non-ASCII ones of the vocabulary.
            "The INDUSTRIALIZATION of disproportionate to thermoregulatory response Électronegativity",
            "Brønsted Lowry asked Cortés, the Levée en masse; the École at place Émile; 10 µF 2π answer",
            "Phosphofructokinase—neurotransmitters…unconstitutional’s “responsibilities”",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        p.push("lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(400));
        p.push("Which of the following statements is true? ".repeat(150) + "\nA. x\nB. y");
        p.push((0..3000).map(|i| format!("w{} ", i % 97)).collect());
        p
    }

    /// [`split_options`] as it was: a byte loop.
    fn split_options_before(prompt: &str) -> (&str, Vec<&str>) {
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

    /// [`has_word`] as it was: no `contains` first.
    fn has_word_before(text: &str, word: &str) -> bool {
        let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        text.match_indices(word).any(|(i, _)| {
            !is_word(text[..i].chars().next_back())
                && !is_word(text[i + word.len()..].chars().next())
        })
    }

    /// [`hand`] as it was before [`QuestionScan`]: one search per marker (the reference the
    /// tests compare with).
    fn hand_before(prompt: &str) -> Vec<f32> {
        let (q, options) = split_options_before(prompt);
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
            .any(|w| has_word_before(q, w));
        let code = ["def", "return", "int", "printf", "for", "while"]
            .iter()
            .any(|w| has_word_before(q, w))
            || q.contains(['{', '}', ';']);
        let joined = options.join(" ").to_lowercase();
        let combined = ["all of the above", "none of the above", "both"]
            .iter()
            .any(|w| has_word_before(&joined, w));
        let ws: Vec<&str> = q.split_whitespace().collect();
        let capitalised = ws
            .iter()
            .skip(1)
            .filter(|w| w.chars().next().is_some_and(char::is_uppercase))
            .count() as f32
            / (ws.len() as f32 + 1.0);
        let roman = has_word_before(prompt, "I and II")
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

    fn same_row(a: &[(u32, f32)], b: &[(u32, f32)]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits())
    }

    fn same_values(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The row as it was computed before the text walk: from the term list and the markers'
    /// separate searches.
    fn row_before(m: &TierModel, prompt: &str) -> Vec<(u32, f32)> {
        row_of(
            &m.vocabulary,
            &m.scaler,
            &terms(prompt),
            &hand_before(prompt),
        )
    }

    /// The score as it was computed before the text walk.
    fn gain_before(m: &TierModel, prompt: &str) -> f32 {
        let row = row_before(m, prompt);
        crate::tier::gain(&m.large, &m.small, &row)
    }

    #[test]
    fn the_text_walk_gives_the_term_list_row_and_markers_to_the_bit() {
        let m = TierModel::from_json(SHIPPED_TIER_MODEL).unwrap();
        let v = &m.vocabulary;
        for p in awkward_prompts() {
            let old = v.tfidf(&terms(&p));
            let new = v.tfidf_of_text(&p);
            assert!(same_row(&old, &new), "{p:?}\n{old:?}\n{new:?}");
            assert_eq!(split_options_before(&p), split_options(&p), "{p:?}");
            assert!(same_values(&hand_before(&p), &hand(&p)), "{p:?}");
            assert!(
                same_row(&row_before(&m, &p), &row(v, &m.scaler, &p)),
                "{p:?}"
            );
        }
        // The prompts do hit words and pairs, or the comparison above proves little.
        let hits: Vec<(u32, f32)> = awkward_prompts()
            .iter()
            .flat_map(|p| v.tfidf_of_text(p))
            .collect();
        assert!(hits.iter().any(|&(i, _)| v.terms[i as usize].contains(' ')));
        assert!(hits.len() > 50, "{}", hits.len());
    }

    #[test]
    fn the_text_walk_follows_an_odd_vocabulary() {
        // Pair terms whose words are no terms, a duplicate, a term of three words, terms the
        // tokeniser never makes (upper case, one letter, an empty word).
        let terms_list = [
            "ab cd", "cd", "cd ef", "cd ef", "ef gh ij", "gh ij", "Ab", "x", " ab", "ab ", "cd cd",
        ];
        let mut v = Vocabulary {
            terms: terms_list.iter().map(|t| (*t).to_owned()).collect(),
            idf: (1..=terms_list.len()).map(|i| i as f32 * 0.37).collect(),
            ..Vocabulary::default()
        }
        .indexed();
        for p in [
            "ab cd ef gh ij",
            "AB x CD y EF",
            "ab ab cd cd cd ef gh ij ab",
            "Ab cd ef gh ij x x",
            "gh ij gh ij cd, cd",
        ] {
            let old = v.tfidf(&terms(p));
            assert!(!old.is_empty(), "{p}");
            assert!(same_row(&old, &v.tfidf_of_text(p)), "{p}");
        }
        v = Vocabulary::default().indexed();
        assert!(v.tfidf_of_text("anything at all").is_empty());
        // A large vocabulary: more than 2^16 words in pair terms, many pairs per word.
        let mut terms_list: Vec<String> = (0..40_000)
            .flat_map(|i| [format!("a{i} b{i}"), format!("b{i} a{}", i + 1)])
            .chain((0..3000).map(|i| format!("hub a{i}")))
            .collect();
        terms_list.push("a7".into());
        terms_list.sort();
        v = Vocabulary {
            idf: vec![1.5; terms_list.len()],
            terms: terms_list,
            ..Vocabulary::default()
        }
        .indexed();
        for p in [
            "a7 b7 a8 b9 a39999 b39999 a40000",
            "a1 b1 a2 b2 a1 b1 a7",
            "hub a0 hub a1500 hub a2999 hub a3000 hub b3 hub",
        ] {
            let old = v.tfidf(&terms(p));
            assert!(old.len() >= 3, "{p}");
            assert!(same_row(&old, &v.tfidf_of_text(p)), "{p}");
        }
    }

    #[test]
    fn every_fixture_prompt_scores_as_from_its_term_list_and_searches() {
        let m = TierModel::from_json(SHIPPED_TIER_MODEL).unwrap();
        let fixtures = [
            include_str!("../../tests/fixtures/routing-small.jsonl"),
            include_str!("../../tests/fixtures/routing-dev.jsonl"),
        ];
        let mut n = 0;
        for line in fixtures.iter().flat_map(|f| f.lines()) {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let p = v["prompt"].as_str().unwrap();
            assert_eq!(split_options_before(p), split_options(p), "{p:?}");
            assert!(same_values(&hand_before(p), &hand(p)), "{p:?}");
            assert!(
                same_row(&row_before(&m, p), &row(&m.vocabulary, &m.scaler, p)),
                "{p:?}"
            );
            let (old, new) = (gain_before(&m, p), m.score(p).gain);
            assert!((old - new).abs() <= 1e-6, "{p:?}: {old} vs {new}");
            n += 1;
        }
        assert!(n > 5000, "{n} prompts");
    }

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
