// attention_split.cu: decode attention split over the KV length, for steps
// of few (token, head) rows and long contexts, in three launches that give
// attention_body's bits:
//
//  1. attention_split_scores, `segs` blocks per row, block b taking the
//     segments of SPLIT_TILES tiles b, b + segs, … (so that one launch
//     shape serves any context: a graph replays it): every score s_j = dot(q, k_j) · scale (lane j's FMA chain of
//     each chunk, the xor tree 4, 2, 1, chunk partials in order from +0.0)
//     into sc, and each tile's maximum (sequential over its positions from
//     -inf, a position replacing it only when greater) into tm;
//  2. attention_split_pv, the same blocks: the running max before the
//     segment, then per tile of it the running max m after it, alpha =
//     det_exp(m before - m after), p_j = det_exp(s_j - m after), lt (the
//     sum of its p in index order from +0.0) and acc_t[d] (the fmaf chain
//     of p_j · v_j[d] in index order from +0.0) into ta, tl and at;
//  3. attention_split_merge, a block per row: l = l·alpha + lt and
//     acc[d] = acc[d]·alpha + acc_t[d] tile by tile in order from +0.0,
//     then out = acc / l.
//
// The running max before a tile is the sequential fold mr = (tm > mr ? tm :
// mr) from -inf over the tiles before it. No tile maximum is NaN (a NaN
// score never compares greater), so the fold is the first tile, in order,
// whose maximum equals the largest (equal as IEEE compares: +0 and -0
// tie); step 2 finds it by a block reduction that breaks ties by the lower
// tile index, which gives the fold's bits whatever the order of the
// reduction. The tiles are attention_body's: absolute tiles of ATTN_TILE
// positions from the window's first key's tile, the positions below that
// key skipped.
//
// Scratch, per row r = token · n_heads + head, for `cap` tiles a row (at
// least any row of the step has; a row with more gets NaN, nothing written
// past the scratch): sc[r · cap · ATTN_TILE + j - base0],
// tm, ta, tl [r · cap + tile], at [(r · cap + tile) · head_dim + d].

#define SPLIT_TILES 16
#define SPLIT_POS (SPLIT_TILES * ATTN_TILE)

// A row's walk: its query position, the window's first key and that key's
// tile start, and how many tiles it has.
struct SplitRow {
    int p_end, lo, base0, tiles;
};

__device__ __forceinline__ SplitRow split_row(const unsigned long long* pos, int t, int window) {
    int p_end = (int)pos[t];
    int lo = first_key(p_end, window), base0 = lo / ATTN_TILE * ATTN_TILE;
    SplitRow s;
    s.p_end = p_end;
    s.lo = lo;
    s.base0 = base0;
    s.tiles = (p_end - base0) / ATTN_TILE + 1;
    return s;
}

extern "C" __global__ void attention_split_scores(const float* q, const unsigned long long* pages,
                                                  const unsigned long long* seq_off,
                                                  const unsigned long long* pos, int n_heads, int n_kv_heads,
                                                  int head_dim, int layer, int page_len, int aux, float scale,
                                                  int window, int segs, int cap, float* sc, float* tm) {
    PDL_ENTRY();
    int r = blockIdx.x / segs;
    int t = r / n_heads, h = r % n_heads;
    int tid = threadIdx.x, grp = tid >> 3, lane8 = tid & 7;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    SplitRow w = split_row(pos, t, window);
    // A walk past the scratch is the host's error: the merge writes NaN.
    if (w.tiles > cap || blockIdx.x % segs * SPLIT_TILES >= w.tiles) return;  // uniform over the block
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float ss[SPLIT_POS];
    for (int d = tid; d < hd; d += ATTN_THREADS) qs[d] = q[(long long)t * qd + h * hd + d];
    const unsigned long long* pt = pages + seq_off[t];
    for (int seg = blockIdx.x % segs; seg * SPLIT_TILES < w.tiles; seg += segs) {
        __syncthreads();  // qs written; the last segment's ss read
        int i0 = seg * SPLIT_TILES, i1 = min(i0 + SPLIT_TILES, w.tiles);
        // Positions of the segment relative to base0: [jb0, jb1); those below
        // cut (the window's first key) are not keys.
        int jb0 = i0 * ATTN_TILE, jb1 = min(i1 * ATTN_TILE, w.p_end + 1 - w.base0), cut = w.lo - w.base0;
        int chunks = (hd + CHUNK - 1) / CHUNK;
        // One position per group of 8 at a time; the loop is uniform over the
        // warp (shuffles need all lanes): dead groups compute on q.
        for (int jj0 = jb0; jj0 < jb1; jj0 += ATTN_THREADS / 8) {
            int jj = jj0 + grp;
            bool live = jj >= cut && jj < jb1;
            int j = w.base0 + jj;
            const float* kr = live ? kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 0) + kvh * hd : qs;
            float total = 0.0f;
            for (int c = 0; c < chunks; ++c) {
                int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                float lv = 0.0f;
                #pragma unroll
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    int i = c0 + lane8 + s2 * LANES;
                    if (i < cend) lv = fmaf(qs[i], kr[i], lv);
                }
                lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);
                lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);
                lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);
                total = total + lv;
            }
            if (live && lane8 == 0) {
                float s = total * scale;
                ss[jj - jb0] = s;
                sc[(long long)r * cap * ATTN_TILE + jj] = s;
            }
        }
        __syncthreads();
        if (tid < i1 - i0) {
            int j0 = (i0 + tid) * ATTN_TILE, j1 = min(j0 + ATTN_TILE, jb1);
            float mt = __int_as_float(0xff800000);  // -inf
            for (int i = max(j0, cut); i < j1; ++i) {
                float sv = ss[i - jb0];
                if (sv > mt) mt = sv;
            }
            tm[(long long)r * cap + i0 + tid] = mt;
        }
    }
}

// Of two (max, first tile) pairs, the one the sequential fold keeps: the
// greater value, or on a tie the lower tile.
__device__ __forceinline__ void split_pick(float& v, int& i, float ov, int oi) {
    if (ov > v || (!(v > ov) && oi < i)) {
        v = ov;
        i = oi;
    }
}

extern "C" __global__ void attention_split_pv(const unsigned long long* pages, const unsigned long long* seq_off,
                                              const unsigned long long* pos, int n_heads, int n_kv_heads,
                                              int head_dim, int layer, int page_len, int aux, int window, int segs,
                                              int cap, const float* sc, const float* tm, float* ta, float* tl,
                                              float* at) {
    PDL_ENTRY();
    int r = blockIdx.x / segs;
    int t = r / n_heads, h = r % n_heads;
    int tid = threadIdx.x;
    int hd = head_dim, kvd = n_kv_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    SplitRow w = split_row(pos, t, window);
    if (w.tiles > cap) return;  // uniform over the block
    __shared__ float ps[SPLIT_POS];
    __shared__ float mb[SPLIT_TILES], ma[SPLIT_TILES];
    __shared__ float rv[ATTN_THREADS / 32];
    __shared__ int ri[ATTN_THREADS / 32];
    const float* tmr = tm + (long long)r * cap;
    const unsigned long long* pt = pages + seq_off[t];
    for (int seg = blockIdx.x % segs; seg * SPLIT_TILES < w.tiles; seg += segs) {
        int i0 = seg * SPLIT_TILES, i1 = min(i0 + SPLIT_TILES, w.tiles), nt = i1 - i0;
        __syncthreads();  // the last segment's rv, ri, ma and ps read
        // The running max before tile i0: the fold over tiles 0 .. i0.
        float v = __int_as_float(0xff800000);
        int vi = 0x7fffffff;
        for (int i = tid; i < i0; i += ATTN_THREADS) {
            float x = tmr[i];
            if (x > v) {
                v = x;
                vi = i;
            }
        }
        #pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, m);
            int oi = __shfl_xor_sync(0xffffffffu, vi, m);
            split_pick(v, vi, ov, oi);
        }
        if ((tid & 31) == 0) {
            rv[tid >> 5] = v;
            ri[tid >> 5] = vi;
        }
        __syncthreads();
        if (tid == 0) {
            for (int wi = 1; wi < ATTN_THREADS / 32; ++wi) split_pick(v, vi, rv[wi], ri[wi]);
            // The segment's tiles, in order: the max before and after each.
            float mr = v;
            for (int k = 0; k < nt; ++k) {
                float x = tmr[i0 + k];
                float mn = x > mr ? x : mr;
                mb[k] = mr;
                ma[k] = mn;
                mr = mn;
            }
        }
        __syncthreads();
        long long row_t = (long long)r * cap;
        if (tid < nt) ta[row_t + i0 + tid] = det_exp(mb[tid] - ma[tid]);
        int jb0 = i0 * ATTN_TILE, jb1 = min(i1 * ATTN_TILE, w.p_end + 1 - w.base0), cut = w.lo - w.base0;
        const float* scr = sc + row_t * ATTN_TILE;
        for (int jj = max(jb0, cut) + tid; jj < jb1; jj += ATTN_THREADS)
            ps[jj - jb0] = det_exp(scr[jj] - ma[(jj - jb0) / ATTN_TILE]);
        __syncthreads();
        if (tid < nt) {
            int j0 = max((i0 + tid) * ATTN_TILE, cut), j1 = min((i0 + tid) * ATTN_TILE + ATTN_TILE, jb1);
            float lt = 0.0f;
            for (int i = j0; i < j1; ++i) lt = lt + ps[i - jb0];
            tl[row_t + i0 + tid] = lt;
        }
        for (int pi = tid; pi < nt * hd; pi += ATTN_THREADS) {
            int k = pi / hd, d = pi % hd;
            int j0 = max((i0 + k) * ATTN_TILE, cut), j1 = min((i0 + k) * ATTN_TILE + ATTN_TILE, jb1);
            float a = 0.0f;
            #pragma unroll 8
            for (int i = j0; i < j1; ++i) {
                int j = w.base0 + i;
                float vv = kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d];
                a = fmaf(ps[i - jb0], vv, a);
            }
            at[(row_t + i0 + k) * hd + d] = a;
        }
    }
}

extern "C" __global__ void attention_split_merge(const unsigned long long* pos, int n_heads, int head_dim,
                                                 int window, int cap, const float* ta, const float* tl,
                                                 const float* at, float* out) {
    PDL_ENTRY();
    int r = blockIdx.x, t = r / n_heads, h = r % n_heads;
    int d = threadIdx.x, hd = head_dim;
    SplitRow w = split_row(pos, t, window);
    long long row_t = (long long)r * cap;
    if (w.tiles > cap) {
        if (d < hd) out[(long long)t * n_heads * hd + h * hd + d] = __int_as_float(0x7fc00000);
        return;
    }
    float l = 0.0f, acc = 0.0f;
    for (int k = 0; k < w.tiles; ++k) {
        float alpha = ta[row_t + k];
        l = l * alpha + tl[row_t + k];
        if (d < hd) acc = acc * alpha + at[(row_t + k) * hd + d];
    }
    if (d < hd) out[(long long)t * n_heads * hd + h * hd + d] = acc / l;
}
