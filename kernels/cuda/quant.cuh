// quant.cuh: weights as the kernels read them: one element of a row of f32,
// bf16 or a block format (Q4_0, Q4_1, Q8_0, and the super-blocks of 256 of
// Q4_K and Q6_K), dequantized in the kernel as kernels/src/quant.rs and
// kernels/src/kquant.rs widen it: the same f32 operations in the same order,
// so the canonical dot over dequantized weights has the CPU's bits.

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

// Weight w (0..255) of a Q4_K super-block (144 bytes: f16 d, f16 dmin, 12
// bytes of packed 6-bit scales and mins, 128 bytes of nibbles): d·sc and
// dmin·m rounded each, then (d·sc)·q rounded, minus dmin·m (kquant.rs q4_k).
__device__ __forceinline__ float q4k_weight(const unsigned char* blk, int w) {
    const unsigned char* s = blk + 4;
    int j = w >> 5;
    unsigned sc, m;
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    float dl = f16_to_f32(ld16(blk)) * (float)sc;
    float ml = f16_to_f32(ld16(blk + 2)) * (float)m;
    unsigned char byte = blk[16 + (j >> 1) * 32 + (w & 31)];
    unsigned q = (j & 1) ? (byte >> 4) : (byte & 0xf);
    return dl * (float)q - ml;
}

// Weight w (0..255) of a Q6_K super-block (210 bytes: 128 of low nibbles,
// 64 of high bit pairs, 16 signed 8-bit scales, f16 d): (d·scale) rounded,
// times q − 32 (kquant.rs q6_k).
__device__ __forceinline__ float q6k_weight(const unsigned char* blk, int w) {
    int half = w >> 7, within = w & 127;
    unsigned char byte = blk[half * 64 + (within & 63)];
    int lo = within < 64 ? (byte & 0xf) : (byte >> 4);
    int hi = (blk[128 + half * 32 + (within & 31)] >> (2 * (within >> 5))) & 3;
    float dl = f16_to_f32(ld16(blk + 208)) * (float)(signed char)blk[192 + (w >> 4)];
    return dl * (float)((lo | (hi << 4)) - 32);
}

// Weight i of a row, by storage. kind: 0 f32, 1 bf16, 2 Q4_0, 3 Q4_1, 4 Q8_0,
// 5 Q4_K, 6 Q6_K.
__device__ __forceinline__ float weight(int kind, const void* row, int i) {
    if (kind == 0) return ((const float*)row)[i];
    if (kind == 1) return __uint_as_float((unsigned)((const unsigned short*)row)[i] << 16);
    const unsigned char* r = (const unsigned char*)row;
    if (kind == 5) return q4k_weight(r + (i >> 8) * 144, i & 255);
    if (kind == 6) return q6k_weight(r + (i >> 8) * 210, i & 255);
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
