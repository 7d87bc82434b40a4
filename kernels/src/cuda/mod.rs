//! CUDA mirror of the canonical kernels (feature `cuda`): the same ops, by the
//! same names, compiled from kernels/cuda/ (joined as `cuda_source::SOURCE`)
//! by NVRTC through cudarc, with `--fmad=false` so that no multiply-add is
//! contracted and every FMA is an explicit `fmaf` where the CPU code has
//! one. Each op returns the CPU fast path's bits exactly (contract invariant
//! I6, checked by `kernels/examples/gpu_check/` on a device).
//!
//! The CUDA libraries are loaded at run time: a build needs no CUDA, and
//! [`Gpu::open`] returns an error (never panics) where no driver or device is
//! present. This module owns [`Gpu`] (the device, its stream and both
//! modules), its opening, and [`GpuError`]; the rest lives by
//! responsibility: `compile` (NVRTC), `cache` (compiled modules on disk),
//! `portable` (per-call ops that copy their operands: the portable mode's
//! proof of arithmetic), `resident`
//! (the paths the engine uses) over `buf`, `graph`, `launch`, `ops::*`,
//! `split`, `overlap` and `tuning`, and `harness` (gpu_check's and
//! `lmrr bench`'s helpers).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};

use crate::quant::QuantKind;

pub mod buf;
pub mod cache;
pub mod compile;
pub mod graph;
pub mod harness;
pub(crate) mod launch;
pub mod ops;
pub mod overlap;
pub mod portable;
pub mod resident;
pub mod split;
pub mod tc;
pub mod tuning;

/// Largest head dimension the resident attention kernels hold.
pub const MAX_HEAD_DIM: usize = 256;

/// Largest head dimension the one-thread attention kernel of the portable
/// mirror holds (its per-thread arrays): a latent attention row of the
/// DeepSeek-V2/V3 class (576 floats) fits.
pub const ONE_THREAD_MAX_HEAD_DIM: usize = 640;

pub use crate::cuda_source::{negative_controls, Control, ANY_CASE, CONTROL_CASES, SOURCE};

pub use crate::cuda_source::prefetch_source;
pub use compile::{compile, compile_for, compile_many, nvrtc_present, resident_source};
pub use portable::MatmulKernel;

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
    #[error("NVRTC could not compile the CUDA source: {0}")]
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
    /// The tensor-core kernels ([`tc`]), built on first use.
    tc: std::sync::OnceLock<Result<tc::TcKernels, String>>,
}

/// The kernels' storage code (`weight()` in kernels/cuda/quant.cuh) of a
/// block format: every format the CPU stores has one, so a model runs on the
/// device as it is stored.
pub(crate) fn quant_code(q: QuantKind) -> i32 {
    match q {
        QuantKind::Q4_0 => 2,
        QuantKind::Q4_1 => 3,
        QuantKind::Q8_0 => 4,
        QuantKind::Q4K => 5,
        QuantKind::Q6K => 6,
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
    /// two). Each module is the device's CUBIN from the on-disk cache
    /// ([`cache`]), compiled by NVRTC and stored on a miss.
    pub fn open_tuned(
        ordinal: usize,
        source: &str,
        fmad: bool,
        tuning: resident::Tuning,
    ) -> Result<Self, GpuError> {
        Self::open_from(ordinal, source, fmad, None, tuning)
    }

    /// [`Gpu::open_tuned`] with `source` already compiled by [`compile`]
    /// into `ptx` (the module of the reference kernels, and of the resident
    /// ones too unless `tuning.pdl` on a device that has it, which builds
    /// them again, through the cache, for the device's architecture).
    pub fn open_compiled(
        ordinal: usize,
        source: &str,
        fmad: bool,
        ptx: String,
        tuning: resident::Tuning,
    ) -> Result<Self, GpuError> {
        Self::open_from(ordinal, source, fmad, Some(ptx), tuning)
    }

    fn open_from(
        ordinal: usize,
        source: &str,
        fmad: bool,
        ptx: Option<String>,
        mut tuning: resident::Tuning,
    ) -> Result<Self, GpuError> {
        use cache::Format;
        // SAFETY: these only try to open the shared libraries by name.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc);
        }
        let store = cache::ModuleCache::from_env()?;
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // One stream does everything, so cudarc's cross-stream event tracking
        // only costs time (and events cannot be recorded in a graph capture).
        // SAFETY: no slice is ever used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let tc = compile::Toolchain::of(&ctx)?;
        // The resident kernels: the reference module's image, or with
        // programmatic dependent launch (Tuning::pdl) their own build for
        // sm_90 or later, where the device has it.
        tuning.pdl &= tc.capability.0 >= 9;
        let load_ref = |format: Format, image: &[u8]| {
            let module = match format {
                Format::Cubin => cudarc::nvrtc::Ptx::from_binary(image.to_vec()),
                Format::Ptx => cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(image)),
            };
            let res = match tuning.pdl {
                true => None,
                false => Some(launch::Kernels::load(&ctx, format, image, tuning)?),
            };
            Ok::<_, GpuError>((ctx.load_module(module).map_err(drv)?, res))
        };
        let reference = compile::ModuleSpec {
            what: "reference kernels",
            text: source,
            fmad,
            ptx_arch: None,
        };
        let (module, res) = match ptx {
            Some(ptx) => load_ref(Format::Ptx, ptx.as_bytes())?,
            None => compile::device_module(&reference, &tc, &store, load_ref)?,
        };
        let res = match res {
            Some(res) => res,
            None => {
                let text = resident_source(source);
                let spec = compile::ModuleSpec {
                    what: "resident kernels",
                    text: &text,
                    fmad,
                    ptx_arch: Some("compute_90"),
                };
                compile::device_module(&spec, &tc, &store, |format, image| {
                    launch::Kernels::load(&ctx, format, image, tuning)
                })?
            }
        };
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
            tc: std::sync::OnceLock::new(),
            ctx,
        })
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|e| format!("unknown ({e:?})"))
    }
}

#[cfg(test)]
mod quant_code_tests {
    use super::*;

    /// Every stored format has its own code, and none is f32's (0) or
    /// bf16's (1): `weight()` must never read one format as another.
    #[test]
    fn every_block_format_has_its_own_device_code() {
        let codes: Vec<i32> = QuantKind::ALL.iter().map(|&q| quant_code(q)).collect();
        for (i, c) in codes.iter().enumerate() {
            assert!(*c >= 2, "{} has code {c}", QuantKind::ALL[i].name());
            assert!(
                !codes[..i].contains(c),
                "{} shares code {c}",
                QuantKind::ALL[i].name()
            );
        }
    }
}
