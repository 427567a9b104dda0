#!/usr/bin/env python3
"""Could a cheap first stage spare the transformer on semantic-cache misses (issue 19, item 3)?

A miss costs one transformer embedding of the question (~13-18 ms for 32 tokens on this 2-core
CPU, close to its arithmetic floor), because only then can the index be searched. A first stage
that says "no stored question can be a hit" from cheap features would skip it. This measures,
on the dev pairs, how far the cheap signals separate the pairs the cache would answer from
unrelated questions in the same namespace:

- the static embedding's cosine (the table distilled from the model; mean of token rows), raw
  and mean-centred, as the 128-byte sketch the loop detector uses (random +-1 projection, int8);
- IDF-weighted Jaccard overlap of the two texts' model tokens.

"Likely hits" are the duplicates in the top 40% of their source by transformer cosine (the
verifier answers about that share of QQP duplicates at precision 0.90). The selectivity is the
share of questions that find at least one of 2,500 other QQP questions above the threshold (one
namespace of distinct, varied questions, as in the benchmark).

    python3 bench/semantic-prefilter.py sample PAIRS... > /tmp/sample-pairs.jsonl
    cargo run --release -p embedder --example dump_pair_vectors -- /tmp/sample-pairs.jsonl /tmp/sample
    python3 bench/semantic-prefilter.py analyse /tmp/sample-pairs.jsonl /tmp/sample

The token-overlap gate against the shipped verifier's own hits (`gate`; the sample there is the
one above plus every cai-prompts pair, 5,326 pairs; `pair_scores` takes ~3 min):

    cargo run --release -p embedder --example pair_scores -- /tmp/sample-pairs.jsonl > /tmp/scores.jsonl
    python3 bench/semantic-prefilter.py gate /tmp/scores.jsonl embedder/assets/verifier.json

Needs numpy. The sample: 2,500 pairs of ../shared/data/qqp-dev.jsonl and 2,500 of
../shared/data/pairs-dev.jsonl, seed 7.
"""
import json
import random
import sys
from collections import Counter

QUERIES = 2500


def sample(paths):
    random.seed(7)
    out = []
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        out += random.sample(rows, 2500)
    for r in out:
        print(json.dumps({"a": r["a"], "b": r["b"], "duplicate": r["duplicate"],
                          "source": r.get("source", "qqp")}))


def analyse(pairs_path, prefix):
    import numpy as np

    rows = [json.loads(line) for line in open(pairs_path)]
    n = len(rows)

    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-9)

    transformer = unit(np.fromfile(f"{prefix}.f32", dtype="<f4").reshape(n, 2, 384))
    static = np.fromfile(f"{prefix}.static.f32", dtype="<f4").reshape(n, 2, 384)
    ids = [set(json.loads(line)) for line in open(f"{prefix}.ids.jsonl")]
    dup = np.array([r["duplicate"] for r in rows])
    src = np.array([r["source"] for r in rows])
    tc = (transformer[:, 0] * transformer[:, 1]).sum(-1)
    qqp = np.flatnonzero(src == "qqp")[:QUERIES]

    projection = np.random.default_rng(1).choice([-1.0, 1.0], size=(384, 128))

    def sketch(x):
        y = x @ projection
        q = np.round(y / np.maximum(np.abs(y).max(-1, keepdims=True), 1e-9) * 127)
        return unit(q)

    df = Counter(t for s in ids for t in s)

    def weight(t):
        return np.log(len(ids) / (1 + df[t]))

    def jaccard(a, b):
        union = sum(weight(t) for t in a | b)
        return sum(weight(t) for t in a & b) / union if union else 0.0

    likely = np.zeros(n, dtype=bool)
    for s in sorted(set(src)):
        m = dup & (src == s)
        if m.sum() >= 5:
            likely |= m & (tc >= np.quantile(tc[m], 0.6))

    signals = {
        "static sketch cosine": sketch(unit(static)),
        "static sketch cosine, mean-centred": sketch(unit(static - static.reshape(-1, 384).mean(0))),
    }
    print("| signal | source | likely hits | kept at 1% / 2% / 5% loss (threshold) |")
    print("|---|---|---|---|")
    thresholds = {}
    for name, k in signals.items():
        cos = (k[:, 0] * k[:, 1]).sum(-1)
        for s in sorted(set(src)):
            m = likely & (src == s)
            if m.sum() < 5:
                continue
            q = np.quantile(cos[m], [0.01, 0.02, 0.05])
            print(f"| {name} | {s} | {m.sum()} | {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} |")
        a = k[qqp, 0]
        sims = a @ a.T
        np.fill_diagonal(sims, -1)
        thresholds[name] = sims.max(1)
    jac = np.array([jaccard(ids[2 * i], ids[2 * i + 1]) for i in range(n)])
    for s in sorted(set(src)):
        m = likely & (src == s)
        if m.sum() >= 5:
            q = np.quantile(jac[m], [0.01, 0.02, 0.05])
            print(f"| IDF Jaccard of tokens | {s} | {m.sum()} | {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} |")
    sets = [ids[2 * i] for i in qqp]
    thresholds["IDF Jaccard of tokens"] = np.array(
        [max(jaccard(sets[i], sets[j]) for j in range(len(sets)) if j != i) for i in range(300)])
    print()
    print(f"Share of questions with a candidate among {QUERIES} other QQP questions:")
    print()
    print("| signal | " + " | ".join(f"t = {t}" for t in (0.3, 0.4, 0.5, 0.6, 0.7)) + " |")
    print("|---|---|---|---|---|---|")
    for name, best in thresholds.items():
        cells = " | ".join(f"{np.mean(best >= t):.2f}" for t in (0.3, 0.4, 0.5, 0.6, 0.7))
        print(f"| {name} | {cells} |")


def gate(scores_path, verifier_path):
    """How many of the shipped verifier's own hits a token-overlap gate keeps, per source and
    precision setting, and how many questions of a varied namespace it still sends on."""
    import numpy as np

    rows = [json.loads(line) for line in open(scores_path)]
    verifier = json.load(open(verifier_path))
    idf_df, docs = verifier["stats"]["idf"]["df"], verifier["stats"]["idf"]["docs"]

    def weight(t):
        d = idf_df[t] if t < len(idf_df) else 0
        return np.log((docs + 1) / (d + 1))

    def jaccard(a, b):
        a, b = set(a), set(b)
        union = sum(weight(t) for t in a | b)
        return sum(weight(t) for t in a & b) / union if union else 0.0

    def lowest(target):
        pts = [p for p in verifier["curve"] if p["precision"] >= target and p["recall"] > 0]
        return min(p["threshold"] for p in pts)

    settings = [(m, lowest(m)) for m in (0.80, 0.85, 0.90)]
    src = np.array([r["source"] for r in rows])
    p = np.array([r["p"] for r in rows])
    # A stored question is handed to the verifier only above `cache.semantic.min_cosine`.
    p[np.array([r["cos"] for r in rows]) < 0.7] = 0.0
    dup = np.array([bool(r["duplicate"]) for r in rows])
    jac = np.array([jaccard(r["ids_a"], r["ids_b"]) for r in rows])
    gates = (0.1, 0.15, 0.2, 0.25, 0.3)
    print("Verifier hits (true / false; transformer cosine >= 0.7 and probability >= the setting's")
    print("threshold) and the share of the true ones a gate at IDF Jaccard >= t keeps / the false ones left:")
    print()
    print("| source | min precision | hits true / false | " + " | ".join(f"t = {t}" for t in gates) + " |")
    print("|---|---|---|" + "---|" * len(gates))
    for s in sorted(set(src)):
        for m, thr in settings:
            hit = (src == s) & (p >= thr)
            if not hit.any():
                continue
            tp, fp = (hit & dup).sum(), (hit & ~dup).sum()
            cells = " | ".join(
                f"{(hit & dup & (jac >= t)).sum() / max(tp, 1):.3f} / {(hit & ~dup & (jac >= t)).sum()}"
                for t in gates)
            print(f"| {s} | {m:.2f} (p >= {thr:.3f}) | {tp} / {fp} | {cells} |")
    # Selectivity: one namespace of varied questions (the QQP `a` sides).
    texts = [r["ids_a"] for r in rows if r["source"] == "qqp"][:QUERIES]
    vocab = sorted({t for x in texts for t in x})
    col = {t: i for i, t in enumerate(vocab)}
    w = np.array([weight(t) for t in vocab])
    inc = np.zeros((len(texts), len(vocab)))
    for i, x in enumerate(texts):
        for t in set(x):
            inc[i, col[t]] = 1.0
    inter = (inc * w) @ inc.T
    total = inc @ w
    jm = inter / np.maximum(total[:, None] + total[None, :] - inter, 1e-9)
    np.fill_diagonal(jm, 0)
    best = jm.max(1)
    print()
    for size in (100, 500, 1000, len(texts)):
        sub = jm[:size, :size].max(1)
        print(f"namespace of {size} QQP questions: share with a candidate at " +
              ", ".join(f"t={t}: {np.mean(sub >= t):.2f}" for t in gates))
    _ = best


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(sys.argv[2:])
    elif sys.argv[1] == "gate":
        gate(sys.argv[2], sys.argv[3])
    else:
        analyse(sys.argv[2], sys.argv[3])
