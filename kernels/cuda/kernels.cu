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

// Programmatic dependent launch (sm_90 on, LMRR_CUDA_PDL=1): the resident
// path may launch a kernel before the one ahead of it in the stream has
// finished, so every resident kernel first waits until that one has
// completed and its writes are visible (griddepcontrol.wait), and only then
// lets the next kernel be launched (launch_dependents): no kernel touches
// memory before its predecessor is done, so no value changes; what overlaps
// is the next launch's set-up with this kernel's run. Compiled for an
// earlier architecture (the default), both are nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                            \
    do {                                                       \
        asm volatile("griddepcontrol.wait;" ::: "memory");     \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
    } while (0)
#else
#define PDL_ENTRY() \
    do {            \
    } while (0)
#endif

// Prologue before the wait (LMRR_CUDA_PDL_PREFETCH: the resident module
// compiled with PDL_PREFETCH defined): a kernel whose first loads are of
// weights (matmul_rows and its forms, matmul_fused; norm_reg's norm weight)
// issues them before griddepcontrol.wait, so their DRAM latency overlaps the
// kernel ahead of it. Weights are never written while steps run, so what they load
// is the same whenever they load it; everything else still waits
// (PDL_ENTRY_LATE, right after those loads, instead of PDL_ENTRY first).
#if defined(PDL_PREFETCH)
#define PDL_ENTRY_EARLY() \
    do {                  \
    } while (0)
#define PDL_ENTRY_LATE() PDL_ENTRY()
#else
#define PDL_ENTRY_EARLY() PDL_ENTRY()
#define PDL_ENTRY_LATE() \
    do {                 \
    } while (0)
#endif

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

// matmul, one warp per output: the same canonical order spread over the
// warp. Thread (g = lane / 8, j = lane % 8) runs lane j's FMA chain of chunk
// 4q + g; the lane tree is three xor-shuffles whose pairs are the tree's own
// ((0,4) (1,5) (2,6) (3,7), then (0,2) (1,3), then (0,1): IEEE addition is
// commutative, so either side of a pair gets the same bits); lane 0 adds the
// chunk partials in chunk order. Bit-identical to `matmul` (gpu_check).
extern "C" __global__ void matmul_warp(int kind, const float* x, const unsigned char* w, float* y,
                                       int n, int rows, int k, long long row_bytes) {
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= (long long)n * rows) return;  // uniform over the warp
    int o = (int)(warp % rows), t = (int)(warp / rows);
    const float* xr = x + (long long)t * k;
    const unsigned char* wr = w + o * row_bytes;
    int g = lane >> 3, j = lane & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    float total = 0.0f;
    for (int q = 0; q < chunks; q += 4) {
        int c = q + g;
        float l = 0.0f;
        if (c < chunks) {
            int cend = min(c * CHUNK + CHUNK, k);
            for (int i = c * CHUNK + j; i < cend; i += LANES) l = fmaf(xr[i], weight(kind, wr, i), l);
        }
        l = l + __shfl_xor_sync(0xffffffffu, l, 4);
        l = l + __shfl_xor_sync(0xffffffffu, l, 2);
        l = l + __shfl_xor_sync(0xffffffffu, l, 1);
        float p0 = __shfl_sync(0xffffffffu, l, 0);
        float p1 = __shfl_sync(0xffffffffu, l, 8);
        float p2 = __shfl_sync(0xffffffffu, l, 16);
        float p3 = __shfl_sync(0xffffffffu, l, 24);
        total = total + p0;
        if (q + 1 < chunks) total = total + p1;
        if (q + 2 < chunks) total = total + p2;
        if (q + 3 < chunks) total = total + p3;
    }
    if (lane == 0) y[(long long)t * rows + o] = total;
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

// Element i of a matmul's output of `count` values: y[i], or where the
// matmul was split (part non-null), its chunk partials summed in chunk
// order from +0.0, ((0 + part[0][i]) + part[1][i]) + …: sum_chunks' value,
// so a kernel that reads its input through split_value needs no sum_chunks
// launch ahead of it and reads the same bits.
__device__ __forceinline__ float split_value(const float* y, const float* part, int chunks, long long count,
                                             long long i) {
    if (!part) return y[i];
    float t = 0.0f;
    for (int c = 0; c < chunks; ++c) t = t + part[(long long)c * count + i];
    return t;
}

// SwiGLU of one element: silu(g) · u, the CPU's operations.
__device__ __forceinline__ float swiglu_of(float g, float u) { return (g / (1.0f + det_exp(-g))) * u; }

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int n) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_of(g[i], u[i]);
}

// swiglu of a gate and an up matmul's outputs, each read through
// split_value (its chunk partials summed here where it was split: one
// launch for sum_chunks and swiglu).
extern "C" __global__ void swiglu_split(const float* g, const float* gpart, const float* u, const float* upart,
                                        int chunks, float* out, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_of(split_value(g, gpart, chunks, n, i), split_value(u, upart, chunks, n, i));
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

// ---- mini-v4: hyper-connections, MoE combine, indexer scores ----
// The order of kernels/src/hyper.rs, one rounding per written operation.

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + det_exp(-x));
}

// Coefficients of n tokens from raw (n, 2h + h*h), one thread per token:
// pre (n, h), post (n, h), res (n, h, h) after `iters` Sinkhorn-Knopp rounds
// (rows then columns; sums sequential from +0.0 in index order; IEEE division).
extern "C" __global__ void hc_coeffs(const float* raw, float* pre, float* post, float* res,
                                     int n, int h, int iters, float eps) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    int w = 2 * h + h * h;
    const float* r = raw + (long long)t * w;
    for (int i = 0; i < h; ++i) {
        pre[(long long)t * h + i] = sigmoid(r[i]);
        post[(long long)t * h + i] = 2.0f * sigmoid(r[h + i]);
    }
    const float* rr = r + 2 * h;
    float* m = res + (long long)t * h * h;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int k = 0; k < h * h; ++k) {
        if (rr[k] > mx) mx = rr[k];
    }
    for (int k = 0; k < h * h; ++k) m[k] = det_exp(rr[k] - mx) + eps;
    for (int it = 0; it < iters; ++it) {
        for (int i = 0; i < h; ++i) {
            float s = 0.0f;
            for (int j = 0; j < h; ++j) s = s + m[i * h + j];
            for (int j = 0; j < h; ++j) m[i * h + j] = m[i * h + j] / s;  // row
        }
        for (int j = 0; j < h; ++j) {
            float s = 0.0f;
            for (int i = 0; i < h; ++i) s = s + m[i * h + j];
            for (int i = 0; i < h; ++i) m[i * h + j] = m[i * h + j] / s;  // column
        }
    }
}

// out[t][c] = sum_i pre[t][i] * x[t][i][c], an fmaf chain from +0.0 over
// streams; one thread per (t, c).
extern "C" __global__ void hc_pre(const float* x, const float* pre, float* out, int n, int h, int d) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    float acc = 0.0f;
    for (int i = 0; i < h; ++i) acc = fmaf(pre[t * h + i], x[(t * h + i) * d + c], acc);
    out[idx] = acc;
}

// out[t][i][c] = sum_j res[t][i][j] * x[t][j][c], then + post[t][i] * y[t][c],
// one fmaf chain; one thread per (t, i, c).
extern "C" __global__ void hc_post(const float* x, const float* res, const float* post,
                                   const float* y, float* out, int n, int h, int d) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * h * d) return;
    int c = (int)(idx % d);
    long long ti = idx / d;  // t * h + i
    long long t = ti / h;
    float acc = 0.0f;
    for (int j = 0; j < h; ++j) acc = fmaf(res[ti * h + j], x[(t * h + j) * d + c], acc);
    out[idx] = fmaf(post[ti], y[t * d + c], acc);
}

// Expert combine of n tokens: token t uses experts off[t] .. off[t+1] (gates
// and rows of ys, row width d, ascending expert index);
// out[t][c] = base[t][c] + sum_e gate[e] * ys[e][c], an fmaf chain from base.
extern "C" __global__ void moe_combine(const float* base, const float* gates, const float* ys,
                                       const int* off, float* out, int n, int d) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    float acc = base[idx];
    for (int e = off[t]; e < off[t + 1]; ++e) acc = fmaf(gates[e], ys[(long long)e * d + c], acc);
    out[idx] = acc;
}

// Indexer scores of one query q (heads, dim) against m keys (m, dim):
// out[s] = sum_h w[h] * relu(dot(q_h, key_s)), the dot canonical (dot_canon),
// the head sum an fmaf chain from +0.0 in head order; one thread per key.
extern "C" __global__ void index_scores(const float* q, const float* w, const float* keys,
                                        float* out, int m, int heads, int dim) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= m) return;
    const float* key = keys + (long long)s * dim;
    float acc = 0.0f;
    for (int hh = 0; hh < heads; ++hh) {
        float v = dot_canon(0, q + (long long)hh * dim, key, dim);
        float r = v > 0.0f ? v : 0.0f;
        acc = fmaf(w[hh], r, acc);
    }
    out[s] = acc;
}

// ---- Resident path: kernels over device-resident weights, activations and
// paged KV (kernels/src/cuda/resident.rs). Same canonical orders as above;
// each is checked against the one-thread references by gpu_check.

// The canonical dot of x (k floats) with a weight row, on a whole warp, in
// matmul_warp's order; every lane returns the same total.
__device__ __forceinline__ float warp_dot(int kind, const float* x, const void* row, int k) {
    int lane = threadIdx.x & 31;
    int g = lane >> 3, j = lane & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    float total = 0.0f;
    for (int q = 0; q < chunks; q += 4) {
        int c = q + g;
        float l = 0.0f;
        if (c < chunks) {
            int cend = min(c * CHUNK + CHUNK, k);
            for (int i = c * CHUNK + j; i < cend; i += LANES) l = fmaf(x[i], weight(kind, row, i), l);
        }
        l = l + __shfl_xor_sync(0xffffffffu, l, 4);
        l = l + __shfl_xor_sync(0xffffffffu, l, 2);
        l = l + __shfl_xor_sync(0xffffffffu, l, 1);
        float p0 = __shfl_sync(0xffffffffu, l, 0);
        float p1 = __shfl_sync(0xffffffffu, l, 8);
        float p2 = __shfl_sync(0xffffffffu, l, 16);
        float p3 = __shfl_sync(0xffffffffu, l, 24);
        total = total + p0;
        if (q + 1 < chunks) total = total + p1;
        if (q + 2 < chunks) total = total + p2;
        if (q + 3 < chunks) total = total + p3;
    }
    return total;
}

#define MM_TOKENS 8
#define MM_GROUPS 1

// matmul over tiles of MM_TOKENS tokens: one warp per (output row, token
// tile). The warp loads its lanes' weights of MM_GROUPS groups of four
// chunks at once into registers (so that many loads are in flight) and runs
// every token of the tile against them, each token in matmul_warp's exact
// order (lane j's FMA chain of chunk 4q + g, the xor-shuffle tree, chunk
// partials in chunk order): a weight row is read once per tile instead of
// once per token. Warps are ordered row-fastest, so neighbouring warps
// stream neighbouring rows.
extern "C" __global__ void matmul_tile(int kind, const float* x, const unsigned char* w, float* y,
                                       int n, int rows, int k, long long row_bytes) {
    PDL_ENTRY();
    long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    int tiles = (n + MM_TOKENS - 1) / MM_TOKENS;
    if (warp >= (long long)rows * tiles) return;  // uniform over the warp
    int o = (int)(warp % rows), t0 = (int)(warp / rows) * MM_TOKENS;
    int tn = min(MM_TOKENS, n - t0);
    const unsigned char* wr = w + o * row_bytes;
    int g = lane >> 3, j = lane & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    float total[MM_TOKENS];
    #pragma unroll
    for (int tt = 0; tt < MM_TOKENS; ++tt) total[tt] = 0.0f;
    for (int q0 = 0; q0 < chunks; q0 += 4 * MM_GROUPS) {
        float wv[MM_GROUPS][CHUNK / LANES];
        #pragma unroll
        for (int gq = 0; gq < MM_GROUPS; ++gq) {
            int c = q0 + 4 * gq + g;
            int base = c * CHUNK + j;
            int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
            #pragma unroll
            for (int s = 0; s < CHUNK / LANES; ++s) {
                int i = base + s * LANES;
                wv[gq][s] = i < cend ? weight(kind, wr, i) : 0.0f;
            }
        }
        #pragma unroll
        for (int tt = 0; tt < MM_TOKENS; ++tt) {
            if (tt < tn) {  // uniform over the warp
                const float* xr = x + (long long)(t0 + tt) * k;
                float tot = total[tt];
                #pragma unroll
                for (int gq = 0; gq < MM_GROUPS; ++gq) {
                    int q = q0 + 4 * gq;
                    if (q < chunks) {  // uniform over the warp
                        int c = q + g;
                        int base = c * CHUNK + j;
                        int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
                        float l = 0.0f;
                        #pragma unroll
                        for (int s = 0; s < CHUNK / LANES; ++s) {
                            int i = base + s * LANES;
                            if (i < cend) l = fmaf(xr[i], wv[gq][s], l);
                        }
                        l = l + __shfl_xor_sync(0xffffffffu, l, 4);
                        l = l + __shfl_xor_sync(0xffffffffu, l, 2);
                        l = l + __shfl_xor_sync(0xffffffffu, l, 1);
                        float p0 = __shfl_sync(0xffffffffu, l, 0);
                        float p1 = __shfl_sync(0xffffffffu, l, 8);
                        float p2 = __shfl_sync(0xffffffffu, l, 16);
                        float p3 = __shfl_sync(0xffffffffu, l, 24);
                        tot = tot + p0;
                        if (q + 1 < chunks) tot = tot + p1;
                        if (q + 2 < chunks) tot = tot + p2;
                        if (q + 3 < chunks) tot = tot + p3;
                    }
                }
                total[tt] = tot;
            }
        }
    }
    if (lane == 0) {
        #pragma unroll
        for (int tt = 0; tt < MM_TOKENS; ++tt)
            if (tt < tn) y[(long long)(t0 + tt) * rows + o] = total[tt];
    }
}

#define MR_GROUPS 16
#define MR_MAX_CHUNKS 256

// The partials of matmul_rows for one (row wr of W, token tile t0 of tn
// tokens), made by the tid-th of MR_GROUPS · 8 threads (a warp-aligned set):
// part[tt][c] = chunk c's lane tree for token tt. With u non-null, the input
// is SwiGLU(x, u), each element computed as the swiglu kernel computes it
// (down's input made on the fly).
template <bool SWI = false>
__device__ __forceinline__ void mm_rows_partials(int kind, const float* x, const unsigned char* wr, int tn, int k,
                                                 int t0, int tid, float (*part)[MR_MAX_CHUNKS],
                                                 const float* u = nullptr) {
    int g = tid >> 3, j = tid & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    // The loop is uniform over each warp (shuffles need all its lanes).
    for (int cb = 0; cb < chunks; cb += MR_GROUPS) {
        int c = cb + g;
        int base = c * CHUNK + j;
        int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
        float wv[CHUNK / LANES];
        #pragma unroll
        for (int s = 0; s < CHUNK / LANES; ++s) {
            int i = base + s * LANES;
            wv[s] = i < cend ? weight(kind, wr, i) : 0.0f;
        }
        if (cb == 0) PDL_ENTRY_LATE();  // the first weights in flight; now the inputs
        #pragma unroll
        for (int tt = 0; tt < MM_TOKENS; ++tt) {
            if (tt < tn) {  // uniform over the block
                const float* xr = x + (long long)(t0 + tt) * k;
                float l = 0.0f;
                #pragma unroll
                for (int s = 0; s < CHUNK / LANES; ++s) {
                    int i = base + s * LANES;
                    if (i < cend) {
                        float xv = SWI ? swiglu_of(xr[i], u[(long long)(t0 + tt) * k + i]) : xr[i];
                        l = fmaf(xv, wv[s], l);
                    }
                }
                l = l + __shfl_xor_sync(0xffffffffu, l, 4);
                l = l + __shfl_xor_sync(0xffffffffu, l, 2);
                l = l + __shfl_xor_sync(0xffffffffu, l, 1);
                if (j == 0 && c < chunks) part[tt][c] = l;
            }
        }
    }
    if (chunks == 0) PDL_ENTRY_LATE();  // no weights: wait all the same
}

// The body of matmul_rows for one (row o of W, token tile t0): the
// partials, then thread tt adds token tt's in chunk order from +0.0.
template <bool SWI = false>
__device__ __forceinline__ void mm_rows_block(int kind, const float* x, const unsigned char* w, float* y,
                                              int n, int rows, int k, long long row_bytes, int o, int t0,
                                              const float* u = nullptr) {
    __shared__ float part[MM_TOKENS][MR_MAX_CHUNKS];
    int tn = min(MM_TOKENS, n - t0);
    int chunks = (k + CHUNK - 1) / CHUNK;
    mm_rows_partials<SWI>(kind, x, w + o * row_bytes, tn, k, t0, threadIdx.x, part, u);
    __syncthreads();
    if (threadIdx.x < tn) {
        int tt = threadIdx.x;
        float total = 0.0f;
        for (int c = 0; c < chunks; ++c) total = total + part[tt][c];
        y[(long long)(t0 + tt) * rows + o] = total;
    }
}

// matmul with one block of MR_GROUPS groups of 8 threads per (output row,
// tile of MM_TOKENS tokens): group g computes the partials of chunks g,
// g + MR_GROUPS, ... (lane j's FMA chain, the xor-shuffle tree inside the
// group), each chunk's weights loaded once into registers and run against
// every token of the tile; then thread tt adds token tt's chunk partials in
// chunk order from +0.0. The same bits as matmul_warp with the chunks of a
// row in flight at once (decode latency), for k up to 64 * MR_MAX_CHUNKS.
extern "C" __global__ void matmul_rows(int kind, const float* x, const unsigned char* w, float* y,
                                       int n, int rows, int k, long long row_bytes) {
    PDL_ENTRY_EARLY();
    mm_rows_block(kind, x, w, y, n, rows, k, row_bytes, blockIdx.x % rows, (blockIdx.x / rows) * MM_TOKENS);
}

// matmul_rows with MR4_ROWS rows a block (LMRR_CUDA_ROWS4_MIN: wide
// matrices, the lm head): the same 16 groups of 8 threads, group g taking
// chunks g, g + MR_GROUPS, ... of all MR4_ROWS rows, each chunk's weights of
// the rows loaded at once (4 × 8 loads in flight a thread, not 8); then, per
// row and token, matmul_rows' lane chain (elements j + 8s, s ascending, from
// 0.0), the xor tree 4, 2, 1 and thread r·8 + tt adding row r's chunk
// partials for token tt in chunk order from +0.0: matmul_rows' operations
// in its order, a quarter of its blocks. k ≤ 64 · MR4_MAX_CHUNKS.
#define MR4_ROWS 4
#define MR4_MAX_CHUNKS 64
// The body of matmul_rows4 and matmul_multi4 for rows o0 .. o0 + MR4_ROWS
// (those below `rows`) of W and token tile t0.
__device__ __forceinline__ void mm_rows4_block(int kind, const float* x, const unsigned char* w, float* y, int n,
                                               int rows, int k, long long row_bytes, int o0, int t0) {
    __shared__ float part4[MR4_ROWS][MM_TOKENS][MR4_MAX_CHUNKS];
    int tn = min(MM_TOKENS, n - t0);
    int g = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    // The loop is uniform over each warp (shuffles need all its lanes).
    for (int cb = 0; cb < chunks; cb += MR_GROUPS) {
        int c = cb + g;
        int base = c * CHUNK + j;
        int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
        float wv[MR4_ROWS][CHUNK / LANES];
        #pragma unroll
        for (int r = 0; r < MR4_ROWS; ++r) {
            bool live = o0 + r < rows;
            const unsigned char* wr = w + (long long)(live ? o0 + r : 0) * row_bytes;
            #pragma unroll
            for (int s = 0; s < CHUNK / LANES; ++s) {
                int i = base + s * LANES;
                wv[r][s] = live && i < cend ? weight(kind, wr, i) : 0.0f;
            }
        }
        if (cb == 0) PDL_ENTRY_LATE();  // the first weights in flight; now the inputs
        #pragma unroll
        for (int tt = 0; tt < MM_TOKENS; ++tt) {
            if (tt < tn) {  // uniform over the block
                const float* xr = x + (long long)(t0 + tt) * k;
                float xv[CHUNK / LANES];
                #pragma unroll
                for (int s = 0; s < CHUNK / LANES; ++s) {
                    int i = base + s * LANES;
                    xv[s] = i < cend ? xr[i] : 0.0f;
                }
                #pragma unroll
                for (int r = 0; r < MR4_ROWS; ++r) {
                    float l = 0.0f;
                    #pragma unroll
                    for (int s = 0; s < CHUNK / LANES; ++s) {
                        if (base + s * LANES < cend) l = fmaf(xv[s], wv[r][s], l);
                    }
                    l = l + __shfl_xor_sync(0xffffffffu, l, 4);
                    l = l + __shfl_xor_sync(0xffffffffu, l, 2);
                    l = l + __shfl_xor_sync(0xffffffffu, l, 1);
                    if (j == 0 && c < chunks) part4[r][tt][c] = l;
                }
            }
        }
    }
    if (chunks == 0) PDL_ENTRY_LATE();  // no weights: wait all the same
    __syncthreads();
    int r = threadIdx.x / MM_TOKENS, tt = threadIdx.x % MM_TOKENS;
    if (r < MR4_ROWS && tt < tn && o0 + r < rows) {
        float total = 0.0f;
        for (int c = 0; c < chunks; ++c) total = total + part4[r][tt][c];
        y[(long long)(t0 + tt) * rows + o0 + r] = total;
    }
}

extern "C" __global__ void matmul_rows4(int kind, const float* x, const unsigned char* w, float* y,
                                        int n, int rows, int k, long long row_bytes) {
    PDL_ENTRY_EARLY();
    int groups = (rows + MR4_ROWS - 1) / MR4_ROWS;
    mm_rows4_block(kind, x, w, y, n, rows, k, row_bytes, (int)(blockIdx.x % groups) * MR4_ROWS,
                   (int)(blockIdx.x / groups) * MM_TOKENS);
}

// Up to three matmuls of one input in one launch (q, k, v; gate, up): blocks
// 0 .. rows0·tiles are matrix 0's, then matrix 1's, then matrix 2's; each
// output as matmul_rows computes it.
extern "C" __global__ void matmul_multi(int kind, const float* x, int n, int k,
                                        const unsigned char* w0, float* y0, int rows0, long long rb0,
                                        const unsigned char* w1, float* y1, int rows1, long long rb1,
                                        const unsigned char* w2, float* y2, int rows2, long long rb2) {
    PDL_ENTRY_EARLY();
    int tiles = (n + MM_TOKENS - 1) / MM_TOKENS;
    int b = blockIdx.x;
    if (b < rows0 * tiles) {
        mm_rows_block(kind, x, w0, y0, n, rows0, k, rb0, b % rows0, (b / rows0) * MM_TOKENS);
        return;
    }
    b -= rows0 * tiles;
    if (b < rows1 * tiles) {
        mm_rows_block(kind, x, w1, y1, n, rows1, k, rb1, b % rows1, (b / rows1) * MM_TOKENS);
        return;
    }
    b -= rows1 * tiles;
    mm_rows_block(kind, x, w2, y2, n, rows2, k, rb2, b % rows2, (b / rows2) * MM_TOKENS);
}

// x += y, then out = rms_norm(x) * w, one warp per row (the residual add
// and the next block's norm in one launch; each value as the two kernels
// compute it).
extern "C" __global__ void add_norm(float* x, const float* y, const float* w, float* out, int rows, int d, float eps) {
    PDL_ENTRY();
    long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    float* xr = x + r * d;
    for (int i = lane; i < d; i += 32) xr[i] = xr[i] + y[r * d + i];
    __syncwarp();
    float ss = warp_dot(0, xr, xr, d);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = lane; i < d; i += 32) out[r * d + i] = (xr[i] * inv) * w[i];
}

// RMSNorm of one row per block of MR_GROUPS groups of 8 threads, after
// x += y when `add` (the residual add and the next block's norm in one
// launch): group g computes the sum-of-squares partials of chunks g,
// g + MR_GROUPS, ... (lane chains, the xor-shuffle tree), thread 0 adds them
// in chunk order, and every thread writes (x * inv) * w for its elements:
// rms_norm's bits with a row's chunks in flight at once (rms_norm_warp walks
// them one after another). d ≤ 64 * MR_MAX_CHUNKS.
extern "C" __global__ void norm_block(float* x, const float* y, const float* ypart, int ychunks, const float* w,
                                      float* out, int rows, int d, float eps, int add) {
    PDL_ENTRY();
    __shared__ float part[MR_MAX_CHUNKS];
    __shared__ float inv_s;
    long long r = blockIdx.x;
    if (r >= rows) return;  // uniform over the block
    float* xr = x + r * d;
    if (add) {
        for (int i = threadIdx.x; i < d; i += blockDim.x)
            xr[i] = xr[i] + split_value(y, ypart, ychunks, (long long)rows * d, r * d + i);
        __syncthreads();
    }
    int g = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (d + CHUNK - 1) / CHUNK;
    for (int cb = 0; cb < chunks; cb += MR_GROUPS) {
        int c = cb + g;
        int cend = c < chunks ? min(c * CHUNK + CHUNK, d) : 0;
        float l = 0.0f;
        for (int i = c * CHUNK + j; i < cend; i += LANES) l = fmaf(xr[i], xr[i], l);
        l = l + __shfl_xor_sync(0xffffffffu, l, 4);
        l = l + __shfl_xor_sync(0xffffffffu, l, 2);
        l = l + __shfl_xor_sync(0xffffffffu, l, 1);
        if (j == 0 && c < chunks) part[c] = l;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (int c = 0; c < chunks; ++c) ss = ss + part[c];
        inv_s = 1.0f / sqrtf(ss / (float)d + eps);
    }
    __syncthreads();
    float inv = inv_s;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[r * d + i] = (xr[i] * inv) * w[i];
}

// norm_block with the row in registers: one block of 8·chunks threads
// (rounded up to a warp) per row, group c of 8 threads holding chunk c
// (thread j its elements 64c + j + 8s, s ascending, with their weights
// loaded at the start), so the row is read once, the residual add, the
// lane chains and the output all run on registers, and one barrier joins
// the chunk partials, which every thread adds in chunk order from +0.0:
// norm_block's operations, in its order. d ≤ 64 · NR_MAX_CHUNKS.
// LOADS_FIRST (norm_reg_lf): every residual value loaded before the first
// sum is stored. x and y are plain pointers, so the compiler must take them
// to alias and cannot move a load of y above a store to x: the default form
// makes each of a thread's elements a round trip (the same values either
// way). Faster alone (ncu on an H100: 3.24 against 4.64 µs a batch-1 norm)
// and in prefill, slower in a batch-1 decode chain under programmatic
// dependent launch, so the host picks by row count (Tuning::loads_first_min).
#define NR_MAX_CHUNKS 128
// Row r of norm_reg's work (its body, and the last block of
// matmul_rows_norm). WAIT: the PDL wait after the norm weight's loads
// (norm_reg; matmul_rows_norm has waited already). CG: y read through L2
// (ld.global.cg), for y written by other blocks of the same launch.
template <bool LOADS_FIRST, bool WAIT, bool CG>
__device__ __forceinline__ void norm_reg_row(float* x, const float* y, const float* ypart, int ychunks,
                                             const float* w, float* out, int rows, int d, float eps, int add,
                                             long long r) {
    __shared__ float part[NR_MAX_CHUNKS];
    int c = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (d + CHUNK - 1) / CHUNK;
    int base = c * CHUNK + j;
    int cend = c < chunks ? min(c * CHUNK + CHUNK, d) : 0;
    float* xr = x + r * d;
    float xv[CHUNK / LANES], wv[CHUNK / LANES];
    #pragma unroll
    for (int s = 0; s < CHUNK / LANES; ++s) {
        int i = base + s * LANES;
        wv[s] = i < cend ? w[i] : 0.0f;
    }
    if (WAIT) PDL_ENTRY_LATE();  // the norm weight in flight; now the row
    #pragma unroll
    for (int s = 0; s < CHUNK / LANES; ++s) {
        int i = base + s * LANES;
        xv[s] = i < cend ? xr[i] : 0.0f;
    }
    if (add && LOADS_FIRST) {
        // Every y value loaded before any x store: one round trip for the
        // row rather than one per element.
        float yv[CHUNK / LANES];
        #pragma unroll
        for (int s = 0; s < CHUNK / LANES; ++s) {
            int i = base + s * LANES;
            yv[s] = i < cend ? split_value(y, ypart, ychunks, (long long)rows * d, r * d + i) : 0.0f;
        }
        #pragma unroll
        for (int s = 0; s < CHUNK / LANES; ++s) {
            int i = base + s * LANES;
            if (i < cend) {
                xv[s] = xv[s] + yv[s];
                xr[i] = xv[s];
            }
        }
    } else if (add) {
        #pragma unroll
        for (int s = 0; s < CHUNK / LANES; ++s) {
            int i = base + s * LANES;
            if (i < cend) {
                xv[s] = xv[s] + (CG ? __ldcg(y + r * d + i)
                                    : split_value(y, ypart, ychunks, (long long)rows * d, r * d + i));
                xr[i] = xv[s];
            }
        }
    }
    float l = 0.0f;
    #pragma unroll
    for (int s = 0; s < CHUNK / LANES; ++s) {
        if (base + s * LANES < cend) l = fmaf(xv[s], xv[s], l);
    }
    l = l + __shfl_xor_sync(0xffffffffu, l, 4);
    l = l + __shfl_xor_sync(0xffffffffu, l, 2);
    l = l + __shfl_xor_sync(0xffffffffu, l, 1);
    if (j == 0 && c < chunks) part[c] = l;
    __syncthreads();
    float ss = 0.0f;
    for (int q = 0; q < chunks; ++q) ss = ss + part[q];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    #pragma unroll
    for (int s = 0; s < CHUNK / LANES; ++s) {
        int i = base + s * LANES;
        if (i < cend) out[r * d + i] = (xv[s] * inv) * wv[s];
    }
}

template <bool LOADS_FIRST>
__device__ __forceinline__ void norm_reg_body(float* x, const float* y, const float* ypart, int ychunks,
                                              const float* w, float* out, int rows, int d, float eps, int add) {
    long long r = blockIdx.x;
    if (r >= rows) return;  // uniform over the block
    norm_reg_row<LOADS_FIRST, true, false>(x, y, ypart, ychunks, w, out, rows, d, eps, add, r);
}

extern "C" __global__ void norm_reg(float* x, const float* y, const float* ypart, int ychunks, const float* w,
                                    float* out, int rows, int d, float eps, int add) {
    PDL_ENTRY_EARLY();
    norm_reg_body<false>(x, y, ypart, ychunks, w, out, rows, d, eps, add);
}

extern "C" __global__ void norm_reg_lf(float* x, const float* y, const float* ypart, int ychunks, const float* w,
                                       float* out, int rows, int d, float eps, int add) {
    PDL_ENTRY_EARLY();
    norm_reg_body<true>(x, y, ypart, ychunks, w, out, rows, d, eps, add);
}

#define GM_GR 4
#define GM_GT 2
#define GM_ROWS (8 * GM_GR)
#define GM_TOKS (8 * GM_GT)
#define GM_THREADS (64 * GM_GR * GM_GT / 8)
// matmul_gemm_wide: 64 rows × 32 tokens, 256 threads (half the staged
// loads per FMA, for steps of many tokens).
#define GW_GR 8
#define GW_GT 4
#define GW_ROWS (8 * GW_GR)
#define GW_TOKS (8 * GW_GT)
#define GW_THREADS (64 * GW_GR * GW_GT / 8)

// The lane tree of 8 lanes over 8 outputs at once, the outputs owned by
// xor: the thread of lane j holds in v[q] its lane's partial of output q ^ j.
// Three exchange steps (lanes xor 4, 2, 1; the lane is bits 2..4 of the
// thread index, so the shuffle masks are 16, 8, 4) each keep the lower half
// of v and add the partner's upper half, which holds the same outputs: the
// partner's v[q + 4] is output (q + 4) ^ (j ^ 4) = q ^ j. Lane j is left with
// output j's tree. Every add is one of the canonical tree's pairs ((0,4)
// (1,5) (2,6) (3,7), then (0,2) (1,3), then (0,1)), its operands possibly
// swapped (IEEE addition is commutative); no lane selects which half to keep.
__device__ __forceinline__ float tree8_xor(const float v[8]) {
    float w4[4];
    #pragma unroll
    for (int q = 0; q < 4; ++q) w4[q] = v[q] + __shfl_xor_sync(0xffffffffu, v[q + 4], 16);
    float w2[2];
    #pragma unroll
    for (int q = 0; q < 2; ++q) w2[q] = w4[q] + __shfl_xor_sync(0xffffffffu, w4[q + 2], 8);
    return w2[0] + __shfl_xor_sync(0xffffffffu, w2[1], 4);
}

// matmul for many tokens (prefill, batched decode): one block of GM_THREADS
// per GM_ROWS rows × GM_TOKS tokens. Per chunk, the block stages the chunk's
// widened weights of its rows and its tokens' inputs in shared memory; group
// (ri, ti) of 8 threads owns 8 rows × 8 tokens, the thread of lane j running
// lane j's FMA chain (elements 64c + j + 8s, s ascending) of all 64 outputs,
// so each staged value feeds 8 FMAs. The lane trees are taken 8 outputs at a
// time by tree8_xor, and the thread of lane j adds row j's chunk partial to
// its 8 tokens' totals in chunk order from +0.0: matmul_warp's bits. A
// staged zero past the end of k adds fma(0, 0, acc) = acc (or +0.0 for a
// lane at -0.0, which no later add can tell apart: a total starts at +0.0).
//
// Shared memory traffic is what bounds this kernel, so:
// - staged lane-major: a row's chunk holds lane l's 8 values (elements
//   l + 8s) together at l·8, the two halves swapped for lanes 4..7
//   (gm_pos), so a thread reads two of its lane's values in one 8-byte load
//   and a warp's 8 lanes hit 16 distinct banks; the rows of 8-row cell c
//   sit 2·c floats further (gm_row), so the two cells a warp reads (2m and
//   2m + 1) fill all 32;
// - a warp is 8 lanes × 2 row cells × 2 token cells, the row cell in bit 0
//   of the thread index and the token cell in bit 1: threads t and t ^ 1
//   read the same inputs, t and t ^ 2 the same weights, which lets the
//   hardware return an 8-byte load in one pass instead of two;
// - lane j keeps its 8 rows' partials in xor order (acc[.][q]: row q ^ j),
//   so the tree exchanges without selects.
//
// Split over chunks (part non-null; for steps whose tiles are too few to
// fill the device): block (tile, g) runs chunks [g·cpb, g·cpb + cpb) only
// and stores each chunk's partial at part[(c·n + t)·rows + o]; sum_chunks
// then adds them in chunk order from +0.0, the same adds.
//
// gemm_tiles<GR, GT, PF> is the body: GR·8 rows × GT·8 tokens per block of
// 8·GR·GT threads (GR, GT even); matmul_gemm (4, 2), matmul_gemm_wide
// (8, 4) and matmul_gemm_pipelined (8, 4, staging pipelined) differ in tile
// and staging only, never in any output's operations.
// Staged value e of a block's chunk at c0 (ragged at cend): weight row
// o0 + e / CHUNK, or input token t0 + e / CHUNK; 0 outside the matrix.
__device__ __forceinline__ float gm_weight(int kind, const unsigned char* w, long long row_bytes, int rows,
                                           int o0, int c0, int cend, int e) {
    int wr = o0 + e / CHUNK, i = c0 + e % CHUNK;
    return (wr < rows && i < cend) ? weight(kind, w + wr * row_bytes, i) : 0.0f;
}

__device__ __forceinline__ float gm_input(const float* x, int n, int k, int t0, int c0, int cend, int e) {
    int t = t0 + e / CHUNK, i = c0 + e % CHUNK;
    return (t < n && i < cend) ? x[(long long)t * k + i] : 0.0f;
}

// Where staged element i (0..63) of a chunk sits within its row, and where
// staged row r starts (see gemm_tiles' layout notes).
__device__ __forceinline__ int gm_pos(int i) { return (i & 7) * 8 + ((i >> 3) ^ (i & 4)); }
__device__ __forceinline__ int gm_row(int r) { return r * CHUNK + (r >> 3) * 2; }
__device__ __forceinline__ int gm_at(int e) { return gm_row(e / CHUNK) + gm_pos(e % CHUNK); }
// Floats of a staged tile of `r` rows (the cells' offsets included).
#define GM_STAGE(r) ((r) * CHUNK + (r) / 8 * 2)

// A thread's share of a chunk's staging, into registers: staged element
// tid + q·THREADS of the weights (wreg) and of the inputs (xreg). On an
// interior tile of f32 weights over a whole chunk (fast), every element
// is in the matrix and the address of element q is a stride from the
// first one: one load each, no storage switch and no bounds; otherwise
// gm_weight and gm_input, element by element. The values are the same.
template <int R, int T, int THREADS>
__device__ __forceinline__ void gm_fetch(int kind, const float* x, const unsigned char* w, int n, int rows, int k,
                                         long long row_bytes, int o0, int t0, int c0, float* wreg, float* xreg) {
    const int WPT = R * CHUNK / THREADS, XPT = T * CHUNK / THREADS, RPQ = THREADS / CHUNK;
    int tid = threadIdx.x, cend = min(c0 + CHUNK, k);
    bool fast = kind == 0 && o0 + R <= rows && t0 + T <= n && c0 + CHUNK <= k;
    if (fast) {
        long long rs = row_bytes / 4;
        const float* wp = (const float*)w + (long long)(o0 + tid / CHUNK) * rs + c0 + tid % CHUNK;
        #pragma unroll
        for (int q = 0; q < WPT; ++q) wreg[q] = wp[(long long)q * RPQ * rs];
        const float* xp = x + (long long)(t0 + tid / CHUNK) * k + c0 + tid % CHUNK;
        #pragma unroll
        for (int q = 0; q < XPT; ++q) xreg[q] = xp[(long long)q * RPQ * k];
    } else {
        #pragma unroll
        for (int q = 0; q < WPT; ++q) wreg[q] = gm_weight(kind, w, row_bytes, rows, o0, c0, cend, tid + q * THREADS);
        #pragma unroll
        for (int q = 0; q < XPT; ++q) xreg[q] = gm_input(x, n, k, t0, c0, cend, tid + q * THREADS);
    }
}

// gm_fetch and the stores of its values, for the unpipelined forms: on the
// slow path each value goes straight to shared memory (no register array
// held across the loop).
template <int R, int T, int THREADS>
__device__ __forceinline__ void gm_stage(int kind, const float* x, const unsigned char* w, int n, int rows, int k,
                                         long long row_bytes, int o0, int t0, int c0, float* ws, float* xs) {
    const int WPT = R * CHUNK / THREADS, XPT = T * CHUNK / THREADS;
    int tid = threadIdx.x, cend = min(c0 + CHUNK, k);
    if (kind == 0 && o0 + R <= rows && t0 + T <= n && c0 + CHUNK <= k) {
        float wreg[WPT], xreg[XPT];
        gm_fetch<R, T, THREADS>(kind, x, w, n, rows, k, row_bytes, o0, t0, c0, wreg, xreg);
        #pragma unroll
        for (int q = 0; q < WPT; ++q) ws[gm_at(tid + q * THREADS)] = wreg[q];
        #pragma unroll
        for (int q = 0; q < XPT; ++q) xs[gm_at(tid + q * THREADS)] = xreg[q];
    } else {
        for (int e = tid; e < R * CHUNK; e += THREADS) ws[gm_at(e)] = gm_weight(kind, w, row_bytes, rows, o0, c0, cend, e);
        for (int e = tid; e < T * CHUNK; e += THREADS) xs[gm_at(e)] = gm_input(x, n, k, t0, c0, cend, e);
    }
}

// PF (pipelined): each thread loads its share of the next chunk into
// registers while the block computes on the current one, and stores it to
// shared memory after the barrier; without PF it loads and stores it before
// the barrier. The staged values, and so the bits, are the same.
template <int GR, int GT, bool PF>
__device__ __forceinline__ void gemm_tiles(int kind, const float* x, const unsigned char* w, float* y,
                                           int n, int rows, int k, long long row_bytes, float* part, int cpb,
                                           float* ws, float* xs, int blk) {
    const int R = 8 * GR, T = 8 * GT, THREADS = 8 * GR * GT, HR = GR / 2;
    // Staged values per thread (R·CHUNK and T·CHUNK are multiples of THREADS).
    const int WPT = R * CHUNK / THREADS, XPT = T * CHUNK / THREADS;
    float wreg[PF ? WPT : 1], xreg[PF ? XPT : 1];
    int row_blocks = (rows + R - 1) / R;
    int tiles = row_blocks * ((n + T - 1) / T);
    int tile = blk % tiles, group = blk / tiles;
    int o0 = (tile % row_blocks) * R, t0 = (tile / row_blocks) * T;
    int tid = threadIdx.x;
    int j = (tid >> 2) & 7, wi = tid >> 5;
    int ri = (wi % HR) * 2 + (tid & 1), ti = (wi / HR) * 2 + ((tid >> 1) & 1);
    int o = o0 + ri * 8 + j;
    // This lane's values in row cell ri (row q ^ j at wb + ((q ^ j) << 6))
    // and token cell ti (token tt at xb + (tt << 6)); sw: the half swap.
    int wb = gm_row(ri * 8) + j * 8, xb = gm_row(ti * 8) + j * 8, jx = j << 6, sw = j & 4;
    int chunks = (k + CHUNK - 1) / CHUNK;
    int cfirst = part ? group * cpb : 0;
    int clast = part ? min(chunks, cfirst + cpb) : chunks;
    float total[8];
    #pragma unroll
    for (int tt = 0; tt < 8; ++tt) total[tt] = 0.0f;
    if (PF && cfirst < clast)
        gm_fetch<R, T, THREADS>(kind, x, w, n, rows, k, row_bytes, o0, t0, cfirst * CHUNK, wreg, xreg);
    for (int c = cfirst; c < clast; ++c) {
        int c0 = c * CHUNK;
        if (PF) {
            #pragma unroll
            for (int q = 0; q < WPT; ++q) ws[gm_at(tid + q * THREADS)] = wreg[q];
            #pragma unroll
            for (int q = 0; q < XPT; ++q) xs[gm_at(tid + q * THREADS)] = xreg[q];
        } else {
            gm_stage<R, T, THREADS>(kind, x, w, n, rows, k, row_bytes, o0, t0, c0, ws, xs);
        }
        __syncthreads();
        // The next chunk's loads are in flight during this one's FMAs.
        if (PF && c + 1 < clast)
            gm_fetch<R, T, THREADS>(kind, x, w, n, rows, k, row_bytes, o0, t0, c0 + CHUNK, wreg, xreg);
        float acc[8][8];
        #pragma unroll
        for (int tt = 0; tt < 8; ++tt) {
            #pragma unroll
            for (int q = 0; q < 8; ++q) acc[tt][q] = 0.0f;
        }
        // Steps s = 2·sp and 2·sp + 1 of lane j, in that order, per output
        // (not unrolled: unrolled, the compiler hoists every step's loads
        // and needs twice the registers, halving the blocks an SM holds).
        #pragma unroll 1
        for (int sp = 0; sp < CHUNK / LANES / 2; ++sp) {
            int so = (2 * sp) ^ sw;
            float2 wv[8];
            #pragma unroll
            for (int q = 0; q < 8; ++q) wv[q] = *(const float2*)(ws + wb + ((q << 6) ^ jx) + so);
            #pragma unroll
            for (int th = 0; th < 2; ++th) {
                float2 xv[4];
                #pragma unroll
                for (int u = 0; u < 4; ++u) xv[u] = *(const float2*)(xs + xb + ((th * 4 + u) << 6) + so);
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    #pragma unroll
                    for (int q = 0; q < 8; ++q) acc[th * 4 + u][q] = fmaf(xv[u].x, wv[q].x, acc[th * 4 + u][q]);
                }
                #pragma unroll
                for (int u = 0; u < 4; ++u) {
                    #pragma unroll
                    for (int q = 0; q < 8; ++q) acc[th * 4 + u][q] = fmaf(xv[u].y, wv[q].y, acc[th * 4 + u][q]);
                }
            }
        }
        if (part) {
            #pragma unroll
            for (int tt = 0; tt < 8; ++tt) {
                float p = tree8_xor(acc[tt]);
                int t = t0 + ti * 8 + tt;
                if (o < rows && t < n) part[((long long)c * n + t) * rows + o] = p;
            }
        } else {
            #pragma unroll
            for (int tt = 0; tt < 8; ++tt) total[tt] = total[tt] + tree8_xor(acc[tt]);
        }
        __syncthreads();
    }
    if (!part && o < rows) {
        #pragma unroll
        for (int tt = 0; tt < 8; ++tt) {
            int t = t0 + ti * 8 + tt;
            if (t < n) y[(long long)t * rows + o] = total[tt];
        }
    }
}

extern "C" __global__ void __launch_bounds__(GM_THREADS) matmul_gemm(int kind, const float* x, const unsigned char* w, float* y,
                                       int n, int rows, int k, long long row_bytes, float* part, int cpb) {
    PDL_ENTRY();
    __shared__ __align__(16) float ws[GM_STAGE(GM_ROWS)];
    __shared__ __align__(16) float xs[GM_STAGE(GM_TOKS)];
    gemm_tiles<GM_GR, GM_GT, false>(kind, x, w, y, n, rows, k, row_bytes, part, cpb, ws, xs, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(GW_THREADS, 2) matmul_gemm_wide(int kind, const float* x, const unsigned char* w, float* y,
                                            int n, int rows, int k, long long row_bytes, float* part, int cpb) {
    PDL_ENTRY();
    __shared__ __align__(16) float ws[GM_STAGE(GW_ROWS)];
    __shared__ __align__(16) float xs[GM_STAGE(GW_TOKS)];
    gemm_tiles<GW_GR, GW_GT, false>(kind, x, w, y, n, rows, k, row_bytes, part, cpb, ws, xs, blockIdx.x);
}

// Up to three matmul_gemm_wide passes over one input x (n, k) in one
// launch: matrix m takes blocks [b_m, b_m + blocks_m) in order, each block
// exactly the block it is in its own launch (split when part_m is non-null,
// cpb_m chunks a block), so every output, or partial, has its own launch's
// bits. A matrix of 0 blocks is absent.
#define GEMM_MULTI_ARGS(m) const unsigned char *w##m, float *y##m, int rows##m, long long rb##m, float *part##m, int cpb##m, int blocks##m
extern "C" __global__ void __launch_bounds__(GW_THREADS, 2) matmul_gemm_multi(int kind, const float* x, int n, int k,
                                                                            GEMM_MULTI_ARGS(0), GEMM_MULTI_ARGS(1),
                                                                            GEMM_MULTI_ARGS(2)) {
    PDL_ENTRY();
    __shared__ __align__(16) float ws[GM_STAGE(GW_ROWS)];
    __shared__ __align__(16) float xs[GM_STAGE(GW_TOKS)];
    int b = blockIdx.x;  // uniform over the block
    if (b < blocks0) {
        gemm_tiles<GW_GR, GW_GT, false>(kind, x, w0, y0, n, rows0, k, rb0, part0, cpb0, ws, xs, b);
    } else if (b < blocks0 + blocks1) {
        gemm_tiles<GW_GR, GW_GT, false>(kind, x, w1, y1, n, rows1, k, rb1, part1, cpb1, ws, xs, b - blocks0);
    } else {
        gemm_tiles<GW_GR, GW_GT, false>(kind, x, w2, y2, n, rows2, k, rb2, part2, cpb2, ws, xs, b - blocks0 - blocks1);
    }
}

// The chunk partials of a split matmul_gemm summed in chunk order from
// +0.0: y[i] = ((0 + part[0][i]) + part[1][i]) + …, over count = n·rows.
extern "C" __global__ void sum_chunks(const float* part, float* y, int chunks, long long count) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    y[i] = split_value(y, part, chunks, count, i);
}

// rms_norm with one warp per row (the sum of squares by warp_dot).
extern "C" __global__ void rms_norm_warp(const float* x, const float* w, float* out, int rows, int d, float eps) {
    PDL_ENTRY();
    long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* xr = x + r * d;
    float ss = warp_dot(0, xr, xr, d);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = lane; i < d; i += 32) out[r * d + i] = (xr[i] * inv) * w[i];
}

// Embedding rows: out[t][c] = widened weight c of row ids[t].
extern "C" __global__ void embed_rows(int kind, const unsigned char* w, const unsigned long long* ids,
                                      float* out, int n, int d, long long row_bytes) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    out[idx] = weight(kind, w + (long long)ids[t] * row_bytes, c);
}

// x[i] += y[i], y read through split_value.
extern "C" __global__ void add_rows(float* x, const float* y, const float* part, int chunks, int n) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + split_value(y, part, chunks, n, i);
}

// out[j] = x[rows[j]] (rows of d floats).
extern "C" __global__ void gather_rows(const float* x, const unsigned long long* rows, float* out, int m, int d) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)m * d) return;
    long long j = idx / d;
    int c = (int)(idx % d);
    out[idx] = x[(long long)rows[j] * d + c];
}

// A paged KV page on the device: per layer, page_len K rows then page_len V
// rows (kv_dim floats each) then page_len auxiliary rows (aux floats), at
// the device address the page table holds.
__device__ __forceinline__ float* kv_row(unsigned long long page, int layer, int page_len, int kvd, int aux,
                                         int slot, int which) {
    long long layer_stride = (long long)page_len * (2 * kvd + aux);
    return (float*)page + layer * layer_stride + (long long)which * page_len * kvd + (long long)slot * kvd;
}

// RoPE of n query rows (qd) and key rows (kvd) at positions pos[t], and the
// rotated K rows with the V rows written into token t's page dst[t], slot
// slot[t], of `layer` (RoPE then the page writes, in one launch). q, k and
// v are read through split_value (qpart, kpart, vpart: the partials of a
// split q, k or v matmul, summed here): the rows are then written to q, k
// and v as well, as sum_chunks would have left them before the rotation.
extern "C" __global__ void rope_kv(float* q, float* k, float* v, const float* qpart, const float* kpart,
                                   const float* vpart, int chunks, const float* cos_t, const float* sin_t,
                                   const unsigned long long* pos, const unsigned long long* dst,
                                   const unsigned long long* slot, int n, int qd, int kvd, int d,
                                   int layer, int page_len, int aux) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int h = d / 2;
    int per = qd / 2 + kvd / 2 + kvd;
    if (idx >= (long long)n * per) return;
    long long t = idx / per;
    int r = (int)(idx % per);
    int s = (int)slot[t];
    if (r >= qd / 2 + kvd / 2) {
        int c = r - qd / 2 - kvd / 2;
        float val = split_value(v, vpart, chunks, (long long)n * kvd, t * kvd + c);
        if (vpart) v[t * kvd + c] = val;
        kv_row(dst[t], layer, page_len, kvd, aux, s, 1)[c] = val;
        return;
    }
    bool is_k = r >= qd / 2;
    int width = is_k ? kvd : qd;
    float* base = is_k ? k : q;
    float* row = base + t * width;
    const float* part = is_k ? kpart : qpart;
    if (is_k) r -= qd / 2;
    int head = r / h, i = r % h;
    float* p = row + head * d;
    const float* c = cos_t + (long long)pos[t] * h;
    const float* sn = sin_t + (long long)pos[t] * h;
    long long at = t * width + head * d + i;
    float a = split_value(base, part, chunks, (long long)n * width, at);
    float b = split_value(base, part, chunks, (long long)n * width, at + h);
    float lo = a * c[i] - b * sn[i];
    float hi = b * c[i] + a * sn[i];
    p[i] = lo;
    p[i + h] = hi;
    if (is_k) {
        float* kr = kv_row(dst[t], layer, page_len, kvd, aux, s, 0) + head * d;
        kr[i] = lo;
        kr[i + h] = hi;
    }
}

#define ATTN_THREADS 256
#define SC_POS 2048
#define SC_TILES 64
#define ACC_T 4096
#define ATTN_BATCH 4

// Paged attention, one block of ATTN_THREADS per (token, head), with
// `attention`'s exact arithmetic but its tiles computed side by side: the
// canonical merge's only dependence between tiles is the running max, a
// cheap scan, so positions are taken in super-chunks of up to SC_TILES tiles
// and, per super-chunk:
//  1. every score s_j = dot_canon(q, k_j) * scale, by groups of 8 threads
//     (lane j's FMA chain of each chunk, the xor-shuffle tree, chunk partials
//     in order);
//  2. each tile's max, sequentially over its positions;
//  3. the running max m_new per tile, scanned in tile order from the last
//     super-chunk's, and alpha = det_exp(m_prev - m_new);
//  4. p_j = det_exp(s_j - m_new of j's tile);
//  5. each tile's lt = sum of its p in index order, and its acc_t[d] = the
//     fmaf chain of p_j * v_j[d] in index order;
//  6. the merge, tile by tile in order: l = l*alpha + lt,
//     acc[d] = acc[d]*alpha + acc_t[d].
// Every value is the one the one-thread kernel computes, by the same
// operations in the same order. Token t reads pages pages[seq_off[t] ..]
// (page_len positions each) up to pos[t].

// q's head for attention_body, at file scope so that a prologue can leave
// it there (attention_decode_rope_qs) rather than in global memory for the
// body to load again.
__shared__ float attn_qs[MAX_HEAD_DIM];

// The step's inputs of one decode-rope block (ATTN_EARLY, LMRR_CUDA_ATTN_EARLY):
// its position, page slot and page, its sequence's page-list offset, the
// cos/sin pair of its thread's rotation index (thread i < half rotates q's
// element pair i, thread 128 + i k's), and the pages of the first batch of
// K rows its group reads (positions u·32 + group, u < ATTN_BATCH). The host
// uploads these before a step's first kernel and no kernel writes them (the
// RoPE tables never change), so they may be loaded before the PDL wait: the
// same values, two or three dependent round trips off the chain after it.
struct DecodeIn {
    int pos, slot;
    unsigned long long dst, so;
    float c, sn;
    unsigned long long pg[4];
};

// QS: the caller has put q's head in attn_qs and passed a barrier since
// (decode_rope_prologue<true>), so the body neither loads it nor waits.
// EARLY: `ein` holds the block's inputs, loaded before the PDL wait
// (DecodeIn); its first batch of K rows takes its pages from there.
template <int BATCH, bool VPRE, bool PRE = false, bool QS = false, bool EARLY = false>
__device__ __forceinline__ void attention_body(const float* q, const unsigned long long* pages,
                                               const unsigned long long* seq_off,
                                               const unsigned long long* pos, float* out,
                                               int n_heads, int n_kv_heads, int head_dim, int layer,
                                               int page_len, int aux, float scale,
                                               const DecodeIn* ein = nullptr) {
    static_assert(!EARLY || BATCH <= 4, "DecodeIn holds four pages of a first batch");
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int tid = threadIdx.x;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    float* qs = attn_qs;
    __shared__ float sc[SC_POS];
    __shared__ float tm[SC_TILES], ta[SC_TILES], tl[SC_TILES];
    __shared__ float at[ACC_T];
    int tiles_per = min(SC_TILES, ACC_T / hd);
    int grp = tid >> 3, lane8 = tid & 7;
    // Positions below first_new were written by earlier steps (PRE only).
    int first_new = 0;
    float kpre[BATCH][CHUNK / LANES], vpre[VPRE ? ATTN_TILE : 1];
    if (PRE) {
        unsigned long long so = seq_off[t];
        int n = gridDim.x / n_heads;
        first_new = (int)pos[t];
        for (int u = t - 1; u >= 0 && seq_off[u] == so; --u) first_new = min(first_new, (int)pos[u]);
        for (int u = t + 1; u < n && seq_off[u] == so; ++u) first_new = min(first_new, (int)pos[u]);
        const unsigned long long* pt0 = pages + so;
        int npos0 = min(tiles_per * ATTN_TILE, (int)pos[t] + 1);
        int cend0 = min(CHUNK, hd);
        #pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            int jj = u * 32 + grp;
            bool old = jj < npos0 && jj < first_new;
            const float* kr = old ? kv_row(pt0[jj / page_len], layer, page_len, kvd, aux, jj % page_len, 0) + kvh * hd
                                  : nullptr;
            #pragma unroll
            for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                int i = lane8 + s2 * LANES;
                kpre[u][s2] = old && i < cend0 ? kr[i] : 0.0f;
            }
        }
        if (VPRE) {
            int ntiles0 = (npos0 + ATTN_TILE - 1) / ATTN_TILE;
            int tt = tid / hd, d = tid % hd;
            int j0 = tt * ATTN_TILE, cnt = tid < ntiles0 * hd ? min(ATTN_TILE, npos0 - j0) : 0;
            #pragma unroll
            for (int i = 0; i < (VPRE ? ATTN_TILE : 1); ++i) {
                int j = j0 + i;
                vpre[i] = i < cnt && j < first_new
                              ? kv_row(pt0[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d]
                              : 0.0f;
            }
        }
        PDL_ENTRY();
    }
    if (!QS) {
        for (int d = tid; d < hd; d += ATTN_THREADS) qs[d] = q[(long long)t * qd + h * hd + d];
        __syncthreads();
    }
    const unsigned long long* pt = pages + (EARLY ? ein->so : seq_off[t]);
    int p_end = EARLY ? ein->pos : (int)pos[t];
    float m = __int_as_float(0xff800000);  // -inf
    float l = 0.0f;
    float acc = 0.0f;  // dimension tid (tid < hd; MAX_HEAD_DIM == ATTN_THREADS)
    int chunks = (hd + CHUNK - 1) / CHUNK;
    for (int base = 0; base <= p_end; base += tiles_per * ATTN_TILE) {
        int npos = min(tiles_per * ATTN_TILE, p_end + 1 - base);
        int ntiles = (npos + ATTN_TILE - 1) / ATTN_TILE;
        // 1. Scores, BATCH positions per group at a time (their K loads in
        // flight together; each position's dot is the same whichever group
        // computes it). The loop is uniform over the warp
        // (shuffles need all lanes): dead groups compute on q and write
        // nothing.
        for (int jb = 0; jb < npos; jb += 32 * BATCH) {
            const float* kr[BATCH];
            float total[BATCH];
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                int jj = jb + u * 32 + grp;
                int j = base + jj;
                // EARLY: the first batch's pages came before the wait.
                unsigned long long pg = jj < npos ? (EARLY && base == 0 && jb == 0 ? ein->pg[u] : pt[j / page_len]) : 0;
                kr[u] = jj < npos ? kv_row(pg, layer, page_len, kvd, aux, j % page_len, 0) + kvh * hd : qs;
                total[u] = 0.0f;
            }
            for (int c = 0; c < chunks; ++c) {
                int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                float kv[BATCH][CHUNK / LANES], qv[CHUNK / LANES];
                #pragma unroll
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    int i = c0 + lane8 + s2 * LANES;
                    qv[s2] = i < cend ? qs[i] : 0.0f;
                    #pragma unroll
                    for (int u = 0; u < BATCH; ++u) {
                        // Loaded before the wait: base 0, the first batch, chunk 0, an old row.
                        bool pre = PRE && base == 0 && jb == 0 && c == 0 && u * 32 + grp < first_new;
                        kv[u][s2] = pre ? kpre[u][s2] : i < cend ? kr[u][i] : 0.0f;
                    }
                }
                #pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    float lv = 0.0f;
                    #pragma unroll
                    for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                        if (c0 + lane8 + s2 * LANES < cend) lv = fmaf(qv[s2], kv[u][s2], lv);
                    }
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);
                    total[u] = total[u] + lv;
                }
            }
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                int jj = jb + u * 32 + grp;
                if (jj < npos && lane8 == 0) sc[jj] = total[u] * scale;
            }
        }
        __syncthreads();
        // 2. Tile maxima.
        if (tid < ntiles) {
            int j0 = tid * ATTN_TILE, j1 = min(j0 + ATTN_TILE, npos);
            float mt = __int_as_float(0xff800000);
            for (int i = j0; i < j1; ++i) {
                float sv = sc[i];
                if (sv > mt) mt = sv;
            }
            tm[tid] = mt;
        }
        __syncthreads();
        // 3. Running max in tile order; ta holds the max before each tile.
        if (tid == 0) {
            float mr = m;
            for (int tt = 0; tt < ntiles; ++tt) {
                float mn = tm[tt] > mr ? tm[tt] : mr;
                ta[tt] = mr;
                tm[tt] = mn;
                mr = mn;
            }
        }
        __syncthreads();
        if (tid < ntiles) ta[tid] = det_exp(ta[tid] - tm[tid]);
        // 4. p.
        for (int i = tid; i < npos; i += ATTN_THREADS) sc[i] = det_exp(sc[i] - tm[i / ATTN_TILE]);
        __syncthreads();
        // 5. Per tile: lt, and acc_t for each dimension.
        if (tid < ntiles) {
            int j0 = tid * ATTN_TILE, j1 = min(j0 + ATTN_TILE, npos);
            float lt = 0.0f;
            for (int i = j0; i < j1; ++i) lt = lt + sc[i];
            tl[tid] = lt;
        }
        for (int pi = tid; pi < ntiles * hd; pi += ATTN_THREADS) {
            int tt = pi / hd, d = pi % hd;
            int j0 = tt * ATTN_TILE, cnt = min(ATTN_TILE, npos - j0);
            float a = 0.0f;
            if (VPRE) {
                // The tile's V values first, all in flight, then the chain.
                float vv[ATTN_TILE];
                #pragma unroll
                for (int i = 0; i < ATTN_TILE; ++i) {
                    int j = base + j0 + i;
                    // Loaded before the wait: base 0, this thread's first pair, an old row.
                    bool pre = PRE && base == 0 && pi == tid && j < first_new;
                    vv[i] = i < cnt ? (pre ? vpre[VPRE ? i : 0]
                                           : kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d])
                                    : 0.0f;
                }
                #pragma unroll
                for (int i = 0; i < ATTN_TILE; ++i) {
                    if (i < cnt) a = fmaf(sc[j0 + i], vv[i], a);
                }
            } else {
                #pragma unroll 8
                for (int i = 0; i < cnt; ++i) {
                    int j = base + j0 + i;
                    float vv = kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d];
                    a = fmaf(sc[j0 + i], vv, a);
                }
            }
            at[pi] = a;
        }
        __syncthreads();
        // 6. Merge in tile order.
        for (int tt = 0; tt < ntiles; ++tt) {
            float alpha = ta[tt];
            l = l * alpha + tl[tt];
            if (tid < hd) acc = acc * alpha + at[tt * hd + tid];
        }
        m = tm[ntiles - 1];
        __syncthreads();
    }
    if (tid < hd) out[(long long)t * qd + h * hd + tid] = acc / l;
}


// The throughput form: one position per group at a time, so that many
// blocks fit an SM (prefill, wide decode steps).
extern "C" __global__ void attention_paged(const float* q, const unsigned long long* pages,
                                           const unsigned long long* seq_off,
                                           const unsigned long long* pos, float* out,
                                           int n_heads, int n_kv_heads, int head_dim, int layer,
                                           int page_len, int aux, float scale) {
    PDL_ENTRY();
    attention_body<1, false>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer, page_len, aux,
                             scale);
}

// The latency form, for steps of fewer blocks than the device has SMs
// (small-batch decode): ATTN_BATCH positions per group at a time and each
// tile's V values loaded before its chain, so a block has its loads in
// flight together at the cost of registers. The same operations.
extern "C" __global__ void attention_decode(const float* q, const unsigned long long* pages,
                                            const unsigned long long* seq_off,
                                            const unsigned long long* pos, float* out,
                                            int n_heads, int n_kv_heads, int head_dim, int layer,
                                            int page_len, int aux, float scale) {
    PDL_ENTRY();
    attention_body<ATTN_BATCH, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer, page_len,
                                     aux, scale);
}

// attention_decode with rope_kv's work for its own token done first, so a
// decode step needs no rope_kv launch (LMRR_CUDA_ROPE_ATTN). Only for steps
// whose spans are one token each and whose tokens' pages are in no other
// span's page list (no block reads a row another block writes; the host
// checks). Block (t, h): RoPE of
// q's head h in place (only this block reads it); RoPE of k's head kvh of
// token t from `kraw` (the k matmul's output, left unrotated: every block
// of the group reads it) into the page slot dst[t]/slot[t], with v's head
// kvh — every block of the group writes these same values there before
// reading it, so each reads its own row — and, by the group's first head,
// into `kout` (the step's K rows, which go back to the host). Each value by
// rope_kv's operations: lo = a·cos - b·sin, hi = b·cos + a·sin.
// RoPE of q's head h of token t in place, of k's head kvh (from `kraw`, the
// k matmul's unrotated rows) into the page slot dst[t]/slot[t] with v's head
// kvh, and by the group's first head into `kout`; then a barrier: the
// prologue of attention_decode_rope and attention_decode_rope_hd64. QS
// (attention_decode_rope_qs): the rotated q head also into attn_qs, which
// the barrier hands to attention_body<.., QS = true> (no reload of q).
// EARLY (ATTN_EARLY): the block's inputs come in `ein` (DecodeIn), loaded
// before the PDL wait, not from pos, dst, slot and the tables.
template <bool QS = false, bool EARLY = false>
__device__ __forceinline__ void decode_rope_prologue(float* q, const float* kraw, float* kout, const float* v,
                                                     const float* cos_t, const float* sin_t,
                                                     const unsigned long long* pos, const unsigned long long* dst,
                                                     const unsigned long long* slot, int n_heads, int n_kv_heads,
                                                     int head_dim, int layer, int page_len, int aux,
                                                     const DecodeIn* ein = nullptr) {
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int tid = threadIdx.x;
    int hd = head_dim, half = head_dim / 2, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int group = n_heads / n_kv_heads, kvh = h / group;
    const float* c = cos_t + (long long)(EARLY ? 0 : pos[t]) * half;
    const float* sn = sin_t + (long long)(EARLY ? 0 : pos[t]) * half;
    int s = EARLY ? ein->slot : (int)slot[t];
    if (tid < half) {
        float* qr = q + (long long)t * qd + h * hd;
        float a = qr[tid], b = qr[tid + half];
        float ci = EARLY ? ein->c : c[tid], si = EARLY ? ein->sn : sn[tid];
        float lo = a * ci - b * si;
        float hi = b * ci + a * si;
        qr[tid] = lo;
        qr[tid + half] = hi;
        if (QS) {
            attn_qs[tid] = lo;
            attn_qs[tid + half] = hi;
        }
    }
    if (tid >= 128 && tid - 128 < half) {
        int i = tid - 128;
        long long at = (long long)t * kvd + kvh * hd + i;
        float a = kraw[at], b = kraw[at + half];
        float ci = EARLY ? ein->c : c[i], si = EARLY ? ein->sn : sn[i];
        float lo = a * ci - b * si;
        float hi = b * ci + a * si;
        float* kr = kv_row(EARLY ? ein->dst : dst[t], layer, page_len, kvd, aux, s, 0) + kvh * hd;
        kr[i] = lo;
        kr[i + half] = hi;
        if (h % group == 0) {
            kout[at] = lo;
            kout[at + half] = hi;
        }
    }
    // dst[t] read where it is used (not once at the top): the form before
    // ATTN_EARLY compiles to the SASS it had (measured 1.028 ms a batch-1
    // step on an H100 on 2026-12-06; a build that read it once at the top
    // measured 1.224, not explained).
    if (tid < hd)
        kv_row(EARLY ? ein->dst : dst[t], layer, page_len, kvd, aux, s, 1)[kvh * hd + tid] =
            v[(long long)t * kvd + kvh * hd + tid];
    __syncthreads();
}

// DecodeIn of this block and thread: what decode_rope_prologue and
// attention_body<.., EARLY> read of the step's inputs, loaded at once.
__device__ __forceinline__ DecodeIn decode_inputs(const float* cos_t, const float* sin_t,
                                                  const unsigned long long* pages,
                                                  const unsigned long long* seq_off,
                                                  const unsigned long long* pos, const unsigned long long* dst,
                                                  const unsigned long long* slot, int n_heads, int head_dim,
                                                  int page_len) {
    int t = blockIdx.x / n_heads, tid = threadIdx.x, half = head_dim / 2;
    DecodeIn in;
    in.pos = (int)pos[t];
    in.slot = (int)slot[t];
    in.dst = dst[t];
    in.so = seq_off[t];
    int i = tid < 128 ? tid : tid - 128;
    in.c = i < half ? cos_t[(long long)in.pos * half + i] : 0.0f;
    in.sn = i < half ? sin_t[(long long)in.pos * half + i] : 0.0f;
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
        int j = u * 32 + (tid >> 3);
        in.pg[u] = j <= in.pos ? pages[in.so + j / page_len] : 0ull;
    }
    return in;
}

// attention_decode_rope with the rotated q head handed from the prologue to
// the body in shared memory (LMRR_CUDA_ROPE_QS): one barrier and one load
// of q from global memory fewer; the same values in the same operations
// (q is still rotated in place in global memory, as attention_decode_rope
// leaves it).
extern "C" __global__ void attention_decode_rope_qs(float* q, const float* kraw, float* kout, const float* v,
                                                    const float* cos_t, const float* sin_t,
                                                    const unsigned long long* pages,
                                                    const unsigned long long* seq_off,
                                                    const unsigned long long* pos, const unsigned long long* dst,
                                                    const unsigned long long* slot, float* out, int n_heads,
                                                    int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                                                    float scale) {
#if defined(ATTN_EARLY)
    // The step's inputs before the wait (LMRR_CUDA_ATTN_EARLY): DecodeIn.
    DecodeIn in = decode_inputs(cos_t, sin_t, pages, seq_off, pos, dst, slot, n_heads, head_dim, page_len);
    PDL_ENTRY();
    decode_rope_prologue<true, true>(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim,
                                     layer, page_len, aux, &in);
    attention_body<ATTN_BATCH, true, false, true, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim,
                                                        layer, page_len, aux, scale, &in);
#else
    PDL_ENTRY();
    decode_rope_prologue<true>(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim,
                               layer, page_len, aux);
    attention_body<ATTN_BATCH, true, false, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer,
                                                  page_len, aux, scale);
#endif
}

// Prefill attention: one block of ATTN_THREADS per (group, head), a group
// being up to PF_TQ tokens of one sequence (stacked consecutively; the host
// lists them: groups[g] = first token << 32 | count). Each tile of
// ATTN_TILE positions is loaded once into shared memory and serves every
// token of the group, where attention_paged loads it once per token. Per
// token the arithmetic is attention_paged's, tile by tile:
//  1. s_j = dot_canon(q, k_j) * scale, one thread per (token, position):
//     lane l's FMA chain of each chunk (elements l + 8s, s ascending), the
//     lane tree, chunk partials in order;
//  2. the tile's max over the token's positions in it, in index order; the
//     running max m_new = max(tile max, m); alpha = det_exp(m - m_new);
//  3. p_j = det_exp(s_j - m_new);
//  4. lt = the sum of the tile's p in index order, l = l * alpha + lt; per
//     dimension a = the fmaf chain of p_j * v_j[d] in index order,
//     acc = acc * alpha + a;
// and out = acc / l. Tiles start at position 0 whatever the group, so the
// tiles, and so the bits, are those of the one-token kernels (whose
// super-chunks only batch tiles: each merge is still one tile's).
#define PF_TQ 16
#define PF_MAXHD 128
#define PF_ACC (PF_TQ * PF_MAXHD / ATTN_THREADS)
// The body, for any head_dim up to PF_MAXHD (HD 0: read at run time) or
// for one head_dim HD known at compile time (a divisor of ATTN_THREADS, a
// multiple of 8, at most PF_MAXHD; rows of K and V 16-byte aligned: kvd and
// page_len · aux multiples of 4). With HD: the K/V tile comes in as float4
// rows (one page lookup a row piece, not an element), the next tile's
// loads are in flight while this tile is computed, q and k are read as
// float4 (each lane chain's FMAs still in its order: lane l takes elements
// l + 8s, s ascending) with one read of q serving both of a thread's
// positions, each token's tile max (steps 2 and 3) is made by its
// half-warp right after its scores (two barriers a tile fewer), and P·V
// walks the positions once for all of a thread's tokens (each token's chain
// still its own, in position order). The same operations on the same values
// as with HD 0.
template <int HD>
__device__ __forceinline__ void attention_prefill_body(const float* q, const unsigned long long* pages,
                                                       const unsigned long long* seq_off,
                                                       const unsigned long long* pos,
                                                       const unsigned long long* groups, float* out, int n_heads,
                                                       int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                                                       float scale) {
    constexpr int MH = HD > 0 ? HD : PF_MAXHD;
    constexpr int KS = HD > 0 ? HD + 4 : PF_MAXHD + 1;  // HD: float4 rows, 8 rows on 32 banks
    constexpr int NACC = PF_TQ * MH / ATTN_THREADS;
    constexpr int V4 = HD > 0 ? ATTN_TILE * HD / 4 / ATTN_THREADS : 1;  // a thread's float4s of a tile
    // HD: a token's scores one bank apart from the next token's, so that
    // the per-token walks of steps 2 and 4 (thread u reads row u) do not
    // all hit one bank.
    constexpr int SCS = HD > 0 ? ATTN_TILE + 1 : ATTN_TILE;
    __shared__ __align__(16) float qs[PF_TQ][MH];
    __shared__ __align__(16) float ks[ATTN_TILE][KS];
    __shared__ __align__(16) float vs[ATTN_TILE][MH];
    __shared__ __align__(16) float sc[PF_TQ][SCS];
    __shared__ float tok_m[PF_TQ], tok_l[PF_TQ], tok_alpha[PF_TQ];
    __shared__ int tok_end[PF_TQ];
    int g = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    unsigned long long gr = groups[g];
    int t0 = (int)(gr >> 32), cnt = (int)(gr & 0xffffffffu);
    int tid = threadIdx.x;
    const int hd = HD > 0 ? HD : head_dim;
    int kvd = n_kv_heads * hd, qd = n_heads * hd;
    int kvh = h / (n_heads / n_kv_heads);
    const unsigned long long* pt = pages + seq_off[t0];
    for (int i = tid; i < PF_TQ * hd; i += ATTN_THREADS) {
        int u = i / hd, d = i % hd;
        qs[u][d] = u < cnt ? q[(long long)(t0 + u) * qd + h * hd + d] : 0.0f;
    }
    if (tid < PF_TQ) {
        tok_end[tid] = tid < cnt ? (int)pos[t0 + tid] + 1 : 0;
        tok_m[tid] = __int_as_float(0xff800000);  // -inf
        tok_l[tid] = 0.0f;
    }
    __syncthreads();
    int end = 0;
    for (int u = 0; u < cnt; ++u) end = max(end, tok_end[u]);
    // Thread tid owns (token, dimension) pairs tid + r·ATTN_THREADS.
    float acc[NACC];
    #pragma unroll
    for (int r = 0; r < NACC; ++r) acc[r] = 0.0f;
    int chunks = (hd + CHUNK - 1) / CHUNK;
    // Scores: token su, positions sr and sr + 16 of the tile.
    int su = tid >> 4, sr = tid & 15;
    // HD: float4 f of the tile (f = tid + s·ATTN_THREADS) is row f / (HD/4),
    // columns 4 (f % (HD/4)) on; the next tile's, in flight.
    float4 kn[V4], vn[V4];
    auto fetch = [&](int j0) {
        int jn = min(ATTN_TILE, end - j0);
        #pragma unroll
        for (int s = 0; s < V4; ++s) {
            int f = tid + s * ATTN_THREADS, r = f / (MH / 4), c = f % (MH / 4);
            float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kk;
            if (r < jn) {
                int j = j0 + r;
                unsigned long long pg = pt[j / page_len];
                int slot = j % page_len;
                kk = *(const float4*)(kv_row(pg, layer, page_len, kvd, aux, slot, 0) + kvh * hd + 4 * c);
                vv = *(const float4*)(kv_row(pg, layer, page_len, kvd, aux, slot, 1) + kvh * hd + 4 * c);
            }
            kn[s] = kk;
            vn[s] = vv;
        }
    };
    if (HD > 0 && end > 0) fetch(0);
    for (int j0 = 0; j0 < end; j0 += ATTN_TILE) {
        int jn = min(ATTN_TILE, end - j0);
        if (HD > 0) {
            #pragma unroll
            for (int s = 0; s < V4; ++s) {
                int f = tid + s * ATTN_THREADS, r = f / (MH / 4), c = f % (MH / 4);
                *(float4*)&ks[r][4 * c] = kn[s];
                *(float4*)&vs[r][4 * c] = vn[s];
            }
        } else {
            for (int i = tid; i < ATTN_TILE * hd; i += ATTN_THREADS) {
                int r = i / hd, d = i % hd;
                float kv = 0.0f, vv = 0.0f;
                if (r < jn) {
                    int j = j0 + r;
                    unsigned long long pg = pt[j / page_len];
                    kv = kv_row(pg, layer, page_len, kvd, aux, j % page_len, 0)[kvh * hd + d];
                    vv = kv_row(pg, layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d];
                }
                ks[r][d] = kv;
                vs[r][d] = vv;
            }
        }
        __syncthreads();
        // 1. Scores.
        if (HD > 0) {
            float tot[2] = {0.0f, 0.0f};
            #pragma unroll
            for (int c = 0; c < (MH + CHUNK - 1) / CHUNK; ++c) {
                const int c0 = c * CHUNK, cend = min(c0 + CHUNK, MH);
                float l[2][LANES];
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    #pragma unroll
                    for (int ln = 0; ln < LANES; ++ln) l[hf][ln] = 0.0f;
                }
                #pragma unroll 2
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    const int i = c0 + s2 * LANES;
                    if (i < cend) {
                        float4 qa = *(const float4*)&qs[su][i], qb = *(const float4*)&qs[su][i + 4];
                        #pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            float4 ka = *(const float4*)&ks[sr + hf * 16][i];
                            float4 kb = *(const float4*)&ks[sr + hf * 16][i + 4];
                            l[hf][0] = fmaf(qa.x, ka.x, l[hf][0]);
                            l[hf][1] = fmaf(qa.y, ka.y, l[hf][1]);
                            l[hf][2] = fmaf(qa.z, ka.z, l[hf][2]);
                            l[hf][3] = fmaf(qa.w, ka.w, l[hf][3]);
                            l[hf][4] = fmaf(qb.x, kb.x, l[hf][4]);
                            l[hf][5] = fmaf(qb.y, kb.y, l[hf][5]);
                            l[hf][6] = fmaf(qb.z, kb.z, l[hf][6]);
                            l[hf][7] = fmaf(qb.w, kb.w, l[hf][7]);
                        }
                    }
                }
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) tot[hf] = tot[hf] + lane_tree(l[hf]);
            }
            float s0 = tot[0] * scale, s1 = tot[1] * scale;
            // 2 and 3 here, without a barrier: token su's scores are its
            // half-warp's. Its tile max by a butterfly over (score,
            // position), the earlier position kept on a tie: the first
            // maximal score, which the in-order walk (`if (sv > mt) mt =
            // sv`) finds, zero's sign included; NaN and positions past the
            // token's end never win (the walk skips them).
            const int e = su < cnt ? min(ATTN_TILE, tok_end[su] - j0) : 0;
            const float ninf = __int_as_float(0xff800000);
            float mv = (sr < e && s0 == s0) ? s0 : ninf, mi = (float)sr;
            float m1 = (sr + 16 < e && s1 == s1) ? s1 : ninf;
            if (m1 > mv) {
                mv = m1;
                mi = (float)(sr + 16);
            }
            #pragma unroll
            for (int o = 8; o >= 1; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, mv, o);
                float oi = __shfl_xor_sync(0xffffffffu, mi, o);
                if (ov > mv || (ov == mv && oi < mi)) {
                    mv = ov;
                    mi = oi;
                }
            }
            float mp = tok_m[su];
            float mn = mv > mp ? mv : mp;
            float alpha = det_exp(mp - mn);
            sc[su][sr] = sr < e ? det_exp(s0 - mn) : s0;
            sc[su][sr + 16] = sr + 16 < e ? det_exp(s1 - mn) : s1;
            __syncwarp();  // every lane has read tok_m[su]
            if (sr == 0 && e > 0) {
                tok_alpha[su] = alpha;
                tok_m[su] = mn;
            }
            // The next tile's loads, in flight through the sums and P·V.
            if (j0 + ATTN_TILE < end) fetch(j0 + ATTN_TILE);
        } else {
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                int r = sr + half * 16;
                float total = 0.0f;
                for (int c = 0; c < chunks; ++c) {
                    int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                    float l[LANES];
                    #pragma unroll
                    for (int ln = 0; ln < LANES; ++ln) l[ln] = 0.0f;
                    #pragma unroll
                    for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                        #pragma unroll
                        for (int ln = 0; ln < LANES; ++ln) {
                            int i = c0 + ln + s2 * LANES;
                            if (i < cend) l[ln] = fmaf(qs[su][i], ks[r][i], l[ln]);
                        }
                    }
                    total = total + lane_tree(l);
                }
                sc[su][r] = total * scale;
            }
        }
        __syncthreads();
        // 2. Each token's tile max, running max and alpha (HD: done above).
        if (HD == 0 && tid < cnt) {
            int e = min(ATTN_TILE, tok_end[tid] - j0);
            if (e > 0) {
                float mt = __int_as_float(0xff800000);
                for (int i = 0; i < e; ++i) {
                    float sv = sc[tid][i];
                    if (sv > mt) mt = sv;
                }
                float mp = tok_m[tid];
                float mn = mt > mp ? mt : mp;
                tok_alpha[tid] = det_exp(mp - mn);
                tok_m[tid] = mn;
            }
        }
        if (HD == 0) {
            __syncthreads();
            // 3. p.
            for (int i = tid; i < PF_TQ * ATTN_TILE; i += ATTN_THREADS) {
                int u = i / ATTN_TILE, r = i % ATTN_TILE;
                if (u < cnt && j0 + r < tok_end[u]) sc[u][r] = det_exp(sc[u][r] - tok_m[u]);
            }
            __syncthreads();
        }
        // 4. The tile's sums and the merge.
        if (tid < cnt) {
            int e = min(ATTN_TILE, tok_end[tid] - j0);
            if (e > 0) {
                float lt = 0.0f;
                for (int i = 0; i < e; ++i) lt = lt + sc[tid][i];
                tok_l[tid] = tok_l[tid] * tok_alpha[tid] + lt;
            }
        }
        if (HD > 0) {
            // Thread tid's pairs: dimension tid % HD of tokens tid / HD + r·(ATTN_THREADS / HD).
            const int d = tid % MH, u0 = tid / MH;
            int e[NACC];
            float a[NACC];
            int emax = 0;
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                int u = u0 + r * (ATTN_THREADS / MH);
                e[r] = u < cnt ? min(ATTN_TILE, tok_end[u] - j0) : 0;
                a[r] = 0.0f;
                emax = max(emax, e[r]);
            }
            for (int i = 0; i < emax; ++i) {
                float vv = vs[i][d];
                #pragma unroll
                for (int r = 0; r < NACC; ++r) {
                    if (i < e[r]) a[r] = fmaf(sc[u0 + r * (ATTN_THREADS / MH)][i], vv, a[r]);
                }
            }
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                if (e[r] > 0) acc[r] = acc[r] * tok_alpha[u0 + r * (ATTN_THREADS / MH)] + a[r];
            }
        } else {
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                int pr = tid + r * ATTN_THREADS, u = pr / hd, d = pr % hd;
                if (u < cnt) {
                    int e = min(ATTN_TILE, tok_end[u] - j0);
                    if (e > 0) {
                        float a = 0.0f;
                        for (int i = 0; i < e; ++i) a = fmaf(sc[u][i], vs[i][d], a);
                        acc[r] = acc[r] * tok_alpha[u] + a;
                    }
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < NACC; ++r) {
        int pr = tid + r * ATTN_THREADS, u = pr / hd, d = pr % hd;
        if (u < cnt) out[(long long)(t0 + u) * qd + h * hd + d] = acc[r] / tok_l[u];
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attention_prefill(
    const float* q, const unsigned long long* pages, const unsigned long long* seq_off,
    const unsigned long long* pos, const unsigned long long* groups, float* out, int n_heads, int n_kv_heads,
    int head_dim, int layer, int page_len, int aux, float scale) {
    PDL_ENTRY();
    attention_prefill_body<0>(q, pages, seq_off, pos, groups, out, n_heads, n_kv_heads, head_dim, layer, page_len,
                              aux, scale);
}

// attention_prefill for head_dim 64 (LMRR_CUDA_ATTN_PREFILL_HD64).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attention_prefill_hd64(
    const float* q, const unsigned long long* pages, const unsigned long long* seq_off,
    const unsigned long long* pos, const unsigned long long* groups, float* out, int n_heads, int n_kv_heads,
    int head_dim, int layer, int page_len, int aux, float scale) {
    PDL_ENTRY();
    attention_prefill_body<64>(q, pages, seq_off, pos, groups, out, n_heads, n_kv_heads, head_dim, layer, page_len,
                               aux, scale);
}

// The device's FP32 FMA rate, for `lmrr bench`: 8 independent fmaf chains
// of `iters` steps per thread (2 FLOPs each); the sums are written so that
// nothing is optimised away.
extern "C" __global__ void fma_peak(float* out, int iters, float a, float b) {
    PDL_ENTRY();
    float acc[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = (float)(threadIdx.x + j);
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(acc[j], a, b);
    }
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) s = s + acc[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
