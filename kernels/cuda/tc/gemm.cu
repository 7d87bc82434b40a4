// Tensor-core matmul Y[t][o] = X[t] . W[o]: X (n, K) f32 rounded to bf16
// (nearest even) as it is staged, W (rows, K) bf16, Y (n, rows) f32.
// Invariant (tensor_core::gemm on the CPU is its model): every output is a
// chain of mma.m16n8k16 over k in order from +0, k blocks of 16 aligned to
// 0, zeros past K; a block tile changes which warp runs a chain, never the
// chain. No split over k, so no batch, tile or launch shape changes a bit.

__device__ __forceinline__ unsigned short tc_bf16_rne(float v) {
    unsigned b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ unsigned tc_ld32(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// d += A·B for one m16n8k16 fragment set. The g++ emulation of this file
// (kernels/cuda/emu/tc_runner.cpp) defines TC_MMA_EMULATED and its own
// tc_mma, with which it checks the tiling and fragment indices on a CPU.
#ifndef TC_MMA_EMULATED
__device__ __forceinline__ void tc_mma(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// A warp's accumulators out: fragment (i, j) holds tokens g and g + 8 of its
// 16, rows 2t and 2t + 1 of its 8; outputs past n or rows are not written.
template <int BM, int BN, int WM, int WN>
__device__ __forceinline__ void tc_store(const float (&acc)[BM / WM / 16][BN / WN / 8][4], float* Y,
                                         int n, int rows, int m0, int n0, int wm, int wn, int g,
                                         int t) {
#pragma unroll
    for (int i = 0; i < BM / WM / 16; i++)
#pragma unroll
        for (int j = 0; j < BN / WN / 8; j++) {
            const int tok = m0 + wm * (BM / WM) + i * 16 + g;
            const int o = n0 + wn * (BN / WN) + j * 8 + t * 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int tt = tok + h * 8;
                if (tt >= n) continue;
                if (o < rows) Y[(size_t)tt * rows + o] = acc[i][j][h * 2];
                if (o + 1 < rows) Y[(size_t)tt * rows + o + 1] = acc[i][j][h * 2 + 1];
            }
        }
}

// Asynchronous copies and matrix loads (sm_80). The emulation defines
// TC_MMA_EMULATED and its own: copies at once, ldmatrix gathered warp-wide.
#ifndef TC_MMA_EMULATED
// 16 bytes global -> shared, zero-filled (nothing read) where !full.
__device__ __forceinline__ void tc_cp_async16(void* smem, const void* gmem, bool full) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// ldmatrix: lane l gives the row address of matrix l / 8, row l % 8; r[j]
// is the lane's (row g, elements 2t, 2t+1) of matrix j.
__device__ __forceinline__ void tc_ldsm_x4(unsigned* r, const unsigned short* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void tc_ldsm_x2(unsigned* r, const unsigned short* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(s));
}
#define TC_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned short name[]
// A hint: the line holding p into L2 (no register, no wait).
__device__ __forceinline__ void tc_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
#endif

// X (f32) rounded to bf16 (nearest even) once, for tc_mm_* to stream: the
// same rounding the staging of tc_gemm_* does, so either gives the same bits.
extern "C" __global__ void tc_round_bf16(const float* __restrict__ X, unsigned short* __restrict__ Xb,
                                         long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        Xb[i] = tc_bf16_rne(X[i]);
}

// Y (n, rows) f32 = Xb (n, K) bf16 · W (rows, K)ᵀ bf16, K % 8 == 0 (16-byte
// chunks, each wholly inside K or past it). BM tokens x BN rows a block, WM
// x WN warps; k tiles of BK through a ring of STAGES in dynamic shared
// memory, filled by cp.async STAGES - 1 tiles ahead; fragments by ldmatrix.
// Each output is one warp's chain of mma over k blocks of 16 in order from
// +0, zeros past K, k blocks wholly past K skipped: tc_gemm_*'s chains, so
// any tile of either family gives the same bits.
template <int BM, int BN, int WM, int WN, int BK, int STAGES>
__device__ __forceinline__ void tc_mm_body(const unsigned short* __restrict__ Xb,
                                           const unsigned short* __restrict__ W,
                                           float* __restrict__ Y, int n, int rows, int K) {
    constexpr int LD = BK + 8;  // +16 bytes: ldmatrix's 8 rows on 8 bank groups
    constexpr int MI = BM / WM / 16, NI = BN / WN / 8, THREADS = WM * WN * 32, CH = BK / 8;
    constexpr int STAGE = (BM + BN) * LD;
    TC_DYNAMIC_SMEM(smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tiles = (K + BK - 1) / BK;
    auto load = [&](int tile) {
        unsigned short* xs = smem + (tile % STAGES) * STAGE;
        unsigned short* ws = xs + BM * LD;
        const int k0 = tile * BK;
        for (int i = tid; i < BM * CH; i += THREADS) {
            const int r = i / CH, c = (i % CH) * 8, tok = m0 + r, k = k0 + c;
            const bool full = tok < n && k < K;
            tc_cp_async16(xs + r * LD + c, full ? Xb + (size_t)tok * K + k : Xb, full);
        }
        for (int i = tid; i < BN * CH; i += THREADS) {
            const int r = i / CH, c = (i % CH) * 8, o = n0 + r, k = k0 + c;
            const bool full = o < rows && k < K;
            tc_cp_async16(ws + r * LD + c, full ? W + (size_t)o * K + k : W, full);
        }
    };
    float acc[MI][NI][4] = {};  // every chain starts from +0
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < tiles) load(s);
        tc_cp_commit();
    }
    for (int tile = 0; tile < tiles; tile++) {
        tc_cp_wait<STAGES - 2>();
        __syncthreads();  // the tile is in; the slot refilled next was read by all
        if (tile + STAGES - 1 < tiles) load(tile + STAGES - 1);
        tc_cp_commit();
        const unsigned short* xs = smem + (tile % STAGES) * STAGE;
        const unsigned short* ws = xs + BM * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            if (tile * BK + kk >= K) break;
            unsigned a[MI][4], b[NI][2];
#pragma unroll
            for (int i = 0; i < MI; i++)
                tc_ldsm_x4(a[i], xs + (wm * (BM / WM) + i * 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j + 1 < NI; j += 2) {
                unsigned r[4];
                tc_ldsm_x4(r, ws + (wn * (BN / WN) + j * 8 + (lane & 7) + (lane >> 4) * 8) * LD + kk +
                                  ((lane >> 3) & 1) * 8);
                b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
            }
            if (NI & 1)
                tc_ldsm_x2(b[NI - 1], ws + (wn * (BN / WN) + (NI - 1) * 8 + (lane & 7)) * LD + kk +
                                          ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NI; j++) tc_mma(acc[i][j], a[i], b[j]);
        }
    }
    tc_store<BM, BN, WM, WN>(acc, Y, n, rows, m0, n0, wm, wn, g, t);
}

// The instances (tc.rs and tc_probe name them with their tiles, threads and
// shared memory: (BM + BN) * (BK + 8) * 2 * STAGES bytes).
#define TC_MM(NAME, BM, BN, WM, WN, BK, STAGES)                                                      \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32)                                     \
        NAME(const unsigned short* Xb, const unsigned short* W, float* Y, int n, int rows, int K) { \
        tc_mm_body<BM, BN, WM, WN, BK, STAGES>(Xb, W, Y, n, rows, K);                              \
    }
TC_MM(tc_mm_32x32, 32, 32, 2, 2, 64, 4)
TC_MM(tc_mm_64x64, 64, 64, 2, 2, 64, 4)
TC_MM(tc_mm_128x128, 128, 128, 2, 4, 64, 3)

// Few tokens (decode): no shared memory and no barrier. A warp owns 8 rows
// and a tile of TOK tokens (8 or 16) and loads its fragments straight from
// global memory, U k blocks a group, the next group in flight while the
// current group's chain runs. Lane (g, t) loads 8 bytes, elements 4t..4t+3
// of a k block, where the instruction takes elements 2t, 2t+1, 2t+8, 2t+9:
// A and B go through the same permutation of the block's 16 k. Under
// SM90_BF16 an instruction is one fused step over its 16 products (each
// aligned and cut on its own, the cut terms added exactly), so its result
// depends on which 16 k it holds, not on their order: each output is still
// the chain of mma over k blocks of 16 in order from +0, tc_mm_*'s bits.
// K % 8 == 0 (8-byte loads wholly inside K or past it).
__device__ __forceinline__ uint2 tc_ld8(const unsigned short* p, bool ok) {
    return ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
}

// PF > 0: each group also asks L2 for the weights PF groups ahead (lane t
// one 128-byte line of its row's 512), so DRAM's latency is paid ahead of
// the loads that hold registers.
template <int TOK, int U, int PF>
__device__ __forceinline__ void tc_mv_body(const unsigned short* __restrict__ Xb,
                                           const unsigned short* __restrict__ W,
                                           float* __restrict__ Y, int n, int rows, int K) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int o0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 8;
    if (o0 >= rows) return;  // uniform over the warp; nothing below waits on others
    const int m0 = blockIdx.y * TOK, row = o0 + g, t0 = m0 + g, t1 = m0 + g + 8;
    const bool wok = row < rows, ok0 = t0 < n, ok1 = TOK == 16 && t1 < n;
    const unsigned short* wp = W + (size_t)(wok ? row : 0) * K + 4 * t;
    const unsigned short* x0 = Xb + (size_t)(ok0 ? t0 : 0) * K + 4 * t;
    const unsigned short* x1 = Xb + (size_t)(ok1 ? t1 : 0) * K + 4 * t;
    const int blocks = (K + 15) / 16;
    uint2 wb[2][U], xa[2][U], xc[2][TOK == 16 ? U : 1];
    auto load = [&](int s, int kb0) {
        if (PF > 0) {
            const int e = (kb0 + PF * U) * 16 + 64 * t;  // line t of the group's span
            if (wok && e < K) tc_prefetch_l2(wp - 4 * t + e);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int e = (kb0 + u) * 16, in = e + 4 * t < K;
            wb[s][u] = tc_ld8(wp + e, wok && in);
            xa[s][u] = tc_ld8(x0 + e, ok0 && in);
            if (TOK == 16) xc[s][TOK == 16 ? u : 0] = tc_ld8(x1 + e, ok1 && in);
        }
    };
    float acc[4] = {};  // every chain starts from +0
    auto chain = [&](int s, int kb0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (kb0 + u >= blocks) break;  // blocks wholly past K are skipped
            const uint2 c = TOK == 16 ? xc[s][TOK == 16 ? u : 0] : make_uint2(0u, 0u);
            const unsigned a[4] = {xa[s][u].x, c.x, xa[s][u].y, c.y};
            const unsigned b[2] = {wb[s][u].x, wb[s][u].y};
            tc_mma(acc, a, b);
        }
    };
    load(0, 0);
    for (int kb0 = 0; kb0 < blocks; kb0 += 2 * U) {
        load(1, kb0 + U);
        chain(0, kb0);
        load(0, kb0 + 2 * U);
        chain(1, kb0 + U);
    }
    const int o = o0 + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int tt = m0 + g + h * 8;
        if (tt >= n || (h == 1 && TOK == 8)) continue;
        if (o < rows) Y[(size_t)tt * rows + o] = acc[h * 2];
        if (o + 1 < rows) Y[(size_t)tt * rows + o + 1] = acc[h * 2 + 1];
    }
}

// Launch: grid (ceil(rows / 32), ceil(n / TOK)), 128 threads, no shared memory.
#define TC_MV(NAME, TOK, U, PF)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        NAME(const unsigned short* Xb, const unsigned short* W, float* Y, int n, int rows, int K) { \
        tc_mv_body<TOK, U, PF>(Xb, W, Y, n, rows, K);                                           \
    }
TC_MV(tc_mv_8, 8, 16, 2)
TC_MV(tc_mv_16, 16, 8, 0)

// BM tokens x BN rows a block, WM x WN warps, each warp (BM/WM) x (BN/WN).
template <int BM, int BN, int WM, int WN>
__device__ __forceinline__ void tc_gemm_body(const float* __restrict__ X,
                                             const unsigned short* __restrict__ W,
                                             float* __restrict__ Y, int n, int rows, int K) {
    constexpr int BK = 32, LD = BK + 8;  // +8: rows start on other banks
    constexpr int MI = BM / WM / 16, NI = BN / WN / 8, THREADS = WM * WN * 32;
    __shared__ __align__(16) unsigned short xs[BM * LD];
    __shared__ __align__(16) unsigned short ws[BN * LD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const bool vec = (K & 7) == 0;
    float acc[MI][NI][4] = {};  // every chain starts from +0
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool full = vec && k0 + BK <= K;
        if (full) {
            // X: 4 floats a thread a pass; W: 8 bf16.
            for (int i = tid; i < BM * BK / 4; i += THREADS) {
                const int r = i / (BK / 4), c = (i % (BK / 4)) * 4, tok = m0 + r;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (tok < n) v = *reinterpret_cast<const float4*>(X + (size_t)tok * K + k0 + c);
                unsigned short* d = xs + r * LD + c;
                d[0] = tc_bf16_rne(v.x);
                d[1] = tc_bf16_rne(v.y);
                d[2] = tc_bf16_rne(v.z);
                d[3] = tc_bf16_rne(v.w);
            }
            for (int i = tid; i < BN * BK / 8; i += THREADS) {
                const int r = i / (BK / 8), c = (i % (BK / 8)) * 8, o = n0 + r;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (o < rows) v = *reinterpret_cast<const uint4*>(W + (size_t)o * K + k0 + c);
                *reinterpret_cast<uint4*>(ws + r * LD + c) = v;
            }
        } else {
            for (int i = tid; i < BM * BK; i += THREADS) {
                const int r = i / BK, c = i % BK, tok = m0 + r, k = k0 + c;
                xs[r * LD + c] = (tok < n && k < K) ? tc_bf16_rne(X[(size_t)tok * K + k]) : 0;
            }
            for (int i = tid; i < BN * BK; i += THREADS) {
                const int r = i / BK, c = i % BK, o = n0 + r, k = k0 + c;
                ws[r * LD + c] = (o < rows && k < K) ? W[(size_t)o * K + k] : 0;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned a[MI][4], b[NI][2];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                const unsigned short* p = xs + (wm * (BM / WM) + i * 16 + g) * LD + kk + t * 2;
                a[i][0] = tc_ld32(p);
                a[i][1] = tc_ld32(p + 8 * LD);
                a[i][2] = tc_ld32(p + 8);
                a[i][3] = tc_ld32(p + 8 * LD + 8);
            }
#pragma unroll
            for (int j = 0; j < NI; j++) {
                const unsigned short* p = ws + (wn * (BN / WN) + j * 8 + g) * LD + kk + t * 2;
                b[j][0] = tc_ld32(p);
                b[j][1] = tc_ld32(p + 8);
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NI; j++) tc_mma(acc[i][j], a[i], b[j]);
        }
        __syncthreads();
    }
    tc_store<BM, BN, WM, WN>(acc, Y, n, rows, m0, n0, wm, wn, g, t);
}

// Launch: grid (ceil(rows / 64), ceil(n / 64)), 128 threads. The kernel
// for a matrix whose width is not a multiple of 8 (tc_mm_* need 16-byte
// chunks); the same chains.
extern "C" __global__ void __launch_bounds__(128) tc_gemm_64x64(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemm_body<64, 64, 2, 2>(X, W, Y, n, rows, K);
}
