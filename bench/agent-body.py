#!/usr/bin/env python3
"""Write an agent's chat request as it resends its history: the longest progressing fixture
(tests/fixtures/agent-sessions/progressing/swe-paging-through-big-file.json, a coding agent
paging through a big file), its first 60 messages up to the last non-assistant one, model
`fast`: 22 messages, ~80 KB. For bench/ab-min.sh's BODY_FILE.

    python3 bench/agent-body.py > /tmp/agent-body.json
"""
import json
import pathlib

fixture = pathlib.Path(__file__).resolve().parent.parent / (
    "tests/fixtures/agent-sessions/progressing/swe-paging-through-big-file.json")
messages = json.loads(fixture.read_text())["messages"][:60]
while messages and messages[-1]["role"] == "assistant":
    messages.pop()
print(json.dumps({"model": "fast", "messages": messages, "max_tokens": 16}))
