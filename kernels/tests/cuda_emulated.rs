//! kernels.cu's resident kernels, run on the CPU through a CUDA emulation
//! (`kernels/cuda/emu/`: the same source compiled by the host's C++
//! compiler, a block's threads run as fibers, shuffles and barriers
//! emulated),
//! against the CPU fast path, bit for bit. This checks the kernels' index
//! arithmetic and reduction orders on every machine, CI included; the device
//! itself is checked by `gpu_check` (register, memory-model and compiler
//! differences can only show there). Skipped, with the reason printed,
//! where no `g++` is found, unless `LMRR_REQUIRE_TOOLS=1` (CI), where that
//! is a failure.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use lmrr_kernels::*;

/// Whether g++ runs here; panics without it under `LMRR_REQUIRE_TOOLS=1`.
fn have_gxx() -> bool {
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

/// Builds the emulation of `source` (kernels.cu's text, or a variant) as
/// `name`; `contract` lets the host compiler contract multiply-adds.
fn build(name: &str, source: &str, contract: bool) -> PathBuf {
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

fn emulator() -> Option<&'static PathBuf> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        have_gxx().then(|| build("cuda_emu", lmrr_kernels::cuda_source::SOURCE, false))
    })
    .as_ref()
}

/// Runs one job; returns its output arrays.
fn job(line: &str, arrays: &[&[u8]]) -> Vec<Vec<u8>> {
    job_on(emulator().expect("emulator"), line, arrays)
}

fn job_on(bin: &PathBuf, line: &str, arrays: &[&[u8]]) -> Vec<Vec<u8>> {
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

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Quantized blocks with realistic f16 scales.
fn blocks(r: &mut SplitMix64, kind: QuantKind, n: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
    for b in out.chunks_exact_mut(bb) {
        let h = ((r.next_u64() as u16 & 1) << 15)
            | ((7 + (r.next_u64() % 3) as u16) << 10)
            | (r.next_u64() as u16 & 0x3ff);
        b[..2].copy_from_slice(&h.to_le_bytes());
        if kind == QuantKind::Q4_1 {
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
struct Stored {
    wf: Vec<f32>,
    wb: Vec<u16>,
    q40: Vec<u8>,
    q41: Vec<u8>,
    q80: Vec<u8>,
}

impl Stored {
    fn new(r: &mut SplitMix64, n: usize, scale: f32) -> Self {
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

    /// `(label, kernels.cu's storage kind, the CPU's view, the raw bytes)`.
    fn each(&self) -> [(&'static str, i32, Weights<'_>, Vec<u8>); 5] {
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

#[test]
fn matmul_kernels_match_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(5);
    // (rows, cols, tokens): tails of rows, tokens and chunks; more chunks
    // than matmul_rows has groups (1088 = 17 chunks); gemm's row and token
    // tiles both partial; split gemm with 1, 2, 5 and 3 chunks per block.
    for &(rows, cols, n) in &[
        (7usize, 96usize, 3usize),
        (33, 160, 17),
        (20, 1088, 9),
        (65, 64, 40),
        // Whole and partial wide tiles (64 rows × 32 tokens), ragged chunks.
        (130, 224, 70),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let st = Stored::new(&mut r, rows * cols, 0.5);
        for (label, kind, w, raw) in st.each() {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(&th, &x, n, &m, &mut cpu);
            for kernel in [
                "warp",
                "tile",
                "rows",
                "rows4",
                "gemm",
                "gemm_split1",
                "gemm_split2",
                "gemm_split5",
                "gemm_wide",
                "gemm_wide_split3",
            ] {
                let out = job(
                    &format!("matmul {kernel} {kind} {n} {rows} {cols}"),
                    &[&bytes(&x), &raw],
                );
                let dev = floats(&out[0]);
                assert_eq!(
                    differing(&cpu, &dev),
                    0,
                    "matmul_{kernel} {label} {n}×{cols}·{cols}×{rows}"
                );
            }
        }
    }
}

/// `matmul_multi` (a block per row and token tile over up to three
/// matrices) against three CPU matmuls: ragged row counts, one and two
/// token tiles, a partial last chunk, an absent third matrix.
#[test]
fn matmul_multi_matches_three_matmuls() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(6);
    let cases: &[(usize, usize, [usize; 3])] = &[
        (192, 5, [24, 8, 8]),
        (200, 11, [25, 7, 9]),
        (576, 1, [13, 6, 0]),
    ];
    for &(cols, n, rows) in cases {
        let x = r.uniform_vec(n * cols, 2.0);
        let ws: Vec<Vec<f32>> = rows.iter().map(|&o| r.uniform_vec(o * cols, 0.5)).collect();
        let out = job(
            &format!("multi 0 {n} {cols} {} {} {}", rows[0], rows[1], rows[2]),
            &[&bytes(&x), &bytes(&ws[0]), &bytes(&ws[1]), &bytes(&ws[2])],
        );
        for (i, w) in ws.iter().enumerate() {
            let m = Matrix::new(Weights::F32(w), rows[i], cols).expect("shape");
            let mut cpu = vec![0.0; n * rows[i]];
            matmul(&th, &x, n, &m, &mut cpu);
            assert_eq!(
                differing(&cpu, &floats(&out[i])),
                0,
                "matmul_multi {n}×{cols} matrix {i} of {rows:?}"
            );
        }
    }
}

#[test]
fn norm_kernels_match_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(7);
    let eps = 1e-5f32;
    for &(rows, d) in &[(3usize, 100usize), (2, 576), (1, 1100), (4, 7)] {
        let x = r.uniform_vec(rows * d, 3.0);
        let y = r.uniform_vec(rows * d, 1.0);
        let w = r.uniform_vec(d, 1.5);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        for add in [false, true] {
            let src = if add { &sum } else { &x };
            let mut cpu = vec![0.0; src.len()];
            rms_norm(src, &w, eps, &mut cpu);
            let variants = [
                ("warp", emulator()),
                ("block", emulator()),
                ("reg", emulator()),
                ("reg_lf", emulator()),
            ];
            for (kernel, bin) in variants {
                let Some(bin) = bin else { continue };
                let out = job_on(
                    bin,
                    &format!(
                        "norm {kernel} {rows} {d} {} {}",
                        u8::from(add),
                        eps.to_bits()
                    ),
                    &[&bytes(&x), &bytes(&y), &bytes(&w)],
                );
                let what = format!("{kernel} norm {rows}×{d}, add {add}");
                assert_eq!(differing(&cpu, &floats(&out[0])), 0, "{what}");
                assert_eq!(
                    differing(src, &floats(&out[1])),
                    0,
                    "{what}: the sum written back"
                );
            }
        }
    }
}

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
            ("attention_prefill_hd64", 3, emulator()),
            // The groups listed last first (LMRR_CUDA_PF_LONGEST_FIRST
            // reorders them): which block serves which group moves no bit.
            ("attention_prefill_hd64, groups reversed", 5, emulator()),
        ] {
            let Some(bin) = bin else { continue };
            // attention_prefill holds head dims up to PF_MAXHD (128);
            // the _hd64 kernels are for head_dim 64 alone.
            if (decode == 2 && hd > 128) || (decode >= 3 && hd != 64) {
                continue;
            }
            // One span of every task (the positions below the first are
            // earlier steps' rows: loaded before the wait under
            // ATTN_PREFETCH), then two spans of half the tasks each where
            // their count is even (the second span's table a copy of the
            // first; attention_prefill's groups end at the span's end).
            let mut layouts = vec![(index.clone(), seq_off.clone())];
            if tasks.len() >= 4 && tasks.len() % 2 == 0 {
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

/// The emulation of kernels.cu as compiled with `PDL_PREFETCH` and
/// `ATTN_PREFETCH` (LMRR_CUDA_ATTN_PREFETCH): `attention_decode`'s loads
/// before the wait, whose values must be the ones it would load after.
fn emulator_prefetch() -> Option<&'static PathBuf> {
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

/// The emulation of kernels.cu as the resident module is compiled with
/// `ATTN_EARLY` (LMRR_CUDA_ATTN_EARLY): `attention_decode_rope_qs` taking
/// its step inputs from the loads made before the wait (`DecodeIn`).
fn emulator_early() -> Option<&'static PathBuf> {
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

/// The tests above can fail: every negative control that breaks one of the
/// kernels they run (its source built and run the same way) gives other bits
/// on a small case of that kernel. Contraction (`fmad=true` on the device)
/// is played by the host compiler's own (`-ffp-contract=fast -mfma`).
#[test]
fn the_emulation_sees_each_broken_kernel() {
    if !have_gxx() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(9);
    // One small case per kernel family, with its CPU answer.
    let (rows, cols, n) = (40usize, 1088usize, 20usize);
    let x = r.uniform_vec(n * cols, 2.0);
    let wf = r.uniform_vec(rows * cols, 0.5);
    let m = Matrix::new(Weights::F32(&wf), rows, cols).expect("shape");
    let mut mm_cpu = vec![0.0; n * rows];
    matmul(&th, &x, n, &m, &mut mm_cpu);
    let (dn, nr) = (1100usize, 2usize);
    let nx = r.uniform_vec(nr * dn, 3.0);
    let nw = r.uniform_vec(dn, 1.5);
    let mut norm_cpu = vec![0.0; nx.len()];
    rms_norm(&nx, &nw, 1e-5, &mut norm_cpu);
    // Scores of one size (keys small): many p of a tile alike, so that the
    // order of their sum shows.
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let pos = 100usize;
    let k = r.uniform_vec((pos + 1) * 128, 0.3);
    let v = r.uniform_vec((pos + 1) * 128, 1.0);
    let view = KvView {
        block_len: pos + 1,
        k: vec![&k],
        v: vec![&v],
    };
    let q = r.uniform_vec(256, 2.0);
    let mut at_cpu = vec![0.0; 256];
    attention(
        &th,
        &[AttnTask {
            q: &q,
            kv: &view,
            pos,
        }],
        &shape,
        0.125,
        &mut at_cpu,
    );
    let store: Vec<f32> = [k.as_slice(), v.as_slice()].concat();
    // Folded sums: partials of 3 chunks read by the norms, swiglu_split and
    // add_rows (CPU: the chunk-order sum, then the op).
    let (fr, fd, fc) = (2usize, 130usize, 3usize);
    let fx = r.uniform_vec(fr * fd, 3.0);
    let fp = r.uniform_vec(fc * fr * fd, 1.0);
    let fnw = r.uniform_vec(fd, 1.5);
    let fy = chunk_sums(&fp, fc, fr * fd);
    let fsum: Vec<f32> = fx.iter().zip(&fy).map(|(a, b)| a + b).collect();
    let mut fnorm = vec![0.0; fsum.len()];
    rms_norm(&fsum, &fnw, 1e-5, &mut fnorm);
    let mut fsw = vec![0.0; fsum.len()];
    swiglu(&fy, &fy, &mut fsw);
    let folded_cpu = [&fnorm, &fsum, &fnorm, &fsum, &fsw, &fsum];
    // Two matrices of x in one matmul_gemm_multi launch (the first split).
    let w2 = r.uniform_vec(70 * cols, 0.5);
    let m2 = Matrix::new(Weights::F32(&w2), 70, cols).expect("shape");
    let mut multi_cpu = vec![0.0; n * 70];
    matmul(&th, &x, n, &m2, &mut multi_cpu);
    // A decode step through attention_decode_rope_qs against rope_kv then
    // attention_decode (the job runs both).
    let (rope_line, rope_arrays) = decode_rope_inputs(&mut r, 9, 3, 64, 16, &[5, 64, 100]);
    let rope_refs: Vec<&[u8]> = rope_arrays.iter().map(|a| a.as_slice()).collect();
    let controls = lmrr_kernels::cuda_source::negative_controls().unwrap_or_else(|e| panic!("{e}"));
    let mut seen = 0;
    for (i, c) in controls.iter().enumerate() {
        // Controls of kernels these tests do not run (the one-thread
        // references' lane tree, the mini-v4 ops, sigmoid) are gpu_check's.
        let what = c.label;
        let ours = [
            "matmul_warp",
            "matmul_tile",
            "matmul_rows",
            "matmul_gemm",
            "matmul_gemm_multi",
            "attention_paged",
            "attention_decode",
            "attention_prefill",
            "attention_decode_rope_qs",
            "norm_block",
            "norm_reg",
            "fmad",
        ]
        .iter()
        .any(|p| what.contains(p));
        if !ours {
            continue;
        }
        let bin = build(&format!("control_{i}"), &c.source, c.fmad);
        let mut d = 0;
        for kernel in [
            "warp",
            "tile",
            "rows",
            "rows4",
            "gemm",
            "gemm_split1",
            "gemm_wide",
        ] {
            let out = job_on(
                &bin,
                &format!("matmul {kernel} 0 {n} {rows} {cols}"),
                &[&bytes(&x), &bytes(&wf)],
            );
            d += differing(&mm_cpu, &floats(&out[0]));
        }
        for kernel in ["warp", "block", "reg"] {
            let out = job_on(
                &bin,
                &format!("norm {kernel} {nr} {dn} 0 {}", 1e-5f32.to_bits()),
                &[&bytes(&nx), &bytes(&nx), &bytes(&nw)],
            );
            d += differing(&norm_cpu, &floats(&out[0]));
        }
        {
            let out = job_on(
                &bin,
                &format!("split_consumers {fr} {fd} {fc} {}", 1e-5f32.to_bits()),
                &[
                    &bytes(&fx),
                    &bytes(&fp),
                    &bytes(&fnw),
                    &bytes(&fp),
                    &bytes(&fp),
                ],
            );
            for (want, got) in folded_cpu.iter().zip(&out) {
                d += differing(want, &floats(got));
            }
            let out = job_on(
                &bin,
                &format!("gemm_multi 0 {n} {cols} {rows} 70 0 2 0 0"),
                &[&bytes(&x), &bytes(&wf), &bytes(&w2), &[]],
            );
            d += differing(&mm_cpu, &floats(&out[0])) + differing(&multi_cpu, &floats(&out[1]));
        }
        for decode in [0, 1, 2, 3] {
            let out = job_on(
                &bin,
                &format!(
                    "attention 1 4 2 64 {} {} {decode}",
                    pos + 1,
                    0.125f32.to_bits()
                ),
                &[
                    &bytes(&q),
                    &bytes(&store),
                    &bytes64(&[0]),
                    &bytes64(&[0]),
                    &bytes64(&[pos as u64]),
                ],
            );
            d += differing(&at_cpu, &floats(&out[0]));
        }
        {
            let out = job_on(&bin, &rope_line, &rope_refs);
            for i in 0..4 {
                d += differing(&floats(&out[i]), &floats(&out[4 + i]));
            }
        }
        println!("negative control `{what}`: {d} differing bits");
        assert!(
            d > 0,
            "control `{what}`: the emulated kernels give the CPU's bits anyway"
        );
        seen += 1;
    }
    assert!(seen >= 8, "{seen} controls run");
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
}

/// The CPU's sum of a split matmul's partials (`chunks` × `count`), chunk
/// by chunk from +0.0: what `sum_chunks` computes.
fn chunk_sums(part: &[f32], chunks: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| (0..chunks).fold(0.0f32, |t, c| t + part[c * count + i]))
        .collect()
}

/// `matmul_gemm_multi` (up to three matrices of one input in one launch,
/// each split over its chunks or not) against the CPU's matmul of each, in
/// every storage.
#[test]
fn gemm_multi_matches_each_matmul() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(21);
    // (tokens, cols, rows of each, chunks a block of each, 0: unsplit):
    // ragged rows, tokens and chunks; an absent third matrix; splits of
    // 1, 2 and 3 chunks beside an unsplit one; one matrix alone (split
    // and not), as `mm_outs` launches o and down under gemm_multi.
    for &(n, cols, rows, cpb) in &[
        (40usize, 224usize, [130usize, 64, 20], [1usize, 0, 2]),
        (33, 160, [70, 9, 0], [0, 3, 0]),
        (19, 192, [66, 0, 0], [2, 0, 0]),
        (35, 128, [64, 0, 0], [0, 0, 0]),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let st: Vec<Stored> = rows
            .iter()
            .map(|&m| Stored::new(&mut r, m.max(1) * cols, 0.5))
            .collect();
        let each: Vec<_> = st.iter().map(|s| s.each()).collect();
        for kind in 0..5 {
            let raws: Vec<&Vec<u8>> = each.iter().map(|e| &e[kind].3).collect();
            let empty = Vec::new();
            let arrays: Vec<&[u8]> = (0..3)
                .map(|i| {
                    if rows[i] == 0 {
                        &empty[..]
                    } else {
                        &raws[i][..]
                    }
                })
                .collect();
            let out = job(
                &format!(
                    "gemm_multi {} {n} {cols} {} {} {} {} {} {}",
                    each[0][kind].1, rows[0], rows[1], rows[2], cpb[0], cpb[1], cpb[2]
                ),
                &[&bytes(&x), arrays[0], arrays[1], arrays[2]],
            );
            for i in 0..3 {
                let label = each[i][kind].0;
                if rows[i] == 0 {
                    assert!(floats(&out[i]).is_empty(), "absent matrix {i}");
                    continue;
                }
                let m = Matrix::new(each[i][kind].2, rows[i], cols).expect("shape");
                let mut cpu = vec![0.0; n * rows[i]];
                matmul(&th, &x, n, &m, &mut cpu);
                assert_eq!(
                    differing(&cpu, &floats(&out[i])),
                    0,
                    "matmul_gemm_multi {label}: matrix {i} {n}×{cols}·{cols}×{} (cpb {})",
                    rows[i],
                    cpb[i]
                );
            }
        }
    }
}

/// The kernels that fold a split matmul's sum into their own loads
/// (`norm_reg`, `norm_block`, `swiglu_split`, `add_rows` reading partials
/// through `split_value`) against the CPU's chunk-order sum, then its op.
#[test]
fn folded_sums_match_sum_chunks_then_the_op() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(22);
    let eps = 1e-5f32;
    for &(rows, d, chunks) in &[(3usize, 200usize, 7usize), (2, 576, 24), (1, 64, 2)] {
        let count = rows * d;
        let x = r.uniform_vec(count, 3.0);
        let part = r.uniform_vec(chunks * count, 1.0);
        let w = r.uniform_vec(d, 1.5);
        let gp = r.uniform_vec(chunks * count, 2.0);
        let up = r.uniform_vec(chunks * count, 2.0);
        let out = job(
            &format!("split_consumers {rows} {d} {chunks} {}", eps.to_bits()),
            &[
                &bytes(&x),
                &bytes(&part),
                &bytes(&w),
                &bytes(&gp),
                &bytes(&up),
            ],
        );
        let y = chunk_sums(&part, chunks, count);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut norm = vec![0.0; count];
        rms_norm(&sum, &w, eps, &mut norm);
        let mut sw = vec![0.0; count];
        swiglu(
            &chunk_sums(&gp, chunks, count),
            &chunk_sums(&up, chunks, count),
            &mut sw,
        );
        let what = format!("{rows}×{d}, {chunks} chunks");
        for (i, (label, want)) in [
            ("norm_reg out", &norm),
            ("norm_reg x + y", &sum),
            ("norm_block out", &norm),
            ("norm_block x + y", &sum),
            ("swiglu_split", &sw),
            ("add_rows", &sum),
            ("norm_reg_lf out", &norm),
            ("norm_reg_lf x + y", &sum),
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(differing(want, &floats(&out[i])), 0, "{label}, {what}");
        }
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
fn decode_rope_inputs(
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

/// What one program-op check found: each compared output's label and its
/// count of differing values (0 everywhere: the kernel gave the reference's
/// bits). The tests assert every count is 0; the controls, that some is not.
type Found = Vec<(String, usize)>;

fn assert_none_differ(found: &Found) {
    for (what, d) in found {
        assert_eq!(*d, 0, "{what}: {d} values differ from the reference");
    }
}

fn f(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// `geglu` (`out = gelu_tanh(g) · u`, the host's two constants) against
/// `lmrr_kernels::act::geglu` (the fast path), `geglu_ref` and the scalar
/// `gelu_tanh_scalar(g) · u`: random values of a wide range beside ±0,
/// subnormals, magnitudes where `a·x²` overflows or `det_exp` saturates
/// each way, and a length that is no multiple of a block or of a vector.
/// No infinite or NaN operand: a NaN's bits are the platform's (x86 and the
/// device differ), not the op's.
fn geglu_check(bin: &PathBuf) -> Found {
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

/// `round_bf16` (in place) against [`round_bf16_ref`]: ties with an even
/// and an odd upper half each sign, just above and below a tie, the
/// largest finite values (rounding to ±inf), ±inf, signalling and quiet
/// NaNs of either sign and payload, ±0, subnormals (ties and a carry into
/// the smallest normal), and random bit patterns.
fn round_bf16_check(bin: &PathBuf) -> Found {
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
fn stream_mean_check(bin: &PathBuf) -> Found {
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

fn ints(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `moe_combine_idx` against `lmrr_kernels::moe_combine` token by token:
/// expert outputs laid out by expert (rows of `ys`), each entry's row
/// picked by `idx` (out of order, one row read by two tokens), tokens of
/// zero to three entries; with a base (-0.0 in places: a token of no entry
/// keeps it) and without (null: the chain from +0.0).
fn moe_combine_idx_check(bin: &PathBuf) -> Found {
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
fn kv_write_aux_check(bin: &PathBuf) -> Found {
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
fn add_scale_repeat_check(bin: &PathBuf) -> Found {
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

/// The program-op tests above can fail: each mutation below breaks one
/// detail of one program-op kernel (the rounding of an operation, the
/// order or start of a sum, an index), and the check of that kernel, run
/// on the mutated source's emulation, must find differing values. These
/// controls are the emulation's own: `gpu_check`'s control run
/// (`cuda_source::negative_controls`) does not cover these kernels.
#[test]
fn the_emulation_sees_each_broken_program_op() {
    if !have_gxx() {
        return;
    }
    type Check = fn(&PathBuf) -> Found;
    let controls: &[(&str, &str, &str, Check)] = &[
        (
            "geglu: a·x²·x + x as mul + add, not fmaf",
            "float v = fmaf(a * (x * x), x, x);",
            "float v = a * (x * x) * x + x;",
            geglu_check,
        ),
        (
            "round_bf16: ties away from zero",
            "((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)",
            "((b + 0x8000u) >> 16)",
            round_bf16_check,
        ),
        (
            "round_bf16: a NaN's quiet bit not set",
            "((b >> 16) | 0x40u)",
            "(b >> 16)",
            round_bf16_check,
        ),
        (
            "stream_mean: the sum starts from the first stream",
            "float acc = 0.0f;\n    for (int j = 0; j < s; ++j) acc = acc + x[(t * s + j) * d + c];",
            "float acc = x[t * s * d + c];\n    for (int j = 1; j < s; ++j) acc = acc + x[(t * s + j) * d + c];",
            stream_mean_check,
        ),
        (
            "moe_combine_idx: mul + add, not fmaf",
            "acc = fmaf(gates[e], ys[(long long)idx[e] * d + c], acc);",
            "acc = gates[e] * ys[(long long)idx[e] * d + c] + acc;",
            moe_combine_idx_check,
        ),
        (
            "kv_write_aux: slots kvd floats apart",
            "+ (long long)slot[t] * aux;",
            "+ (long long)slot[t] * kvd;",
            kv_write_aux_check,
        ),
        (
            "add_bias: the bias of the next column",
            "y[i] = y[i] + b[i % cols];",
            "y[i] = y[i] + b[(i + 1) % cols];",
            add_scale_repeat_check,
        ),
        (
            "scale_elems: divided by the reciprocal",
            "x[i] = x[i] * by;",
            "x[i] = x[i] / (1.0f / by);",
            add_scale_repeat_check,
        ),
        (
            "repeat_rows: each repeat shifted by one column",
            "out[idx] = x[t * d + c % d];",
            "out[idx] = x[t * d + (c + 1) % d];",
            add_scale_repeat_check,
        ),
    ];
    let source = lmrr_kernels::cuda_source::SOURCE;
    for (i, &(label, from, to, check)) in controls.iter().enumerate() {
        assert_eq!(
            source.matches(from).count(),
            1,
            "control `{label}`: its target is not once in the CUDA source"
        );
        let bin = build(&format!("op_control_{i}"), &source.replace(from, to), false);
        let d: usize = check(&bin).iter().map(|(_, d)| d).sum();
        println!("negative control `{label}`: {d} differing values");
        assert!(
            d > 0,
            "control `{label}`: the emulated kernel gives the reference's bits anyway"
        );
    }
}
