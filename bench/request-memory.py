#!/usr/bin/env python3
"""Peak memory of the gateway per large request: six concurrent requests of one shape, the
gateway's VmHWM over its idle RSS, divided by six and by the body size.

    cargo build --release -p gateway --bins
    BIN=$CARGO_TARGET_DIR/release bench/request-memory.py string    # one 4 MiB message
    BIN=$CARGO_TARGET_DIR/release bench/request-memory.py messages  # 16,000 small messages

The gateway runs its embedded default with a day budget (so every prompt is counted), the cache
off, in front of the zero-latency simulator.
"""
import json, os, subprocess, sys, tempfile, threading, time, urllib.request

BIN = os.environ.get("BIN", os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release"))
UP, GW = 19301, 19302
ADMIN = "bench-admin-token-123456"
work = tempfile.mkdtemp()
env = dict(os.environ, RUST_LOG="warn", GATEWAY_ADMIN_TOKEN=ADMIN)
sim = subprocess.Popen([f"{BIN}/gateway", "simulate", "--profile", "zero", "--model", "sim-small",
                        "--port", str(UP)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(f"{work}/g.toml", "w") as f:
    f.write(f'''
[server]
listen = "127.0.0.1:{GW}"
max_body_bytes = 8388608
[store]
url = "sqlite://{work}/g.db"
[admin]
token = "{ADMIN}"
[ledger]
spool_dir = "{work}/spool"
[cache]
mode = "off"
[models]
fast = "small"
[[tiers.small.replicas]]
name = "s"
url = "http://127.0.0.1:{UP}/v1"
model = "sim-small"
[[tiers.large.replicas]]
name = "l"
url = "http://127.0.0.1:{UP}/v1"
model = "sim-small"
''')
gw = subprocess.Popen([f"{BIN}/gateway", "serve", "--config", f"{work}/g.toml"], env=env,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    time.sleep(1.5)
    ctl = lambda *a: subprocess.run([f"{BIN}/gatewayctl", "--url", f"http://127.0.0.1:{GW}", *a],
                                    env=env, capture_output=True, text=True, check=True).stdout
    ctl("tenants", "create", "m")
    key = json.loads(ctl("--json", "keys", "create", "--tenant", "m"))["key"]
    ctl("budgets", "set", "--tenant", "m", "--window", "day", "--tokens", "1000000000")

    def kib(field):
        for line in open(f"/proc/{gw.pid}/status"):
            if line.startswith(field):
                return int(line.split()[1])

    kind = sys.argv[1] if len(sys.argv) > 1 else "string"
    if kind == "string":
        messages = [{"role": "user", "content": "x " * (2 * 1024 * 1024 - 100)}]
    else:
        messages = [{"role": "user", "content": "hi " * 40}] * 16000
    data = json.dumps({"model": "fast", "max_tokens": 16, "messages": messages}).encode()
    statuses = []

    def send():
        req = urllib.request.Request(f"http://127.0.0.1:{GW}/v1/chat/completions", data=data,
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"})
        try:
            statuses.append(urllib.request.urlopen(req).status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)

    idle = kib("VmRSS")
    threads = [threading.Thread(target=send) for _ in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    peak = kib("VmHWM")
    mib = len(data) / 1048576
    print(f"{kind}: body {mib:.2f} MiB, statuses {statuses}, idle {idle/1024:.0f} MiB, "
          f"peak {peak/1024:.0f} MiB: {(peak - idle) / 1024 / 6 / mib:.1f}x the body per request")
finally:
    gw.kill()
    sim.kill()
