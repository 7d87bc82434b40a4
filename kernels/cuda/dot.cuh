// dot.cuh: the canonical dot product of an input row with a weight row: on
// one thread (dot_canon) and on a whole warp in the same order (warp_dot).

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
