//! CUDA mirror of the canonical kernels (feature `cuda`): the same ops, by the
//! same names, compiled from `kernels/cuda/kernels.cu` by NVRTC through
//! cudarc, with `--fmad=false` so that no multiply-add is contracted and every
//! FMA is an explicit `fmaf` where the CPU code has one. One GPU thread
//! computes one output in the scalar reference's order, so each op returns the
//! CPU fast path's bits exactly (contract invariant I6, checked by
//! `kernels/examples/gpu_check.rs` on a device).
//!
//! The CUDA libraries are loaded at run time: a build needs no CUDA, and
//! [`Gpu::open`] returns an error (never panics) where no driver or device is
//! present. This mirror covers matmul over every weight storage, RMSNorm,
//! SwiGLU, `det_exp`, RoPE, attention, and mini-v4's hyper-connection
//! coefficients (sigmoid, Sinkhorn–Knopp), stream mixes, expert combine and
//! indexer scores ([`crate::hyper`]). Each call copies its operands to
//! the device and back (weights too): it is the portable mode's proof of
//! arithmetic, not a fast path.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::matmul::{Matrix, Weights};
use crate::quant::QuantKind;
use crate::{AttnShape, AttnTask, RopeTable};

pub mod buf;
pub mod graph;
pub mod harness;
pub(crate) mod launch;
pub mod ops;
pub mod overlap;
pub mod resident;
pub mod split;
pub mod tuning;

/// Largest head dimension the attention kernel's per-thread arrays hold.
pub const MAX_HEAD_DIM: usize = 256;

pub use crate::cuda_source::{negative_controls, Control, ANY_CASE, CONTROL_CASES, SOURCE};

/// Whether libnvrtc can be loaded here (no GPU needed).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library by name.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` with the device path's NVRTC options (`fmad` as
/// given) and returns the PTX: what [`Gpu::open_with`] loads.
pub fn compile(source: &str, fmad: bool) -> Result<String, GpuError> {
    compile_for(source, fmad, None)
}

/// [`compile`] for a virtual architecture (`Some("compute_90")`: the
/// resident kernels with programmatic dependent launch) or NVRTC's default.
pub fn compile_for(
    source: &str,
    fmad: bool,
    arch: Option<&'static str>,
) -> Result<String, GpuError> {
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(fmad),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some("kernels.cu".into()),
        arch,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| GpuError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

pub use crate::cuda_source::prefetch_source;

/// [`compile`] of each `(source, fmad)` of `items`, on up to `threads`
/// threads at once (NVRTC compiles distinct programs concurrently), results
/// in `items`' order: `gpu_check`'s negative controls, each a whole-module
/// compile, in the time of a few.
pub fn compile_many(items: &[(&str, bool)], threads: usize) -> Vec<Result<String, GpuError>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<String, GpuError>>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(src, fmad)) = items.get(i) else {
                    break;
                };
                let r = compile(src, fmad);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|m| {
            m.into_inner()
                .ok()
                .flatten()
                .unwrap_or_else(|| Err(GpuError::Compile("a compile thread failed".into())))
        })
        .collect()
}

/// `source` as the resident module is compiled under programmatic
/// dependent launch: `ATTN_EARLY` and `PDL_PREFETCH` defined, so that the
/// kernels load what no kernel ahead of them writes (weights, the step's
/// inputs) before waiting for it (kernels.cu's `PDL_ENTRY_EARLY`,
/// `DecodeIn`).
pub fn resident_source(source: &str) -> String {
    format!("#define ATTN_EARLY 1\n{}", prefetch_source(source))
}

/// Why the device path is unavailable or failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver library (libcuda) on this machine")]
    NoDriver,
    #[error("no NVRTC library (libnvrtc) on this machine")]
    NoNvrtc,
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("{0}")]
    Config(String),
    #[error("NVRTC could not compile kernels.cu: {0}")]
    Compile(String),
    #[error("{what}: sizes do not match ({detail})")]
    Shape { what: &'static str, detail: String },
    #[error(
        "out of device memory for {what}: needed {needed} bytes, {free} bytes free ({detail})"
    )]
    OutOfMemory {
        what: String,
        needed: usize,
        free: usize,
        detail: String,
    },
}

pub(crate) fn drv<E: std::fmt::Debug>(e: E) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// An open device with the kernels loaded.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The second stream of overlapped copies ([`overlap`]), made on first use.
    pub(crate) copies: std::sync::Mutex<Option<Arc<CudaStream>>>,
    /// The resident path's kernels ([`resident`]).
    pub(crate) res: launch::Kernels,
    matmul: CudaFunction,
    matmul_warp: CudaFunction,
    /// `matmul_tile` and `matmul_rows` on operands of this call (the
    /// resident path launches its own handles).
    matmul_tile: CudaFunction,
    matmul_rows: CudaFunction,
    rms_norm: CudaFunction,
    exp_slice: CudaFunction,
    swiglu: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    hc_coeffs: CudaFunction,
    hc_pre: CudaFunction,
    hc_post: CudaFunction,
    moe_combine: CudaFunction,
    index_scores: CudaFunction,
}

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

/// The kernels' storage code (`weight()` in kernels.cu) of a block format,
/// or an error for one they do not read.
pub(crate) fn quant_code(q: QuantKind) -> Result<i32, GpuError> {
    #[allow(unreachable_patterns)]
    match q {
        QuantKind::Q4_0 => Ok(2),
        QuantKind::Q4_1 => Ok(3),
        QuantKind::Q8_0 => Ok(4),
        other => Err(GpuError::Config(format!(
            "{other:?} weights have no CUDA kernel yet (the device reads f32, bf16, Q4_0, Q4_1, Q8_0)"
        ))),
    }
}

pub(crate) fn grid(n: usize) -> LaunchConfig {
    let threads = 128u32;
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(threads).max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn as_i32(what: &'static str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::Shape {
        what,
        detail: format!("{v} does not fit the kernel's 32-bit index"),
    })
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        Self::open_with(ordinal, SOURCE, false)
    }

    /// [`Gpu::open`] with another source or with multiply-add contraction
    /// allowed: negative controls for checks (contraction changes bits, so a
    /// check that cannot see it proves nothing).
    pub fn open_with(ordinal: usize, source: &str, fmad: bool) -> Result<Self, GpuError> {
        Self::open_tuned(ordinal, source, fmad, resident::Tuning::from_env()?)
    }

    /// [`Gpu::open_with`] under `tuning` rather than the environment's (a
    /// negative control opened with plain launches compiles one module, not
    /// two).
    pub fn open_tuned(
        ordinal: usize,
        source: &str,
        fmad: bool,
        tuning: resident::Tuning,
    ) -> Result<Self, GpuError> {
        // SAFETY: these only try to open the shared libraries by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc);
        }
        let ptx = compile(source, fmad)?;
        Self::open_compiled(ordinal, source, fmad, ptx, tuning)
    }

    /// [`Gpu::open_tuned`] with `source` already compiled by [`compile`]
    /// into `ptx` (the module of the reference kernels, and of the resident
    /// ones too unless `tuning.pdl` on a device that has it, which compiles
    /// them again for sm_90).
    pub fn open_compiled(
        ordinal: usize,
        source: &str,
        fmad: bool,
        ptx: String,
        mut tuning: resident::Tuning,
    ) -> Result<Self, GpuError> {
        // SAFETY: this only tries to open the shared library by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // One stream does everything, so cudarc's cross-stream event tracking
        // only costs time (and events cannot be recorded in a graph capture).
        // SAFETY: no slice is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        // The resident kernels: the same PTX, or with programmatic dependent
        // launch (Tuning::pdl) compiled for sm_90, where the device has it.
        let major = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(drv)?;
        tuning.pdl &= major >= 9;
        let res_ptx = if tuning.pdl {
            compile_for(&resident_source(source), fmad, Some("compute_90"))?
        } else {
            ptx.clone()
        };
        let res = launch::Kernels::load(&ctx, &res_ptx, tuning)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(drv)?;
        let f = |name: &str| module.load_function(name).map_err(drv);
        // A created stream, not the legacy default one: decode steps are
        // captured as CUDA graphs, which the default stream cannot do.
        let stream = ctx.new_stream().map_err(drv)?;
        Ok(Self {
            res,
            matmul_tile: f("matmul_tile")?,
            matmul_rows: f("matmul_rows")?,
            stream,
            copies: std::sync::Mutex::new(None),
            matmul: f("matmul")?,
            matmul_warp: f("matmul_warp")?,
            rms_norm: f("rms_norm")?,
            exp_slice: f("exp_slice")?,
            swiglu: f("swiglu")?,
            rope: f("rope")?,
            attention: f("attention")?,
            hc_coeffs: f("hc_coeffs")?,
            hc_pre: f("hc_pre")?,
            hc_post: f("hc_post")?,
            moe_combine: f("moe_combine")?,
            index_scores: f("index_scores")?,
            ctx,
        })
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|e| format!("unknown ({e:?})"))
    }

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
            Weights::Quant(q, s) => (quant_code(q)?, s.to_vec()),
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
            // kernels.cu; every index they form is below n·rows, n·k or
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
        if w.is_empty() || x.len() % w.len() != 0 || out.len() != x.len() {
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
        // SAFETY: matches `rms_norm` in kernels.cu; rows·d = x.len().
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
        // SAFETY: matches the element-wise kernels in kernels.cu (inputs,
        // output, count); every index is below `n`.
        unsafe { b.launch(grid(out.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }

    /// [`crate::rope`] of one row (whole heads) at `pos`, in place.
    pub fn rope(&self, table: &RopeTable, x: &mut [f32], pos: usize) -> Result<(), GpuError> {
        let d = table.head_dim();
        if x.len() % d != 0 {
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
        // SAFETY: matches `rope` in kernels.cu; threads cover width / 2 pairs.
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
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let bad = shape.n_kv_heads == 0
            || shape.n_heads % shape.n_kv_heads != 0
            || shape.head_dim > MAX_HEAD_DIM
            || out.len() != tasks.len() * qd
            || tasks
                .iter()
                .any(|t| t.q.len() != qd || t.pos >= t.kv.capacity());
        if bad {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!(
                    "{} tasks, out {}, heads {}/{} × {} (head_dim ≤ {MAX_HEAD_DIM})",
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
            .arg(&scale);
        // SAFETY: matches `attention` in kernels.cu; task t reads rows
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
        // SAFETY: matches `hc_coeffs` in kernels.cu; token t reads raw[t·w ..
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
        // SAFETY: matches `hc_pre` in kernels.cu; every index is below n·h·d,
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
        // SAFETY: matches `hc_post` in kernels.cu; every index is below
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
        // SAFETY: matches `moe_combine` in kernels.cu; token t reads gates
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
        // SAFETY: matches `index_scores` in kernels.cu; key s reads
        // keys[s·dim .. (s+1)·dim], q below heads·dim, w below heads.
        unsafe { b.launch(grid(keys.len())) }.map_err(drv)?;
        s.memcpy_dtoh(&dout, out).map_err(drv)
    }
}
