#!/usr/bin/env python3
"""Unlabelled real agent sessions for the loop detector's false-positive check.

Converts every public trajectory of two real agent benchmarks into the fixture format of
`tests/fixtures/agent-sessions/` (`messages` only, no label) under OUT, one file each:

* sierra-research/tau-bench `historical_trajectories/gpt-4o-airline.json` (200 gpt-4o
  customer-service runs with tools), and
* SWE-agent/mini-swe-agent `output/*/*.traj.json` (deepseek coding-agent runs: bash tool
  calls and their outputs), at the two commits the committed fixtures came from.

The same cleaning as `tests/fixtures/agent-sessions/adapt_real.py` (tool outputs clipped to
2,000 characters). Then replay them through the guard step:

    python3 bench/real-sessions.py --tau-bench DIR --mini-swe-agent DIR --out /tmp/real-sessions
    cargo run -p e2e --example guard_fixtures -- --exact-only --unlabelled /tmp/real-sessions

Each DIR is a git clone or a bare git directory (`fetch` gives the latter).
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "../tests/fixtures/agent-sessions"))
import adapt_real  # noqa: E402


def ls(repo, commit):
    out = subprocess.run(["git", "--git-dir", adapt_real.git_dir(repo), "ls-tree", "-r", "--name-only",
                          commit], check=True, stdout=subprocess.PIPE).stdout.decode()
    return out.split("\n")


WRITTEN = set()


def write(out, name, origin, messages):
    """Write one session and return its number of requests; None (nothing written) when the
    same transcript was written already (some runs are published twice under two names)."""
    key = adapt_real.json.dumps(messages, sort_keys=True)
    if key in WRITTEN:
        return None
    WRITTEN.add(key)
    path = os.path.join(out, name + ".json")
    with open(path, "w", encoding="utf-8") as f:
        adapt_real.json.dump({"name": name, "origin": origin, "messages": messages}, f,
                             ensure_ascii=False)
    return adapt_real.n_assistant(messages)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tau-bench")
    ap.add_argument("--mini-swe-agent")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sessions = requests = skipped = 0
    if a.tau_bench:
        p = "historical_trajectories/gpt-4o-airline.json"
        for e in adapt_real.git_show(a.tau_bench, adapt_real.TAU, p):
            m = adapt_real.clean_openai(e["traj"], clip_user_after=10 ** 9)
            name = f"tau-airline-task{e['task_id']}-trial{e['trial']}"
            n = write(a.out, name, f"sierra-research/tau-bench:{p}", m)
            sessions, requests = sessions + (n is not None), requests + (n or 0)
    if a.mini_swe_agent:
        seen = set()
        for commit in (adapt_real.MSWE_BENCH, adapt_real.MSWE_LITE):
            for p in ls(a.mini_swe_agent, commit):
                if not (p.startswith("output/") and p.endswith(".traj.json")):
                    continue
                run, task = p.split("/")[1], os.path.basename(p)[: -len(".traj.json")]
                name = f"mswe-{run}-{task}"
                if name in seen:
                    continue
                seen.add(name)
                try:
                    t = adapt_real.git_show(a.mini_swe_agent, commit, p)
                except subprocess.CalledProcessError:
                    skipped += 1  # a blob the copy lacks (a mirror may leave large files out)
                    continue
                m = adapt_real.clean_openai(t["messages"])
                n = write(a.out, name, f"SWE-agent/mini-swe-agent:{p}@{commit[:10]}", m)
                sessions, requests = sessions + (n is not None), requests + (n or 0)
    print(f"{sessions} sessions, {requests} requests, in {a.out} ({skipped} unreadable, skipped)")


if __name__ == "__main__":
    main()
