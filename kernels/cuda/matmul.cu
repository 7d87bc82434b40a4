// matmul.cu: y = x · Wᵀ over every weight storage, in the canonical order:
// the one-thread reference (matmul), one warp per output (matmul_warp), and
// the resident path's forms: token tiles (matmul_tile), a row's chunks in
// flight (matmul_rows, matmul_rows4, matmul_multi), staged tiles for many
// tokens (matmul_gemm, matmul_gemm_wide, matmul_gemm_multi) and the sum of
// a split matmul's chunk partials (sum_chunks). Each gives matmul's bits.

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
// At most 32 registers a thread (16 blocks of 128 threads an SM: full
// occupancy, the loads in flight that a decode matvec lives on): the
// K-quant decode in weight() would otherwise raise the count for every
// storage, f32 and bf16 included.
#define MR_MIN_BLOCKS 16
extern "C" __global__ void __launch_bounds__(MR_GROUPS * 8, MR_MIN_BLOCKS) matmul_rows(int kind, const float* x, const unsigned char* w, float* y,
                                       int n, int rows, int k, long long row_bytes) {
    PDL_ENTRY_EARLY();
    mm_rows_block(kind, x, w, y, n, rows, k, row_bytes, blockIdx.x % rows, (blockIdx.x / rows) * MM_TOKENS);
}

// matmul_rows with MR4_ROWS rows a block (Tuning::rows4_min: wide
// matrices, the lm head): the same 16 groups of 8 threads, group g taking
// chunks g, g + MR_GROUPS, ... of all MR4_ROWS rows, each chunk's weights of
// the rows loaded at once (4 × 8 loads in flight a thread, not 8); then, per
// row and token, matmul_rows' lane chain (elements j + 8s, s ascending, from
// 0.0), the xor tree 4, 2, 1 and thread r·8 + tt adding row r's chunk
// partials for token tt in chunk order from +0.0: matmul_rows' operations
// in its order, a quarter of its blocks. k ≤ 64 · MR4_MAX_CHUNKS.
#define MR4_ROWS 4
#define MR4_MAX_CHUNKS 64
// The body of matmul_rows4 for rows o0 .. o0 + MR4_ROWS
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
extern "C" __global__ void __launch_bounds__(MR_GROUPS * 8, MR_MIN_BLOCKS) matmul_multi(int kind, const float* x, int n, int k,
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
// 8·GR·GT threads (GR, GT even); matmul_gemm (4, 2) and matmul_gemm_wide
// (8, 4) differ in tile only, never in any output's operations.
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

// Whether a block's chunk at c0 takes gm_fetch's fast path: an interior
// tile (every staged element in the matrix) of f32 or bf16 weights.
template <int R, int T>
__device__ __forceinline__ bool gm_fast(int kind, int n, int rows, int k, int o0, int t0, int c0) {
    return (kind == 0 || kind == 1) && o0 + R <= rows && t0 + T <= n && c0 + CHUNK <= k;
}

// A thread's share of a chunk's staging, into registers: staged element
// tid + q·THREADS of the weights (wreg) and of the inputs (xreg). On the
// fast path (gm_fast) the address of element q is a stride from the
// first one: one load each (a bf16 widened as weight() widens it), no
// storage switch and no bounds; otherwise gm_weight and gm_input, element
// by element. The values are the same.
template <int R, int T, int THREADS>
__device__ __forceinline__ void gm_fetch(int kind, const float* x, const unsigned char* w, int n, int rows, int k,
                                         long long row_bytes, int o0, int t0, int c0, float* wreg, float* xreg) {
    const int WPT = R * CHUNK / THREADS, XPT = T * CHUNK / THREADS, RPQ = THREADS / CHUNK;
    int tid = threadIdx.x, cend = min(c0 + CHUNK, k);
    if (gm_fast<R, T>(kind, n, rows, k, o0, t0, c0)) {
        if (kind == 0) {
            long long rs = row_bytes / 4;
            const float* wp = (const float*)w + (long long)(o0 + tid / CHUNK) * rs + c0 + tid % CHUNK;
            #pragma unroll
            for (int q = 0; q < WPT; ++q) wreg[q] = wp[(long long)q * RPQ * rs];
        } else {
            long long rs = row_bytes / 2;
            const unsigned short* wp = (const unsigned short*)w + (long long)(o0 + tid / CHUNK) * rs + c0 + tid % CHUNK;
            #pragma unroll
            for (int q = 0; q < WPT; ++q) wreg[q] = __uint_as_float((unsigned)wp[(long long)q * RPQ * rs] << 16);
        }
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
    if (gm_fast<R, T>(kind, n, rows, k, o0, t0, c0)) {
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
