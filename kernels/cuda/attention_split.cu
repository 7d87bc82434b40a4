// attention_split.cu: decode attention split over the KV length, for steps
// of few (token, head) rows and long contexts, in three launches that give
// attention_body's bits:
//
//  1. attention_split_scores, `segs` blocks per (token, K/V head), each
//     serving the query heads of that K/V head (K and V rows read once for
//     all of them), block b taking the segments of SPLIT_TILES tiles b,
//     b + segs, … (so that one launch shape serves any context: a graph
//     replays it): every score s_j = dot(q, k_j) · scale (lane j's FMA chain of
//     each chunk, the xor tree 4, 2, 1, chunk partials in order from +0.0)
//     into sc, and each tile's maximum (sequential over its positions from
//     -inf, a position replacing it only when greater) into tm;
//  2. attention_split_pv, the same blocks, per query head: the running max before the
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

#define SPLIT_TILES 4
#define SPLIT_POS (SPLIT_TILES * ATTN_TILE)
// Query heads of one K/V head a block of steps 1 and 2 serves (each K and V
// row read once for all of them); a model with more takes the other forms.
#define SPLIT_MAX_GROUP 8
// Tiles whose partials the merge loads before folding them.
#define SPLIT_MERGE_AHEAD 16

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

// Steps 1 and 2 run a block per (token, K/V head, …): its query heads are
// h0 .. h0 + G, whose rows are t · n_heads + h0 + g.
extern "C" __global__ void attention_split_scores(const float* q, const unsigned long long* pages,
                                                  const unsigned long long* seq_off,
                                                  const unsigned long long* pos, int n_heads, int n_kv_heads,
                                                  int head_dim, int layer, int page_len, int aux, float scale,
                                                  int window, int segs, int cap, float* sc, float* tm) {
    PDL_ENTRY();
    int rk = blockIdx.x / segs;
    int t = rk / n_kv_heads, kvh = rk % n_kv_heads;
    int G = n_heads / n_kv_heads, h0 = kvh * G;
    int tid = threadIdx.x, grp = tid >> 3, lane8 = tid & 7;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    SplitRow w = split_row(pos, t, window);
    // A walk past the scratch is the host's error: the merge writes NaN.
    if (w.tiles > cap || G > SPLIT_MAX_GROUP || blockIdx.x % segs * SPLIT_TILES >= w.tiles) return;  // uniform
    __shared__ float qs[SPLIT_MAX_GROUP * MAX_HEAD_DIM];
    __shared__ float ss[SPLIT_MAX_GROUP * SPLIT_POS];
    for (int e = tid; e < G * hd; e += ATTN_THREADS) qs[e] = q[(long long)t * qd + h0 * hd + e];
    const unsigned long long* pt = pages + seq_off[t];
    long long row0 = (long long)t * n_heads + h0;
    for (int seg = blockIdx.x % segs; seg * SPLIT_TILES < w.tiles; seg += segs) {
        __syncthreads();  // qs written; the last segment's ss read
        int i0 = seg * SPLIT_TILES, i1 = min(i0 + SPLIT_TILES, w.tiles), nt = i1 - i0;
        // Positions of the segment relative to base0: [jb0, jb1); those below
        // cut (the window's first key) are not keys.
        int jb0 = i0 * ATTN_TILE, jb1 = min(i1 * ATTN_TILE, w.p_end + 1 - w.base0), cut = w.lo - w.base0;
        int chunks = (hd + CHUNK - 1) / CHUNK;
        // One position per group of 8 at a time, its K row against every
        // head of the block; the loop is uniform over the warp (shuffles
        // need all lanes): dead groups compute on q.
        for (int jj0 = jb0; jj0 < jb1; jj0 += ATTN_THREADS / 8) {
            int jj = jj0 + grp;
            bool live = jj >= cut && jj < jb1;
            int j = w.base0 + jj;
            const float* kr = live ? kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 0) + kvh * hd : qs;
            float total[SPLIT_MAX_GROUP];
            #pragma unroll
            for (int g = 0; g < SPLIT_MAX_GROUP; ++g) total[g] = 0.0f;
            for (int c = 0; c < chunks; ++c) {
                int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                float kv[CHUNK / LANES];
                #pragma unroll
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    int i = c0 + lane8 + s2 * LANES;
                    kv[s2] = i < cend ? kr[i] : 0.0f;
                }
                #pragma unroll
                for (int g = 0; g < SPLIT_MAX_GROUP; ++g) {
                    if (g < G) {  // uniform over the block
                        float lv = 0.0f;
                        #pragma unroll
                        for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                            int i = c0 + lane8 + s2 * LANES;
                            if (i < cend) lv = fmaf(qs[g * hd + i], kv[s2], lv);
                        }
                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);
                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);
                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);
                        total[g] = total[g] + lv;
                    }
                }
            }
            if (live && lane8 == 0) {
                #pragma unroll
                for (int g = 0; g < SPLIT_MAX_GROUP; ++g) {
                    if (g < G) {
                        float s = total[g] * scale;
                        ss[g * SPLIT_POS + jj - jb0] = s;
                        sc[(row0 + g) * cap * ATTN_TILE + jj] = s;
                    }
                }
            }
        }
        __syncthreads();
        for (int e = tid; e < G * nt; e += ATTN_THREADS) {
            int g = e / nt, k = e % nt;
            int j0 = (i0 + k) * ATTN_TILE, j1 = min(j0 + ATTN_TILE, jb1);
            float mt = __int_as_float(0xff800000);  // -inf
            for (int i = max(j0, cut); i < j1; ++i) {
                float sv = ss[g * SPLIT_POS + i - jb0];
                if (sv > mt) mt = sv;
            }
            tm[(row0 + g) * cap + i0 + k] = mt;
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
    int rk = blockIdx.x / segs;
    int t = rk / n_kv_heads, kvh = rk % n_kv_heads;
    int G = n_heads / n_kv_heads, h0 = kvh * G;
    int tid = threadIdx.x;
    int hd = head_dim, kvd = n_kv_heads * head_dim;
    SplitRow w = split_row(pos, t, window);
    if (w.tiles > cap || G > SPLIT_MAX_GROUP) return;  // uniform over the block
    __shared__ float ps[SPLIT_MAX_GROUP * SPLIT_POS];
    __shared__ float mb[SPLIT_MAX_GROUP * SPLIT_TILES], ma[SPLIT_MAX_GROUP * SPLIT_TILES];
    __shared__ float rv[ATTN_THREADS / 32];
    __shared__ int ri[ATTN_THREADS / 32];
    const unsigned long long* pt = pages + seq_off[t];
    long long row0 = (long long)t * n_heads + h0;
    for (int seg = blockIdx.x % segs; seg * SPLIT_TILES < w.tiles; seg += segs) {
        int i0 = seg * SPLIT_TILES, i1 = min(i0 + SPLIT_TILES, w.tiles), nt = i1 - i0;
        for (int g = 0; g < G; ++g) {
            const float* tmr = tm + (row0 + g) * cap;
            __syncthreads();  // rv and ri read; the last segment's ma and ps read
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
                    mb[g * SPLIT_TILES + k] = mr;
                    ma[g * SPLIT_TILES + k] = mn;
                    mr = mn;
                }
            }
        }
        __syncthreads();
        for (int e = tid; e < G * nt; e += ATTN_THREADS) {
            int g = e / nt, k = e % nt;
            ta[(row0 + g) * cap + i0 + k] = det_exp(mb[g * SPLIT_TILES + k] - ma[g * SPLIT_TILES + k]);
        }
        int jb0 = i0 * ATTN_TILE, jb1 = min(i1 * ATTN_TILE, w.p_end + 1 - w.base0), cut = w.lo - w.base0;
        for (int g = 0; g < G; ++g) {
            const float* scr = sc + (row0 + g) * cap * ATTN_TILE;
            for (int jj = max(jb0, cut) + tid; jj < jb1; jj += ATTN_THREADS)
                ps[g * SPLIT_POS + jj - jb0] = det_exp(scr[jj] - ma[g * SPLIT_TILES + (jj - jb0) / ATTN_TILE]);
        }
        __syncthreads();
        for (int e = tid; e < G * nt; e += ATTN_THREADS) {
            int g = e / nt, k = e % nt;
            int j0 = max((i0 + k) * ATTN_TILE, cut), j1 = min((i0 + k) * ATTN_TILE + ATTN_TILE, jb1);
            float lt = 0.0f;
            for (int i = j0; i < j1; ++i) lt = lt + ps[g * SPLIT_POS + i - jb0];
            tl[(row0 + g) * cap + i0 + k] = lt;
        }
        // Each V value read once for every head of the block.
        for (int pi = tid; pi < nt * hd; pi += ATTN_THREADS) {
            int k = pi / hd, d = pi % hd;
            int j0 = max((i0 + k) * ATTN_TILE, cut), j1 = min((i0 + k) * ATTN_TILE + ATTN_TILE, jb1);
            float a[SPLIT_MAX_GROUP];
            #pragma unroll
            for (int g = 0; g < SPLIT_MAX_GROUP; ++g) a[g] = 0.0f;
            // The tile's V values first, all in flight, then the chains.
            int cnt = j1 - j0;
            float vv[ATTN_TILE];
            #pragma unroll
            for (int i = 0; i < ATTN_TILE; ++i) {
                int j = w.base0 + j0 + i;
                vv[i] = i < cnt ? kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d]
                                : 0.0f;
            }
            #pragma unroll
            for (int i = 0; i < ATTN_TILE; ++i) {
                if (i < cnt) {
                    #pragma unroll
                    for (int g = 0; g < SPLIT_MAX_GROUP; ++g) {
                        if (g < G) a[g] = fmaf(ps[g * SPLIT_POS + j0 + i - jb0], vv[i], a[g]);
                    }
                }
            }
            #pragma unroll
            for (int g = 0; g < SPLIT_MAX_GROUP; ++g) {
                if (g < G) at[((row0 + g) * cap + i0 + k) * hd + d] = a[g];
            }
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
    // The fold is a chain over the tiles; the loads of SPLIT_MERGE_AHEAD
    // tiles are issued before their steps, so the chain waits on arithmetic,
    // not on one load per tile.
    float l = 0.0f, acc = 0.0f;
    for (int k = 0; k < w.tiles; k += SPLIT_MERGE_AHEAD) {
        float al[SPLIT_MERGE_AHEAD], lt[SPLIT_MERGE_AHEAD], av[SPLIT_MERGE_AHEAD];
        #pragma unroll
        for (int u = 0; u < SPLIT_MERGE_AHEAD; ++u) {
            bool in = k + u < w.tiles;
            al[u] = in ? ta[row_t + k + u] : 0.0f;
            lt[u] = in ? tl[row_t + k + u] : 0.0f;
            av[u] = in && d < hd ? at[(row_t + k + u) * hd + d] : 0.0f;
        }
        #pragma unroll
        for (int u = 0; u < SPLIT_MERGE_AHEAD; ++u) {
            if (k + u < w.tiles) {
                l = l * al[u] + lt[u];
                acc = acc * al[u] + av[u];
            }
        }
    }
    if (d < hd) out[(long long)t * n_heads * hd + h * hd + d] = acc / l;
}
