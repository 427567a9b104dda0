#!/usr/bin/env bash
# Prefix-affinity replica choice against least-loaded, on SIMULATED batching model servers:
# three replicas of the small tier (`gateway simulate --profile PROFILE`, default large: at most
# MAX_RUNNING sequences at once, prefill 250 µs per uncached prompt token (60 with small), an LRU prefix cache of CACHE_BLOCKS 16-token blocks
# each), CLIENTS concurrent streaming clients, each working through conversations that share a
# long system prompt per family (FAMILIES families of ~2,000 tokens, TURNS turns each).
# Per choice it prints TTFT p50/p99 as the client sees it, requests per second, and the
# simulators' prefix-cache hit rate (cached prompt tokens / prompt tokens).
# GATEWAYS=3 runs three gateway processes sharing nothing, the clients spread over them.
#
#   BIN=/var/tmp/gw-target/debug bench/affinity.sh     # or let bench/common.sh build release
# Needs: python3 with openai (tests/python/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
CLIENTS=${CLIENTS:-24}
FAMILIES=${FAMILIES:-30}
TURNS=${TURNS:-6}
MAX_RUNNING=${MAX_RUNNING:-8}
CACHE_BLOCKS=${CACHE_BLOCKS:-1500}
GATEWAYS=${GATEWAYS:-1}
PROFILE=${PROFILE:-large}
SIM_PORTS=(19401 19402 19403)
GW_BASE=19410

run() {
  local choice=$1
  local sims=()
  for p in "${SIM_PORTS[@]}"; do
    "$SIM_BIN/gateway" simulate --profile "$PROFILE" --model sim-small --port "$p" --max-running "$MAX_RUNNING" \
      --cache-blocks "$CACHE_BLOCKS" >"$WORK/sim-$p.log" 2>&1 &
    sims+=($!)
    PIDS+=($!)
  done
  for p in "${SIM_PORTS[@]}"; do wait_port "$p"; done
  local gws=() ports=()
  for g in $(seq 1 "$GATEWAYS"); do
    local port=$((GW_BASE + g))
    affinity_toml "$port" "$WORK/gw-$choice.db" "$choice" "${SIM_PORTS[@]}" >"$WORK/gw-$g.toml"
    RUST_LOG=error "$BIN/gateway" serve --config "$WORK/gw-$g.toml" >"$WORK/gw-$g.log" 2>&1 &
    gws+=($!)
    PIDS+=($!)
    wait_port "$port"
    ports+=("$port")
  done
  local key
  key=$(bench_key "http://127.0.0.1:${ports[0]}")
  sleep 1 # every gateway has loaded the key
  python3 - "$key" "$choice" "$CLIENTS" "$FAMILIES" "$TURNS" "${ports[*]}" "${SIM_PORTS[*]}" <<'PY'
import asyncio, json, random, sys, time, urllib.request
from openai import AsyncOpenAI
key, choice, clients, families, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ports, sims = sys.argv[6].split(), sys.argv[7].split()
rng = random.Random(7)
words = "policy refund account invoice shipping warranty order customer plan upgrade".split()
systems = [f"You are the support assistant of company {f}. " + " ".join(rng.choice(words) for _ in range(1500))
           for f in range(families)]
jobs = [(f, c) for f in range(families) for c in range(2)]  # two conversations per family
rng.shuffle(jobs)
queue = asyncio.Queue()
for j in jobs: queue.put_nowait(j)
ttfts, done = [], 0
async def client(i):
    global done
    api = AsyncOpenAI(base_url=f"http://127.0.0.1:{ports[i % len(ports)]}/v1", api_key=key, max_retries=0)
    while not queue.empty():
        f, c = queue.get_nowait()
        messages = [{"role": "system", "content": systems[f]}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"conversation {c}, question {t}: " + " ".join(rng.choice(words) for _ in range(30))})
            start = time.perf_counter()
            first = None
            text = ""
            stream = await api.chat.completions.create(model="fast", messages=messages, stream=True, max_tokens=16)
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            ttfts.append(first or (time.perf_counter() - start))
            messages.append({"role": "assistant", "content": text})
            done += 1
async def main():
    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return time.perf_counter() - t0
elapsed = asyncio.run(main())
q = h = 0
for p in sims:
    with urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats") as r:
        s = json.load(r)
    q += s["prefix_cache_queries"]; h += s["prefix_cache_hits"]
ttfts.sort()
pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] * 1000
print(f"{choice:>18} x{len(ports)}: {done} requests in {elapsed:.1f} s ({done / elapsed:.1f} req/s), "
      f"TTFT p50 {pct(0.5):.0f} ms p99 {pct(0.99):.0f} ms, prefix-cache hit rate {h / max(q, 1):.3f}")
PY
  kill "${gws[@]}" "${sims[@]}" 2>/dev/null || true
  wait "${gws[@]}" "${sims[@]}" 2>/dev/null || true
  sleep 1
}

for choice in least_loaded affinity_gate affinity_weighted; do
  run "$choice"
done
