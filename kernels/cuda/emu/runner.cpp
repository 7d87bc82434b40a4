// Runs the CUDA kernels (kernels/cuda/) on the CPU emulation (cuda_emu.h) with the
// launch shapes kernels/src/cuda/ uses, for kernels/tests/cuda_emulated/.
//
// Protocol: stdin holds one job: a text line `NAME int...` and then its
// arrays, each a u64 byte count and the bytes; stdout gets the outputs the
// same way. Exit 2 on a malformed job.
#include "cuda_emu.h"

// The source under test: the joined CUDA source (kernels/src/cuda_source.rs's
// SOURCE, which the test writes to a file), or a negative control's variant.
#ifndef KERNELS_CU
#error "define KERNELS_CU as the path of the joined CUDA source"
#endif
#include KERNELS_CU

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "job_io.h"

static unsigned blocks_of(long long threads, unsigned per) { return (unsigned)((threads + per - 1) / per); }

int main() {
    std::string line;
    {
        int c;
        while ((c = std::fgetc(stdin)) != EOF && c != '\n') line.push_back((char)c);
    }
    std::istringstream hs(line);
    std::string job;
    hs >> job;
    if (job == "matmul") {
        // matmul KERNEL kind n rows k
        std::string kernel;
        int kind, n, rows, k;
        hs >> kernel >> kind >> n >> rows >> k;
        auto x = read_as<float>();
        auto w = read_array();
        long long row_bytes = rows ? (long long)(w.size() / rows) : 0;
        std::vector<float> y((size_t)n * rows, std::nanf(""));
        const float* xp = x.data();
        const unsigned char* wp = w.data();
        float* yp = y.data();
        if (kernel == "thread") {
            emu::launch(blocks_of((long long)n * rows, 128), 128, [&] { matmul(kind, xp, wp, yp, n, rows, k, row_bytes); });
        } else if (kernel == "warp") {
            emu::launch(blocks_of((long long)n * rows * 32, 128), 128, [&] { matmul_warp(kind, xp, wp, yp, n, rows, k, row_bytes); });
        } else if (kernel == "tile") {
            long long warps = (long long)rows * ((n + MM_TOKENS - 1) / MM_TOKENS);
            emu::launch(blocks_of(warps * 32, 128), 128, [&] { matmul_tile(kind, xp, wp, yp, n, rows, k, row_bytes); });
        } else if (kernel == "rows") {
            unsigned b = (unsigned)(rows * ((n + MM_TOKENS - 1) / MM_TOKENS));
            emu::launch(b, 8 * MR_GROUPS, [&] { matmul_rows(kind, xp, wp, yp, n, rows, k, row_bytes); });
        } else if (kernel == "rows4") {
            unsigned b = (unsigned)(((rows + MR4_ROWS - 1) / MR4_ROWS) * ((n + MM_TOKENS - 1) / MM_TOKENS));
            emu::launch(b, 8 * MR_GROUPS, [&] { matmul_rows4(kind, xp, wp, yp, n, rows, k, row_bytes); });
        } else if (kernel == "gemm") {
            unsigned b = (unsigned)(((rows + GM_ROWS - 1) / GM_ROWS) * ((n + GM_TOKS - 1) / GM_TOKS));
            emu::launch(b, GM_THREADS, [&] { matmul_gemm(kind, xp, wp, yp, n, rows, k, row_bytes, nullptr, 0); });
        } else if (kernel == "gemm_wide") {
            unsigned b = (unsigned)(((rows + GW_ROWS - 1) / GW_ROWS) * ((n + GW_TOKS - 1) / GW_TOKS));
            emu::launch(b, GW_THREADS, [&] { matmul_gemm_wide(kind, xp, wp, yp, n, rows, k, row_bytes, nullptr, 0); });
        } else if (kernel.rfind("gemm_split", 0) == 0 || kernel.rfind("gemm_wide_split", 0) == 0) {
            // gemm[_wide]_splitC: blocks of C chunks writing partials, then sum_chunks.
            bool wide = kernel.rfind("gemm_wide_split", 0) == 0;
            int cpb = std::atoi(kernel.c_str() + (wide ? 15 : 10));
            if (cpb < 1) return 2;
            int chunks = (k + CHUNK - 1) / CHUNK;
            int groups = (chunks + cpb - 1) / cpb;
            int R = wide ? GW_ROWS : GM_ROWS, T = wide ? GW_TOKS : GM_TOKS;
            unsigned tiles = (unsigned)(((rows + R - 1) / R) * ((n + T - 1) / T));
            long long count = (long long)n * rows;
            std::vector<float> part((size_t)chunks * count, std::nanf(""));
            float* pp = part.data();
            if (wide) {
                emu::launch(tiles * groups, GW_THREADS, [&] { matmul_gemm_wide(kind, xp, wp, yp, n, rows, k, row_bytes, pp, cpb); });
            } else {
                emu::launch(tiles * groups, GM_THREADS, [&] { matmul_gemm(kind, xp, wp, yp, n, rows, k, row_bytes, pp, cpb); });
            }
            emu::launch(blocks_of(count, 128), 128, [&] { sum_chunks(pp, yp, chunks, count); });
        } else {
            return 2;
        }
        write_array(y);
    } else if (job == "multi") {
        // multi kind n k rows0 rows1 rows2: three matrices, one matmul_multi
        // launch
        int kind, n, k, r0, r1, r2;
        hs >> kind >> n >> k >> r0 >> r1 >> r2;
        auto x = read_as<float>();
        auto w0 = read_array(), w1 = read_array(), w2 = read_array();
        std::vector<float> y0((size_t)n * r0), y1((size_t)n * r1), y2((size_t)n * r2 + 1);
        auto rb = [](const std::vector<unsigned char>& w, int r) { return r ? (long long)(w.size() / r) : 0LL; };
        int tiles = (n + MM_TOKENS - 1) / MM_TOKENS;
        unsigned b = (unsigned)((r0 + r1 + r2) * tiles);
        emu::launch(b, 8 * MR_GROUPS, [&] {
            matmul_multi(kind, x.data(), n, k, w0.data(), y0.data(), r0, rb(w0, r0), w1.data(), y1.data(), r1, rb(w1, r1),
                     w2.data(), y2.data(), r2, rb(w2, r2));
        });
        y2.resize((size_t)n * r2);
        write_array(y0);
        write_array(y1);
        write_array(y2);
    } else if (job == "rope_kv") {
        // rope_kv n qd kvd hd page_len [chunks qs ks vs]: q, k, v, cos, sin,
        // pos, slot (u64); one page of one layer per token -> q, k, pages, v.
        // With chunks > 0, each of q, k, v whose flag is 1 is sent as its
        // chunk partials (chunks · n · width) and read through split_value.
        int n, qd, kvd, hd, page_len, chunks = 0, qs = 0, ks = 0, vs = 0;
        hs >> n >> qd >> kvd >> hd >> page_len >> chunks >> qs >> ks >> vs;
        auto q = read_as<float>();
        auto k = read_as<float>();
        auto v = read_as<float>();
        std::vector<float> qp, kp, vp;
        if (chunks > 0) {
            if (qs) { qp = q; q.assign((size_t)n * qd, std::nanf("")); }
            if (ks) { kp = k; k.assign((size_t)n * kvd, std::nanf("")); }
            if (vs) { vp = v; v.assign((size_t)n * kvd, std::nanf("")); }
        }
        auto ptr = [](std::vector<float>& a) { return a.empty() ? nullptr : a.data(); };
        auto cs = read_as<float>();
        auto sn = read_as<float>();
        auto pos = read_as<uint64_t>();
        auto slot = read_as<uint64_t>();
        size_t pf = (size_t)page_len * 2 * kvd;
        std::vector<float> pages((size_t)n * pf, 0.0f);
        std::vector<unsigned long long> dst(n), ps(pos.begin(), pos.end()), sl(slot.begin(), slot.end());
        for (int t = 0; t < n; ++t) dst[t] = (unsigned long long)(uintptr_t)(pages.data() + t * pf);
        long long per = (long long)n * (qd / 2 + kvd / 2 + kvd);
        emu::launch(blocks_of(per, 128), 128, [&] {
            rope_kv(q.data(), k.data(), v.data(), ptr(qp), ptr(kp), ptr(vp), chunks, cs.data(), sn.data(), ps.data(),
                    dst.data(), sl.data(), n, qd, kvd, hd, 0, page_len, 0);
        });
        write_array(q);
        write_array(k);
        write_array(pages);
        write_array(v);
    } else if (job == "decode_rope") {
        // decode_rope n nh nkv hd page_len scale_bits [window]: q (n·qd), k, v (n·kvd),
        // cos, sin, store (whole pages of one layer), index (page of each
        // table entry), seq_off, pos, dst_page (u64 each), slot (u64) ->
        // rope_kv then attention_decode: out, q, k, store; then
        // attention_decode_rope_qs on the same inputs: out, q, kout, store.
        int n, nh, nkv, hd, page_len, window = 0;
        unsigned scale_bits;
        hs >> n >> nh >> nkv >> hd >> page_len >> scale_bits >> window;
        float scale = __uint_as_float(scale_bits);
        auto q = read_as<float>();
        auto k = read_as<float>();
        auto v = read_as<float>();
        auto cs = read_as<float>();
        auto sn = read_as<float>();
        auto store = read_as<float>();
        auto index = read_as<uint64_t>();
        auto seq_off = read_as<uint64_t>();
        auto pos = read_as<uint64_t>();
        auto dst_page = read_as<uint64_t>();
        auto slot = read_as<uint64_t>();
        int kvd = nkv * hd, qd = nh * hd;
        size_t pf = (size_t)page_len * 2 * kvd;
        std::vector<unsigned long long> so(seq_off.begin(), seq_off.end()), ps(pos.begin(), pos.end()),
            sl(slot.begin(), slot.end());
        auto tables = [&](std::vector<float>& st, std::vector<unsigned long long>& table,
                          std::vector<unsigned long long>& dst) {
            table.resize(index.size());
            for (size_t i = 0; i < index.size(); ++i)
                table[i] = (unsigned long long)(uintptr_t)(st.data() + index[i] * pf);
            dst.resize(n);
            for (int t = 0; t < n; ++t) dst[t] = (unsigned long long)(uintptr_t)(st.data() + dst_page[t] * pf);
        };
        {
            auto qa = q, ka = k, va = v, sa = store;
            std::vector<unsigned long long> table, dst;
            tables(sa, table, dst);
            long long per = (long long)n * (qd / 2 + kvd / 2 + kvd);
            emu::launch(blocks_of(per, 128), 128, [&] {
                rope_kv(qa.data(), ka.data(), va.data(), nullptr, nullptr, nullptr, 0, cs.data(), sn.data(), ps.data(),
                        dst.data(), sl.data(), n, qd, kvd, hd, 0, page_len, 0);
            });
            std::vector<float> out((size_t)n * qd, std::nanf(""));
            emu::launch((unsigned)(n * nh), ATTN_THREADS, [&] {
                attention_decode(qa.data(), table.data(), so.data(), ps.data(), out.data(), nh, nkv, hd, 0, page_len, 0,
                                 scale, window);
            });
            write_array(out);
            write_array(qa);
            write_array(ka);
            write_array(sa);
        }
        {
            auto qb = q, sb = store;
            std::vector<float> kout((size_t)n * kvd, std::nanf(""));
            std::vector<unsigned long long> table, dst;
            tables(sb, table, dst);
            std::vector<float> out((size_t)n * qd, std::nanf(""));
            emu::launch((unsigned)(n * nh), ATTN_THREADS, [&] {
                attention_decode_rope_qs(qb.data(), k.data(), kout.data(), v.data(), cs.data(), sn.data(),
                                         table.data(), so.data(), ps.data(), dst.data(), sl.data(), out.data(), nh,
                                         nkv, hd, 0, page_len, 0, scale, window);
            });
            write_array(out);
            write_array(qb);
            write_array(kout);
            write_array(sb);
        }
    } else if (job == "gemm_multi") {
        // gemm_multi kind n k rows0 rows1 rows2 cpb0 cpb1 cpb2: x, w0, w1, w2
        // -> y0, y1, y2; matrix m split (cpb_m chunks a block, partials then
        // sum_chunks) when cpb_m > 0; rows_m 0: absent.
        int kind, n, k, r[3], cpb[3];
        hs >> kind >> n >> k >> r[0] >> r[1] >> r[2] >> cpb[0] >> cpb[1] >> cpb[2];
        auto x = read_as<float>();
        std::vector<unsigned char> w[3] = {read_array(), read_array(), read_array()};
        int chunks = (k + CHUNK - 1) / CHUNK;
        std::vector<float> y[3], part[3];
        long long rb[3];
        int blocks[3];
        for (int m = 0; m < 3; ++m) {
            y[m].assign((size_t)n * r[m] + 1, std::nanf(""));
            rb[m] = r[m] ? (long long)(w[m].size() / r[m]) : 0;
            int tiles = ((r[m] + GW_ROWS - 1) / GW_ROWS) * ((n + GW_TOKS - 1) / GW_TOKS);
            int groups = cpb[m] > 0 ? (chunks + cpb[m] - 1) / cpb[m] : 1;
            blocks[m] = r[m] ? tiles * groups : 0;
            if (cpb[m] > 0) part[m].assign((size_t)chunks * n * r[m] + 1, std::nanf(""));
        }
        auto pp = [&](int m) { return cpb[m] > 0 ? part[m].data() : nullptr; };
        emu::launch((unsigned)(blocks[0] + blocks[1] + blocks[2]), GW_THREADS, [&] {
            matmul_gemm_multi(kind, x.data(), n, k, w[0].data(), y[0].data(), r[0], rb[0], pp(0), cpb[0], blocks[0],
                              w[1].data(), y[1].data(), r[1], rb[1], pp(1), cpb[1], blocks[1], w[2].data(),
                              y[2].data(), r[2], rb[2], pp(2), cpb[2], blocks[2]);
        });
        for (int m = 0; m < 3; ++m) {
            long long count = (long long)n * r[m];
            if (cpb[m] > 0 && count > 0) {
                float* p = part[m].data();
                float* ym = y[m].data();
                emu::launch(blocks_of(count, 128), 128, [&] { sum_chunks(p, ym, chunks, count); });
            }
            y[m].resize((size_t)count);
            write_array(y[m]);
        }
    } else if (job == "split_consumers") {
        // split_consumers rows d chunks eps_bits: x, part (chunks · rows · d),
        // w, g_part, u_part (chunks · rows · d each) -> norm_reg's out and x,
        // norm_block's out and x, swiglu_split's out, add_rows' x,
        // norm_reg_lf's out and x: each
        // reading its y (or g, u) through split_value.
        int rows, d, chunks;
        unsigned eps_bits;
        hs >> rows >> d >> chunks >> eps_bits;
        float eps = __uint_as_float(eps_bits);
        auto x = read_as<float>();
        auto part = read_as<float>();
        auto w = read_as<float>();
        auto gp = read_as<float>();
        auto up = read_as<float>();
        long long count = (long long)rows * d;
        std::vector<float> out1(count, std::nanf("")), out2(count, std::nanf("")), sw(count, std::nanf(""));
        std::vector<float> out4(count, std::nanf(""));
        auto x1 = x, x2 = x, x3 = x, x4 = x;
        unsigned threads = (unsigned)((8 * ((d + CHUNK - 1) / CHUNK) + 31) / 32 * 32);
        emu::launch((unsigned)rows, threads, [&] {
            norm_reg(x1.data(), nullptr, part.data(), chunks, w.data(), out1.data(), rows, d, eps, 1);
        });
        emu::launch((unsigned)rows, threads, [&] {
            norm_reg_lf(x4.data(), nullptr, part.data(), chunks, w.data(), out4.data(), rows, d, eps, 1);
        });
        emu::launch((unsigned)rows, 8 * MR_GROUPS, [&] {
            norm_block(x2.data(), nullptr, part.data(), chunks, w.data(), out2.data(), rows, d, eps, 1);
        });
        emu::launch(blocks_of(count, 128), 128,
                    [&] { swiglu_split(nullptr, gp.data(), nullptr, up.data(), chunks, sw.data(), count); });
        emu::launch(blocks_of(count, 128), 128, [&] { add_rows(x3.data(), nullptr, part.data(), chunks, (int)count); });
        write_array(out1);
        write_array(x1);
        write_array(out2);
        write_array(x2);
        write_array(sw);
        write_array(x3);
        write_array(out4);
        write_array(x4);
    } else if (job == "embed") {
        // embed kind n d: w, ids (u64) -> rows
        int kind, n, d;
        hs >> kind >> n >> d;
        auto w = read_array();
        auto ids = read_as<uint64_t>();
        std::vector<unsigned long long> id(ids.begin(), ids.end());
        std::vector<float> out((size_t)n * d, std::nanf(""));
        // Row bytes from the storage: the caller sends whole rows.
        long long rb = 0;
        if (kind == 0) rb = 4LL * d;
        else if (kind == 1) rb = 2LL * d;
        else if (kind >= 5) rb = (long long)(d / 256) * (kind == 5 ? 144 : 210);
        else rb = (long long)(d / 32) * (kind == 2 ? 18 : kind == 3 ? 20 : 34);
        emu::launch(blocks_of((long long)n * d, 128), 128,
                    [&] { embed_rows(kind, w.data(), id.data(), out.data(), n, d, rb); });
        write_array(out);
    } else if (job == "norm") {
        // norm KERNEL rows d add eps_bits: out, then x after the add
        std::string kernel;
        int rows, d, add;
        unsigned eps_bits;
        hs >> kernel >> rows >> d >> add >> eps_bits;
        float eps = __uint_as_float(eps_bits);
        auto x = read_as<float>();
        auto y = read_as<float>();
        auto w = read_as<float>();
        std::vector<float> out(x.size(), std::nanf(""));
        if (kernel == "warp") {
            unsigned b = blocks_of((long long)rows * 32, 128);
            if (add)
                emu::launch(b, 128, [&] { add_norm(x.data(), y.data(), w.data(), out.data(), rows, d, eps); });
            else
                emu::launch(b, 128, [&] { rms_norm_warp(x.data(), w.data(), out.data(), rows, d, eps); });
        } else if (kernel == "block") {
            emu::launch((unsigned)rows, 8 * MR_GROUPS,
                        [&] { norm_block(x.data(), y.data(), nullptr, 0, w.data(), out.data(), rows, d, eps, add); });
        } else if (kernel == "reg" || kernel == "reg_lf") {
            unsigned threads = (unsigned)((8 * ((d + CHUNK - 1) / CHUNK) + 31) / 32 * 32);
            if (kernel == "reg")
                emu::launch((unsigned)rows, threads,
                            [&] { norm_reg(x.data(), y.data(), nullptr, 0, w.data(), out.data(), rows, d, eps, add); });
            else
                emu::launch((unsigned)rows, threads, [&] {
                    norm_reg_lf(x.data(), y.data(), nullptr, 0, w.data(), out.data(), rows, d, eps, add);
                });
        } else {
            return 2;
        }
        write_array(out);
        write_array(x);
    } else if (job == "attention") {
        // attention tasks nh nkv hd page_len scale_bits [decode: 1 attention_decode, 2
        // attention_prefill, 3 attention_prefill_hd64 or _hd128 (by hd), 5 the same
        // with its groups listed last first, 6 the one-thread attention over
        // each task's rows gathered from the pages, 7 the split decode
        // attention, 8 the same in two blocks a row] [window: 0 none]: q,
        // pages (floats, whole pages of one layer), page index per table
        // entry, seq_off, pos (u64 each)
        int tasks, nh, nkv, hd, page_len, decode = 0, window = 0;
        unsigned scale_bits;
        hs >> tasks >> nh >> nkv >> hd >> page_len >> scale_bits >> decode >> window;
        float scale = __uint_as_float(scale_bits);
        auto q = read_as<float>();
        auto pages = read_as<float>();
        auto index = read_as<uint64_t>();
        auto seq_off = read_as<uint64_t>();
        auto pos = read_as<uint64_t>();
        int kvd = nkv * hd;
        size_t page_floats = (size_t)page_len * 2 * kvd;
        std::vector<unsigned long long> table(index.size());
        for (size_t i = 0; i < index.size(); ++i)
            table[i] = (unsigned long long)(uintptr_t)(pages.data() + index[i] * page_floats);
        std::vector<unsigned long long> so(seq_off.begin(), seq_off.end()), ps(pos.begin(), pos.end());
        std::vector<float> out((size_t)tasks * nh * hd, std::nanf(""));
        if (decode == 2 || decode == 3 || decode == 5) {
            // attention_prefill (3: attention_prefill_hd64 or _hd128; 5: the
            // same with the groups listed last first): groups of up to PF_TQ
            // consecutive tasks of one sequence (equal seq_off).
            std::vector<unsigned long long> groups;
            for (int t = 0; t < tasks;) {
                int c = 1;
                while (t + c < tasks && c < PF_TQ && so[t + c] == so[t]) ++c;
                groups.push_back(((unsigned long long)t << 32) | (unsigned)c);
                t += c;
            }
            if (decode == 5) std::reverse(groups.begin(), groups.end());
            emu::launch((unsigned)(groups.size() * nh), ATTN_THREADS, [&] {
                if ((decode == 3 || decode == 5) && hd == 128)
                    attention_prefill_hd128(q.data(), table.data(), so.data(), ps.data(), groups.data(), out.data(),
                                            nh, nkv, hd, 0, page_len, 0, scale, window);
                else if (decode == 3 || decode == 5)
                    attention_prefill_hd64(q.data(), table.data(), so.data(), ps.data(), groups.data(), out.data(), nh,
                                           nkv, hd, 0, page_len, 0, scale, window);
                else
                    attention_prefill(q.data(), table.data(), so.data(), ps.data(), groups.data(), out.data(), nh, nkv,
                                      hd, 0, page_len, 0, scale, window);
            });
            write_array(out);
            std::fflush(stdout);
            return 0;
        }
        if (decode == 7 || decode == 8) {
            // The split decode attention: scores, then p and the tiles'
            // partials, then the merge, over scratch for the most tiles any
            // task has, in segments of SPLIT_TILES: a block per segment (7),
            // or two blocks per row each taking every other segment (8).
            int cap = 0;
            for (int t = 0; t < tasks; ++t) {
                int lo = first_key((int)ps[t], window), base0 = lo / ATTN_TILE * ATTN_TILE;
                cap = std::max(cap, ((int)ps[t] - base0) / ATTN_TILE + 1);
            }
            int segs = decode == 8 ? 2 : (cap + SPLIT_TILES - 1) / SPLIT_TILES;
            size_t rows_n = (size_t)tasks * nh;
            std::vector<float> sc(rows_n * cap * ATTN_TILE, std::nanf("")), tm(rows_n * cap, std::nanf("")),
                ta(rows_n * cap, std::nanf("")), tl(rows_n * cap, std::nanf("")),
                at(rows_n * cap * hd, std::nanf(""));
            unsigned blocks = (unsigned)((size_t)tasks * nkv * segs);
            emu::launch(blocks, ATTN_THREADS, [&] {
                attention_split_scores(q.data(), table.data(), so.data(), ps.data(), nh, nkv, hd, 0, page_len, 0,
                                       scale, window, segs, cap, sc.data(), tm.data());
            });
            emu::launch(blocks, ATTN_THREADS, [&] {
                attention_split_pv(table.data(), so.data(), ps.data(), nh, nkv, hd, 0, page_len, 0, window, segs, cap,
                                   sc.data(), tm.data(), ta.data(), tl.data(), at.data());
            });
            emu::launch((unsigned)rows_n, ATTN_THREADS, [&] {
                attention_split_merge(ps.data(), nh, hd, window, cap, ta.data(), tl.data(), at.data(), out.data());
            });
            write_array(out);
            std::fflush(stdout);
            return 0;
        }
        if (decode == 6) {
            // The one-thread kernel (the portable mirror's): task t's rows
            // 0 ..= pos[t] copied out of its pages, one after another.
            std::vector<float> k, v;
            std::vector<long long> off(tasks);
            std::vector<int> p32(tasks);
            for (int t = 0; t < tasks; ++t) {
                off[t] = (long long)(k.size() / kvd);
                p32[t] = (int)ps[t];
                for (unsigned long long j = 0; j <= ps[t]; ++j) {
                    const float* pg = (const float*)(uintptr_t)table[so[t] + j / page_len];
                    const float* kr = pg + (j % page_len) * kvd;
                    const float* vr = pg + ((size_t)page_len + j % page_len) * kvd;
                    k.insert(k.end(), kr, kr + kvd);
                    v.insert(v.end(), vr, vr + kvd);
                }
            }
            emu::launch(blocks_of((long long)tasks * nh, 128), 128, [&] {
                attention(q.data(), k.data(), v.data(), off.data(), p32.data(), out.data(), tasks, nh, nkv, hd, scale,
                          window);
            });
            write_array(out);
            std::fflush(stdout);
            return 0;
        }
        emu::launch((unsigned)(tasks * nh), ATTN_THREADS, [&] {
            if (decode)
                attention_decode(q.data(), table.data(), so.data(), ps.data(), out.data(), nh, nkv, hd, 0, page_len, 0,
                                 scale, window);
            else
                attention_paged(q.data(), table.data(), so.data(), ps.data(), out.data(), nh, nkv, hd, 0, page_len, 0,
                                scale, window);
        });
        write_array(out);
    } else if (job == "add_bias") {
        // add_bias cols: y, b (cols floats) -> y after the adds
        int cols;
        hs >> cols;
        auto y = read_as<float>();
        auto b = read_as<float>();
        long long n = (long long)y.size();
        emu::launch(blocks_of(n, 128), 128, [&] { add_bias(y.data(), b.data(), n, cols); });
        write_array(y);
    } else if (job == "scale") {
        // scale by_bits: x -> x after the multiplies (scale_elems)
        unsigned by_bits;
        hs >> by_bits;
        auto x = read_as<float>();
        long long n = (long long)x.size();
        emu::launch(blocks_of(n, 128), 128, [&] { scale_elems(x.data(), __uint_as_float(by_bits), n); });
        write_array(x);
    } else if (job == "geglu") {
        // geglu a_bits neg2c_bits: g, u -> out (the host's two constants)
        unsigned a_bits, c_bits;
        hs >> a_bits >> c_bits;
        auto g = read_as<float>();
        auto u = read_as<float>();
        long long n = (long long)g.size();
        std::vector<float> out(g.size(), std::nanf(""));
        emu::launch(blocks_of(n, 128), 128, [&] {
            geglu(g.data(), u.data(), out.data(), n, __uint_as_float(a_bits), __uint_as_float(c_bits));
        });
        write_array(out);
    } else if (job == "repeat_rows") {
        // repeat_rows n d w: x (n·d) -> out (n·w)
        int n, d, w;
        hs >> n >> d >> w;
        auto x = read_as<float>();
        std::vector<float> out((size_t)n * w, std::nanf(""));
        emu::launch(blocks_of((long long)n * w, 128), 128, [&] { repeat_rows(x.data(), out.data(), n, d, w); });
        write_array(out);
    } else if (job == "round_bf16") {
        // round_bf16: x -> x rounded in place
        auto x = read_as<float>();
        long long n = (long long)x.size();
        emu::launch(blocks_of(n, 128), 128, [&] { round_bf16(x.data(), n); });
        write_array(x);
    } else if (job == "stream_mean") {
        // stream_mean n s d inv_bits: x (n·s·d) -> out (n·d)
        int n, s, d;
        unsigned inv_bits;
        hs >> n >> s >> d >> inv_bits;
        auto x = read_as<float>();
        std::vector<float> out((size_t)n * d, std::nanf(""));
        emu::launch(blocks_of((long long)n * d, 128), 128,
                    [&] { stream_mean(x.data(), out.data(), n, s, d, __uint_as_float(inv_bits)); });
        write_array(out);
    } else if (job == "moe_combine_idx") {
        // moe_combine_idx n d: base (n·d floats; none: null), gates, ys (rows
        // of d), idx (i32, a row of ys per entry), off (i32, n + 1) -> out
        int n, d;
        hs >> n >> d;
        auto base = read_as<float>();
        auto gates = read_as<float>();
        auto ys = read_as<float>();
        auto idx = read_as<int32_t>();
        auto off = read_as<int32_t>();
        std::vector<float> out((size_t)n * d, std::nanf(""));
        const float* bp = base.empty() ? nullptr : base.data();
        emu::launch(blocks_of((long long)n * d, 128), 128, [&] {
            moe_combine_idx(bp, gates.data(), ys.data(), idx.data(), off.data(), out.data(), n, d);
        });
        write_array(out);
    } else if (job == "kv_write_aux") {
        // kv_write_aux n layers layer page_len kvd aux: ik (n·aux), store
        // (whole pages of `layers` layers), dst (the page of each token),
        // slot (u64 each) -> store after the writes
        int n, layers, layer, page_len, kvd, aux;
        hs >> n >> layers >> layer >> page_len >> kvd >> aux;
        auto ik = read_as<float>();
        auto store = read_as<float>();
        auto page = read_as<uint64_t>();
        auto slot = read_as<uint64_t>();
        size_t pf = (size_t)layers * page_len * (2 * kvd + aux);
        std::vector<unsigned long long> dst(n), sl(slot.begin(), slot.end());
        for (int t = 0; t < n; ++t) dst[t] = (unsigned long long)(uintptr_t)(store.data() + page[t] * pf);
        emu::launch(blocks_of((long long)n * aux, 128), 128,
                    [&] { kv_write_aux(ik.data(), dst.data(), sl.data(), n, layer, page_len, kvd, aux); });
        write_array(store);
    } else {
        return 2;
    }
    std::fflush(stdout);
    return 0;
}
