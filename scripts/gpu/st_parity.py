#!/usr/bin/env python3
"""Compare our embeddings (GPU and CPU, from the gpu_embed program) with sentence-transformers
itself on the same texts and the same weights:

    python3 st_parity.py VECTORS.json MODEL_DIR

VECTORS.json is gpu_embed's output. The reference is sentence-transformers' pipeline for the
model (Transformer -> mean pooling -> normalise) in float32 with TF32 off, on the GPU when torch
sees one and on the CPU; where SentenceTransformer cannot load the folder, the same pipeline
through transformers' AutoModel and the tokenizers library. Thresholds as the Rust parity tests:
sentence cosine >= 0.9999, token cosine >= 0.999. Prints one table row per comparison; exits 1
if a comparison fails, 0 (saying why) when torch or sentence-transformers is missing here.
"""
import json
import math
import os
import sys

# The GPU machine has no network: never let the Hugging Face libraries try to reach it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SENTENCE_MIN, TOKEN_MIN = 0.9999, 0.999


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else (1.0 if na == nb else 0.0)


def reference(model_dir, device, texts):
    """Sentence vectors and per-text token vectors (without [CLS]/[SEP]) from the library."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(model_dir, device=device).float()
        sentences = model.encode(texts, batch_size=64, normalize_embeddings=True,
                                 convert_to_numpy=False)
        tokens = model.encode(texts, batch_size=64, output_value="token_embeddings",
                              convert_to_numpy=False)
        how = "SentenceTransformer"
    except Exception as e:  # noqa: BLE001 - report and use the plain pipeline
        print(f"SentenceTransformer could not load {model_dir} ({type(e).__name__}: {e}); "
              "using transformers' AutoModel with the same pooling")
        from tokenizers import Tokenizer
        from transformers import AutoModel

        tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        tok.enable_truncation(256)
        bert = AutoModel.from_pretrained(model_dir).float().to(device).eval()
        sentences, tokens = [], []
        with torch.no_grad():
            for text in texts:
                ids = tok.encode(text).ids
                out = bert(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0]
                sentences.append(torch.nn.functional.normalize(out.mean(0), dim=0))
                tokens.append(out)
        how = "transformers AutoModel"
    sentences = [s.double().cpu().tolist() for s in sentences]
    tokens = [t.double().cpu().tolist()[1:-1] for t in tokens]
    return sentences, tokens, how


def compare(name, ours, ref):
    """Worst sentence and token cosine of `ours` against `ref`; a row; whether it passed."""
    worst_s, worst_t, where, problems = 1.0, 1.0, "", []
    for i, (s, r) in enumerate(zip(ours["sentences"], ref[0])):
        c = cosine(s, r)
        if c < worst_s:
            worst_s, where = c, f"text {i}"
    for i, (t, r) in enumerate(zip(ours["tokens"], ref[1])):
        if len(t) != len(r):
            problems.append(f"text {i}: {len(t)} tokens vs {len(r)}")
            continue
        for a, b in zip(t, r):
            worst_t = min(worst_t, cosine(a, b))
    ok = worst_s >= SENTENCE_MIN and worst_t >= TOKEN_MIN and not problems
    detail = f"worst sentence cosine {worst_s:.6f} ({where}), worst token cosine {worst_t:.5f}"
    if problems:
        detail += "; token counts differ: " + ", ".join(problems[:3])
    print(f"| {name} | {'ok' if ok else 'FAILED'} | {detail} |")
    return ok


def main():
    vectors_path, model_dir = sys.argv[1], sys.argv[2]
    with open(vectors_path) as f:
        doc = json.load(f)
    texts = doc["texts"]
    try:
        import torch  # noqa: F401
        import sentence_transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e} (sentence-transformers and torch are on the GPU machine)")
        return 0
    import torch

    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    print(f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, "
          f"{len(texts)} texts")
    print()
    print("| comparison | result | detail |")
    print("|---|---|---|")
    ok = True
    for device in devices:
        ref = reference(model_dir, device, texts)
        label = f"{ref[2]} ({device}, fp32)"
        ok &= compare(f"our CPU transformer vs {label}", doc["cpu"], ref)
        if doc.get("gpu"):
            ok &= compare(f"our GPU transformer vs {label}", doc["gpu"], ref)
    if not doc.get("gpu"):
        print(f"| our GPU transformer | skipped | {doc.get('gpu_skipped')} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
