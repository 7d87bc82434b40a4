//! Fast path ≡ scalar reference, bit for bit, on awkward sizes and 1, 2, 3 threads.
//!
//! Inputs come from a seeded generator so failures reproduce. Sizes are chosen
//! around the chunk (64) and lane (8) boundaries, never only at multiples.

use lmrr_kernels::*;

const SIZES: &[usize] = &[
    0, 1, 3, 7, 8, 9, 15, 63, 64, 65, 71, 127, 129, 200, 577, 1000,
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn pools() -> Vec<Threads> {
    (1..=3).map(|n| Threads::new(n).unwrap()).collect()
}

#[test]
fn simd_is_active_on_this_machine_or_says_why() {
    // The comparisons below are only meaningful if the fast path really runs.
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert_eq!(isa(), Isa::Avx2Fma);
        return;
    }
    eprintln!("no AVX2+FMA here: fast paths fall back to scalar");
}

#[test]
fn dot_and_sum_match_reference() {
    let mut r = SplitMix64(1);
    for &n in SIZES {
        for scale in [1.0f32, 1e-3, 1e4] {
            let a = r.uniform_vec(n, scale);
            let b = r.uniform_vec(n, 1.0);
            assert_eq!(
                dot(&a, &b).to_bits(),
                dot_ref(&a, &b).to_bits(),
                "dot n={n}"
            );
            assert_eq!(sum(&a).to_bits(), sum_ref(&a).to_bits(), "sum n={n}");
        }
    }
}

#[test]
fn dot_ref_follows_the_documented_order() {
    // Restate the order independently: 8 lanes per 64-chunk, tree, chunks in order.
    let mut r = SplitMix64(2);
    for &n in &[1usize, 9, 64, 65, 130, 300] {
        let a = r.uniform_vec(n, 100.0);
        let b = r.uniform_vec(n, 100.0);
        let mut total = 0.0f32;
        let mut c = 0;
        while c < n {
            let mut l = [0.0f32; 8];
            for i in c..(c + 64).min(n) {
                let lane = (i - c) % 8;
                l[lane] = a[i].mul_add(b[i], l[lane]);
            }
            let partial = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
            total += partial;
            c += 64;
        }
        assert_eq!(dot_ref(&a, &b).to_bits(), total.to_bits(), "n={n}");
    }
}

#[test]
fn chunk_order_is_observable() {
    // A sum whose value depends on association: a naive left-to-right sum differs,
    // proving the test above pins an order and not just "some" order.
    let mut v = vec![1.0f32; 130];
    v[0] = 1e8;
    v[64] = -1e8;
    let naive: f32 = v.iter().sum();
    assert_ne!(naive.to_bits(), sum_ref(&v).to_bits());
}

fn bf16_round(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

#[test]
fn matmul_matches_reference_for_f32_and_bf16_and_threads() {
    let mut r = SplitMix64(3);
    for &(rows, cols) in &[(1usize, 5usize), (7, 63), (13, 65), (33, 130), (40, 9)] {
        for &n in &[1usize, 2, 3, 4, 5, 9, 70] {
            let x = r.uniform_vec(n * cols, 2.0);
            let wf = r.uniform_vec(rows * cols, 0.5);
            let wb: Vec<u16> = wf.iter().map(|&v| bf16_round(v)).collect();
            for w in [Weights::F32(&wf), Weights::Bf16(&wb)] {
                let m = Matrix::new(w, rows, cols).unwrap();
                let mut want = vec![0.0; n * rows];
                matmul_ref(&x, n, &m, &mut want);
                for th in pools() {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul(&th, &x, n, &m, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "rows={rows} cols={cols} n={n} threads={}",
                        th.count()
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_of_one_token_equals_its_row_in_a_batch() {
    // Batch invariance at the kernel level: token t's outputs do not depend on n.
    let mut r = SplitMix64(4);
    let (rows, cols) = (29, 100);
    let w = r.uniform_vec(rows * cols, 0.5);
    let m = Matrix::new(Weights::F32(&w), rows, cols).unwrap();
    let x = r.uniform_vec(11 * cols, 1.0);
    let th = Threads::new(2).unwrap();
    let mut all = vec![0.0; 11 * rows];
    matmul(&th, &x, 11, &m, &mut all);
    for t in 0..11 {
        let mut one = vec![0.0; rows];
        matmul(&th, &x[t * cols..(t + 1) * cols], 1, &m, &mut one);
        assert_eq!(
            bits(&one),
            bits(&all[t * rows..(t + 1) * rows]),
            "token {t}"
        );
    }
}

#[test]
fn exp_matches_reference_and_is_accurate() {
    let mut r = SplitMix64(5);
    let mut x = r.uniform_vec(10_001, 90.0);
    x.extend([
        0.0,
        -0.0,
        88.0,
        88.000_01,
        -87.0,
        -87.000_01,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-30,
    ]);
    let mut want = vec![0.0; x.len()];
    let mut got = vec![0.0; x.len()];
    exp_slice_ref(&x, &mut want);
    exp_slice(&x, &mut got);
    assert_eq!(bits(&got), bits(&want));
    // Accuracy within the domain: a few ulp of the f64 exp.
    for &v in &x {
        if (EXP_DOMAIN.0..=EXP_DOMAIN.1).contains(&v) {
            let e = det_exp(v) as f64;
            let t = (v as f64).exp();
            assert!(
                ((e - t) / t).abs() < 4.0 * f32::EPSILON as f64,
                "exp({v}) = {e}, want {t}"
            );
        }
    }
    assert_eq!(det_exp(0.0), 1.0);
    assert_eq!(det_exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(det_exp(89.0), f32::INFINITY);
    assert!(det_exp(f32::NAN).is_nan());
}
const EXP_DOMAIN: (f32, f32) = (lmrr_kernels::exp::EXP_LO, lmrr_kernels::exp::EXP_HI);

#[test]
fn silu_swiglu_match_reference() {
    let mut r = SplitMix64(6);
    for &n in SIZES {
        let g = r.uniform_vec(n, 20.0);
        let u = r.uniform_vec(n, 3.0);
        let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
        silu_ref(&g, &mut a);
        silu(&g, &mut b);
        assert_eq!(bits(&a), bits(&b), "silu n={n}");
        swiglu_ref(&g, &u, &mut a);
        swiglu(&g, &u, &mut b);
        assert_eq!(bits(&a), bits(&b), "swiglu n={n}");
    }
}

#[test]
fn rms_norm_matches_reference() {
    let mut r = SplitMix64(7);
    for &d in &[1usize, 7, 65, 129, 576] {
        for rows in [1usize, 3] {
            let x = r.uniform_vec(rows * d, 4.0);
            let w = r.uniform_vec(d, 1.5);
            let (mut a, mut b) = (vec![0.0; rows * d], vec![0.0; rows * d]);
            rms_norm_ref(&x, &w, 1e-5, &mut a);
            rms_norm(&x, &w, 1e-5, &mut b);
            assert_eq!(bits(&a), bits(&b), "d={d}");
        }
    }
}

#[test]
fn rope_matches_reference() {
    let mut r = SplitMix64(8);
    for &hd in &[2usize, 6, 10, 18, 64, 66] {
        let table = RopeTable::new(hd, 10_000.0, 300);
        for pos in [0usize, 1, 17, 299] {
            let x = r.uniform_vec(3 * hd, 2.0);
            let (mut a, mut b) = (x.clone(), x.clone());
            rope_ref(&table, &mut a, pos);
            rope(&table, &mut b, pos);
            assert_eq!(bits(&a), bits(&b), "hd={hd} pos={pos}");
        }
    }
}

#[test]
fn rope_at_position_zero_is_identity() {
    let table = RopeTable::new(8, 10_000.0, 4);
    let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.37 - 2.0).collect();
    let mut y = x.clone();
    rope(&table, &mut y, 0);
    assert_eq!(bits(&x), bits(&y));
}

#[test]
fn softmax_matches_reference_and_sums_to_one() {
    let mut r = SplitMix64(9);
    for &n in &[1usize, 7, 65, 1000, 4099] {
        let x = r.uniform_vec(n, 30.0);
        let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
        softmax_ref(&x, &mut a);
        softmax(&x, &mut b);
        assert_eq!(bits(&a), bits(&b), "n={n}");
        let s: f64 = a.iter().map(|&v| v as f64).sum();
        assert!((s - 1.0).abs() < 1e-4, "sum {s}");
    }
}

#[test]
fn argmax_ties_go_to_lowest_index_and_nan_never_wins() {
    let mut r = SplitMix64(10);
    for &n in SIZES {
        let x = r.uniform_vec(n, 1.0);
        assert_eq!(argmax(&x), argmax_ref(&x), "n={n}");
    }
    let mut x = vec![0.5f32; 21];
    x[3] = 2.0;
    x[17] = 2.0;
    x[1] = f32::NAN;
    assert_eq!(argmax(&x), Some(3));
    assert_eq!(argmax_ref(&x), Some(3));
    assert_eq!(argmax(&[f32::NAN; 9]), None);
    assert_eq!(argmax_ref(&[f32::NAN; 9]), None);
    assert_eq!(argmax(&[]), None);
    assert_eq!(argmax(&[f32::NEG_INFINITY; 10]), Some(0));
}

/// Builds KV storage for `len` positions cut into blocks of `block_len`.
fn blocks(data: &[f32], kv_dim: usize, block_len: usize) -> Vec<Vec<f32>> {
    data.chunks(block_len * kv_dim)
        .map(|c| {
            let mut b = c.to_vec();
            b.resize(block_len * kv_dim, f32::NAN); // unused tail must never be read
            b
        })
        .collect()
}

#[test]
fn attention_matches_reference_across_layouts_and_threads() {
    let mut r = SplitMix64(11);
    for &(nh, nkv, hd) in &[
        (6usize, 2usize, 10usize),
        (4, 4, 64),
        (9, 3, 66),
        (2, 1, 7),
        (4, 2, 152),
    ] {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let len = 100;
        let k = r.uniform_vec(len * shape.kv_dim(), 1.5);
        let v = r.uniform_vec(len * shape.kv_dim(), 1.0);
        let positions = [0usize, 1, 31, 32, 33, 64, 99];
        let qs: Vec<Vec<f32>> = positions
            .iter()
            .map(|_| r.uniform_vec(shape.q_dim(), 1.0))
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want: Option<Vec<u32>> = None;
        for block_len in [1usize, 5, 16, 100] {
            let kb = blocks(&k, shape.kv_dim(), block_len);
            let vb = blocks(&v, shape.kv_dim(), block_len);
            let view = KvView {
                block_len,
                k: kb.iter().map(|b| b.as_slice()).collect(),
                v: vb.iter().map(|b| b.as_slice()).collect(),
            };
            let tasks: Vec<AttnTask> = positions
                .iter()
                .zip(&qs)
                .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
                .collect();
            let mut refo = vec![0.0; tasks.len() * shape.q_dim()];
            attention_ref(&tasks, &shape, scale, &mut refo);
            let want = want.get_or_insert_with(|| bits(&refo));
            assert_eq!(
                &bits(&refo),
                want,
                "layout changed the reference (block {block_len})"
            );
            for th in pools() {
                let mut got = vec![0.0; refo.len()];
                attention(&th, &tasks, &shape, scale, &mut got);
                assert_eq!(
                    &bits(&got),
                    want,
                    "shape {shape:?} block {block_len} threads {}",
                    th.count()
                );
            }
        }
    }
}

/// A lone decode token whose K/V heads are fewer than the threads: the
/// heads of a group are cut into parts, one a thread, and every cut gives
/// the reference's bits (1 K/V head of 7 query heads over 1–8 threads).
#[test]
fn attention_of_one_token_cut_into_head_parts_matches_reference() {
    let mut r = SplitMix64(12);
    for &(nh, nkv, hd) in &[(7usize, 1usize, 16usize), (8, 2, 64), (4, 1, 9)] {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let len = 70;
        let k = r.uniform_vec(len * shape.kv_dim(), 1.5);
        let v = r.uniform_vec(len * shape.kv_dim(), 1.0);
        let (kb, vb) = (
            blocks(&k, shape.kv_dim(), 16),
            blocks(&v, shape.kv_dim(), 16),
        );
        let view = KvView {
            block_len: 16,
            k: kb.iter().map(|b| b.as_slice()).collect(),
            v: vb.iter().map(|b| b.as_slice()).collect(),
        };
        let q = r.uniform_vec(shape.q_dim(), 1.0);
        let tasks = [AttnTask {
            q: &q,
            kv: &view,
            pos: len - 1,
        }];
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want = vec![0.0; shape.q_dim()];
        attention_ref(&tasks, &shape, scale, &mut want);
        for n in 1..=8 {
            let th = Threads::new(n).unwrap();
            let mut got = vec![f32::NAN; want.len()];
            attention(&th, &tasks, &shape, scale, &mut got);
            assert_eq!(bits(&got), bits(&want), "shape {shape:?}, {n} threads");
        }
    }
}

#[test]
fn attention_over_one_key_returns_its_value() {
    // Softmax over a single key is exactly 1: out == v (independent expectation).
    let shape = AttnShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 9,
    };
    let k: Vec<f32> = (0..9).map(|i| i as f32).collect();
    let v: Vec<f32> = (0..9).map(|i| 0.25 * i as f32 - 1.0).collect();
    let view = KvView {
        block_len: 1,
        k: vec![&k],
        v: vec![&v],
    };
    let q = vec![0.3f32; 18];
    let tasks = [AttnTask {
        q: &q,
        kv: &view,
        pos: 0,
    }];
    let mut out = vec![0.0; 18];
    attention(&Threads::single(), &tasks, &shape, 0.1, &mut out);
    assert_eq!(bits(&out[..9]), bits(&v));
    assert_eq!(bits(&out[9..]), bits(&v));
}

#[test]
fn attention_variant_with_one_split_and_det_exp_is_the_reference() {
    use lmrr_kernels::attention_variants::{attention_variant, fast_exp, ExpKind};
    let mut r = SplitMix64(12);
    let shape = AttnShape {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 10,
    };
    let len = 90;
    let k = r.uniform_vec(len * shape.kv_dim(), 1.5);
    let v = r.uniform_vec(len * shape.kv_dim(), 1.0);
    let view = KvView {
        block_len: len,
        k: vec![&k],
        v: vec![&v],
    };
    let qs: Vec<Vec<f32>> = (0..3).map(|_| r.uniform_vec(shape.q_dim(), 1.0)).collect();
    let tasks: Vec<AttnTask> = [0usize, 40, 89]
        .iter()
        .zip(&qs)
        .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
        .collect();
    let mut want = vec![0.0; 3 * shape.q_dim()];
    attention_ref(&tasks, &shape, 0.3, &mut want);
    let th = Threads::new(2).unwrap();
    let mut got = vec![0.0; want.len()];
    attention_variant(&th, &tasks, &[1, 1, 1], &shape, 0.3, ExpKind::Det, &mut got);
    assert_eq!(bits(&got), bits(&want));
    // Splits and the fast exp change bits (that is what the patches are for) but
    // stay close.
    for (splits, exp) in [([3usize, 3, 3], ExpKind::Det), ([1, 1, 1], ExpKind::Fast)] {
        attention_variant(&th, &tasks, &splits, &shape, 0.3, exp, &mut got);
        assert_ne!(bits(&got), bits(&want), "{splits:?} {exp:?}");
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-2));
    }
    assert!((fast_exp(1.0) - std::f32::consts::E).abs() < 2e-3);
}
