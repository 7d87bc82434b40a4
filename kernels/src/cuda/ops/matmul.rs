//! Matmul on resident operands: the kernel for a shape chosen by
//! [`Tuning`] (`matmul_rows`, `matmul_rows4`, `matmul_tile`, `matmul_gemm`
//! whole or split over chunks, `matmul_multi` for several matrices of one
//! input). Every choice gives the same bits; only speed moves.

use cudarc::driver::LaunchConfig;

use crate::cuda::buf::{DevMatrix, SplitScratch};
use crate::cuda::launch::*;
use crate::cuda::split::MmOut;
#[allow(unused_imports)] // the doc links
use crate::cuda::tuning::Tuning;
use crate::cuda::{as_i32, Gpu, GpuError};

/// Which `matmul_gemm` kernel: its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTiles {
    /// `matmul_gemm`: 32 rows × 16 tokens, 64 threads.
    Narrow,
    /// `matmul_gemm_wide`: 64 rows × 32 tokens, 256 threads.
    Wide,
}

/// Blocks of one `matmul_gemm` (or `_wide`) pass over `rows` × `n`.
pub(crate) fn gemm_tiles(tiles: GemmTiles, rows: usize, n: usize) -> usize {
    if tiles != GemmTiles::Narrow {
        rows.div_ceil(GW_ROWS) * n.div_ceil(GW_TOKS)
    } else {
        rows.div_ceil(GM_ROWS) * n.div_ceil(GM_TOKS)
    }
}

impl Gpu {
    /// `y (n, rows) = x (n, cols) · Wᵀ` with no split scratch
    /// ([`Gpu::mm_split`]).
    pub fn mm(&self, x: u64, n: usize, w: &DevMatrix, y: u64) -> Result<(), GpuError> {
        self.mm_split(x, n, w, y, SplitScratch::NONE)
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ`: by `matmul_gemm` (staged tiles of
    /// rows × tokens) from [`Tuning::gemm_min`] tokens on, split over its
    /// chunks into `scratch` when its tiles alone would leave the device
    /// idle; otherwise by `matmul_rows` (a block per row and token tile, its
    /// chunks in flight at once), or `matmul_tile` where a row has more
    /// chunks than `matmul_rows` holds. Every choice gives the same bits.
    pub fn mm_split(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        scratch: SplitScratch,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let dims = mm_dims(n, w)?;
        let tun = self.res.tuning;
        if n >= tun.gemm_min.max(1) {
            let kind = if n >= tun.gemm_wide_min.max(1) {
                GemmTiles::Wide
            } else {
                GemmTiles::Narrow
            };
            let tiles = gemm_tiles(kind, w.rows, n);
            let chunks = w.cols.div_ceil(64);
            let fits = scratch.floats >= chunks * n * w.rows && scratch.addr != 0;
            let split = (fits && tiles < tun.split_blocks && chunks > 1).then(|| {
                // Chunks per block so that tiles · groups reaches the target.
                let groups = tun.split_blocks.div_ceil(tiles).min(chunks);
                chunks.div_ceil(groups)
            });
            return self.gemm_launch(x, n, w, y, kind, split.map(|cpb| (scratch.addr, cpb)));
        }
        let chunks = w.cols.div_ceil(64);
        if tun.rows4_min > 0
            && w.rows >= tun.rows4_min
            && n >= tun.rows4_tokens
            && chunks <= MR4_MAX_CHUNKS
        {
            return self.rows4_launch(x, n, w, y);
        }
        let rows_kernel = chunks <= MR_MAX_CHUNKS;
        let (f, cfg) = if rows_kernel {
            (
                &self.res.matmul_rows,
                row_blocks(w.rows * n.div_ceil(MM_TOKENS))?,
            )
        } else {
            (
                &self.res.matmul_tile,
                warps(w.rows * n.div_ceil(MM_TOKENS))?,
            )
        };
        let mut b = self.kernel(f)?;
        b.matmul_args(w, &x, &y, &dims);
        // SAFETY: matches `matmul_rows` / `matmul_tile`; x holds n·cols, y
        // n·rows floats; matmul_rows only for rows of ≤ MR_MAX_CHUNKS chunks.
        unsafe { b.launch(cfg) }
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ` by `matmul_rows4`: a block per
    /// four rows and token tile ([`Tuning::rows4_min`]).
    pub(crate) fn rows4_launch(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        width_fits("matmul_rows4", w.cols, MR4_MAX_CHUNKS)?;
        let dims = mm_dims(n, w)?;
        let cfg = row_blocks(w.rows.div_ceil(MR4_ROWS) * n.div_ceil(MM_TOKENS))?;
        let mut b = self.kernel(&self.res.matmul_rows4)?;
        b.matmul_args(w, &x, &y, &dims);
        // SAFETY: matches `matmul_rows4`; x holds n·cols, y n·rows floats;
        // rows of at most MR4_MAX_CHUNKS chunks (checked above), and the
        // kernel reads no row at or past `rows`.
        unsafe { b.launch(cfg) }
    }

    /// `matmul_gemm` (the kernel `tiles` names) over every chunk
    /// (`split` None), or split: `(part, cpb)`, blocks of `cpb` chunks
    /// writing each chunk's partials into `part` (chunks · n · rows
    /// floats), then `sum_chunks` into `y`.
    pub(crate) fn gemm_launch(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        tiles: GemmTiles,
        split: Option<(u64, usize)>,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let chunks = w.cols.div_ceil(64);
        let (part, cpb) = match split {
            Some((p, c)) => (p, c.clamp(1, chunks.max(1))),
            None => (0, 0),
        };
        self.gemm_pass(x, n, w, y, tiles, part, cpb)?;
        self.sum_split(MmOut { y, part, chunks }, n * w.rows)
            .map(|_| ())
    }

    /// The `matmul_gemm` launch of [`Gpu::gemm_launch`] alone: into `y`
    /// (`part` 0), or each chunk's partials into `part` by blocks of `cpb`
    /// chunks (no sum).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_pass(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        kind: GemmTiles,
        part: u64,
        cpb: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let dims = mm_dims(n, w)?;
        let chunks = w.cols.div_ceil(64);
        let tiles = gemm_tiles(kind, w.rows, n);
        let cpb = if part == 0 {
            0
        } else {
            cpb.clamp(1, chunks.max(1))
        };
        let groups = if part == 0 { 1 } else { chunks.div_ceil(cpb) };
        let cpbi = as_i32("matmul", cpb)?;
        let cfg = LaunchConfig {
            grid_dim: (as_i32("matmul", tiles * groups)? as u32, 1, 1),
            block_dim: (
                if kind == GemmTiles::Narrow {
                    GM_THREADS
                } else {
                    GW_THREADS
                },
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let f = match kind {
            GemmTiles::Narrow => &self.res.matmul_gemm,
            GemmTiles::Wide => &self.res.matmul_gemm_wide,
        };
        let mut b = self.kernel(f)?;
        b.matmul_args(w, &x, &y, &dims).arg(&part).arg(&cpbi);
        // SAFETY: matches `matmul_gemm`; x holds n·cols, y n·rows floats,
        // part (when non-null) chunks·n·rows; the grid is tiles · groups.
        unsafe { b.launch(cfg) }
    }

    /// Several matmuls of one input `x (n, cols)` in one launch (`mats`:
    /// up to three `(W, y)` of the same storage and `cols`), each output as
    /// [`Gpu::mm`] computes it; separate launches where they cannot share one.
    pub fn mm_multi(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
        scratch: SplitScratch,
    ) -> Result<(), GpuError> {
        let shared = mats.len() <= 3
            && mats.iter().all(|(w, _)| {
                w.kind == mats[0].0.kind
                    && w.cols == mats[0].0.cols
                    && w.cols.div_ceil(64) <= MR_MAX_CHUNKS
                    && w.rows > 0
            });
        if !shared || n == 0 || n >= self.res.tuning.gemm_min.max(1) || mats.len() < 2 {
            for (w, y) in mats {
                self.mm_split(x, n, w, *y, scratch)?;
            }
            return Ok(());
        }
        self.multi_rows_launch(x, n, mats)
    }

    /// One `matmul_multi` launch over up to three matrices of one storage
    /// and width, each of at most `MR_MAX_CHUNKS` chunks a row.
    pub(crate) fn multi_rows_launch(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
    ) -> Result<(), GpuError> {
        let Some((w0, _)) = mats.first() else {
            return Ok(());
        };
        let what = "matmul_multi";
        width_fits(what, w0.cols, MR_MAX_CHUNKS)?;
        if mats.len() > 3
            || mats
                .iter()
                .any(|(w, _)| w.kind != w0.kind || w.cols != w0.cols)
        {
            return Err(GpuError::Shape {
                what,
                detail: format!("{} matrices (at most 3, one storage and width)", mats.len()),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let tiles = n.div_ceil(MM_TOKENS);
        let blocks: usize = mats.iter().map(|(w, _)| w.rows * tiles).sum();
        let (ni, ki) = (as_i32("matmul", n)?, as_i32("matmul", mats[0].0.cols)?);
        as_i32("matmul", n * mats[0].0.cols)?;
        let cfg = row_blocks(blocks)?;
        let [m0, m1, m2] = mat_slots(mats)?;
        let mut b = self.kernel(&self.res.matmul_multi)?;
        b.arg(&mats[0].0.kind).arg(&x).arg(&ni).arg(&ki);
        for m in [&m0, &m1, &m2] {
            b.arg(&m.0).arg(&m.1).arg(&m.2).arg(&m.3);
        }
        // SAFETY: matches `matmul_multi`; x holds n·cols floats, each y
        // n·rows; an absent third matrix has 0 rows and gets no block.
        unsafe { b.launch(cfg) }
    }
}
