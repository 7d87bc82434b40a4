// rope.cu: rotate-half RoPE: of one row with the host's tables (rope), and
// of a step's q and k rows with the K/V rows written into their pages
// (rope_kv).

// Rotate-half RoPE of one row of `width` = heads * d values at position pos,
// with the host's tables (cos/sin rows of d/2 values).
extern "C" __global__ void rope(float* x, const float* cos_row, const float* sin_row, int width, int d) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    int h = d / 2;
    if (idx >= width / 2) return;
    int head = idx / h, i = idx % h;
    float* p = x + head * d;
    float a = p[i], b = p[i + h];
    p[i] = a * cos_row[i] - b * sin_row[i];
    p[i + h] = b * cos_row[i] + a * sin_row[i];
}

// RoPE of n query rows (qd) and key rows (kvd) at positions pos[t], and the
// rotated K rows with the V rows written into token t's page dst[t], slot
// slot[t], of `layer` (RoPE then the page writes, in one launch). q, k and
// v are read through split_value (qpart, kpart, vpart: the partials of a
// split q, k or v matmul, summed here): the rows are then written to q, k
// and v as well, as sum_chunks would have left them before the rotation.
extern "C" __global__ void rope_kv(float* q, float* k, float* v, const float* qpart, const float* kpart,
                                   const float* vpart, int chunks, const float* cos_t, const float* sin_t,
                                   const unsigned long long* pos, const unsigned long long* dst,
                                   const unsigned long long* slot, int n, int qd, int kvd, int d,
                                   int layer, int page_len, int aux) {
    PDL_ENTRY();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int h = d / 2;
    int per = qd / 2 + kvd / 2 + kvd;
    if (idx >= (long long)n * per) return;
    long long t = idx / per;
    int r = (int)(idx % per);
    int s = (int)slot[t];
    if (r >= qd / 2 + kvd / 2) {
        int c = r - qd / 2 - kvd / 2;
        float val = split_value(v, vpart, chunks, (long long)n * kvd, t * kvd + c);
        if (vpart) v[t * kvd + c] = val;
        kv_row(dst[t], layer, page_len, kvd, aux, s, 1)[c] = val;
        return;
    }
    bool is_k = r >= qd / 2;
    int width = is_k ? kvd : qd;
    float* base = is_k ? k : q;
    float* row = base + t * width;
    const float* part = is_k ? kpart : qpart;
    if (is_k) r -= qd / 2;
    int head = r / h, i = r % h;
    float* p = row + head * d;
    const float* c = cos_t + (long long)pos[t] * h;
    const float* sn = sin_t + (long long)pos[t] * h;
    long long at = t * width + head * d + i;
    float a = split_value(base, part, chunks, (long long)n * width, at);
    float b = split_value(base, part, chunks, (long long)n * width, at + h);
    float lo = a * c[i] - b * sn[i];
    float hi = b * c[i] + a * sn[i];
    p[i] = lo;
    p[i + h] = hi;
    if (is_k) {
        float* kr = kv_row(dst[t], layer, page_len, kvd, aux, s, 0) + head * d;
        kr[i] = lo;
        kr[i + h] = hi;
    }
}
