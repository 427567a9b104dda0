//! [`GpuIndex`]: the semantic cache's vector index on the GPU.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;

use super::{device_err, grid, guard, int, Gpu};
use crate::bert::EmbedError;
use crate::index::{EntryId, Hit, VectorIndex};

/// The scan kernel (CUDA C), compiled per index with its row width.
pub(super) const SCAN: &str = include_str!("scan.cu");

/// Largest `k` a [`GpuIndex`] search returns (larger requests are capped).
pub const MAX_K: usize = 16;
/// Threads per block of `scan_topk` (`SCAN_THREADS` in scan.cu).
const SCAN_THREADS: u32 = 256;
/// Rows a block covers per grid-stride step: 16 half-warps × 2 rows (scan.cu).
const ROWS_PER_BLOCK_STEP: usize = (SCAN_THREADS as usize / 16) * 2;
/// Expired rows one search reports (and so drops) at most.
const EXPIRED_CAP: usize = 256;
/// The expiry of a free row.
const FREE_ROW: i64 = i64::MIN;
/// "No candidate" in the kernel's output.
const NO_ROW: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    ns: u64,
    row: u32,
    used: u64,
    expires: i64,
}

/// The last state of a row, staged for the device.
#[derive(Debug)]
enum Staged {
    Free,
    Entry {
        ns: u64,
        expires: i64,
        data: Vec<f16>,
    },
}

/// The semantic cache's vector index on the GPU, with the semantics of
/// [`CpuIndex`](crate::index::CpuIndex).
///
/// Device side: one fp16 matrix of `capacity` rows (each `dim` halves, padded with zeros to a
/// multiple of 8 so a row is whole 16-byte chunks), and per row its namespace (u64) and expiry
/// (i64, `FREE_ROW` for a free row). Host side: the id of each row, each entry's namespace, row
/// and LRU tick, an ordered map from tick to entry (the LRU order, so eviction is `O(log n)`),
/// the free rows (lowest reused first, and the scanned extent shrinks when the top rows free),
/// and a count per namespace (a search of an empty namespace launches nothing).
///
/// Writes are staged per row and flushed, consecutive rows in one copy, at the end of each
/// operation; a failed flush stays staged and is retried by the next operation.
///
/// A search is one launch of `scan_topk` (see `scan.cu`): the block candidates come back in one
/// copy with the expired rows the scan met above the threshold, and the host merges them. As in
/// `CpuIndex`, expired entries are never returned, and expired entries that a search meets
/// scoring at least its threshold are dropped (`CpuIndex` drops those of them that would have
/// entered its running best `k`; here all of them, up to 256 per search), so `len` may count
/// expired entries until they are touched or evicted, as the trait allows. `k` is capped at
/// [`MAX_K`].
pub struct GpuIndex {
    dim: usize,
    /// Halves per row on the device (`dim` rounded up to a multiple of 8).
    stride: usize,
    capacity: usize,
    ttl_ms: i64,
    gpu: Gpu,
    scan: CudaFunction,
    data: CudaSlice<f16>,
    row_ns: CudaSlice<u64>,
    row_expires: CudaSlice<i64>,
    query: CudaSlice<f32>,
    /// `[expired count, expired rows.., (score bits, row) per block and rank]`.
    out: CudaSlice<u32>,
    /// Most blocks a scan launches (enough to fill the device).
    max_blocks: usize,
    slots: HashMap<EntryId, Slot>,
    row_ids: Vec<Option<EntryId>>,
    lru: BTreeMap<u64, EntryId>,
    per_ns: HashMap<u64, usize>,
    free: BTreeSet<u32>,
    /// Rows `0..high` are scanned; rows past it are free.
    high: u32,
    tick: u64,
    staged: BTreeMap<u32, Staged>,
    error: Option<EmbedError>,
}

impl std::fmt::Debug for GpuIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuIndex")
            .field("dim", &self.dim)
            .field("capacity", &self.capacity)
            .field("len", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl GpuIndex {
    /// An index of `dim`-dimensional vectors holding at most `capacity` entries, each living
    /// `ttl_ms` after insertion, on CUDA device `ordinal`. The whole matrix
    /// (`capacity × dim` halves) is allocated now.
    pub fn new(
        dim: usize,
        capacity: usize,
        ttl_ms: i64,
        ordinal: usize,
    ) -> Result<Self, EmbedError> {
        let capacity = capacity.max(1);
        if dim == 0 {
            return Err(EmbedError::Device(
                "an index of 0-dimensional vectors".into(),
            ));
        }
        let stride = dim.div_ceil(8) * 8;
        // Rows are u32 on the host and `int` in the kernel.
        i32::try_from(capacity)
            .map_err(|_| EmbedError::Device(format!("index capacity {capacity} too large")))?;
        let gpu = Gpu::open(ordinal)?;
        let parts = guard("creating the GPU index", || {
            let module = gpu.compile(SCAN, &[format!("-DIDX_CHUNKS={}", stride / 8)])?;
            let scan = super::function(&module, "scan_topk")?;
            let per_sm = scan
                .occupancy_max_active_blocks_per_multiprocessor(SCAN_THREADS, 0, None)
                .map_err(device_err("occupancy of scan_topk"))?;
            let max_blocks = gpu.multiprocessors()? * (per_sm as usize).max(1);
            let s = &gpu.stream;
            let alloc = device_err("allocating the index");
            let data = s.alloc_zeros::<f16>(capacity * stride).map_err(&alloc)?;
            let row_ns = s.alloc_zeros::<u64>(capacity).map_err(&alloc)?;
            let row_expires = s.clone_htod(&vec![FREE_ROW; capacity]).map_err(&alloc)?;
            let query = s.alloc_zeros::<f32>(stride).map_err(&alloc)?;
            let out = s
                .alloc_zeros::<u32>(1 + EXPIRED_CAP + 2 * max_blocks * MAX_K)
                .map_err(&alloc)?;
            s.synchronize().map_err(&alloc)?;
            Ok((scan, max_blocks, data, row_ns, row_expires, query, out))
        })?;
        let (scan, max_blocks, data, row_ns, row_expires, query, out) = parts;
        Ok(Self {
            dim,
            stride,
            capacity,
            ttl_ms,
            gpu,
            scan,
            data,
            row_ns,
            row_expires,
            query,
            out,
            max_blocks,
            slots: HashMap::new(),
            row_ids: vec![None; capacity],
            lru: BTreeMap::new(),
            per_ns: HashMap::new(),
            free: BTreeSet::new(),
            high: 0,
            tick: 0,
            staged: BTreeMap::new(),
            error: None,
        })
    }

    /// The most entries this index holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The last GPU error an operation met, if any, cleared by this call. The
    /// [`VectorIndex`] methods cannot return errors: an insert that failed on the device stays
    /// staged and is retried by the next operation, and a search that failed returns no hits.
    pub fn take_error(&mut self) -> Option<EmbedError> {
        self.error.take()
    }

    /// Insert many entries of one namespace: the same result as [`VectorIndex::insert`] for
    /// each in order, with their rows copied to the device in as few copies as their rows
    /// allow (consecutive rows in one). Vectors of the wrong dimension are skipped.
    pub fn insert_many(
        &mut self,
        ns: u64,
        entries: &[(EntryId, &[f32])],
        now_ms: i64,
    ) -> Result<(), EmbedError> {
        for &(id, vector) in entries {
            self.stage_insert(ns, id, vector, now_ms);
        }
        self.flush()
    }

    /// Time one scan kernel on the device (CUDA events around the launch and the 4-byte clear of
    /// its output counter before it), in milliseconds: the search of `query` in `ns` without the
    /// query's upload, the copies back, the host merge or any change to the index.
    pub fn time_scan(
        &mut self,
        ns: u64,
        query: &[f32],
        k: usize,
        threshold: f32,
        now_ms: i64,
    ) -> Result<f32, EmbedError> {
        if query.len() != self.dim {
            return Err(EmbedError::Device(format!(
                "query of {} dimensions for an index of {}",
                query.len(),
                self.dim
            )));
        }
        self.flush()?;
        let k = k.clamp(1, MAX_K);
        guard("timing the GPU scan", || {
            let blocks = self.upload_query(query)?;
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let stream = self.gpu.stream.clone();
            let start = stream
                .record_event(timing)
                .map_err(device_err("recording an event"))?;
            self.launch(blocks, ns, now_ms, threshold, k)?;
            let end = stream
                .record_event(timing)
                .map_err(device_err("recording an event"))?;
            start
                .elapsed_ms(&end)
                .map_err(device_err("timing the scan"))
        })
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Host bookkeeping of an insert; the device write is staged.
    fn stage_insert(&mut self, ns: u64, id: EntryId, vector: &[f32], now_ms: i64) {
        if vector.len() != self.dim {
            return;
        }
        self.stage_remove(id);
        while self.slots.len() >= self.capacity {
            let Some((_, &oldest)) = self.lru.first_key_value() else {
                break;
            };
            self.stage_remove(oldest);
        }
        let row = match self.free.pop_first() {
            Some(row) => row,
            None => {
                self.high += 1;
                self.high - 1
            }
        };
        let used = self.next_tick();
        let expires = now_ms.saturating_add(self.ttl_ms).max(FREE_ROW + 1);
        let mut data: Vec<f16> = vector.iter().map(|&x| f16::from_f32(x)).collect();
        data.resize(self.stride, f16::ZERO);
        self.slots.insert(
            id,
            Slot {
                ns,
                row,
                used,
                expires,
            },
        );
        self.row_ids[row as usize] = Some(id);
        self.lru.insert(used, id);
        *self.per_ns.entry(ns).or_default() += 1;
        self.staged.insert(row, Staged::Entry { ns, expires, data });
    }

    /// Host bookkeeping of a removal; the device write (the row's expiry set to `FREE_ROW`) is
    /// staged.
    fn stage_remove(&mut self, id: EntryId) -> bool {
        let Some(slot) = self.slots.remove(&id) else {
            return false;
        };
        self.lru.remove(&slot.used);
        if let Some(n) = self.per_ns.get_mut(&slot.ns) {
            *n -= 1;
            if *n == 0 {
                self.per_ns.remove(&slot.ns);
            }
        }
        self.row_ids[slot.row as usize] = None;
        self.staged.insert(slot.row, Staged::Free);
        self.free.insert(slot.row);
        // Shrink the scanned extent past free top rows: those need no device write (nothing
        // scans them, and a reuse rewrites them).
        while self.high > 0 && self.free.contains(&(self.high - 1)) {
            self.high -= 1;
            self.free.remove(&self.high);
            self.staged.remove(&self.high);
        }
        // A row past the extent may keep a stale expiry on the device: nothing scans it, and
        // the extent only grows over it by allocating it, which stages a full rewrite.
        true
    }

    /// Copy the staged rows to the device, runs of consecutive rows in one copy each.
    fn flush(&mut self) -> Result<(), EmbedError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let result = guard("writing index rows to the GPU", || {
            let mut runs: Vec<(u32, Vec<&Staged>)> = Vec::new();
            for (&row, staged) in &self.staged {
                match runs.last_mut() {
                    Some((start, run)) if *start as usize + run.len() == row as usize => {
                        run.push(staged);
                    }
                    _ => runs.push((row, vec![staged])),
                }
            }
            let stream = &self.gpu.stream;
            let write = device_err("writing index rows");
            for (start, run) in runs {
                let (from, to) = (start as usize, start as usize + run.len());
                let expires: Vec<i64> = run
                    .iter()
                    .map(|s| match s {
                        Staged::Free => FREE_ROW,
                        Staged::Entry { expires, .. } => *expires,
                    })
                    .collect();
                stream
                    .memcpy_htod(&expires, &mut self.row_expires.slice_mut(from..to))
                    .map_err(&write)?;
                if run.iter().all(|s| matches!(s, Staged::Free)) {
                    continue;
                }
                let ns: Vec<u64> = run
                    .iter()
                    .map(|s| match s {
                        Staged::Free => 0,
                        Staged::Entry { ns, .. } => *ns,
                    })
                    .collect();
                let mut data = Vec::with_capacity(run.len() * self.stride);
                for s in &run {
                    match s {
                        Staged::Free => data.resize(data.len() + self.stride, f16::ZERO),
                        Staged::Entry { data: row, .. } => data.extend_from_slice(row),
                    }
                }
                stream
                    .memcpy_htod(&ns, &mut self.row_ns.slice_mut(from..to))
                    .map_err(&write)?;
                stream
                    .memcpy_htod(
                        &data,
                        &mut self.data.slice_mut(from * self.stride..to * self.stride),
                    )
                    .map_err(&write)?;
            }
            Ok(())
        });
        if result.is_ok() {
            self.staged.clear();
        }
        result
    }

    /// Upload the query (padded to the row stride); the number of blocks to launch.
    fn upload_query(&mut self, query: &[f32]) -> Result<usize, EmbedError> {
        let mut padded = query.to_vec();
        padded.resize(self.stride, 0.0);
        self.gpu
            .stream
            .memcpy_htod(&padded, &mut self.query)
            .map_err(device_err("uploading the query"))?;
        Ok((self.high as usize)
            .div_ceil(ROWS_PER_BLOCK_STEP)
            .clamp(1, self.max_blocks))
    }

    /// Zero the expired counter and launch the scan over rows `0..high`.
    fn launch(
        &mut self,
        blocks: usize,
        ns: u64,
        now_ms: i64,
        threshold: f32,
        k: usize,
    ) -> Result<(), EmbedError> {
        let stream = &self.gpu.stream;
        stream
            .memset_zeros(&mut self.out.slice_mut(0..1))
            .map_err(device_err("clearing the scan output"))?;
        let rows = int(self.high as usize, "rows")?;
        let k_i = int(k, "k")?;
        let cap = int(EXPIRED_CAP, "expired cap")?;
        let cfg = LaunchConfig {
            grid_dim: (grid(blocks), 1, 1),
            block_dim: (SCAN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: scan_topk(data, row_ns, row_expires, query, rows, ns, now, threshold, k, out,
        // expired_cap) as declared in scan.cu, compiled with IDX_CHUNKS = stride / 8: `data`
        // holds capacity × stride halves (read as 16-byte chunks; cudarc allocations are
        // 256-byte aligned), the row arrays hold `capacity >= high = rows` entries, `query`
        // holds `stride` floats, `out` holds 1 + EXPIRED_CAP + 2 × max_blocks × MAX_K words and
        // `blocks <= max_blocks`, `1 <= k <= MAX_K`.
        unsafe {
            stream
                .launch_builder(&self.scan)
                .arg(&self.data)
                .arg(&self.row_ns)
                .arg(&self.row_expires)
                .arg(&self.query)
                .arg(&rows)
                .arg(&ns)
                .arg(&now_ms)
                .arg(&threshold)
                .arg(&k_i)
                .arg(&mut self.out)
                .arg(&cap)
                .launch(cfg)
        }
        .map_err(device_err("scan_topk"))?;
        Ok(())
    }

    /// The scan: the merged candidates (best first, at most `k`) and the expired rows met.
    fn scan(
        &mut self,
        ns: u64,
        query: &[f32],
        k: usize,
        threshold: f32,
        now_ms: i64,
    ) -> Result<(Vec<Hit>, Vec<EntryId>), EmbedError> {
        self.flush()?;
        guard("searching the GPU index", || {
            let blocks = self.upload_query(query)?;
            self.launch(blocks, ns, now_ms, threshold, k)?;
            let words = 1 + EXPIRED_CAP + 2 * blocks * k;
            let stream = &self.gpu.stream;
            let out = stream
                .clone_dtoh(&self.out.slice(0..words))
                .map_err(device_err("copying the scan results back"))?;
            stream
                .synchronize()
                .map_err(device_err("running scan_topk"))?;
            Ok(self.merge(&out, blocks, k, ns, now_ms))
        })
    }

    /// Merge the block candidates: live rows of `ns` only (a guard against a row whose device
    /// write is still staged after a failure), best first, ties by row.
    fn merge(
        &self,
        out: &[u32],
        blocks: usize,
        k: usize,
        ns: u64,
        now_ms: i64,
    ) -> (Vec<Hit>, Vec<EntryId>) {
        let live = |row: u32| {
            self.row_ids
                .get(row as usize)
                .copied()
                .flatten()
                .and_then(|id| self.slots.get(&id).map(|s| (id, *s)))
                .filter(|(_, s)| s.ns == ns)
        };
        let expired_count = (out[0] as usize).min(EXPIRED_CAP);
        let expired = out[1..=expired_count]
            .iter()
            .filter_map(|&row| live(row))
            .filter(|(_, s)| s.expires <= now_ms)
            .map(|(id, _)| id)
            .collect();
        let mut candidates: Vec<(f32, u32)> = out
            [1 + EXPIRED_CAP..1 + EXPIRED_CAP + 2 * blocks * k]
            .chunks_exact(2)
            .filter(|pair| pair[1] != NO_ROW)
            .map(|pair| (f32::from_bits(pair[0]), pair[1]))
            .collect();
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let hits = candidates
            .into_iter()
            .filter_map(|(score, row)| {
                live(row)
                    .filter(|(_, s)| s.expires > now_ms)
                    .map(|(id, _)| Hit { id, score })
            })
            .take(k)
            .collect();
        (hits, expired)
    }

    fn record<T>(&mut self, result: Result<T, EmbedError>) -> Option<T> {
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.error = Some(e);
                None
            }
        }
    }
}

impl VectorIndex for GpuIndex {
    fn insert(&mut self, ns: u64, id: EntryId, vector: &[f32], now_ms: i64) {
        self.stage_insert(ns, id, vector, now_ms);
        let flushed = self.flush();
        self.record(flushed);
    }

    fn search(
        &mut self,
        ns: u64,
        query: &[f32],
        k: usize,
        threshold: f32,
        now_ms: i64,
    ) -> Vec<Hit> {
        if query.len() != self.dim || k == 0 || !self.per_ns.contains_key(&ns) {
            return Vec::new();
        }
        let k = k.min(MAX_K);
        let scanned = self.scan(ns, query, k, threshold, now_ms);
        let Some((hits, expired)) = self.record(scanned) else {
            return Vec::new();
        };
        for id in expired {
            self.stage_remove(id);
        }
        for hit in &hits {
            let used = self.next_tick();
            if let Some(slot) = self.slots.get_mut(&hit.id) {
                self.lru.remove(&slot.used);
                slot.used = used;
                self.lru.insert(used, hit.id);
            }
        }
        let flushed = self.flush();
        self.record(flushed);
        hits
    }

    fn remove(&mut self, id: EntryId) -> bool {
        let removed = self.stage_remove(id);
        let flushed = self.flush();
        self.record(flushed);
        removed
    }

    fn contains(&self, id: EntryId) -> bool {
        self.slots.contains_key(&id)
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}
