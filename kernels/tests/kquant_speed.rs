//! Timing of the K-quant matmuls on Qwen2.5-Coder-1.5B's shapes, one thread:
//! decode (one token) and a prefill block (64 tokens). Ignored by default;
//! run with `cargo test --release -p lmrr-kernels --test kquant_speed --
//! --ignored --nocapture`. Prints the best of several repeats per case (the
//! least disturbed by other work on the machine), and checks the outputs
//! against the f32 matmul over the dequantized copy so a faster kernel is
//! never a wrong one.

use lmrr_kernels::quant::{dequant_ref, QuantKind};
use lmrr_kernels::threads::Threads;
use lmrr_kernels::*;
use std::time::Instant;

/// Random super-blocks with f16 scales of a trained model's magnitude.
fn blocks(r: &mut SplitMix64, kind: QuantKind, n: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
    for b in out.chunks_exact_mut(bb) {
        let (offs, d): (&[usize], f32) = match kind {
            QuantKind::Q4K => (&[0, 2], 0.002),
            _ => (&[208], 0.0005),
        };
        for &o in offs {
            let h = half_bits(r.uniform(d));
            b[o..o + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    out
}

/// f16 bits of a normal value near `x` (exponent and top mantissa bits).
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let e = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let sign = ((b >> 16) & 0x8000) as u16;
    if e <= 0 {
        return sign;
    }
    sign | ((e.min(30) as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

#[test]
#[ignore]
fn kquant_matmul_speed() {
    let mut r = SplitMix64(7);
    let th = Threads::new(1).expect("one thread");
    // (kind, rows, cols): ffn gate/up, ffn down, attention q, lm head slice.
    let cases = [
        (QuantKind::Q4K, 8960usize, 1536usize),
        (QuantKind::Q6K, 1536, 8960),
        (QuantKind::Q4K, 1536, 1536),
        (QuantKind::Q6K, 8192, 1536),
    ];
    for &(kind, rows, cols) in &cases {
        let q = blocks(&mut r, kind, rows * cols / 256);
        let m = Matrix::new(Weights::Quant(kind, &q), rows, cols).expect("shape");
        let mut deq = vec![0.0f32; rows * cols];
        dequant_ref(kind, &q, &mut deq);
        let mf = Matrix::new(Weights::F32(&deq), rows, cols).expect("shape");
        for &n in &[1usize, 64] {
            let x = r.uniform_vec(n * cols, 1.0);
            let mut y = vec![0.0f32; n * rows];
            let reps = if n == 1 { 15 } else { 3 };
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = Instant::now();
                matmul(&th, &x, n, &m, &mut y);
                best = best.min(t.elapsed().as_secs_f64());
            }
            let mut want = vec![0.0f32; n * rows];
            matmul(&th, &x, n, &mf, &mut want);
            let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{kind:?} {rows}x{cols} n={n}: differs from the f32 matmul"
            );
            let gw = (rows * cols * n) as f64 / best / 1e9;
            println!(
                "{:?} {rows}x{cols} n={n}: best {:.3} ms ({gw:.2} G weight·tokens/s)",
                kind,
                best * 1e3
            );
        }
    }
}

/// The CPU's f32 FMA peak on one core: 12 independent 8-lane FMA chains (more
/// than latency × throughput), best of several runs. The bound every f32
/// matmul here is under, prefill included.
#[test]
#[ignore]
#[cfg(target_arch = "x86_64")]
fn fma_peak() {
    use std::arch::x86_64::*;
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        return;
    }
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run(iters: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); 12];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut s = 0.0;
        for v in acc {
            let mut o = [0.0f32; 8];
            _mm256_storeu_ps(o.as_mut_ptr(), v);
            s += o.iter().sum::<f32>();
        }
        s
    }
    let iters = 20_000_000;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: AVX2 and FMA detected above.
        let s = unsafe { run(iters) };
        best = best.min(t.elapsed().as_secs_f64());
        assert!(s.is_finite());
    }
    let fmas = (iters * 12 * 8) as f64;
    println!(
        "f32 FMA peak, one core: {:.1} G FMA/s ({:.1} GFLOP/s)",
        fmas / best / 1e9,
        2.0 * fmas / best / 1e9
    );
    if !is_x86_feature_detected!("avx512f") {
        return;
    }
    // The same with 512-bit registers: 12 chains (two FMA units of 4
    // cycles' latency need at least 8), named one by one so that no
    // accumulator leaves its register.
    #[target_feature(enable = "avx512f")]
    unsafe fn run512(iters: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let one = _mm512_set1_ps(1.0);
        let (mut c0, mut c1, mut c2, mut c3) = (one, one, one, one);
        let (mut c4, mut c5, mut c6, mut c7) = (one, one, one, one);
        let (mut c8, mut c9, mut c10, mut c11) = (one, one, one, one);
        for _ in 0..iters {
            c0 = _mm512_fmadd_ps(c0, a, b);
            c1 = _mm512_fmadd_ps(c1, a, b);
            c2 = _mm512_fmadd_ps(c2, a, b);
            c3 = _mm512_fmadd_ps(c3, a, b);
            c4 = _mm512_fmadd_ps(c4, a, b);
            c5 = _mm512_fmadd_ps(c5, a, b);
            c6 = _mm512_fmadd_ps(c6, a, b);
            c7 = _mm512_fmadd_ps(c7, a, b);
            c8 = _mm512_fmadd_ps(c8, a, b);
            c9 = _mm512_fmadd_ps(c9, a, b);
            c10 = _mm512_fmadd_ps(c10, a, b);
            c11 = _mm512_fmadd_ps(c11, a, b);
        }
        [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11]
            .iter()
            .map(|v| _mm512_reduce_add_ps(*v))
            .sum()
    }
    let iters = 5_000_000;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: AVX-512 F detected above.
        let s = unsafe { run512(iters) };
        best = best.min(t.elapsed().as_secs_f64());
        assert!(s.is_finite());
    }
    let fmas = (iters * 12 * 16) as f64;
    println!(
        "f32 FMA peak with AVX-512, one core: {:.1} G FMA/s ({:.1} GFLOP/s)",
        fmas / best / 1e9,
        2.0 * fmas / best / 1e9
    );
}
