//! The portable mode's device ops: each call copies its operands to the
//! device and back (weights too) and runs the one-thread (or one-warp)
//! reference kernels: the proof of arithmetic behind `Device::Cuda`, not a
//! fast path. matmul over every weight storage ([`MatmulKernel`] picks the
//! kernel `gpu_check` compares), RMSNorm, `det_exp`, SwiGLU, RoPE,
//! attention, and mini-v4's hyper-connection coefficients, stream mixes,
//! expert combine and indexer scores ([`crate::hyper`]).

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::{
    as_i32, drv, grid, launch, quant_code, resident, Gpu, GpuError, ONE_THREAD_MAX_HEAD_DIM,
};
use crate::matmul::{Matrix, Weights};
use crate::{AttnShape, AttnTask, RopeTable};

/// Which matmul kernel: the one-thread-per-output reference, or the fast
/// one-warp-per-output kernel in the same canonical order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    Thread,
    Warp,
    /// One warp per (row, tile of [`resident::MM_TOKENS`] tokens): the
    /// resident path's matmul for rows of many chunks.
    Tile,
    /// One block per (row, token tile), a row's chunks in flight at once:
    /// the resident path's matmul for up to 8 tokens.
    Rows,
    /// Staged tiles of 32 rows × 16 tokens: the resident path's matmul for
    /// more tokens.
    Gemm,
    /// `matmul_gemm` split over chunks, this many per block, its partials
    /// summed by `sum_chunks`: the resident path's form for steps whose
    /// tiles are too few to fill the device.
    GemmSplit(usize),
    /// `matmul_gemm_wide`: tiles of 64 rows × 32 tokens (256 threads).
    GemmWide,
    /// `matmul_gemm_wide` split over chunks, this many per block.
    GemmWideSplit(usize),
    /// `matmul_rows4`: `Rows` with four rows a block (wide matrices,
    /// [`resident::Tuning::rows4_min`]).
    Rows4,
}

impl Gpu {
    /// [`crate::matmul`] on the device (weights uploaded for this call), by
    /// the warp kernel; the one-thread-per-output kernel stays as the
    /// reference `gpu_check` holds it to ([`Gpu::matmul_with`]).
    pub fn matmul(&self, x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) -> Result<(), GpuError> {
        self.matmul_with(MatmulKernel::Warp, x, n, w, y, 1)
            .map(|_| ())
    }

    /// [`Gpu::matmul`] with the kernel chosen, launched `reps` times on
    /// operands uploaded once; returns the seconds the launches took
    /// (synchronized), for `gpu_check`'s kernel timings.
    pub fn matmul_with(
        &self,
        kernel: MatmulKernel,
        x: &[f32],
        n: usize,
        w: &Matrix,
        y: &mut [f32],
        reps: usize,
    ) -> Result<f64, GpuError> {
        if x.len() != n * w.cols || y.len() != n * w.rows {
            return Err(GpuError::Shape {
                what: "matmul",
                detail: format!(
                    "x {} (want {}), y {} (want {})",
                    x.len(),
                    n * w.cols,
                    y.len(),
                    n * w.rows
                ),
            });
        }
        if y.is_empty() {
            return Ok(0.0);
        }
        let (kind, bytes): (i32, Vec<u8>) = match w.w {
            Weights::F32(s) => (0, s.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Weights::Bf16(s) => (1, s.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Weights::Quant(q, s) => (quant_code(q), s.to_vec()),
        };
        let row_bytes = (bytes.len() / w.rows.max(1)) as i64;
        if let MatmulKernel::Gemm
        | MatmulKernel::GemmSplit(_)
        | MatmulKernel::GemmWide
        | MatmulKernel::GemmWideSplit(_)
        | MatmulKernel::Rows4 = kernel
        {
            return self.gemm_check(kernel, x, n, w, y, reps);
        }
        let s = &self.stream;
        let dx = s.clone_htod(x).map_err(drv)?;
        let dw = s.clone_htod(&bytes).map_err(drv)?;
        let mut dy = s.alloc_zeros::<f32>(y.len()).map_err(drv)?;
        let (ni, ri, ki) = (
            as_i32("matmul", n)?,
            as_i32("matmul", w.rows)?,
            as_i32("matmul", w.cols)?,
        );
        let (f, cfg) = match kernel {
            MatmulKernel::Thread => (&self.matmul, grid(n * w.rows)),
            MatmulKernel::Warp => (&self.matmul_warp, grid(n * w.rows * 32)),
            MatmulKernel::Tile => (
                &self.matmul_tile,
                grid(n.div_ceil(resident::MM_TOKENS) * w.rows * 32),
            ),
            MatmulKernel::Gemm
            | MatmulKernel::GemmSplit(_)
            | MatmulKernel::GemmWide
            | MatmulKernel::GemmWideSplit(_)
            | MatmulKernel::Rows4 => {
                return Err(GpuError::Shape {
                    what: "matmul",
                    detail: "the resident kernels are launched by gemm_check".into(),
                })
            }
            MatmulKernel::Rows => {
                launch::width_fits("matmul_rows", w.cols, resident::MR_MAX_CHUNKS)?;
                (
                    &self.matmul_rows,
                    LaunchConfig {
                        grid_dim: (n.div_ceil(resident::MM_TOKENS) as u32 * w.rows as u32, 1, 1),
                        block_dim: (resident::MR_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            }
        };
        // The launch grid counts threads (or blocks) in 32 bits.
        as_i32("matmul", n * w.rows * 32)?;
        s.synchronize().map_err(drv)?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            let mut b = s.launch_builder(f);
            b.arg(&kind)
                .arg(&dx)
                .arg(&dw)
                .arg(&mut dy)
                .arg(&ni)
                .arg(&ri)
                .arg(&ki)
                .arg(&row_bytes);
            // SAFETY: the argument list matches `matmul` and `matmul_warp` in
            // kernels/cuda/; every index they form is below n·rows, n·k or
            // rows·row_bytes.
            unsafe { b.launch(cfg) }.map_err(drv)?;
        }
        s.synchronize().map_err(drv)?;
        let secs = t0.elapsed().as_secs_f64();
        s.memcpy_dtoh(&dy, y).map_err(drv)?;
        Ok(secs)
    }

    /// [`crate::rms_norm`] on the device.
    pub fn rms_norm(
        &self,
        x: &[f32],
        w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        if w.is_empty() || !x.len().is_multiple_of(w.len()) || out.len() != x.len() {
            return Err(GpuError::Shape {
                what: "rms_norm",
                detail: format!("x {}, w {}, out {}", x.len(), w.len(), out.len()),
            });
        }
        if x.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let (dx, dw) = (s.clone_htod(x).map_err(drv)?, s.clone_htod(w).map_err(drv)?);
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let rows = as_i32("rms_norm", x.len() / w.len())?;
        let d = as_i32("rms_norm", w.len())?;
        let mut b = s.launch_builder(&self.rms_norm);
        b.arg(&dx)
            .arg(&dw)
            .arg(&mut dout)
            .arg(&rows)
            .arg(&d)
            .arg(&eps);
        // SAFETY: matches `rms_norm` in kernels/cuda/; rows·d = x.len().
        unsafe { b.launch(grid(x.len() / w.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::exp_slice`] on the device.
    pub fn exp_slice(&self, x: &[f32], out: &mut [f32]) -> Result<(), GpuError> {
        self.map(&self.exp_slice, "exp_slice", &[x], out)
    }

    /// [`crate::swiglu`] on the device.
    pub fn swiglu(&self, g: &[f32], u: &[f32], out: &mut [f32]) -> Result<(), GpuError> {
        self.map(&self.swiglu, "swiglu", &[g, u], out)
    }

    fn map(
        &self,
        f: &CudaFunction,
        what: &'static str,
        ins: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        if ins.iter().any(|i| i.len() != out.len()) {
            return Err(GpuError::Shape {
                what,
                detail: format!(
                    "inputs {:?}, out {}",
                    ins.iter().map(|i| i.len()).collect::<Vec<_>>(),
                    out.len()
                ),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let dins = ins
            .iter()
            .map(|i| s.clone_htod(*i).map_err(drv))
            .collect::<Result<Vec<_>, _>>()?;
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let n = as_i32(what, out.len())?;
        let mut b = s.launch_builder(f);
        for d in &dins {
            b.arg(d);
        }
        b.arg(&mut dout).arg(&n);
        // SAFETY: matches the element-wise kernels in kernels/cuda/ (inputs,
        // output, count); every index is below `n`.
        unsafe { b.launch(grid(out.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::rope`] of one row (whole heads) at `pos`, in place.
    pub fn rope(&self, table: &RopeTable, x: &mut [f32], pos: usize) -> Result<(), GpuError> {
        let d = table.head_dim();
        if !x.len().is_multiple_of(d) {
            return Err(GpuError::Shape {
                what: "rope",
                detail: format!("row of {} values is not whole heads of {d}", x.len()),
            });
        }
        if x.is_empty() {
            return Ok(());
        }
        let (c, sn) = table.row(pos);
        let s = &self.stream;
        let mut dx = s.clone_htod(x).map_err(drv)?;
        let (dc, ds) = (
            s.clone_htod(c).map_err(drv)?,
            s.clone_htod(sn).map_err(drv)?,
        );
        let (width, di) = (as_i32("rope", x.len())?, as_i32("rope", d)?);
        let mut b = s.launch_builder(&self.rope);
        b.arg(&mut dx).arg(&dc).arg(&ds).arg(&width).arg(&di);
        // SAFETY: matches `rope` in kernels/cuda/; threads cover width / 2 pairs.
        unsafe { b.launch(grid(x.len() / 2)) }.map_err(drv)?;
        s.memcpy_dtoh(&dx, x).map_err(drv)
    }

    /// [`crate::attention`] on the device: each task's keys and values
    /// `0..=pos` are gathered from its [`crate::KvView`] into one buffer.
    pub fn attention(
        &self,
        tasks: &[AttnTask],
        shape: &AttnShape,
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        self.attention_window(tasks, shape, scale, None, out)
    }

    /// [`crate::attention_window`] on the device: as [`Gpu::attention`],
    /// each task attending `first_key(pos, window) ..= pos` (the rows below
    /// are gathered too, and not read).
    pub fn attention_window(
        &self,
        tasks: &[AttnTask],
        shape: &AttnShape,
        scale: f32,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let win = crate::cuda::ops::attention::window_arg(window)?;
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let bad = shape.n_kv_heads == 0
            || !shape.n_heads.is_multiple_of(shape.n_kv_heads)
            || shape.head_dim > ONE_THREAD_MAX_HEAD_DIM
            || out.len() != tasks.len() * qd
            || tasks
                .iter()
                .any(|t| t.q.len() != qd || t.pos >= t.kv.capacity());
        if bad {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!(
                    "{} tasks, out {}, heads {}/{} × {} (head_dim ≤ {ONE_THREAD_MAX_HEAD_DIM})",
                    tasks.len(),
                    out.len(),
                    shape.n_heads,
                    shape.n_kv_heads,
                    shape.head_dim
                ),
            });
        }
        if tasks.is_empty() {
            return Ok(());
        }
        let mut q = Vec::with_capacity(tasks.len() * qd);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        let (mut offs, mut pos) = (
            Vec::with_capacity(tasks.len()),
            Vec::with_capacity(tasks.len()),
        );
        for t in tasks {
            q.extend_from_slice(t.q);
            offs.push((k.len() / kvd) as i64);
            pos.push(as_i32("attention", t.pos)?);
            for j in 0..=t.pos {
                k.extend_from_slice(t.kv.key(j, kvd));
                v.extend_from_slice(t.kv.value(j, kvd));
            }
        }
        let s = &self.stream;
        let (dq, dk, dv) = (
            s.clone_htod(&q).map_err(drv)?,
            s.clone_htod(&k).map_err(drv)?,
            s.clone_htod(&v).map_err(drv)?,
        );
        let (doff, dpos) = (
            s.clone_htod(&offs).map_err(drv)?,
            s.clone_htod(&pos).map_err(drv)?,
        );
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let n = as_i32("attention", tasks.len())?;
        as_i32("attention", tasks.len() * shape.n_heads)?;
        let (nh, nkv, hd) = (
            as_i32("attention", shape.n_heads)?,
            as_i32("attention", shape.n_kv_heads)?,
            as_i32("attention", shape.head_dim)?,
        );
        let mut b = s.launch_builder(&self.attention);
        b.arg(&dq)
            .arg(&dk)
            .arg(&dv)
            .arg(&doff)
            .arg(&dpos)
            .arg(&mut dout)
            .arg(&n)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&scale)
            .arg(&win);
        // SAFETY: matches `attention` in kernels/cuda/; task t reads rows
        // offs[t] ..= offs[t] + pos[t] of k and v, all gathered above.
        unsafe { b.launch(grid(tasks.len() * shape.n_heads)) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::hc_coeffs`] on the device, one thread per token.
    pub fn hc_coeffs(
        &self,
        raw: &[f32],
        h: usize,
        iters: usize,
        pre: &mut [f32],
        post: &mut [f32],
        res: &mut [f32],
    ) -> Result<(), GpuError> {
        let w = crate::hyper::hc_raw_width(h);
        let n = raw.len() / w.max(1);
        if raw.len() != n * w || pre.len() != n * h || post.len() != n * h || res.len() != n * h * h
        {
            return Err(GpuError::Shape {
                what: "hc_coeffs",
                detail: format!(
                    "raw {} (tokens of {w}), pre {}, post {}, res {} for h = {h}",
                    raw.len(),
                    pre.len(),
                    post.len(),
                    res.len()
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let draw = s.clone_htod(raw).map_err(drv)?;
        let mut dpre = s.alloc_zeros::<f32>(pre.len()).map_err(drv)?;
        let mut dpost = s.alloc_zeros::<f32>(post.len()).map_err(drv)?;
        let mut dres = s.alloc_zeros::<f32>(res.len()).map_err(drv)?;
        let (ni, hi, it) = (
            as_i32("hc_coeffs", n)?,
            as_i32("hc_coeffs", h)?,
            as_i32("hc_coeffs", iters)?,
        );
        as_i32("hc_coeffs", w)?; // h·h and 2h + h·h are formed in 32 bits
        let eps = crate::hyper::HC_EPS;
        let mut b = s.launch_builder(&self.hc_coeffs);
        b.arg(&draw)
            .arg(&mut dpre)
            .arg(&mut dpost)
            .arg(&mut dres)
            .arg(&ni)
            .arg(&hi)
            .arg(&it)
            .arg(&eps);
        // SAFETY: matches `hc_coeffs` in kernels/cuda/; token t reads raw[t·w ..
        // (t+1)·w] and writes h, h and h·h values of pre, post and res.
        unsafe { b.launch(grid(n)) }.map_err(drv)?;
        s.memcpy_dtoh(&dpre, pre).map_err(drv)?;
        s.memcpy_dtoh(&dpost, post).map_err(drv)?;
        s.memcpy_dtoh(&dres, res).map_err(drv)
    }

    /// [`crate::hc_pre`] on the device, one thread per output.
    pub fn hc_pre(
        &self,
        x: &[f32],
        pre: &[f32],
        h: usize,
        d: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let n = out.len() / d.max(1);
        if x.len() != n * h * d || pre.len() != n * h || out.len() != n * d {
            return Err(GpuError::Shape {
                what: "hc_pre",
                detail: format!(
                    "x {}, pre {}, out {} for h = {h}, d = {d}",
                    x.len(),
                    pre.len(),
                    out.len()
                ),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let (dx, dp) = (
            s.clone_htod(x).map_err(drv)?,
            s.clone_htod(pre).map_err(drv)?,
        );
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let (ni, hi, di) = (
            as_i32("hc_pre", n)?,
            as_i32("hc_pre", h)?,
            as_i32("hc_pre", d)?,
        );
        as_i32("hc_pre", out.len())?; // the launch grid counts outputs in 32 bits
        let mut b = s.launch_builder(&self.hc_pre);
        b.arg(&dx)
            .arg(&dp)
            .arg(&mut dout)
            .arg(&ni)
            .arg(&hi)
            .arg(&di);
        // SAFETY: matches `hc_pre` in kernels/cuda/; every index is below n·h·d,
        // n·h or n·d.
        unsafe { b.launch(grid(out.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::hc_post`] on the device, one thread per output.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post(
        &self,
        x: &[f32],
        res: &[f32],
        post: &[f32],
        y: &[f32],
        h: usize,
        d: usize,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let n = y.len() / d.max(1);
        if x.len() != n * h * d
            || res.len() != n * h * h
            || post.len() != n * h
            || y.len() != n * d
            || out.len() != n * h * d
        {
            return Err(GpuError::Shape {
                what: "hc_post",
                detail: format!(
                    "x {}, res {}, post {}, y {}, out {} for h = {h}, d = {d}",
                    x.len(),
                    res.len(),
                    post.len(),
                    y.len(),
                    out.len()
                ),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let (dx, dr) = (
            s.clone_htod(x).map_err(drv)?,
            s.clone_htod(res).map_err(drv)?,
        );
        let (dp, dy) = (
            s.clone_htod(post).map_err(drv)?,
            s.clone_htod(y).map_err(drv)?,
        );
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let (ni, hi, di) = (
            as_i32("hc_post", n)?,
            as_i32("hc_post", h)?,
            as_i32("hc_post", d)?,
        );
        as_i32("hc_post", out.len())?; // the launch grid counts outputs in 32 bits
        let mut b = s.launch_builder(&self.hc_post);
        b.arg(&dx)
            .arg(&dr)
            .arg(&dp)
            .arg(&dy)
            .arg(&mut dout)
            .arg(&ni)
            .arg(&hi)
            .arg(&di);
        // SAFETY: matches `hc_post` in kernels/cuda/; every index is below
        // n·h·d, n·h·h, n·h or n·d.
        unsafe { b.launch(grid(out.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::moe_combine`] of one token on the device.
    pub fn moe_combine(
        &self,
        base: &[f32],
        gates: &[f32],
        ys: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        self.moe_combine_many(base.len(), base, &[(gates, ys)], out)
    }

    /// [`crate::moe_combine`] of `tokens.len()` tokens in one launch: token
    /// `t` combines `base[t·d..]` with its `(gates, ys)` into `out[t·d..]`.
    pub fn moe_combine_many(
        &self,
        d: usize,
        base: &[f32],
        tokens: &[(&[f32], &[&[f32]])],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let n = tokens.len();
        let bad = base.len() != n * d
            || out.len() != n * d
            || tokens
                .iter()
                .any(|(g, ys)| g.len() != ys.len() || ys.iter().any(|y| y.len() != d));
        if bad {
            return Err(GpuError::Shape {
                what: "moe_combine",
                detail: format!(
                    "{n} tokens of {d}: base {}, out {}, gates {:?}, expert rows {:?}",
                    base.len(),
                    out.len(),
                    tokens.iter().map(|t| t.0.len()).collect::<Vec<_>>(),
                    tokens
                        .iter()
                        .map(|t| t.1.iter().map(|y| y.len()).collect::<Vec<_>>())
                        .collect::<Vec<_>>()
                ),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let mut gates = Vec::new();
        let mut ys = Vec::new();
        let mut off = Vec::with_capacity(n + 1);
        off.push(0i32);
        for (g, y) in tokens {
            gates.extend_from_slice(g);
            for row in y.iter() {
                ys.extend_from_slice(row);
            }
            off.push(as_i32("moe_combine", gates.len())?);
        }
        // A token with no routed expert reads nothing; the buffers still
        // need one element each (a zero-byte allocation is an error).
        if gates.is_empty() {
            gates.push(0.0);
            ys.push(0.0);
        }
        as_i32("moe_combine", out.len())?; // the launch grid counts outputs in 32 bits
        let s = &self.stream;
        let (db, dg) = (
            s.clone_htod(base).map_err(drv)?,
            s.clone_htod(&gates).map_err(drv)?,
        );
        let (dy, doff) = (
            s.clone_htod(&ys).map_err(drv)?,
            s.clone_htod(&off).map_err(drv)?,
        );
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let (ni, di) = (as_i32("moe_combine", n)?, as_i32("moe_combine", d)?);
        let mut b = s.launch_builder(&self.moe_combine);
        b.arg(&db)
            .arg(&dg)
            .arg(&dy)
            .arg(&doff)
            .arg(&mut dout)
            .arg(&ni)
            .arg(&di);
        // SAFETY: matches `moe_combine` in kernels/cuda/; token t reads gates
        // and rows off[t] .. off[t+1], all packed above, and base/out row t.
        unsafe { b.launch(grid(out.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::index_scores`] on the device, one thread per key.
    pub fn index_scores(
        &self,
        q: &[f32],
        w: &[f32],
        dim: usize,
        keys: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let heads = w.len();
        if q.len() != heads * dim || out.len() != keys.len() || keys.iter().any(|k| k.len() != dim)
        {
            return Err(GpuError::Shape {
                what: "index_scores",
                detail: format!(
                    "q {} for {heads} heads × {dim}, {} keys, out {}",
                    q.len(),
                    keys.len(),
                    out.len()
                ),
            });
        }
        if out.is_empty() {
            return Ok(());
        }
        let mut packed = Vec::with_capacity(keys.len() * dim);
        for k in keys {
            packed.extend_from_slice(k);
        }
        // One element at least in each buffer (heads or dim may be 0).
        let pad = |v: &[f32]| if v.is_empty() { vec![0.0] } else { v.to_vec() };
        let s = &self.stream;
        let (dq, dw) = (
            s.clone_htod(&pad(q)).map_err(drv)?,
            s.clone_htod(&pad(w)).map_err(drv)?,
        );
        let dk = s.clone_htod(&pad(&packed)).map_err(drv)?;
        let mut dout = s.alloc_zeros::<f32>(out.len()).map_err(drv)?;
        let (mi, hi, di) = (
            as_i32("index_scores", keys.len())?,
            as_i32("index_scores", heads)?,
            as_i32("index_scores", dim)?,
        );
        let mut b = s.launch_builder(&self.index_scores);
        b.arg(&dq)
            .arg(&dw)
            .arg(&dk)
            .arg(&mut dout)
            .arg(&mi)
            .arg(&hi)
            .arg(&di);
        // SAFETY: matches `index_scores` in kernels/cuda/; key s reads
        // keys[s·dim .. (s+1)·dim], q below heads·dim, w below heads.
        unsafe { b.launch(grid(keys.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }
}
