#!/usr/bin/env python3
"""Writes a tiny 2-layer llama GGUF whose matrices are Q4_K and Q6_K blocks.

    python3 scripts/tiny_kquant_gguf.py OUT.gguf

For running a K-quant model on a machine that cannot download one (the GPU
machine): `lmrr import-gguf` keeps the blocks as they are (`--dtype keep`),
and `scripts/device-check.sh` compares CUDA's digests with the CPU's. Python's
standard library only. Hidden 256 and FFN 512, so every matrix row is whole
super-blocks of 256; the vocabulary is the 94 printable ASCII characters,
space (`Ġ`) and newline (`Ċ`), as engine/tests/fixtures/tiny_gguf.rs builds
its own tiny model. The blocks are random bytes with f16 scales small enough
that the K-quants' 6- and 8-bit sub-scales keep the logits finite; the seed
is fixed, so the file is the same on every machine.
"""

import random
import struct
import sys

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
Q4_K, Q6_K, F32 = 12, 14, 0
# (weights, bytes) of a super-block.
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210)}


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def meta_u32(v):
    return struct.pack("<I", 4) + struct.pack("<I", v)


def meta_str(v):
    return struct.pack("<I", 8) + gguf_str(v)


def meta_strs(vs):
    return struct.pack("<IIQ", 9, 8, len(vs)) + b"".join(gguf_str(v) for v in vs)


def f16_scale(rng, e0):
    """An f16 in [2^(e0-15), 2^(e0-12)) with a random sign and mantissa."""
    h = (rng.getrandbits(1) << 15) | ((e0 + rng.randrange(3)) << 10) | rng.getrandbits(10)
    return struct.pack("<H", h)


def blocks(rng, ty, elements):
    weights, size = BLOCK[ty]
    out = bytearray()
    for _ in range(elements // weights):
        if ty == Q4_K:  # d, dmin, then scales and nibbles
            out += f16_scale(rng, 2) + f16_scale(rng, 2)
            out += bytes(rng.getrandbits(8) for _ in range(size - 4))
        else:  # nibbles, high bits, int8 scales, then d
            out += bytes(rng.getrandbits(8) for _ in range(size - 2))
            out += f16_scale(rng, 1)
    return bytes(out)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_kquant_gguf.py OUT.gguf")
    rng = random.Random(7)
    tokens = [chr(b) for b in range(33, 127)] + ["Ġ", "Ċ"]
    kv = HIDDEN // HEADS * KV_HEADS
    meta = [
        ("general.architecture", meta_str("llama")),
        ("llama.embedding_length", meta_u32(HIDDEN)),
        ("llama.feed_forward_length", meta_u32(FFN)),
        ("llama.attention.head_count", meta_u32(HEADS)),
        ("llama.attention.head_count_kv", meta_u32(KV_HEADS)),
        ("llama.block_count", meta_u32(LAYERS)),
        ("llama.context_length", meta_u32(1024)),
        ("tokenizer.ggml.tokens", meta_strs(tokens)),
        # A plain-text template, so chat scripts (examples/multi-user.toml) run.
        ("tokenizer.chat_template", meta_str(
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")),
    ]
    norm = b"".join(struct.pack("<f", 1.0 + i / 256) for i in range(HIDDEN))
    # (name, ggml dims: columns first, type, data); both block types in
    # every layer, as Q4_K_M files mix them.
    tensors = [
        ("token_embd.weight", [HIDDEN, len(tokens)], Q4_K, blocks(rng, Q4_K, HIDDEN * len(tokens))),
        ("output_norm.weight", [HIDDEN], F32, norm),
        ("output.weight", [HIDDEN, len(tokens)], Q6_K, blocks(rng, Q6_K, HIDDEN * len(tokens))),
    ]
    for layer in range(LAYERS):
        for n in ("attn_norm", "ffn_norm"):
            tensors.append((f"blk.{layer}.{n}.weight", [HIDDEN], F32, norm))
        for n, dims, ty in [
            ("attn_q", [HIDDEN, HIDDEN], Q4_K),
            ("attn_k", [HIDDEN, kv], Q4_K),
            ("attn_v", [HIDDEN, kv], Q6_K),
            ("attn_output", [HIDDEN, HIDDEN], Q4_K),
            ("ffn_gate", [HIDDEN, FFN], Q4_K),
            ("ffn_up", [HIDDEN, FFN], Q4_K),
            ("ffn_down", [FFN, HIDDEN], Q6_K),
        ]:
            tensors.append((f"blk.{layer}.{n}.weight", dims, ty, blocks(rng, ty, dims[0] * dims[1])))

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, value in meta:
        out += gguf_str(key) + value
    offset = 0
    for name, dims, ty, data in tensors:
        out += gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        offset += -(-len(data) // 32) * 32
    out += bytes(-len(out) % 32)
    for _, _, _, data in tensors:
        out += data + bytes(-len(data) % 32)
    with open(sys.argv[1], "wb") as f:
        f.write(out)


if __name__ == "__main__":
    main()
