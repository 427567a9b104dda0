#!/usr/bin/env bash
# What a semantic miss costs at one connection, per request (issue 19, item 3): one gateway
# with the semantic layer on in front of the minimal upstream, N new questions sent one after
# another into one namespace by a sequential client that reads the gateway's gated-lookup counter
# after each request, so each latency is known to be a lookup the first stage decided (gated) or
# one the transformer ran for (the rest). Prints both groups' percentiles and the counters.
#
#   BIN=DIR STAGE='gate_student = 0.45' N=700 bench/semantic-c1.sh
#
# STAGE: lines for [cache.semantic] (default the learned first stage at 0.45; e.g.
# 'gate_overlap = 0.15', or 'nice = 0'). QUESTIONS: a JSONL file of {"a": question} (default the
# `a` side of ../shared/data/qqp-dev.jsonl). GAP_MS: the client waits this long after each
# answer (default 0): with the minimal upstream answering at once, answers to index pile up
# behind the lookups the first stage decides, and a lookup's pass takes the newest of them
# along; a gap of a few passes lets each answer be indexed first, as a real model server's
# answer time does. Needs python3, the model (scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-gate_student = 0.45}
N=${N:-700}
QUESTIONS=${QUESTIONS:-../shared/data/qqp-dev.jsonl}
P_UP=${P_UP:-19401}
P_GW=${P_GW:-19402}
. bench/common.sh

start_semantic c1 "$P_UP" "$P_GW" "$STAGE"
KEY=$(cat "$WORK/c1.key") python3 - "$P_GW" "$QUESTIONS" "$N" "${GAP_MS:-0}" <<'PY'
import http.client, json, os, re, sys, time
port, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
gap = float(sys.argv[4]) / 1000
seen, questions = set(), []
for line in open(path):
    q = json.loads(line)["a"].replace("\n", " ").strip()
    if q and q not in seen:
        seen.add(q)
        questions.append(q)
questions = questions[:n]
key = os.environ["KEY"]
api, scrape = http.client.HTTPConnection("127.0.0.1", port), http.client.HTTPConnection("127.0.0.1", port)

def counters():
    scrape.request("GET", "/metrics")
    text = scrape.getresponse().read().decode()
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r'gateway_cache_lookups_total\{layer="semantic",result="(\w+)"\} (\d+)', text)}

groups = {"gated": [], "the rest": []}
before = counters().get("gated", 0)
for q in questions:
    body = json.dumps({"model": "fast", "messages": [{"role": "user", "content": q}],
                       "max_tokens": 16, "temperature": 0})
    t = time.perf_counter()
    api.request("POST", "/v1/chat/completions", body,
                {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    r = api.getresponse()
    r.read()
    ms = (time.perf_counter() - t) * 1000
    assert r.status == 200, r.status
    now = counters().get("gated", 0)
    groups["gated" if now > before else "the rest"].append(ms)
    before = now
    time.sleep(gap)
print(f"| requests | count | p10 ms | p50 ms | p90 ms | max ms |\n|---|---|---|---|---|---|")
for name, v in groups.items():
    v.sort()
    if v:
        k = len(v)
        print(f"| {name} | {k} | {v[k // 10]:.2f} | {v[k // 2]:.2f} | {v[9 * k // 10]:.2f} | {v[-1]:.2f} |")
print("counters:", counters())
PY
