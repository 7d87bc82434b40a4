// hyper.cu: mini-v4's hyper-connection coefficients (sigmoid, Sinkhorn-Knopp)
// and stream mixes, MoE expert combine and indexer scores, in the order of
// kernels/src/hyper.rs, one rounding per written operation.

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + det_exp(-x));
}

// Coefficients of n tokens from raw (n, 2h + h*h), one thread per token:
// pre (n, h), post (n, h), res (n, h, h) after `iters` Sinkhorn-Knopp rounds
// (rows then columns; sums sequential from +0.0 in index order; IEEE division).
extern "C" __global__ void hc_coeffs(const float* raw, float* pre, float* post, float* res,
                                     int n, int h, int iters, float eps) {
    PDL_ENTRY();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    int w = 2 * h + h * h;
    const float* r = raw + (long long)t * w;
    for (int i = 0; i < h; ++i) {
        pre[(long long)t * h + i] = sigmoid(r[i]);
        post[(long long)t * h + i] = 2.0f * sigmoid(r[h + i]);
    }
    const float* rr = r + 2 * h;
    float* m = res + (long long)t * h * h;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int k = 0; k < h * h; ++k) {
        if (rr[k] > mx) mx = rr[k];
    }
    for (int k = 0; k < h * h; ++k) m[k] = det_exp(rr[k] - mx) + eps;
    for (int it = 0; it < iters; ++it) {
        for (int i = 0; i < h; ++i) {
            float s = 0.0f;
            for (int j = 0; j < h; ++j) s = s + m[i * h + j];
            for (int j = 0; j < h; ++j) m[i * h + j] = m[i * h + j] / s;  // row
        }
        for (int j = 0; j < h; ++j) {
            float s = 0.0f;
            for (int i = 0; i < h; ++i) s = s + m[i * h + j];
            for (int i = 0; i < h; ++i) m[i * h + j] = m[i * h + j] / s;  // column
        }
    }
}

// out[t][c] = sum_i pre[t][i] * x[t][i][c], an fmaf chain from +0.0 over
// streams; one thread per (t, c).
extern "C" __global__ void hc_pre(const float* x, const float* pre, float* out, int n, int h, int d) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    float acc = 0.0f;
    for (int i = 0; i < h; ++i) acc = fmaf(pre[t * h + i], x[(t * h + i) * d + c], acc);
    out[idx] = acc;
}

// out[t][i][c] = sum_j res[t][i][j] * x[t][j][c], then + post[t][i] * y[t][c],
// one fmaf chain; one thread per (t, i, c).
extern "C" __global__ void hc_post(const float* x, const float* res, const float* post,
                                   const float* y, float* out, int n, int h, int d) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * h * d) return;
    int c = (int)(idx % d);
    long long ti = idx / d;  // t * h + i
    long long t = ti / h;
    float acc = 0.0f;
    for (int j = 0; j < h; ++j) acc = fmaf(res[ti * h + j], x[(t * h + j) * d + c], acc);
    out[idx] = fmaf(post[ti], y[t * d + c], acc);
}

// Expert combine of n tokens: token t uses experts off[t] .. off[t+1] (gates
// and rows of ys, row width d, ascending expert index);
// out[t][c] = base[t][c] + sum_e gate[e] * ys[e][c], an fmaf chain from base.
extern "C" __global__ void moe_combine(const float* base, const float* gates, const float* ys,
                                       const int* off, float* out, int n, int d) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    long long t = idx / d;
    int c = (int)(idx % d);
    float acc = base[idx];
    for (int e = off[t]; e < off[t + 1]; ++e) acc = fmaf(gates[e], ys[(long long)e * d + c], acc);
    out[idx] = acc;
}

// Indexer scores of one query q (heads, dim) against m keys (m, dim):
// out[s] = sum_h w[h] * relu(dot(q_h, key_s)), the dot canonical (dot_canon),
// the head sum an fmaf chain from +0.0 in head order; one thread per key.
extern "C" __global__ void index_scores(const float* q, const float* w, const float* keys,
                                        float* out, int m, int heads, int dim) {
    PDL_ENTRY();
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= m) return;
    const float* key = keys + (long long)s * dim;
    float acc = 0.0f;
    for (int hh = 0; hh < heads; ++hh) {
        float v = dot_canon(0, q + (long long)hh * dim, key, dim);
        float r = v > 0.0f ? v : 0.0f;
        acc = fmaf(w[hh], r, acc);
    }
    out[s] = acc;
}

// moe_combine over expert outputs laid out by expert: entry e of token t
// reads row idx[e] of ys; base null: the chain starts from +0.0 (no shared
// expert). The same fmaf chain as moe_combine.
extern "C" __global__ void moe_combine_idx(const float* base, const float* gates, const float* ys,
                                           const int* idx, const int* off, float* out, int n, int d) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * d) return;
    long long t = i / d;
    int c = (int)(i % d);
    float acc = base ? base[i] : 0.0f;
    for (int e = off[t]; e < off[t + 1]; ++e) acc = fmaf(gates[e], ys[(long long)idx[e] * d + c], acc);
    out[i] = acc;
}

// Indexer keys of n tokens into their pages: row t of ik (aux floats) to the
// auxiliary row of slot[t] in page dst[t] at `layer` (after the page's K and
// V rows; the layout of kv_row).
extern "C" __global__ void kv_write_aux(const float* ik, const unsigned long long* dst,
                                        const unsigned long long* slot, int n, int layer, int page_len,
                                        int kvd, int aux) {
    PDL_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * aux) return;
    long long t = i / aux;
    int c = (int)(i % aux);
    long long stride = (long long)page_len * (2 * kvd + aux);
    float* row = (float*)dst[t] + layer * stride + 2LL * page_len * kvd + (long long)slot[t] * aux;
    row[c] = ik[i];
}
