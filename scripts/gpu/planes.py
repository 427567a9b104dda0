#!/usr/bin/env python3
"""Split a safetensors file of 2-byte values into byte planes, or join them back, so that xz
compresses the fp16 weights better (the sign-and-exponent bytes, alike across a tensor, sit
together; 45.4 MB of all-MiniLM-L6-v2 in fp16 compress to 38.7 MB instead of 40.9):

    python3 scripts/gpu/planes.py split IN.safetensors OUT.planes   # here (gpu-bundle.sh)
    python3 scripts/gpu/planes.py join IN.planes OUT.safetensors    # there (run.sh)

The header (its 8-byte length and JSON) is kept as it is; the data after it becomes every
value's first byte, then every value's second byte. Standard library only.
"""
import struct
import sys


def main():
    mode, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(src, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    head, data = raw[: 8 + n], raw[8 + n :]
    if len(data) % 2:
        sys.exit(f"{src}: {len(data)} bytes of data, not 2-byte values")
    half = len(data) // 2
    out = bytearray(len(data))
    if mode == "split":
        out[:half], out[half:] = data[0::2], data[1::2]
    elif mode == "join":
        out[0::2], out[1::2] = data[:half], data[half:]
    else:
        sys.exit(f"unknown mode {mode}: split or join")
    with open(dst, "wb") as f:
        f.write(head)
        f.write(out)


if __name__ == "__main__":
    main()
