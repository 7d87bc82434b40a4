//! The emulation's harness: building the g++ emulation of the CUDA source
//! (as compiled by default, with `PDL_PREFETCH`/`ATTN_PREFETCH`, with
//! `ATTN_EARLY`, or a negative control's mutated text), running one job of
//! runner.cpp's protocol on it, the byte conversions of its arrays, the
//! bitwise comparison every test uses, and operands in every weight storage.
//! A build is per process (its own folder), so two test processes at once
//! never rewrite a binary the other runs.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use lmrr_kernels::*;

/// Whether g++ runs here; panics without it under `LMRR_REQUIRE_TOOLS=1`.
pub(crate) fn have_gxx() -> bool {
    let ok = Command::new("g++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = "no g++ to build the CUDA emulation";
        if std::env::var("LMRR_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
            panic!("LMRR_REQUIRE_TOOLS=1 and {why}");
        }
        // Straight to stderr: libtest hides a passing test's eprintln!.
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
    }
    ok
}

/// Builds the emulation of `source` (the CUDA source, or a variant) as
/// `name`; `contract` lets the host compiler contract multiply-adds.
pub(crate) fn build(name: &str, source: &str, contract: bool) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda/emu");
    // Named per process: two test processes at once (a workspace run beside
    // a filtered one) must not rewrite the binary the other is running.
    let tmp =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("emu-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("the emulation's folder");
    let cu = tmp.join(format!("{name}.cu"));
    std::fs::write(&cu, source).expect("write the source");
    let out = tmp.join(name);
    let mut cmd = Command::new("g++");
    // -O1 builds faster than -O2 and runs these small cases as fast; a
    // contracting build needs -O2, the level at which GCC forms fused
    // multiply-adds.
    cmd.args(["-std=c++20", "-w"])
        .args(if contract {
            ["-O2", "-ffp-contract=fast"]
        } else {
            ["-O1", "-ffp-contract=off"]
        })
        .arg(format!("-DKERNELS_CU=\"{}\"", cu.display()))
        .arg("-o")
        .arg(&out)
        .arg(dir.join("runner.cpp"));
    if contract {
        cmd.arg("-mfma");
    }
    let st = cmd.status().expect("run g++");
    assert!(
        st.success(),
        "{name}: the source does not build under the emulation"
    );
    out
}

/// The emulation of the CUDA source as the device compiles it by default
/// (built once per process); `None` where no g++ runs.
pub(crate) fn emulator() -> Option<&'static PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        have_gxx().then(|| build("cuda_emu", lmrr_kernels::cuda_source::SOURCE, false))
    })
    .as_ref()
}

/// The emulation of the CUDA source as compiled with `PDL_PREFETCH` and
/// `ATTN_PREFETCH` (LMRR_CUDA_ATTN_PREFETCH): `attention_decode`'s loads
/// before the wait, whose values must be the ones it would load after.
pub(crate) fn emulator_prefetch() -> Option<&'static PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        have_gxx().then(|| {
            let src = format!(
                "#define ATTN_PREFETCH 1\n{}",
                lmrr_kernels::cuda_source::prefetch_source(lmrr_kernels::cuda_source::SOURCE)
            );
            build("cuda_emu_prefetch", &src, false)
        })
    })
    .as_ref()
}

/// The emulation of the CUDA source as the resident module is compiled with
/// `ATTN_EARLY` (LMRR_CUDA_ATTN_EARLY): `attention_decode_rope_qs` taking
/// its step inputs from the loads made before the wait (`DecodeIn`).
pub(crate) fn emulator_early() -> Option<&'static PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        have_gxx().then(|| {
            let src = format!(
                "#define ATTN_EARLY 1\n{}",
                lmrr_kernels::cuda_source::prefetch_source(lmrr_kernels::cuda_source::SOURCE)
            );
            build("cuda_emu_early", &src, false)
        })
    })
    .as_ref()
}

/// Runs one job; returns its output arrays.
pub(crate) fn job(line: &str, arrays: &[&[u8]]) -> Vec<Vec<u8>> {
    job_on(emulator().expect("emulator"), line, arrays)
}

/// Runs one job on the emulation `bin`; returns its output arrays.
pub(crate) fn job_on(bin: &PathBuf, line: &str, arrays: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut child = Command::new(bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the emulator");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        for a in arrays {
            stdin.write_all(&(a.len() as u64).to_le_bytes()).unwrap();
            stdin.write_all(a).unwrap();
        }
    }
    let out = child.wait_with_output().expect("emulator output");
    assert!(
        out.status.success(),
        "job `{line}` failed: {:?}",
        out.status
    );
    let mut rest = &out.stdout[..];
    let mut arrays = Vec::new();
    while rest.len() >= 8 {
        let n = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        arrays.push(rest[8..8 + n].to_vec());
        rest = &rest[8 + n..];
    }
    arrays
}

/// f32s as the emulator reads them (little-endian bytes).
pub(crate) fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// u64s as the emulator reads them (little-endian bytes).
pub(crate) fn bytes64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// i32s as the emulator reads them (little-endian bytes).
pub(crate) fn ints(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An output array of f32s.
pub(crate) fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The f32 of `bits`.
pub(crate) fn f(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// How many values of `a` and `b` differ in their bits (a length
/// difference counted too): the tests' only comparison.
pub(crate) fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Quantized blocks with realistic f16 scales.
pub(crate) fn blocks(r: &mut SplitMix64, kind: QuantKind, n: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
    for b in out.chunks_exact_mut(bb) {
        let h = ((r.next_u64() as u16 & 1) << 15)
            | ((7 + (r.next_u64() % 3) as u16) << 10)
            | (r.next_u64() as u16 & 0x3ff);
        // The f16 scale: first in every block but Q6_K's, which ends with it.
        let at = if kind == QuantKind::Q6K { bb - 2 } else { 0 };
        b[at..at + 2].copy_from_slice(&h.to_le_bytes());
        // Q4_1's f16 min and Q4_K's f16 dmin follow the scale.
        if kind == QuantKind::Q4_1 || kind == QuantKind::Q4K {
            let m = ((r.next_u64() as u16 & 1) << 15)
                | ((9 + (r.next_u64() % 3) as u16) << 10)
                | (r.next_u64() as u16 & 0x3ff);
            b[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    out
}

/// One matrix's values in every storage the kernels read: f32, its bf16
/// truncation, and random GGUF blocks of each kind.
pub(crate) struct Stored {
    wf: Vec<f32>,
    wb: Vec<u16>,
    q40: Vec<u8>,
    q41: Vec<u8>,
    q80: Vec<u8>,
}

impl Stored {
    pub(crate) fn new(r: &mut SplitMix64, n: usize, scale: f32) -> Self {
        let wf = r.uniform_vec(n, scale);
        let wb = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        Self {
            wf,
            wb,
            q40: blocks(r, QuantKind::Q4_0, n / 32),
            q41: blocks(r, QuantKind::Q4_1, n / 32),
            q80: blocks(r, QuantKind::Q8_0, n / 32),
        }
    }

    /// `(label, the kernels' storage kind, the CPU's view, the raw bytes)`.
    pub(crate) fn each(&self) -> [(&'static str, i32, Weights<'_>, Vec<u8>); 5] {
        let wbb = self.wb.iter().flat_map(|v| v.to_le_bytes()).collect();
        [
            ("f32", 0, Weights::F32(&self.wf), bytes(&self.wf)),
            ("bf16", 1, Weights::Bf16(&self.wb), wbb),
            (
                "Q4_0",
                2,
                Weights::Quant(QuantKind::Q4_0, &self.q40),
                self.q40.clone(),
            ),
            (
                "Q4_1",
                3,
                Weights::Quant(QuantKind::Q4_1, &self.q41),
                self.q41.clone(),
            ),
            (
                "Q8_0",
                4,
                Weights::Quant(QuantKind::Q8_0, &self.q80),
                self.q80.clone(),
            ),
        ]
    }
}

/// The super-block formats (Q4_K, Q6_K) of `n` weights (a multiple of
/// 256), as [`Stored::each`] gives the others: `(label, the kernels'
/// storage kind, the raw bytes)`.
pub(crate) fn kquant_blocks(
    r: &mut SplitMix64,
    n: usize,
) -> [(&'static str, i32, QuantKind, Vec<u8>); 2] {
    assert_eq!(n % 256, 0, "K-quant weights come in super-blocks of 256");
    [
        (
            "Q4_K",
            5,
            QuantKind::Q4K,
            blocks(r, QuantKind::Q4K, n / 256),
        ),
        (
            "Q6_K",
            6,
            QuantKind::Q6K,
            blocks(r, QuantKind::Q6K, n / 256),
        ),
    ]
}

/// The CPU's sum of a split matmul's partials (`chunks` × `count`), chunk
/// by chunk from +0.0: what `sum_chunks` computes.
pub(crate) fn chunk_sums(part: &[f32], chunks: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| (0..chunks).fold(0.0f32, |t, c| t + part[c * count + i]))
        .collect()
}
