//! The tensor-core matmul on resident operands (`kernels/cuda/tc/gemm.cu`):
//! `y (n, rows) = bf16(x) · Wᵀ` by `mma.sync.m16n8k16`, each output the
//! chain [`crate::tensor_core::tc_dot`] models, whichever tile kernel runs
//! it. The module is built on first use (sm_80 or later) and kept.

use cudarc::driver::LaunchConfig;

use super::buf::DevMatrix;
use super::compile::compile_for;
use super::launch::{Func, RawModule};
use super::{as_i32, drv, Gpu, GpuError};
use crate::cuda::cache::Format;

/// The tile kernels, by (tokens, rows) a block and threads.
pub(crate) struct TcKernels {
    _module: RawModule,
    /// `tc_gemm_16x32`, `tc_gemm_64x64`, `tc_gemm_128x128`.
    gemm: [(Func, usize, usize, u32); 3],
    /// `tc_gemv_32`: up to 16 tokens, columns a multiple of 4.
    gemv: Func,
}

impl TcKernels {
    fn load(g: &Gpu) -> Result<Self, GpuError> {
        let (major, minor) = g.capability()?;
        if major < 8 {
            return Err(GpuError::Config(format!(
                "tensor-core numerics need compute capability 8.0 or later; {} is {major}.{minor}",
                g.name()
            )));
        }
        let ptx = compile_for(crate::cuda_source::TC_SOURCE, false, Some("compute_80"))?;
        let module = RawModule::load(&g.ctx, Format::Ptx, ptx.as_bytes())?;
        let f = |name: &str| module.function(name);
        Ok(Self {
            gemm: [
                (f("tc_gemm_16x32")?, 16, 32, 128),
                (f("tc_gemm_64x64")?, 64, 64, 128),
                (f("tc_gemm_128x128")?, 128, 128, 256),
            ],
            gemv: f("tc_gemv_32")?,
            _module: module,
        })
    }
}

impl Gpu {
    /// `(major, minor)` compute capability.
    pub fn capability(&self) -> Result<(i32, i32), GpuError> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let major = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(drv)?;
        let minor = self
            .ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(drv)?;
        Ok((major, minor))
    }

    /// Builds the tensor-core module if it is not yet: an error here (an
    /// older device, no NVRTC) is the reason tensor-core numerics cannot
    /// run on this device.
    pub fn tensor_cores(&self) -> Result<(), GpuError> {
        self.tc_kernels().map(|_| ())
    }

    fn tc_kernels(&self) -> Result<&TcKernels, GpuError> {
        let r = self
            .tc
            .get_or_init(|| TcKernels::load(self).map_err(|e| e.to_string()));
        r.as_ref().map_err(|e| GpuError::Config(e.clone()))
    }

    /// `y (n, rows) = bf16(x (n, cols)) · Wᵀ` on tensor cores, `W` stored as
    /// bf16: the tile kernel for `n` (any gives the same bits).
    pub fn tc_mm(&self, x: u64, n: usize, w: &DevMatrix, y: u64) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        if w.kind != 1 {
            return Err(GpuError::Config(format!(
                "tensor-core numerics multiply bf16 weights; a {}x{} matrix is stored otherwise",
                w.rows, w.cols
            )));
        }
        let k = self.tc_kernels()?;
        let gemv = (k.gemv, 16, 32, 128);
        let (f, bm, bn, threads) = match n {
            0..=16 if w.cols % 4 == 0 => &gemv,
            0..=16 => &k.gemm[0],
            17..=128 => &k.gemm[1],
            _ => &k.gemm[2],
        };
        let (ni, ri, ci) = (
            as_i32("tc_mm", n)?,
            as_i32("tc_mm", w.rows)?,
            as_i32("tc_mm", w.cols)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (w.rows.div_ceil(*bn) as u32, n.div_ceil(*bm) as u32, 1),
            block_dim: (*threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.kernel(f)?;
        // These kernels do not wait on the grid ahead (no griddepcontrol):
        // launched in plain stream order.
        l.no_pdl();
        l.arg(&x).arg(&w.buf.ptr).arg(&y).arg(&ni).arg(&ri).arg(&ci);
        // SAFETY: x holds n·cols floats, W rows·cols bf16, y n·rows floats
        // (the resident plan's buffers); the grid covers exactly that.
        unsafe { l.launch(cfg) }
    }
}
