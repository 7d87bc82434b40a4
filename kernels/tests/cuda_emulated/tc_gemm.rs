//! The tensor-core GEMM's tiling, staging and fragment indices
//! (`kernels/cuda/tc/gemm.cu`), on the emulation (`tc_runner.cpp`): every
//! `mma.m16n8k16` is emulated warp-wide from the lanes' fragments, with a
//! stand-in inner product (the addend and the 16 products summed in f64 in
//! k order, rounded to f32) that [`chain`] computes on the host. The
//! instruction's own arithmetic is `tensor_core`'s model, held to the
//! hardware by `tc_probe`; what is checked here is that every output is the
//! chain of its own row and column over k blocks in order, for each tile
//! kernel, with partial tiles, k not a multiple of 16 or 8, and the rows of
//! tokens launched apart.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lmrr_kernels::matmul::bf16_to_f32;
use lmrr_kernels::splitmix::SplitMix64;
use lmrr_kernels::tensor_core::f32_to_bf16;

use crate::harness::{have_gxx, job_on};

/// Builds `runner` (tc_runner.cpp, or a control's copy beside its mutated
/// gemm.cu) as `out`.
fn build(runner: &Path, out: &Path) {
    let st = std::process::Command::new("g++")
        .args(["-std=c++20", "-w", "-O1", "-ffp-contract=off", "-o"])
        .arg(out)
        .arg(runner)
        .status()
        .expect("run g++");
    assert!(
        st.success(),
        "{} does not build under the emulation",
        runner.display()
    );
}

/// This process's folder for emulation builds.
fn tmp(name: &str) -> PathBuf {
    let d =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("the emulation's folder");
    d
}

fn emulator() -> Option<&'static PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        have_gxx().then(|| {
            let out = tmp("emu").join("tc_emu");
            build(
                &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda/emu/tc_runner.cpp"),
                &out,
            );
            out
        })
    })
    .as_ref()
}

/// A job's operands: x (f32) and W (bf16) drawn from `seed`.
struct Operands {
    x: Vec<f32>,
    w: Vec<u16>,
}

impl Operands {
    fn new(n: usize, rows: usize, k: usize, seed: u64) -> Self {
        let mut r = SplitMix64(seed);
        let x = r.uniform_vec(n * k, 3.0);
        let w = r
            .uniform_vec(rows * k, 1.0)
            .into_iter()
            .map(f32_to_bf16)
            .collect();
        Self { x, w }
    }

    /// The host's chain for every output, as bits, row-major (n, rows).
    fn want(&self, n: usize, rows: usize, k: usize) -> Vec<u32> {
        let xb: Vec<u16> = self.x.iter().map(|&v| f32_to_bf16(v)).collect();
        (0..n * rows)
            .map(|i| {
                let (t, o) = (i / rows, i % rows);
                chain(&xb[t * k..(t + 1) * k], &self.w[o * k..(o + 1) * k]).to_bits()
            })
            .collect()
    }

    /// `kernel`'s outputs on the emulation `bin`, as bits.
    fn run(&self, bin: &PathBuf, kernel: &str, n: usize, rows: usize, k: usize) -> Vec<u32> {
        let xbytes: Vec<u8> = self.x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let wbytes: Vec<u8> = self.w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = job_on(
            bin,
            &format!("tc_gemm {kernel} {n} {rows} {k}"),
            &[&xbytes, &wbytes],
        );
        out[0]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

/// The stand-in chain for output (t, o): from +0, per k block of 16
/// (zero-padded), `(f32)(acc + Σ products in f64)`.
fn chain(xb: &[u16], w: &[u16]) -> f32 {
    let mut acc = 0.0f32;
    for (a, b) in xb.chunks(16).zip(w.chunks(16)) {
        let mut s = acc as f64;
        for (&x, &y) in a.iter().zip(b) {
            s += bf16_to_f32(x) as f64 * bf16_to_f32(y) as f64;
        }
        acc = s as f32;
    }
    acc
}

/// Every output of each kernel on each (tokens, rows, k) equals the host's
/// chain, bit for bit.
fn check(bin: &PathBuf, kernels: &[&str], shapes: &[(usize, usize, usize)]) {
    for &(n, rows, k) in shapes {
        let ops = Operands::new(n, rows, k, (n * 1000 + rows * 10 + k) as u64);
        let want = ops.want(n, rows, k);
        for kernel in kernels {
            let got = ops.run(bin, kernel, n, rows, k);
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(
                bad,
                0,
                "{kernel} n {n} rows {rows} k {k}: {bad} of {} outputs differ",
                n * rows
            );
        }
    }
}

#[test]
fn the_f32_staging_kernel_chains_each_output_over_its_own_row_and_column() {
    let Some(bin) = emulator() else { return };
    // (tokens, rows, k): partial tiles everywhere; k = 40 (not a multiple
    // of 16: zero padding), 36 (not of 8: the scalar staging), 96 (three
    // staged k tiles); 130 tokens cross a 128-token block row.
    let shapes = [(3, 37, 40), (17, 70, 36), (130, 33, 96), (1, 129, 64)];
    check(bin, &["tc_gemm_64x64"], &shapes);
}

#[test]
fn the_pipelined_kernels_chain_each_output_over_k_blocks_in_order() {
    let Some(bin) = emulator() else { return };
    // tc_mm_* (x rounded by tc_round_bf16, K % 8 == 0): k = 40 (a tile cut
    // short, a k block wholly past K skipped), 8, and 1,040 (17 tiles of 64,
    // 33 of 32: the ring of stages wraps several times); 9, 17 and 130
    // tokens use the fragments' second rows and cross block rows; 37 and 70
    // rows leave warps and lanes past the matrix.
    let shapes = [(1, 37, 40), (9, 70, 1040), (17, 33, 8), (130, 40, 72)];
    let kernels = ["tc_mm_32x32", "tc_mm_64x64", "tc_mm_128x128"];
    check(bin, &kernels, &shapes);
}

#[test]
fn the_direct_load_kernels_chain_each_output_over_k_blocks_in_order() {
    let Some(bin) = emulator() else { return };
    // tc_mv_* (fragments loaded from global memory, two groups of k blocks
    // in flight): k = 40 and 8 (a k block half past K, one wholly past K
    // skipped), 1,040 (65 blocks: the groups of 16 and 8 wrap with a
    // ragged tail); 9 and 17 tokens use the second token tile and the
    // fragments' second rows; 37 and 70 rows leave warps and lanes past the
    // matrix.
    let shapes = [(1, 37, 40), (9, 70, 1040), (17, 33, 8), (130, 40, 72)];
    check(bin, &["tc_mv_8", "tc_mv_16"], &shapes);
}

#[test]
fn the_check_sees_a_wrong_fragment_index() {
    // Negative control: gemm.cu with a2 (k + 8) read from k instead must
    // fail the comparison above (the same emulation, the mutated source).
    let Some(_) = emulator() else { return };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let src = std::fs::read_to_string(dir.join("tc/gemm.cu")).unwrap();
    let bad = src.replacen("a[i][2] = tc_ld32(p + 8);", "a[i][2] = tc_ld32(p);", 1);
    assert_ne!(src, bad, "the mutation must apply");
    let t = tmp("emu-ctl");
    for d in ["tc", "emu"] {
        std::fs::create_dir_all(t.join(d)).unwrap();
    }
    std::fs::write(t.join("tc/gemm.cu"), bad).unwrap();
    for f in ["tc_runner.cpp", "cuda_emu.h", "job_io.h"] {
        std::fs::copy(dir.join("emu").join(f), t.join("emu").join(f)).unwrap();
    }
    let out = t.join("tc_emu_ctl");
    build(&t.join("emu/tc_runner.cpp"), &out);
    let (n, rows, k) = (5, 20, 32);
    let ops = Operands::new(n, rows, k, 1);
    let got = ops.run(&out, "tc_gemm_64x64", n, rows, k);
    let differ = got
        .iter()
        .zip(ops.want(n, rows, k))
        .filter(|(a, b)| **a != *b)
        .count();
    assert!(differ > 0, "a wrong fragment index went unseen");
}
