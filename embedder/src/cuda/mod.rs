//! The GPU path (feature `cuda`): the transformer ([`GpuEmbedder`]), the static table
//! ([`GpuStatic`]) and the semantic cache's vector index ([`GpuIndex`]) on an NVIDIA GPU.
//!
//! # Loading CUDA
//!
//! Built on `cudarc` with *dynamic loading*: the driver (`libcuda`), NVRTC and cuBLAS are opened
//! at run time, so the crate builds, and every CPU path runs, on machines without the CUDA
//! toolkit or a GPU. [`available`] says whether this machine can run the GPU path (and why not);
//! every constructor calls it first. cudarc panics when a library or one of its symbols cannot
//! be loaded; [`available`] checks the libraries without loading any symbol, and every entry
//! point of this module runs its CUDA calls under [`std::panic::catch_unwind`], turning such a
//! panic (a driver too old for a symbol, say) into [`EmbedError::Device`].
//!
//! # What is resident on the GPU
//!
//! - [`GpuEmbedder`]: every weight of the model, f32, uploaded once by [`GpuEmbedder::load`]
//!   (about 91 MB for all-MiniLM-L6-v2; the query, key and value projections fused into one
//!   `[3h, h]` matrix), the kernels, and a workspace (activations of the largest batch seen,
//!   grown on demand) reused by every call.
//! - [`GpuStatic`]: the whole `vocab × dim` table, f32.
//! - [`GpuIndex`]: every stored vector as fp16 in one `capacity × stride` matrix, with a
//!   namespace (u64) and an expiry (i64) per row; the host keeps the bookkeeping (id per row,
//!   LRU clock, free rows).
//!
//! # Batching
//!
//! Whatever texts one call passes are one batch: the caller (the gateway) gathers concurrent
//! requests. A batch is padded to its longest text (at most
//! [`MAX_TOKENS`](crate::bert::MAX_TOKENS) tokens) and run as one forward pass of
//! `texts × len` tokens (split into several passes only past [`MAX_PASS_TOKENS`] tokens, to
//! bound the workspace; the attention scores of a pass are computed a chunk of texts at a time
//! within a fixed budget). Each object does all its work in order on one CUDA stream of its own;
//! a call returns once its results are on the host.
//!
//! # Kernels
//!
//! CUDA C (`kernels.cu`, `scan.cu`, embedded in the binary) compiled at run time by NVRTC,
//! once per object: to a cubin for the device's architecture (`sm_90` on an H100/H200), which
//! any driver of the same CUDA major version loads, else to PTX that the driver compiles. They
//! include no header, so NVRTC needs nothing but its own built-ins.
//!
//! # Row-major tensors, column-major cuBLAS
//!
//! Every tensor here is row-major (C order), as in PyTorch and candle; cuBLAS is column-major.
//! A row-major `r × c` matrix is, byte for byte, the column-major `c × r` matrix — its
//! transpose — so each product is computed transposed, with nothing copied: for a linear layer
//! `Y = X·Wᵀ` (`X` `[rows, in]`, `W` `[out, in]` as PyTorch stores it), cuBLAS computes
//! `Yᵀ = W·Xᵀ` with `A = W` (seen column-major as `Wᵀ`, so `transa = T`, `lda = in`),
//! `B = X` (seen as `Xᵀ`, `transb = N`, `ldb = in`) and `C = Y` (seen as `Yᵀ`, `ldc = out`):
//! `m = out`, `n = rows`, `k = in`. The attention products follow the same rule per head
//! (`attention_scores`, `attention_context` below), and the unit tests check all three
//! against a plain row-major product through a CPU model of cuBLAS's column-major contract.
//!
//! # The fused scan
//!
//! A [`GpuIndex`] search is one kernel launch: each half-warp scores two rows at a time (fp16
//! loads of 16 bytes, fp32 products), skips rows of other namespaces after reading their 8-byte
//! namespace, and keeps its best `k` (at most [`MAX_K`]) above the threshold in shared memory;
//! each block writes its merged best `k`, and the host merges `blocks × k` candidates. No
//! per-row score ever reaches memory, so the scan costs about one read of the matrix.

#![allow(
    unsafe_code,
    reason = "kernel launches, cuBLAS calls, the NVRTC cubin FFI and turning off cudarc's event \
              tracking are unsafe in cudarc; each use states why it is sound"
)]

mod bert;
mod index;
mod static_table;

use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

pub use self::bert::GpuEmbedder;
pub use self::index::{GpuIndex, MAX_K};
pub use self::static_table::GpuStatic;

use crate::bert::EmbedError;

/// The CUDA version of cudarc's bindings (the workspace's `cudarc` feature `cuda-13000`). cudarc
/// opens each library by name, the unversioned `libX.so` first, then `libX.so.13`, `.so.12` and
/// older: an unversioned link of another CUDA version on the loader path wins. So
/// `scripts/gpu/cuda-libs.sh` puts CUDA 13's folders first on `LD_LIBRARY_PATH` when the loader
/// cache lacks the `.so.13` libraries, and [`versions`] reports what was loaded.
pub const CUDA_BINDINGS: &str = "13.0";

/// Largest forward pass of [`GpuEmbedder`], in (padded) tokens; a larger call runs as several
/// passes. Bounds the workspace (about 25 KB of activations per token).
pub const MAX_PASS_TOKENS: usize = 65_536;

/// The number of CUDA devices, or why the GPU path cannot run here: the driver, NVRTC or cuBLAS
/// library cannot be found, the driver fails to initialise, or there is no device.
///
/// Never panics: the libraries are probed without loading any symbol first, and the driver
/// calls run under [`catch_unwind`].
pub fn available() -> Result<usize, EmbedError> {
    // SAFETY: each probe only tries `dlopen` on the library's usual names and closes what it
    // opened; no symbol is resolved or called.
    let probes = unsafe {
        [
            (
                "the CUDA driver",
                "cuda",
                "the NVIDIA driver's libcuda.so.1",
                cudarc::driver::sys::is_culib_present(),
            ),
            (
                "NVRTC",
                "nvrtc",
                "a CUDA toolkit's lib64, or pip's nvidia-cuda-nvrtc package's lib folder",
                cudarc::nvrtc::sys::is_culib_present(),
            ),
            (
                "cuBLAS",
                "cublas",
                "a CUDA toolkit's lib64, or pip's nvidia-cublas package's lib folder",
                cudarc::cublas::sys::is_culib_present(),
            ),
        ]
    };
    let missing: Vec<String> = probes
        .iter()
        .filter(|(.., present)| !present)
        .map(|(name, lib, hint, _)| {
            // cudarc's candidate names, as `libX.so` and its versions: "libnvrtc.so[.13|.12|…]".
            let stem = format!("lib{lib}.so.");
            let versions: Vec<String> = cudarc::get_lib_name_candidates(lib)
                .into_iter()
                .filter_map(|n| n.strip_prefix(&stem).map(str::to_owned))
                .collect();
            format!(
                "{name} (lib{lib}.so[.{}], from {hint})",
                versions.join("|.")
            )
        })
        .collect();
    if !missing.is_empty() {
        return Err(EmbedError::Device(format!(
            "cannot load {} on the loader path (LD_LIBRARY_PATH, then the ldconfig cache): no \
             NVIDIA driver or CUDA {CUDA_BINDINGS} libraries here",
            missing.join("; "),
        )));
    }
    let count = guard("counting CUDA devices", || {
        CudaContext::device_count().map_err(device_err("cuInit / cuDeviceGetCount"))
    })?;
    match usize::try_from(count) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(EmbedError::Device("no CUDA device".into())),
    }
}

/// The versions of the CUDA libraries loaded: the driver's CUDA version, NVRTC's and cuBLAS's
/// (e.g. "driver CUDA 13.0, NVRTC 13.0, cuBLAS 13.1.0"), or why they cannot be read.
pub fn versions() -> Result<String, EmbedError> {
    available()?;
    guard("reading the CUDA library versions", || {
        let mut driver = 0i32;
        // SAFETY: each call writes plain integers through the pointers given, which are valid
        // for the call.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(device_err("cuDriverGetVersion"))?;
        let (mut nv_major, mut nv_minor) = (0i32, 0i32);
        // SAFETY: as above.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nv_major, &mut nv_minor) }
            .result()
            .map_err(|e| EmbedError::Device(format!("nvrtcVersion: {e:?}")))?;
        let mut blas = [0i32; 3];
        for (part, value) in [
            cudarc::cublas::sys::libraryPropertyType::MAJOR_VERSION,
            cudarc::cublas::sys::libraryPropertyType::MINOR_VERSION,
            cudarc::cublas::sys::libraryPropertyType::PATCH_LEVEL,
        ]
        .into_iter()
        .zip(&mut blas)
        {
            // SAFETY: as above.
            unsafe { cudarc::cublas::sys::cublasGetProperty(part, value) }
                .result()
                .map_err(device_err("cublasGetProperty"))?;
        }
        Ok(format!(
            "driver CUDA {}.{}, NVRTC {nv_major}.{nv_minor}, cuBLAS {}.{}.{} (built for CUDA \
             {CUDA_BINDINGS})",
            driver / 1000,
            driver % 1000 / 10,
            blas[0],
            blas[1],
            blas[2],
        ))
    })
}

/// The name of device `ordinal` (e.g. "NVIDIA H200").
pub fn device_name(ordinal: usize) -> Result<String, EmbedError> {
    let gpu = Gpu::open(ordinal)?;
    guard("reading the device name", || {
        gpu.ctx.name().map_err(device_err("cuDeviceGetName"))
    })
}

/// Run CUDA calls, turning a panic of cudarc's dynamic loading (a missing library or symbol)
/// into [`EmbedError::Device`].
fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, EmbedError>) -> Result<T, EmbedError> {
    // AssertUnwindSafe: the only panics expected here come from cudarc resolving a library or a
    // symbol, before the CUDA call that needed it runs, so no state is left half-updated.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(EmbedError::Device(format!("{what}: {message}")))
        }
    }
}

/// Map a CUDA error (driver, cuBLAS) into [`EmbedError::Device`], naming the failed step.
fn device_err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> EmbedError {
    move |e| EmbedError::Device(format!("{what}: {e}"))
}

/// One device as this module uses it: its primary context and a stream of our own.
///
/// Every object of this module (embedder, static table, index) has its own [`Gpu`] and does
/// all its work — allocation, copies, launches, frees — in order on its one stream, so cudarc's
/// cross-stream event tracking is turned off (it would record two events per kernel argument).
struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl Gpu {
    fn open(ordinal: usize) -> Result<Self, EmbedError> {
        let count = available()?;
        if ordinal >= count {
            return Err(EmbedError::Device(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        guard("opening the CUDA device", || {
            let ctx = CudaContext::new(ordinal).map_err(device_err("cuDevicePrimaryCtxRetain"))?;
            // SAFETY: tracking is off before anything is allocated in this context object, and
            // everything allocated through it is used, and freed, only on `stream` below, in
            // stream order: no cross-stream synchronisation is needed.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(device_err("cuStreamCreate"))?;
            Ok(Self { ctx, stream })
        })
    }

    /// Compile CUDA C with NVRTC for this device (`defines`: extra `-D` options) and load it.
    ///
    /// First as a cubin for the device's own architecture (`sm_XY`): machine code loads on any
    /// driver of the same CUDA major version, even one older than NVRTC. Then, if that fails
    /// (an NVRTC without cubin output, or one that does not know the device), as PTX for the
    /// architecture (`compute_XY`) or NVRTC's default one, which the driver compiles at load
    /// time (and which needs a driver at least as new as NVRTC).
    fn compile(&self, src: &str, defines: &[String]) -> Result<Arc<CudaModule>, EmbedError> {
        let (major, minor) = self
            .ctx
            .compute_capability()
            .map_err(device_err("reading the compute capability"))?;
        let arch = architecture(major, minor);
        let mut failures = Vec::new();
        if let Some((_, sm)) = arch {
            let cubin =
                guard("NVRTC (cubin)", || compile_cubin(src, sm, defines)).and_then(|cubin| {
                    self.ctx
                        .load_module(Ptx::from_binary(cubin))
                        .map_err(device_err("loading the kernels (cuModuleLoadData)"))
                });
            match cubin {
                Ok(module) => return Ok(module),
                Err(e) => failures.push(format!("{sm} cubin: {e}")),
            }
        }
        let options = |arch| CompileOptions {
            arch,
            options: defines.to_vec(),
            ..Default::default()
        };
        let ptx = match cudarc::nvrtc::compile_ptx_with_opts(src, options(arch.map(|a| a.0))) {
            Ok(ptx) => ptx,
            // An NVRTC older than the device does not know its architecture: compile for
            // NVRTC's default one, and let the driver JIT the PTX.
            Err(_) if arch.is_some() => cudarc::nvrtc::compile_ptx_with_opts(src, options(None))
                .map_err(|e| EmbedError::Device(compile_message(&e)))?,
            Err(e) => return Err(EmbedError::Device(compile_message(&e))),
        };
        self.ctx.load_module(ptx).map_err(|e| {
            failures.push(format!("PTX: loading the kernels (cuModuleLoadData): {e}"));
            EmbedError::Device(failures.join("; "))
        })
    }

    /// Number of streaming multiprocessors.
    fn multiprocessors(&self) -> Result<usize, EmbedError> {
        let n = self
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(device_err("reading the multiprocessor count"))?;
        Ok(usize::try_from(n).unwrap_or(1).max(1))
    }
}

/// NVRTC's virtual and real architecture names for a compute capability (None: unknown here;
/// NVRTC's default virtual architecture is used).
fn architecture(major: i32, minor: i32) -> Option<(&'static str, &'static str)> {
    Some(match (major, minor) {
        (7, 0) => ("compute_70", "sm_70"),
        (7, 2) => ("compute_72", "sm_72"),
        (7, 5) => ("compute_75", "sm_75"),
        (8, 0) => ("compute_80", "sm_80"),
        (8, 6) => ("compute_86", "sm_86"),
        (8, 7) => ("compute_87", "sm_87"),
        (8, 9) => ("compute_89", "sm_89"),
        (9, 0) => ("compute_90", "sm_90"),
        (10, 0) => ("compute_100", "sm_100"),
        (12, 0) => ("compute_120", "sm_120"),
        _ => return None,
    })
}

/// Compile CUDA C to a cubin for the real architecture `sm` (`sm_90`, ...).
fn compile_cubin(src: &str, sm: &str, defines: &[String]) -> Result<Vec<u8>, EmbedError> {
    use cudarc::nvrtc::{result, sys};
    let fail =
        |what: &str, e: &dyn std::fmt::Debug| EmbedError::Device(format!("NVRTC {what}: {e:?}"));
    let src = CString::new(src).map_err(|e| fail("source", &e))?;
    let prog = result::create_program(&src, None).map_err(|e| fail("nvrtcCreateProgram", &e))?;
    let mut options = vec![format!("--gpu-architecture={sm}")];
    options.extend(defines.iter().cloned());
    // SAFETY: `prog` was created above from `src`, which outlives it; it is used only here and
    // destroyed exactly once, after its last use. The cubin buffer has the size NVRTC reported.
    unsafe {
        let compiled = result::compile_program(prog, &options)
            .map_err(|e| {
                let log = result::get_program_log(prog)
                    .map(|log| {
                        let bytes: Vec<u8> = log
                            .iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c.to_ne_bytes()[0])
                            .collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                EmbedError::Device(format!("NVRTC: {e:?}: {log}"))
            })
            .and_then(|()| {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail("nvrtcGetCUBINSize", &e))?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| fail("nvrtcGetCUBIN", &e))?;
                Ok(cubin)
            });
        // A failure to free the program only leaks it: the result stands.
        let _ = result::destroy_program(prog);
        compiled
    }
}

fn compile_message(e: &CompileError) -> String {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("NVRTC: {nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("NVRTC: {other:?}"),
    }
}

fn function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction, EmbedError> {
    module
        .load_function(name)
        .map_err(|e| EmbedError::Device(format!("kernel {name}: {e}")))
}

/// A size as the `int` the kernels and cuBLAS take.
fn int(n: usize, what: &str) -> Result<i32, EmbedError> {
    i32::try_from(n).map_err(|_| EmbedError::Device(format!("{what} = {n} exceeds a CUDA int")))
}

/// Threads per block of the "one warp per row" kernels.
const ROW_BLOCK: u32 = 256;

/// Launch shape for `rows` rows, one warp each.
fn warp_per_row(rows: usize) -> LaunchConfig {
    let warps_per_block = ROW_BLOCK as usize / 32;
    LaunchConfig {
        grid_dim: (grid(rows.div_ceil(warps_per_block)), 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape for `n` elements, one thread each.
fn thread_per_element(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(n.div_ceil(ROW_BLOCK as usize)), 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid dimension (at least 1; the callers' sizes are bounded far below `u32::MAX` blocks).
fn grid(blocks: usize) -> u32 {
    u32::try_from(blocks.max(1)).unwrap_or(u32::MAX)
}

/// `Y[rows, out] = X[rows, inp] · W[out, inp]ᵀ` (row-major) as one cuBLAS product with
/// `A = W`, `B = X`, `C = Y`; see the module docs.
fn linear(rows: i32, inp: i32, out: i32) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: out,
        n: rows,
        k: inp,
        alpha: 1.0,
        lda: inp,
        ldb: inp,
        beta: 0.0,
        ldc: out,
    }
}

/// Per head `h` of `batch`: `S_h[len, len] = scale · Q_h · K_hᵀ` with `Q_h`, `K_h` `[len, dh]`
/// row-major and consecutive (stride `len·dh`); cuBLAS computes `S_hᵀ = K_h · Q_hᵀ` with
/// `A = K`, `B = Q`, `C = S`.
fn attention_scores(len: i32, dh: i32, batch: i32, scale: f32) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: len,
            n: len,
            k: dh,
            alpha: scale,
            lda: dh,
            ldb: dh,
            beta: 0.0,
            ldc: len,
        },
        batch_size: batch,
        stride_a: i64::from(len) * i64::from(dh),
        stride_b: i64::from(len) * i64::from(dh),
        stride_c: i64::from(len) * i64::from(len),
    }
}

/// Per head: `O_h[len, dh] = P_h[len, len] · V_h[len, dh]` (row-major); cuBLAS computes
/// `O_hᵀ = V_hᵀ · P_hᵀ` with `A = V`, `B = P`, `C = O`.
fn attention_context(len: i32, dh: i32, batch: i32) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: dh,
            n: len,
            k: len,
            alpha: 1.0,
            lda: dh,
            ldb: len,
            beta: 0.0,
            ldc: dh,
        },
        batch_size: batch,
        stride_a: i64::from(len) * i64::from(dh),
        stride_b: i64::from(len) * i64::from(len),
        stride_c: i64::from(len) * i64::from(dh),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use super::*;

    /// cuBLAS's `sgemm` contract on host memory: column-major, `C = α·op(A)·op(B) + β·C`.
    fn sgemm(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let t = |op| op == cublasOperation_t::CUBLAS_OP_T;
        let at = |i: usize, p: usize| {
            if t(cfg.transa) {
                a[p + i * lda]
            } else {
                a[i + p * lda]
            }
        };
        let bt = |p: usize, j: usize| {
            if t(cfg.transb) {
                b[j + p * ldb]
            } else {
                b[p + j * ldb]
            }
        };
        for j in 0..n {
            for i in 0..m {
                let s: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                c[i + j * ldc] = cfg.alpha * s + cfg.beta * c[i + j * ldc];
            }
        }
    }

    fn strided(cfg: &StridedBatchedConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        for i in 0..cfg.batch_size as usize {
            let (sa, sb, sc) = (
                cfg.stride_a as usize * i,
                cfg.stride_b as usize * i,
                cfg.stride_c as usize * i,
            );
            sgemm(&cfg.gemm, &a[sa..], &b[sb..], &mut c[sc..]);
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    }

    /// Row-major `x[r, k] · y[k, c]`.
    fn matmul(x: &[f32], y: &[f32], r: usize, k: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                out[i * c + j] = (0..k).map(|p| x[i * k + p] * y[p * c + j]).sum();
            }
        }
        out
    }

    fn transpose(x: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut out = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                out[j * r + i] = x[i * c + j];
            }
        }
        out
    }

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }

    #[test]
    fn linear_is_x_times_w_transposed_in_row_major() {
        let (rows, inp, out) = (5, 7, 3);
        let x = values(rows * inp, 1);
        let w = values(out * inp, 2);
        let mut y = vec![0.0; rows * out];
        sgemm(&linear(5, 7, 3), &w, &x, &mut y);
        close(&y, &matmul(&x, &transpose(&w, out, inp), rows, inp, out));
    }

    #[test]
    fn attention_products_are_per_head_q_kt_and_p_v_in_row_major() {
        let (len, dh, heads) = (4, 3, 2);
        let q = values(heads * len * dh, 3);
        let k = values(heads * len * dh, 4);
        let v = values(heads * len * dh, 5);
        let mut s = vec![0.0; heads * len * len];
        strided(&attention_scores(4, 3, 2, 0.5), &k, &q, &mut s);
        let mut o = vec![0.0; heads * len * dh];
        strided(&attention_context(4, 3, 2), &v, &s, &mut o);
        for h in 0..heads {
            let (qh, kh, vh) = (
                &q[h * len * dh..(h + 1) * len * dh],
                &k[h * len * dh..(h + 1) * len * dh],
                &v[h * len * dh..(h + 1) * len * dh],
            );
            let expect: Vec<f32> = matmul(qh, &transpose(kh, len, dh), len, dh, len)
                .into_iter()
                .map(|x| x * 0.5)
                .collect();
            let sh = &s[h * len * len..(h + 1) * len * len];
            close(sh, &expect);
            close(
                &o[h * len * dh..(h + 1) * len * dh],
                &matmul(sh, vh, len, len, dh),
            );
        }
    }

    #[test]
    fn known_architectures_map_to_nvrtc_names() {
        assert_eq!(architecture(9, 0), Some(("compute_90", "sm_90")));
        assert_eq!(architecture(8, 0), Some(("compute_80", "sm_80")));
        assert_eq!(architecture(3, 5), None);
    }

    /// The kernels compile with NVRTC, to PTX and to an sm_90 cubin, where the library is
    /// present (it needs no GPU); with
    /// `CUDA_KERNELS_PTX_DIR` set, the PTX is written there for inspection (e.g. `ptxas`).
    #[test]
    fn kernels_compile_with_nvrtc_when_it_is_present() {
        // SAFETY: only probes for the library (dlopen/dlclose).
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let sources = [
            ("kernels", bert::KERNELS, Vec::new()),
            ("scan384", index::SCAN, vec!["-DIDX_CHUNKS=48".to_owned()]),
            ("scan20", index::SCAN, vec!["-DIDX_CHUNKS=3".to_owned()]),
        ];
        for (name, src, defines) in sources {
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(
                src,
                CompileOptions {
                    arch: Some("compute_90"),
                    options: defines.clone(),
                    ..Default::default()
                },
            )
            .map_err(|e| compile_message(&e))
            .unwrap();
            if let Some(dir) = std::env::var_os("CUDA_KERNELS_PTX_DIR") {
                std::fs::write(
                    std::path::Path::new(&dir).join(format!("{name}.ptx")),
                    ptx.to_src(),
                )
                .unwrap();
            }
            let cubin = compile_cubin(src, "sm_90", &defines).unwrap();
            assert_eq!(&cubin[..4], b"\x7fELF", "{name}: a cubin is an ELF image");
        }
    }
}
