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

The learned first stage (`cache.semantic.gate_student`): a linear map from the static table's
sentence vector to the transformer's, fitted by ridge regression (`student` prints the
held-out figures, each source scored by a map fitted without it; `fit` writes the shipped map,
fitted on every text, to embedder/assets/gate-student.bin). `sample --every-cai` is the sample
above plus every cai-prompts pair (the 5,326 pairs `gate` uses); `prompts` writes the routing
prompts as pairs, extra texts for the fit:

    python3 bench/semantic-prefilter.py sample --every-cai PAIRS... > /tmp/gate-pairs.jsonl
    python3 bench/semantic-prefilter.py prompts ../shared/data/routing-dev.jsonl > /tmp/gate-extra.jsonl
    cargo run --release -p embedder --example dump_pair_vectors -- /tmp/gate-pairs.jsonl /tmp/gp
    cargo run --release -p embedder --example dump_pair_vectors -- /tmp/gate-extra.jsonl /tmp/gx
    cargo run --release -p embedder --example pair_scores -- /tmp/gate-pairs.jsonl > /tmp/gs.jsonl
    python3 bench/semantic-prefilter.py student /tmp/gate-pairs.jsonl /tmp/gp /tmp/gx /tmp/gs.jsonl embedder/assets/verifier.json
    python3 bench/semantic-prefilter.py fit /tmp/gate-pairs.jsonl /tmp/gp /tmp/gx embedder/assets/gate-student.bin

`asym` prints `student`'s tables with each stored question's true transformer vector (placed in
the student space) instead of its student vector (tried, not shipped: docs/benchmarks.md,
"Thirty-third sitting"):

    python3 bench/semantic-prefilter.py asym /tmp/gate-pairs.jsonl /tmp/gp /tmp/gx /tmp/gs.jsonl embedder/assets/verifier.json

`metric` does the same for a map trained so that the student cosine of two texts tracks their
transformer cosine, instead of fitted to the vector (measured, not shipped; ~10 minutes):

    python3 bench/semantic-prefilter.py metric /tmp/gate-pairs.jsonl /tmp/gp /tmp/gx /tmp/gs.jsonl embedder/assets/verifier.json

`pooled` does the same for a map from the mean, max and min of the question's static token rows
(measured, not shipped):

    python3 bench/semantic-prefilter.py pooled /tmp/gate-pairs.jsonl /tmp/gp /tmp/gx /tmp/gs.jsonl embedder/assets/verifier.json models/all-MiniLM-L6-v2/static.bin

Needs numpy. The sample: 2,500 pairs of ../shared/data/qqp-dev.jsonl and 2,500 of
../shared/data/pairs-dev.jsonl, seed 7.
"""
import json
import random
import sys
from collections import Counter

QUERIES = 2500
# `cache.semantic.min_cosine`: a stored question is handed to the verifier only above it.
MIN_COSINE = 0.7


def verifier_threshold(verifier, target):
    """The verifier's lowest probability threshold reaching precision `target` on its curve."""
    return min(q["threshold"] for q in verifier["curve"]
               if q["precision"] >= target and q["recall"] > 0)


def true_hits(p, cos, dup, thr):
    """Pairs the shipped verifier answers (above the cosine floor and the threshold) that are
    labelled duplicates."""
    return (p >= thr) & (cos >= MIN_COSINE) & dup


def sample(paths):
    every_cai = "--every-cai" in paths
    paths = [p for p in paths if p != "--every-cai"]
    random.seed(7)
    out = []
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        out += random.sample(rows, 2500)
    if every_cai:
        seen = {(r["a"], r["b"]) for r in out}
        for path in paths:
            for line in open(path):
                r = json.loads(line)
                if r.get("source", "").startswith("cai") and (r["a"], r["b"]) not in seen:
                    out.append(r)
                    seen.add((r["a"], r["b"]))
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

    settings = [(m, verifier_threshold(verifier, m)) for m in (0.80, 0.85, 0.90)]
    src = np.array([r["source"] for r in rows])
    p = np.array([r["p"] for r in rows])
    # A stored question is handed to the verifier only above `cache.semantic.min_cosine`.
    p[np.array([r["cos"] for r in rows]) < MIN_COSINE] = 0.0
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


def prompts(path):
    """The routing prompts two by two as (unlabelled) pairs: more texts for the fit."""
    rows = [json.loads(line) for line in open(path)]
    for i in range(0, len(rows) - 1, 2):
        print(json.dumps({"a": rows[i]["prompt"], "b": rows[i + 1]["prompt"], "duplicate": False,
                          "source": "routing"}))


STUDENT_DIMS = 128
STUDENT_RIDGE = 0.01


def student_data(pairs_path, prefix, extra_prefix):
    import numpy as np

    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-9)

    rows = [json.loads(line) for line in open(pairs_path)]
    n = len(rows)
    teacher = unit(np.fromfile(f"{prefix}.f32", dtype="<f4").reshape(n, 2, 384).astype(np.float64))
    static = np.fromfile(f"{prefix}.static.f32", dtype="<f4").reshape(n, 2, 384).astype(np.float64)
    extra_t = unit(np.fromfile(f"{extra_prefix}.f32", dtype="<f4").reshape(-1, 384).astype(np.float64))
    extra_s = np.fromfile(f"{extra_prefix}.static.f32", dtype="<f4").reshape(-1, 384).astype(np.float64)
    src = np.array([r.get("source", "qqp").replace("-minedneg", "") for r in rows])
    return rows, teacher, static, extra_t, extra_s, src


def student_fit(static, teacher, with_basis=False):
    """Ridge regression from [static sentence vector, 1] to the transformer's vector, then the
    output reduced to its STUDENT_DIMS principal directions: a (385, STUDENT_DIMS) map (and,
    `with_basis`, those directions as a (384, STUDENT_DIMS) map of transformer vectors)."""
    import numpy as np

    f = np.hstack([static, np.ones((len(static), 1))])
    w = np.linalg.solve(f.T @ f + STUDENT_RIDGE * np.eye(f.shape[1]), f.T @ teacher)
    y = f @ w
    _, _, vt = np.linalg.svd(y - y.mean(0), full_matrices=False)
    basis = vt[:STUDENT_DIMS].T
    return (w @ basis, basis) if with_basis else w @ basis


def stored_vectors(teacher, basis):
    """A stored question's transformer vector in the student's space (the question was
    embedded when its answer was indexed, so the stored side need not be approximated)."""
    import numpy as np

    y = teacher @ basis
    return y / np.maximum(np.linalg.norm(y, axis=-1, keepdims=True), 1e-9)


def student_vectors(static, w):
    import numpy as np

    y = np.hstack([static, np.ones((len(static), 1))]) @ w
    return y / np.maximum(np.linalg.norm(y, axis=-1, keepdims=True), 1e-9)


def held_out(pairs_path, prefix, extra_prefix, scores_path, verifier_path, with_basis=False):
    """What `student` and `asym` share: the vectors, each pair's transformer cosine and verifier
    probability, whether it is a duplicate, and per source a map fitted without that source's
    texts (with its basis when asked)."""
    import numpy as np

    rows, teacher, static, extra_t, extra_s, src = student_data(pairs_path, prefix, extra_prefix)
    verifier, p, cos, dup = pair_scores(rows, scores_path, verifier_path)

    def fit_without(source):
        m = src != source
        return student_fit(np.vstack([static[m].reshape(-1, 384), extra_s]),
                           np.vstack([teacher[m].reshape(-1, 384), extra_t]), with_basis)

    maps = {s: fit_without(s) for s in sorted(set(src))}
    return rows, teacher, static, src, verifier, p, cos, dup, maps


def pair_scores(rows, scores_path, verifier_path):
    """The shipped verifier, and each pair's probability, transformer cosine and label
    (`pair_scores`' output for `rows`)."""
    import numpy as np

    scores = [json.loads(line) for line in open(scores_path)]
    verifier = json.load(open(verifier_path))
    p = np.array([r["p"] for r in scores])
    cos = np.array([r["cos"] for r in scores])
    dup = np.array([bool(r["duplicate"]) for r in rows])
    return verifier, p, cos, dup


def kept_tables(x, src, maps, p, cos, dup, thr, gates):
    """Per source, the share of the verifier's true hits (at threshold `thr`) whose student
    cosine reaches each gate, by the map fitted without that source (`x`: each pair's two
    inputs to the map); then the Quora namespace's `go_on_table`."""
    import numpy as np

    print("| source | true hits (min precision 0.80) | " + " | ".join(f"kept at t = {t}" for t in gates) + " |")
    print("|---|---|" + "---|" * len(gates))
    for s, w in maps.items():
        m = src == s
        cs = (student_vectors(x[m, 0], w) * student_vectors(x[m, 1], w)).sum(-1)
        hit = true_hits(p[m], cos[m], dup[m], thr)
        print(f"| {s} | {hit.sum()} | " + " | ".join(f"{np.mean(cs[hit] >= t):.3f}" for t in gates) + " |")
    qqp = np.flatnonzero(src == "qqp")[:QUERIES]
    a = student_vectors(x[qqp, 0], maps["qqp"])
    go_on_table(a @ a.T, gates)


def go_on_table(sims, gates):
    """Share of the namespace's questions that find another above each gate, as it grows
    (`sims`: lookup by stored question; a question does not find itself)."""
    import numpy as np

    np.fill_diagonal(sims, -1)
    print()
    print("| questions in the namespace | " + " | ".join(f"go on at t = {g}" for g in gates) + " |")
    print("|---|" + "---|" * len(gates))
    for size in (100, 500, 1000, len(sims)):
        best = sims[:size, :size].max(1)
        print(f"| {size} | " + " | ".join(f"{np.mean(best >= g):.2f}" for g in gates) + " |")


def student(pairs_path, prefix, extra_prefix, scores_path, verifier_path):
    """Held out: each source's pairs scored by a map fitted on the other sources' texts and the
    routing prompts; the QQP namespace by one fitted without QQP."""
    import numpy as np

    rows, teacher, static, src, verifier, p, cos, dup, maps = held_out(
        pairs_path, prefix, extra_prefix, scores_path, verifier_path)
    gates = (0.3, 0.35, 0.4, 0.45, 0.5)
    print("| source | min precision | true hits | " + " | ".join(f"kept at t = {t}" for t in gates) + " |")
    print("|---|---|---|" + "---|" * len(gates))
    for s, w in maps.items():
        m = src == s
        cs = (student_vectors(static[m, 0], w) * student_vectors(static[m, 1], w)).sum(-1)
        for target in (0.80, 0.90):
            hit = true_hits(p[m], cos[m], dup[m], verifier_threshold(verifier, target))
            if hit.sum() < 5:
                continue
            cells = " | ".join(f"{np.mean(cs[hit] >= t):.3f}" for t in gates)
            print(f"| {s} | {target:.2f} | {hit.sum()} | {cells} |")
    qqp = np.flatnonzero(src == "qqp")[:QUERIES]
    a = student_vectors(static[qqp, 0], maps["qqp"])
    sims = a @ a.T
    np.fill_diagonal(sims, -1)
    t = teacher[qqp, 0] @ teacher[qqp, 0].T
    np.fill_diagonal(t, -1)
    print()
    print("| questions in the namespace | " + " | ".join(f"go on at t = {g}" for g in gates)
          + f" | the transformer's own cosine >= {MIN_COSINE} |")
    print("|---|" + "---|" * (len(gates) + 1))
    for size in (100, 500, 1000, len(qqp)):
        best = sims[:size, :size].max(1)
        cells = " | ".join(f"{np.mean(best >= g):.2f}" for g in gates)
        print(f"| {size} | {cells} | {np.mean(t[:size, :size].max(1) >= MIN_COSINE):.2f} |")


def student_asym(pairs_path, prefix, extra_prefix, scores_path, verifier_path):
    """`student`'s tables with the stored side's true transformer vector (in the student's
    space) instead of its student vector: a new question's student vector against what the
    index holds. Each pair counts as two lookups (either text stored first); held out as
    `student`."""
    import numpy as np

    rows, teacher, static, src, verifier, p, cos, dup, maps = held_out(
        pairs_path, prefix, extra_prefix, scores_path, verifier_path, with_basis=True)
    gates = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6)
    print("| source | min precision | true hits | " + " | ".join(f"kept at t = {t}" for t in gates) + " |")
    print("|---|---|---|" + "---|" * len(gates))
    for s, (w, basis) in maps.items():
        m = src == s
        q = [student_vectors(static[m, k], w) for k in (0, 1)]
        st = [stored_vectors(teacher[m, k], basis) for k in (0, 1)]
        cs = np.concatenate([(q[0] * st[1]).sum(-1), (q[1] * st[0]).sum(-1)])
        for target in (0.80, 0.90):
            hit = true_hits(p[m], cos[m], dup[m], verifier_threshold(verifier, target))
            if hit.sum() < 5:
                continue
            hit2 = np.concatenate([hit, hit])
            cells = " | ".join(f"{np.mean(cs[hit2] >= t):.3f}" for t in gates)
            print(f"| {s} | {target:.2f} | {hit.sum()} | {cells} |")
    # The same text asked again (a repeat the exact layer did not answer: another namespace
    # key, or spacing): its student vector against its own stored vector.
    cells = []
    for t in gates:
        kept = []
        for s, (w, basis) in maps.items():
            m = src == s
            x = (student_vectors(static[m, 0], w) * stored_vectors(teacher[m, 0], basis)).sum(-1)
            kept.append(x >= t)
        cells.append(f"{np.mean(np.concatenate(kept)):.3f}")
    print(f"| the same text | — | {len(rows)} | " + " | ".join(cells) + " |")
    qqp = np.flatnonzero(src == "qqp")[:QUERIES]
    w, basis = maps["qqp"]
    sims = student_vectors(static[qqp, 0], w) @ stored_vectors(teacher[qqp, 0], basis).T
    go_on_table(sims, gates)


def student_pooled(pairs_path, prefix, extra_prefix, scores_path, verifier_path, table_path):
    """`student`'s tables for a map from more than the mean: the normalised mean, the max and the
    min of the question's static token rows (from `PREFIX.ids.jsonl` and the table file), same
    held-out folds."""
    import struct
    import numpy as np

    raw = open(table_path, "rb").read()
    _, vocab, dim = struct.unpack("<III", raw[8:20])
    table = np.frombuffer(raw[20:], dtype="<f4").reshape(vocab, dim).astype(np.float64)

    def pooled(ids_path):
        out = []
        for line in open(ids_path):
            ids = json.loads(line)
            if not ids:
                out.append(np.zeros(3 * dim))
                continue
            rows = table[ids]
            mean = rows.sum(0)
            mean /= max(np.linalg.norm(mean), 1e-9)
            out.append(np.concatenate([mean, rows.max(0), rows.min(0)]))
        return np.array(out)

    rows, teacher, static, extra_t, extra_s, src = student_data(pairs_path, prefix, extra_prefix)
    x = pooled(f"{prefix}.ids.jsonl").reshape(len(rows), 2, -1)
    extra_x = pooled(f"{extra_prefix}.ids.jsonl")
    verifier, p, cos, dup = pair_scores(rows, scores_path, verifier_path)
    thr = verifier_threshold(verifier, 0.80)
    gates = (0.4, 0.45, 0.5, 0.55, 0.6)
    maps = {}
    for s in sorted(set(src)):
        m = src != s
        maps[s] = student_fit(np.vstack([x[m].reshape(-1, x.shape[2]), extra_x]),
                              np.vstack([teacher[m].reshape(-1, 384), extra_t]))
    kept_tables(x, src, maps, p, cos, dup, thr, gates)


def metric_fit(static, teacher, pos, w0, steps=800, batch=1024, lr=3e-3, near=0.3, weight=8.0):
    """`w0` trained so that the student cosine of two texts tracks their transformer cosine:
    Adam on the squared error over every pair of a batch of texts plus labelled duplicates
    (`pos`, text indices), the pairs near the gate (either cosine above `near`) weighted
    1 + `weight` times."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.hstack([static, np.ones((len(static), 1))])
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for step in range(1, steps + 1):
        idx = rng.choice(len(x), batch, replace=False)
        if len(pos):
            p = pos[rng.choice(len(pos), min(256, len(pos)), replace=False)]
            idx = np.concatenate([idx, p[:, 0], p[:, 1]])
        y = x[idx] @ w
        n = np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-9)
        yn = y / n
        s, t = yn @ yn.T, teacher[idx] @ teacher[idx].T
        wt = 1.0 + weight * ((t > near) | (s > near))
        np.fill_diagonal(wt, 0.0)
        g = wt * (s - t) / wt.sum()
        dyn = 4.0 * g @ yn
        grad = x[idx].T @ ((dyn - yn * (dyn * yn).sum(1, keepdims=True)) / n)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        w -= lr * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
    return w


def student_metric(pairs_path, prefix, extra_prefix, scores_path, verifier_path):
    """`student`'s tables for a map trained on the cosine (`metric_fit`, from the ridge map)
    instead of the vector, same held-out folds (measured, not shipped)."""
    import numpy as np

    rows, teacher, static, extra_t, extra_s, src = student_data(pairs_path, prefix, extra_prefix)
    verifier, p, cos, dup = pair_scores(rows, scores_path, verifier_path)
    gates = (0.35, 0.4, 0.45, 0.5, 0.55, 0.6)
    maps = {}
    for s in sorted(set(src)):
        m = src != s
        st = np.vstack([static[m].reshape(-1, 384), extra_s])
        te = np.vstack([teacher[m].reshape(-1, 384), extra_t])
        keep = np.flatnonzero(dup[m] & (cos[m] >= 0.6))
        maps[s] = metric_fit(st, te, np.stack([2 * keep, 2 * keep + 1], 1), student_fit(st, te))
    thr = verifier_threshold(verifier, 0.80)
    kept_tables(static, src, maps, p, cos, dup, thr, gates)


def fit(pairs_path, prefix, extra_prefix, out_path):
    """The shipped map: fitted on every text. File: b"GWSTUDNT", version 1, rows, columns
    (u32 little-endian), then the (385, 128) map row-major as little-endian f32."""
    import struct
    import numpy as np

    _, teacher, static, extra_t, extra_s, _ = student_data(pairs_path, prefix, extra_prefix)
    w = student_fit(np.vstack([static.reshape(-1, 384), extra_s]),
                    np.vstack([teacher.reshape(-1, 384), extra_t]))
    with open(out_path, "wb") as f:
        f.write(b"GWSTUDNT" + struct.pack("<III", 1, w.shape[0], w.shape[1]))
        f.write(w.astype("<f4").tobytes())
    print(f"wrote {out_path}: {w.shape[0]} x {w.shape[1]}, fitted on {2 * len(static) + len(extra_s)} texts")


if __name__ == "__main__":
    if sys.argv[1] == "sample":
        sample(sys.argv[2:])
    elif sys.argv[1] == "gate":
        gate(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "prompts":
        prompts(sys.argv[2])
    elif sys.argv[1] == "student":
        student(*sys.argv[2:7])
    elif sys.argv[1] == "pooled":
        student_pooled(*sys.argv[2:8])
    elif sys.argv[1] == "metric":
        student_metric(*sys.argv[2:7])
    elif sys.argv[1] == "asym":
        student_asym(*sys.argv[2:7])
    elif sys.argv[1] == "fit":
        fit(*sys.argv[2:6])
    else:
        analyse(sys.argv[2], sys.argv[3])
