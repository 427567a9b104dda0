#!/usr/bin/env bash
# Prefix affinity under open-loop load, the shape issue 17 asks for: four SIMULATED batching
# replicas (large profile: prefill 250 µs per uncached token, decode 25 ms per token, at most 8
# sequences at once, an LRU prefix cache of CACHE_BLOCKS 16-token blocks each), 20 system prompts
# of 1-4k tokens, users arriving as a Poisson process and holding multi-turn conversations.
# First the tier's capacity is measured (closed loop, least-loaded); then each choice runs at 50%
# and 80% of it, against the same arrival sequence. Also: the prefix-cache hit rate of one
# infinitely large replica on the same requests (the reference), and a workload with no shared
# prefixes (least-loaded vs the default).
#
#   BIN=/var/tmp/gw-target/debug bench/affinity-load.sh
# Needs: python3 with openai (tests/python/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
DURATION=${DURATION:-30}
CACHE_BLOCKS=${CACHE_BLOCKS:-1200}
SIM_PORTS=(19501 19502 19503 19504)
P_GW=19510

# start_tier N CACHE_BLOCKS MAX_RUNNING: N simulators on SIM_PORTS; their pids in SIMS.
start_tier() {
  SIMS=()
  for i in $(seq 0 $(($1 - 1))); do
    "$SIM_BIN/gateway" simulate --profile large --model sim-small --port "${SIM_PORTS[$i]}" \
      --max-running "$3" --cache-blocks "$2" >"$WORK/sim-$i.log" 2>&1 &
    SIMS+=($!)
    PIDS+=($!)
  done
  for i in $(seq 0 $(($1 - 1))); do wait_port "${SIM_PORTS[$i]}"; done
}

# start_tier_gateway CHOICE N: a gateway in front of the first N simulators.
start_tier_gateway() {
  affinity_toml "$P_GW" "$WORK/gw-$1-$RANDOM.db" "$1" "${SIM_PORTS[@]:0:$2}" >"$WORK/gw.toml"
  RUST_LOG=error "$BIN/gateway" serve --config "$WORK/gw.toml" >"$WORK/gw.log" 2>&1 &
  GW=$!
  PIDS+=($GW)
  wait_port $P_GW
  KEY=$(bench_key "http://127.0.0.1:$P_GW")
}

# load MODE RATE LABEL SIM_COUNT: the Python load generator (MODE closed|open|unique).
load() {
  python3 - "$KEY" "$P_GW" "$1" "$2" "$DURATION" "$3" "${SIM_PORTS[*]:0:$4}" <<'PY'
import asyncio, json, random, sys, time, urllib.request
from openai import AsyncOpenAI
key, port, mode, rate, duration, label = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
sims = sys.argv[7].split()
rng = random.Random(11)
words = "policy refund account invoice shipping warranty order customer plan upgrade".split()
# 20 system prompts of 1-4k tokens (about one token per word here).
systems = [f"You are the assistant of product {f}. " + " ".join(rng.choice(words) for _ in range(rng.randint(1000, 4000)))
           for f in range(20)]
api = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
ttfts, done, failed = [], 0, 0
conversations = []  # open conversations: message lists
def next_request():
    if mode == "unique":
        return [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(2000)) + f" {rng.random()}"}]
    if conversations and rng.random() < 0.6:
        msgs = rng.choice(conversations)
        if len(msgs) > 13:
            conversations.remove(msgs)
            msgs = None
    else:
        msgs = None
    if msgs is None:
        msgs = [{"role": "system", "content": rng.choice(systems)}]
        conversations.append(msgs)
    msgs.append({"role": "user", "content": "question: " + " ".join(rng.choice(words) for _ in range(20))})
    return list(msgs)
async def one(messages):
    global done, failed
    start = time.perf_counter()
    first = None
    text = ""
    try:
        stream = await api.chat.completions.create(model="fast", messages=messages, stream=True, max_tokens=16)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text += chunk.choices[0].delta.content
        ttfts.append(first if first is not None else time.perf_counter() - start)
        done += 1
    except Exception:
        failed += 1
async def closed(clients):
    end = time.perf_counter() + duration
    async def worker():
        while time.perf_counter() < end:
            await one(next_request())
    await asyncio.gather(*(worker() for _ in range(clients)))
async def open_loop():
    end = time.perf_counter() + duration
    tasks = []
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one(next_request())))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
t0 = time.perf_counter()
if mode == "closed":
    asyncio.run(closed(int(rate)))
else:
    asyncio.run(open_loop())
elapsed = time.perf_counter() - t0
q = h = 0
for p in sims:
    with urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats") as r:
        s = json.load(r)
    q += s["prefix_cache_queries"]; h += s["prefix_cache_hits"]
ttfts.sort()
pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] * 1000 if ttfts else float("nan")
mean = sum(ttfts) / len(ttfts) * 1000 if ttfts else float("nan")
print(f"{label:>34}: {done / elapsed:6.1f} req/s ({failed} failed), TTFT mean {mean:6.0f} ms p95 {pct(0.95):6.0f} ms, "
      f"prefix-cache hit rate {h / max(q, 1):.3f}", flush=True)
if mode == "closed":
    print(f"CAPACITY {done / elapsed:.2f}")
PY
}

stop() { kill "$GW" "${SIMS[@]}" 2>/dev/null || true; wait "$GW" "${SIMS[@]}" 2>/dev/null || true; sleep 1; }

# Capacity: 48 closed-loop clients on least-loaded.
start_tier 4 "$CACHE_BLOCKS" 8
start_tier_gateway least_loaded 4
cap=$(load closed 48 "capacity (closed loop, least_loaded)" 4 | tee /dev/stderr | sed -n 's/^CAPACITY //p')
stop
for share in 0.5 0.8; do
  rate=$(python3 -c "print(round($cap * $share, 2))")
  for choice in least_loaded round_robin affinity_gate affinity_weighted; do
    start_tier 4 "$CACHE_BLOCKS" 8
    start_tier_gateway "$choice" 4
    load open "$rate" "$choice at ${share} (${rate} req/s)" 4
    stop
  done
  start_tier 1 100000000 1000000
  start_tier_gateway least_loaded 1
  load open "$rate" "one infinite replica at ${share}" 1
  stop
done
rate=$(python3 -c "print(round($cap * 0.5, 2))")
for choice in least_loaded affinity_weighted; do
  start_tier 4 "$CACHE_BLOCKS" 8
  start_tier_gateway "$choice" 4
  load unique "$rate" "no shared prefixes: $choice" 4
  stop
done
