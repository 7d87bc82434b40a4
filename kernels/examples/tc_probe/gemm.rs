//! The tensor-core GEMM kernels on the GPU: bit for bit against the CPU's
//! `tc_matmul` (every output of the small shapes, a sample of the large
//! ones), the same bits from every kernel shape and from a one-token
//! launch, then the time of each at an 8B model's shapes.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use lmrr_kernels::splitmix::SplitMix64;
use lmrr_kernels::tensor_core::{f32_to_bf16, tc_dot, tc_matmul, SM90_BF16};
use lmrr_kernels::Threads;

use super::Probe;

/// (name, tokens a block, rows a block, threads, dynamic shared memory,
/// input rounded to bf16 first): tc_gemm_* read x as f32, tc_mm_* its bf16
/// rounding from tc_round_bf16 (timed with it), as kernels/src/cuda/tc.rs
/// launches them.
const KERNELS: [(&str, usize, usize, u32, u32, bool); 6] = [
    ("tc_gemm_64x64", 64, 64, 128, 0, false),
    ("tc_mm_128x128", 128, 128, 256, 256 * 72 * 2 * 3, true),
    ("tc_mm_64x64", 64, 64, 128, 128 * 72 * 2 * 4, true),
    ("tc_mm_32x32", 32, 32, 128, 64 * 72 * 2 * 4, true),
    ("tc_mv_8", 8, 32, 128, 0, true),
    ("tc_mv_16", 16, 32, 128, 0, true),
];

/// Whether `kernel` serves k (tc_mm_*: a multiple of 8).
fn fits(kernel: usize, k: usize) -> bool {
    !KERNELS[kernel].5 || k.is_multiple_of(8)
}

struct Gemm<'a> {
    p: &'a Probe,
    x: CudaSlice<f32>,
    xb: CudaSlice<u16>,
    w: CudaSlice<u16>,
    y: CudaSlice<f32>,
    n: usize,
    rows: usize,
    k: usize,
}

impl<'a> Gemm<'a> {
    fn new(
        p: &'a Probe,
        x: &[f32],
        w: &[u16],
        n: usize,
        rows: usize,
        k: usize,
    ) -> Result<Self, String> {
        let s = p.ctx.default_stream();
        let e = |e: cudarc::driver::DriverError| format!("{e:?}");
        Ok(Self {
            p,
            x: s.clone_htod(x).map_err(e)?,
            xb: s.alloc_zeros::<u16>(x.len()).map_err(e)?,
            w: s.clone_htod(w).map_err(e)?,
            y: s.alloc_zeros::<f32>(n * rows).map_err(e)?,
            n,
            rows,
            k,
        })
    }

    fn launch(&mut self, kernel: usize, n: usize) -> Result<(), String> {
        let (name, bm, bn, threads, smem, rounds) = KERNELS[kernel];
        let load = |name: &str| {
            self.p
                .module
                .load_function(name)
                .map_err(|e| format!("{name}: {e:?}"))
        };
        let f = load(name)?;
        let s = self.p.ctx.default_stream();
        let (ni, ri, ki) = (n as i32, self.rows as i32, self.k as i32);
        if rounds {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| format!("{name}: {e:?}"))?;
            let round = load("tc_round_bf16")?;
            let count = (n * self.k) as i64;
            let cfg = LaunchConfig {
                grid_dim: ((n * self.k).div_ceil(256).min(4096) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = s.launch_builder(&round);
            l.arg(&self.x).arg(&mut self.xb).arg(&count);
            // SAFETY: x holds n·k floats (n ≤ self.n), xb as many bf16.
            unsafe { l.launch(cfg) }.map_err(|e| format!("tc_round_bf16: {e:?}"))?;
        }
        let cfg = LaunchConfig {
            grid_dim: (self.rows.div_ceil(bn) as u32, n.div_ceil(bm) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut l = s.launch_builder(&f);
        if rounds {
            l.arg(&self.xb);
        } else {
            l.arg(&self.x);
        }
        l.arg(&self.w).arg(&mut self.y).arg(&ni).arg(&ri).arg(&ki);
        // SAFETY: x (or xb) holds n·k values (n ≤ self.n), w rows·k bf16,
        // y n·rows floats.
        unsafe { l.launch(cfg) }.map_err(|e| format!("{name}: {e:?}"))?;
        Ok(())
    }

    fn output(&self) -> Result<Vec<f32>, String> {
        self.p
            .ctx
            .default_stream()
            .clone_dtoh(&self.y)
            .map_err(|e| format!("{e:?}"))
    }

    /// Median seconds of `reps` launches of `kernel` over all tokens.
    fn time(&mut self, kernel: usize, reps: usize) -> Result<f64, String> {
        let s = self.p.ctx.default_stream();
        self.launch(kernel, self.n)?;
        s.synchronize().map_err(|e| format!("{e:?}"))?;
        let mut t = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            for _ in 0..10 {
                self.launch(kernel, self.n)?;
            }
            s.synchronize().map_err(|e| format!("{e:?}"))?;
            t.push(t0.elapsed().as_secs_f64() / 10.0);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }
}

fn operands(n: usize, rows: usize, k: usize, seed: u64) -> (Vec<f32>, Vec<u16>) {
    let mut r = SplitMix64(seed);
    let x = r.uniform_vec(n * k, 2.0);
    let w = r
        .uniform_vec(rows * k, 0.05)
        .into_iter()
        .map(f32_to_bf16)
        .collect();
    (x, w)
}

/// Checks and times; prints a table; true when every check held.
pub fn run(p: &Probe) -> bool {
    match run_inner(p) {
        Ok(ok) => ok,
        Err(e) => {
            println!("tensor-core GEMM: error: {e}");
            false
        }
    }
}

fn run_inner(p: &Probe) -> Result<bool, String> {
    let th = Threads::new(
        std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .min(16),
    )
    .map_err(|e| format!("{e}"))?;
    let mut ok = true;
    println!("\n## tensor-core GEMM against the CPU model (tc_matmul)");
    // (tokens, rows, k): small shapes checked whole, k not a multiple of 16
    // (zeros past k) and of 8 (the scalar staging), tiles cut short.
    let shapes = [
        (1, 4096, 4096),
        (16, 4096, 14336),
        (7, 1000, 4100),
        (3, 999, 4098),
        (40, 2000, 4104),
        (33, 300, 776),
        (64, 512, 4096),
        (200, 257, 2056),
    ];
    for &(n, rows, k) in &shapes {
        let (x, w) = operands(n, rows, k, (n * 31 + rows * 7 + k) as u64);
        let mut want = vec![0.0f32; n * rows];
        tc_matmul(&th, &SM90_BF16, &x, n, &w, rows, k, &mut want);
        let mut g = Gemm::new(p, &x, &w, n, rows, k)?;
        for (kernel, (name, ..)) in KERNELS.iter().enumerate() {
            if !fits(kernel, k) {
                continue;
            }
            g.launch(kernel, n)?;
            let got = g.output()?;
            let bad = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            // Token 0 alone: the batch must not change its bits.
            g.launch(kernel, 1)?;
            let one = g.output()?;
            let bad1 = (0..rows)
                .filter(|&o| one[o].to_bits() != want[o].to_bits())
                .count();
            println!(
                "{name:<16} n {n:>3} rows {rows:>5} k {k:>5}: {bad} of {} outputs differ from the model; token 0 launched alone: {bad1} differ",
                n * rows
            );
            ok &= bad == 0 && bad1 == 0;
        }
    }
    // A large shape: every kernel the same bits, a sample against the model.
    let (n, rows, k) = (512, 4096, 4096);
    let (x, w) = operands(n, rows, k, 99);
    let mut g = Gemm::new(p, &x, &w, n, rows, k)?;
    let mut outs = Vec::new();
    for kernel in (0..KERNELS.len()).filter(|&kn| fits(kn, k)) {
        g.launch(kernel, n)?;
        outs.push(g.output()?);
    }
    let same = outs.iter().all(|o| {
        o.iter()
            .zip(&outs[0])
            .all(|(a, b)| a.to_bits() == b.to_bits())
    });
    let mut r = SplitMix64(5);
    let xb: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
    let sample = 4096;
    let bad = (0..sample)
        .filter(|_| {
            let (t, o) = (
                (r.next_u64() % n as u64) as usize,
                (r.next_u64() % rows as u64) as usize,
            );
            let m = tc_dot(&SM90_BF16, &xb[t * k..(t + 1) * k], &w[o * k..(o + 1) * k]);
            m.to_bits() != outs[0][t * rows + o].to_bits()
        })
        .count();
    println!("n {n} rows {rows} k {k}: the {} kernels for it give {} bits; {bad} of {sample} sampled outputs differ from the model", outs.len(), if same { "the same" } else { "DIFFERENT" });
    ok &= same && bad == 0;

    println!("\n## tensor-core GEMM speed (median of 5 × 10 launches; 8B shapes: qkv 6144x4096, gate+up 28672x4096, down 4096x14336)");
    println!(
        "{:<16} {:>5} {:>7} {:>7} {:>10} {:>9} {:>10}",
        "kernel", "n", "rows", "k", "us", "TFLOP/s", "W GB/s"
    );
    for &(rows, k) in &[(6144usize, 4096usize), (28672, 4096), (4096, 14336)] {
        for &n in &[1usize, 8, 16, 64, 512] {
            let (x, w) = operands(n, rows, k, 7);
            let mut g = Gemm::new(p, &x, &w, n, rows, k)?;
            for (kernel, (name, ..)) in KERNELS.iter().enumerate() {
                if !fits(kernel, k) {
                    continue;
                }
                let s = g.time(kernel, 5)?;
                println!(
                    "{name:<16} {n:>5} {rows:>7} {k:>7} {:>10.1} {:>9.1} {:>10.0}",
                    s * 1e6,
                    2.0 * (n * rows * k) as f64 / s / 1e12,
                    (rows * k * 2) as f64 / s / 1e9
                );
            }
        }
    }
    Ok(ok)
}
