"""A retry storm through the gateway, driven by the official `openai` SDK.

CLIENTS threads each send chat completions in a loop for DURATION seconds with the SDK's own
retry behaviour (MAX_RETRIES, TIMEOUT seconds per attempt), while the simulators behind the
gateway go through fault PHASES (their own schedules, counted from about the start of this
script). Prints one human-readable summary and, last, one JSON line:

  requests, answered, failed      distinct client calls (each with its SDK retries)
  upstream                        requests the simulators received (GET /sim/stats)
  amplification                   upstream / requests
  share                           per half second, the share of the calls begun then that were
                                  answered (after the SDK's retries)
  recovered                       per phase: seconds after it ended until the calls begun were
                                  answered at 95% again for a whole second (null: not in the run)
  opened                          per phase: replica -> seconds after it began until its
                                  breaker was first seen open (admin API, every 100 ms)

Used by tests/tests/storm.rs (in the suite) and bench/storm.sh (the longer benchmark).

Environment: GATEWAY_BASE_URL (…/v1), GATEWAY_API_KEY, GATEWAY_ADMIN_URL (…/admin/v1),
GATEWAY_ADMIN_TOKEN, SIM_ROOTS (space-separated simulator root URLs), DURATION, CLIENTS,
MAX_RETRIES, TIMEOUT, PHASES (JSON: [[label, start_s, end_s], ...]), SETTLE (seconds to wait
for late answers before reading the simulators' counters), SIM_SCHEDULES (JSON: {root: [window,
...]}, each simulator's fault schedule, posted to its `/sim/faults` at the start so the phases
count from the same moment as this script).
"""

import json
import os
import threading
import time
import urllib.request

from openai import OpenAI

base = os.environ["GATEWAY_BASE_URL"]
key = os.environ["GATEWAY_API_KEY"]
admin_url = os.environ["GATEWAY_ADMIN_URL"]
admin_token = os.environ["GATEWAY_ADMIN_TOKEN"]
sims = os.environ["SIM_ROOTS"].split()
duration = float(os.environ.get("DURATION", "36"))
clients = int(os.environ.get("CLIENTS", "50"))
max_retries = int(os.environ.get("MAX_RETRIES", "2"))
timeout = float(os.environ.get("TIMEOUT", "2"))
phases = json.loads(os.environ.get("PHASES", "[]"))
settle = float(os.environ.get("SETTLE", "6"))

for root, schedule in json.loads(os.environ.get("SIM_SCHEDULES", "{}")).items():
    req = urllib.request.Request(
        f"{root}/sim/faults",
        data=json.dumps({"schedule": schedule}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).read()

start = time.time()
lock = threading.Lock()
outcomes = []  # (seconds since start when the call began, answered in the end)
opened = []  # (replica, seconds since start) each time its breaker left "closed"


def watch():
    state = {}
    while time.time() - start < duration:
        try:
            req = urllib.request.Request(
                f"{admin_url}/replicas", headers={"Authorization": f"Bearer {admin_token}"}
            )
            with urllib.request.urlopen(req, timeout=2) as resp:
                for tier in json.load(resp)["data"]:
                    for rep in tier["replicas"]:
                        was = state.get(rep["name"], "closed")
                        if rep["breaker"] != "closed" and was == "closed":
                            opened.append((rep["name"], time.time() - start))
                        state[rep["name"]] = rep["breaker"]
        except Exception:
            pass
        time.sleep(0.1)


def worker(i):
    client = OpenAI(base_url=base, api_key=key, timeout=timeout, max_retries=max_retries)
    n = 0
    while time.time() - start < duration:
        n += 1
        began = time.time() - start
        try:
            client.chat.completions.create(
                model="fast",
                max_tokens=8,
                messages=[{"role": "user", "content": f"client {i} question {n}"}],
            )
            ok = True
        except Exception:
            ok = False
        with lock:
            outcomes.append((began, ok))


threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
watcher = threading.Thread(target=watch)
watcher.start()
for t in threads:
    t.start()
for t in threads:
    t.join()
watcher.join()
time.sleep(settle)  # late answers of a slow phase reach the simulators' counters

upstream = 0
for root in sims:
    with urllib.request.urlopen(f"{root}/sim/stats") as r:
        upstream += json.load(r)["requests"]
requests = len(outcomes)
answered = sum(1 for _, ok in outcomes if ok)
amplification = upstream / max(requests, 1)

step = 0.5
buckets = {}
for t, ok in outcomes:
    b = buckets.setdefault(int(t / step), [0, 0])
    b[0] += 1
    b[1] += ok
last = int(duration / step)
share = [round(buckets[k][1] / buckets[k][0], 3) if k in buckets else None for k in range(last)]


def back_at(end):
    """Seconds after `end` until the answered share is >= 0.95 for two half seconds running."""
    for k in range(int(end / step), last - 1):
        pair = [share[k], share[k + 1]]
        if all(v is not None and v >= 0.95 for v in pair):
            return round(k * step - end, 1)
    return None


recovered = {label: back_at(end) for label, _, end in phases}
first_open = {}
for label, begin, _ in phases:
    seen = {}
    for rep, t in opened:
        if t >= begin and rep not in seen:
            seen[rep] = round(t - begin, 1)
    first_open[label] = seen

print(
    f"{requests} client requests ({answered} answered, {requests - answered} failed after the "
    f"SDK's retries), {upstream} upstream requests, amplification {amplification:.2f}"
)
print("answered share of the calls begun per half second: " + " ".join("-" if v is None else f"{v:.2f}" for v in share))
for label, begin, end in phases:
    rec = recovered[label]
    rec = f"{rec} s" if rec is not None else "not within the run"
    print(
        f"{label} ({begin}-{end} s): breakers seen opening {first_open[label] or 'none'} after it "
        f"began; answered share back at 95% {rec} after it ended"
    )
print(
    json.dumps(
        {
            "requests": requests,
            "answered": answered,
            "failed": requests - answered,
            "upstream": upstream,
            "amplification": amplification,
            "share": share,
            "recovered": recovered,
            "opened": first_open,
        }
    )
)
