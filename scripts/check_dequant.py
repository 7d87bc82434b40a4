#!/usr/bin/env python3
"""Holds lmrr's dequantization of ggml block formats against gguf-py's
(`gguf/quants.py`, the format's reference implementation), bit for bit.

  check_dequant.py --write-fixture [PATH]
      Random blocks of every format lmrr reads, with extreme f16 scales
      (zero, -0, subnormal, max, inf, NaN with payloads) and extreme quants
      (all ones, all zeros), dequantized by gguf-py; writes blocks and the
      expected f32 bits to PATH (default
      kernels/tests/fixtures/dequant_gguf_py.bin), which the Rust test
      `dequant_matches_gguf_py_fixture` (kernels/tests/it/quant.rs) reads.
  check_dequant.py --gguf FILE [--lmrr BIN]
      Dequantizes every tensor of FILE with gguf-py and with
      `lmrr gguf-dequant FILE TENSOR` and compares all bits (NaN payloads
      included). Exit 1 on any difference.

Needs `pip install gguf numpy`. Fixture layout (little endian), per format:
u8 name length, name, u32 blocks, u32 block bytes, u32 block weights, the
blocks, then blocks × block weights u32 f32 bits.
"""

import argparse
import os
import struct
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# Byte offsets of the f16 scales (d, then dmin/m where the format has one).
SCALES = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}

# f16 bit patterns: zeros, subnormals, smallest normal, max, infinities,
# quiet and signalling NaNs with payloads and both signs, ordinary values.
SPECIAL = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00,
           0xFC00, 0x7E00, 0x7C01, 0xFE2A, 0x3C00, 0xB800, 0x1400, 0x5A00]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FIXTURE = os.path.join(ROOT, "kernels", "tests", "fixtures", "dequant_gguf_py.bin")


def blocks_for(name: str, rng: np.random.Generator) -> np.ndarray:
    """Every special scale as d (with a rotated one as dmin), all-ones and
    all-zero quants, and a few random blocks (random scale bits too)."""
    _, bb = GGML_QUANT_SIZES[T[name]]
    offs = SCALES[name]
    out = []
    for i, s in enumerate(SPECIAL):
        b = rng.integers(0, 256, bb, dtype=np.uint8)
        for j, o in enumerate(offs):
            v = SPECIAL[(i + 5 * j) % len(SPECIAL)]
            b[o:o + 2] = np.frombuffer(struct.pack("<H", v), dtype=np.uint8)
        out.append(b)
    # Both scales NaN with different payloads: which one propagates.
    b = rng.integers(0, 256, bb, dtype=np.uint8)
    for j, o in enumerate(offs):
        b[o:o + 2] = np.frombuffer(struct.pack("<H", [0x7E01, 0xFE3F][j]), dtype=np.uint8)
    out.append(b)
    for fill, scale in ((0xFF, 0x7BFF), (0xFF, 0x0001), (0x00, 0x3C00)):
        b = np.full(bb, fill, dtype=np.uint8)
        for o in offs:
            b[o:o + 2] = np.frombuffer(struct.pack("<H", scale), dtype=np.uint8)
        out.append(b)
    extra = 3 if bb > 40 else 12
    for _ in range(extra):
        out.append(rng.integers(0, 256, bb, dtype=np.uint8))
    return np.stack(out)


def write_fixture(path: str) -> None:
    rng = np.random.default_rng(20261207)
    parts = []
    total = 0
    for name in FORMATS:
        bw, bb = GGML_QUANT_SIZES[T[name]]
        blocks = blocks_for(name, rng)
        with np.errstate(all="ignore"):
            want = dequantize(blocks, T[name]).astype(np.float32).reshape(-1)
        assert want.size == len(blocks) * bw
        nb = name.encode()
        parts.append(struct.pack("<B", len(nb)) + nb)
        parts.append(struct.pack("<III", len(blocks), bb, bw))
        parts.append(blocks.tobytes())
        parts.append(want.view(np.uint32).astype("<u4").tobytes())
        total += len(blocks)
        print(f"{name}: {len(blocks)} blocks, {want.size} weights")
    data = b"".join(parts)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    print(f"wrote {path}: {len(FORMATS)} formats, {total} blocks, {len(data)} bytes")


def check_gguf(path: str, lmrr: str) -> int:
    reader = GGUFReader(path)
    bad = 0
    counts: dict[str, int] = {}
    for t in reader.tensors:
        ty = T(t.tensor_type).name
        with np.errstate(all="ignore"):
            want = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        got = subprocess.run([lmrr, "gguf-dequant", path, t.name], capture_output=True)
        if got.returncode != 0:
            print(f"{t.name} ({ty}): lmrr failed: {got.stderr.decode().strip()}")
            bad += 1
            continue
        g = np.frombuffer(got.stdout, dtype="<u4")
        w = want.view(np.uint32)
        if g.shape != w.shape:
            print(f"{t.name} ({ty}): lmrr wrote {g.size} weights, gguf-py {w.size}")
            bad += 1
        elif (diff := int(np.count_nonzero(g != w))) != 0:
            i = int(np.flatnonzero(g != w)[0])
            print(f"{t.name} ({ty}): {diff} of {w.size} weights differ, first at {i}: "
                  f"lmrr {g[i]:#010x}, gguf-py {w[i]:#010x}")
            bad += 1
        counts[ty] = counts.get(ty, 0) + 1
    summary = ", ".join(f"{n} {ty}" for ty, n in sorted(counts.items()))
    print(f"{path}: {len(reader.tensors)} tensors ({summary}), {bad} differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-fixture", nargs="?", const=DEFAULT_FIXTURE, metavar="PATH")
    ap.add_argument("--gguf", metavar="FILE")
    ap.add_argument("--lmrr", default=os.path.join(ROOT, "target", "release", "lmrr"))
    a = ap.parse_args()
    if not a.write_fixture and not a.gguf:
        ap.error("give --write-fixture and/or --gguf FILE")
    if a.write_fixture:
        write_fixture(a.write_fixture)
    if a.gguf:
        return check_gguf(a.gguf, a.lmrr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
