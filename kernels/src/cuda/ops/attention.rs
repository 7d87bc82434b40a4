//! RoPE with the K/V page writes (`rope_kv`) and paged attention on the
//! device: the decode forms (`attention_paged`, `attention_decode`, the
//! fused `attention_decode_rope_qs`) and the prefill forms
//! (`attention_prefill`, `_hd64`, `_hd128`), chosen by [`AttnKernel`]; the step's
//! page table ([`PageTable`]).
//!
//! Invariant: every form computes each output by the CPU reference's tile
//! order, so the choice moves speed only; shapes the kernels cannot hold
//! are errors, never launches. A sliding window is the CPU's
//! `attention_window`: each form walks a token's keys from
//! `first_key(pos, window)` in the same absolute tiles (the argument
//! `window`, 0 for none).

use cudarc::driver::LaunchConfig;

use crate::cuda::buf::DevBuf;
use crate::cuda::launch::*;
use crate::cuda::split::MmOut;
use crate::cuda::{as_i32, Gpu, GpuError, MAX_HEAD_DIM};
use crate::paged::PageLayout;

/// Which attention kernel (each gives the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// `attention_paged`: a block per (token, head), one position per
    /// group of 8 threads at a time (wide steps).
    Paged,
    /// `attention_decode`: the same blocks, each group's K/V loads batched
    /// (small steps).
    Decode,
    /// `attention_prefill`: a block per (group of up to [`PF_TQ`] tokens of
    /// one sequence, head), each K/V tile loaded once for the group.
    Prefill,
    /// `attention_prefill_hd64`: `attention_prefill` for head_dim 64, its
    /// tiles loaded as float4 rows with the next in flight (the same
    /// operations; [`AttnKernel::fixed_head_dim`] and [`prefill_fixed`]
    /// say where it may run).
    PrefillHd64,
    /// `attention_prefill_hd128`: the same for head_dim 128.
    PrefillHd128,
    /// `attention_split_*`: decode split over the KV length, three
    /// launches over scratch ([`Gpu::attention_split`]; `attention_with`
    /// refuses it, having none).
    Split,
}

impl AttnKernel {
    /// Whether the kernel walks the table's prefill groups.
    pub fn is_prefill(self) -> bool {
        matches!(self, Self::Prefill | Self::PrefillHd64 | Self::PrefillHd128)
    }

    /// The head_dim a kernel compiled for one serves (`None`: any).
    pub fn fixed_head_dim(self) -> Option<usize> {
        match self {
            Self::PrefillHd64 => Some(64),
            Self::PrefillHd128 => Some(128),
            _ => None,
        }
    }
}

/// The prefill kernel compiled for `shape`'s head_dim (64 or 128) where it
/// may serve `shape` over pages of `layout`: every K/V row 16-byte aligned
/// (kv_dim and page_len · aux_dim multiples of 4, so every page and layer
/// starts on one). `None`: `attention_prefill` (any head_dim up to
/// [`PF_MAXHD`]).
pub fn prefill_fixed(shape: &crate::AttnShape, layout: &PageLayout) -> Option<AttnKernel> {
    let aligned =
        layout.kv_dim.is_multiple_of(4) && (layout.page_len * layout.aux_dim).is_multiple_of(4);
    match shape.head_dim {
        64 if aligned => Some(AttnKernel::PrefillHd64),
        128 if aligned => Some(AttnKernel::PrefillHd128),
        _ => None,
    }
}

/// Whether the attention kernels hold `shape` over pages of `layout`:
/// whole groups of heads per K/V head, head_dim up to [`MAX_HEAD_DIM`], the
/// pages' kv_dim the shape's.
pub(crate) fn attn_shape_ok(shape: &crate::AttnShape, layout: &PageLayout) -> bool {
    shape.n_kv_heads != 0
        && shape.n_heads.is_multiple_of(shape.n_kv_heads)
        && shape.head_dim <= MAX_HEAD_DIM
        && shape.kv_dim() == layout.kv_dim
}

/// The attention kernels' shape arguments and a launch of `blocks` blocks.
pub(crate) struct AttnArgs {
    pub(crate) nh: i32,
    pub(crate) nkv: i32,
    pub(crate) hd: i32,
    pub(crate) li: i32,
    pub(crate) pl: i32,
    pub(crate) aux: i32,
    pub(crate) cfg: LaunchConfig,
}

pub(crate) fn attn_args(
    shape: &crate::AttnShape,
    layout: &PageLayout,
    layer: usize,
    blocks: usize,
) -> Result<AttnArgs, GpuError> {
    let (pl, _, aux) = layout_args(layout)?;
    Ok(AttnArgs {
        nh: as_i32("attention", shape.n_heads)?,
        nkv: as_i32("attention", shape.n_kv_heads)?,
        hd: as_i32("attention", shape.head_dim)?,
        li: as_i32("attention", layer)?,
        pl,
        aux,
        cfg: LaunchConfig {
            grid_dim: (as_i32("attention", blocks)? as u32, 1, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
    })
}

/// The kernels' `window` argument: 0 for none; a window wider than any
/// position the kernels index is the same walk as none, so it is clamped.
/// A window of zero positions is refused, as the CPU refuses it.
pub(crate) fn window_arg(window: Option<usize>) -> Result<i32, GpuError> {
    match window {
        None => Ok(0),
        Some(0) => Err(GpuError::Shape {
            what: "attention",
            detail: "a window of zero positions".into(),
        }),
        Some(w) => Ok(i32::try_from(w).unwrap_or(i32::MAX)),
    }
}

pub(crate) fn layout_args(l: &PageLayout) -> Result<(i32, i32, i32), GpuError> {
    as_i32("kv page", l.page_floats())?;
    Ok((
        as_i32("kv page", l.page_len)?,
        as_i32("kv page", l.kv_dim)?,
        as_i32("kv page", l.aux_dim)?,
    ))
}

/// Device addresses of a step's page table (u64 arrays): every sequence's
/// page addresses, each token's offset into them, and each token's position;
/// and, where the step's spans are long, `n_groups` groups of at most
/// [`PF_TQ`] consecutive tokens of one sequence at `groups` (each
/// `first token << 32 | count`, see [`prefill_groups`]), which let
/// attention share K/V tiles (`attention_prefill`); `n_groups` 0: none.
#[derive(Debug, Clone, Copy)]
pub struct PageTable {
    pub pages: u64,
    pub seq_off: u64,
    pub pos: u64,
    pub groups: u64,
    pub n_groups: usize,
}

impl Gpu {
    /// RoPE of `n` query and key rows at positions `pos`, and the rotated
    /// keys with the values `v` written into the tokens' pages (`dst`,
    /// `slot`) of `layer`: RoPE then the page writes, one launch. Each of
    /// q, k, v is read where it is: a split matmul's partials are summed
    /// here and its rows written to its `y` as well.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv(
        &self,
        qkv: (MmOut, MmOut, MmOut),
        tables: (&DevBuf, &DevBuf),
        pos: u64,
        dst: u64,
        slot: u64,
        n: usize,
        qd: usize,
        head_dim: usize,
        layout: PageLayout,
        layer: usize,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let kvd = layout.kv_dim;
        let per = qd / 2 + kvd / 2 + kvd;
        // One chunk count among the partials (q, k and v share their input,
        // so they always agree; a mismatch is summed in place first).
        let (q, k) = crate::cuda::split::agree(self, qkv.0, qkv.1, n * kvd)?;
        let (q, v) = crate::cuda::split::agree(self, q, qkv.2, n * kvd)?;
        let (k, v) = crate::cuda::split::agree(self, k, v, n * kvd)?;
        let chunks = as_i32("rope", q.chunks.max(k.chunks).max(v.chunks))?;
        let (ni, qi, ki, di) = (
            as_i32("rope", n)?,
            as_i32("rope", qd)?,
            as_i32("rope", kvd)?,
            as_i32("rope", head_dim)?,
        );
        let li = as_i32("rope", layer)?;
        let (pl, _, aux) = layout_args(&layout)?;
        let mut b = self.kernel(&self.res.rope_kv)?;
        b.arg(&q.y)
            .arg(&k.y)
            .arg(&v.y)
            .arg(&q.part)
            .arg(&k.part)
            .arg(&v.part)
            .arg(&chunks)
            .arg(&tables.0.ptr)
            .arg(&tables.1.ptr)
            .arg(&pos)
            .arg(&dst)
            .arg(&slot)
            .arg(&ni)
            .arg(&qi)
            .arg(&ki)
            .arg(&di)
            .arg(&li)
            .arg(&pl)
            .arg(&aux);
        // SAFETY: matches `rope_kv`; q holds n·qd floats, k and v n·kvd (and
        // each non-null part chunks times its floats); positions inside the
        // tables, every page address a whole page of `layout`, every slot
        // below page_len.
        unsafe { b.launch(elems(n * per, "rope_kv")?) }
    }

    /// Paged causal attention of `n` query rows: token t attends positions
    /// `first_key(pos[t], window) ..= pos[t]` through page addresses
    /// `pages[seq_off[t]..]`; by
    /// `attention_prefill` (`_hd64`, `_hd128` where [`prefill_fixed`]) where the table
    /// lists groups, the split over the KV length where the caller gives
    /// its scratch (`split`, [`Gpu::attention_split`]), `attention_decode`
    /// for steps of at most [`Tuning::attn_decode_max`] blocks,
    /// `attention_paged` otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_paged(
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
        split: Option<crate::cuda::ops::attention_split::SplitKv>,
    ) -> Result<(), GpuError> {
        if let Some(split) = split {
            return self
                .attention_split(q, table, n, shape, layout, layer, scale, window, out, split);
        }
        let tun = self.res.tuning;
        let kernel = if table.n_groups > 0 && shape.head_dim <= PF_MAXHD {
            prefill_fixed(shape, &layout).unwrap_or(AttnKernel::Prefill)
        } else if n * shape.n_heads <= tun.attn_decode_max {
            AttnKernel::Decode
        } else {
            AttnKernel::Paged
        };
        self.attention_with(
            kernel, q, table, n, shape, layout, layer, scale, window, out,
        )
    }

    /// [`Gpu::attention_paged`] by the kernel named, whatever the step's
    /// size (`Prefill` needs the table's groups).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with(
        &self,
        kernel: AttnKernel,
        q: u64,
        table: PageTable,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        window: Option<usize>,
        out: u64,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let win = window_arg(window)?;
        if !attn_shape_ok(shape, &layout) {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!(
                    "heads {}/{} × {} (head_dim ≤ {MAX_HEAD_DIM}), pages of kv_dim {}",
                    shape.n_heads, shape.n_kv_heads, shape.head_dim, layout.kv_dim
                ),
            });
        }
        let prefill = kernel.is_prefill();
        if let Some(fixed) = kernel.fixed_head_dim() {
            if prefill_fixed(shape, &layout) != Some(kernel) {
                return Err(GpuError::Shape {
                    what: "attention (_hd64, _hd128)",
                    detail: format!(
                        "head_dim {} ({fixed}), kv_dim {} and page_len {} × aux_dim {} (multiples of 4)",
                        shape.head_dim, layout.kv_dim, layout.page_len, layout.aux_dim
                    ),
                });
            }
        }
        if prefill && (shape.head_dim > PF_MAXHD || table.n_groups == 0) {
            return Err(GpuError::Shape {
                what: "attention_prefill",
                detail: format!(
                    "head_dim {} (≤ {PF_MAXHD}), {} groups (> 0)",
                    shape.head_dim, table.n_groups
                ),
            });
        }
        let blocks = if prefill { table.n_groups } else { n } * shape.n_heads;
        let AttnArgs {
            nh,
            nkv,
            hd,
            li,
            pl,
            aux,
            cfg,
        } = attn_args(shape, &layout, layer, blocks)?;
        let f = match kernel {
            AttnKernel::Paged => &self.res.attention_paged,
            AttnKernel::Decode => &self.res.attention_decode,
            AttnKernel::Prefill => &self.res.attention_prefill,
            AttnKernel::PrefillHd64 => &self.res.attention_prefill_hd64,
            AttnKernel::PrefillHd128 => &self.res.attention_prefill_hd128,
            AttnKernel::Split => {
                return Err(GpuError::Shape {
                    what: "attention_split",
                    detail: "launched with its scratch by Gpu::attention_split".into(),
                })
            }
        };
        let mut b = self.kernel(f)?;
        b.arg(&q)
            .arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos);
        if prefill {
            b.arg(&table.groups);
        }
        b.arg(&out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&scale)
            .arg(&win);
        // SAFETY: matches `attention_paged` / `attention_decode` (the same
        // parameters) and `attention_prefill` (groups after pos); token t's
        // page list covers positions 0..=pos[t], each entry the address of a
        // whole page; each group's tokens share one sequence's page list
        // (`prefill_groups`) and its count is at most PF_TQ.
        unsafe { b.launch(cfg) }
    }

    /// `rope_kv` then `attention_decode` in one launch, the same bits: RoPE of `q` (n · qd, in
    /// place) and of the unrotated K rows `kraw` (n · kvd) into `kout` and,
    /// with the V rows `v`, into each token's page slot `dst`/`slot`; then
    /// attention into `out`. Only for a step whose tokens are one per
    /// sequence and whose pages are in no other token's page list (no
    /// block reads a row another block writes), with head_dim even and at
    /// most 256: the caller checks the first two, this the shapes.
    /// The kernel is `attention_decode_rope_qs`, which also hands the
    /// rotated q head to the attention in shared memory; under `window`
    /// each token attends its last `window` positions.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode_rope(
        &self,
        qkv: (u64, u64, u64),
        kout: u64,
        tables: (&DevBuf, &DevBuf),
        table: PageTable,
        dst: u64,
        slot: u64,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        window: Option<usize>,
        out: u64,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let win = window_arg(window)?;
        if !attn_shape_ok(shape, &layout)
            || !shape.head_dim.is_multiple_of(2)
            || table.n_groups != 0
        {
            return Err(GpuError::Shape {
                what: "attention_decode_rope",
                detail: format!(
                    "heads {}/{} × {} (even, ≤ {MAX_HEAD_DIM}), pages of kv_dim {}, {} prefill groups (0)",
                    shape.n_heads, shape.n_kv_heads, shape.head_dim, layout.kv_dim, table.n_groups
                ),
            });
        }
        let AttnArgs {
            nh,
            nkv,
            hd,
            li,
            pl,
            aux,
            cfg,
        } = attn_args(shape, &layout, layer, n * shape.n_heads)?;
        let f = &self.res.attention_decode_rope_qs;
        let mut b = self.kernel(f)?;
        b.arg(&qkv.0)
            .arg(&qkv.1)
            .arg(&kout)
            .arg(&qkv.2)
            .arg(&tables.0.ptr)
            .arg(&tables.1.ptr)
            .arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos)
            .arg(&dst)
            .arg(&slot)
            .arg(&out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&scale)
            .arg(&win);
        // SAFETY: matches `attention_decode_rope_qs`; q holds n·qd floats,
        // kraw, kout and v n·kvd; positions inside the RoPE tables; each
        // token's page list covers 0..=pos[t] and dst[t]/slot[t] is the
        // slot of pos[t] in it (distinct over the step); out n·qd floats.
        unsafe { b.launch(cfg) }
    }
}
