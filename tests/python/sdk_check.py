"""Drive a running gateway with the official `openai` Python SDK.

Usage: GATEWAY_BASE_URL=http://127.0.0.1:PORT/v1 GATEWAY_API_KEY=sk-gw-... python3 sdk_check.py
Exits non-zero (with a message) on the first failed check.
"""
import os
import sys

import openai
from openai import OpenAI

base = os.environ["GATEWAY_BASE_URL"]
key = os.environ["GATEWAY_API_KEY"]
client = OpenAI(base_url=base, api_key=key, max_retries=0)

# Chat, non-streaming.
r = client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
assert r.choices[0].message.content, r
assert r.usage.completion_tokens == 5, r.usage

# Chat, streaming, with and without the usage chunk.
text, usage = "", None
for chunk in client.chat.completions.create(
    model="smart", stream=True, stream_options={"include_usage": True},
    messages=[{"role": "user", "content": "Stream"}], max_tokens=4,
):
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
assert text, "streamed text"
assert usage is not None and usage.completion_tokens == 4, usage
chunks = list(client.chat.completions.create(model="fast", stream=True, messages=[{"role": "user", "content": "x"}], max_tokens=3))
assert all(c.usage is None for c in chunks), "no usage chunk unless asked"

# The cache: a temperature-0 repeat is answered from it, buffered and replayed as a stream.
ask = dict(model="fast", temperature=0, max_tokens=6, messages=[{"role": "user", "content": "Cache me"}])
raw = client.chat.completions.with_raw_response.create(**ask)
assert raw.headers.get("x-gateway-cache") == "miss", raw.headers
first = raw.parse().choices[0].message.content
raw = client.chat.completions.with_raw_response.create(**ask)
assert raw.headers.get("x-gateway-cache") == "hit-exact", raw.headers
assert raw.parse().choices[0].message.content == first
replayed = "".join(
    c.choices[0].delta.content or ""
    for c in client.chat.completions.create(stream=True, **ask)
    if c.choices
)
assert replayed == first, (replayed, first)

# Completions, embeddings, models.
c = client.completions.create(model="fast", prompt="Once upon", max_tokens=3)
assert c.choices[0].text
e = client.embeddings.create(model="fast", input=["a", "b"])
assert len(e.data) == 2 and len(e.data[0].embedding) > 0
ids = [m.id for m in client.models.list().data]
assert {"fast", "smart", "auto"} <= set(ids), ids

# A bad key raises the SDK's AuthenticationError; an unknown model, NotFoundError.
try:
    OpenAI(base_url=base, api_key="sk-gw-not-a-real-key", max_retries=0).models.list()
    sys.exit("expected AuthenticationError")
except openai.AuthenticationError:
    pass
try:
    client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    sys.exit("expected NotFoundError")
except openai.NotFoundError:
    pass
try:
    client.chat.completions.create(model="fast", messages=[{"role": "wizard", "content": "x"}])
    sys.exit("expected BadRequestError")
except openai.BadRequestError as err:
    assert "messages[0].role" in str(err), err

print("python sdk: all checks passed")
