#!/usr/bin/env python3
"""Convert a safetensors file's F32 tensors to F16 (round to nearest even), other dtypes as they
are, with no dependency beyond the standard library (this machine has no NumPy):

    python3 scripts/gpu/fp16.py IN.safetensors OUT.safetensors

Used by scripts/gpu-bundle.sh to halve all-MiniLM-L6-v2 (91 MB -> 45 MB) so the bundle fits the
GPU machine's 64 MiB transfer. Both loaders read it back as F32: candle (`VarBuilder` with
`DType::F32`, the GPU path's `to_dtype(F32)`) and sentence-transformers (asked for float32), so
the GPU, the CPU and the reference all run the same rounded weights. Prints the largest relative
rounding error and refuses values outside F16's range.
"""
import array
import json
import struct
import sys


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    out_header, chunks, offset, worst = {}, [], 0, 0.0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        info = header[name]
        start, end = info["data_offsets"]
        raw = data[start:end]
        dtype = info["dtype"]
        if dtype == "F32":
            values = array.array("f")
            values.frombytes(raw)
            if sys.byteorder != "little":
                values.byteswap()
            try:
                raw = struct.pack(f"<{len(values)}e", *values)
            except OverflowError:
                sys.exit(f"{name}: a value is outside float16's range")
            back = struct.unpack(f"<{len(values)}e", raw)
            big = max((abs(v) for v in values), default=0.0)
            if big > 0:
                worst = max(worst, max(abs(a - b) for a, b in zip(values, back)) / big)
            dtype = "F16"
        out_header[name] = {
            "dtype": dtype,
            "shape": info["shape"],
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    if meta is not None:
        out_header["__metadata__"] = meta
    text = json.dumps(out_header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
    print(
        f"{src} -> {dst}: {len(out_header) - (meta is not None)} tensors, {offset / 1e6:.1f} MB "
        f"of data; largest rounding error {worst:.2e} of a tensor's largest magnitude"
    )


if __name__ == "__main__":
    main()
