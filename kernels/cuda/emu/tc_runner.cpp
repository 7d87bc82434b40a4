// Runs the tensor-core GEMM (kernels/cuda/tc/gemm.cu) on the CPU emulation
// (cuda_emu.h) to check its tiling, staging and fragment indices: each
// mma.m16n8k16 is emulated warp-wide from the lanes' fragments as PTX's ISA
// places them, with a stand-in arithmetic for the instruction's inner
// product (the addend plus the 16 products summed in double, in k order, then
// rounded to float). kernels/tests/cuda_emulated/tc_gemm.rs computes the same
// chain on the host: any wrong row, column, k or block order shows.
//
// Protocol as runner.cpp's: `tc_gemm KERNEL n rows k`, then x (f32, n·k) and
// w (bf16 bits, rows·k); out: y (f32, n·rows).
#include "cuda_emu.h"

#define TC_MMA_EMULATED 1

static float tc_emu_bf16(unsigned short b) {
    unsigned u = (unsigned)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Lane (g, t) holds A rows g and g+8 at k 2t, 2t+1 (a0, a1) and 2t+8, 2t+9
// (a2, a3); B column g at k 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1); D rows g and
// g+8, columns 2t and 2t+1.
__device__ void tc_mma(float* d, const unsigned* a, const unsigned* b) {
    const unsigned lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    float arow[2][16], bcol[2][16];
    for (unsigned tt = 0; tt < 4; tt++) {
        unsigned src = g * 4 + tt;
        unsigned v[4];
        for (int r = 0; r < 4; r++) v[r] = emu::exchange(a[r], src);
        for (int h = 0; h < 2; h++) {
            // h = 0: row g (a0, a2); h = 1: row g + 8 (a1, a3).
            unsigned lo = v[h], hi = v[h + 2];
            arow[h][tt * 2] = tc_emu_bf16((unsigned short)(lo & 0xffff));
            arow[h][tt * 2 + 1] = tc_emu_bf16((unsigned short)(lo >> 16));
            arow[h][tt * 2 + 8] = tc_emu_bf16((unsigned short)(hi & 0xffff));
            arow[h][tt * 2 + 9] = tc_emu_bf16((unsigned short)(hi >> 16));
        }
    }
    for (unsigned c = 0; c < 2; c++) {
        for (unsigned tt = 0; tt < 4; tt++) {
            unsigned src = (t * 2 + c) * 4 + tt;
            unsigned b0 = emu::exchange(b[0], src), b1 = emu::exchange(b[1], src);
            bcol[c][tt * 2] = tc_emu_bf16((unsigned short)(b0 & 0xffff));
            bcol[c][tt * 2 + 1] = tc_emu_bf16((unsigned short)(b0 >> 16));
            bcol[c][tt * 2 + 8] = tc_emu_bf16((unsigned short)(b1 & 0xffff));
            bcol[c][tt * 2 + 9] = tc_emu_bf16((unsigned short)(b1 >> 16));
        }
    }
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 2; c++) {
            double s = d[h * 2 + c];
            for (int k = 0; k < 16; k++) s += (double)arow[h][k] * (double)bcol[c][k];
            d[h * 2 + c] = (float)s;
        }
}

// cp.async: the copy at once (what a thread reads after the wait and the
// barrier is what the device would have copied by then).
__device__ void tc_cp_async16(void* smem, const void* gmem, bool full) {
    if (full) std::memcpy(smem, gmem, 16);
    else std::memset(smem, 0, 16);
}
__device__ void tc_cp_commit() {}
template <int N>
__device__ void tc_cp_wait() {}
// ldmatrix: lane (g, t) takes, of matrix j, the word at element 2t of the
// row whose address lane 8j + g gave.
template <int M>
static void tc_ldsm(unsigned* r, const unsigned short* p) {
    const unsigned lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    for (unsigned j = 0; j < M; j++) {
        const unsigned short* q = emu::exchange(p, j * 8 + g);
        std::memcpy(&r[j], q + 2 * t, 4);
    }
}
__device__ void tc_ldsm_x4(unsigned* r, const unsigned short* p) { tc_ldsm<4>(r, p); }
__device__ void tc_ldsm_x2(unsigned* r, const unsigned short* p) { tc_ldsm<2>(r, p); }
__device__ void tc_prefetch_l2(const void*) {}
// Dynamic shared memory: one static buffer as large as the largest instance.
#define TC_DYNAMIC_SMEM(name) static __attribute__((aligned(16))) unsigned short name[(1 << 17) / 2]

#include "../tc/gemm.cu"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "job_io.h"

int main() {
    std::string line;
    for (int c; (c = std::fgetc(stdin)) != EOF && c != '\n';) line.push_back((char)c);
    std::istringstream hs(line);
    std::string job, kernel;
    int n = 0, rows = 0, k = 0;
    hs >> job >> kernel >> n >> rows >> k;
    if (job != "tc_gemm") return 2;
    auto x = read_as<float>();
    auto w = read_as<unsigned short>();
    std::vector<float> y((size_t)n * rows, std::nanf(""));
    int bm = 0, bn = 0, threads = 0;
    void (*gemm)(const float*, const unsigned short*, float*, int, int, int) = nullptr;
    void (*mm)(const unsigned short*, const unsigned short*, float*, int, int, int) = nullptr;
    if (kernel == "tc_gemm_64x64") bm = 64, bn = 64, threads = 128, gemm = tc_gemm_64x64;
    else if (kernel == "tc_mm_128x128") bm = 128, bn = 128, threads = 256, mm = tc_mm_128x128;
    else if (kernel == "tc_mm_64x64") bm = 64, bn = 64, threads = 128, mm = tc_mm_64x64;
    else if (kernel == "tc_mv_8") bm = 8, bn = 32, threads = 128, mm = tc_mv_8;
    else if (kernel == "tc_mv_16") bm = 16, bn = 32, threads = 128, mm = tc_mv_16;
    else if (kernel == "tc_mm_32x32") bm = 32, bn = 32, threads = 128, mm = tc_mm_32x32;
    else return 2;
    // tc_mm_*: x rounded to bf16 by tc_round_bf16 first, as tc.rs does.
    std::vector<unsigned short> xb(x.size());
    if (mm) emu::launch(4, 64, [&] { tc_round_bf16(x.data(), xb.data(), (long long)x.size()); });
    // The emulation's grids are one-dimensional: each row of blocks over the
    // tokens (blockIdx.y on the device) is a launch of its own on the tokens
    // it covers, which is what blockIdx.y · BM offsets to.
    for (int m0 = 0; m0 < n; m0 += bm) {
        const float* xp = x.data() + (size_t)m0 * k;
        const unsigned short* xbp = xb.data() + (size_t)m0 * k;
        float* yp = y.data() + (size_t)m0 * rows;
        int nn = std::min(bm, n - m0);
        unsigned grid = (unsigned)((rows + bn - 1) / bn);
        if (mm) emu::launch(grid, threads, [&] { mm(xbp, w.data(), yp, nn, rows, k); });
        else emu::launch(grid, threads, [&] { gemm(xp, w.data(), yp, nn, rows, k); });
    }
    write_array(y);
    return 0;
}
