//! RMSNorm on resident rows, with the residual add and a split matmul's
//! partials folded in: `norm_reg` where the row fits it, then `norm_block`,
//! then the warp kernels ([`NormKernel`]); each gives the CPU's bits.

use cudarc::driver::LaunchConfig;

use crate::cuda::buf::DevBuf;
use crate::cuda::launch::*;
use crate::cuda::split::MmOut;
use crate::cuda::{as_i32, Gpu, GpuError};

/// Which RMSNorm kernel [`Gpu::rms_norm_resident`] runs (the resident path
/// takes `norm_reg` where the row fits it, then `norm_block`, then the warp
/// kernels); every one computes the CPU's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKernel {
    /// `rms_norm_warp` / `add_norm`: one warp per row.
    Warp,
    /// `norm_block`: one block per row, its chunks in flight at once.
    Block,
    /// `norm_reg`: `norm_block` with the row in registers.
    Reg,
    /// `norm_reg_lf`: `norm_reg` with the residual row loaded before its
    /// first store (the same values).
    RegLf,
}

impl Gpu {
    /// `x += y`, then `out = rms_norm(x)·w`, `rows` rows of `d`, one launch
    /// (`y` read where it is: a split matmul's partials are summed by the
    /// norm kernel, or by `sum_chunks` ahead of the warp kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn add_norm(
        &self,
        x: u64,
        y: MmOut,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        self.norm_launch(x, Some(y), w, rows, d, eps, out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_launch(
        &self,
        x: u64,
        y: Option<MmOut>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if d.div_ceil(64) <= NR_MAX_CHUNKS {
            let min = self.res.tuning.loads_first_min;
            let kernel = if min > 0 && rows >= min {
                NormKernel::RegLf
            } else {
                NormKernel::Reg
            };
            return self.norm_blocks(kernel, x, y, w, rows, d, eps, out);
        }
        if d.div_ceil(64) <= MR_MAX_CHUNKS {
            return self.norm_blocks(NormKernel::Block, x, y, w, rows, d, eps, out);
        }
        let y = match y {
            Some(o) => Some(self.sum_split(o, rows * d)?),
            None => None,
        };
        self.norm_warp(x, y, w, rows, d, eps, out)
    }

    /// RMSNorm (after `x += y` when given) with one warp per row
    /// (`rms_norm_warp`, `add_norm`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_warp(
        &self,
        x: u64,
        y: Option<u64>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        let (ri, di) = (as_i32("rms_norm", rows)?, as_i32("rms_norm", d)?);
        as_i32("rms_norm", rows * d)?;
        let cfg = warps(rows)?;
        match y {
            Some(y) => {
                let mut b = self.kernel(&self.res.add_norm)?;
                b.arg(&x)
                    .arg(&y)
                    .arg(&w.ptr)
                    .arg(&out)
                    .arg(&ri)
                    .arg(&di)
                    .arg(&eps);
                // SAFETY: matches `add_norm`; x, y, out hold rows·d floats, w d.
                unsafe { b.launch(cfg) }
            }
            None => {
                let mut b = self.kernel(&self.res.rms_norm_warp)?;
                b.arg(&x).arg(&w.ptr).arg(&out).arg(&ri).arg(&di).arg(&eps);
                // SAFETY: matches `rms_norm_warp`; x and out hold rows·d
                // floats, w d.
                unsafe { b.launch(cfg) }
            }
        }
    }

    /// RMSNorm (after `x += y` when given) with one block per row: by
    /// `norm_reg` or `norm_reg_lf` (the row in registers, a group of 8
    /// threads per chunk; `d` at most `64 · NR_MAX_CHUNKS`) or `norm_block`
    /// (its chunks in flight at once; `d` at most `64 · MR_MAX_CHUNKS`).
    /// `kernel` is one of those three ([`NormKernel::Warp`] is
    /// [`Gpu::norm_warp`]'s).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_blocks(
        &self,
        kernel: NormKernel,
        x: u64,
        y: Option<MmOut>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        let (what, most, f, reg) = match kernel {
            NormKernel::Reg => ("norm_reg", NR_MAX_CHUNKS, &self.res.norm_reg, true),
            NormKernel::RegLf => ("norm_reg_lf", NR_MAX_CHUNKS, &self.res.norm_reg_lf, true),
            NormKernel::Block => ("norm_block", MR_MAX_CHUNKS, &self.res.norm_block, false),
            NormKernel::Warp => {
                return Err(GpuError::Shape {
                    what: "norm_blocks",
                    detail: "rms_norm_warp is not a block-per-row kernel".into(),
                })
            }
        };
        width_fits(what, d, most)?;
        let (ri, di) = (as_i32("rms_norm", rows)?, as_i32("rms_norm", d)?);
        as_i32("rms_norm", rows * d)?;
        let add = i32::from(y.is_some());
        let y = y.unwrap_or(MmOut::at(0));
        let yc = as_i32("rms_norm", y.chunks)?;
        // norm_reg: a group of 8 threads per chunk, whole warps.
        let threads = if reg {
            (8 * d.div_ceil(64)).div_ceil(32).max(1) as u32 * 32
        } else {
            MR_THREADS
        };
        let cfg = LaunchConfig {
            grid_dim: (ri as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.kernel(f)?;
        b.arg(&x)
            .arg(&y.y)
            .arg(&y.part)
            .arg(&yc)
            .arg(&w.ptr)
            .arg(&out)
            .arg(&ri)
            .arg(&di)
            .arg(&eps)
            .arg(&add);
        // SAFETY: matches `norm_block` / `norm_reg` / `norm_reg_lf` (the same parameters);
        // x, out (and y, or its partials chunks·rows·d, when added) hold
        // rows·d floats, w d; d within the
        // partials it holds, and norm_reg has a group for every chunk.
        unsafe { b.launch(cfg) }
    }

    /// Row-wise RMSNorm of `rows` rows of `d` (`norm_block`; `rms_norm_warp`
    /// for rows wider than `norm_block` holds).
    pub fn norm_rows(
        &self,
        x: u64,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        self.norm_launch(x, None, w, rows, d, eps, out)
    }
}
