//! Sliding-window attention on the emulation: every attention kernel (the
//! one-thread `attention`; `attention_paged`, `attention_decode`,
//! `attention_prefill`, `attention_prefill_hd64` and `_hd128`; the split
//! decode (`attention_split_*`); `attention_decode_rope_qs`
//! with its RoPE and page writes, as compiled by default and with
//! `ATTN_EARLY`) against the CPU's `attention_window`, bit for bit. Windows
//! cut the first tile mid-tile, start it on a tile boundary, are one tile,
//! one position, exactly the context and wider than it; one decode token
//! and a prefill's tokens at many positions of one sequence (groups whose
//! windows start in different tiles); GQA and MHA; contexts past a
//! super-chunk. The negative controls mutate the source (a first key one
//! position late; tiles counted from the first key instead of from
//! absolute position 0) and the same check must see each in every kernel.

use std::path::PathBuf;

use crate::attention::decode_rope_inputs;
use crate::harness::*;
use lmrr_kernels::*;

/// One sequence's tokens at `positions` (heads `nh`/`nkv` × `hd`, pages of
/// `page_len`), each run under every window of `windows`.
struct Case {
    nh: usize,
    nkv: usize,
    hd: usize,
    positions: Vec<usize>,
    page_len: usize,
    windows: &'static [usize],
}

fn paged_cases() -> Vec<Case> {
    let case = |nh, nkv, hd, positions: Vec<usize>, page_len, windows| Case {
        nh,
        nkv,
        hd,
        positions,
        page_len,
        windows,
    };
    // A prefill's tokens: two runs and two strays (one far ahead, one far
    // behind), so that a group of 16 holds tokens whose windows start in
    // different tiles, and tiles no token of a group reads.
    let prefill: Vec<usize> = (0..40).chain(60..84).chain([200, 7]).collect();
    vec![
        // One decode token at 100: the first key 81 (mid-tile), 64 (a tile
        // boundary), 69 (a window of one tile), 100 (one position), 0
        // (exactly the context), and a window wider than the context.
        case(4, 2, 64, vec![100], 16, &[20, 37, 32, 1, 101, 500]),
        case(9, 3, 64, vec![40], 7, &[9, 8, 1, 64]),
        case(3, 3, 80, vec![95], 7, &[10, 64]),
        case(3, 1, 64, prefill.clone(), 16, &[20, 32, 17, 1, 1000]),
        // head_dim 128 (attention_prefill_hd128; 80 above is the run-time
        // form's): a few tokens, and the prefill's groups.
        case(2, 1, 128, vec![3, 90, 91, 92, 200], 32, &[50, 1, 96]),
        case(4, 2, 128, prefill, 16, &[20, 17]),
        // Past a super-chunk (2,048 positions at head_dim 64, 512 at 256):
        // the window's first tile in the first super-chunk or in the last.
        case(2, 2, 64, vec![2100], 32, &[100, 2080, 2048]),
        case(2, 1, 256, vec![1100], 64, &[700, 33]),
    ]
}

/// The paged kernels by the runner's code, and which head dims each holds.
const PAGED: [(&str, u32); 7] = [
    ("attention", 6),
    ("attention_paged", 0),
    ("attention_decode", 1),
    ("attention_prefill", 2),
    ("attention_prefill_hd64 or _hd128", 3),
    ("attention_prefill_hd64 or _hd128, groups reversed", 5),
    ("attention_split_*", 7),
];

fn holds(code: u32, hd: usize) -> bool {
    match code {
        2 => hd <= 128,
        3 | 5 => hd == 64 || hd == 128,
        _ => true,
    }
}

/// Decode steps for `attention_decode_rope_qs`: (heads, kv heads,
/// head_dim, page_len, one token per sequence at these positions, windows).
type RopeCase = (
    usize,
    usize,
    usize,
    usize,
    &'static [usize],
    &'static [usize],
);
const ROPE_CASES: [RopeCase; 2] = [
    (9, 3, 64, 16, &[5, 64, 100, 300], &[20, 32, 37, 1, 1000]),
    (4, 2, 128, 7, &[3, 40], &[10, 1]),
];

/// The differing values of every windowed case, per kernel, on `bin` (the
/// default build, or a control's) and `early` (its `ATTN_EARLY` build).
fn window_check(bin: &PathBuf, early: &PathBuf) -> Vec<(String, usize)> {
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(77);
    let mut tally: Vec<(String, usize)> = Vec::new();
    let mut add = |name: &str, d: usize| match tally.iter_mut().find(|(n, _)| n == name) {
        Some((_, t)) => *t += d,
        None => tally.push((name.to_string(), d)),
    };
    for c in paged_cases() {
        let shape = AttnShape {
            n_heads: c.nh,
            n_kv_heads: c.nkv,
            head_dim: c.hd,
        };
        let kvd = shape.kv_dim();
        let cap = c.positions.iter().max().copied().unwrap_or(0) + 1;
        let pages = cap.div_ceil(c.page_len);
        let k = r.uniform_vec(pages * c.page_len * kvd, 3.0);
        let v = r.uniform_vec(pages * c.page_len * kvd, 1.0);
        let view = KvView {
            block_len: c.page_len,
            k: k.chunks(c.page_len * kvd).collect(),
            v: v.chunks(c.page_len * kvd).collect(),
        };
        // The sequence's pages stored in reverse order (the table decides).
        let pf = c.page_len * 2 * kvd;
        let mut store = vec![0.0f32; pages * pf];
        for b in 0..pages {
            let at = (pages - 1 - b) * pf;
            store[at..at + c.page_len * kvd].copy_from_slice(view.k[b]);
            store[at + c.page_len * kvd..at + pf].copy_from_slice(view.v[b]);
        }
        let index: Vec<u64> = (0..pages).map(|b| (pages - 1 - b) as u64).collect();
        let qs: Vec<Vec<f32>> = c
            .positions
            .iter()
            .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
            .collect();
        let tasks: Vec<AttnTask> = c
            .positions
            .iter()
            .zip(&qs)
            .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
            .collect();
        let q = qs.concat();
        let seq_off = vec![0u64; tasks.len()];
        let pos: Vec<u64> = c.positions.iter().map(|&p| p as u64).collect();
        let scale = 1.0 / (c.hd as f32).sqrt();
        for &w in c.windows {
            let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
            attention_window(&th, &tasks, &shape, scale, Some(w), &mut cpu);
            for (name, code) in PAGED {
                if !holds(code, c.hd) {
                    continue;
                }
                let line = format!(
                    "attention {} {} {} {} {} {} {code} {w}",
                    tasks.len(),
                    c.nh,
                    c.nkv,
                    c.hd,
                    c.page_len,
                    scale.to_bits()
                );
                let out = job_on(
                    bin,
                    &line,
                    &[
                        &bytes(&q),
                        &bytes(&store),
                        &bytes64(&index),
                        &bytes64(&seq_off),
                        &bytes64(&pos),
                    ],
                );
                add(name, differing(&cpu, &floats(&out[0])));
            }
        }
    }
    for (nh, nkv, hd, page_len, positions, windows) in ROPE_CASES {
        let (line, arrays) = decode_rope_inputs(&mut r, nh, nkv, hd, page_len, positions);
        let refs: Vec<&[u8]> = arrays.iter().map(|a| a.as_slice()).collect();
        for &w in windows {
            let cpu = decode_rope_cpu(&th, &arrays, (nh, nkv, hd, page_len), positions, w);
            for (build_name, b) in [("", bin), (", ATTN_EARLY", early)] {
                let out = job_on(b, &format!("{line} {w}"), &refs);
                add(
                    &format!("attention_decode after rope_kv{build_name}"),
                    differing(&cpu, &floats(&out[0])),
                );
                add(
                    &format!("attention_decode_rope_qs{build_name}"),
                    differing(&cpu, &floats(&out[4])),
                );
            }
        }
    }
    tally
}

/// The CPU's answer to a `decode_rope` job of [`decode_rope_inputs`]'s
/// arrays under `window`: each token's q and k rotated by the CPU's RoPE,
/// its k and v rows written into its page slot, then `attention_window`
/// over its pages.
fn decode_rope_cpu(
    th: &Threads,
    arrays: &[Vec<u8>],
    (nh, nkv, hd, page_len): (usize, usize, usize, usize),
    positions: &[usize],
    window: usize,
) -> Vec<f32> {
    let u64s = |b: &[u8]| -> Vec<usize> {
        b.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect()
    };
    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
    let (mut q, k, v) = (floats(&arrays[0]), floats(&arrays[1]), floats(&arrays[2]));
    let mut store = floats(&arrays[5]);
    let (index, seq_off, dst_page) = (u64s(&arrays[6]), u64s(&arrays[7]), u64s(&arrays[9]));
    let max_pos = positions.iter().max().copied().unwrap_or(0);
    let table = RopeTable::new(hd, 10_000.0, max_pos + 1);
    let pf = page_len * 2 * kvd;
    for (t, &p) in positions.iter().enumerate() {
        rope(&table, &mut q[t * qd..(t + 1) * qd], p);
        let mut kr = k[t * kvd..(t + 1) * kvd].to_vec();
        rope(&table, &mut kr, p);
        let (page, s) = (dst_page[t] * pf, p % page_len);
        store[page + s * kvd..page + (s + 1) * kvd].copy_from_slice(&kr);
        let vat = page + (page_len + s) * kvd;
        store[vat..vat + kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
    }
    let views: Vec<KvView> = positions
        .iter()
        .enumerate()
        .map(|(t, &p)| {
            let list = &index[seq_off[t]..seq_off[t] + (p + 1).div_ceil(page_len)];
            KvView {
                block_len: page_len,
                k: list
                    .iter()
                    .map(|&b| &store[b * pf..b * pf + page_len * kvd])
                    .collect(),
                v: list
                    .iter()
                    .map(|&b| &store[b * pf + page_len * kvd..(b + 1) * pf])
                    .collect(),
            }
        })
        .collect();
    let tasks: Vec<AttnTask> = positions
        .iter()
        .enumerate()
        .map(|(t, &pos)| AttnTask {
            q: &q[t * qd..(t + 1) * qd],
            kv: &views[t],
            pos,
        })
        .collect();
    let mut out = vec![0.0; positions.len() * qd];
    let scale = 1.0 / (hd as f32).sqrt();
    attention_window(th, &tasks, &shape, scale, Some(window), &mut out);
    out
}

/// The kernels every windowed check covers (the tally's names).
const KERNELS: [&str; 11] = [
    "attention",
    "attention_paged",
    "attention_decode",
    "attention_prefill",
    "attention_prefill_hd64 or _hd128",
    "attention_prefill_hd64 or _hd128, groups reversed",
    "attention_split_*",
    "attention_decode after rope_kv",
    "attention_decode_rope_qs",
    "attention_decode after rope_kv, ATTN_EARLY",
    "attention_decode_rope_qs, ATTN_EARLY",
];

#[test]
fn windowed_attention_matches_the_cpu_in_every_kernel() {
    let (Some(bin), Some(early)) = (emulator(), emulator_early()) else {
        return;
    };
    let tally = window_check(bin, early);
    let names: Vec<&str> = tally.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, KERNELS, "the kernels the check ran");
    for (name, d) in &tally {
        assert_eq!(*d, 0, "{name}: values differing from attention_window");
    }
}

/// The check above can fail: each mutation breaks the window (the first
/// key, where the tiles start, or which pages `ATTN_EARLY` loads before the
/// wait), and the part of the check of every kernel it breaks (all of them
/// unless named), run on the mutated source's emulation, must find
/// differing values.
#[test]
fn the_window_check_sees_a_wrong_first_key_or_tile() {
    if emulator().is_none() {
        return;
    }
    type Mutation<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str]);
    let mutations: &[Mutation] = &[
        (
            "the first key one position late",
            &[(
                "return window > 0 ? max(0, pos + 1 - window) : 0;",
                "return window > 0 ? max(0, pos + 2 - window) : 0;",
            )],
            &KERNELS,
        ),
        (
            "tiles counted from the first key, not from position 0",
            &[
                // attention_paged, attention_decode, attention_decode_rope_qs
                // (its body, and its first batch's pages under ATTN_EARLY).
                ("base0 = lo / ATTN_TILE * ATTN_TILE;", "base0 = lo;"),
                // attention_prefill and its hd64 and hd128 forms.
                (
                    "begin = begin / ATTN_TILE * ATTN_TILE;",
                    "begin = begin + 0;",
                ),
                // attention (the one-thread kernel).
                (
                    "j1 = min((j0 / ATTN_TILE + 1) * ATTN_TILE, p_end + 1);",
                    "j1 = min(j0 + ATTN_TILE, p_end + 1);",
                ),
            ],
            &KERNELS,
        ),
        (
            "ATTN_EARLY: the first batch's pages counted from the first key",
            &[(
                "pages[in.so + j / page_len] : 0ull;",
                "pages[in.so + (j - lo) / page_len] : 0ull;",
            )],
            &["attention_decode_rope_qs, ATTN_EARLY"],
        ),
    ];
    let source = cuda_source::SOURCE;
    for (i, &(label, edits, broken)) in mutations.iter().enumerate() {
        let mut bad = source.to_string();
        for &(from, to) in edits {
            assert!(
                bad.contains(from),
                "control `{label}`: `{from}` is not in the CUDA source"
            );
            bad = bad.replace(from, to);
        }
        let bin = build(&format!("window_control_{i}"), &bad, false);
        let early_src = format!(
            "#define ATTN_EARLY 1\n{}",
            cuda_source::prefetch_source(&bad)
        );
        let early = build(&format!("window_control_{i}_early"), &early_src, false);
        let tally = window_check(&bin, &early);
        for (name, d) in tally.iter().filter(|(n, _)| broken.contains(&n.as_str())) {
            println!("negative control `{label}`: {name}: {d} differing values");
            assert!(
                *d > 0,
                "control `{label}`: {name} gives attention_window's bits anyway"
            );
        }
        assert_eq!(tally.len(), KERNELS.len(), "control `{label}`: kernels run");
    }
}
