// common.cuh: what every kernel family shares: the canonical order's
// constants (CHUNK, LANES) and lane tree, the programmatic-dependent-launch
// entry macros, det_exp, split_value (a split matmul's partials summed where
// they are read), swiglu_of, and the paged KV layout (kv_row).
//
// The kernels' files are not compiled on their own: kernels/src/cuda_source.rs
// joins them in a fixed order (common.cuh, quant.cuh, dot.cuh, matmul.cu,
// norm.cu, elementwise.cu, rope.cu, attention.cu, attention_split.cu, hyper.cu) into the one
// source NVRTC compiles, the g++ emulation includes and the negative
// controls mutate; a file may use what the files before it define.
//
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

// Prologue before the wait (the resident module
// compiled with PDL_PREFETCH defined): a kernel whose first loads are of
// weights (matmul_rows and its forms; norm_reg's norm weight)
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

// A paged KV page on the device: per layer, page_len K rows then page_len V
// rows (kv_dim floats each) then page_len auxiliary rows (aux floats), at
// the device address the page table holds.
__device__ __forceinline__ float* kv_row(unsigned long long page, int layer, int page_len, int kvd, int aux,
                                         int slot, int which) {
    long long layer_stride = (long long)page_len * (2 * kvd + aux);
    return (float*)page + layer * layer_stride + (long long)which * page_len * kvd + (long long)slot * kvd;
}
