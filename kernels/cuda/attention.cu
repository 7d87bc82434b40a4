// attention.cu: causal attention in the CPU reference's tile order: the
// one-thread reference (attention), the paged resident forms for decode
// (attention_paged, attention_decode, attention_decode_rope_qs with rope_kv's
// work in its prologue) and for prefill (attention_prefill,
// attention_prefill_hd64, attention_prefill_hd128).
//
// Every kernel takes a sliding window `window` (0: none), the CPU's
// attention_window (kernels/src/attention.rs): the keys of the query at
// position pos are [first_key(pos, window), pos], walked in the same
// absolute tiles of ATTN_TILE positions, the first tile cut at the first
// key and every later tile whole. Without a window the first key is 0 and
// each walk is the one it was before windows.

#define ATTN_TILE 32
#define MAX_HEAD_DIM 256
// The one-thread kernel's per-thread arrays: wide enough for a latent
// attention row (DeepSeek-V2/V3 class: a 512-float latent and a 64-float
// rotated key) and more.
#define ONE_THREAD_MAX_HEAD_DIM 640

// The first key the query at `pos` attends to under `window` (0: all):
// max(0, pos - window + 1).
__device__ __forceinline__ int first_key(int pos, int window) {
    return window > 0 ? max(0, pos + 1 - window) : 0;
}

// Causal attention of one query token per task, one thread per (task, head),
// in the CPU reference's order (kernels/src/attention.rs): tiles of ATTN_TILE
// absolute positions; per tile canonical-dot scores times scale, tile max,
// det_exp, sequential sum and fmaf P·V chains; tiles merged in order.
// Task t's keys/values are rows kv_off[t] .. kv_off[t] + pos[t] of k and v
// (row width kv_dim; the rows below the window's first key are not read);
// q and out are (tasks, n_heads * head_dim).
extern "C" __global__ void attention(const float* q, const float* k, const float* v,
                                     const long long* kv_off, const int* pos, float* out,
                                     int tasks, int n_heads, int n_kv_heads, int head_dim,
                                     float scale, int window) {
    int item = blockIdx.x * blockDim.x + threadIdx.x;
    if (item >= tasks * n_heads) return;
    int t = item / n_heads, h = item % n_heads;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + (long long)t * qd + h * hd;
    const float* kt = k + kv_off[t] * kvd + kvh * hd;
    const float* vt = v + kv_off[t] * kvd + kvh * hd;
    float m = __int_as_float(0xff800000);  // -inf
    float l = 0.0f;
    float acc[ONE_THREAD_MAX_HEAD_DIM], acc_t[ONE_THREAD_MAX_HEAD_DIM];
    for (int d = 0; d < hd; ++d) acc[d] = 0.0f;
    float s[ATTN_TILE];
    int p_end = pos[t];
    // Tiles of absolute positions: the first from the window's first key
    // to the end of its tile, then whole tiles.
    for (int j0 = first_key(p_end, window), j1; j0 <= p_end; j0 = j1) {
        j1 = min((j0 / ATTN_TILE + 1) * ATTN_TILE, p_end + 1);
        float mt = __int_as_float(0xff800000);
        for (int j = j0; j < j1; ++j) {
            float sj = dot_canon(0, qh, kt + (long long)j * kvd, hd) * scale;
            s[j - j0] = sj;
            if (sj > mt) mt = sj;
        }
        float m_new = mt > m ? mt : m;
        float alpha = det_exp(m - m_new);
        float lt = 0.0f;
        for (int d = 0; d < hd; ++d) acc_t[d] = 0.0f;
        for (int j = j0; j < j1; ++j) {
            float pj = det_exp(s[j - j0] - m_new);
            lt = lt + pj;
            const float* vr = vt + (long long)j * kvd;
            for (int d = 0; d < hd; ++d) acc_t[d] = fmaf(pj, vr[d], acc_t[d]);
        }
        l = l * alpha + lt;
        for (int d = 0; d < hd; ++d) acc[d] = acc[d] * alpha + acc_t[d];
        m = m_new;
    }
    float* o = out + (long long)t * qd + h * hd;
    for (int d = 0; d < hd; ++d) o[d] = acc[d] / l;
}

#define ATTN_THREADS 256
#define SC_POS 2048
#define SC_TILES 64
#define ACC_T 4096
#define ATTN_BATCH 4

// Paged attention, one block of ATTN_THREADS per (token, head), with
// `attention`'s exact arithmetic but its tiles computed side by side: the
// canonical merge's only dependence between tiles is the running max, a
// cheap scan, so positions are taken in super-chunks of up to SC_TILES tiles
// and, per super-chunk:
//  1. every score s_j = dot_canon(q, k_j) * scale, by groups of 8 threads
//     (lane j's FMA chain of each chunk, the xor-shuffle tree, chunk partials
//     in order);
//  2. each tile's max, sequentially over its positions;
//  3. the running max m_new per tile, scanned in tile order from the last
//     super-chunk's, and alpha = det_exp(m_prev - m_new);
//  4. p_j = det_exp(s_j - m_new of j's tile);
//  5. each tile's lt = sum of its p in index order, and its acc_t[d] = the
//     fmaf chain of p_j * v_j[d] in index order;
//  6. the merge, tile by tile in order: l = l*alpha + lt,
//     acc[d] = acc[d]*alpha + acc_t[d].
// Every value is the one the one-thread kernel computes, by the same
// operations in the same order. Token t reads pages pages[seq_off[t] ..]
// (page_len positions each) from its window's first key up to pos[t].

// q's head for attention_body, at file scope so that a prologue can leave
// it there (attention_decode_rope_qs) rather than in global memory for the
// body to load again.
__shared__ float attn_qs[MAX_HEAD_DIM];

// The step's inputs of one decode-rope block (ATTN_EARLY):
// its position, page slot and page, its sequence's page-list offset, the
// cos/sin pair of its thread's rotation index (thread i < half rotates q's
// element pair i, thread 128 + i k's), and the pages of the first batch of
// K rows its group reads (positions base0 + u·32 + group, u < ATTN_BATCH,
// base0 the start of the tile of the window's first key). The host
// uploads these before a step's first kernel and no kernel writes them (the
// RoPE tables never change), so they may be loaded before the PDL wait: the
// same values, two or three dependent round trips off the chain after it.
struct DecodeIn {
    int pos, slot;
    unsigned long long dst, so;
    float c, sn;
    unsigned long long pg[4];
};

// QS: the caller has put q's head in attn_qs and passed a barrier since
// (decode_rope_prologue<true>), so the body neither loads it nor waits.
// EARLY: `ein` holds the block's inputs, loaded before the PDL wait
// (DecodeIn); its first batch of K rows takes its pages from there.
// Under a window the super-chunks start at the tile of the first key lo
// and the first tile's positions below lo are skipped at every step (no
// score, max, p, sum or P·V of them), so each tile is the CPU's.
template <int BATCH, bool VPRE, bool QS = false, bool EARLY = false>
__device__ __forceinline__ void attention_body(const float* q, const unsigned long long* pages,
                                               const unsigned long long* seq_off,
                                               const unsigned long long* pos, float* out,
                                               int n_heads, int n_kv_heads, int head_dim, int layer,
                                               int page_len, int aux, float scale, int window,
                                               const DecodeIn* ein = nullptr) {
    static_assert(!EARLY || BATCH <= 4, "DecodeIn holds four pages of a first batch");
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int tid = threadIdx.x;
    int hd = head_dim, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int kvh = h / (n_heads / n_kv_heads);
    float* qs = attn_qs;
    __shared__ float sc[SC_POS];
    __shared__ float tm[SC_TILES], ta[SC_TILES], tl[SC_TILES];
    __shared__ float at[ACC_T];
    int tiles_per = min(SC_TILES, ACC_T / hd);
    int grp = tid >> 3, lane8 = tid & 7;
    if (!QS) {
        for (int d = tid; d < hd; d += ATTN_THREADS) qs[d] = q[(long long)t * qd + h * hd + d];
        __syncthreads();
    }
    const unsigned long long* pt = pages + (EARLY ? ein->so : seq_off[t]);
    int p_end = EARLY ? ein->pos : (int)pos[t];
    // The window's first key and the start of its tile (0 and 0 without one).
    int lo = first_key(p_end, window), base0 = lo / ATTN_TILE * ATTN_TILE;
    float m = __int_as_float(0xff800000);  // -inf
    float l = 0.0f;
    float acc = 0.0f;  // dimension tid (tid < hd; MAX_HEAD_DIM == ATTN_THREADS)
    int chunks = (hd + CHUNK - 1) / CHUNK;
    for (int base = base0; base <= p_end; base += tiles_per * ATTN_TILE) {
        int npos = min(tiles_per * ATTN_TILE, p_end + 1 - base);
        int ntiles = (npos + ATTN_TILE - 1) / ATTN_TILE;
        // The super-chunk's positions below the window: part of its first
        // tile, in the first super-chunk only.
        int cut = max(0, lo - base);
        // 1. Scores, BATCH positions per group at a time (their K loads in
        // flight together; each position's dot is the same whichever group
        // computes it). The loop is uniform over the warp
        // (shuffles need all lanes): dead groups compute on q and write
        // nothing.
        for (int jb = 0; jb < npos; jb += 32 * BATCH) {
            const float* kr[BATCH];
            float total[BATCH];
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                int jj = jb + u * 32 + grp;
                int j = base + jj;
                bool live = jj >= cut && jj < npos;
                // EARLY: the first batch's pages came before the wait.
                unsigned long long pg = live ? (EARLY && base == base0 && jb == 0 ? ein->pg[u] : pt[j / page_len]) : 0;
                kr[u] = live ? kv_row(pg, layer, page_len, kvd, aux, j % page_len, 0) + kvh * hd : qs;
                total[u] = 0.0f;
            }
            for (int c = 0; c < chunks; ++c) {
                int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                float kv[BATCH][CHUNK / LANES], qv[CHUNK / LANES];
                #pragma unroll
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    int i = c0 + lane8 + s2 * LANES;
                    qv[s2] = i < cend ? qs[i] : 0.0f;
                    #pragma unroll
                    for (int u = 0; u < BATCH; ++u) kv[u][s2] = i < cend ? kr[u][i] : 0.0f;
                }
                #pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    float lv = 0.0f;
                    #pragma unroll
                    for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                        if (c0 + lane8 + s2 * LANES < cend) lv = fmaf(qv[s2], kv[u][s2], lv);
                    }
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);
                    lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);
                    total[u] = total[u] + lv;
                }
            }
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                int jj = jb + u * 32 + grp;
                if (jj >= cut && jj < npos && lane8 == 0) sc[jj] = total[u] * scale;
            }
        }
        __syncthreads();
        // 2. Tile maxima (the first tile's positions below cut skipped).
        if (tid < ntiles) {
            int j0 = tid * ATTN_TILE, j1 = min(j0 + ATTN_TILE, npos);
            float mt = __int_as_float(0xff800000);
            for (int i = j0; i < j1; ++i) {
                if (i < cut) continue;
                float sv = sc[i];
                if (sv > mt) mt = sv;
            }
            tm[tid] = mt;
        }
        __syncthreads();
        // 3. Running max in tile order; ta holds the max before each tile.
        if (tid == 0) {
            float mr = m;
            for (int tt = 0; tt < ntiles; ++tt) {
                float mn = tm[tt] > mr ? tm[tt] : mr;
                ta[tt] = mr;
                tm[tt] = mn;
                mr = mn;
            }
        }
        __syncthreads();
        if (tid < ntiles) ta[tid] = det_exp(ta[tid] - tm[tid]);
        // 4. p.
        for (int i = cut + tid; i < npos; i += ATTN_THREADS) sc[i] = det_exp(sc[i] - tm[i / ATTN_TILE]);
        __syncthreads();
        // 5. Per tile: lt, and acc_t for each dimension.
        if (tid < ntiles) {
            int j0 = max(tid * ATTN_TILE, cut), j1 = min(tid * ATTN_TILE + ATTN_TILE, npos);
            float lt = 0.0f;
            for (int i = j0; i < j1; ++i) lt = lt + sc[i];
            tl[tid] = lt;
        }
        for (int pi = tid; pi < ntiles * hd; pi += ATTN_THREADS) {
            int tt = pi / hd, d = pi % hd;
            int j0 = max(tt * ATTN_TILE, cut), cnt = min(tt * ATTN_TILE + ATTN_TILE, npos) - j0;
            float a = 0.0f;
            if (VPRE) {
                // The tile's V values first, all in flight, then the chain.
                float vv[ATTN_TILE];
                #pragma unroll
                for (int i = 0; i < ATTN_TILE; ++i) {
                    int j = base + j0 + i;
                    vv[i] = i < cnt ? kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d]
                                    : 0.0f;
                }
                #pragma unroll
                for (int i = 0; i < ATTN_TILE; ++i) {
                    if (i < cnt) a = fmaf(sc[j0 + i], vv[i], a);
                }
            } else {
                #pragma unroll 8
                for (int i = 0; i < cnt; ++i) {
                    int j = base + j0 + i;
                    float vv = kv_row(pt[j / page_len], layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d];
                    a = fmaf(sc[j0 + i], vv, a);
                }
            }
            at[pi] = a;
        }
        __syncthreads();
        // 6. Merge in tile order.
        for (int tt = 0; tt < ntiles; ++tt) {
            float alpha = ta[tt];
            l = l * alpha + tl[tt];
            if (tid < hd) acc = acc * alpha + at[tt * hd + tid];
        }
        m = tm[ntiles - 1];
        __syncthreads();
    }
    if (tid < hd) out[(long long)t * qd + h * hd + tid] = acc / l;
}


// The throughput form: one position per group at a time, so that many
// blocks fit an SM (prefill, wide decode steps).
extern "C" __global__ void attention_paged(const float* q, const unsigned long long* pages,
                                           const unsigned long long* seq_off,
                                           const unsigned long long* pos, float* out,
                                           int n_heads, int n_kv_heads, int head_dim, int layer,
                                           int page_len, int aux, float scale, int window) {
    PDL_ENTRY();
    attention_body<1, false>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer, page_len, aux,
                             scale, window);
}

// The latency form, for steps of fewer blocks than the device has SMs
// (small-batch decode): ATTN_BATCH positions per group at a time and each
// tile's V values loaded before its chain, so a block has its loads in
// flight together at the cost of registers. The same operations.
extern "C" __global__ void attention_decode(const float* q, const unsigned long long* pages,
                                            const unsigned long long* seq_off,
                                            const unsigned long long* pos, float* out,
                                            int n_heads, int n_kv_heads, int head_dim, int layer,
                                            int page_len, int aux, float scale, int window) {
    PDL_ENTRY();
    attention_body<ATTN_BATCH, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer, page_len,
                                     aux, scale, window);
}

// attention_decode with rope_kv's work for its own token done first, so a
// decode step needs no rope_kv launch. Only for steps
// whose spans are one token each and whose tokens' pages are in no other
// span's page list (no block reads a row another block writes; the host
// checks). Block (t, h): RoPE of
// q's head h in place (only this block reads it); RoPE of k's head kvh of
// token t from `kraw` (the k matmul's output, left unrotated: every block
// of the group reads it) into the page slot dst[t]/slot[t], with v's head
// kvh — every block of the group writes these same values there before
// reading it, so each reads its own row — and, by the group's first head,
// into `kout` (the step's K rows, which go back to the host). Each value by
// rope_kv's operations: lo = a·cos - b·sin, hi = b·cos + a·sin.
// RoPE of q's head h of token t in place, of k's head kvh (from `kraw`, the
// k matmul's unrotated rows) into the page slot dst[t]/slot[t] with v's head
// kvh, and by the group's first head into `kout`; then a barrier: the
// prologue of attention_decode_rope_qs. QS: the rotated q head also into
// attn_qs, which the barrier hands to attention_body<.., QS = true> (no
// reload of q).
// EARLY (ATTN_EARLY): the block's inputs come in `ein` (DecodeIn), loaded
// before the PDL wait, not from pos, dst, slot and the tables.
template <bool QS = false, bool EARLY = false>
__device__ __forceinline__ void decode_rope_prologue(float* q, const float* kraw, float* kout, const float* v,
                                                     const float* cos_t, const float* sin_t,
                                                     const unsigned long long* pos, const unsigned long long* dst,
                                                     const unsigned long long* slot, int n_heads, int n_kv_heads,
                                                     int head_dim, int layer, int page_len, int aux,
                                                     const DecodeIn* ein = nullptr) {
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int tid = threadIdx.x;
    int hd = head_dim, half = head_dim / 2, kvd = n_kv_heads * head_dim, qd = n_heads * head_dim;
    int group = n_heads / n_kv_heads, kvh = h / group;
    const float* c = cos_t + (long long)(EARLY ? 0 : pos[t]) * half;
    const float* sn = sin_t + (long long)(EARLY ? 0 : pos[t]) * half;
    int s = EARLY ? ein->slot : (int)slot[t];
    if (tid < half) {
        float* qr = q + (long long)t * qd + h * hd;
        float a = qr[tid], b = qr[tid + half];
        float ci = EARLY ? ein->c : c[tid], si = EARLY ? ein->sn : sn[tid];
        float lo = a * ci - b * si;
        float hi = b * ci + a * si;
        qr[tid] = lo;
        qr[tid + half] = hi;
        if (QS) {
            attn_qs[tid] = lo;
            attn_qs[tid + half] = hi;
        }
    }
    if (tid >= 128 && tid - 128 < half) {
        int i = tid - 128;
        long long at = (long long)t * kvd + kvh * hd + i;
        float a = kraw[at], b = kraw[at + half];
        float ci = EARLY ? ein->c : c[i], si = EARLY ? ein->sn : sn[i];
        float lo = a * ci - b * si;
        float hi = b * ci + a * si;
        float* kr = kv_row(EARLY ? ein->dst : dst[t], layer, page_len, kvd, aux, s, 0) + kvh * hd;
        kr[i] = lo;
        kr[i + half] = hi;
        if (h % group == 0) {
            kout[at] = lo;
            kout[at + half] = hi;
        }
    }
    // dst[t] read where it is used (not once at the top), so that the form
    // without ATTN_EARLY keeps the SASS it had; reading it once at the top
    // was measured slower (docs/PERFORMANCE.md).
    if (tid < hd)
        kv_row(EARLY ? ein->dst : dst[t], layer, page_len, kvd, aux, s, 1)[kvh * hd + tid] =
            v[(long long)t * kvd + kvh * hd + tid];
    __syncthreads();
}

// DecodeIn of this block and thread: what decode_rope_prologue and
// attention_body<.., EARLY> read of the step's inputs, loaded at once.
__device__ __forceinline__ DecodeIn decode_inputs(const float* cos_t, const float* sin_t,
                                                  const unsigned long long* pages,
                                                  const unsigned long long* seq_off,
                                                  const unsigned long long* pos, const unsigned long long* dst,
                                                  const unsigned long long* slot, int n_heads, int head_dim,
                                                  int page_len, int window) {
    int t = blockIdx.x / n_heads, tid = threadIdx.x, half = head_dim / 2;
    DecodeIn in;
    in.pos = (int)pos[t];
    in.slot = (int)slot[t];
    in.dst = dst[t];
    in.so = seq_off[t];
    int i = tid < 128 ? tid : tid - 128;
    in.c = i < half ? cos_t[(long long)in.pos * half + i] : 0.0f;
    in.sn = i < half ? sin_t[(long long)in.pos * half + i] : 0.0f;
    // The body's first batch: from the tile of the window's first key.
    int lo = first_key(in.pos, window), base0 = lo / ATTN_TILE * ATTN_TILE;
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
        int j = base0 + u * 32 + (tid >> 3);
        in.pg[u] = j >= lo && j <= in.pos ? pages[in.so + j / page_len] : 0ull;
    }
    return in;
}

// rope_kv then attention_decode in one launch, the rotated q head handed
// from the prologue to the body in shared memory (no reload of q from
// global memory); the same values in the same operations (q is still
// rotated in place in global memory, as rope_kv leaves it).
extern "C" __global__ void attention_decode_rope_qs(float* q, const float* kraw, float* kout, const float* v,
                                                    const float* cos_t, const float* sin_t,
                                                    const unsigned long long* pages,
                                                    const unsigned long long* seq_off,
                                                    const unsigned long long* pos, const unsigned long long* dst,
                                                    const unsigned long long* slot, float* out, int n_heads,
                                                    int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                                                    float scale, int window) {
#if defined(ATTN_EARLY)
    // The step's inputs before the wait (ATTN_EARLY): DecodeIn.
    DecodeIn in = decode_inputs(cos_t, sin_t, pages, seq_off, pos, dst, slot, n_heads, head_dim, page_len, window);
    PDL_ENTRY();
    decode_rope_prologue<true, true>(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim,
                                     layer, page_len, aux, &in);
    attention_body<ATTN_BATCH, true, true, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer,
                                                 page_len, aux, scale, window, &in);
#else
    PDL_ENTRY();
    decode_rope_prologue<true>(q, kraw, kout, v, cos_t, sin_t, pos, dst, slot, n_heads, n_kv_heads, head_dim,
                               layer, page_len, aux);
    attention_body<ATTN_BATCH, true, true>(q, pages, seq_off, pos, out, n_heads, n_kv_heads, head_dim, layer,
                                           page_len, aux, scale, window);
#endif
}

// Prefill attention: one block of ATTN_THREADS per (group, head), a group
// being up to PF_TQ tokens of one sequence (stacked consecutively; the host
// lists them: groups[g] = first token << 32 | count). Each tile of
// ATTN_TILE positions is loaded once into shared memory and serves every
// token of the group, where attention_paged loads it once per token. Per
// token the arithmetic is attention_paged's, tile by tile:
//  1. s_j = dot_canon(q, k_j) * scale, one thread per (token, position):
//     lane l's FMA chain of each chunk (elements l + 8s, s ascending), the
//     lane tree, chunk partials in order;
//  2. the tile's max over the token's positions in it, in index order; the
//     running max m_new = max(tile max, m); alpha = det_exp(m - m_new);
//  3. p_j = det_exp(s_j - m_new);
//  4. lt = the sum of the tile's p in index order, l = l * alpha + lt; per
//     dimension a = the fmaf chain of p_j * v_j[d] in index order,
//     acc = acc * alpha + a;
// and out = acc / l. Tiles are absolute (ATTN_TILE positions from a
// multiple of ATTN_TILE) whatever the group, so the tiles, and so the bits,
// are those of the one-token kernels (whose super-chunks only batch tiles:
// each merge is still one tile's). Under a window token u's positions are
// [tok_lo[u], pos]: the tiles are walked from the one of the group's
// lowest first key, and a token takes of each tile only its positions in
// its window (none of a tile below it), so its first tile is cut as the
// CPU's is.
#define PF_TQ 16
#define PF_MAXHD 128
#define PF_ACC (PF_TQ * PF_MAXHD / ATTN_THREADS)
// The body, for any head_dim up to PF_MAXHD (HD 0: read at run time) or
// for one head_dim HD known at compile time (a divisor of ATTN_THREADS, a
// multiple of 8, at most PF_MAXHD; rows of K and V 16-byte aligned: kvd and
// page_len · aux multiples of 4). With HD: the K/V tile comes in as float4
// rows (one page lookup a row piece, not an element), the next tile's
// loads are in flight while this tile is computed, q and k are read as
// float4 (each lane chain's FMAs still in its order: lane l takes elements
// l + 8s, s ascending) with one read of q serving both of a thread's
// positions, each token's tile max (steps 2 and 3) is made by its
// half-warp right after its scores (two barriers a tile fewer), and P·V
// walks the positions once for all of a thread's tokens (each token's chain
// still its own, in position order). The same operations on the same values
// as with HD 0.
template <int HD>
__device__ __forceinline__ void attention_prefill_body(const float* q, const unsigned long long* pages,
                                                       const unsigned long long* seq_off,
                                                       const unsigned long long* pos,
                                                       const unsigned long long* groups, float* out, int n_heads,
                                                       int n_kv_heads, int head_dim, int layer, int page_len, int aux,
                                                       float scale, int window) {
    constexpr int MH = HD > 0 ? HD : PF_MAXHD;
    constexpr int KS = HD > 0 ? HD + 4 : PF_MAXHD + 1;  // HD: float4 rows, 8 rows on 32 banks
    constexpr int NACC = PF_TQ * MH / ATTN_THREADS;
    constexpr int V4 = HD > 0 ? ATTN_TILE * HD / 4 / ATTN_THREADS : 1;  // a thread's float4s of a tile
    // HD: a token's scores one bank apart from the next token's, so that
    // the per-token walks of steps 2 and 4 (thread u reads row u) do not
    // all hit one bank.
    constexpr int SCS = HD > 0 ? ATTN_TILE + 1 : ATTN_TILE;
    __shared__ __align__(16) float qs[PF_TQ][MH];
    __shared__ __align__(16) float ks[ATTN_TILE][KS];
    __shared__ __align__(16) float vs[ATTN_TILE][MH];
    __shared__ __align__(16) float sc[PF_TQ][SCS];
    __shared__ float tok_m[PF_TQ], tok_l[PF_TQ], tok_alpha[PF_TQ];
    __shared__ int tok_lo[PF_TQ], tok_end[PF_TQ];
    int g = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    unsigned long long gr = groups[g];
    int t0 = (int)(gr >> 32), cnt = (int)(gr & 0xffffffffu);
    int tid = threadIdx.x;
    const int hd = HD > 0 ? HD : head_dim;
    int kvd = n_kv_heads * hd, qd = n_heads * hd;
    int kvh = h / (n_heads / n_kv_heads);
    const unsigned long long* pt = pages + seq_off[t0];
    for (int i = tid; i < PF_TQ * hd; i += ATTN_THREADS) {
        int u = i / hd, d = i % hd;
        qs[u][d] = u < cnt ? q[(long long)(t0 + u) * qd + h * hd + d] : 0.0f;
    }
    if (tid < PF_TQ) {
        tok_end[tid] = tid < cnt ? (int)pos[t0 + tid] + 1 : 0;
        tok_lo[tid] = tid < cnt ? first_key((int)pos[t0 + tid], window) : 0;
        tok_m[tid] = __int_as_float(0xff800000);  // -inf
        tok_l[tid] = 0.0f;
    }
    __syncthreads();
    // The tiles any token of the group reads: from the tile of the lowest
    // first key (0 without a window) to the highest end.
    int end = 0, begin = cnt > 0 ? tok_lo[0] : 0;
    for (int u = 0; u < cnt; ++u) {
        end = max(end, tok_end[u]);
        begin = min(begin, tok_lo[u]);
    }
    begin = begin / ATTN_TILE * ATTN_TILE;
    // Thread tid owns (token, dimension) pairs tid + r·ATTN_THREADS.
    float acc[NACC];
    #pragma unroll
    for (int r = 0; r < NACC; ++r) acc[r] = 0.0f;
    int chunks = (hd + CHUNK - 1) / CHUNK;
    // Scores: token su, positions sr and sr + 16 of the tile.
    int su = tid >> 4, sr = tid & 15;
    // HD: float4 f of the tile (f = tid + s·ATTN_THREADS) is row f / (HD/4),
    // columns 4 (f % (HD/4)) on; the next tile's, in flight.
    float4 kn[V4], vn[V4];
    auto fetch = [&](int j0) {
        int jn = min(ATTN_TILE, end - j0);
        #pragma unroll
        for (int s = 0; s < V4; ++s) {
            int f = tid + s * ATTN_THREADS, r = f / (MH / 4), c = f % (MH / 4);
            float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kk;
            if (r < jn) {
                int j = j0 + r;
                unsigned long long pg = pt[j / page_len];
                int slot = j % page_len;
                kk = *(const float4*)(kv_row(pg, layer, page_len, kvd, aux, slot, 0) + kvh * hd + 4 * c);
                vv = *(const float4*)(kv_row(pg, layer, page_len, kvd, aux, slot, 1) + kvh * hd + 4 * c);
            }
            kn[s] = kk;
            vn[s] = vv;
        }
    };
    if (HD > 0 && end > begin) fetch(begin);
    for (int j0 = begin; j0 < end; j0 += ATTN_TILE) {
        int jn = min(ATTN_TILE, end - j0);
        if (HD > 0) {
            #pragma unroll
            for (int s = 0; s < V4; ++s) {
                int f = tid + s * ATTN_THREADS, r = f / (MH / 4), c = f % (MH / 4);
                *(float4*)&ks[r][4 * c] = kn[s];
                *(float4*)&vs[r][4 * c] = vn[s];
            }
        } else {
            for (int i = tid; i < ATTN_TILE * hd; i += ATTN_THREADS) {
                int r = i / hd, d = i % hd;
                float kv = 0.0f, vv = 0.0f;
                if (r < jn) {
                    int j = j0 + r;
                    unsigned long long pg = pt[j / page_len];
                    kv = kv_row(pg, layer, page_len, kvd, aux, j % page_len, 0)[kvh * hd + d];
                    vv = kv_row(pg, layer, page_len, kvd, aux, j % page_len, 1)[kvh * hd + d];
                }
                ks[r][d] = kv;
                vs[r][d] = vv;
            }
        }
        __syncthreads();
        // 1. Scores.
        if (HD > 0) {
            float tot[2] = {0.0f, 0.0f};
            #pragma unroll
            for (int c = 0; c < (MH + CHUNK - 1) / CHUNK; ++c) {
                const int c0 = c * CHUNK, cend = min(c0 + CHUNK, MH);
                float l[2][LANES];
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    #pragma unroll
                    for (int ln = 0; ln < LANES; ++ln) l[hf][ln] = 0.0f;
                }
                #pragma unroll 2
                for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                    const int i = c0 + s2 * LANES;
                    if (i < cend) {
                        float4 qa = *(const float4*)&qs[su][i], qb = *(const float4*)&qs[su][i + 4];
                        #pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            float4 ka = *(const float4*)&ks[sr + hf * 16][i];
                            float4 kb = *(const float4*)&ks[sr + hf * 16][i + 4];
                            l[hf][0] = fmaf(qa.x, ka.x, l[hf][0]);
                            l[hf][1] = fmaf(qa.y, ka.y, l[hf][1]);
                            l[hf][2] = fmaf(qa.z, ka.z, l[hf][2]);
                            l[hf][3] = fmaf(qa.w, ka.w, l[hf][3]);
                            l[hf][4] = fmaf(qb.x, kb.x, l[hf][4]);
                            l[hf][5] = fmaf(qb.y, kb.y, l[hf][5]);
                            l[hf][6] = fmaf(qb.z, kb.z, l[hf][6]);
                            l[hf][7] = fmaf(qb.w, kb.w, l[hf][7]);
                        }
                    }
                }
                #pragma unroll
                for (int hf = 0; hf < 2; ++hf) tot[hf] = tot[hf] + lane_tree(l[hf]);
            }
            float s0 = tot[0] * scale, s1 = tot[1] * scale;
            // 2 and 3 here, without a barrier: token su's scores are its
            // half-warp's. Its tile max by a butterfly over (score,
            // position), the earlier position kept on a tie: the first
            // maximal score, which the in-order walk (`if (sv > mt) mt =
            // sv`) finds, zero's sign included; NaN and positions outside
            // b .. e (the token's positions in the tile: its window's, up
            // to its own) never win (the walk skips them).
            const int b = su < cnt ? max(0, tok_lo[su] - j0) : 0;
            const int e = su < cnt ? min(ATTN_TILE, tok_end[su] - j0) : 0;
            const float ninf = __int_as_float(0xff800000);
            float mv = (sr >= b && sr < e && s0 == s0) ? s0 : ninf, mi = (float)sr;
            float m1 = (sr + 16 >= b && sr + 16 < e && s1 == s1) ? s1 : ninf;
            if (m1 > mv) {
                mv = m1;
                mi = (float)(sr + 16);
            }
            #pragma unroll
            for (int o = 8; o >= 1; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, mv, o);
                float oi = __shfl_xor_sync(0xffffffffu, mi, o);
                if (ov > mv || (ov == mv && oi < mi)) {
                    mv = ov;
                    mi = oi;
                }
            }
            float mp = tok_m[su];
            float mn = mv > mp ? mv : mp;
            float alpha = det_exp(mp - mn);
            sc[su][sr] = sr >= b && sr < e ? det_exp(s0 - mn) : s0;
            sc[su][sr + 16] = sr + 16 >= b && sr + 16 < e ? det_exp(s1 - mn) : s1;
            __syncwarp();  // every lane has read tok_m[su]
            if (sr == 0 && e > b) {
                tok_alpha[su] = alpha;
                tok_m[su] = mn;
            }
            // The next tile's loads, in flight through the sums and P·V.
            if (j0 + ATTN_TILE < end) fetch(j0 + ATTN_TILE);
        } else {
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                int r = sr + half * 16;
                float total = 0.0f;
                for (int c = 0; c < chunks; ++c) {
                    int c0 = c * CHUNK, cend = min(c0 + CHUNK, hd);
                    float l[LANES];
                    #pragma unroll
                    for (int ln = 0; ln < LANES; ++ln) l[ln] = 0.0f;
                    #pragma unroll
                    for (int s2 = 0; s2 < CHUNK / LANES; ++s2) {
                        #pragma unroll
                        for (int ln = 0; ln < LANES; ++ln) {
                            int i = c0 + ln + s2 * LANES;
                            if (i < cend) l[ln] = fmaf(qs[su][i], ks[r][i], l[ln]);
                        }
                    }
                    total = total + lane_tree(l);
                }
                sc[su][r] = total * scale;
            }
        }
        __syncthreads();
        // 2. Each token's tile max, running max and alpha (HD: done above).
        if (HD == 0 && tid < cnt) {
            int b = max(0, tok_lo[tid] - j0), e = min(ATTN_TILE, tok_end[tid] - j0);
            if (e > b) {
                float mt = __int_as_float(0xff800000);
                for (int i = b; i < e; ++i) {
                    float sv = sc[tid][i];
                    if (sv > mt) mt = sv;
                }
                float mp = tok_m[tid];
                float mn = mt > mp ? mt : mp;
                tok_alpha[tid] = det_exp(mp - mn);
                tok_m[tid] = mn;
            }
        }
        if (HD == 0) {
            __syncthreads();
            // 3. p (also of the positions below a token's window, which
            // nothing reads).
            for (int i = tid; i < PF_TQ * ATTN_TILE; i += ATTN_THREADS) {
                int u = i / ATTN_TILE, r = i % ATTN_TILE;
                if (u < cnt && j0 + r < tok_end[u]) sc[u][r] = det_exp(sc[u][r] - tok_m[u]);
            }
            __syncthreads();
        }
        // 4. The tile's sums and the merge.
        if (tid < cnt) {
            int b = max(0, tok_lo[tid] - j0), e = min(ATTN_TILE, tok_end[tid] - j0);
            if (e > b) {
                float lt = 0.0f;
                for (int i = b; i < e; ++i) lt = lt + sc[tid][i];
                tok_l[tid] = tok_l[tid] * tok_alpha[tid] + lt;
            }
        }
        if (HD > 0) {
            // Thread tid's pairs: dimension tid % HD of tokens tid / HD + r·(ATTN_THREADS / HD).
            const int d = tid % MH, u0 = tid / MH;
            // Each token's positions b .. e of the tile (its window's).
            int b[NACC], e[NACC];
            float a[NACC];
            int bmin = ATTN_TILE, emax = 0;
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                int u = u0 + r * (ATTN_THREADS / MH);
                b[r] = u < cnt ? max(0, tok_lo[u] - j0) : 0;
                e[r] = u < cnt ? min(ATTN_TILE, tok_end[u] - j0) : 0;
                a[r] = 0.0f;
                bmin = min(bmin, b[r]);
                emax = max(emax, e[r]);
            }
            for (int i = bmin; i < emax; ++i) {
                float vv = vs[i][d];
                #pragma unroll
                for (int r = 0; r < NACC; ++r) {
                    if (i >= b[r] && i < e[r]) a[r] = fmaf(sc[u0 + r * (ATTN_THREADS / MH)][i], vv, a[r]);
                }
            }
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                if (e[r] > b[r]) acc[r] = acc[r] * tok_alpha[u0 + r * (ATTN_THREADS / MH)] + a[r];
            }
        } else {
            #pragma unroll
            for (int r = 0; r < NACC; ++r) {
                int pr = tid + r * ATTN_THREADS, u = pr / hd, d = pr % hd;
                if (u < cnt) {
                    int b = max(0, tok_lo[u] - j0), e = min(ATTN_TILE, tok_end[u] - j0);
                    if (e > b) {
                        float a = 0.0f;
                        for (int i = b; i < e; ++i) a = fmaf(sc[u][i], vs[i][d], a);
                        acc[r] = acc[r] * tok_alpha[u] + a;
                    }
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < NACC; ++r) {
        int pr = tid + r * ATTN_THREADS, u = pr / hd, d = pr % hd;
        if (u < cnt) out[(long long)(t0 + u) * qd + h * hd + d] = acc[r] / tok_l[u];
    }
}

// The prefill kernels: the body for any head_dim up to PF_MAXHD (HD 0), and
// compiled for head_dim 64 (AttnKernel::PrefillHd64) and 128
// (AttnKernel::PrefillHd128: Llama 3, Qwen, Mistral; static shared memory
// 43.7 KB of the 48 KB).
#define ATTN_PREFILL(NAME, HD)                                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                \
        NAME(const float* q, const unsigned long long* pages, const unsigned long long* seq_off,             \
             const unsigned long long* pos, const unsigned long long* groups, float* out, int n_heads,       \
             int n_kv_heads, int head_dim, int layer, int page_len, int aux, float scale, int window) {      \
        PDL_ENTRY();                                                                                          \
        attention_prefill_body<HD>(q, pages, seq_off, pos, groups, out, n_heads, n_kv_heads, head_dim, layer, \
                                   page_len, aux, scale, window);                                             \
    }
ATTN_PREFILL(attention_prefill, 0)
ATTN_PREFILL(attention_prefill_hd64, 64)
ATTN_PREFILL(attention_prefill_hd128, 128)
