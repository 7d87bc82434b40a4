//! The resident kernels of the program ops beyond llama's (the resident
//! executor's biases, scaling, GeGLU, stream repeats and means, bf16
//! rounding, and the MoE combine over expert rows laid out by expert), each
//! launched on device buffers as the executor launches it and held to its
//! CPU form bit for bit.

use lmrr_kernels::cuda::Gpu;
use lmrr_kernels::*;

use crate::report::Report;
use crate::util::*;

/// Uploads `v` (one float at least: a zero-byte buffer is an error).
fn up(gpu: &Gpu, v: &[f32]) -> lmrr_kernels::cuda::resident::DevBuf {
    let v: &[f32] = if v.is_empty() { &[0.0] } else { v };
    gpu.upload(v, "gpu_check operand").expect("upload")
}

fn down(gpu: &Gpu, addr: u64, n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n];
    gpu.dtoh(addr, &mut out).expect("download");
    out
}

/// The engine's bf16 rounding (nearest, ties to even, a NaN kept quiet).
fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    let h = if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) >> 16
    };
    f32::from_bits((h & 0xFFFF) << 16)
}

pub fn program_ops(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    // GeGLU, values wide enough that det_exp's range is crossed.
    let n = 4099;
    let (g, u) = (r.uniform_vec(n, 12.0), r.uniform_vec(n, 3.0));
    let mut cpu = vec![0.0; n];
    geglu(&g, &u, &mut cpu);
    let (dg, du, dout) = (up(gpu, &g), up(gpu, &u), up(gpu, &vec![0.0; n]));
    gpu.geglu(dg.ptr(), du.ptr(), dout.ptr(), n).expect("geglu");
    rep.case(
        format!("geglu over {n}"),
        diff(&cpu, &down(gpu, dout.ptr(), n)),
        n,
    );

    // A matmul's bias, then a scale, in place.
    let (rows, cols) = (37, 129);
    let y = r.uniform_vec(rows * cols, 4.0);
    let b = r.uniform_vec(cols, 2.0);
    let by = 0.731_f32;
    let cpu: Vec<f32> = y
        .iter()
        .enumerate()
        .map(|(i, &v)| (v + b[i % cols]) * by)
        .collect();
    let (dy, db) = (up(gpu, &y), up(gpu, &b));
    gpu.add_bias(dy.ptr(), db.ptr(), rows * cols, cols)
        .expect("add_bias");
    gpu.scale(dy.ptr(), by, rows * cols).expect("scale");
    rep.case(
        format!("add_bias then scale, {rows} × {cols}"),
        diff(&cpu, &down(gpu, dy.ptr(), rows * cols)),
        rows * cols,
    );

    // Streams: each row repeated four times, then their mean.
    let (n, s, d) = (9, 4, 515);
    let x = r.uniform_vec(n * d, 3.0);
    let (dx, dstreams, dmean) = (
        up(gpu, &x),
        up(gpu, &vec![0.0; n * s * d]),
        up(gpu, &vec![0.0; n * d]),
    );
    gpu.repeat_rows(dx.ptr(), dstreams.ptr(), n, d, s * d)
        .expect("repeat_rows");
    let streams = down(gpu, dstreams.ptr(), n * s * d);
    let cpu: Vec<f32> = (0..n * s * d)
        .map(|i| x[(i / (s * d)) * d + i % d])
        .collect();
    rep.case(
        format!("repeat_rows {n} × {d} into {s} streams"),
        diff(&cpu, &streams),
        cpu.len(),
    );
    // A mean over streams that differ: perturb them on the host first.
    let mixed: Vec<f32> = streams
        .iter()
        .enumerate()
        .map(|(i, &v)| v * (1.0 + (i % 7) as f32 / 8.0))
        .collect();
    let dmixed = up(gpu, &mixed);
    gpu.stream_mean(dmixed.ptr(), dmean.ptr(), n, s, d)
        .expect("stream_mean");
    let inv = 1.0 / s as f32;
    let cpu: Vec<f32> = (0..n * d)
        .map(|i| {
            let (t, c) = (i / d, i % d);
            let mut acc = 0.0f32;
            for j in 0..s {
                acc += mixed[(t * s + j) * d + c];
            }
            acc * inv
        })
        .collect();
    rep.case(
        format!("stream_mean {n} × {s} streams × {d}"),
        diff(&cpu, &down(gpu, dmean.ptr(), n * d)),
        n * d,
    );

    // bf16 rounding: random values, ties, and the special values.
    let mut v = r.uniform_vec(2048, 100.0);
    v.extend([
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x0000_0001),
        -0.0,
        f32::MAX,
    ]);
    let cpu: Vec<f32> = v.iter().map(|&x| bf16_round(x)).collect();
    let dv = up(gpu, &v);
    gpu.round_bf16(dv.ptr(), v.len()).expect("round_bf16");
    rep.case(
        format!(
            "round_bf16 over {} (ties, infinities, a subnormal)",
            v.len()
        ),
        diff(&cpu, &down(gpu, dv.ptr(), v.len())),
        v.len(),
    );

    // The MoE combine over expert rows laid out by expert: token t's
    // entries name rows of `ys` by index.
    let (n, d, k, experts) = (5, 131, 3, 8);
    let ys = r.uniform_vec(n * k * d, 2.0);
    let base = r.uniform_vec(n * d, 1.0);
    let gates = r.uniform_vec(n * k, 1.5);
    // Entry e reads row (7e + e / k) mod (n·k): rows out of entry order, some
    // read twice.
    let idx: Vec<i32> = (0..n * k)
        .map(|e| ((e * 7 + e / k) % (n * k)) as i32)
        .collect();
    let mut ints = idx.clone();
    ints.extend((0..=n).map(|t| (t * k) as i32));
    for with_base in [true, false] {
        let mut cpu = vec![0.0; n * d];
        for t in 0..n {
            let rows: Vec<&[f32]> = (0..k)
                .map(|j| {
                    let q = idx[t * k + j] as usize;
                    &ys[q * d..(q + 1) * d]
                })
                .collect();
            let zero = vec![0.0; d];
            let b = if with_base {
                &base[t * d..(t + 1) * d]
            } else {
                &zero[..]
            };
            moe_combine(
                b,
                &gates[t * k..(t + 1) * k],
                &rows,
                &mut cpu[t * d..(t + 1) * d],
            );
        }
        let (dys, dbase, dg) = (up(gpu, &ys), up(gpu, &base), up(gpu, &gates));
        let dints = gpu.upload(&ints, "combine entries").expect("upload");
        let dout = up(gpu, &vec![0.0; n * d]);
        gpu.moe_combine_dev(
            if with_base { dbase.ptr() } else { 0 },
            dg.ptr(),
            dys.ptr(),
            dints.ptr(),
            dints.ptr() + 4 * (n * k) as u64,
            dout.ptr(),
            n,
            d,
        )
        .expect("moe_combine_idx");
        rep.case(
            format!(
                "moe_combine_idx {n} tokens × {k} of {experts} experts × {d}, {}",
                if with_base {
                    "shared base"
                } else {
                    "from +0.0"
                }
            ),
            diff(&cpu, &down(gpu, dout.ptr(), n * d)),
            n * d,
        );
    }
}
