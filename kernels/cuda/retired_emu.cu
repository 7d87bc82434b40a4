// Kernels deleted from the device source after they measured slower (git
// log and docs/PERFORMANCE.md name each with its figure). Only the g++
// emulation's runner (kernels/cuda/emu/runner.cpp) still names them; the
// emulated test appends this file to the source it builds so that runner
// compiles until its jobs for these kernels are removed. NVRTC never sees
// this file. Delete it together with those jobs.
#define ATTN_DECODE_BOUNDS
#define ROWS4_BOUNDS
// swiglu over float4s (n4 = n / 4; every pointer 16-byte aligned): each
// element the swiglu kernel's value, four a thread, so that a wide step's
// loads are four times as many bytes in flight.
extern "C" __global__ void swiglu4(const float4* g, const float4* u, float4* out, int n4) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 a = g[i], b = u[i];
        out[i] = make_float4(swiglu_of(a.x, b.x), swiglu_of(a.y, b.y), swiglu_of(a.z, b.z), swiglu_of(a.w, b.w));
    }
}

// matmul_multi with matmul_rows4's blocks (LMRR_CUDA_MULTI4): blocks
// 0 .. ceil(rows0 / MR4_ROWS)·tiles are matrix 0's, then matrix 1's, then
// matrix 2's; each output as matmul_rows computes it.
extern "C" __global__ void ROWS4_BOUNDS matmul_multi4(int kind, const float* x, int n, int k,
                                         const unsigned char* w0, float* y0, int rows0, long long rb0,
                                         const unsigned char* w1, float* y1, int rows1, long long rb1,
                                         const unsigned char* w2, float* y2, int rows2, long long rb2) {
    PDL_ENTRY_EARLY();
    int tiles = (n + MM_TOKENS - 1) / MM_TOKENS;
    int g0 = (rows0 + MR4_ROWS - 1) / MR4_ROWS, g1 = (rows1 + MR4_ROWS - 1) / MR4_ROWS;
    int g2 = (rows2 + MR4_ROWS - 1) / MR4_ROWS;
    int b = blockIdx.x;
    if (b < g0 * tiles) {
        mm_rows4_block(kind, x, w0, y0, n, rows0, k, rb0, (b % g0) * MR4_ROWS, (b / g0) * MM_TOKENS);
        return;
    }
    b -= g0 * tiles;
    if (b < g1 * tiles) {
        mm_rows4_block(kind, x, w1, y1, n, rows1, k, rb1, (b % g1) * MR4_ROWS, (b / g1) * MM_TOKENS);
        return;
    }
    b -= g1 * tiles;
    mm_rows4_block(kind, x, w2, y2, n, rows2, k, rb2, (b % g2) * MR4_ROWS, (b / g2) * MM_TOKENS);
}

// matmul_rows of SwiGLU(g, u) (down after gate and up): the swiglu launch
// folded into down's input loads, each input element the swiglu kernel's.
extern "C" __global__ void matmul_rows_swiglu(int kind, const float* g, const float* u, const unsigned char* w,
                                              float* y, int n, int rows, int k, long long row_bytes) {
    PDL_ENTRY_EARLY();
    mm_rows_block<true>(kind, g, w, y, n, rows, k, row_bytes, blockIdx.x % rows, (blockIdx.x / rows) * MM_TOKENS, u);
}

// gate and up with SwiGLU in the epilogue (decode steps): one block of
// 2 · MR_GROUPS · 8 threads per (row o, token tile); the first half makes
// row o of gate's partials and the second half row o of up's, each as
// matmul_rows does, side by side; then, in warp 0, lane h·8 + tt adds token
// tt's partials of half h in chunk order from +0.0 (matmul_rows' sum) and
// lane tt stores swiglu_of(gate, up): the swiglu kernel's value of
// matmul_rows' two outputs, without the swiglu launch or the g/u rows.
// gate and up share one storage, shape and row_bytes.
static_assert(MM_TOKENS == 8, "gate_up_swiglu's sum: lanes 0-7 of warp 0 add gate's tokens, 8-15 up's");
extern "C" __global__ void gate_up_swiglu(int kind, const float* x, const unsigned char* wg,
                                          const unsigned char* wu, float* y, int n, int rows, int k,
                                          long long row_bytes) {
    PDL_ENTRY_EARLY();
    __shared__ float part[2][MM_TOKENS][MR_MAX_CHUNKS];
    int o = blockIdx.x % rows, t0 = (blockIdx.x / rows) * MM_TOKENS;
    int tn = min(MM_TOKENS, n - t0);
    int chunks = (k + CHUNK - 1) / CHUNK;
    int half = threadIdx.x / (8 * MR_GROUPS), tid = threadIdx.x % (8 * MR_GROUPS);
    mm_rows_partials(kind, x, (half ? wu : wg) + o * row_bytes, tn, k, t0, tid, part[half]);
    __syncthreads();
    if (threadIdx.x < 32) {
        int h = (threadIdx.x >> 3) & 1, tt = threadIdx.x & 7;
        float total = 0.0f;
        if (threadIdx.x < 16 && tt < tn) {
            for (int c = 0; c < chunks; ++c) total = total + part[h][tt][c];
        }
        float up = __shfl_down_sync(0xffffffffu, total, 8);
        if (threadIdx.x < tn) y[(long long)(t0 + threadIdx.x) * rows + o] = swiglu_of(total, up);
    }
}

// matmul_chunk: one thread per (output row, 64-chunk of it), for decode
// steps of few tokens. The thread loads its chunk's 64 weights at once (16
// float4 loads of f32, 8 of bf16, with `vec`; element by element otherwise
// or in a partial last chunk), then per token makes the chunk's eight lane
// chains itself — lane j's FMA chain over elements j + 8s, s ascending, from
// +0.0 — and joins them by lane_tree (the xor-shuffle tree's sums, a + b
// being b + a); the block's threads then add each row's chunk partials in
// chunk order from +0.0. The bits of matmul_rows and of the one-thread
// matmul, with a row's chunks spread over threads rather than over groups of
// a block per row: fewer, fuller blocks, each thread 256 bytes of loads in
// flight. Block b: rows of block b % row_blocks, token tile b / row_blocks
// (MM_TOKENS tokens); thread t: row t / chunks of the block, chunk t % chunks.
// vec: k a multiple of 4 and every row, x and w 16-byte aligned (the host
// checks).
//
// matmul_fused's forms, by `mode` and `nw`: with nw non-null, each input
// element is the token's RMSNorm (x_i * inv) * nw_i, inv from the canonical
// sum of squares (each chunk's lane chains and tree by the threads of the
// block's first row, the partials added in chunk order: rms_norm's value);
// mode 0 stores y = x·Wᵀ, rows over up to three matrices (row r < rows0 is
// matrix 0's, then matrix 1's, then 2's); mode 1 adds it into y0 (the
// residual add after o and down); mode 2 pairs row o of W0 with row o of W1
// (the block's first rpb/2 rows are W0's, the rest W1's same rows) and stores
// y0 = SwiGLU(x·W0ᵀ, x·W1ᵀ), as the swiglu kernel computes it.
#define MC_MAX_THREADS 256

// The weight row, output, its row count and index for row r of block rb.
__device__ __forceinline__ bool mc_locate(int mode, int rb, int rpb, int r, const unsigned char* w0, float* y0,
                                          int rows0, long long rb0, const unsigned char* w1, float* y1, int rows1,
                                          long long rb1, const unsigned char* w2, float* y2, int rows2,
                                          long long rb2, const unsigned char** w, float** y, int* rows, int* o) {
    if (mode == 2) {
        int hp = rpb / 2;
        long long pair = (long long)rb * hp + r % hp;
        if (r >= 2 * hp || pair >= rows0) return false;
        *o = (int)pair, *y = y0, *rows = rows0;
        *w = r < hp ? w0 + pair * rb0 : w1 + pair * rb1;
        return true;
    }
    long long row = (long long)rb * rpb + r;
    if (r >= rpb || row >= (long long)rows0 + rows1 + rows2) return false;
    if (row < rows0) {
        *w = w0 + row * rb0, *y = y0, *rows = rows0, *o = (int)row;
    } else if (row < (long long)rows0 + rows1) {
        *o = (int)(row - rows0);
        *w = w1 + *o * rb1, *y = y1, *rows = rows1;
    } else {
        *o = (int)(row - rows0 - rows1);
        *w = w2 + *o * rb2, *y = y2, *rows = rows2;
    }
    return true;
}

extern "C" __global__ void __launch_bounds__(MC_MAX_THREADS)
    matmul_chunk(int kind, int vec, const float* x, int n, int k, int rpb, const float* nw, float eps, int mode,
                 const unsigned char* w0, float* y0, int rows0, long long rb0, const unsigned char* w1, float* y1,
                 int rows1, long long rb1, const unsigned char* w2, float* y2, int rows2, long long rb2) {
    PDL_ENTRY_EARLY();
    __shared__ float part[MM_TOKENS * MC_MAX_THREADS];
    __shared__ float inv[MM_TOKENS];
    int chunks = (k + CHUNK - 1) / CHUNK;
    long long units = mode == 2 ? rows0 : (long long)rows0 + rows1 + rows2;
    int per = mode == 2 ? rpb / 2 : rpb;
    int row_blocks = (int)((units + per - 1) / per);
    int rb = blockIdx.x % row_blocks, t0 = (blockIdx.x / row_blocks) * MM_TOKENS;
    int tn = min(MM_TOKENS, n - t0);
    int tid = threadIdx.x, r = tid / chunks, c = tid % chunks;
    const unsigned char* wr = nullptr;
    float* yd;
    int rows, o;
    bool live = mc_locate(mode, rb, rpb, r, w0, y0, rows0, rb0, w1, y1, rows1, rb1, w2, y2, rows2, rb2, &wr, &yd,
                          &rows, &o);
    int c0 = c * CHUNK, cnt = min(CHUNK, k - c0);
    float wv[CHUNK];
    if (live) {
        if (vec && cnt == CHUNK && kind == 0) {
            const float4* p = (const float4*)(wr + (long long)c0 * 4);
            #pragma unroll
            for (int q = 0; q < CHUNK / 4; ++q) {
                float4 v = p[q];
                wv[4 * q] = v.x, wv[4 * q + 1] = v.y, wv[4 * q + 2] = v.z, wv[4 * q + 3] = v.w;
            }
        } else if (vec && cnt == CHUNK && kind == 1) {
            const uint4* p = (const uint4*)(wr + (long long)c0 * 2);
            #pragma unroll
            for (int q = 0; q < CHUNK / 8; ++q) {
                uint4 v = p[q];
                unsigned u[4] = {v.x, v.y, v.z, v.w};
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    wv[8 * q + 2 * e] = __uint_as_float(u[e] << 16);
                    wv[8 * q + 2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
                }
            }
        } else {
            #pragma unroll
            for (int i = 0; i < CHUNK; ++i) wv[i] = i < cnt ? weight(kind, wr, c0 + i) : 0.0f;
        }
    }
    PDL_ENTRY_LATE();  // the weights in flight; now the inputs
    if (nw) {
        // Each token's sum-of-squares chunk partials, by the first row's threads.
        if (tid < chunks) {
            for (int tt = 0; tt < tn; ++tt) {
                const float* xr = x + (long long)(t0 + tt) * k + c0;
                float l[LANES];
                #pragma unroll
                for (int j = 0; j < LANES; ++j) l[j] = 0.0f;
                #pragma unroll
                for (int i = 0; i < CHUNK; ++i)
                    if (i < cnt) l[i & 7] = fmaf(xr[i], xr[i], l[i & 7]);
                part[tt * MC_MAX_THREADS + c] = lane_tree(l);
            }
        }
        __syncthreads();
        if (tid < tn) {
            float ss = 0.0f;
            for (int cc = 0; cc < chunks; ++cc) ss = ss + part[tid * MC_MAX_THREADS + cc];
            inv[tid] = 1.0f / sqrtf(ss / (float)k + eps);
        }
        __syncthreads();
    }
    #pragma unroll 1
    for (int tt = 0; tt < MM_TOKENS; ++tt) {
        if (tt < tn && live) {
            const float* xr = x + (long long)(t0 + tt) * k + c0;
            float l[LANES];
            #pragma unroll
            for (int j = 0; j < LANES; ++j) l[j] = 0.0f;
            if (nw) {
                float iv = inv[tt];
                const float* nr = nw + c0;
                #pragma unroll
                for (int i = 0; i < CHUNK; ++i)
                    if (i < cnt) l[i & 7] = fmaf((xr[i] * iv) * nr[i], wv[i], l[i & 7]);
            } else if (cnt == CHUNK) {
                if (vec) {
                    const float4* xp = (const float4*)xr;
                    #pragma unroll
                    for (int q = 0; q < CHUNK / 4; ++q) {
                        // Elements 4q .. 4q + 3: lanes 4(q & 1) .. + 3, s = q / 2.
                        float4 xv = xp[q];
                        int b = 4 * (q & 1);
                        l[b] = fmaf(xv.x, wv[4 * q], l[b]);
                        l[b + 1] = fmaf(xv.y, wv[4 * q + 1], l[b + 1]);
                        l[b + 2] = fmaf(xv.z, wv[4 * q + 2], l[b + 2]);
                        l[b + 3] = fmaf(xv.w, wv[4 * q + 3], l[b + 3]);
                    }
                } else {
                    #pragma unroll
                    for (int i = 0; i < CHUNK; ++i) l[i & 7] = fmaf(xr[i], wv[i], l[i & 7]);
                }
            } else {
                #pragma unroll
                for (int i = 0; i < CHUNK; ++i)
                    if (i < cnt) l[i & 7] = fmaf(xr[i], wv[i], l[i & 7]);
            }
            part[tt * MC_MAX_THREADS + tid] = lane_tree(l);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < per * tn; idx += blockDim.x) {
        int rr = idx / tn, tt = idx % tn;
        const unsigned char* w_;
        float* yo;
        int rows_, o_;
        if (!mc_locate(mode, rb, rpb, rr, w0, y0, rows0, rb0, w1, y1, rows1, rb1, w2, y2, rows2, rb2, &w_, &yo,
                       &rows_, &o_))
            continue;
        const float* pr = part + tt * MC_MAX_THREADS + rr * chunks;
        float total = 0.0f;
        for (int cc = 0; cc < chunks; ++cc) total = total + pr[cc];
        long long at = (long long)(t0 + tt) * rows_ + o_;
        if (mode == 0) {
            yo[at] = total;
        } else if (mode == 1) {
            yo[at] = yo[at] + total;
        } else {
            const float* pu = pr + (rpb / 2) * chunks;
            float u = 0.0f;
            for (int cc = 0; cc < chunks; ++cc) u = u + pu[cc];
            yo[at] = swiglu_of(total, u);
        }
    }
}

// matmul_rows, then the residual add and RMSNorm of norm_reg on its output
// in the same launch (LMRR_CUDA_ROWS_NORM_MAX): y (n, rows) = x · Wᵀ as
// matmul_rows makes it; then the last block to finish (a counter every
// block bumps after a fence over its stores: atomicInc, which wraps it
// back to 0 for the next launch) makes, for each token t < n,
// resid[t] += y[t] and hout[t] = rms_norm(resid[t]) · nw, norm_reg's
// operations in its order, reading y through L2 (other blocks wrote it).
// Which block is last moves no bit: it only adds and norms finished rows.
// The norm's row is `rows` wide (d = rows), at most 8 · MR_GROUPS / 8 =
// MR_GROUPS chunks (128 threads a block, a group of 8 a chunk).
extern "C" __global__ void matmul_rows_norm(int kind, const float* x, const unsigned char* w, float* y, int n,
                                            int rows, int k, long long row_bytes, float* resid, const float* nw,
                                            float* hout, float eps, unsigned* counter) {
    PDL_ENTRY_EARLY();
    mm_rows_block(kind, x, w, y, n, rows, k, row_bytes, blockIdx.x % rows, (blockIdx.x / rows) * MM_TOKENS);
    __shared__ int last;
    __threadfence();  // this block's y stores before its count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicInc(counter, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;  // uniform over the block
    __threadfence();  // every other block's y stores seen before the reads below
    for (int t = 0; t < n; ++t) {
        norm_reg_row<false, false, true>(resid, y, nullptr, 0, nw, hout, n, rows, eps, 1, t);
        __syncthreads();  // the next row's partials over this row's
    }
}

// ---- Fused decode kernels (LMRR_CUDA_FUSED_MAX, LMRR_CUDA_SWIGLU_MAX): one launch where the
// default path has two or three, for steps of at most MM_TOKENS tokens.

// Partials of one weight row wr for the tile's tokens into part[tt][c], as
// mm_rows_block computes them; with nw, each input is the token's RMSNorm,
// (x_i * inv[tt]) * nw[i], made on the fly by the same two roundings.
// The weights of this thread's lane in the first MR_GROUPS chunks of row wr
// (fz_partials' first pass), loaded ahead (before the PDL wait).
__device__ __forceinline__ void fz_first(int kind, const unsigned char* wr, int k, float pre[CHUNK / LANES]) {
    int g = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    int cend = g < chunks ? min(g * CHUNK + CHUNK, k) : 0;
    #pragma unroll
    for (int s = 0; s < CHUNK / LANES; ++s) {
        int i = g * CHUNK + j + s * LANES;
        pre[s] = i < cend ? weight(kind, wr, i) : 0.0f;
    }
}

__device__ __forceinline__ void fz_partials(int kind, const float* x, const unsigned char* wr, int tn, int k,
                                            int t0, const float* nw, const float* inv,
                                            float (*part)[MR_MAX_CHUNKS], const float pre[CHUNK / LANES]) {
    int g = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    for (int cb = 0; cb < chunks; cb += MR_GROUPS) {
        int c = cb + g;
        int base = c * CHUNK + j;
        int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
        float wv[CHUNK / LANES];
        #pragma unroll
        for (int s = 0; s < CHUNK / LANES; ++s) {
            int i = base + s * LANES;
            wv[s] = cb == 0 ? pre[s] : i < cend ? weight(kind, wr, i) : 0.0f;
        }
        #pragma unroll
        for (int tt = 0; tt < MM_TOKENS; ++tt) {
            if (tt < tn) {  // uniform over the block
                const float* xr = x + (long long)(t0 + tt) * k;
                float l = 0.0f;
                #pragma unroll
                for (int s = 0; s < CHUNK / LANES; ++s) {
                    int i = base + s * LANES;
                    if (i < cend) {
                        float xv = nw ? (xr[i] * inv[tt]) * nw[i] : xr[i];
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
}

// inv[tt] = 1 / sqrt(dot(x_t, x_t) / k + eps) for the tile's tokens: the
// canonical dot's chunk partials by the groups, summed in chunk order
// (rms_norm's value), `part` used as scratch.
__device__ __forceinline__ void fz_norm_inv(const float* x, int tn, int k, int t0, float eps,
                                            float (*part)[MR_MAX_CHUNKS], float* inv) {
    int g = threadIdx.x >> 3, j = threadIdx.x & 7;
    int chunks = (k + CHUNK - 1) / CHUNK;
    for (int cb = 0; cb < chunks; cb += MR_GROUPS) {
        int c = cb + g;
        int cend = c < chunks ? min(c * CHUNK + CHUNK, k) : 0;
        for (int tt = 0; tt < tn; ++tt) {
            const float* xr = x + (long long)(t0 + tt) * k;
            float l = 0.0f;
            for (int i = c * CHUNK + j; i < cend; i += LANES) l = fmaf(xr[i], xr[i], l);
            l = l + __shfl_xor_sync(0xffffffffu, l, 4);
            l = l + __shfl_xor_sync(0xffffffffu, l, 2);
            l = l + __shfl_xor_sync(0xffffffffu, l, 1);
            if (j == 0 && c < chunks) part[tt][c] = l;
        }
    }
    __syncthreads();
    if (threadIdx.x < tn) {
        int tt = threadIdx.x;
        float ss = 0.0f;
        for (int c = 0; c < chunks; ++c) ss = ss + part[tt][c];
        inv[tt] = 1.0f / sqrtf(ss / (float)k + eps);
    }
    __syncthreads();
}

// Up to three matmuls of one input, one block per (row, token tile), with
// an optional RMSNorm of the input made in the block (nw non-null) and an
// epilogue by `mode`: 0 stores y = x·Wᵀ (q, k, v; the output head);
// 1 accumulates y = y + x·Wᵀ into y0 (the residual add after o and down);
// 2 computes rows o of W0 and W1 in one block and stores
// y0 = silu(x·W0ᵀ) · (x·W1ᵀ) (gate, up and SwiGLU). Every output is the
// value the separate kernels compute, by the same operations.
extern "C" __global__ void matmul_fused(int kind, const float* x, int n, int k, const float* nw, float eps,
                                        int mode, const unsigned char* w0, float* y0, int rows0, long long rb0,
                                        const unsigned char* w1, float* y1, int rows1, long long rb1,
                                        const unsigned char* w2, float* y2, int rows2, long long rb2) {
    PDL_ENTRY_EARLY();
    __shared__ float part[MM_TOKENS][MR_MAX_CHUNKS];
    __shared__ float part2[MM_TOKENS][MR_MAX_CHUNKS];
    __shared__ float inv[MM_TOKENS];
    int tiles = (n + MM_TOKENS - 1) / MM_TOKENS;
    int b = blockIdx.x;
    const unsigned char* w = w0;
    float* y = y0;
    int rows = rows0;
    long long rb = rb0;
    if (mode != 2 && b >= rows0 * tiles) {
        b -= rows0 * tiles;
        if (b < rows1 * tiles) {
            w = w1, y = y1, rows = rows1, rb = rb1;
        } else {
            b -= rows1 * tiles;
            w = w2, y = y2, rows = rows2, rb = rb2;
        }
    }
    int o = b % rows, t0 = (b / rows) * MM_TOKENS;
    int tn = min(MM_TOKENS, n - t0);
    int chunks = (k + CHUNK - 1) / CHUNK;
    // Both rows' first weights in flight before the wait (PDL_PREFETCH) and
    // before the norm.
    float pre0[CHUNK / LANES], pre1[CHUNK / LANES];
    fz_first(kind, w + o * rb, k, pre0);
    if (mode == 2) fz_first(kind, w1 + o * rb1, k, pre1);
    PDL_ENTRY_LATE();
    if (nw) fz_norm_inv(x, tn, k, t0, eps, part, inv);
    fz_partials(kind, x, w + o * rb, tn, k, t0, nw, inv, part, pre0);
    if (mode == 2) fz_partials(kind, x, w1 + o * rb1, tn, k, t0, nw, inv, part2, pre1);
    __syncthreads();
    if (threadIdx.x < tn) {
        int tt = threadIdx.x;
        float total = 0.0f;
        for (int c = 0; c < chunks; ++c) total = total + part[tt][c];
        long long at = (long long)(t0 + tt) * rows + o;
        if (mode == 0) {
            y[at] = total;
        } else if (mode == 1) {
            y[at] = y[at] + total;
        } else {
            float u = 0.0f;
            for (int c = 0; c < chunks; ++c) u = u + part2[tt][c];
            y[at] = (total / (1.0f + det_exp(-total))) * u;
        }
    }
}

// matmul_gemm_wide with its staging pipelined (gemm_tiles' PF).
extern "C" __global__ void __launch_bounds__(GW_THREADS, 2) matmul_gemm_pipelined(int kind, const float* x, const unsigned char* w, float* y,
                                                 int n, int rows, int k, long long row_bytes, float* part,
                                                 int cpb) {
    PDL_ENTRY();
    __shared__ __align__(16) float ws[GM_STAGE(GW_ROWS)];
    __shared__ __align__(16) float xs[GM_STAGE(GW_TOKS)];
    gemm_tiles<GW_GR, GW_GT, true>(kind, x, w, y, n, rows, k, row_bytes, part, cpb, ws, xs, blockIdx.x);
}

extern "C" __global__ void ATTN_DECODE_BOUNDS attention_decode_rope(float* q, const float* kraw, float* kout, const float* v,
                                                 const float* cos_t, const float* sin_t,
                                                 const unsigned long long* pages, const unsigned long long* seq_off,
                                                 const unsigned long long* pos, const unsigned long long* dst,
                                                 const unsigned long long* slot, float* out, int n_heads,
                                                 int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                                                 float scale) {
    PDL_ENTRY();
    decode_rope_prologue(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim, layer,
                         page_len, aux);
    attention_body<ATTN_BATCH, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer, page_len,
                                     aux, scale);
}

// Decode attention for head_dim 64 (LMRR_CUDA_ATTN_DECODE_HD64): the same
// block per (token, head) and the same operations as attention_body, with
// fewer barriers and no serial thread. Each pass takes DW_POS positions, a
// thread each, so warp w holds tile w (ATTN_TILE == 32):
//  1. the thread's score: the K row as float4 loads, lane j's FMA chain over
//     elements j + 8s (s ascending) kept by the thread itself, lane_tree,
//     0.0f + the tree (the chunk sum from +0.0), times scale;
//  2. the tile's max by the warp's xor shuffles over its scores, NaN taken as
//     -inf (attention_body's `if (sv > mt) mt = sv` from -inf never picks a
//     NaN either): the maximum of a set, which no order changes but for the
//     sign of a zero, and a zero's sign changes neither s - m nor m_prev -
//     m_new, so no value downstream;
//  3. every thread walks the tiles' maxima in order for the running max (the
//     scan attention_body's thread 0 makes), p = det_exp(s - m_new);
//  4. lt by one thread a tile, in index order from +0.0; acc_t[d] the fmaf
//     chain of p_j · v_j[d] in index order, its V values loaded before the
//     score;
//  5. the merge, tile by tile in order: l = l·alpha + lt, acc = acc·alpha +
//     acc_t, alpha = det_exp(m_before - m_after).
// Rows 16-byte aligned (the host checks hd64_fits).
#define DW_POS ATTN_THREADS
#define DW_TILES (DW_POS / ATTN_TILE)
#define DW_PAIRS (DW_TILES * 64 / ATTN_THREADS)
__device__ __forceinline__ void attention_decode64_body(const float* q, const unsigned long long* pages,
                                                        const unsigned long long* seq_off,
                                                        const unsigned long long* pos, float* out, int n_heads,
                                                        int n_kv_heads, int layer, int page_len, int aux,
                                                        float scale) {
    const int hd = 64;
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int kvd = n_kv_heads * hd, qd = n_heads * hd;
    int kvh = h / (n_heads / n_kv_heads);
    __shared__ __align__(16) float qs[64];
    __shared__ float tm[DW_TILES], tl[DW_TILES];
    __shared__ float ps[DW_POS];
    __shared__ float at[DW_TILES * 64];
    if (tid < hd) qs[tid] = q[(long long)t * qd + h * hd + tid];
    __syncthreads();
    const unsigned long long* pt = pages + seq_off[t];
    int p_end = (int)pos[t];
    const float NEG_INF = __int_as_float(0xff800000);
    float m = NEG_INF, l = 0.0f, acc = 0.0f;  // acc: dimension tid (tid < 64)
    for (int base = 0; base <= p_end; base += DW_POS) {
        int npos = min(DW_POS, p_end + 1 - base);
        int ntiles = (npos + ATTN_TILE - 1) / ATTN_TILE;
        // This thread's (tile, dimension) pairs' V values, in flight now.
        float vv[DW_PAIRS][ATTN_TILE];
        #pragma unroll
        for (int r = 0; r < DW_PAIRS; ++r) {
            int pi = tid + r * ATTN_THREADS, tt = pi / hd, d = pi % hd;
            int j0 = tt * ATTN_TILE, cnt = tt < ntiles ? min(ATTN_TILE, npos - j0) : 0;
            #pragma unroll
            for (int i = 0; i < ATTN_TILE; ++i) {
                int j = base + j0 + i;
                vv[r][i] = i < cnt ? kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d]
                                   : 0.0f;
            }
        }
        // 1. The score of position base + tid.
        bool live = tid < npos;
        float sc = NEG_INF;
        if (live) {
            int j = base + tid;
            const float4* kr = (const float4*)(kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 0) +
                                               kvh * hd);
            const float4* q4 = (const float4*)qs;
            float lv[LANES];
            #pragma unroll
            for (int i = 0; i < LANES; ++i) lv[i] = 0.0f;
            #pragma unroll
            for (int qq = 0; qq < 16; ++qq) {
                // Elements 4qq .. 4qq + 3: lanes 4(qq & 1) .. + 3, s = qq / 2.
                float4 kk = kr[qq], qv = q4[qq];
                int b = 4 * (qq & 1);
                lv[b] = fmaf(qv.x, kk.x, lv[b]);
                lv[b + 1] = fmaf(qv.y, kk.y, lv[b + 1]);
                lv[b + 2] = fmaf(qv.z, kk.z, lv[b + 2]);
                lv[b + 3] = fmaf(qv.w, kk.w, lv[b + 3]);
            }
            float total = 0.0f;
            total = total + lane_tree(lv);
            sc = total * scale;
        }
        // 2. Tile maxima.
        float mv = live && sc > NEG_INF ? sc : NEG_INF;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float o = __shfl_xor_sync(0xffffffffu, mv, off);
            mv = o > mv ? o : mv;
        }
        if (lane == 0 && warp < ntiles) tm[warp] = mv;
        __syncthreads();
        // 3. The running max to this thread's tile; p.
        {
            float mr = m;
            for (int tt = 0; tt <= warp && tt < ntiles; ++tt) mr = tm[tt] > mr ? tm[tt] : mr;
            if (live) ps[tid] = det_exp(sc - mr);
        }
        __syncthreads();
        // 4. Per tile: lt, and acc_t for each dimension.
        if (tid < ntiles) {
            int j0 = tid * ATTN_TILE, cnt = min(ATTN_TILE, npos - j0);
            float lt = 0.0f;
            for (int i = 0; i < cnt; ++i) lt = lt + ps[j0 + i];
            tl[tid] = lt;
        }
        #pragma unroll
        for (int r = 0; r < DW_PAIRS; ++r) {
            int pi = tid + r * ATTN_THREADS, tt = pi / hd, d = pi % hd;
            if (tt < ntiles) {
                int j0 = tt * ATTN_TILE, cnt = min(ATTN_TILE, npos - j0);
                float a = 0.0f;
                #pragma unroll
                for (int i = 0; i < ATTN_TILE; ++i) {
                    if (i < cnt) a = fmaf(ps[j0 + i], vv[r][i], a);
                }
                at[tt * hd + d] = a;
            }
        }
        __syncthreads();
        // 5. Merge in tile order (every thread keeps m and l; acc by tid < 64).
        for (int tt = 0; tt < ntiles; ++tt) {
            float mn = tm[tt] > m ? tm[tt] : m;
            float alpha = det_exp(m - mn);
            l = l * alpha + tl[tt];
            if (tid < hd) acc = acc * alpha + at[tt * hd + tid];
            m = mn;
        }
        __syncthreads();
    }
    if (tid < hd) out[(long long)t * qd + h * hd + tid] = acc / l;
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1)
    attention_decode_hd64(const float* q, const unsigned long long* pages, const unsigned long long* seq_off,
                          const unsigned long long* pos, float* out, int n_heads, int n_kv_heads, int head_dim,
                          int layer, int page_len, int aux, float scale) {
    PDL_ENTRY();
    attention_decode64_body(q, pages, seq_off, pos, out, n_heads, n_kv_heads, layer, page_len, aux, scale);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1)
    attention_decode_rope_hd64(float* q, const float* kraw, float* kout, const float* v, const float* cos_t,
                               const float* sin_t, const unsigned long long* pages,
                               const unsigned long long* seq_off, const unsigned long long* pos,
                               const unsigned long long* dst, const unsigned long long* slot, float* out,
                               int n_heads, int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                               float scale) {
    PDL_ENTRY();
    decode_rope_prologue(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim, layer,
                         page_len, aux);
    attention_decode64_body(q, pages, seq_off, pos, out, n_heads, n_kv_heads, layer, page_len, aux, scale);
}
