#!/usr/bin/env bash
# Build, HERE, everything the GPU test machine needs to check the embedder's CUDA path in one
# run: that machine (an H200) has no network and no Rust, only the NVIDIA driver, CUDA 13's pip
# libraries, PyTorch and sentence-transformers, and it receives the working tree plus named
# folders, 64 MiB in all. Writes the git-ignored folder gpu-bundle/ (GPU_BUNDLE_DIR to change):
#
#   payload.tar.xz  xz-compressed (LZMA's extreme preset: the fp16 weights shrink by a tenth):
#                   bin/, the CUDA-featured release programs, stripped: the embedder's unit tests
#                   (embedder_unit), the GPU/CPU parity tests (gpu_parity), the vector dump for
#                   the sentence-transformers comparison (gpu_embed) and the benchmark
#                   (gpu_bench), built for x86-64 like that machine; model/, all-MiniLM-L6-v2 with
#                   its weights in fp16 (45 MB instead of 91; as byte planes, scripts/gpu/planes.py,
#                   which xz packs into 39 MB) and the tokenizer, config and sentence-transformers
#                   files
#   run.sh          the check to run there (scripts/gpu/run.sh), with st_parity.py, cuda-libs.sh
#                   and the parity texts
#
# With GPU_BUNDLE_GATEWAY=1 (the default; CI's dry run sets 0 to spare a release build), also
# the end-to-end figures of the semantic cache on the GPU (issue 19, item 3): the payload then
# holds bin/gw/ (the gateway built with `--features cuda`, gatewayctl, the minimal upstream),
# bin/tools/ (this machine's wrk with its LuaJIT library) and questions.jsonl (the questions of
# ../shared/data/qqp-dev.jsonl); run.sh runs bench/cache-throughput.sh there with them.
#
# Prints the bundle's size with the working tree's and fails above 60 MiB. Then, with a lent
# machine: run `gpu-bundle/run.sh` there, carrying gpu-bundle (docs/benchmarks.md, "GPU").
# About 8-10 minutes on 2 cores from a cold build cache (the release build).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${GPU_BUNDLE_DIR:-gpu-bundle}
GATEWAY=${GPU_BUNDLE_GATEWAY:-1}
PAIRS=${PAIRS:-../shared/data/qqp-dev.jsonl}
LIMIT_MIB=60
TARGET=${CARGO_TARGET_DIR:-target}

scripts/fetch-model.sh
MODEL=${MODEL_DIR:-models/all-MiniLM-L6-v2}

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/payload/bin" "$STAGE/payload/model/1_Pooling"

# Build the programs; cargo says where each executable is.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        name = m["target"]["name"]
        if "lib" in m["target"]["kind"]:
            name += "_unit"
        print(name, m["executable"])
'
}
{
  cargo test --release --locked -p embedder --features cuda --lib --test gpu_parity --no-run \
    --message-format=json-render-diagnostics
  cargo build --release --locked -p embedder --features cuda --example gpu_embed \
    --example gpu_bench --message-format=json-render-diagnostics
  if [ "$GATEWAY" = 1 ]; then
    cargo build --release --locked -p gateway --features cuda --bins --example min_upstream \
      --message-format=json-render-diagnostics
  fi
} | executables >"$STAGE/executables"
# take NAME DEST: copy the built executable NAME to $STAGE/payload/bin/DEST, stripped.
take() {
  local path
  path=$(awk -v n="$1" '$1 == n { print $2 }' "$STAGE/executables" | tail -1)
  if [ -z "$path" ]; then
    echo "the build produced no $1" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$STAGE/payload/bin/$2")"
  cp "$path" "$STAGE/payload/bin/$2"
  strip "$STAGE/payload/bin/$2"
}
for want in embedder_unit gpu_parity gpu_embed gpu_bench; do
  take "$want" "$want"
done
if [ "$GATEWAY" = 1 ]; then
  take gateway gw/gateway
  take gatewayctl gw/gatewayctl
  take min_upstream gw/examples/min_upstream
  # The GPU machine has no wrk: take this machine's, with the LuaJIT library it links.
  wrk=$(command -v wrk) || { echo "GPU_BUNDLE_GATEWAY=1 needs wrk here: apt-get install wrk" >&2; exit 1; }
  mkdir -p "$STAGE/payload/bin/tools"
  cp "$wrk" "$STAGE/payload/bin/tools/wrk"
  luajit=$(ldd "$wrk" | awk '/libluajit/ { print $3 }')
  if [ -n "$luajit" ]; then
    cp -L "$luajit" "$STAGE/payload/bin/tools/"
  fi
fi

python3 scripts/gpu/fp16.py "$MODEL/model.safetensors" "$STAGE/model.safetensors"
python3 scripts/gpu/planes.py split "$STAGE/model.safetensors" "$STAGE/payload/model/model.planes"
for f in tokenizer.json config.json modules.json sentence_bert_config.json 1_Pooling/config.json; do
  cp "$MODEL/$f" "$STAGE/payload/model/$f"
done
if [ "$GATEWAY" = 1 ]; then
  # Only the questions (the `a` side) travel: bench/cache-throughput.sh reads nothing else.
  python3 -c '
import json, sys
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        out.write(json.dumps({"a": json.loads(line)["a"]}) + "\n")
' "$PAIRS" "$STAGE/payload/questions.jsonl"
fi
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -c '
import lzma, sys, tarfile
with tarfile.open(sys.argv[1], "w:xz", preset=9 | lzma.PRESET_EXTREME) as t:
    t.add(sys.argv[2], arcname=".")
' "$DEST/payload.tar.xz" "$STAGE/payload"
cp scripts/gpu/run.sh scripts/gpu/st_parity.py scripts/gpu/cuda-libs.sh scripts/gpu/planes.py "$DEST/"
cp embedder/tests/fixtures/parity-texts.json "$DEST/"
{
  echo "GPU bundle built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- embedder scripts/gpu || echo ' (with uncommitted changes)')"
  echo "$(rustc -V), x86-64, cudarc bindings for CUDA 13.0; model weights fp16"
} >"$DEST/BUILD"

# What would travel: tracked and untracked-not-ignored files, plus the bundle.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
  xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
bundle_bytes=$(find "$DEST" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
echo
echo "bundle $DEST:"
(cd "$DEST" && find . -type f -printf '  %-36p %10s bytes\n' | sort)
python3 - "$tree_bytes" "$bundle_bytes" "$LIMIT_MIB" <<'PY'
import sys
tree, bundle, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mib = 1 << 20
total = tree + bundle
print(f"bundle {bundle / mib:.1f} MiB + working tree {tree / mib:.1f} MiB = {total / mib:.1f} MiB "
      f"(limit {limit} MiB)")
if total > limit * mib:
    sys.exit(f"over {limit} MiB: the device machine takes 64 MiB in all")
PY
echo "next, on the GPU machine: run 'gpu-bundle/run.sh' with gpu-bundle carried"
