//! Split gemm outputs, where they are and who sums them.
//!
//! A `matmul_gemm` that would leave the device idle is split over its
//! chunks: its blocks write each chunk's partial into scratch, and the
//! partials are summed in chunk order from +0.0 (`sum_chunks`). This module
//! owns the step's matmuls of one input ([`Gpu::mm_outs`]: q, k, v; gate,
//! up), planned into disjoint regions of the step's split scratch and, with
//! [`Tuning::gemm_multi`], launched as one `matmul_gemm_multi`; and, with
//! [`Tuning::fold_sums`], outputs left as partials ([`MmOut`]) for the kernel
//! that reads them to sum through `split_value` (`rope_kv`, the norms,
//! `swiglu_split`, `add_rows`).
//!
//! Invariants: every output, summed where it is read or by `sum_chunks`, is
//! the bits of the matmul's own launch (the same blocks, the same partials,
//! the same sum); partials stay in the scratch only until the kernel that
//! reads them has run (the next split matmul of the step reuses it), so a
//! caller hands each [`MmOut`] with partials to one consumer before its next
//! [`Gpu::mm_outs`].

use cudarc::driver::LaunchConfig;

use super::buf::{DevMatrix, SplitScratch};
use super::launch::{elems, mm_dims, GW_THREADS};
use super::ops::matmul::{gemm_tiles, GemmTiles};
use super::tuning::Tuning;
use super::{as_i32, Gpu, GpuError};

/// Where a matmul's output values are: in `y` (`part` 0), or as the chunk
/// partials of a split gemm (`chunks` · n · rows floats at `part`), whose
/// sum in chunk order the consuming kernel makes (`split_value`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmOut {
    /// The output's address (n · rows floats): its values when `part` is 0,
    /// and where a consumer that needs them in place puts them.
    pub y: u64,
    /// Chunk partials of a split gemm; 0: none.
    pub part: u64,
    /// The matmul's chunks (columns / 64, rounded up).
    pub chunks: usize,
}

impl MmOut {
    /// Values already in `y`.
    pub fn at(y: u64) -> Self {
        Self {
            y,
            part: 0,
            chunks: 0,
        }
    }

    /// Whether the values are still partials.
    pub fn is_split(&self) -> bool {
        self.part != 0
    }
}

/// The one-launch matmul [`Gpu::multi_resident`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultiKernel {
    /// `matmul_multi` (a block per row; fewer tokens than the gemm's).
    Rows,
    /// `matmul_gemm_multi`, every matrix whole.
    Gemm,
    /// `matmul_gemm_multi`, each matrix split over its chunks as the
    /// tuning's `split_blocks` plans it, the partials then summed.
    GemmSplit,
}

/// One matmul of [`Gpu::mm_outs`]: its partials (0: unsplit), chunks per
/// block, and blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    part: u64,
    cpb: usize,
    blocks: usize,
}

/// Plans `mats` (rows, cols) of an `n`-token step with `kind` tiles into
/// `scratch`: each matmul split (as [`Gpu::mm_split`] decides: fewer tiles
/// than [`Tuning::split_blocks`], more than one chunk) where its partials
/// fit the scratch left after the ones before it.
fn plan(
    tun: &Tuning,
    kind: GemmTiles,
    n: usize,
    mats: &[(usize, usize)],
    scratch: SplitScratch,
) -> Vec<Plan> {
    let mut used = 0usize;
    mats.iter()
        .map(|&(rows, cols)| {
            let tiles = gemm_tiles(kind, rows, n);
            let chunks = cols.div_ceil(64);
            let need = chunks * n * rows;
            let split = scratch.addr != 0
                && scratch.floats.saturating_sub(used) >= need
                && tiles < tun.split_blocks
                && chunks > 1;
            if !split {
                return Plan {
                    part: 0,
                    cpb: 0,
                    blocks: tiles,
                };
            }
            let groups = tun.split_blocks.div_ceil(tiles.max(1)).min(chunks);
            let cpb = chunks.div_ceil(groups);
            let part = scratch.addr + 4 * used as u64;
            used += need;
            Plan {
                part,
                cpb,
                blocks: tiles * chunks.div_ceil(cpb),
            }
        })
        .collect()
}

impl Gpu {
    /// `y = x (n, cols) · Wᵀ` for each `(W, y)` of `mats` (one input, up to
    /// three matrices), each output the bits [`Gpu::mm_split`] gives.
    /// Below [`Tuning::gemm_min`] tokens this is [`Gpu::mm_multi`].
    /// Otherwise the split matmuls' partials go to disjoint regions of
    /// `scratch`, and the matmuls of wide tiles are one launch (a single
    /// matrix too: `matmul_gemm_multi` does not spill); with `fold` split
    /// outputs are returned as partials (no `sum_chunks`), to be read by one
    /// kernel that sums them before the next `mm_outs`.
    pub fn mm_outs(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
        scratch: SplitScratch,
        fold: bool,
    ) -> Result<Vec<MmOut>, GpuError> {
        let tun = self.res.tuning;
        let plain: Vec<MmOut> = mats.iter().map(|(_, y)| MmOut::at(*y)).collect();
        if n == 0 || n < tun.gemm_min.max(1) {
            self.mm_multi(x, n, mats, scratch)?;
            return Ok(plain);
        }
        let kind = if n >= tun.gemm_wide_min.max(1) {
            GemmTiles::Wide
        } else {
            GemmTiles::Narrow
        };
        let shapes: Vec<(usize, usize)> = mats.iter().map(|(w, _)| (w.rows, w.cols)).collect();
        let plans = plan(&tun, kind, n, &shapes, scratch);
        let one_launch = kind == GemmTiles::Wide
            && (1..=3).contains(&mats.len())
            && mats
                .iter()
                .all(|(w, _)| w.kind == mats[0].0.kind && w.cols == mats[0].0.cols && w.rows > 0);
        if one_launch {
            self.gemm_multi_launch(x, n, mats, &plans)?;
        } else {
            for ((w, y), p) in mats.iter().zip(&plans) {
                self.gemm_pass(x, n, w, *y, kind, p.part, p.cpb)?;
            }
        }
        let mut outs = Vec::with_capacity(mats.len());
        for ((w, y), p) in mats.iter().zip(&plans) {
            let o = MmOut {
                y: *y,
                part: p.part,
                chunks: w.cols.div_ceil(64),
            };
            outs.push(if fold {
                o
            } else {
                MmOut::at(self.sum_split(o, n * w.rows)?)
            });
        }
        Ok(outs)
    }

    /// Up to three matmuls of one input on host operands by one launch of
    /// the kernel `kernel` names (gpu_check: each matrix's output against
    /// the CPU's matmul); returns each matrix's output.
    pub fn multi_resident(
        &self,
        kernel: MultiKernel,
        x: &[f32],
        n: usize,
        mats: &[&crate::Matrix],
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let dx = self.upload(x, "x")?;
        let dm: Vec<DevMatrix> = mats
            .iter()
            .map(|m| self.upload_matrix(m, "w"))
            .collect::<Result<_, _>>()?;
        let outs: Vec<super::buf::DevBuf> = mats
            .iter()
            .map(|m| self.alloc(n * m.rows * 4, "y"))
            .collect::<Result<_, _>>()?;
        let pairs: Vec<(&DevMatrix, u64)> =
            dm.iter().zip(&outs).map(|(m, o)| (m, o.ptr())).collect();
        let shapes: Vec<(usize, usize)> = mats.iter().map(|m| (m.rows, m.cols)).collect();
        let mut scratch = None;
        match kernel {
            MultiKernel::Rows => {
                if n >= self.res.tuning.gemm_min.max(1) || n > super::launch::MM_TOKENS {
                    return Err(GpuError::Shape {
                        what: "matmul_multi",
                        detail: format!(
                            "{n} tokens (this check runs it below the gemm's {})",
                            self.res.tuning.gemm_min
                        ),
                    });
                }
                self.mm_multi(dx.ptr(), n, &pairs, SplitScratch::NONE)?;
            }
            MultiKernel::Gemm | MultiKernel::GemmSplit => {
                let sp = if kernel == MultiKernel::GemmSplit {
                    let floats: usize = shapes.iter().map(|(r, c)| c.div_ceil(64) * n * r).sum();
                    let buf = self.alloc(floats * 4, "partials")?;
                    let sp = SplitScratch {
                        addr: buf.ptr(),
                        floats,
                    };
                    scratch = Some(buf);
                    sp
                } else {
                    SplitScratch::NONE
                };
                let plans = plan(&self.res.tuning, GemmTiles::Wide, n, &shapes, sp);
                self.gemm_multi_launch(dx.ptr(), n, &pairs, &plans)?;
                for ((w, y), p) in pairs.iter().zip(&plans) {
                    let o = MmOut {
                        y: *y,
                        part: p.part,
                        chunks: w.cols.div_ceil(64),
                    };
                    self.sum_split(o, n * w.rows)?;
                }
            }
        }
        let res = outs
            .iter()
            .zip(mats)
            .map(|(o, m)| {
                let mut v = vec![0.0; n * m.rows];
                self.dtoh(o.ptr(), &mut v)?;
                Ok(v)
            })
            .collect();
        drop(scratch);
        res
    }

    /// `matmul_gemm_multi` over `mats` (1 to 3, one storage and width, wide
    /// tiles) as `plans` lays them out. One matrix alone takes it too: the
    /// same body as `matmul_gemm_wide`, which spills 24 bytes at its 128
    /// registers where this one does not (ptxas, sm_90).
    fn gemm_multi_launch(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
        plans: &[Plan],
    ) -> Result<(), GpuError> {
        let (ni, _, ki) = mm_dims(n, mats[0].0)?;
        let total: usize = plans.iter().map(|p| p.blocks).sum();
        let cfg = LaunchConfig {
            grid_dim: (as_i32("matmul", total)? as u32, 1, 1),
            block_dim: (GW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Per matrix: weights, y, rows, row bytes, partials, chunks a block,
        // blocks (an absent third: no blocks).
        let mut slots = Vec::with_capacity(3);
        for i in 0..3 {
            slots.push(match (mats.get(i), plans.get(i)) {
                (Some((w, y)), Some(p)) => {
                    mm_dims(n, w)?;
                    (
                        w.buf.ptr(),
                        *y,
                        as_i32("matmul", w.rows)?,
                        w.row_bytes,
                        p.part,
                        as_i32("matmul", p.cpb)?,
                        as_i32("matmul", p.blocks)?,
                    )
                }
                _ => (0, 0, 0, 0, 0, 0, 0),
            });
        }
        let mut b = self.kernel(&self.res.matmul_gemm_multi)?;
        b.arg(&mats[0].0.kind).arg(&x).arg(&ni).arg(&ki);
        for s in &slots {
            b.arg(&s.0)
                .arg(&s.1)
                .arg(&s.2)
                .arg(&s.3)
                .arg(&s.4)
                .arg(&s.5)
                .arg(&s.6);
        }
        // SAFETY: matches `matmul_gemm_multi`; x holds n·cols floats, each y
        // n·rows, each non-null part chunks·n·rows (disjoint regions of the
        // scratch, `plan`); the grid is the matrices' blocks in order.
        unsafe { b.launch(cfg) }
    }

    /// Sums `o`'s partials into `o.y` (`sum_chunks`, `count` = n · rows)
    /// where it has them; returns the address of its values.
    pub fn sum_split(&self, o: MmOut, count: usize) -> Result<u64, GpuError> {
        if !o.is_split() || count == 0 {
            return Ok(o.y);
        }
        let ci = as_i32("matmul", o.chunks)?;
        let cl = count as i64;
        let mut b = self.kernel(&self.res.sum_chunks)?;
        b.arg(&o.part).arg(&o.y).arg(&ci).arg(&cl);
        // SAFETY: matches `sum_chunks`; part holds chunks·count floats, y
        // count.
        unsafe { b.launch(elems(count, "sum_chunks")?) }?;
        Ok(o.y)
    }

    /// `out = silu(g) · u` for `n` floats, `g` and `u` read where they are
    /// (`swiglu_split` sums partials; `swiglu` where both are in place).
    pub fn swiglu_out(&self, g: MmOut, u: MmOut, out: u64, n: usize) -> Result<(), GpuError> {
        if !g.is_split() && !u.is_split() {
            return self.swiglu_dev(g.y, u.y, out, n);
        }
        if n == 0 {
            return Ok(());
        }
        // One chunk count for both: a mismatch (never the case for gate and
        // up, which share their input) is summed in place first.
        let (g, u) = agree(self, g, u, n)?;
        let chunks = as_i32("swiglu", g.chunks.max(u.chunks))?;
        let nl = n as i64;
        let mut b = self.kernel(&self.res.swiglu_split)?;
        b.arg(&g.y)
            .arg(&g.part)
            .arg(&u.y)
            .arg(&u.part)
            .arg(&chunks)
            .arg(&out)
            .arg(&nl);
        // SAFETY: matches `swiglu_split`; g, u (or their partials, chunks·n)
        // and out hold n floats.
        unsafe { b.launch(elems(n, "swiglu")?) }
    }

    /// `x[i] += y[i]` for `n` floats, `y` read where it is.
    pub fn add_out(&self, x: u64, y: MmOut, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let ni = as_i32("add", n)?;
        let ci = as_i32("add", y.chunks)?;
        let mut b = self.kernel(&self.res.add_rows)?;
        b.arg(&x).arg(&y.y).arg(&y.part).arg(&ci).arg(&ni);
        // SAFETY: matches `add_rows`; x and y (or its partials, chunks·n)
        // hold n floats.
        unsafe { b.launch(elems(n, "add")?) }
    }
}

/// `a` and `b` with one chunk count among their partials: where both are
/// split with different counts, `b` is summed in place (`count` floats).
pub(crate) fn agree(
    gpu: &Gpu,
    a: MmOut,
    b: MmOut,
    count: usize,
) -> Result<(MmOut, MmOut), GpuError> {
    if a.is_split() && b.is_split() && a.chunks != b.chunks {
        return Ok((a, MmOut::at(gpu.sum_split(b, count)?)));
    }
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tun(split_blocks: usize) -> Tuning {
        Tuning {
            split_blocks,
            ..Tuning::default()
        }
    }

    #[test]
    fn plans_give_each_split_its_own_region_and_keep_mm_splits_choice() {
        let s = SplitScratch {
            addr: 1 << 20,
            floats: 1_000_000,
        };
        // Batch 64, q/k/v of the small preset: 9 chunks each, wide tiles.
        let p = plan(
            &tun(4096),
            GemmTiles::Wide,
            64,
            &[(576, 576), (192, 576), (192, 576)],
            s,
        );
        // 18 and 6 tiles: split to one chunk a block (groups = 9).
        assert_eq!(p[0].cpb, 1);
        assert_eq!(p[0].blocks, 18 * 9);
        assert_eq!(p[1].blocks, 6 * 9);
        assert_eq!(p[0].part, s.addr);
        assert_eq!(p[1].part, s.addr + 4 * (9 * 64 * 576) as u64);
        assert_eq!(p[2].part, p[1].part + 4 * (9 * 64 * 192) as u64);
        // Past the scratch: the later matmul runs unsplit.
        let small = SplitScratch {
            addr: 1 << 20,
            floats: 9 * 64 * 576 + 100,
        };
        let p = plan(
            &tun(4096),
            GemmTiles::Wide,
            64,
            &[(576, 576), (192, 576)],
            small,
        );
        assert_ne!(p[0].part, 0);
        assert_eq!((p[1].part, p[1].cpb, p[1].blocks), (0, 0, 6));
        // Tiles enough, one chunk, no scratch, or splitting off: unsplit.
        for (t, rows, cols, sc) in [
            (tun(4096), 49152, 576, s),
            (tun(4096), 576, 64, s),
            (tun(4096), 576, 576, SplitScratch::NONE),
            (tun(0), 576, 576, s),
        ] {
            let p = plan(&t, GemmTiles::Wide, 64, &[(rows, cols)], sc);
            assert_eq!(p[0].part, 0, "{rows}×{cols}");
            assert_eq!(p[0].blocks, gemm_tiles(GemmTiles::Wide, rows, 64));
        }
        // Groups below the chunks: several chunks a block.
        let p = plan(&tun(100), GemmTiles::Wide, 64, &[(1536, 576)], s);
        // 48 tiles: 3 groups of 3 chunks.
        assert_eq!((p[0].cpb, p[0].blocks), (3, 48 * 3));
    }
}
