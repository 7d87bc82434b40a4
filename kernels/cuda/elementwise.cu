// elementwise.cu: one value per thread: det_exp of a slice, SwiGLU (plain
// and over a split matmul's partials), embedding rows, residual adds, row
// gathers, and the FMA-rate probe of `lmrr bench`.

extern "C" __global__ void exp_slice(const float* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = det_exp(x[i]);
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int n) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_of(g[i], u[i]);
}

// swiglu of a gate and an up matmul's outputs, each read through
// split_value (its chunk partials summed here where it was split: one
// launch for sum_chunks and swiglu).
extern "C" __global__ void swiglu_split(const float* g, const float* gpart, const float* u, const float* upart,
                                        int chunks, float* out, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_of(split_value(g, gpart, chunks, n, i), split_value(u, upart, chunks, n, i));
}

// Embedding rows: out[t][c] = widened weight c of row ids[t].
extern "C" __global__ void embed_rows(int kind, const unsigned char* w, const unsigned long long* ids,
                                      float* out, int n, int d, long long row_bytes) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    out[idx] = weight(kind, w + (long long)ids[t] * row_bytes, c);
}

// x[i] += y[i], y read through split_value.
extern "C" __global__ void add_rows(float* x, const float* y, const float* part, int chunks, int n) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + split_value(y, part, chunks, n, i);
}

// out[j] = x[rows[j]] (rows of d floats).
extern "C" __global__ void gather_rows(const float* x, const unsigned long long* rows, float* out, int m, int d) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)m * d) return;
    long long j = idx / d;
    int c = (int)(idx % d);
    out[idx] = x[(long long)rows[j] * d + c];
}

// The device's FP32 FMA rate, for `lmrr bench`: 8 independent fmaf chains
// of `iters` steps per thread (2 FLOPs each); the sums are written so that
// nothing is optimised away.
extern "C" __global__ void fma_peak(float* out, int iters, float a, float b) {
    PDL_ENTRY();
    float acc[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = (float)(threadIdx.x + j);
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = fmaf(acc[j], a, b);
    }
    float s = 0.0f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) s = s + acc[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// y[i] = y[i] + b[i % cols]: a matmul's bias, one IEEE add after the dot.
extern "C" __global__ void add_bias(float* y, const float* b, long long n, int cols) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] + b[i % cols];
}

// x[i] = x[i] * by, one IEEE multiply.
extern "C" __global__ void scale_elems(float* x, float by, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * by;
}

// GeGLU: out[i] = gelu_tanh(g[i]) * u[i], gelu_tanh in the order of
// kernels/src/act.rs (x / (1 + det_exp(neg2c * fma(a * x², x, x)))); the two
// constants come from the host so that they are its bits.
extern "C" __global__ void geglu(const float* g, const float* u, float* out, long long n, float a,
                                 float neg2c) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = g[i];
    float v = fmaf(a * (x * x), x, x);
    out[i] = x / (1.0f + det_exp(v * neg2c)) * u[i];
}

// out[t][c] = x[t][c % d]: each row of d repeated across a row of w.
extern "C" __global__ void repeat_rows(const float* x, float* out, int n, int d, int w) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * w) return;
    long long t = idx / w;
    int c = (int)(idx % w);
    out[idx] = x[t * d + c % d];
}

// Every element rounded to bf16 (nearest, ties to even; a NaN kept quiet)
// and widened back, as the host's f32_to_bf16.
extern "C" __global__ void round_bf16(float* x, long long n) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned int b = __float_as_uint(x[i]);
    unsigned int h = x[i] != x[i] ? ((b >> 16) | 0x40u) : ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    x[i] = __uint_as_float((h & 0xFFFFu) << 16);
}

// out[t][c] = (sum over streams j, in order from +0.0, of x[t][j][c]) * inv.
extern "C" __global__ void stream_mean(const float* x, float* out, int n, int s, int d, float inv) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    float acc = 0.0f;
    for (int j = 0; j < s; ++j) acc = acc + x[(t * s + j) * d + c];
    out[idx] = acc * inv;
}
