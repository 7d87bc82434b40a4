//! The resident kernels of the step programs' op kinds (elementwise.cu's
//! `add_bias`, `scale_elems`, `geglu`, `repeat_rows`, `round_bf16`,
//! `stream_mean`; hyper.cu's `moe_combine_idx`, `kv_write_aux`), launched as
//! kernels/src/cuda/ops/program.rs launches them (one thread per element,
//! blocks of 128), against their CPU references bit for bit, on inputs that
//! reach their edge cases. Each `*_check` returns what it compared, so that
//! the negative controls (controls.rs) run the same checks on a mutated
//! source.

use std::path::PathBuf;

use crate::harness::*;
use lmrr_kernels::*;

/// What one program-op check found: each compared output's label and its
/// count of differing values (0 everywhere: the kernel gave the reference's
/// bits). The tests assert every count is 0; the controls, that some is not.
pub(crate) type Found = Vec<(String, usize)>;

fn assert_none_differ(found: &Found) {
    for (what, d) in found {
        assert_eq!(*d, 0, "{what}: {d} values differ from the reference");
    }
}

/// The engine's bf16 rounding (`f32_to_bf16` in engine/src/model/synth.rs,
/// widened back): nearest, ties to even, a NaN kept a NaN with its quiet
/// bit set. Written here from that rule (the upper half, plus one where the
/// lower half is past its midpoint or on it with the upper half odd), not
/// from the kernel's or the engine's expression.
fn round_bf16_ref(x: f32) -> f32 {
    let (hi, lo) = (x.to_bits() >> 16, x.to_bits() & 0xFFFF);
    let h = if x.is_nan() {
        hi | 0x40
    } else if lo > 0x8000 || (lo == 0x8000 && hi & 1 == 1) {
        hi + 1
    } else {
        hi
    };
    f32::from_bits(h << 16)
}

/// `geglu` (`out = gelu_tanh(g) · u`, the host's two constants) against
/// `lmrr_kernels::act::geglu` (the fast path), `geglu_ref` and the scalar
/// `gelu_tanh_scalar(g) · u`: random values of a wide range beside ±0,
/// subnormals, magnitudes where `a·x²` overflows or `det_exp` saturates
/// each way, and a length that is no multiple of a block or of a vector.
/// No infinite or NaN operand: a NaN's bits are the platform's (x86 and the
/// device differ), not the op's.
pub(crate) fn geglu_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(41);
    let n = 1000;
    let mut g = r.uniform_vec(n, 12.0);
    let mut u = r.uniform_vec(n, 3.0);
    let edges = [
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        1e-20,
        -1e-20,
        10.0,
        -10.0,
        20.0,
        -20.0,
        100.0,
        -100.0,
        1e4,
        -1e4,
        1e19,
        -1e19,
        1e20,
        -1e20,
        f32::MAX,
        -f32::MAX,
    ];
    g[..edges.len()].copy_from_slice(&edges);
    // The same edges again against a -0.0 and a large multiplier.
    g[100..100 + edges.len()].copy_from_slice(&edges);
    u[100..100 + edges.len()].fill(-0.0);
    g[200..200 + edges.len()].copy_from_slice(&edges);
    u[200..200 + edges.len()].fill(1e30);
    let line = format!(
        "geglu {} {}",
        act::GELU_A.to_bits(),
        act::GELU_NEG_2C.to_bits()
    );
    let dev = floats(&job_on(bin, &line, &[&bytes(&g), &bytes(&u)])[0]);
    let mut fast = vec![0.0; n];
    geglu(&g, &u, &mut fast);
    let mut slow = vec![0.0; n];
    geglu_ref(&g, &u, &mut slow);
    let scalar: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&a, &b)| gelu_tanh_scalar(a) * b)
        .collect();
    vec![
        ("geglu against act::geglu".into(), differing(&fast, &dev)),
        ("geglu against geglu_ref".into(), differing(&slow, &dev)),
        (
            "geglu against gelu_tanh_scalar · u".into(),
            differing(&scalar, &dev),
        ),
    ]
}

#[test]
fn geglu_matches_the_cpu() {
    let Some(bin) = emulator() else { return };
    assert_none_differ(&geglu_check(bin));
}

/// `round_bf16` (in place) against [`round_bf16_ref`]: ties with an even
/// and an odd upper half each sign, just above and below a tie, the
/// largest finite values (rounding to ±inf), ±inf, signalling and quiet
/// NaNs of either sign and payload, ±0, subnormals (ties and a carry into
/// the smallest normal), and random bit patterns.
pub(crate) fn round_bf16_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(42);
    let mut x: Vec<f32> = [
        0x3F80_8000u32,
        0x3F81_8000,
        0xBF80_8000,
        0xBF81_8000,
        0x3F80_8001,
        0x3F80_7FFF,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F7F_8000,
        0x7F7E_8000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0xFF80_0001,
        0x7FA0_1234,
        0x7FC0_0000,
        0xFFC0_0000,
        0x7FFF_FFFF,
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x0000_8000,
        0x0001_8000,
        0x0000_FFFF,
        0x8000_8001,
        0x007F_FFFF,
        0x807F_8000,
    ]
    .iter()
    .map(|&b| f(b))
    .collect();
    x.extend((0..3000).map(|_| f(r.next_u64() as u32)));
    let dev = floats(&job_on(bin, "round_bf16", &[&bytes(&x)])[0]);
    let want: Vec<f32> = x.iter().map(|&v| round_bf16_ref(v)).collect();
    vec![(
        format!("round_bf16 of {} values", x.len()),
        differing(&want, &dev),
    )]
}

#[test]
fn round_bf16_matches_the_engines_rule() {
    // The reference on values whose rounding is known by hand: a tie goes to
    // the even neighbour; past it, up; the largest finite value to inf; a
    // signalling NaN comes back quiet.
    for (from, to) in [
        (0x3F80_8000u32, 0x3F80_0000u32),
        (0x3F81_8000, 0x3F82_0000),
        (0x3F80_8001, 0x3F81_0000),
        (0x7F7F_FFFF, 0x7F80_0000),
        (0x7F80_0001, 0x7FC0_0000),
        (0x0000_FFFF, 0x0001_0000),
    ] {
        let got = round_bf16_ref(f(from)).to_bits();
        assert_eq!(got, to, "reference: {from:#010x} gave {got:#010x}");
    }
    let Some(bin) = emulator() else { return };
    assert_none_differ(&round_bf16_check(bin));
}

/// `stream_mean` against the sum of each token's streams in order from
/// +0.0, times `1/s`: one stream, three (1/3 not a power of two) and four;
/// widths past a block; magnitudes far apart (the order of the sum shows)
/// and columns of -0.0 in every stream (a sum from +0.0 gives +0.0, one
/// from the first stream would give -0.0).
pub(crate) fn stream_mean_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(43);
    let mut found = Vec::new();
    for &(n, s, d) in &[(3usize, 3usize, 150usize), (2, 1, 70), (5, 4, 129)] {
        let mut x = r.uniform_vec(n * s * d, 4.0);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 7 == 0 {
                *v *= 1e8;
            }
        }
        // Column 5 of every token: -0.0 in every stream.
        for t in 0..n {
            for j in 0..s {
                x[(t * s + j) * d + 5] = -0.0;
            }
        }
        let inv = 1.0 / s as f32;
        let out = job_on(
            bin,
            &format!("stream_mean {n} {s} {d} {}", inv.to_bits()),
            &[&bytes(&x)],
        );
        let mut want = vec![0.0f32; n * d];
        for t in 0..n {
            for c in 0..d {
                let mut acc = 0.0f32;
                for j in 0..s {
                    acc += x[(t * s + j) * d + c];
                }
                want[t * d + c] = acc * inv;
            }
        }
        found.push((
            format!("stream_mean of {n} tokens × {s} streams × {d}"),
            differing(&want, &floats(&out[0])),
        ));
    }
    found
}

#[test]
fn stream_mean_matches_a_sum_from_zero_then_the_inverse() {
    let Some(bin) = emulator() else { return };
    assert_none_differ(&stream_mean_check(bin));
}

/// `moe_combine_idx` against `lmrr_kernels::moe_combine` token by token:
/// expert outputs laid out by expert (rows of `ys`), each entry's row
/// picked by `idx` (out of order, one row read by two tokens), tokens of
/// zero to three entries; with a base (-0.0 in places: a token of no entry
/// keeps it) and without (null: the chain from +0.0).
pub(crate) fn moe_combine_idx_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(44);
    let (n, d, rows) = (6usize, 200usize, 7usize);
    let counts = [2usize, 0, 3, 1, 3, 2];
    let mut off = vec![0i32];
    for c in counts {
        off.push(off[off.len() - 1] + c as i32);
    }
    let entries = off[n] as usize;
    let idx: Vec<i32> = (0..entries).map(|e| ((e * 5 + 3) % rows) as i32).collect();
    let gates = r.uniform_vec(entries, 1.0);
    let ys = r.uniform_vec(rows * d, 3.0);
    let mut base = r.uniform_vec(n * d, 2.0);
    for v in base.iter_mut().step_by(3) {
        *v = -0.0;
    }
    let mut found = Vec::new();
    for with_base in [true, false] {
        let sent: &[f32] = if with_base { &base } else { &[] };
        let out = job_on(
            bin,
            &format!("moe_combine_idx {n} {d}"),
            &[
                &bytes(sent),
                &bytes(&gates),
                &bytes(&ys),
                &ints(&idx),
                &ints(&off),
            ],
        );
        let mut want = vec![0.0f32; n * d];
        for t in 0..n {
            let (e0, e1) = (off[t] as usize, off[t + 1] as usize);
            let rows_of: Vec<&[f32]> = idx[e0..e1]
                .iter()
                .map(|&i| &ys[i as usize * d..(i as usize + 1) * d])
                .collect();
            let b = if with_base {
                base[t * d..(t + 1) * d].to_vec()
            } else {
                vec![0.0; d]
            };
            moe_combine(&b, &gates[e0..e1], &rows_of, &mut want[t * d..(t + 1) * d]);
        }
        found.push((
            format!("moe_combine_idx, base {with_base}"),
            differing(&want, &floats(&out[0])),
        ));
    }
    found
}

#[test]
fn moe_combine_idx_matches_moe_combine() {
    let Some(bin) = emulator() else { return };
    assert_none_differ(&moe_combine_idx_check(bin));
}

/// `kv_write_aux`: each token's indexer row lands at page + layer ·
/// page_len · (2·kvd + aux) + 2 · page_len · kvd + slot · aux floats (the
/// layout of `kv_row`), bit for bit (NaN payloads and -0.0 among them), and
/// no other float of the store changes; the first, a middle and the last
/// layer, first and last slots, pages out of order, an aux width other than
/// kvd.
pub(crate) fn kv_write_aux_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(45);
    let (layers, page_len, kvd, pages) = (3usize, 4usize, 8usize, 3usize);
    let mut found = Vec::new();
    for &(layer, aux) in &[(0usize, 5usize), (1, 37), (2, 16)] {
        let pf = layers * page_len * (2 * kvd + aux);
        let store = r.uniform_vec(pages * pf, 2.0);
        let page: Vec<u64> = vec![2, 0, 1, 2, 0];
        let slot: Vec<u64> = vec![0, 3, 1, 3, 2];
        let n = page.len();
        let mut ik = r.uniform_vec(n * aux, 1.0);
        ik[0] = -0.0;
        ik[1] = f(0x7FA0_0001);
        ik[2] = f(0xFFC1_2345);
        let out = job_on(
            bin,
            &format!("kv_write_aux {n} {layers} {layer} {page_len} {kvd} {aux}"),
            &[
                &bytes(&ik),
                &bytes(&store),
                &bytes64(&page),
                &bytes64(&slot),
            ],
        );
        let mut want = store.clone();
        for t in 0..n {
            let at = page[t] as usize * pf
                + layer * page_len * (2 * kvd + aux)
                + 2 * page_len * kvd
                + slot[t] as usize * aux;
            want[at..at + aux].copy_from_slice(&ik[t * aux..(t + 1) * aux]);
        }
        found.push((
            format!("kv_write_aux layer {layer}, aux {aux}: the whole store"),
            differing(&want, &floats(&out[0])),
        ));
    }
    found
}

#[test]
fn kv_write_aux_writes_the_aux_rows_and_nothing_else() {
    let Some(bin) = emulator() else { return };
    assert_none_differ(&kv_write_aux_check(bin));
}

/// `add_bias` against plain IEEE adds `y[i] + b[i % cols]`, `scale_elems`
/// against `x[i] · by`, and `repeat_rows` against copies of each row: sums
/// that overflow to ±inf, -0.0 + -0.0 and -0.0 + +0.0, subnormals, a
/// multiplier that is not a power of two; the repeats of NaN payloads and
/// -0.0 copied bit for bit. Lengths past a block, not a multiple of it.
pub(crate) fn add_scale_repeat_check(bin: &PathBuf) -> Found {
    let mut r = SplitMix64(46);
    let (rows, cols) = (7usize, 150usize);
    let mut y = r.uniform_vec(rows * cols, 10.0);
    let mut b = r.uniform_vec(cols, 1.0);
    y[..6].copy_from_slice(&[f32::MAX, -f32::MAX, -0.0, -0.0, f(1), f32::INFINITY]);
    b[..6].copy_from_slice(&[f32::MAX, -f32::MAX, -0.0, 0.0, f(0x8000_0003), 1.0]);
    let out = job_on(bin, &format!("add_bias {cols}"), &[&bytes(&y), &bytes(&b)]);
    let want: Vec<f32> = y
        .iter()
        .enumerate()
        .map(|(i, &v)| v + b[i % cols])
        .collect();
    let mut found = vec![(
        format!("add_bias {rows}×{cols}"),
        differing(&want, &floats(&out[0])),
    )];
    let mut x = r.uniform_vec(1000, 5.0);
    x[..5].copy_from_slice(&[f32::MAX, -0.0, f(1), f(0x0040_0001), -1e-38]);
    for by in [1.0 / 3.0f32, 0.125, -7.0] {
        let out = job_on(bin, &format!("scale {}", by.to_bits()), &[&bytes(&x)]);
        let want: Vec<f32> = x.iter().map(|&v| v * by).collect();
        found.push((
            format!("scale_elems by {by}"),
            differing(&want, &floats(&out[0])),
        ));
    }
    for &(n, d, w) in &[(3usize, 50usize, 200usize), (2, 7, 7), (1, 64, 256)] {
        let mut x = r.uniform_vec(n * d, 1.0);
        x[0] = f(0x7F80_0002);
        x[1] = -0.0;
        let out = job_on(bin, &format!("repeat_rows {n} {d} {w}"), &[&bytes(&x)]);
        let want: Vec<f32> = (0..n * w).map(|i| x[i / w * d + i % w % d]).collect();
        found.push((
            format!("repeat_rows {n} rows of {d} to {w}"),
            differing(&want, &floats(&out[0])),
        ));
    }
    found
}

#[test]
fn add_bias_scale_and_repeat_rows_match_the_plain_ops() {
    let Some(bin) = emulator() else { return };
    assert_none_differ(&add_scale_repeat_check(bin));
}
