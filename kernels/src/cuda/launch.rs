//! Launching the resident kernels: their module, loaded through the driver
//! API (`RawModule`), the handles of its kernels (`Kernels`), and `Launch`,
//! one `cuLaunchKernelEx` with programmatic stream serialization allowed
//! when [`Tuning::pdl`] is on (each kernel then waits for the one ahead of
//! it itself: `PDL_ENTRY` in kernels/cuda/common.cuh). Also the host's
//! copies of the kernels' launch-shape constants, checked against the
//! source's `#define`s, and the grid helpers every op wrapper uses.
//!
//! Invariant: a grid helper returns an error, never a launch, when a size
//! does not fit the kernels' 32-bit indices.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, LaunchConfig};

use super::buf::DevMatrix;
use super::cache::Format;
use super::tuning::Tuning;
use super::{as_i32, drv, Gpu, GpuError};

/// Tokens per warp of `matmul_tile` and per block of `matmul_rows`
/// (`MM_TOKENS` in matmul.cu).
pub const MM_TOKENS: usize = 8;

/// Chunks of a row `matmul_rows` holds partials for (`MR_MAX_CHUNKS`).
pub const MR_MAX_CHUNKS: usize = 256;

/// Rows a block of `matmul_rows4` (matmul.cu's `MR4_ROWS`).
pub const MR4_ROWS: usize = 4;

/// Chunks of a row `matmul_rows4` holds partials for (`MR4_MAX_CHUNKS`).
pub const MR4_MAX_CHUNKS: usize = 64;

/// Threads per block of `matmul_rows` (`MR_GROUPS` groups of 8).
pub const MR_THREADS: u32 = 128;

/// Chunks of a row `norm_reg` holds in registers (`NR_MAX_CHUNKS`).
pub const NR_MAX_CHUNKS: usize = 128;

/// Rows, tokens and threads of a `matmul_gemm` block (`GM_*`).
pub const GM_ROWS: usize = 32;

pub const GM_TOKS: usize = 16;

pub(crate) const GM_THREADS: u32 = 64;

/// The same of `matmul_gemm_wide` (`GW_*`).
pub const GW_ROWS: usize = 64;

pub const GW_TOKS: usize = 32;

pub(crate) const GW_THREADS: u32 = 256;

/// Threads per block of `attention_paged` (`ATTN_THREADS` in attention.cu).
pub(crate) const ATTN_THREADS: u32 = 256;

/// Tokens of one sequence per `attention_prefill` block (`PF_TQ`).
pub const PF_TQ: usize = 16;

/// The largest head_dim `attention_prefill` holds (`PF_MAXHD`).
pub const PF_MAXHD: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's launch shapes are the CUDA source's: a block count or a
    /// shared-memory bound that disagreed would read or write past a row.
    #[test]
    pub(crate) fn the_host_constants_are_the_kernels_defines() {
        let src = crate::cuda_source::SOURCE;
        for (name, value) in [
            ("MM_TOKENS", MM_TOKENS),
            ("MR_MAX_CHUNKS", MR_MAX_CHUNKS),
            ("MR_GROUPS", MR_THREADS as usize / 8),
            ("MR4_ROWS", MR4_ROWS),
            ("MR4_MAX_CHUNKS", MR4_MAX_CHUNKS),
            ("NR_MAX_CHUNKS", NR_MAX_CHUNKS),
            ("ATTN_TILE", crate::cuda::ops::attention_split::ATTN_TILE),
            (
                "SPLIT_TILES",
                crate::cuda::ops::attention_split::SPLIT_TILES,
            ),
            (
                "SPLIT_MAX_GROUP",
                crate::cuda::ops::attention_split::SPLIT_MAX_GROUP,
            ),
        ] {
            let line = format!("#define {name} {value}\n");
            assert!(
                src.contains(&line),
                "the CUDA source has no `{}`",
                line.trim()
            );
        }
    }

    #[test]
    pub(crate) fn a_row_too_wide_for_a_kernel_is_an_error_with_both_widths() {
        assert!(width_fits("matmul_rows4", 64 * MR4_MAX_CHUNKS, MR4_MAX_CHUNKS).is_ok());
        match width_fits("matmul_rows4", 64 * MR4_MAX_CHUNKS + 1, MR4_MAX_CHUNKS) {
            Err(GpuError::Shape { what, detail }) => {
                assert_eq!(what, "matmul_rows4");
                assert!(
                    detail.contains("4097") && detail.contains("4096"),
                    "{detail}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

/// The resident kernels, loaded with the module.
pub(crate) struct Kernels {
    /// The module the handles below belong to.
    pub(crate) _module: RawModule,
    pub(crate) matmul_tile: Func,
    pub(crate) matmul_rows: Func,
    pub(crate) matmul_rows4: Func,
    pub(crate) matmul_multi: Func,
    pub(crate) rope_kv: Func,
    pub(crate) rms_norm_warp: Func,
    pub(crate) add_norm: Func,
    pub(crate) matmul_gemm: Func,
    pub(crate) matmul_gemm_wide: Func,
    pub(crate) matmul_gemm_multi: Func,
    pub(crate) norm_block: Func,
    pub(crate) norm_reg: Func,
    pub(crate) norm_reg_lf: Func,
    pub(crate) sum_chunks: Func,
    /// Which kernel each step and matmul takes ([`Tuning`]).
    pub(crate) tuning: Tuning,
    pub(crate) embed_rows: Func,
    pub(crate) add_rows: Func,
    pub(crate) gather_rows: Func,
    pub(crate) attention_paged: Func,
    pub(crate) attention_decode: Func,
    pub(crate) attention_decode_rope_qs: Func,
    pub(crate) attention_prefill: Func,
    pub(crate) attention_prefill_hd64: Func,
    pub(crate) attention_prefill_hd128: Func,
    pub(crate) attention_split_scores: Func,
    pub(crate) attention_split_pv: Func,
    pub(crate) attention_split_merge: Func,
    pub(crate) swiglu: Func,
    pub(crate) swiglu_split: Func,
    pub(crate) fma_peak: Func,
    pub(crate) add_bias: Func,
    pub(crate) scale_elems: Func,
    pub(crate) geglu: Func,
    pub(crate) repeat_rows: Func,
    pub(crate) round_bf16: Func,
    pub(crate) stream_mean: Func,
    pub(crate) hc_coeffs: Func,
    pub(crate) hc_pre: Func,
    pub(crate) hc_post: Func,
    pub(crate) moe_combine_idx: Func,
    pub(crate) kv_write_aux: Func,
}

impl Kernels {
    /// Loads the resident kernels from `image` (a CUBIN, or PTX text that
    /// the driver compiles; compiled for sm_90 or later when `tuning.pdl`,
    /// whose launches then allow programmatic dependence).
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        format: Format,
        image: &[u8],
        tuning: Tuning,
    ) -> Result<Self, GpuError> {
        let module = RawModule::load(ctx, format, image)?;
        let f = |name: &str| -> Result<Func, GpuError> {
            let c = std::ffi::CString::new(name)
                .map_err(|_| GpuError::Compile(format!("kernel name {name:?}")))?;
            // SAFETY: the module is loaded and alive (`module`, kept below).
            unsafe { result::module::get_function(module.m, c) }
                .map(Func)
                .map_err(drv)
        };
        Ok(Self {
            matmul_tile: f("matmul_tile")?,
            matmul_rows: f("matmul_rows")?,
            matmul_rows4: f("matmul_rows4")?,
            matmul_multi: f("matmul_multi")?,
            rope_kv: f("rope_kv")?,
            rms_norm_warp: f("rms_norm_warp")?,
            add_norm: f("add_norm")?,
            matmul_gemm: f("matmul_gemm")?,
            matmul_gemm_wide: f("matmul_gemm_wide")?,
            matmul_gemm_multi: f("matmul_gemm_multi")?,
            norm_block: f("norm_block")?,
            norm_reg: f("norm_reg")?,
            norm_reg_lf: f("norm_reg_lf")?,
            sum_chunks: f("sum_chunks")?,
            tuning,
            embed_rows: f("embed_rows")?,
            add_rows: f("add_rows")?,
            gather_rows: f("gather_rows")?,
            attention_paged: f("attention_paged")?,
            attention_decode: f("attention_decode")?,
            attention_decode_rope_qs: f("attention_decode_rope_qs")?,
            attention_prefill: f("attention_prefill")?,
            attention_prefill_hd64: f("attention_prefill_hd64")?,
            attention_prefill_hd128: f("attention_prefill_hd128")?,
            attention_split_scores: f("attention_split_scores")?,
            attention_split_pv: f("attention_split_pv")?,
            attention_split_merge: f("attention_split_merge")?,
            swiglu: f("swiglu")?,
            swiglu_split: f("swiglu_split")?,
            fma_peak: f("fma_peak")?,
            add_bias: f("add_bias")?,
            scale_elems: f("scale_elems")?,
            geglu: f("geglu")?,
            repeat_rows: f("repeat_rows")?,
            round_bf16: f("round_bf16")?,
            stream_mean: f("stream_mean")?,
            hc_coeffs: f("hc_coeffs")?,
            hc_pre: f("hc_pre")?,
            hc_post: f("hc_post")?,
            moe_combine_idx: f("moe_combine_idx")?,
            kv_write_aux: f("kv_write_aux")?,
            _module: module,
        })
    }
}

/// The resident kernels' module, loaded through the driver API so that
/// their launches can carry attributes (programmatic dependent launch);
/// unloaded when dropped.
pub(crate) struct RawModule {
    ctx: Arc<CudaContext>,
    m: sys::CUmodule,
}

// SAFETY: a module handle is valid in every thread its context is bound to,
// and every use binds the context first.
unsafe impl Send for RawModule {}
// SAFETY: as for Send; the handle is never mutated after loading.
unsafe impl Sync for RawModule {}

impl RawModule {
    /// `image` loaded into `ctx` (`cuModuleLoadData`): a CUBIN as is, PTX
    /// with the closing NUL the driver reads it up to.
    pub(crate) fn function(&self, name: &str) -> Result<Func, GpuError> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| GpuError::Compile(format!("kernel name {name:?}")))?;
        // SAFETY: the module is loaded and alive while `self` is.
        unsafe { result::module::get_function(self.m, c) }
            .map(Func)
            .map_err(drv)
    }

    /// `name`, allowed `bytes` of dynamic shared memory a block (above the
    /// 48 KiB a launch may ask for without it).
    pub(crate) fn function_with_smem(&self, name: &str, bytes: usize) -> Result<Func, GpuError> {
        let f = self.function(name)?;
        let b = i32::try_from(bytes)
            .map_err(|_| GpuError::Config(format!("{name}: {bytes} bytes of shared memory")))?;
        // SAFETY: `f` is a function of this loaded module.
        unsafe {
            result::function::set_function_attribute(
                f.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                b,
            )
        }
        .map_err(drv)?;
        Ok(f)
    }

    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        format: Format,
        image: &[u8],
    ) -> Result<Self, GpuError> {
        let owned = match format {
            Format::Cubin => image.to_vec(),
            Format::Ptx => std::ffi::CString::new(image)
                .map_err(|_| GpuError::Compile("the PTX holds a NUL byte".into()))?
                .into_bytes_with_nul(),
        };
        ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `owned` is a whole CUBIN or a NUL-terminated PTX text that
        // outlives the call (the driver copies it); the context is current.
        let m = unsafe { result::module::load_data(owned.as_ptr().cast()) }.map_err(drv)?;
        Ok(Self {
            ctx: ctx.clone(),
            m,
        })
    }
}

impl Drop for RawModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by `RawModule::load` and unloaded only here.
            let _ = unsafe { result::module::unload(self.m) };
        }
    }
}

/// A kernel of [`RawModule`], launched by [`Launch`].
#[derive(Clone, Copy)]
pub(crate) struct Func(sys::CUfunction);

// SAFETY: a function handle is valid in every thread of its context; it is
// only launched after the context is bound.
unsafe impl Send for Func {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Func {}

/// The arguments of one launch of a [`Func`] on the Gpu's stream
/// (`cuLaunchKernelEx`), with programmatic stream serialization allowed
/// when [`Tuning::pdl`] is on: the kernel may then be launched before the
/// one ahead of it has finished, and waits for it itself (`PDL_ENTRY` in
/// common.cuh). Each argument is borrowed until the launch.
pub(crate) struct Launch<'a> {
    f: sys::CUfunction,
    stream: sys::CUstream,
    pdl: bool,
    args: Vec<*mut std::ffi::c_void>,
    _args: std::marker::PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// Launches in plain stream order, for a kernel that does not wait on
    /// the grid ahead of it (no `griddepcontrol.wait`).
    pub(crate) fn no_pdl(&mut self) -> &mut Self {
        self.pdl = false;
        self
    }

    /// The next kernel parameter, by reference (its bytes are read at the
    /// launch).
    pub(crate) fn arg<T>(&mut self, v: &'a T) -> &mut Self {
        self.args.push((v as *const T).cast_mut().cast());
        self
    }

    /// A matmul kernel's leading parameters: the storage kind, `x`, the
    /// weights, `y`, `(n, rows, cols)` ([`mm_dims`]) and the row stride.
    pub(crate) fn matmul_args(
        &mut self,
        w: &'a DevMatrix,
        x: &'a u64,
        y: &'a u64,
        dims: &'a (i32, i32, i32),
    ) -> &mut Self {
        self.arg(&w.kind)
            .arg(x)
            .arg(&w.buf.ptr)
            .arg(y)
            .arg(&dims.0)
            .arg(&dims.1)
            .arg(&dims.2)
            .arg(&w.row_bytes)
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order
    /// and type, and every address among them must hold what the kernel
    /// reads and writes at this grid.
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), GpuError> {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream,
            attrs: if self.pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the caller's contract; `config`, `attr` and the argument
        // pointers outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.f,
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(drv)
    }
}

pub(crate) fn warps(n: usize) -> Result<LaunchConfig, GpuError> {
    let threads = n
        .checked_mul(32)
        .filter(|&t| t <= i32::MAX as usize)
        .ok_or_else(|| GpuError::Shape {
            what: "launch",
            detail: format!("{n} warps do not fit a 32-bit grid"),
        })?;
    Ok(super::grid(threads))
}

/// The three `(weights, y, rows, row bytes)` argument groups of the
/// kernels that take up to three matrices of one input (`matmul_multi`):
/// an absent matrix has 0 rows.
pub(crate) fn mat_slots(mats: &[(&DevMatrix, u64)]) -> Result<[(u64, u64, i32, i64); 3], GpuError> {
    let slot = |i: usize| -> Result<(u64, u64, i32, i64), GpuError> {
        Ok(match mats.get(i) {
            Some((w, y)) => (w.buf.ptr, *y, as_i32("matmul", w.rows)?, w.row_bytes),
            None => (0, 0, 0, 0),
        })
    };
    Ok([slot(0)?, slot(1)?, slot(2)?])
}

/// Rows of `cols` columns fit a kernel that holds `most` 64-chunks a row;
/// otherwise an error naming the kernel and both widths.
pub(crate) fn width_fits(what: &'static str, cols: usize, most: usize) -> Result<(), GpuError> {
    if cols.div_ceil(64) > most {
        return Err(GpuError::Shape {
            what,
            detail: format!("rows of {cols} columns (at most {})", 64 * most),
        });
    }
    Ok(())
}

/// A grid of `blocks` blocks of `MR_THREADS` threads (`matmul_rows`,
/// `matmul_multi`).
pub(crate) fn row_blocks(blocks: usize) -> Result<LaunchConfig, GpuError> {
    Ok(LaunchConfig {
        grid_dim: (as_i32("matmul", blocks)? as u32, 1, 1),
        block_dim: (MR_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(crate) fn elems(n: usize, what: &'static str) -> Result<LaunchConfig, GpuError> {
    as_i32(what, n)?;
    Ok(super::grid(n))
}

/// A matmul's `(n, rows, cols)` as the kernels' 32-bit arguments, with
/// `n · cols` (the input's extent) checked to fit them too.
pub(crate) fn mm_dims(n: usize, w: &DevMatrix) -> Result<(i32, i32, i32), GpuError> {
    as_i32("matmul", n * w.cols)?;
    Ok((
        as_i32("matmul", n)?,
        as_i32("matmul", w.rows)?,
        as_i32("matmul", w.cols)?,
    ))
}

impl Gpu {
    /// A launch of resident kernel `f` on this device's stream (its context
    /// bound to the calling thread).
    pub(crate) fn kernel(&self, f: &Func) -> Result<Launch<'_>, GpuError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        Ok(Launch {
            f: f.0,
            stream: self.stream.cu_stream(),
            pdl: self.res.tuning.pdl,
            args: Vec::with_capacity(20),
            _args: std::marker::PhantomData,
        })
    }

    /// How this device's resident path chooses its kernels.
    pub fn tuning(&self) -> Tuning {
        self.res.tuning
    }
}
