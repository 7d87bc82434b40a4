// quant.cuh: weights as the kernels read them: one element of a row of f32,
// bf16 or a block format (Q4_0, Q4_1, Q8_0), dequantized in the kernel as
// kernels/src/quant.rs widens it.

// Exact f16 -> f32; NaNs come out quiet, as in the CPU reference.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h >> 15) << 31;
    unsigned exp = (h >> 10) & 0x1f;
    unsigned man = h & 0x3ff;
    unsigned bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {
        unsigned shift = __clz(man) - 21;
        unsigned m = (man << shift) & 0x3ff;
        bits = sign | ((127 - 15 + 1 - shift) << 23) | (m << 13);
    } else if (exp == 0x1f) {
        bits = man == 0 ? (sign | 0x7f800000u) : (sign | 0x7fc00000u | (man << 13));
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

__device__ __forceinline__ unsigned short ld16(const unsigned char* p) {
    return (unsigned short)(p[0] | (p[1] << 8));
}

// Weight i of a row, by storage. kind: 0 f32, 1 bf16, 2 Q4_0, 3 Q4_1, 4 Q8_0.
__device__ __forceinline__ float weight(int kind, const void* row, int i) {
    if (kind == 0) return ((const float*)row)[i];
    if (kind == 1) return __uint_as_float((unsigned)((const unsigned short*)row)[i] << 16);
    const unsigned char* r = (const unsigned char*)row;
    int b = i >> 5, j = i & 31;
    if (kind == 4) {
        const unsigned char* blk = r + b * 34;
        return f16_to_f32(ld16(blk)) * (float)(signed char)blk[2 + j];
    }
    if (kind == 2) {
        const unsigned char* blk = r + b * 18;
        unsigned char q = blk[2 + (j & 15)];
        int v = j < 16 ? (q & 0xf) : (q >> 4);
        return f16_to_f32(ld16(blk)) * (float)(v - 8);
    }
    const unsigned char* blk = r + b * 20;
    unsigned char q = blk[4 + (j & 15)];
    int v = j < 16 ? (q & 0xf) : (q >> 4);
    // d*q is exact; the add rounds once (no contraction under --fmad=false).
    return f16_to_f32(ld16(blk)) * (float)v + f16_to_f32(ld16(blk + 2));
}
