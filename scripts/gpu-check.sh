#!/usr/bin/env bash
# Check the embedder's CUDA path (feature `cuda`) on a machine with an NVIDIA GPU: the unit tests
# of embedder::cuda (cuBLAS layout mapping, NVRTC compilation of the kernels), the GPU/CPU parity
# tests (embedder/tests/gpu_parity.rs) and the GPU benchmark (embedder/examples/gpu_bench.rs),
# then one summary table. Without an NVIDIA GPU it says so and exits 0.
#
# The CUDA libraries are loaded at run time (driver, NVRTC, cuBLAS): they must be findable by the
# loader. This script adds the usual places (a CUDA toolkit under /usr/local, pip's CUDA wheels
# nvidia-cuda-nvrtc / nvidia-cublas) to LD_LIBRARY_PATH when the loader cache lacks them. For a
# GPU machine without Rust or network, build the bundle here instead: scripts/gpu-bundle.sh.
# On a host without crates.io, set CARGO_NET_OFFLINE=true with the dependencies already fetched.
# About 5-10 minutes on a 16-core machine (most of it the release build).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "no NVIDIA GPU: CUDA path unverified on hardware"
  exit 0
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "nvidia-smi finds no usable NVIDIA GPU: CUDA path unverified on hardware"
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# Make libnvrtc and libcublas findable when the loader cache does not know them.
# shellcheck source=scripts/gpu/cuda-libs.sh
source scripts/gpu/cuda-libs.sh
cuda_libs_on_path

scripts/fetch-model.sh

LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT
status_build=failed status_unit=failed status_parity=failed status_bench=failed

if cargo build --release -p embedder --features cuda --lib --test gpu_parity --example gpu_bench; then
  status_build=ok
fi
if [ "$status_build" = ok ]; then
  if cargo test --release -p embedder --features cuda --lib cuda:: -- --nocapture 2>&1 |
    tee "$LOG/unit.txt"; then
    status_unit=ok
  fi
  if cargo test --release -p embedder --features cuda --test gpu_parity -- --nocapture 2>&1 |
    tee "$LOG/parity.txt"; then
    status_parity=ok
  fi
  if cargo run --release -p embedder --features cuda --example gpu_bench 2>&1 |
    tee "$LOG/bench.txt"; then
    status_bench=ok
  fi
fi
if grep -q '^skipped:' "$LOG/parity.txt" 2>/dev/null; then
  status_parity="skipped ($(grep -m1 '^skipped:' "$LOG/parity.txt" | cut -c10-))"
fi

echo
echo "## CUDA path: summary"
echo
echo "| check | result |"
echo "|---|---|"
echo "| release build (--features cuda) | $status_build |"
echo "| unit tests (embedder::cuda) | $status_unit |"
echo "| GPU/CPU parity (tests/gpu_parity.rs) | $status_parity |"
grep -h -E 'worst sentence cosine|searches agree' "$LOG/parity.txt" 2>/dev/null |
  sed -e 's/^/| parity detail | /' -e 's/$/ |/' || true
echo "| benchmark (examples/gpu_bench.rs) | $status_bench |"
echo
grep -h -E '^\|' "$LOG/bench.txt" 2>/dev/null || true

for s in "$status_build" "$status_unit" "$status_parity" "$status_bench"; do
  case "$s" in ok | skipped*) ;; *) exit 1 ;; esac
done
