//! [`GpuStatic`]: the static embedding table on the GPU. The `vocab × dim` table is uploaded once;
//! a call sends the batch's token ids flattened with per-text offsets, and one kernel
//! (`static_pool`, one block per text) sums the rows of each text's ids, normalises the sum and
//! writes one vector per text — the same arithmetic as
//! [`StaticEmbedder::embed_ids`](crate::static_embed::StaticEmbedder::embed_ids).

use std::path::Path;
use std::sync::Mutex;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::bert::KERNELS;
use super::{device_err, function, grid, guard, int, Gpu};
use crate::bert::EmbedError;

/// Threads per block of `static_pool` (one block per text).
const POOL_BLOCK: u32 = 128;

/// The static embedding table, resident on a GPU.
pub struct GpuStatic {
    gpu: Gpu,
    pool: CudaFunction,
    table: CudaSlice<f32>,
    dim: usize,
    vocab: usize,
    /// Serialises calls (one set of launches and copies on the stream at a time).
    lock: Mutex<()>,
}

impl std::fmt::Debug for GpuStatic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStatic")
            .field("dim", &self.dim)
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl GpuStatic {
    /// Upload `table` (`vocab × dim` f32, row-major: row `i` is token id `i`) to CUDA device
    /// `ordinal`.
    pub fn new(table: &[f32], dim: usize, ordinal: usize) -> Result<Self, EmbedError> {
        if table.is_empty() || table.len().checked_rem(dim) != Some(0) {
            return Err(EmbedError::Device(format!(
                "a static table of {} floats is not a whole number of {dim}-vectors",
                table.len()
            )));
        }
        let vocab = table.len() / dim;
        u32::try_from(vocab)
            .map_err(|_| EmbedError::Device("static table vocabulary too large".into()))?;
        int(table.len(), "static table size")?;
        let gpu = Gpu::open(ordinal)?;
        let (pool, table) = guard("loading the static table onto the GPU", || {
            let module = gpu.compile(KERNELS, &[])?;
            let pool = function(&module, "static_pool")?;
            let table = gpu
                .stream
                .clone_htod(table)
                .map_err(device_err("uploading the static table"))?;
            gpu.stream
                .synchronize()
                .map_err(device_err("uploading the static table"))?;
            Ok((pool, table))
        })?;
        Ok(Self {
            gpu,
            pool,
            table,
            dim,
            vocab,
            lock: Mutex::new(()),
        })
    }

    /// Load a table file written by
    /// [`StaticEmbedder::save`](crate::static_embed::StaticEmbedder::save) onto device
    /// `ordinal`.
    pub fn load(path: &Path, ordinal: usize) -> Result<Self, EmbedError> {
        let (table, dim) = crate::static_embed::read_table::<f32>(path)?;
        Self::new(&table, dim, ordinal)
    }

    /// Dimension of the vectors.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows of the table (the tokenizer's vocabulary size).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The static embedding of each token id sequence: the L2-normalised sum (so the normalised
    /// mean) of its rows, ids past the table skipped, zero for a sequence without known ids —
    /// as [`StaticEmbedder::embed_ids`](crate::static_embed::StaticEmbedder::embed_ids). The
    /// whole batch is one upload, one launch and one copy back.
    pub fn embed_ids(&self, batch: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut offsets = Vec::with_capacity(batch.len() + 1);
        let mut ids: Vec<u32> = Vec::with_capacity(batch.iter().map(Vec::len).sum());
        offsets.push(0u32);
        for seq in batch {
            ids.extend_from_slice(seq);
            offsets.push(
                u32::try_from(ids.len())
                    .map_err(|_| EmbedError::Device("too many token ids in one batch".into()))?,
            );
        }
        if ids.is_empty() {
            // No kernel reads an empty id buffer: every vector is zero.
            return Ok(vec![vec![0.0; self.dim]; batch.len()]);
        }
        let texts = int(batch.len(), "texts")?;
        let dim = int(self.dim, "dimension")?;
        int(batch.len() * self.dim, "output size")?;
        #[allow(clippy::cast_possible_truncation, reason = "checked in new()")]
        let vocab = self.vocab as u32;
        let _serial = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard("running the static table on the GPU", || {
            let stream = &self.gpu.stream;
            let ids_dev = stream
                .clone_htod(&ids)
                .map_err(device_err("uploading token ids"))?;
            let offsets_dev = stream
                .clone_htod(&offsets)
                .map_err(device_err("uploading offsets"))?;
            let mut out = stream
                .alloc_zeros::<f32>(batch.len() * self.dim)
                .map_err(device_err("allocating the output"))?;
            let cfg = LaunchConfig {
                grid_dim: (grid(batch.len()), 1, 1),
                block_dim: (POOL_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: static_pool(table, ids, offsets, out, texts, dim, vocab) as declared in
            // kernels.cu; `offsets` has texts + 1 entries, all within `ids`; ids at or past
            // `vocab` are skipped by the kernel; `out` holds texts × dim floats; one block per
            // text with a block size that is a multiple of 32.
            unsafe {
                stream
                    .launch_builder(&self.pool)
                    .arg(&self.table)
                    .arg(&ids_dev)
                    .arg(&offsets_dev)
                    .arg(&mut out)
                    .arg(&texts)
                    .arg(&dim)
                    .arg(&vocab)
                    .launch(cfg)
            }
            .map_err(device_err("static_pool"))?;
            let flat = stream
                .clone_dtoh(&out)
                .map_err(device_err("copying static vectors back"))?;
            stream
                .synchronize()
                .map_err(device_err("running static_pool"))?;
            Ok(flat.chunks_exact(self.dim).map(<[f32]>::to_vec).collect())
        })
    }
}
