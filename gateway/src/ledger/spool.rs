//! An append-only spool file of ledger rows (JSON lines, fsynced per append) that keeps rows
//! while the database is unreachable; the writer replays it in order and then drops the replayed
//! prefix. Replays are idempotent (the ledger skips known request ids), so a crash between the
//! database write and the truncation writes nothing twice.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::usage::UsageEvent;

/// The spool of one gateway process.
#[derive(Debug)]
pub struct Spool {
    path: PathBuf,
    lock: Mutex<()>,
    rows: AtomicU64,
}

impl Spool {
    /// Open (creating) `dir/ledger.spool`, counting rows left by a previous run.
    pub fn open(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let path = dir.join("ledger.spool");
        let rows = match File::open(&path) {
            Ok(f) => BufReader::new(f).lines().count() as u64,
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        Ok(Self {
            path,
            lock: Mutex::new(()),
            rows: AtomicU64::new(rows),
        })
    }

    /// Rows waiting in the spool.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Acquire)
    }

    /// Append rows durably (written and fsynced before returning).
    pub fn append(&self, rows: &[UsageEvent]) -> io::Result<()> {
        self.write(rows, true)
    }

    /// Append rows without waiting for the disk (the request path's overflow: the OS has them,
    /// and the next synced append or replay flushes them).
    pub fn append_unsynced(&self, rows: &[UsageEvent]) -> io::Result<()> {
        self.write(rows, false)
    }

    fn write(&self, rows: &[UsageEvent], sync: bool) -> io::Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(rows.len() * 512);
        for r in rows {
            serde_json::to_writer(&mut buf, r)?;
            buf.push(b'\n');
        }
        let f = {
            // Hold the lock for the write only, so a concurrent append never waits on a disk
            // flush; fsync after it covers every byte written to the file so far.
            let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?;
            f.write_all(&buf)?;
            self.rows.fetch_add(rows.len() as u64, Ordering::AcqRel);
            f
        };
        if sync {
            f.sync_data()?;
        }
        Ok(())
    }

    /// Every complete row in order, and the byte offset just past them. A torn last line (a
    /// crash mid-append) is left for the next read.
    ///
    /// Takes no lock: the file only grows between truncations, which only the (single) replayer
    /// performs, and a line still being appended is torn and left for the next read.
    pub fn read(&self) -> io::Result<(Vec<UsageEvent>, u64)> {
        let mut bytes = Vec::new();
        match File::open(&self.path) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(e),
        }
        let mut rows = Vec::new();
        let mut offset = 0usize;
        while let Some(end) = bytes[offset..].iter().position(|&b| b == b'\n') {
            let line = &bytes[offset..offset + end];
            match serde_json::from_slice::<UsageEvent>(line) {
                Ok(r) => rows.push(r),
                Err(e) => tracing::error!(error = %e, "unreadable spool line skipped"),
            }
            offset += end + 1;
        }
        Ok((rows, offset as u64))
    }

    /// Drop the first `offset` bytes (rows already written to the database), keeping anything
    /// appended since `read`.
    pub fn consume(&self, offset: u64, rows: u64) -> io::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut tail = Vec::new();
        if let Ok(mut f) = File::open(&self.path) {
            f.seek(SeekFrom::Start(offset))?;
            f.read_to_end(&mut tail)?;
        }
        let tmp = self.path.with_extension("spool.tmp");
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&tail)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        self.rows
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(rows))
            })
            .ok();
        Ok(())
    }
}
