//! The check and measurement harness (not the engine's path): per-call
//! forms of the resident kernels on uploaded operands, which
//! `kernels/examples/gpu_check/` holds to the one-thread references
//! (`gemm_check`, `rms_norm_resident`, `attention_resident`,
//! [`DecodeRopeCase`]), and the device's physical limits for `lmrr bench`
//! (`copy_bandwidth`, `fma_peak`).

use cudarc::driver::LaunchConfig;

use crate::cuda::launch::*;
use crate::cuda::ops::attention::{AttnKernel, PageTable};
use crate::cuda::ops::attention_split::SplitKv;
use crate::cuda::ops::matmul::GemmTiles;
use crate::cuda::ops::norm::NormKernel;
use crate::cuda::split::MmOut;
use crate::cuda::{Gpu, GpuError};
use crate::matmul::Matrix;
use crate::paged::PageLayout;

/// One decode step's attention on host operands (gpu_check), by
/// [`DecodeRopeCase::run`].
pub struct DecodeRopeCase<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_len: usize,
    /// Each token's q (n · qd), unrotated k and v rows (n · kvd).
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// The RoPE tables (positions × head_dim / 2 each).
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// Whole pages of one layer (page_len · 2 · kvd floats each).
    pub store: &'a [f32],
    /// Each page-table entry's page in `store`; token t's list starts at
    /// `seq_off[t]`; its position `pos[t]`, written into page
    /// `dst_page[t]`, slot `pos[t] % page_len`.
    pub index: &'a [u64],
    pub seq_off: &'a [u64],
    pub pos: &'a [u64],
    pub dst_page: &'a [u64],
    /// Each token's sliding window (`None`: full causal).
    pub window: Option<usize>,
}

impl DecodeRopeCase<'_> {
    /// Runs the step twice on the device from the same inputs: `rope_kv`
    /// then attention (the kernel [`Gpu::attention_paged`] picks), and
    /// [`Gpu::attention_decode_rope`] (the kernel
    /// `attention_decode_rope_qs`); returns each path's attention output,
    /// rotated q, rotated K rows and pages.
    pub fn run(&self, gpu: &Gpu) -> Result<[[Vec<f32>; 4]; 2], GpuError> {
        let n = self.pos.len();
        let shape = crate::AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let layout = crate::paged::PageLayout {
            page_len: self.page_len,
            layers: 1,
            kv_dim: kvd,
            aux_dim: 0,
        };
        let pf = (self.page_len * 2 * kvd) as u64 * 4;
        let slot: Vec<u64> = self.pos.iter().map(|p| p % self.page_len as u64).collect();
        let tabs = (gpu.upload(self.cos, "cos")?, gpu.upload(self.sin, "sin")?);
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let mut outs: Vec<[Vec<f32>; 4]> = Vec::new();
        for fused in [false, true] {
            let store = gpu.upload(self.store, "pages")?;
            let table: Vec<u64> = self.index.iter().map(|i| store.ptr + i * pf).collect();
            let dst: Vec<u64> = self.dst_page.iter().map(|i| store.ptr + i * pf).collect();
            let (dq, dk, dv) = (
                gpu.upload(self.q, "q")?,
                gpu.upload(self.k, "k")?,
                gpu.upload(self.v, "v")?,
            );
            let kout = gpu.alloc(n * kvd * 4, "k out")?;
            let out = gpu.alloc(n * qd * 4, "out")?;
            let (dt, dso, dpos, ddst, dslot) = (
                gpu.upload(&table, "table")?,
                gpu.upload(self.seq_off, "seq_off")?,
                gpu.upload(self.pos, "pos")?,
                gpu.upload(&dst, "dst")?,
                gpu.upload(&slot, "slot")?,
            );
            let pt = PageTable {
                pages: dt.ptr,
                seq_off: dso.ptr,
                pos: dpos.ptr,
                groups: 0,
                n_groups: 0,
            };
            let kb = if fused {
                gpu.attention_decode_rope(
                    (dq.ptr, dk.ptr, dv.ptr),
                    kout.ptr,
                    (&tabs.0, &tabs.1),
                    pt,
                    ddst.ptr,
                    dslot.ptr,
                    n,
                    &shape,
                    layout,
                    0,
                    scale,
                    self.window,
                    out.ptr,
                )?;
                &kout
            } else {
                gpu.rope_kv(
                    (MmOut::at(dq.ptr), MmOut::at(dk.ptr), MmOut::at(dv.ptr)),
                    (&tabs.0, &tabs.1),
                    dpos.ptr,
                    ddst.ptr,
                    dslot.ptr,
                    n,
                    qd,
                    self.head_dim,
                    layout,
                    0,
                )?;
                gpu.attention_paged(
                    dq.ptr,
                    pt,
                    n,
                    &shape,
                    layout,
                    0,
                    scale,
                    self.window,
                    out.ptr,
                    None,
                )?;
                &dk
            };
            let mut r = [
                vec![0.0; n * qd],
                vec![0.0; n * qd],
                vec![0.0; n * kvd],
                vec![0.0; self.store.len()],
            ];
            gpu.dtoh(out.ptr, &mut r[0])?;
            gpu.dtoh(dq.ptr, &mut r[1])?;
            gpu.dtoh(kb.ptr, &mut r[2])?;
            gpu.dtoh(store.ptr, &mut r[3])?;
            outs.push(r);
        }
        let b = outs.pop().unwrap_or_default();
        let a = outs.pop().unwrap_or_default();
        Ok([a, b])
    }
}

impl Gpu {
    /// Device-to-device copy bandwidth over a `bytes` buffer: bytes moved
    /// (read plus written) per second, median of `repeats`.
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64, GpuError> {
        let (a, b) = (
            self.alloc(bytes, "bandwidth source")?,
            self.alloc(bytes, "bandwidth target")?,
        );
        self.dtod(a.ptr, b.ptr, bytes)?;
        self.sync()?;
        let mut t: Vec<f64> = (0..repeats.max(1))
            .map(|_| {
                let t0 = std::time::Instant::now();
                self.dtod(a.ptr, b.ptr, bytes)?;
                self.sync()?;
                Ok(t0.elapsed().as_secs_f64())
            })
            .collect::<Result<_, GpuError>>()?;
        t.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / t[t.len() / 2])
    }

    /// FP32 FMA rate in FLOP/s (CUDA cores; 2 FLOPs per fma), median of
    /// `repeats` launches filling the device many times over.
    pub fn fma_peak(&self, repeats: usize) -> Result<f64, GpuError> {
        let (blocks, threads, iters) = (132 * 64u32, 256u32, 4096i32);
        let out = self.alloc((blocks * threads) as usize * 4, "fma_peak")?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let run = || -> Result<f64, GpuError> {
            let t0 = std::time::Instant::now();
            let mut b = self.kernel(&self.res.fma_peak)?;
            let (a, c) = (0.999_f32, 0.001_f32);
            b.arg(&out.ptr).arg(&iters).arg(&a).arg(&c);
            // SAFETY: matches `fma_peak`; out holds blocks·threads floats.
            unsafe { b.launch(cfg) }?;
            self.sync()?;
            Ok(t0.elapsed().as_secs_f64())
        };
        run()?;
        let mut t: Vec<f64> = (0..repeats.max(1))
            .map(|_| run())
            .collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        let flops = 2.0 * 8.0 * iters as f64 * (blocks * threads) as f64;
        Ok(flops / t[t.len() / 2])
    }

    /// `matmul_gemm`, whole or split ([`super::MatmulKernel`]), on uploaded
    /// operands, `reps` times (synchronized); the seconds they took.
    pub(crate) fn gemm_check(
        &self,
        kernel: super::MatmulKernel,
        x: &[f32],
        n: usize,
        w: &Matrix,
        y: &mut [f32],
        reps: usize,
    ) -> Result<f64, GpuError> {
        let dw = self.upload_matrix(w, "gemm check weights")?;
        let dx = self.upload(x, "gemm check input")?;
        let dy = self.alloc(y.len() * 4, "gemm check output")?;
        let chunks = w.cols.div_ceil(64);
        use super::MatmulKernel as K;
        let tiles = match kernel {
            K::GemmWide | K::GemmWideSplit(_) => GemmTiles::Wide,
            _ => GemmTiles::Narrow,
        };
        if kernel == K::Rows4 {
            self.sync()?;
            let t0 = std::time::Instant::now();
            for _ in 0..reps.max(1) {
                self.rows4_launch(dx.ptr, n, &dw, dy.ptr)?;
            }
            self.sync()?;
            let secs = t0.elapsed().as_secs_f64();
            self.dtoh(dy.ptr, y)?;
            return Ok(secs);
        }
        let split = match kernel {
            K::GemmSplit(cpb) | K::GemmWideSplit(cpb) => {
                let part = self.alloc(chunks * n * w.rows * 4, "gemm check partials")?;
                Some((part, cpb))
            }
            _ => None,
        };
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            let sp = split.as_ref().map(|(p, c)| (p.ptr, *c));
            self.gemm_launch(dx.ptr, n, &dw, dy.ptr, tiles, sp)?;
        }
        self.sync()?;
        let secs = t0.elapsed().as_secs_f64();
        self.dtoh(dy.ptr, y)?;
        Ok(secs)
    }

    /// [`crate::rms_norm`] by `rms_norm_warp`, or by `norm_block` when
    /// `block`; with `add`, of `x + add` (the residual add first: `add_norm`
    /// or `norm_block`'s add), the sum also written back into `sum`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_resident(
        &self,
        x: &[f32],
        add: Option<(&[f32], &mut [f32])>,
        w: &[f32],
        eps: f32,
        kernel: NormKernel,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        if w.is_empty() || !x.len().is_multiple_of(w.len()) || out.len() != x.len() {
            return Err(GpuError::Shape {
                what: "rms_norm",
                detail: format!("x {}, w {}, out {}", x.len(), w.len(), out.len()),
            });
        }
        let (dx, dw) = (self.upload(x, "x")?, self.upload(w, "w")?);
        let dout = self.alloc(out.len() * 4, "out")?;
        let (rows, d) = (x.len() / w.len(), w.len());
        let dy = match &add {
            Some((y, _)) if y.len() == x.len() => Some(self.upload(y, "y")?),
            Some(_) => {
                return Err(GpuError::Shape {
                    what: "add_norm",
                    detail: "y is not x's size".into(),
                })
            }
            None => None,
        };
        let yp = dy.as_ref().map(|b| b.ptr);
        let yo = yp.map(MmOut::at);
        match kernel {
            NormKernel::Block | NormKernel::Reg | NormKernel::RegLf => {
                self.norm_blocks(kernel, dx.ptr, yo, &dw, rows, d, eps, dout.ptr)?
            }
            NormKernel::Warp => self.norm_warp(dx.ptr, yp, &dw, rows, d, eps, dout.ptr)?,
        }
        if let Some((_, sum)) = add {
            self.dtoh(dx.ptr, sum)?;
        }
        self.dtoh(dout.ptr, out)
    }

    /// [`crate::attention_window`] by the kernel named: each sequence's keys and
    /// values are copied into device pages of `page_len` positions (layer 0
    /// of a one-layer layout), in a page order other than the positions'
    /// (the table, not the memory order, must decide). A sequence is a task,
    /// or for `Prefill` a run of consecutive tasks over one `KvView`
    /// (grouped by up to [`PF_TQ`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_resident(
        &self,
        tasks: &[crate::AttnTask],
        shape: &crate::AttnShape,
        scale: f32,
        window: Option<usize>,
        page_len: usize,
        kernel: AttnKernel,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        self.attention_resident_timed(tasks, shape, scale, window, page_len, kernel, out, 1)
            .map(|_| ())
    }

    /// [`Gpu::attention_resident`] launched `reps` times (at least once) on
    /// the same uploaded operands; returns the seconds per launch, from
    /// the first launch queued to the last one done (a figure, not a check:
    /// the device is shared).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_resident_timed(
        &self,
        tasks: &[crate::AttnTask],
        shape: &crate::AttnShape,
        scale: f32,
        window: Option<usize>,
        page_len: usize,
        kernel: AttnKernel,
        out: &mut [f32],
        reps: usize,
    ) -> Result<f64, GpuError> {
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        if out.len() != tasks.len() * qd || tasks.iter().any(|t| t.q.len() != qd) || page_len == 0 {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!("{} tasks, out {}", tasks.len(), out.len()),
            });
        }
        let layout = PageLayout {
            page_len,
            layers: 1,
            kv_dim: kvd,
            aux_dim: 0,
        };
        let pf = layout.page_floats();
        // Sequences: for `Prefill`, each run of consecutive tasks over the
        // same rows (one `KvView`) is one sequence, its pages shared and
        // its tasks grouped by PF_TQ; otherwise every task its own.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            match runs.last_mut() {
                Some((a, c)) if kernel.is_prefill() && std::ptr::eq(tasks[*a].kv, t.kv) => *c += 1,
                _ => runs.push((i, 1)),
            }
        }
        let run_pos: Vec<usize> = runs
            .iter()
            .map(|&(a, c)| tasks[a..a + c].iter().map(|t| t.pos).max().unwrap_or(0))
            .collect();
        // Pages of all sequences, stored in reverse order of need.
        let counts: Vec<usize> = run_pos.iter().map(|p| (p + 1).div_ceil(page_len)).collect();
        let total: usize = counts.iter().sum();
        let mut host = vec![0.0f32; total.max(1) * pf];
        let mut page_of = Vec::with_capacity(total);
        let mut next = total;
        for (&(a, _), &pos) in runs.iter().zip(&run_pos) {
            let kv = tasks[a].kv;
            for b in 0..(pos + 1).div_ceil(page_len) {
                next -= 1;
                page_of.push(next);
                let page = &mut host[next * pf..(next + 1) * pf];
                for s in 0..page_len {
                    let j = b * page_len + s;
                    if j > pos {
                        break;
                    }
                    page[s * kvd..(s + 1) * kvd].copy_from_slice(kv.key(j, kvd));
                    page[(page_len + s) * kvd..(page_len + s + 1) * kvd]
                        .copy_from_slice(kv.value(j, kvd));
                }
            }
        }
        let dpages = self.upload(&host, "pages")?;
        let mut ins: Vec<u64> = page_of
            .iter()
            .map(|&p| dpages.ptr + (p * pf * 4) as u64)
            .collect();
        let mut seq_off = Vec::with_capacity(tasks.len());
        let mut groups = Vec::new();
        let mut off = 0u64;
        for (&(a, c), &pages) in runs.iter().zip(&counts) {
            seq_off.extend(std::iter::repeat_n(off, c));
            off += pages as u64;
            for g in (0..c).step_by(PF_TQ) {
                groups.push(((a + g) as u64) << 32 | PF_TQ.min(c - g) as u64);
            }
        }
        let pages_len = ins.len();
        ins.extend(&seq_off);
        ins.extend(tasks.iter().map(|t| t.pos as u64));
        ins.extend(&groups);
        let q: Vec<f32> = tasks.iter().flat_map(|t| t.q.iter().copied()).collect();
        let (din, dq) = (self.upload(&ins, "table")?, self.upload(&q, "q")?);
        let dout = self.alloc(out.len() * 4, "out")?;
        let at = |i: usize| din.ptr + 8 * i as u64;
        let table = PageTable {
            pages: at(0),
            seq_off: at(pages_len),
            pos: at(pages_len + tasks.len()),
            groups: at(pages_len + 2 * tasks.len()),
            n_groups: if kernel.is_prefill() { groups.len() } else { 0 },
        };
        // The split form's scratch, for the longest task's walk.
        let cap_tiles = SplitKv::tiles_for(tasks.iter().map(|t| t.pos).max().unwrap_or(0));
        let scratch = if kernel == AttnKernel::Split {
            let floats = SplitKv::floats(tasks.len() * shape.n_heads, cap_tiles, shape.head_dim);
            Some(self.alloc(floats * 4, "split scratch")?)
        } else {
            None
        };
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            match &scratch {
                Some(s) => self.attention_split(
                    dq.ptr,
                    table,
                    tasks.len(),
                    shape,
                    layout,
                    0,
                    scale,
                    window,
                    dout.ptr,
                    SplitKv {
                        addr: s.ptr,
                        cap_tiles,
                    },
                )?,
                None => self.attention_with(
                    kernel,
                    dq.ptr,
                    table,
                    tasks.len(),
                    shape,
                    layout,
                    0,
                    scale,
                    window,
                    dout.ptr,
                )?,
            }
        }
        self.sync()?;
        let per = t0.elapsed().as_secs_f64() / reps.max(1) as f64;
        self.dtoh(dout.ptr, out)?;
        Ok(per)
    }
}
