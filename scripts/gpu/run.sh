#!/usr/bin/env bash
# The GPU bundle's check, run ON the GPU machine (no Rust, no network needed): copied into
# gpu-bundle/ by scripts/gpu-bundle.sh, which also puts there the CUDA-featured programs
# and the model in fp16 (payload.tar.xz) and the parity texts.
#
#   gpu-bundle/run.sh            # writes logs and the vectors under $OUT (or a temp folder)
#
# 1. prints the GPU and the CUDA libraries found (pip's nvidia-* wheels are added to
#    LD_LIBRARY_PATH when the loader cache lacks them);
# 2. the embedder's CUDA unit tests (NVRTC compiles the kernels for this device's architecture);
# 3. GPU/CPU parity (embedder/tests/gpu_parity.rs: transformer, static table, fp16 index);
# 4. the benchmark (embedder/examples/gpu_bench.rs): batch throughput, the 1M x 384 fp16 scan
#    against the copy-bandwidth floor;
# 5. our GPU and CPU vectors against sentence-transformers itself on the same texts (fp32, TF32
#    off): st_parity.py;
# 6. when the bundle holds the gateway (GPU_BUNDLE_GATEWAY=1): the semantic cache end to end,
#    bench/cache-throughput.sh from the working tree beside the bundle, every request a new
#    question (misses), at 1 and 16 connections, with the layer on the GPU and then on this
#    machine's CPU (the static table is distilled there first);
# 7. compute-sanitizer's memcheck over the parity tests (every kernel launched), where the
#    machine has it;
# then one summary table. Each step has its own time limit; all of it stays well under 10 min.
#
# Without a GPU it says so, checks that the bundle's programs start here (each says why it skips
# the GPU), and exits 0. On a GPU machine it exits 1 if any step failed or skipped the GPU.
#
# REHEARSE=1 runs the GPU machine's steps here, without a GPU, to try this script before the one
# lent run: the GPU programs say why they skip, the gateway's "cuda" runs use the CPU, and each
# gateway measurement lasts GW_DURATION (default 6s). It then exits 1 (steps skipped the GPU).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
cd "$HERE" || exit 1
cat BUILD 2>/dev/null

gpu=yes
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu="no nvidia-smi on this machine"
elif ! nvidia-smi -L >/dev/null 2>&1; then
  gpu="nvidia-smi finds no usable NVIDIA GPU"
fi
cuda_device=cuda
if [ "${REHEARSE:-0}" = 1 ]; then
  echo "rehearsal: the GPU machine's steps without a GPU ($gpu); the gateway's cuda runs use the CPU"
  gpu=rehearsal
  cuda_device=cpu
fi
if [ "$gpu" = yes ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv,noheader
fi

# shellcheck source=scripts/gpu/cuda-libs.sh
source ./cuda-libs.sh
cuda_libs_on_path

PAYLOAD=$(mktemp -d)
trap 'rm -rf "$PAYLOAD"' EXIT
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
  payload.tar.xz "$PAYLOAD" || { echo "cannot unpack payload.tar.xz"; exit 1; }
BIN=$PAYLOAD/bin
export MODEL_DIR="$PAYLOAD/model"
python3 planes.py join "$MODEL_DIR/model.planes" "$MODEL_DIR/model.safetensors" &&
  rm "$MODEL_DIR/model.planes" || { echo "cannot rebuild the model's weights"; exit 1; }

names=() results=()
# step NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, record how it
# ended: ok, failed (exit code), timed out, or skipped (a program said why it did not use a GPU).
# A step never runs past DEADLINE_S seconds after the start (default 540, inside one 600 s call):
# its limit is cut to what is left, and with under 10 s left it is not run.
START=$SECONDS
DEADLINE_S=${DEADLINE_S:-540}
step() {
  local name=$1 limit=$2 rc
  shift 2
  local left=$((DEADLINE_S - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then
    names+=("$name")
    results+=("not run: the ${DEADLINE_S} s deadline was reached")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo
  echo "== $name"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local result=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    result="timed out after ${limit} s"
  elif [ "$rc" != 0 ]; then
    result="failed (exit $rc)"
  elif grep -q 'skipped: ' "$OUT/$name.log"; then
    result="skipped: $(grep -m1 -o 'skipped: .*' "$OUT/$name.log" | cut -c10- | cut -c1-160)"
  fi
  names+=("$name")
  results+=("$result")
}

if [ "$gpu" != yes ] && [ "$gpu" != rehearsal ]; then
  echo "no GPU here ($gpu): the CUDA path is not checked. Checking that the bundle's programs"
  echo "start on this machine instead."
  # The unit tests need no GPU; their NVRTC test compiles the kernels where NVRTC is found.
  step unit 120 "$BIN/embedder_unit" cuda:: --test-threads=1 --nocapture
  step parity-start 120 "$BIN/gpu_parity" --test-threads=1 --nocapture
  step vectors-start 120 "$BIN/gpu_embed" "$MODEL_DIR" parity-texts.json "$OUT/vectors.json"
  step bench-start 60 "$BIN/gpu_bench" "$MODEL_DIR"
  if [ -x "$BIN/gw/gateway" ]; then
    step gateway-start 30 "$BIN/gw/gateway" --version
  fi
  echo
  for i in "${!names[@]}"; do
    echo "${names[$i]}: ${results[$i]}"
    case "${results[$i]}" in ok | skipped*) ;; *) exit 1 ;; esac
  done
  echo "no GPU: nothing verified on hardware; the bundle's programs run. Exit 0."
  exit 0
fi

# Each step has its limit, and all of them together the deadline above; expected in all: about
# 3 minutes, 6 with the gateway's steps.
step unit 60 "$BIN/embedder_unit" cuda:: --test-threads=1 --nocapture
step parity 150 "$BIN/gpu_parity" --test-threads=1 --nocapture
step vectors 60 "$BIN/gpu_embed" "$MODEL_DIR" parity-texts.json "$OUT/vectors.json"
step bench 150 "$BIN/gpu_bench" "$MODEL_DIR"
step sentence-transformers 150 python3 st_parity.py "$OUT/vectors.json" "$MODEL_DIR"

if [ -x "$BIN/gw/gateway" ] && [ -f "$PAYLOAD/questions.jsonl" ]; then
  step distill 120 "$BIN/gw/gateway" embed distill --model "$MODEL_DIR"
  # gateway_run NAME CONNS PORT_BASE MODES DEVICE: one bench/cache-throughput.sh run, misses only.
  gateway_run() {
    step "$1" 100 env PATH="$BIN/tools:$PATH" LD_LIBRARY_PATH="$BIN/tools:${LD_LIBRARY_PATH:-}" \
      BIN="$BIN/gw" MODEL="$MODEL_DIR" PAIRS="$PAYLOAD/questions.jsonl" UPSTREAM=min SUFFIX=0 \
      REPEAT=0 CONNS="$2" DURATION="${GW_DURATION:-6s}" P_UP="$3"1 P_OFF="$3"2 P_EXACT="$3"3 P_SEM="$3"4 \
      MODES="$4" SEMANTIC_TOML="device = \"$5\"" GATEWAY_LOG=info NO_COLOR=1 ../bench/cache-throughput.sh
  }
  gateway_run gateway-gpu-c1 1 1930 "off exact semantic" "$cuda_device"
  gateway_run gateway-gpu-c16 16 1931 "exact semantic" "$cuda_device"
  gateway_run gateway-cpu-c1 1 1932 semantic cpu
  gateway_run gateway-cpu-c16 16 1933 semantic cpu
fi
sanitizer=$(command -v compute-sanitizer ||
  ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  step memcheck 120 "$sanitizer" --tool memcheck --error-exitcode 1 \
    "$BIN/gpu_parity" --test-threads=1
fi

echo
echo "## GPU bundle: summary"
echo
echo "| check | result |"
echo "|---|---|"
for i in "${!names[@]}"; do
  echo "| ${names[$i]} | ${results[$i]} |"
done
grep -h -E 'worst sentence cosine|searches agree|GPU vs CPU' "$OUT/parity.log" 2>/dev/null |
  sed -e 's/^/| parity detail | /' -e 's/$/ |/'
grep -h -E '^\| our ' "$OUT/sentence-transformers.log" 2>/dev/null
echo
grep -h -E '^\|' "$OUT/bench.log" 2>/dev/null
for f in "$OUT"/gateway-*.log; do
  [ -f "$f" ] || continue
  echo
  echo "$(basename "$f" .log): $(grep -h -E '^connections ' "$f")"
  grep -h -E 'semantic cache ready|semantic cache off' "$f" | head -1 | cut -c1-200
  grep -h -E '^\|' "$f"
done
status=0
for r in "${results[@]}"; do
  [ "$r" = ok ] || status=1
done
exit $status
