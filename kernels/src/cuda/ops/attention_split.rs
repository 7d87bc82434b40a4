//! Decode attention split over the KV length (`attention_split_scores`,
//! `attention_split_pv`, `attention_split_merge`, kernels/cuda/
//! attention_split.cu): for steps of few (token, head) rows and long
//! contexts, whose one block per row would leave most of the device idle.
//!
//! Invariant: the same bits as [`AttnKernel::Decode`] (every score, max,
//! p, tile sum and P·V chain by the same operations in the same order; the
//! running max before a segment by a reduction that keeps the sequential
//! fold's value). The launch shape depends on the row count and
//! [`SplitKv::segs`] only, never on the positions, so a captured graph
//! replays it for any context up to [`SplitKv::cap_tiles`] tiles a row.

use cudarc::driver::LaunchConfig;

#[allow(unused_imports)] // the doc links
use crate::cuda::ops::attention::AttnKernel;
use crate::cuda::ops::attention::{attn_args, attn_shape_ok, window_arg, AttnArgs, PageTable};
use crate::cuda::{as_i32, Gpu, GpuError};
use crate::paged::PageLayout;

pub use crate::ATTN_TILE;

/// Tiles per segment of the split (`SPLIT_TILES` in attention_split.cu).
pub const SPLIT_TILES: usize = 4;

/// Query heads per K/V head the split serves (`SPLIT_MAX_GROUP`); a shape
/// with more takes [`Gpu::attention_paged`] (the same bits).
pub const SPLIT_MAX_GROUP: usize = 8;

/// Blocks a split launch aims for (segments per (token, K/V head) times
/// those): several an SM on the devices measured.
const SPLIT_BLOCKS: usize = 1024;

/// Where a split launch keeps its partials: scratch for `cap_tiles` tiles
/// a row at `addr` ([`SplitKv::floats`] floats).
#[derive(Debug, Clone, Copy)]
pub struct SplitKv {
    pub addr: u64,
    pub cap_tiles: usize,
}

impl SplitKv {
    /// Floats of scratch `rows` rows of `cap_tiles` tiles need at
    /// `head_dim` ([`crate::split_kv_floats`]).
    pub fn floats(rows: usize, cap_tiles: usize, head_dim: usize) -> usize {
        crate::split_kv_floats(rows, cap_tiles, head_dim)
    }

    /// Tiles the longest walk of positions up to `max_pos` has (a window
    /// starts a walk at a tile boundary or within its first tile, so no
    /// walk has more).
    pub fn tiles_for(max_pos: usize) -> usize {
        max_pos / ATTN_TILE + 1
    }
}

impl Gpu {
    /// [`Gpu::attention_paged`] of `n` decode rows by the split kernels:
    /// `out` gets `attention_decode`'s bits. Every row's walk must have at
    /// most `split.cap_tiles` tiles (the caller sizes the scratch by
    /// [`SplitKv::tiles_for`] of its longest position). A block of steps 1
    /// and 2 serves one (token, K/V head) and its query heads, taking every
    /// `segs`-th segment, `segs` a function of `n`, the shape and
    /// `cap_tiles` only (so a graph replays the launch for any context).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_split(
        &self,
        q: u64,
        table: PageTable,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        window: Option<usize>,
        out: u64,
        split: SplitKv,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        if attn_shape_ok(shape, &layout) && shape.n_heads / shape.n_kv_heads > SPLIT_MAX_GROUP {
            return self
                .attention_paged(q, table, n, shape, layout, layer, scale, window, out, None);
        }
        let win = window_arg(window)?;
        if !attn_shape_ok(shape, &layout) || split.cap_tiles == 0 {
            return Err(GpuError::Shape {
                what: "attention_split",
                detail: format!(
                    "heads {}/{} × {}, pages of kv_dim {}, scratch of {} tiles a row",
                    shape.n_heads, shape.n_kv_heads, shape.head_dim, layout.kv_dim, split.cap_tiles
                ),
            });
        }
        let rows = n * shape.n_heads;
        let groups = n * shape.n_kv_heads;
        let segs = split
            .cap_tiles
            .div_ceil(SPLIT_TILES)
            .min((SPLIT_BLOCKS / groups).max(1));
        // Every index the kernels form inside the scratch fits 32 bits per
        // factor and 64 in all; the block count fits the grid.
        as_i32("attention_split", groups * segs)?;
        let (segs_i, cap) = (
            as_i32("attention_split", segs)?,
            as_i32("attention_split", split.cap_tiles)?,
        );
        let per = rows * split.cap_tiles;
        let sc = split.addr;
        let tm = sc + 4 * (per * ATTN_TILE) as u64;
        let (ta, tl) = (tm + 4 * per as u64, tm + 8 * per as u64);
        let at = tm + 12 * per as u64;
        let AttnArgs {
            nh,
            nkv,
            hd,
            li,
            pl,
            aux,
            cfg,
        } = attn_args(shape, &layout, layer, groups * segs)?;
        let mut b = self.kernel(&self.res.attention_split_scores)?;
        b.arg(&q)
            .arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&scale)
            .arg(&win)
            .arg(&segs_i)
            .arg(&cap)
            .arg(&sc)
            .arg(&tm);
        // SAFETY: matches `attention_split_scores`; q holds n rows of
        // n_heads·head_dim floats; the table's addresses as for
        // `attention_decode`; sc and tm hold rows·cap·ATTN_TILE and rows·cap
        // floats (the caller's scratch of `SplitKv::floats`).
        unsafe { b.launch(cfg) }?;
        let mut b = self.kernel(&self.res.attention_split_pv)?;
        b.arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&win)
            .arg(&segs_i)
            .arg(&cap)
            .arg(&sc)
            .arg(&tm)
            .arg(&ta)
            .arg(&tl)
            .arg(&at);
        // SAFETY: matches `attention_split_pv`; the scratch as above, ta and
        // tl rows·cap floats, at rows·cap·head_dim.
        unsafe { b.launch(cfg) }?;
        let merge = LaunchConfig {
            grid_dim: (as_i32("attention_split", rows)? as u32, 1, 1),
            ..cfg
        };
        let mut b = self.kernel(&self.res.attention_split_merge)?;
        b.arg(&table.pos)
            .arg(&nh)
            .arg(&hd)
            .arg(&win)
            .arg(&cap)
            .arg(&ta)
            .arg(&tl)
            .arg(&at)
            .arg(&out);
        // SAFETY: matches `attention_split_merge`; out holds n rows of
        // n_heads·head_dim floats; the scratch as above.
        unsafe { b.launch(merge) }
    }
}
