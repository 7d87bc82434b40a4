//! The resident kernels that the program ops beyond llama's use: a
//! matmul's bias, scaling, GeGLU, stream repeats and means, bf16 rounding,
//! the hyper-connection coefficients and mixes, the MoE combine over expert
//! outputs laid out by expert, and indexer-key page writes.
//!
//! Each computes what its host form in `lmrr_kernels` computes, in the same
//! order with the same roundings (the comments in kernels/cuda/ say how).

use crate::cuda::launch::*;
use crate::cuda::{as_i32, Gpu, GpuError};
use crate::paged::PageLayout;

impl Gpu {
    /// `y[i] += b[i % cols]` over `n` floats (a matmul's bias, `cols` wide).
    pub fn add_bias(&self, y: u64, b: u64, n: usize, cols: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let (nl, ci) = (n as i64, as_i32("add_bias", cols.max(1))?);
        let mut l = self.kernel(&self.res.add_bias)?;
        l.arg(&y).arg(&b).arg(&nl).arg(&ci);
        // SAFETY: matches `add_bias`; y holds n floats, b cols.
        unsafe { l.launch(elems(n, "add_bias")?) }
    }

    /// `x[i] *= by` over `n` floats.
    pub fn scale(&self, x: u64, by: f32, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        let mut l = self.kernel(&self.res.scale_elems)?;
        l.arg(&x).arg(&by).arg(&nl);
        // SAFETY: matches `scale_elems`; x holds n floats.
        unsafe { l.launch(elems(n, "scale")?) }
    }

    /// `out = gelu_tanh(g) · u` over `n` floats ([`crate::act::geglu`]).
    pub fn geglu(&self, g: u64, u: u64, out: u64, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let (nl, a, c) = (n as i64, crate::act::GELU_A, crate::act::GELU_NEG_2C);
        let mut l = self.kernel(&self.res.geglu)?;
        l.arg(&g).arg(&u).arg(&out).arg(&nl).arg(&a).arg(&c);
        // SAFETY: matches `geglu`; all hold n floats.
        unsafe { l.launch(elems(n, "geglu")?) }
    }

    /// Each of `n` rows of `d` repeated across a row of `w` (a multiple of d).
    pub fn repeat_rows(
        &self,
        x: u64,
        out: u64,
        n: usize,
        d: usize,
        w: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, di, wi) = (
            as_i32("repeat", n)?,
            as_i32("repeat", d)?,
            as_i32("repeat", w)?,
        );
        let mut l = self.kernel(&self.res.repeat_rows)?;
        l.arg(&x).arg(&out).arg(&ni).arg(&di).arg(&wi);
        // SAFETY: matches `repeat_rows`; x holds n·d floats, out n·w.
        unsafe { l.launch(elems(n * w, "repeat")?) }
    }

    /// Every one of `n` floats rounded to bf16 and widened back.
    pub fn round_bf16(&self, x: u64, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        let mut l = self.kernel(&self.res.round_bf16)?;
        l.arg(&x).arg(&nl);
        // SAFETY: matches `round_bf16`; x holds n floats.
        unsafe { l.launch(elems(n, "round_bf16")?) }
    }

    /// The mean of each of `n` rows' `s` streams of `d` into `out` (n · d):
    /// a sequential sum from `+0.0`, then one multiply by `1/s`.
    pub fn stream_mean(
        &self,
        x: u64,
        out: u64,
        n: usize,
        s: usize,
        d: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || d == 0 {
            return Ok(());
        }
        let inv = 1.0 / s as f32;
        let (ni, si, di) = (
            as_i32("stream_mean", n)?,
            as_i32("stream_mean", s)?,
            as_i32("stream_mean", d)?,
        );
        as_i32("stream_mean", n * s * d)?;
        let mut l = self.kernel(&self.res.stream_mean)?;
        l.arg(&x).arg(&out).arg(&ni).arg(&si).arg(&di).arg(&inv);
        // SAFETY: matches `stream_mean`; x holds n·s·d floats, out n·d.
        unsafe { l.launch(elems(n * d, "stream_mean")?) }
    }

    /// [`crate::hc_coeffs`] of `n` tokens of `h` streams: `raw` (n, 2h + h²)
    /// into `pre`, `post` (n, h) and `res` (n, h, h).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_coeffs_dev(
        &self,
        raw: u64,
        pre: u64,
        post: u64,
        res: u64,
        n: usize,
        h: usize,
        iters: usize,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let (ni, hi, it) = (
            as_i32("hc_coeffs", n)?,
            as_i32("hc_coeffs", h)?,
            as_i32("hc_coeffs", iters)?,
        );
        as_i32("hc_coeffs", n * crate::hyper::hc_raw_width(h))?;
        let eps = crate::hyper::HC_EPS;
        let mut l = self.kernel(&self.res.hc_coeffs)?;
        l.arg(&raw)
            .arg(&pre)
            .arg(&post)
            .arg(&res)
            .arg(&ni)
            .arg(&hi)
            .arg(&it)
            .arg(&eps);
        // SAFETY: matches `hc_coeffs`; raw holds n·(2h + h²) floats, pre and
        // post n·h, res n·h·h.
        unsafe { l.launch(elems(n, "hc_coeffs")?) }
    }

    /// [`crate::hc_pre`]: `out` (n, d) from the streams `x` (n, h, d)
    /// weighted by `pre` (n, h).
    pub fn hc_pre_dev(
        &self,
        x: u64,
        pre: u64,
        out: u64,
        n: usize,
        h: usize,
        d: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, hi, di) = (
            as_i32("hc_pre", n)?,
            as_i32("hc_pre", h)?,
            as_i32("hc_pre", d)?,
        );
        as_i32("hc_pre", n * h * d)?;
        let mut l = self.kernel(&self.res.hc_pre)?;
        l.arg(&x).arg(&pre).arg(&out).arg(&ni).arg(&hi).arg(&di);
        // SAFETY: matches `hc_pre`; every index is below n·h·d, n·h or n·d.
        unsafe { l.launch(elems(n * d, "hc_pre")?) }
    }

    /// [`crate::hc_post`]: new streams `out` (n, h, d) from `x` mixed by
    /// `res` (n, h, h) plus `y` (n, d) placed by `post` (n, h).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post_dev(
        &self,
        x: u64,
        res: u64,
        post: u64,
        y: u64,
        out: u64,
        n: usize,
        h: usize,
        d: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, hi, di) = (
            as_i32("hc_post", n)?,
            as_i32("hc_post", h)?,
            as_i32("hc_post", d)?,
        );
        as_i32("hc_post", n * h * d)?;
        let mut l = self.kernel(&self.res.hc_post)?;
        l.arg(&x)
            .arg(&res)
            .arg(&post)
            .arg(&y)
            .arg(&out)
            .arg(&ni)
            .arg(&hi)
            .arg(&di);
        // SAFETY: matches `hc_post`; every index is below n·h·d, n·h·h, n·h
        // or n·d.
        unsafe { l.launch(elems(n * h * d, "hc_post")?) }
    }

    /// [`crate::moe_combine`] of `n` tokens of `d`: token t's entries
    /// `off[t] .. off[t+1]` (i32 on the device, n + 1 of them) weigh the
    /// rows `idx[e]` (i32) of `ys` by `gates[e]`, in an fma chain from the
    /// token's row of `base` (0: from `+0.0`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_dev(
        &self,
        base: u64,
        gates: u64,
        ys: u64,
        idx: u64,
        off: u64,
        out: u64,
        n: usize,
        d: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, di) = (as_i32("moe_combine", n)?, as_i32("moe_combine", d)?);
        let mut l = self.kernel(&self.res.moe_combine_idx)?;
        l.arg(&base)
            .arg(&gates)
            .arg(&ys)
            .arg(&idx)
            .arg(&off)
            .arg(&out)
            .arg(&ni)
            .arg(&di);
        // SAFETY: matches `moe_combine_idx`; every entry's row index is below
        // ys' rows, base (when not null) and out hold n·d floats.
        unsafe { l.launch(elems(n * d, "moe_combine")?) }
    }

    /// The indexer keys `ik` (n, aux) into each token's page `dst[t]`, slot
    /// `slot[t]` (u64 on the device) at `layer`.
    pub fn kv_write_aux(
        &self,
        ik: u64,
        dst: u64,
        slot: u64,
        n: usize,
        layout: PageLayout,
        layer: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || layout.aux_dim == 0 {
            return Ok(());
        }
        let (ni, li) = (as_i32("kv_write_aux", n)?, as_i32("kv_write_aux", layer)?);
        let (pl, kvd, aux) = crate::cuda::ops::attention::layout_args(&layout)?;
        as_i32("kv_write_aux", n * layout.aux_dim)?;
        let mut l = self.kernel(&self.res.kv_write_aux)?;
        l.arg(&ik)
            .arg(&dst)
            .arg(&slot)
            .arg(&ni)
            .arg(&li)
            .arg(&pl)
            .arg(&kvd)
            .arg(&aux);
        // SAFETY: matches `kv_write_aux`; every page address a whole page of
        // `layout`, every slot below page_len, layer below its layers.
        unsafe { l.launch(elems(n * layout.aux_dim, "kv_write_aux")?) }
    }
}
