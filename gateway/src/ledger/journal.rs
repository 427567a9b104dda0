//! The ledger journal: every row is appended to a local file (one `write`, no fsync) before it
//! is queued, so a process killed with rows in its queue or in a batch on its way to the database
//! loses none of them: the next start finds them in the journal and spools them (the spool's
//! replay skips rows the database already has).
//!
//! The journal is a series of segments, `ledger.journal.<n>` in `ledger.spool_dir`. Rows go to
//! the current segment; the writer rotates it every second. A segment is deleted once it is
//! rotated out and every row in it has been written to the database or to the (fsynced) spool.
//! Without fsync a row survives the process dying (the kernel has it), not the machine losing
//! power: that bound is the operating system's dirty-page writeback (about 30 s on Linux).
//!
//! A segment starts with [`MAGIC`] and holds one record per row: its length (4 bytes, little
//! endian), then the row in postcard, serde's compact binary form (no field names, nothing
//! escaped: appending a row measured ~4.7 k instructions, write included, against ~14.8 k for
//! its ~1 KB JSON line; docs/benchmarks.md, sixteenth sitting).
//! A segment without the magic is an earlier version's JSON lines, and is read as such.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::usage::UsageEvent;

const PREFIX: &str = "ledger.journal.";

/// The first bytes of a segment of binary records (format 1).
const MAGIC: &[u8; 4] = b"GWJ1";

/// Room for one record (a typical row is ~300 bytes).
const RECORD_CAPACITY: usize = 768;

/// The journal of one gateway process.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The segment rows are appended to.
    current: u64,
    file: File,
    /// Rows journaled and not yet written or spooled, per segment.
    pending: BTreeMap<u64, usize>,
}

impl Journal {
    /// Open the journal in `dir`, returning it and the rows of segments a previous run left
    /// behind (rows it may not have written; the caller spools them, then calls
    /// [`Journal::recovered`]).
    pub fn open(dir: &Path) -> io::Result<(Self, Vec<UsageEvent>)> {
        fs::create_dir_all(dir)?;
        let mut left = Vec::new();
        let mut last = 0;
        for (n, path) in segments(dir)? {
            last = last.max(n);
            read_segment(&path, &mut left)?;
        }
        let current = last + 1;
        let file = open_segment(dir, current)?;
        Ok((
            Self {
                dir: dir.to_owned(),
                inner: Mutex::new(Inner {
                    current,
                    file,
                    pending: BTreeMap::from([(current, 0)]),
                }),
            },
            left,
        ))
    }

    /// The rows [`Journal::open`] returned are safe elsewhere (spooled): drop their segments.
    pub fn recovered(&self) -> io::Result<()> {
        let current = self.lock().current;
        for (n, path) in segments(&self.dir)? {
            if n < current {
                fs::remove_file(path)?;
            }
        }
        Ok(())
    }

    /// Append `event`; returns the segment it went to, for [`Journal::done`].
    pub fn append(&self, event: &UsageEvent) -> io::Result<u64> {
        let mut record = Vec::with_capacity(RECORD_CAPACITY);
        record.extend_from_slice(&[0; 4]);
        let mut record = postcard::to_extend(event, record).map_err(io::Error::other)?;
        let len = u32::try_from(record.len() - 4).map_err(io::Error::other)?;
        record[..4].copy_from_slice(&len.to_le_bytes());
        let mut inner = self.lock();
        // One write: a kill can tear only the last record, never interleave two.
        inner.file.write_all(&record)?;
        let current = inner.current;
        *inner.pending.entry(current).or_default() += 1;
        Ok(current)
    }

    /// Rows of `segments` (one entry per row) are in the database or the spool; delete the
    /// segments that are rotated out and hold nothing else.
    pub fn done(&self, segments: impl IntoIterator<Item = u64>) {
        let mut inner = self.lock();
        for s in segments {
            if let Some(n) = inner.pending.get_mut(&s) {
                *n = n.saturating_sub(1);
            }
        }
        self.collect(&mut inner);
    }

    /// Start a new segment (the writer calls this every second).
    pub fn rotate(&self) -> io::Result<()> {
        let mut inner = self.lock();
        let next = inner.current + 1;
        inner.file = open_segment(&self.dir, next)?;
        inner.current = next;
        inner.pending.insert(next, 0);
        self.collect(&mut inner);
        Ok(())
    }

    /// Rows journaled and not yet written or spooled.
    pub fn pending(&self) -> usize {
        self.lock().pending.values().sum()
    }

    fn collect(&self, inner: &mut Inner) {
        let current = inner.current;
        let finished: Vec<u64> = inner
            .pending
            .iter()
            .filter(|(s, n)| **s < current && **n == 0)
            .map(|(s, _)| *s)
            .collect();
        for s in finished {
            inner.pending.remove(&s);
            if let Err(e) = fs::remove_file(segment_path(&self.dir, s)) {
                tracing::warn!(error = %e, segment = s, "could not delete a ledger journal segment");
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn segment_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{n}"))
}

fn open_segment(dir: &Path, n: u64) -> io::Result<File> {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(segment_path(dir, n))?;
    if file.metadata()?.len() == 0 {
        file.write_all(MAGIC)?;
    }
    Ok(file)
}

/// The rows of the segment at `path`, appended to `rows`: binary records, or an earlier
/// version's JSON lines. A record or line torn by a kill mid-write (its request never got
/// this far) is skipped.
fn read_segment(path: &Path, rows: &mut Vec<UsageEvent>) -> io::Result<()> {
    let bytes = fs::read(path)?;
    let Some(mut rest) = bytes.strip_prefix(MAGIC.as_slice()) else {
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice::<UsageEvent>(line) {
                Ok(e) => rows.push(e),
                Err(e) => tracing::warn!(error = %e, "unreadable ledger journal line skipped"),
            }
        }
        return Ok(());
    };
    while !rest.is_empty() {
        let record = rest.split_first_chunk::<4>().and_then(|(len, body)| {
            let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
            Some((body.get(..len)?, &body[len..]))
        });
        let Some((record, after)) = record else {
            tracing::warn!(bytes = rest.len(), "torn ledger journal record skipped");
            break;
        };
        match postcard::from_bytes::<UsageEvent>(record) {
            Ok(e) => rows.push(e),
            Err(e) => tracing::warn!(error = %e, "unreadable ledger journal record skipped"),
        }
        rest = after;
    }
    Ok(())
}

/// The journal segments in `dir`, oldest first.
fn segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|n| n.parse::<u64>().ok())
        {
            out.push((n, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests")]
pub(crate) mod tests {
    use super::*;

    /// A ledger row with id `id` (also used by the writer's tests).
    pub(crate) fn event(id: &str) -> UsageEvent {
        let mut e: UsageEvent = serde_json::from_value(serde_json::json!({
            "request_id": id, "started_at": "2026-12-01T00:00:00Z", "tenant_id": "t",
            "tenant_name": "t", "key_id": "k", "tags": {}, "endpoint": "chat",
            "requested_model": "m", "served_model": null, "tier": null, "replica": null,
            "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0,
            "usage_source": "upstream", "status": 200, "error_kind": null, "stream": false,
            "client_disconnected": false, "latency_ms": 1.0, "ttft_ms": null, "retries": 0,
            "cache_status": "bypass", "cost_micros": 0, "output_cost_micros": 0,
            "saved_micros": 0, "loop_flag": false, "retry_storm_flag": false,
            "fingerprint": "f"}))
        .unwrap();
        e.request_id = id.into();
        e
    }

    #[test]
    fn rows_not_marked_done_survive_into_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let (j, left) = Journal::open(dir.path()).unwrap();
        assert!(left.is_empty());
        let a = j.append(&event("a")).unwrap();
        let b = j.append(&event("b")).unwrap();
        j.rotate().unwrap();
        let c = j.append(&event("c")).unwrap();
        j.done([a]);
        assert_eq!(j.pending(), 2);
        // "b" and "c" were never confirmed: a crash here leaves both, and "a" too (its segment
        // still held "b"), which the spool's idempotent replay then skips.
        drop(j);
        let (j, mut left) = Journal::open(dir.path()).unwrap();
        left.sort_by(|x, y| x.request_id.cmp(&y.request_id));
        let ids: Vec<_> = left.iter().map(|e| e.request_id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c"]);
        j.recovered().unwrap();
        let _ = (b, c);
        let (_, left) = Journal::open(dir.path()).unwrap();
        assert!(left.is_empty(), "recovered segments are gone");
    }

    #[test]
    fn an_earlier_versions_json_segment_is_read_and_a_torn_record_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut full = event("full");
        full.tags.insert("feature".into(), "search \"q\"".into());
        full.served_model = Some("m".into());
        full.ttft_ms = Some(2.5);
        full.matched_blocks = Some(3);
        // An earlier version's segment: JSON lines, the last one torn.
        let mut old = serde_json::to_vec(&event("old")).unwrap();
        old.extend_from_slice(b"\n{\"request_id\":\"to");
        std::fs::write(segment_path(dir.path(), 1), old).unwrap();
        // This version's segment, its last record torn.
        let (j, left) = Journal::open(dir.path()).unwrap();
        assert_eq!(left.len(), 1);
        j.append(&full).unwrap();
        j.append(&event("torn")).unwrap();
        drop(j);
        let path = segment_path(dir.path(), 2);
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(MAGIC));
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        let (_, left) = Journal::open(dir.path()).unwrap();
        let ids: Vec<_> = left.iter().map(|e| e.request_id.as_str()).collect();
        assert_eq!(ids, ["old", "full"]);
        assert_eq!(left[1], full, "every field survives the binary form");
    }

    /// A row as format 1 writes it. A record names no fields, so a field added to
    /// `UsageEvent` (or one moved) would make this version's records unreadable: this test
    /// then fails, and the change needs a new magic, with format 1 still read.
    const GOLDEN: &str = "06676f6c64656e14323032362d31322d30315430303a30303a30305a0174\
                          0174016b000463686174016d00000001010000c801000000000000000000f03f0000000000000000000000000000000166";

    #[test]
    fn the_record_format_is_frozen_under_its_magic() {
        let bytes = postcard::to_stdvec(&event("golden")).unwrap();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, GOLDEN);
        let back: UsageEvent = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, event("golden"));
    }

    #[test]
    fn a_rotated_segment_whose_rows_are_done_is_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _) = Journal::open(dir.path()).unwrap();
        let a = j.append(&event("a")).unwrap();
        j.done([a]);
        assert_eq!(
            segments(dir.path()).unwrap().len(),
            1,
            "the current one stays"
        );
        j.rotate().unwrap();
        assert_eq!(segments(dir.path()).unwrap().len(), 1, "the old one went");
        assert_eq!(j.pending(), 0);
    }
}
