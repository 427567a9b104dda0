#!/usr/bin/env bash
# A paraphrase sent right after its answer, behind answers still waiting to be indexed (issue 19,
# item 3): one gateway with the learned first stage in front of the minimal upstream, one
# connection. Each of TRIALS trials sends BEFORE new questions (most decided by the first stage,
# so their answers queue to be embedded), then one question of a QQP duplicate pair and, right
# after its answer, the pair's other question; prints how many of those hit. BEFORE=0 is the
# ceiling (no answers waiting). BETWEEN=N sends N more new questions between the question and
# its paraphrase (as other clients' answers would land in between at more than one connection),
# so the answer the paraphrase matches is no longer the newest waiting.
#
#   BIN=DIR BEFORE=12 TRIALS=60 bench/semantic-backlog.sh
#   BIN=DIR BEFORE=12 BETWEEN=2 TRIALS=60 bench/semantic-backlog.sh
#
# Needs python3, the model (scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
P_UP=${P_UP:-19601}
P_GW=${P_GW:-19602}
BEFORE=${BEFORE:-12}
TRIALS=${TRIALS:-60}
BETWEEN=${BETWEEN:-0}
. bench/common.sh
start_semantic bl "$P_UP" "$P_GW" "gate_student = 0.45"
KEY=$(cat "$WORK/bl.key") python3 - "$P_GW" "$BEFORE" "$TRIALS" "$BETWEEN" <<'PY'
import http.client, json, os, sys, random
port, before, trials, between = (int(a) for a in sys.argv[1:5])
key = os.environ["KEY"]
rows = [json.loads(l) for l in open("../shared/data/qqp-dev.jsonl")]
dups = [r for r in rows if r["duplicate"]]
others = [r["a"] for r in rows if not r["duplicate"]]
rng = random.Random(5); rng.shuffle(dups); rng.shuffle(others)
conn = http.client.HTTPConnection("127.0.0.1", port)
def ask(q):
    body = json.dumps({"model": "fast", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": q}]})
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    return r.getheader("x-gateway-cache")
hits = k = 0
for t in range(trials):
    for _ in range(before):
        ask(others[k]); k += 1
    d = dups[t]
    ask(d["a"])
    for _ in range(between):
        ask(others[k]); k += 1
    if ask(d["b"]) == "hit-semantic":
        hits += 1
print(f"paraphrase {between} questions after its answer, behind {before} new questions: {hits}/{trials} hit")
PY
