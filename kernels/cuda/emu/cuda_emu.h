// A CPU emulation of the CUDA features kernels.cu uses, so that the very
// source the device compiles runs on a host. Blocks run one after another on
// one OS thread; the threads of a block are fibers (one small stack each,
// reused from block to block and launch to launch) that a scheduler runs in
// turn. A fiber runs until it reaches a point where other threads must
// arrive first: `__syncthreads` (the block), `__syncwarp` and the shuffles
// (its warp). It waits there, and resumes once every thread of the block or
// warp has arrived. `__shared__` becomes `static`: the block's fibers share
// one copy, and blocks run one at a time, so one copy serves each in turn.
// A block whose threads cannot all arrive (one returned before a barrier the
// others wait at, or a warp split between a shuffle and a block barrier)
// is a deadlock on a device; here it ends the process with exit code 3 and
// what each thread waits at.
//
// Arithmetic is the host's IEEE single precision with contraction off
// (compile with -ffp-contract=off): fmaf is C's correctly rounded fmaf,
// division and sqrtf are IEEE, as NVRTC's -prec-div/-prec-sqrt make them.
// The scheduling changes no arithmetic: each thread's operations and the
// values it exchanges are the kernel's own.
//
// Fibers switch by a few lines of assembly on x86-64 (ucontext elsewhere:
// correct, slower, as swapcontext makes a system call per switch).
// Used by kernels/tests/cuda_emulated/; not a performance model.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores its stack
// pointer in *save, and continues on the stack `to` (one saved the same
// way, or a new fiber's first frame).
extern "C" void emu_switch(void** save, void* to);
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#endif

enum class Wait { None, Block, Warp };

struct Fiber {
    dim3 tid;
    Wait wait = Wait::None;
    unsigned gen = 0;  // the barrier's generation when this fiber arrived
    bool done = false;
    unsigned char* stack = nullptr;
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
};

struct Warp {
    unsigned lanes = 0;    // threads of the block in this warp
    unsigned arrived = 0;  // at the warp's current barrier
    unsigned gen = 0;      // completed warp barriers
    // Shuffle values, two sets: a shuffle writes set gen & 1 then waits, so
    // a lane that runs on to the next shuffle writes the other set while
    // the others still read this one; the one after that needs them all to
    // have arrived at the next, past their reads.
    uint64_t value[2][32];
};

// One launch's state; blocks run one at a time, so one of each.
inline dim3 g_block_dim, g_grid_dim, g_block_idx;
inline Fiber* g_cur = nullptr;
inline std::vector<Fiber> g_fibers;
inline std::vector<Warp> g_warps;
inline unsigned g_block_arrived = 0, g_block_gen = 0;
inline void (*g_body)(void*) = nullptr;
inline void* g_body_arg = nullptr;
#if defined(__x86_64__)
inline void* g_sched_sp = nullptr;
#else
inline ucontext_t g_sched_ctx;
#endif

// Each fiber's stack, with a guard page below it so that an overflow faults.
constexpr size_t kStack = 256 * 1024;

inline unsigned char* new_stack() {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void* p = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                   0);
    if (p == MAP_FAILED) {
        std::fprintf(stderr, "cuda_emu: no memory for a fiber stack\n");
        std::exit(3);
    }
    mprotect(p, page, PROT_NONE);
    return (unsigned char*)p + page;
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
    Fiber* me = g_cur;
#if defined(__x86_64__)
    emu_switch(&me->sp, g_sched_sp);
#else
    swapcontext(&me->ctx, &g_sched_ctx);
#endif
}

[[noreturn]] inline void fiber_main() {
    g_body(g_body_arg);
    g_cur->done = true;
    yield();
    std::abort();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
inline void fiber_entry() { fiber_main(); }
#endif

// Sets fiber f to start the kernel body from the top of its stack.
inline void start(Fiber& f) {
    if (!f.stack) f.stack = new_stack();
#if defined(__x86_64__)
    // emu_switch pops six registers and returns into fiber_main; the return
    // slot at a 16-byte boundary leaves the stack as a call would.
    uintptr_t* sp = (uintptr_t*)(((uintptr_t)(f.stack + kStack)) & ~(uintptr_t)15);
    *--sp = 0;
    *--sp = (uintptr_t)&fiber_main;
    for (int i = 0; i < 6; ++i) *--sp = 0;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, (void (*)())fiber_entry, 0);
#endif
}

inline void resume(Fiber& f) {
    g_cur = &f;
#if defined(__x86_64__)
    emu_switch(&g_sched_sp, f.sp);
#else
    swapcontext(&g_sched_ctx, &f.ctx);
#endif
    g_cur = nullptr;
}

inline bool released(const Fiber& f) {
    switch (f.wait) {
        case Wait::Block:
            return g_block_gen != f.gen;
        case Wait::Warp:
            return g_warps[f.tid.x / 32].gen != f.gen;
        default:
            return true;
    }
}

[[noreturn]] inline void deadlock(unsigned threads) {
    std::fprintf(stderr, "cuda_emu: deadlock in block %u of %u (%u threads):", g_block_idx.x, g_grid_dim.x, threads);
    for (unsigned t = 0; t < threads; ++t) {
        const Fiber& f = g_fibers[t];
        std::fprintf(stderr, " %u:%s", t,
                     f.done ? "returned" : f.wait == Wait::Block ? "__syncthreads" : "warp");
    }
    std::fprintf(stderr, "\n");
    std::exit(3);
}

// Runs the current block's `threads` fibers until every one has returned.
inline void run_block(unsigned threads) {
    g_block_arrived = 0;
    for (unsigned w = 0; w < g_warps.size(); ++w) g_warps[w].arrived = 0;
    for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = g_fibers[t];
        f.tid = dim3{t, 0, 0};
        f.wait = Wait::None;
        f.done = false;
        start(f);
    }
    for (unsigned live = threads; live > 0;) {
        bool ran = false;
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = g_fibers[t];
            if (f.done || !released(f)) continue;
            f.wait = Wait::None;
            resume(f);
            ran = true;
            if (f.done) --live;
        }
        if (!ran && live > 0) deadlock(threads);
    }
}

// Arrival at a barrier over `expected` threads whose count and generation
// are *arrived and *gen: the last to arrive releases the others and runs
// on; the others wait for the generation to move.
inline void arrive(Wait kind, unsigned& arrived, unsigned& gen, unsigned expected) {
    if (++arrived == expected) {
        arrived = 0;
        ++gen;
        return;
    }
    g_cur->wait = kind;
    g_cur->gen = gen;
    yield();
}

inline void sync_block() { arrive(Wait::Block, g_block_arrived, g_block_gen, g_block_dim.x); }

inline Warp& my_warp() { return g_warps[g_cur->tid.x / 32]; }

inline void sync_warp() {
    Warp& w = my_warp();
    arrive(Wait::Warp, w.arrived, w.gen, w.lanes);
}

// Every lane of the warp offers `v`; returns the value lane `src` offered.
template <class T>
inline T exchange(T v, unsigned src) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 64 bits");
    Warp& w = my_warp();
    unsigned set = w.gen & 1u;
    uint64_t slot = 0;
    std::memcpy(&slot, &v, sizeof(T));
    w.value[set][g_cur->tid.x & 31u] = slot;
    sync_warp();
    if (src >= w.lanes) {
        std::fprintf(stderr, "cuda_emu: shuffle from lane %u of a warp of %u\n", src, w.lanes);
        std::exit(3);
    }
    T got;
    std::memcpy(&got, &w.value[set][src], sizeof(T));
    return got;
}

// Runs kernel `f` over `grid` blocks of `block` threads, one block after
// another.
template <class F>
void launch(unsigned grid, unsigned block, F f) {
    g_block_dim = dim3{block, 1, 1};
    g_grid_dim = dim3{grid, 1, 1};
    if (g_fibers.size() < block) g_fibers.resize(block);
    g_warps.assign((block + 31) / 32, Warp{});
    for (unsigned w = 0; w < g_warps.size(); ++w) g_warps[w].lanes = std::min(32u, block - 32 * w);
    g_body = [](void* p) { (*(F*)p)(); };
    g_body_arg = &f;
    for (unsigned b = 0; b < grid; ++b) {
        g_block_idx = dim3{b, 0, 0};
        run_block(block);
    }
}
}  // namespace emu

#define threadIdx (emu::g_cur->tid)
#define blockIdx (emu::g_block_idx)
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

struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

inline void __syncthreads() { emu::sync_block(); }

inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emu::exchange(v, (unsigned)(src & 31));
}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
    return emu::exchange(v, (threadIdx.x & 31u) ^ (unsigned)(m & 31));
}

// Lane i gets lane i + d's value (its own where i + d is past the warp).
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d) {
    unsigned lane = threadIdx.x & 31u;
    return emu::exchange(v, lane + d < 32u ? lane + d : lane);
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
inline unsigned __float_as_uint(float f) {
    unsigned i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
// Blocks run one after another, so a fence orders nothing the emulation
// could reorder; it is a real one all the same. atomicInc as CUDA defines
// it: old = *a; *a = old >= val ? 0 : old + 1; returns old.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicInc(unsigned* a, unsigned val) {
    unsigned old = *a;
    *a = old >= val ? 0u : old + 1u;
    return old;
}
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
using std::isnan;
using std::max;
using std::min;
