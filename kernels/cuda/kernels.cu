// CUDA mirror of lmrr's canonical kernels (contract version 1).
//
// Compiled by NVRTC with --fmad=false: no multiply-add is contracted, so every
// fused multiply-add below is an explicit fmaf, exactly where the CPU code
// uses f32::mul_add or an FMA instruction, and every other operation rounds on
// its own. Division and sqrtf are IEEE (NVRTC's defaults -prec-div=true,
// -prec-sqrt=true). One thread computes one output with the scalar
// reference's order: chunks of CHUNK elements aligned to index 0, element i
// on lane i % LANES (an FMA chain from +0.0), lanes joined by the fixed tree,
// chunk partials added in chunk order.

#define CHUNK 64
#define LANES 8

__device__ __forceinline__ float lane_tree(const float l[LANES]) {
    float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];
    float u0 = t0 + t2, u1 = t1 + t3;
    return u0 + u1;
}

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

__device__ float dot_canon(int kind, const float* x, const void* row, int k) {
    float total = 0.0f;
    for (int c0 = 0; c0 < k; c0 += CHUNK) {
        float l[LANES];
        #pragma unroll
        for (int j = 0; j < LANES; ++j) l[j] = 0.0f;
        int cend = min(c0 + CHUNK, k);
        for (int i = c0; i < cend; i += LANES) {
            #pragma unroll
            for (int j = 0; j < LANES; ++j) {
                if (i + j < cend) l[j] = fmaf(x[i + j], weight(kind, row, i + j), l[j]);
            }
        }
        total = total + lane_tree(l);
    }
    return total;
}

// y[t * rows + o] = dot(x[t], W[o]); W row-major, row_bytes bytes per row.
extern "C" __global__ void matmul(int kind, const float* x, const unsigned char* w, float* y,
                                  int n, int rows, int k, long long row_bytes) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * rows) return;
    int o = (int)(idx % rows), t = (int)(idx / rows);
    y[(long long)t * rows + o] = dot_canon(kind, x + (long long)t * k, w + o * row_bytes, k);
}

// out = (x * inv_rms(x)) * w per row of d elements.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int rows, int d, float eps) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * d;
    float ss = dot_canon(0, xr, xr, d);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; ++i) out[(long long)r * d + i] = (xr[i] * inv) * w[i];
}

#define EXP_HI 88.0f
#define EXP_LO -87.0f

__device__ float det_exp(float x) {
    if (isnan(x)) return x;
    if (x > EXP_HI) return __int_as_float(0x7f800000);
    if (x < EXP_LO) return 0.0f;
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.693359375f;
    const float LN2_LO = -2.12194440e-4f;
    const float MAGIC = 12582912.0f;
    const float P[6] = {1.9875691e-4f, 1.3981999e-3f, 8.3334520e-3f, 4.1665796e-2f, 1.6666665e-1f, 0.5f};
    float t = x * LOG2E;
    float n = (t + MAGIC) - MAGIC;
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = P[0];
    #pragma unroll
    for (int i = 1; i < 6; ++i) p = fmaf(p, r, P[i]);
    float y = fmaf(p, r * r, r) + 1.0f;
    float scale = __int_as_float(((int)n + 127) << 23);
    return y * scale;
}

extern "C" __global__ void exp_slice(const float* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = det_exp(x[i]);
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float a = g[i];
        out[i] = (a / (1.0f + det_exp(-a))) * u[i];
    }
}

// Rotate-half RoPE of one row of `width` = heads * d values at position pos,
// with the host's tables (cos/sin rows of d/2 values).
extern "C" __global__ void rope(float* x, const float* cos_row, const float* sin_row, int width, int d) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    int h = d / 2;
    if (idx >= width / 2) return;
    int head = idx / h, i = idx % h;
    float* p = x + head * d;
    float a = p[i], b = p[i + h];
    p[i] = a * cos_row[i] - b * sin_row[i];
    p[i + h] = b * cos_row[i] + a * sin_row[i];
}

#define ATTN_TILE 32
#define MAX_HEAD_DIM 256

// Causal attention of one query token per task, one thread per (task, head),
// in the CPU reference's order (kernels/src/attention.rs): tiles of ATTN_TILE
// absolute positions; per tile canonical-dot scores times scale, tile max,
// det_exp, sequential sum and fmaf P·V chains; tiles merged in order.
// Task t's keys/values are rows kv_off[t] .. kv_off[t] + pos[t] of k and v
// (row width kv_dim); q and out are (tasks, n_heads * head_dim).
extern "C" __global__ void attention(const float* q, const float* k, const float* v,
                                     const long long* kv_off, const int* pos, float* out,
                                     int tasks, int n_heads, int n_kv_heads, int head_dim,
                                     float scale) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    if (item >= tasks * n_heads) return;
    int t = item / n_heads, h = item % n_heads;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + (long long)t * qd + h * hd;
    const float* kt = k + kv_off[t] * kvd + kvh * hd;
    const float* vt = v + kv_off[t] * kvd + kvh * hd;
    float m = __int_as_float(0xff800000);  // -inf
    float l = 0.0f;
    float acc[MAX_HEAD_DIM], acc_t[MAX_HEAD_DIM];
    for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
    float s[ATTN_TILE];
    int p_end = pos[t];
    for (int j0 = 0; j0 <= p_end; j0 += ATTN_TILE) {
        int j1 = min(j0 + ATTN_TILE, p_end + 1);
        float mt = __int_as_float(0xff800000);
        for (int j = j0; j < j1; ++j) {
            float sj = dot_canon(0, qh, kt + (long long)j * kvd, hd) * scale;
            s[j - j0] = sj;
            if (sj > mt) mt = sj;
        }
        float m_new = mt > m ? mt : m;
        float alpha = det_exp(m - m_new);
        float lt = 0.0f;
        for (int d = 0; d < hd; ++d) acc_t[d] = 0.0f;
        for (int j = j0; j < j1; ++j) {
            float pj = det_exp(s[j - j0] - m_new);
            lt = lt + pj;
            const float* vr = vt + (long long)j * kvd;
            for (int d = 0; d < hd; ++d) acc_t[d] = fmaf(pj, vr[d], acc_t[d]);
        }
        l = l * alpha + lt;
        for (int d = 0; d < hd; ++d) acc[d] = acc[d] * alpha + acc_t[d];
        m = m_new;
    }
    float* o = out + (long long)t * qd + h * hd;
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l;
}
