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

// cp.async (sm_80): `bytes` (4, 8 or 16) from global to shared, zero-filled
// where `full` is false (then nothing is read). The emulation defines
// TC_MMA_EMULATED and copies at once.
#ifndef TC_MMA_EMULATED
__device__ __forceinline__ void tc_cp_async8(void* smem, const void* gmem, bool full) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 8 : 0));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif

__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    return (unsigned)tc_bf16_rne(lo) | ((unsigned)tc_bf16_rne(hi) << 16);
}

// Up to 16 tokens (decode): a warp per 8 rows of W over the whole of K, one
// mma a k block, so there are only rows / 8 chains to run at once; memory
// is kept busy by a ring of STAGES k blocks a warp, in flight by cp.async.
// Within a block the lanes' k are permuted the same way for X and W (lane t
// holds k 4t..4t+3: the fragment's k 2t, 2t+1 and 2t+8, 2t+9), so a lane
// reads 8 contiguous bytes of a row; the mma still sums the same 16
// products into the same accumulator, and its sum does not depend on their
// order (the model: products aligned to the largest exponent, truncated,
// added exactly). Each lane reads back only the slots it filled, so the
// ring needs no barrier. Needs K % 4 == 0 (8-byte W chunks, 16-byte X);
// tc_gemm_16x32 serves other K.
template <int WARPS, int STAGES>
__device__ __forceinline__ void tc_gemv_body(const float* __restrict__ X,
                                             const unsigned short* __restrict__ W,
                                             float* __restrict__ Y, int n, int rows, int K) {
    __shared__ __align__(16) unsigned ring[WARPS][STAGES][32][2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = (blockIdx.x * WARPS + warp) * 8, row = row0 + g;
    const int blocks = (K + 15) >> 4;
    const unsigned short* wrow = W + (size_t)(row < rows ? row : 0) * K;
    auto issue = [&](int b) {
        if (b < blocks) {
            const int k = b * 16 + t * 4;
            const bool full = row < rows && k < K;
            tc_cp_async8(ring[warp][b % STAGES][lane], full ? wrow + k : W, full);
        }
        tc_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue(s);
    const bool lo = g < n, hi = g + 8 < n;
    const float* x0 = X + (size_t)(lo ? g : 0) * K;
    const float* x1 = X + (size_t)(hi ? g + 8 : 0) * K;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int b = 0; b < blocks; b++) {
        issue(b + STAGES - 1);
        const int k = b * 16 + t * 4;
        float4 v0 = make_float4(0.f, 0.f, 0.f, 0.f), v1 = v0;
        if (k < K) {
            if (lo) v0 = *reinterpret_cast<const float4*>(x0 + k);
            if (hi) v1 = *reinterpret_cast<const float4*>(x1 + k);
        }
        const unsigned a[4] = {tc_pack(v0.x, v0.y), tc_pack(v1.x, v1.y), tc_pack(v0.z, v0.w),
                               tc_pack(v1.z, v1.w)};
        tc_cp_wait<STAGES - 1>();
        const unsigned* w = ring[warp][b % STAGES][lane];
        const unsigned bw[2] = {w[0], w[1]};
        tc_mma(acc, a, bw);
    }
    const int o = row0 + t * 2;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int tok = g + h * 8;
        if (tok >= n) continue;
        if (o < rows) Y[(size_t)tok * rows + o] = acc[h * 2];
        if (o + 1 < rows) Y[(size_t)tok * rows + o + 1] = acc[h * 2 + 1];
    }
}

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
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;
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
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++) {
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

// Launch: grid (ceil(rows / BN), ceil(n / BM)), WM * WN * 32 threads.
extern "C" __global__ void __launch_bounds__(256) tc_gemm_128x128(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemm_body<128, 128, 2, 4>(X, W, Y, n, rows, K);
}
extern "C" __global__ void __launch_bounds__(128) tc_gemm_64x64(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemm_body<64, 64, 2, 2>(X, W, Y, n, rows, K);
}
extern "C" __global__ void __launch_bounds__(128) tc_gemm_16x32(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemm_body<16, 32, 1, 4>(X, W, Y, n, rows, K);
}
// Launch: grid (ceil(rows / 32)), 128 threads; n <= 16, K % 4 == 0.
extern "C" __global__ void __launch_bounds__(128) tc_gemv_16(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemv_body<4, 16>(X, W, Y, n, rows, K);
}
extern "C" __global__ void __launch_bounds__(128) tc_gemv_32(
    const float* X, const unsigned short* W, float* Y, int n, int rows, int K) {
    tc_gemv_body<4, 32>(X, W, Y, n, rows, K);
}
