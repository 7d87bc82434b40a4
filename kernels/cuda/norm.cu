// norm.cu: RMSNorm: the one-thread reference (rms_norm), one warp per row
// (rms_norm_warp, add_norm), and the resident forms that fold the residual
// add and a split matmul's partials in (norm_block, norm_reg, norm_reg_lf).
// Uses matmul.cu's MR_GROUPS and MR_MAX_CHUNKS.

// out = (x * inv_rms(x)) * w per row of d elements.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int rows, int d, float eps) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * d;
    float ss = dot_canon(0, xr, xr, d);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = 0; i < d; ++i) out[(long long)r * d + i] = (xr[i] * inv) * w[i];
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
// way). Faster alone and in prefill, slower in a batch-1 decode chain under programmatic
// dependent launch, so the host picks by row count (Tuning::loads_first_min).
#define NR_MAX_CHUNKS 128
// Row r of norm_reg's work. WAIT: the PDL wait after the norm weight's
// loads. CG: y read through L2 (ld.global.cg), for y written by other
// blocks of the same launch.
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
