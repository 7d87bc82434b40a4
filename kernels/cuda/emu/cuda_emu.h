// A CPU emulation of the CUDA features kernels.cu uses, so that the very
// source the device compiles runs on a host, each GPU thread an OS thread:
// blocks run one after another, the threads of a block concurrently, with
// __syncthreads a barrier over the block and the warp shuffles an exchange
// through memory between two barriers over the warp. `__shared__` becomes
// `static` (blocks run one at a time, so one copy serves each block in
// turn). Arithmetic is the host's IEEE single precision with contraction
// off (compile with -ffp-contract=off): fmaf is C's correctly rounded fmaf,
// division and sqrtf are IEEE, as NVRTC's -prec-div/-prec-sqrt make them.
// Used by kernels/tests/cuda_emulated.rs; not a performance model.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {
struct Block {
    std::barrier<>* block;
    std::vector<std::unique_ptr<std::barrier<>>>* warps;
    float* lanes;  // one slot per thread, for shuffles
};
inline thread_local dim3 tl_thread, tl_block;
inline dim3 g_block_dim, g_grid_dim;
inline thread_local Block* tl_ctx = nullptr;
}  // namespace emu

#define threadIdx (emu::tl_thread)
#define blockIdx (emu::tl_block)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct alignas(8) float2 {
    float x, y;
};

struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

inline void __syncthreads() { emu::tl_ctx->block->arrive_and_wait(); }

inline std::barrier<>& emu_warp() {
    return *(*emu::tl_ctx->warps)[emu::tl_thread.x / 32];
}

inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp().arrive_and_wait(); }

inline float __shfl_sync(unsigned, float v, int src) {
    unsigned me = emu::tl_thread.x, base = me & ~31u;
    emu::tl_ctx->lanes[me] = v;
    emu_warp().arrive_and_wait();
    float got = emu::tl_ctx->lanes[base + (unsigned)(src & 31)];
    emu_warp().arrive_and_wait();
    return got;
}

inline float __shfl_xor_sync(unsigned mask, float v, int m) {
    return __shfl_sync(mask, v, (int)((emu::tl_thread.x & 31u) ^ (unsigned)m));
}

// Lane i gets lane i + d's value (its own where i + d is past the warp).
inline float __shfl_down_sync(unsigned mask, float v, unsigned d) {
    unsigned lane = emu::tl_thread.x & 31u;
    return __shfl_sync(mask, v, (int)(lane + d < 32u ? lane + d : lane));
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
// Blocks run one after another, so a fence orders nothing the emulation
// could reorder; it is a real one all the same. atomicInc as CUDA defines
// it: old = *a; *a = old >= val ? 0 : old + 1; returns old.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicInc(unsigned* a, unsigned val) {
    unsigned old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(a, &old, old >= val ? 0u : old + 1u, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
    }
    return old;
}
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
using std::isnan;
using std::max;
using std::min;

namespace emu {
// Runs kernel `f` over `grid` blocks of `block` threads (block a multiple of
// 32, as every launch of kernels.cu is): `block` OS threads take the blocks
// one after another, all of them finishing a block before any starts the
// next (a thread that returns early waits there).
template <class F>
void launch(unsigned grid, unsigned block, F f) {
    g_block_dim.x = block;
    g_grid_dim.x = grid;
    std::vector<float> lanes(block);
    std::barrier<> bar(block), between(block);
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (unsigned w = 0; w < (block + 31) / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
    Block ctx{&bar, &warps, lanes.data()};
    std::vector<std::thread> ts;
    ts.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
        ts.emplace_back([&, t] {
            tl_thread.x = t;
            tl_ctx = &ctx;
            for (unsigned b = 0; b < grid; ++b) {
                tl_block.x = b;
                f();
                between.arrive_and_wait();
            }
        });
    }
    for (auto& t : ts) t.join();
}
}  // namespace emu
