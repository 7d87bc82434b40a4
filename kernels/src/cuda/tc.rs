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

/// A tile kernel: the function, tokens and rows a block, threads, dynamic
/// shared memory.
#[derive(Clone, Copy)]
struct Tile {
    f: Func,
    bm: usize,
    bn: usize,
    threads: u32,
    smem: u32,
}

/// The pipelined instances of `tc_mm_body` (gemm.cu), by (name, BM, BN,
/// warps, BK, stages); chosen by tokens a launch (and rows, see
/// [`Gpu::tc_mm`]).
const MM: [(&str, usize, usize, u32, usize, usize); 3] = [
    ("tc_mm_32x32", 32, 32, 4, 64, 4),
    ("tc_mm_64x64", 64, 64, 4, 64, 4),
    ("tc_mm_128x128", 128, 128, 8, 64, 3),
];

/// Rows from which a matrix of 17 to 64 tokens takes 64×64 tiles rather
/// than 32×32: past it the small tiles are many waves of blocks, each
/// reading its inputs again (docs/PERFORMANCE.md has the timings).
const SMALL_TILE_MAX_ROWS: usize = 16_384;

/// The direct-load instances of `tc_mv_body` (gemm.cu), by (name, tokens a
/// block): four warps of 8 rows each, no shared memory; for decode steps.
const MV: [(&str, usize); 2] = [("tc_mv_8", 8), ("tc_mv_16", 16)];

/// The tensor-core module's kernels.
pub(crate) struct TcKernels {
    _module: RawModule,
    round: Func,
    /// `MM`, in its order.
    mm: [Tile; 3],
    /// `MV`, in its order.
    mv: [Tile; 2],
    /// `tc_gemm_64x64` (x as f32, staged to bf16 as it is read): K not a
    /// multiple of 8.
    gemm: Tile,
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
        let mut mm = Vec::with_capacity(MM.len());
        for (name, bm, bn, warps, bk, stages) in MM {
            let smem = (bm + bn) * (bk + 8) * 2 * stages;
            mm.push(Tile {
                f: module.function_with_smem(name, smem)?,
                bm,
                bn,
                threads: warps * 32,
                smem: smem as u32,
            });
        }
        let mm: [Tile; 3] = mm
            .try_into()
            .map_err(|_| GpuError::Config("the tensor-core tile table".into()))?;
        let mut mvs = Vec::with_capacity(MV.len());
        for (name, bm) in MV {
            mvs.push(Tile {
                f: module.function(name)?,
                bm,
                bn: 32,
                threads: 128,
                smem: 0,
            });
        }
        let mv: [Tile; 2] = mvs
            .try_into()
            .map_err(|_| GpuError::Config("the tensor-core tile table".into()))?;
        Ok(Self {
            round: module.function("tc_round_bf16")?,
            mm,
            mv,
            gemm: Tile {
                f: module.function("tc_gemm_64x64")?,
                bm: 64,
                bn: 64,
                threads: 128,
                smem: 0,
            },
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

    /// `xb = bf16(x)` (round to nearest even) for `count` values: the
    /// operand [`Gpu::tc_mm`] streams, made once for the matrices that
    /// share an input.
    pub fn tc_round(&self, x: u64, count: usize, xb: u64) -> Result<(), GpuError> {
        if count == 0 {
            return Ok(());
        }
        let k = self.tc_kernels()?;
        let c = count as i64;
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.kernel(&k.round)?;
        l.no_pdl();
        l.arg(&x).arg(&xb).arg(&c);
        // SAFETY: x holds `count` floats and xb room for `count` bf16.
        unsafe { l.launch(cfg) }
    }

    /// Whether [`Gpu::tc_mm`] takes its input as bf16 (from
    /// [`Gpu::tc_round`]) for a matrix of `cols` columns: a multiple of 8.
    /// Otherwise it reads the f32 input itself.
    pub fn tc_rounds_first(cols: usize) -> bool {
        cols.is_multiple_of(8)
    }

    /// `y (n, rows) = bf16(x (n, cols)) · Wᵀ` on tensor cores, `W` stored as
    /// bf16: `x` is the bf16 input from [`Gpu::tc_round`] where
    /// [`Gpu::tc_rounds_first`], the f32 input otherwise. The tile kernel
    /// for `n` (any gives the same bits).
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
        let t = if !Self::tc_rounds_first(w.cols) {
            k.gemm
        } else {
            match n {
                0..=8 => k.mv[0],
                9..=16 => k.mv[1],
                17..=64 if w.rows < SMALL_TILE_MAX_ROWS => k.mm[0],
                17..=256 => k.mm[1],
                _ => k.mm[2],
            }
        };
        let (ni, ri, ci) = (
            as_i32("tc_mm", n)?,
            as_i32("tc_mm", w.rows)?,
            as_i32("tc_mm", w.cols)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (w.rows.div_ceil(t.bn) as u32, n.div_ceil(t.bm) as u32, 1),
            block_dim: (t.threads, 1, 1),
            shared_mem_bytes: t.smem,
        };
        let mut l = self.kernel(&t.f)?;
        // These kernels do not wait on the grid ahead (no griddepcontrol):
        // launched in plain stream order.
        l.no_pdl();
        l.arg(&x).arg(&w.buf.ptr).arg(&y).arg(&ni).arg(&ri).arg(&ci);
        // SAFETY: x holds n·cols values (bf16 or f32 as above), W rows·cols
        // bf16, y n·rows floats (the resident plan's buffers); the grid
        // covers exactly that.
        unsafe { l.launch(cfg) }
    }
}
