#!/usr/bin/env python3
"""Reference embeddings for the embedder's parity tests.

Computes all-MiniLM-L6-v2 sentence embeddings exactly as sentence-transformers' pipeline for this
model does (modules.json: Transformer with max_seq_length 256 -> mean pooling over the attention
mask -> L2 normalisation), but in float64 NumPy straight from model.safetensors and
tokenizer.json, so it needs neither torch nor network access. Writes JSON fixtures:

    python3 scripts/embed-reference.py models/all-MiniLM-L6-v2 > embedder/tests/fixtures/minilm-reference.json

Needs: pip install numpy safetensors tokenizers
"""
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

TEXTS = [
    "What is the capital of France?",
    "Which city is the capital of France?",
    "How do I reset my password?",
    "How can I change my password?",
    "IIT JEE 2016 cutoff for general category",
    "IIT JEE 2017 cutoff for general category",
    "Is it safe to eat raw cookie dough?",
    "hello",
    "a",
    "",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Ünïcödé tèxt with accents, emoji 🚀 and CJK 漢字テスト",
    "Why doesn't my Rust code compile when I borrow `self` mutably twice?",
    "SELECT count(*) FROM ledger WHERE tenant_id = 'acme' AND started_at >= now() - interval '7 days'",
    # Longer than max_seq_length (256 tokens): truncated like sentence-transformers does.
    " ".join(f"word{i} is followed by another token" for i in range(80)),
]


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def embed(model_dir, texts):
    cfg = json.load(open(f"{model_dir}/config.json"))
    max_len = json.load(open(f"{model_dir}/sentence_bert_config.json"))["max_seq_length"]
    eps = cfg["layer_norm_eps"]
    heads = cfg["num_attention_heads"]
    w = {k: v.astype(np.float64) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok.enable_truncation(max_length=max_len)
    tok.no_padding()
    out = []
    for text in texts:
        enc = tok.encode(text)
        ids = np.array(enc.ids)
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][np.zeros(n, dtype=int)])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        d = x.shape[-1] // heads
        for layer in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{layer}."
            lin = lambda h, name: h @ w[p + name + ".weight"].T + w[p + name + ".bias"]
            q = lin(x, "attention.self.query").reshape(n, heads, d).transpose(1, 0, 2)
            k = lin(x, "attention.self.key").reshape(n, heads, d).transpose(1, 0, 2)
            v = lin(x, "attention.self.value").reshape(n, heads, d).transpose(1, 0, 2)
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            s = np.exp(s - s.max(-1, keepdims=True))
            s = s / s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(1, 0, 2).reshape(n, heads * d)
            x = layer_norm(x + lin(ctx, "attention.output.dense"),
                           w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"], eps)
            h = gelu(lin(x, "intermediate.dense"))
            x = layer_norm(x + lin(h, "output.dense"),
                           w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        pooled = x.mean(0)
        out.append({
            "text": text,
            "tokens": n,
            "embedding": [round(float(v), 8) for v in pooled / np.linalg.norm(pooled)],
        })
    return out


if __name__ == "__main__":
    model_dir = sys.argv[1] if len(sys.argv) > 1 else "models/all-MiniLM-L6-v2"
    json.dump({"model": "all-MiniLM-L6-v2", "max_seq_length": 256,
               "source": "scripts/embed-reference.py (float64 NumPy re-implementation of the "
                         "sentence-transformers pipeline)",
               "cases": embed(model_dir, TEXTS)}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
