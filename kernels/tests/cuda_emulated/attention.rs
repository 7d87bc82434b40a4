//! Attention and what feeds it: `attention_paged`, `attention_decode` (also
//! with its loads before the wait), the decode split over the KV length
//! (`attention_split_*`), `attention_prefill` and its hd64 and hd128 forms
//! against the CPU's attention over paged K/V; `rope_kv` (RoPE and the page
//! writes, from whole rows or split partials) and `embed_rows` against the
//! CPU's RoPE, page layout and row widening; `attention_decode_rope_qs`
//! against `rope_kv` then `attention_decode`.

use crate::harness::*;
use lmrr_kernels::*;

#[test]
fn paged_attention_matches_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(8);
    // (heads, kv heads, head_dim, positions, page_len): tile edges; pages of
    // one position; head dims of several chunks; contexts past one
    // super-chunk (2,048 positions at head_dim 64, 512 at 256), where the
    // running max and the merge cross super-chunks.
    let cases: &[(usize, usize, usize, &[usize], usize)] = &[
        (4, 2, 64, &[0, 31, 32, 70], 16),
        // Two spans of two (below): the second's rows under 40 are old.
        (4, 2, 64, &[5, 6, 40, 41], 16),
        (4, 2, 64, &[5, 40], 1),
        (3, 3, 80, &[95], 7),
        (2, 1, 128, &[200], 16),
        (2, 1, 256, &[1100], 64),
        (2, 2, 64, &[2100], 32),
        // attention_prefill's groups: 20 tokens of one sequence (a group of
        // 16 and one of 4), positions past a super-chunk and unsorted.
        (
            3,
            1,
            64,
            &[
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 30, 31, 32, 33, 63, 64, 2047, 2048, 2050, 100,
            ],
            16,
        ),
        (2, 1, 128, &[3, 90, 91, 92, 200], 32),
        // A latent attention row (512 + 64 floats, one K/V head shared by
        // every head): the one-thread kernel alone holds it.
        (4, 1, 576, &[0, 31, 33, 70], 16),
    ];
    for &(nh, nkv, hd, positions, page_len) in cases {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let kvd = shape.kv_dim();
        let cap = positions.iter().max().unwrap() + 1;
        let pages = cap.div_ceil(page_len);
        // One sequence's pages, stored in reverse order (the table decides).
        let k: Vec<f32> = r.uniform_vec(pages * page_len * kvd, 3.0);
        let v: Vec<f32> = r.uniform_vec(pages * page_len * kvd, 1.0);
        let view = KvView {
            block_len: page_len,
            k: k.chunks(page_len * kvd).collect(),
            v: v.chunks(page_len * kvd).collect(),
        };
        let mut store = vec![0.0f32; pages * page_len * 2 * kvd];
        for b in 0..pages {
            let slot = pages - 1 - b;
            let dst = &mut store[slot * page_len * 2 * kvd..(slot + 1) * page_len * 2 * kvd];
            dst[..page_len * kvd].copy_from_slice(view.k[b]);
            dst[page_len * kvd..].copy_from_slice(view.v[b]);
        }
        let index: Vec<u64> = (0..pages).map(|b| (pages - 1 - b) as u64).collect();
        let qs: Vec<Vec<f32>> = positions
            .iter()
            .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
            .collect();
        let tasks: Vec<AttnTask> = positions
            .iter()
            .zip(&qs)
            .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
        attention(&th, &tasks, &shape, scale, &mut cpu);
        let q: Vec<f32> = qs.concat();
        let seq_off = vec![0u64; tasks.len()];
        let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
        for (kernel, decode, bin) in [
            ("attention_paged", 0, emulator()),
            ("attention_decode", 1, emulator()),
            ("attention_decode, ATTN_PREFETCH", 1, emulator_prefetch()),
            ("attention_prefill", 2, emulator()),
            ("attention_prefill_hd64 or _hd128", 3, emulator()),
            // The groups listed last first (LMRR_CUDA_PF_LONGEST_FIRST
            // reorders them): which block serves which group moves no bit.
            (
                "attention_prefill_hd64 or _hd128, groups reversed",
                5,
                emulator(),
            ),
            // The portable mirror's one-thread kernel over gathered rows.
            ("attention (one thread)", 6, emulator()),
            // Decode split over the KV length (segments of SPLIT_TILES tiles).
            ("attention_split_*", 7, emulator()),
        ] {
            let Some(bin) = bin else { continue };
            // The paged kernels hold head dims up to MAX_HEAD_DIM (256),
            // attention_prefill up to PF_MAXHD (128); the _hd64 and _hd128
            // kernels for head_dim 64 and 128 alone.
            if ((decode <= 1 || decode == 7) && hd > 256)
                || (decode == 2 && hd > 128)
                || ((3..=5).contains(&decode) && hd != 64 && hd != 128)
            {
                continue;
            }
            // One span of every task (the positions below the first are
            // earlier steps' rows: loaded before the wait under
            // ATTN_PREFETCH), then two spans of half the tasks each where
            // their count is even (the second span's table a copy of the
            // first; attention_prefill's groups end at the span's end).
            let mut layouts = vec![(index.clone(), seq_off.clone())];
            if tasks.len() >= 4 && tasks.len().is_multiple_of(2) {
                let half = tasks.len() / 2;
                layouts.push((
                    [index.clone(), index.clone()].concat(),
                    (0..tasks.len())
                        .map(|i| if i < half { 0 } else { pages as u64 })
                        .collect(),
                ));
            }
            for (table, offs) in &layouts {
                let out = job_on(
                    bin,
                    &format!(
                        "attention {} {nh} {nkv} {hd} {page_len} {} {decode}",
                        tasks.len(),
                        scale.to_bits()
                    ),
                    &[
                        &bytes(&q),
                        &bytes(&store),
                        &bytes64(table),
                        &bytes64(offs),
                        &bytes64(&pos),
                    ],
                );
                assert_eq!(
                    differing(&cpu, &floats(&out[0])),
                    0,
                    "{kernel} {nh}/{nkv} × {hd}, positions {positions:?}, pages of {page_len}, spans {offs:?}"
                );
            }
        }
    }
}

/// `rope_kv` (RoPE of q and k, the rotated keys and the values into their
/// page slots) and `embed_rows` (widened rows of every storage) against the
/// CPU's RoPE, page layout and row widening.
#[test]
fn rope_kv_and_embedding_match_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(12);
    let (hd, nh, nkv, page_len) = (64usize, 9usize, 3usize, 16usize);
    let (qd, kvd) = (nh * hd, nkv * hd);
    let table = RopeTable::new(hd, 100_000.0, 4096);
    let positions = [0usize, 1, 17, 511, 4095];
    let n = positions.len();
    let q = r.uniform_vec(n * qd, 2.0);
    let k = r.uniform_vec(n * kvd, 2.0);
    let v = r.uniform_vec(n * kvd, 1.0);
    let (cos, sin) = table.tables();
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let slots: Vec<u64> = positions.iter().map(|&p| (p % page_len) as u64).collect();
    let out = job(
        &format!("rope_kv {n} {qd} {kvd} {hd} {page_len}"),
        &[
            &bytes(&q),
            &bytes(&k),
            &bytes(&v),
            &bytes(cos),
            &bytes(sin),
            &bytes64(&pos),
            &bytes64(&slots),
        ],
    );
    let (gq, gk, pages) = (floats(&out[0]), floats(&out[1]), floats(&out[2]));
    let pf = page_len * 2 * kvd;
    for (t, &p) in positions.iter().enumerate() {
        let mut cq = q[t * qd..(t + 1) * qd].to_vec();
        let mut ck = k[t * kvd..(t + 1) * kvd].to_vec();
        rope(&table, &mut cq, p);
        rope(&table, &mut ck, p);
        assert_eq!(differing(&cq, &gq[t * qd..(t + 1) * qd]), 0, "q at {p}");
        assert_eq!(differing(&ck, &gk[t * kvd..(t + 1) * kvd]), 0, "k at {p}");
        let page = &pages[t * pf..(t + 1) * pf];
        assert_page_rows(
            page,
            p % page_len,
            page_len,
            &ck,
            &v[t * kvd..(t + 1) * kvd],
            &format!("at {p}"),
        );
    }
    // Embedding rows of every storage.
    let (rows, d) = (50usize, 96usize);
    let st = Stored::new(&mut r, rows * d, 1.0);
    let ids: Vec<u64> = vec![0, 49, 7, 7, 23];
    for (label, kind, w, raw) in st.each() {
        let m = Matrix::new(w, rows, d).expect("shape");
        let mut cpu = vec![0.0; ids.len() * d];
        for (i, &id) in ids.iter().enumerate() {
            m.row_into(id as usize, &mut cpu[i * d..(i + 1) * d], true);
        }
        let out = job(
            &format!("embed {kind} {} {d}", ids.len()),
            &[&raw, &bytes64(&ids)],
        );
        assert_eq!(differing(&cpu, &floats(&out[0])), 0, "embed_rows {label}");
    }
    // And of the super-block formats: rows of two super-blocks.
    let d = 512usize;
    for (label, kind, q, raw) in kquant_blocks(&mut r, rows * d) {
        let m = Matrix::new(Weights::Quant(q, &raw), rows, d).expect("shape");
        let mut cpu = vec![0.0; ids.len() * d];
        for (i, &id) in ids.iter().enumerate() {
            m.row_into(id as usize, &mut cpu[i * d..(i + 1) * d], true);
        }
        let out = job(
            &format!("embed {kind} {} {d}", ids.len()),
            &[&raw, &bytes64(&ids)],
        );
        assert_eq!(differing(&cpu, &floats(&out[0])), 0, "embed_rows {label}");
    }
}

/// `rope_kv` reading q, k and v as split matmuls' partials (each or some):
/// the CPU's RoPE of their chunk-order sums, the rows written back, and
/// the page rows.
#[test]
fn rope_kv_folds_the_split_sums() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(23);
    let (hd, nh, nkv, page_len, chunks) = (64usize, 3usize, 1usize, 8usize, 5usize);
    let (qd, kvd) = (nh * hd, nkv * hd);
    let table = RopeTable::new(hd, 10_000.0, 64);
    let (cos, sin) = table.tables();
    let positions = [0usize, 9, 63];
    let n = positions.len();
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let slots: Vec<u64> = positions.iter().map(|&p| (p % page_len) as u64).collect();
    for flags in [[1u8, 1, 1], [0, 1, 1], [1, 0, 0]] {
        let send = |r: &mut SplitMix64, width: usize, split: u8| -> (Vec<f32>, Vec<f32>) {
            if split == 1 {
                let p = r.uniform_vec(chunks * n * width, 1.0);
                let s = chunk_sums(&p, chunks, n * width);
                (p, s)
            } else {
                let v = r.uniform_vec(n * width, 2.0);
                (v.clone(), v)
            }
        };
        let (qs, q) = send(&mut r, qd, flags[0]);
        let (ks, k) = send(&mut r, kvd, flags[1]);
        let (vs, v) = send(&mut r, kvd, flags[2]);
        let out = job(
            &format!(
                "rope_kv {n} {qd} {kvd} {hd} {page_len} {chunks} {} {} {}",
                flags[0], flags[1], flags[2]
            ),
            &[
                &bytes(&qs),
                &bytes(&ks),
                &bytes(&vs),
                &bytes(cos),
                &bytes(sin),
                &bytes64(&pos),
                &bytes64(&slots),
            ],
        );
        let (gq, gk, pages, gv) = (
            floats(&out[0]),
            floats(&out[1]),
            floats(&out[2]),
            floats(&out[3]),
        );
        let pf = page_len * 2 * kvd;
        for (t, &p) in positions.iter().enumerate() {
            let mut cq = q[t * qd..(t + 1) * qd].to_vec();
            let mut ck = k[t * kvd..(t + 1) * kvd].to_vec();
            rope(&table, &mut cq, p);
            rope(&table, &mut ck, p);
            let cv = &v[t * kvd..(t + 1) * kvd];
            let what = format!("flags {flags:?}, position {p}");
            assert_eq!(differing(&cq, &gq[t * qd..(t + 1) * qd]), 0, "q, {what}");
            assert_eq!(differing(&ck, &gk[t * kvd..(t + 1) * kvd]), 0, "k, {what}");
            assert_eq!(differing(cv, &gv[t * kvd..(t + 1) * kvd]), 0, "v, {what}");
            let page = &pages[t * pf..(t + 1) * pf];
            assert_page_rows(page, p % page_len, page_len, &ck, cv, &what);
        }
    }
}

/// The inputs of a decode step of `positions.len()` sequences (one token
/// each, at `positions[t]`) for the `decode_rope` job: every sequence's
/// pages of one layer in one store (in reverse order of need), earlier
/// positions' rows random, the new position's rows NaN (a kernel that reads
/// them before writing them shows).
pub(crate) fn decode_rope_inputs(
    r: &mut SplitMix64,
    nh: usize,
    nkv: usize,
    hd: usize,
    page_len: usize,
    positions: &[usize],
) -> (String, Vec<Vec<u8>>) {
    let (qd, kvd, n) = (nh * hd, nkv * hd, positions.len());
    let pf = page_len * 2 * kvd;
    let counts: Vec<usize> = positions
        .iter()
        .map(|p| (p + 1).div_ceil(page_len))
        .collect();
    let total: usize = counts.iter().sum();
    let mut store = r.uniform_vec(total * pf, 2.0);
    let (mut index, mut seq_off, mut dst_page) = (Vec::new(), Vec::new(), Vec::new());
    let mut next = total;
    for (&p, &c) in positions.iter().zip(&counts) {
        seq_off.push(index.len() as u64);
        for _ in 0..c {
            next -= 1;
            index.push(next as u64);
        }
        let page = index[seq_off[seq_off.len() - 1] as usize + p / page_len] as usize;
        dst_page.push(page as u64);
        let s = p % page_len;
        for which in 0..2 {
            let at = page * pf + which * page_len * kvd + s * kvd;
            store[at..at + kvd].fill(f32::NAN);
        }
    }
    let max_pos = positions.iter().max().copied().unwrap_or(0);
    let table = RopeTable::new(hd, 10_000.0, max_pos + 1);
    let (cos, sin) = table.tables();
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let slot: Vec<u64> = positions.iter().map(|&p| (p % page_len) as u64).collect();
    let line = format!(
        "decode_rope {n} {nh} {nkv} {hd} {page_len} {}",
        (1.0 / (hd as f32).sqrt()).to_bits()
    );
    let arrays = vec![
        bytes(&r.uniform_vec(n * qd, 2.0)),
        bytes(&r.uniform_vec(n * kvd, 2.0)),
        bytes(&r.uniform_vec(n * kvd, 1.0)),
        bytes(cos),
        bytes(sin),
        bytes(&store),
        bytes64(&index),
        bytes64(&seq_off),
        bytes64(&pos),
        bytes64(&dst_page),
        bytes64(&slot),
    ];
    (line, arrays)
}

/// `attention_decode_rope_qs` (LMRR_CUDA_ROPE_ATTN: RoPE, the K/V page
/// writes and decode attention in one launch, q handed over in shared
/// memory) against `rope_kv` then `attention_decode`: the same attention output, rotated q, step K rows
/// (for the host) and pages, bit for bit; grouped and ungrouped heads, head
/// dims of one and two chunks, pages of 1, 7 and 16 positions, a new
/// position opening a page and one deep in a sequence.
#[test]
fn attention_decode_rope_qs_matches_rope_kv_then_attention_decode() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(31);
    let cases: &[(usize, usize, usize, usize, &[usize])] = &[
        (9, 3, 64, 16, &[0, 5, 63, 64, 200]),
        (4, 2, 128, 7, &[3, 40]),
        (2, 2, 64, 1, &[10]),
    ];
    for &(nh, nkv, hd, page_len, positions) in cases {
        let (line, arrays) = decode_rope_inputs(&mut r, nh, nkv, hd, page_len, positions);
        let refs: Vec<&[u8]> = arrays.iter().map(|a| a.as_slice()).collect();
        // The module as compiled by default, then with ATTN_EARLY (the
        // step's inputs loaded before the wait); each form against the
        // separate kernels of its own build.
        for (build_name, bin) in [("default", emulator()), ("ATTN_EARLY", emulator_early())] {
            let Some(bin) = bin else { return };
            let out = job_on(bin, &line, &refs);
            let what = format!(
                "{build_name}: {nh}/{nkv} heads × {hd}, pages of {page_len}, positions {positions:?}"
            );
            let separate = floats(&out[0]);
            assert!(
                separate.iter().all(|x| x.is_finite()),
                "{what}: rope_kv then attention_decode gave non-finite values"
            );
            assert_eq!(out.len(), 8, "{what}: the job's outputs");
            for (i, name) in ["attention output", "rotated q", "K rows", "pages"]
                .iter()
                .enumerate()
            {
                assert_eq!(
                    differing(&floats(&out[i]), &floats(&out[4 + i])),
                    0,
                    "{what}: {name}"
                );
            }
        }
    }
}

/// Slot `s` of one layer's page (`page_len` K rows, then `page_len` V rows)
/// holds the rows `k` and `v`, bit for bit.
fn assert_page_rows(page: &[f32], s: usize, page_len: usize, k: &[f32], v: &[f32], what: &str) {
    let kvd = k.len();
    assert_eq!(
        differing(k, &page[s * kvd..(s + 1) * kvd]),
        0,
        "K page row, {what}"
    );
    let vr = &page[(page_len + s) * kvd..(page_len + s + 1) * kvd];
    assert_eq!(differing(v, vr), 0, "V page row, {what}");
}
