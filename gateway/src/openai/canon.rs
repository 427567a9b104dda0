//! The compact JSON serde_json writes for a parsed value, written straight from the client's
//! text: objects' keys in sorted order (serde_json's map is a `BTreeMap`), a duplicated key's
//! last value, strings and numbers as serde_json writes them back. A hash of it equals the hash
//! of the parsed tree written out (the fingerprint, a derived session), so a request read this
//! way, without a tree, hashes as one read into a tree does.
//!
//! The text must be valid JSON (it was read by serde_json first). Anything this writer does not
//! reproduce byte for byte (nesting near serde_json's limit, more objects than a body may hold,
//! a string or number serde_json would refuse) gives `None`, and the caller reads the tree.

use std::borrow::Cow;
use std::ops::Range;

use super::MAX_OBJECTS;

/// Deeper nesting is left to the parser (serde_json refuses 128 levels).
const MAX_DEPTH: usize = 100;

/// Writes values of one text.
pub struct Writer<'a> {
    text: &'a str,
    /// Whole floats (`1.0`) written as integers, as the fingerprint wants.
    whole_floats: bool,
    /// Objects written so far (a body holds at most [`MAX_OBJECTS`]).
    objects: usize,
    /// The entries of the objects being written, innermost last.
    entries: Vec<Entry<'a>>,
    /// An unsorted object's text while it is put in order.
    scratch: Vec<u8>,
}

/// One `"key":value` of an object, as written into the output.
struct Entry<'a> {
    key: Cow<'a, str>,
    at: Range<usize>,
    /// Where its value is in the text.
    value: Range<usize>,
}

/// What escapes a string holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Escapes {
    None,
    /// Only ones serde_json writes back as they are.
    Kept,
    /// Some that serde_json writes back otherwise (`\u`, `\/`).
    Rewritten,
}

/// Whether `bytes` holds a byte below 0x20, eight at a time.
fn has_control(bytes: &[u8]) -> bool {
    const LOW: u64 = 0x2020_2020_2020_2020;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let Ok(word) = <[u8; 8]>::try_from(chunk) else {
            return true;
        };
        let x = u64::from_le_bytes(word);
        // A byte below 0x20 borrows into its high bit where that bit was clear.
        if x.wrapping_sub(LOW) & !x & HIGH != 0 {
            return true;
        }
    }
    chunks.remainder().iter().any(|&b| b < 0x20)
}

/// Keys of the top-level object left out, and string members merged in (sorted among the
/// rest by key), as the fingerprint wants.
#[derive(Clone, Copy)]
pub struct Edits<'e> {
    /// Keys left out.
    pub skip: &'e [&'e str],
    /// Members added, in key order; their keys are among `skip`.
    pub add: &'e [(&'e str, &'e str)],
}

impl<'a> Writer<'a> {
    /// A writer of values of `text`.
    pub fn new(text: &'a str, whole_floats: bool) -> Self {
        Self {
            text,
            whole_floats,
            objects: 0,
            entries: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The whole text, an object, with `edits` applied to its top level, written into `sink`
    /// (`out` holds the text of its members on the way; the top level is written from it in
    /// order, not copied back). Noted on the way, so that the body is not scanned again: where
    /// the top-level members `keys` are in the text (by their keys as read; of a key given
    /// twice, the last), and whether that is also where [`super::top_level`] finds them (every
    /// top-level key written without escapes, none of `keys` twice: where splicing is safe).
    pub fn object<const N: usize>(
        &mut self,
        edits: Edits<'_>,
        keys: [&str; N],
        out: &mut Vec<u8>,
        sink: &mut dyn std::io::Write,
    ) -> Option<(super::TopLevel<N>, bool)> {
        let at = self.space(0);
        if self.byte(at)? != b'{' {
            return None;
        }
        let end = self.object_at(at, 1, Some((edits, sink)), out)?;
        if self.space(end) != self.text.len() {
            return None;
        }
        // The top level's entries are left in place by `object_at` (in key order, stable).
        let found = self.members(keys, end - 1);
        self.entries.clear();
        Some(found)
    }

    /// Where the top-level members `keys` are, from the top level's entries, and whether the
    /// top level is plain (see [`Self::object`]); the object closes at `close`.
    fn members<const N: usize>(&self, keys: [&str; N], close: usize) -> (super::TopLevel<N>, bool) {
        let mut values: [Option<Range<usize>>; N] = std::array::from_fn(|_| None);
        let mut plain = true;
        for e in &self.entries {
            // A key with escapes could spell one of `keys` another way.
            plain &= matches!(e.key, Cow::Borrowed(_));
            if let Some(k) = keys.iter().position(|k| *k == e.key) {
                plain &= values[k].replace(e.value.clone()).is_none();
            }
        }
        (super::TopLevel { values, close }, plain)
    }

    /// The value at `range` (as a `serde_json::value::RawValue` of this text spans it, or a
    /// member's value as [`Self::object`] notes it): one value, with nothing but spacing around
    /// it inside `range`.
    pub fn value(&mut self, range: Range<usize>, out: &mut Vec<u8>) -> Option<()> {
        let end = self.value_at(range.start, 0, out)?;
        let rest = self.text.as_bytes().get(end..range.end)?;
        rest.iter()
            .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .then_some(())
    }

    fn byte(&self, at: usize) -> Option<u8> {
        self.text.as_bytes().get(at).copied()
    }

    fn space(&self, mut at: usize) -> usize {
        while matches!(self.byte(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            at += 1;
        }
        at
    }

    /// Writes the value at `at` (spacing before it skipped); the index past it.
    fn value_at(&mut self, at: usize, depth: usize, out: &mut Vec<u8>) -> Option<usize> {
        let at = self.space(at);
        match self.byte(at)? {
            b'{' => self.object_at(at, depth + 1, None, out),
            b'[' => self.array_at(at, depth + 1, out),
            b'"' => self.string_value_at(at, out),
            b't' => self.literal(at, "true", out),
            b'f' => self.literal(at, "false", out),
            b'n' => self.literal(at, "null", out),
            b'-' | b'0'..=b'9' => self.number_at(at, out),
            _ => None,
        }
    }

    fn literal(&self, at: usize, word: &str, out: &mut Vec<u8>) -> Option<usize> {
        let end = at + word.len();
        (self.text.get(at..end)? == word).then(|| {
            out.extend_from_slice(word.as_bytes());
            end
        })
    }

    /// Writes the string whose opening quote is at `at`; the index past it and its value.
    fn string_at(&self, at: usize, out: &mut Vec<u8>) -> Option<(usize, Cow<'a, str>)> {
        let (end, escapes) = self.scan_string(at)?;
        let literal = self.text.get(at..end)?;
        let inner = &literal[1..literal.len() - 1];
        if escapes == Escapes::None {
            out.extend_from_slice(literal.as_bytes());
            return Some((end, Cow::Borrowed(inner)));
        }
        let value: String = serde_json::from_str(literal).ok()?;
        serde_json::to_writer(&mut *out, &value).ok()?;
        Some((end, Cow::Owned(value)))
    }

    /// [`Self::string_at`] for a value, whose text is not needed: a string whose escapes
    /// serde_json writes back as they are (`\n`, `\"`, ...; an agent's history is full of
    /// them) is copied as it came, without being decoded and encoded again.
    fn string_value_at(&self, at: usize, out: &mut Vec<u8>) -> Option<usize> {
        let (end, escapes) = self.scan_string(at)?;
        if escapes == Escapes::Rewritten {
            return self.string_at(at, out).map(|(end, _)| end);
        }
        out.extend_from_slice(self.text.get(at..end)?.as_bytes());
        Some(end)
    }

    /// The index past the string whose opening quote is at `at`, and what escapes it holds;
    /// `None` when serde_json would refuse it (a control character).
    fn scan_string(&self, at: usize) -> Option<(usize, Escapes)> {
        let bytes = self.text.as_bytes();
        let mut escapes = Escapes::None;
        let end = super::string_end_noting(bytes, at, |c| {
            // serde_json writes back `\"`, `\\` and the short escapes of control characters as
            // they are; `\/` and `\u` come back as what they stand for.
            escapes = match c {
                b'u' | b'/' => Escapes::Rewritten,
                _ if escapes == Escapes::Rewritten => Escapes::Rewritten,
                _ => Escapes::Kept,
            };
        })?;
        // serde_json refuses control characters in a string (they must be escaped).
        (!has_control(&bytes[at + 1..end - 1])).then_some((end, escapes))
    }

    fn number_at(&self, at: usize, out: &mut Vec<u8>) -> Option<usize> {
        let bytes = self.text.as_bytes();
        let mut end = at;
        while matches!(
            bytes.get(end),
            Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
        ) {
            end += 1;
        }
        let token = self.text.get(at..end)?;
        // A small non-negative integer is written back as it came (`u64`, then its digits).
        let plain = token.len() <= 18
            && token.bytes().all(|b| b.is_ascii_digit())
            && (token.len() == 1 || !token.starts_with('0'));
        if plain {
            out.extend_from_slice(token.as_bytes());
            return Some(end);
        }
        let n: serde_json::Number = serde_json::from_str(token).ok()?;
        match super::request::whole(&n).filter(|_| self.whole_floats) {
            Some(i) => serde_json::to_writer(&mut *out, &i).ok()?,
            None => serde_json::to_writer(&mut *out, &n).ok()?,
        }
        Some(end)
    }

    fn array_at(&mut self, at: usize, depth: usize, out: &mut Vec<u8>) -> Option<usize> {
        if depth > MAX_DEPTH {
            return None;
        }
        out.push(b'[');
        let mut i = self.space(at + 1);
        if self.byte(i)? == b']' {
            out.push(b']');
            return Some(i + 1);
        }
        loop {
            i = self.value_at(i, depth, out)?;
            i = self.space(i);
            match self.byte(i)? {
                b',' => out.push(b','),
                b']' => {
                    out.push(b']');
                    return Some(i + 1);
                }
                _ => return None,
            }
            i += 1;
        }
    }

    fn object_at(
        &mut self,
        at: usize,
        depth: usize,
        top: Option<(Edits<'_>, &mut dyn std::io::Write)>,
        out: &mut Vec<u8>,
    ) -> Option<usize> {
        self.objects += 1;
        if depth > MAX_DEPTH || self.objects > MAX_OBJECTS {
            return None;
        }
        let start = out.len();
        let base = self.entries.len();
        let mut sorted = true;
        out.push(b'{');
        let mut i = self.space(at + 1);
        if self.byte(i)? == b'}' {
            i += 1;
        } else {
            loop {
                if self.byte(i)? != b'"' {
                    return None;
                }
                if self.entries.len() > base {
                    out.push(b',');
                }
                let from = out.len();
                let (end, key) = self.string_at(i, out)?;
                i = self.space(end);
                if self.byte(i)? != b':' {
                    return None;
                }
                out.push(b':');
                let value = self.space(i + 1);
                i = self.value_at(value, depth, out)?;
                if let Some(last) = self.entries.last().filter(|_| self.entries.len() > base) {
                    sorted &= last.key < key;
                }
                self.entries.push(Entry {
                    key,
                    at: from..out.len(),
                    value: value..i,
                });
                i = self.space(i);
                match self.byte(i)? {
                    b',' => i = self.space(i + 1),
                    b'}' => {
                        i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        match top {
            None if sorted => out.push(b'}'),
            None => self.reorder(start, base, out),
            // The top level's entries stay for `object` to read.
            Some((edits, sink)) => {
                self.write_sorted(start, base, edits, out, sink).ok()?;
                return Some(i);
            }
        }
        self.entries.truncate(base);
        Some(i)
    }

    /// Rewrites the object written from `start` (its entries from `base`) in key order, a
    /// duplicated key's last entry kept.
    fn reorder(&mut self, start: usize, base: usize, out: &mut Vec<u8>) {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(&out[start..]);
        out.truncate(start);
        let none = Edits {
            skip: &[],
            add: &[],
        };
        // Writing into a Vec cannot fail.
        let _ = self.write_sorted(start, base, none, &scratch, out);
        self.scratch = scratch;
    }

    /// Writes the object whose text is `from[start..]` (its entries from `base`, their ranges
    /// offset by `start`) into `to` in key order, a duplicated key's last entry kept, `edits`
    /// applied.
    fn write_sorted(
        &mut self,
        start: usize,
        base: usize,
        edits: Edits<'_>,
        from: &[u8],
        to: &mut dyn std::io::Write,
    ) -> std::io::Result<()> {
        let entries = &mut self.entries[base..];
        // Stable: a duplicated key's entries stay in the order they came.
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        to.write_all(b"{")?;
        let mut added = edits.add.iter().peekable();
        let mut first = true;
        let mut comma = |to: &mut dyn std::io::Write| {
            if std::mem::take(&mut first) {
                Ok(())
            } else {
                to.write_all(b",")
            }
        };
        let add = |to: &mut dyn std::io::Write, (k, v): &(&str, &str)| {
            serde_json::to_writer(&mut *to, k)?;
            to.write_all(b":")?;
            serde_json::to_writer(&mut *to, v).map_err(std::io::Error::other)
        };
        for (n, e) in entries.iter().enumerate() {
            let later = entries.get(n + 1).is_some_and(|next| next.key == e.key);
            if later || edits.skip.contains(&&*e.key) {
                continue;
            }
            while let Some(a) = added.next_if(|(k, _)| *k < &*e.key) {
                comma(to)?;
                add(to, a)?;
            }
            comma(to)?;
            to.write_all(&from[e.at.start - start..e.at.end - start])?;
        }
        for a in added {
            comma(to)?;
            add(to, a)?;
        }
        to.write_all(b"}")
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;
    use serde_json::Value;

    /// What serde_json writes for the parsed value (whole floats as integers when asked).
    fn reference(text: &str, whole_floats: bool) -> Vec<u8> {
        let mut v: Value = serde_json::from_str(text).unwrap();
        if whole_floats {
            crate::openai::canonical_numbers(&mut v);
        }
        serde_json::to_vec(&v).unwrap()
    }

    fn written(text: &str, whole_floats: bool) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        Writer::new(text, whole_floats)
            .value(0..text.len(), &mut out)
            .map(|()| out)
    }

    #[test]
    fn values_are_written_as_serde_json_writes_them_parsed() {
        for text in [
            r#" { "b" : 1 , "a" : [ 1.0 , -0 , 2.50, 1e2, -7, 0, 12345678901234567890, 3E-2 ] } "#,
            r#"{"z":{"y":{"x":null,"w":true}},"a":false,"m":"\u00e9\n\"q\"\/","\u0061":"dup"}"#,
            r#"{"k":1,"k":2,"j":{"k":[],"k":{}}}"#,
            r#"[{"role":"user","content":"hi"},{"content":"x","role":"assistant"}]"#,
            r#""plain""#,
            r#""a\ud83d\udc4db""#,
            r#"{"k\n":"a\nb\t\"c\\ \r\b\f","j":["x\/y","\u0041\n","\n\u001f"]}"#,
            "{}",
            "[]",
            "-0.0",
            "1.5e300",
        ] {
            for whole in [false, true] {
                assert_eq!(
                    written(text, whole).map(String::from_utf8),
                    Some(String::from_utf8(reference(text, whole))),
                    "{text} whole={whole}"
                );
            }
        }
    }

    #[test]
    fn control_characters_are_found_in_any_position() {
        for len in 0..40 {
            for at in 0..len {
                for b in [0u8, 0x1f, 0x20, 0x7f, 0x80, 0xff] {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = b;
                    assert_eq!(has_control(&bytes), b < 0x20, "{len} {at} {b}");
                }
            }
        }
    }

    #[test]
    fn what_serde_json_would_refuse_is_left_to_it() {
        let deep = format!("{}1{}", "[".repeat(120), "]".repeat(120));
        for text in [r#""\ud800""#, "1e400", &deep] {
            assert_eq!(written(text, true), None, "{text}");
        }
    }

    #[test]
    fn the_top_level_edits_skip_keys_and_merge_members_in_order() {
        let text = r#"{"stream":true,"n":1,"messages":[],"temperature":0.0,"model":"x"}"#;
        let (mut out, mut sink) = (Vec::new(), Vec::new());
        let edits = Edits {
            skip: &["stream", "model", "endpoint"],
            add: &[("endpoint", "chat"), ("model", "m\"y")],
        };
        Writer::new(text, true)
            .object(edits, ["model"], &mut out, &mut sink)
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&sink).unwrap(),
            r#"{"endpoint":"chat","messages":[],"model":"m\"y","n":1,"temperature":0}"#
        );
        for text in ["[1]", "{} x"] {
            assert_eq!(
                Writer::new(text, true).object(edits, ["model"], &mut out, &mut sink),
                None
            );
        }
    }

    #[test]
    fn the_top_level_members_are_noted_where_the_scan_finds_them() {
        let keys = ["model", "max_tokens", "stream_options", "absent"];
        let edits = Edits {
            skip: &[],
            add: &[],
        };
        for text in [
            r#"{"model":"x","messages":[{"model":"inner","max_tokens":1}],"max_tokens":16}"#,
            " {\n \"max_tokens\" :\t5.0 ,\"model\": \"a\\\"b\" ,\"stream_options\":{\"include_usage\":true} } \n",
            r#"{"x\u0079":1,"model":"x"}"#,
            r#"{"model":"x","model":"y"}"#,
            r#"{"dup":1,"dup":2,"model":"x"}"#,
            r#"{"m\u006fdel":"x"}"#,
            r#"{"model":"x","z":{"a\u0062":[1,{"c":null}]}}"#,
            "{}",
        ] {
            let (mut out, mut sink) = (Vec::new(), Vec::new());
            let keys_bytes = keys.map(str::as_bytes);
            let (noted, plain) = Writer::new(text, true)
                .object(edits, keys, &mut out, &mut sink)
                .unwrap();
            let scanned = crate::openai::top_level(text.as_bytes(), keys_bytes);
            assert_eq!(plain.then_some(&noted), scanned.as_ref(), "{text}");
            // By the keys as read, the last of a key given twice, as the tree has it.
            let tree: serde_json::Value = serde_json::from_str(text).unwrap();
            for (k, at) in keys.iter().zip(&noted.values) {
                let written = at.clone().map(|r| {
                    serde_json::from_str::<serde_json::Value>(&text[r]).unwrap()
                });
                assert_eq!(written.as_ref(), tree.get(k), "{text} {k}");
            }
        }
    }
}
