"""Independent reference for kernels/tests/it/rope_table.rs (run: python3 this-file).

Computes the RoPE cos/sin tables the way lmrr defines them, with every
transcendental correctly rounded instead of taken from a math library:

    inv[i]   = pow(theta, -(2i)/head_dim)        f64, correctly rounded (mpmath, 200 bits)
    a        = pos * inv[i]                      f64 product (IEEE, as Python floats do)
    cos, sin = cos(a), sin(a)                    f64, correctly rounded, then rounded to f32

and prints, per (head_dim, theta, positions), the SHA-256 of the little-endian
f32 bits of the whole cos table followed by the whole sin table (row-major,
position by position), plus a few single entries. The exponent -(2i)/head_dim is
the IEEE f64 quotient, as in the Rust code. Needs mpmath (tested with 1.3.0).
"""
import hashlib
import struct

from mpmath import mp, mpf

mp.prec = 200


def f64(x):
    """Nearest f64 to the mpmath number x (mpmath rounds to nearest, ties even)."""
    return float(x)


def f32_bits(x):
    """Bits of the f32 nearest to the f64 x (C's (float) cast: nearest, ties even)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def table(head_dim, theta, max_pos):
    half = head_dim // 2
    inv = [f64(mp.power(mpf(theta), mpf(-(2 * i) / head_dim))) for i in range(half)]
    cos, sin = [], []
    for p in range(max_pos):
        for f in inv:
            a = float(p) * f
            cos.append(f32_bits(f64(mp.cos(mpf(a)))))
            sin.append(f32_bits(f64(mp.sin(mpf(a)))))
    return cos, sin


if __name__ == "__main__":
    for hd, theta, max_pos in [
        (8, 10_000.0, 4),
        (48, 10_000.0, 1024),
        (32, 100_000.0, 2048),
        (64, 100_000.0, 8192),
        (128, 500_000.0, 8192),
    ]:
        cos, sin = table(hd, theta, max_pos)
        blob = b"".join(struct.pack("<I", b) for b in cos + sin)
        print(f"({hd}, {theta}, {max_pos}): {hashlib.sha256(blob).hexdigest()}")
        half = hd // 2
        for p, i in [(1, 0), (3, 1), (max_pos - 1, half - 1)]:
            k = p * half + i
            print(f"   pos {p} i {i}: cos {cos[k]:#010x} sin {sin[k]:#010x}")
        if hd == 128:
            k = 3531 * half + 6
            print(f"   pos 3531 i 6: cos {cos[k]:#010x} sin {sin[k]:#010x}")
