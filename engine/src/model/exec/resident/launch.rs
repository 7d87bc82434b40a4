//! One step's ops as resident kernel launches: where each value lives
//! ([`Loc`], from the [`Plan`]), which kernel serves each op, and the fusions
//! that read a value where it is — a split matmul's partials summed by the
//! one kernel that reads them, a residual add folded into the norm after it,
//! the gather of every row standing for its input, RoPE and the page writes
//! made by the decode attention kernel itself.
//!
//! Invariant: a fusion computes what the ops it stands for compute, with
//! the same roundings (the kernels say how); the runner only moves where
//! values live and how many launches make them.

use std::ops::Range;

use lmrr_kernels::cuda::overlap::Overlap;
use lmrr_kernels::cuda::resident::{DevBuf, MmOut, PageLayout, PageTable, SplitKv, SplitScratch};

use super::device::Resident;
use super::plan::{Loc, Plan};
use crate::model::exec::{Act, Buf, Op, Program, Rows, Tables};
use crate::model::{gpu_err, SeqSpan};
use crate::EngineError;

/// Device addresses of one step: each buffer's own region, the split
/// partials, the unrotated K rows of the fused decode attention, the
/// per-layer K, V and indexer-key staging, the bf16 matmul input of
/// tensor-core numerics, and the step's inputs.
pub(super) struct Addrs {
    pub own: Vec<u64>,
    pub part: u64,
    pub part_floats: usize,
    pub kraw: u64,
    pub k: u64,
    pub v: u64,
    pub aux: u64,
    /// Tensor-core numerics: a matmul op's input rounded to bf16.
    pub xb: u64,
    pub ids: u64,
    pub table: PageTable,
    pub dst: u64,
    pub slot: u64,
    pub rows: u64,
    /// The split decode attention's scratch and spread, where the step
    /// takes it (no fused RoPE attention then).
    pub split: Option<SplitKv>,
}

/// Runs a program's ops in order, keeping where each buffer's value is and
/// which are still split partials.
pub(super) struct Runner<'a> {
    pub r: &'a Resident,
    pub prog: &'a Program,
    pub plan: &'a Plan,
    pub tables: &'a Tables<'a>,
    pub a: &'a Addrs,
    pub layout: PageLayout,
    pub n: usize,
    pub m: usize,
    rope_attn: bool,
    direct: bool,
    pub spans: &'a [SeqSpan<'a>],
    cur: Vec<Loc>,
    val: Vec<Option<MmOut>>,
    /// The next op to run (a fusion runs several).
    next: usize,
}

fn e(err: lmrr_kernels::cuda::GpuError) -> EngineError {
    gpu_err(err)
}

impl<'a> Runner<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        r: &'a Resident,
        prog: &'a Program,
        plan: &'a Plan,
        tables: &'a Tables<'a>,
        a: &'a Addrs,
        layout: PageLayout,
        n: usize,
        m: usize,
        rope_attn: bool,
        direct: bool,
        spans: &'a [SeqSpan<'a>],
    ) -> Self {
        let bufs = prog.bufs.len();
        Self {
            r,
            prog,
            plan,
            tables,
            a,
            layout,
            n,
            m,
            rope_attn,
            direct,
            spans,
            cur: (0..bufs).map(|b| Loc::Own(Buf(b as u16))).collect(),
            val: vec![None; bufs],
            next: 0,
        }
    }

    /// The address of `loc`.
    fn at(&self, loc: Loc) -> u64 {
        let (n, g) = (self.n as u64, self.plan.kv);
        let per = |l: usize, w: usize| 4 * (l as u64) * n * w as u64;
        match loc {
            Loc::Own(b) => self.a.own[b.0 as usize],
            Loc::StageK(l) => self.a.k + per(l, g.kv_dim),
            Loc::StageV(l) => self.a.v + per(l, g.kv_dim),
            Loc::StageAux(l) => self.a.aux + per(l, g.aux_dim),
            Loc::KRaw => self.a.kraw,
        }
    }

    pub fn rows(&self, b: Buf) -> usize {
        match self.prog.decl(b).rows {
            Rows::Tokens => self.n,
            Rows::Wanted => self.m,
        }
    }

    pub fn width(&self, b: Buf) -> usize {
        self.prog.decl(b).width
    }

    fn count(&self, b: Buf) -> usize {
        self.rows(b) * self.width(b)
    }

    /// Where the logits are after the step.
    pub fn logits_addr(&self) -> u64 {
        self.at(self.cur[self.prog.logits.0 as usize])
    }

    /// `b`'s values in place (a split value summed first); their address.
    pub fn read(&mut self, b: Buf) -> Result<u64, EngineError> {
        let i = b.0 as usize;
        if let Some(o) = self.val[i].take() {
            let c = self.count(b);
            return self.r.gpu().sum_split(o, c).map_err(e);
        }
        Ok(self.at(self.cur[i]))
    }

    /// `b`'s value as it is (partials or in place), for a kernel that sums
    /// partials where it reads them; the value is then that kernel's.
    fn read_split(&mut self, b: Buf) -> MmOut {
        let i = b.0 as usize;
        self.val[i]
            .take()
            .unwrap_or_else(|| MmOut::at(self.at(self.cur[i])))
    }

    /// Every value still in partials summed in place (before anything else
    /// uses the split scratch).
    pub fn flush(&mut self) -> Result<(), EngineError> {
        for i in 0..self.val.len() {
            if self.val[i].is_some() {
                self.read(Buf(i as u16))?;
            }
        }
        Ok(())
    }

    /// Where op `i` writes `b`; its address.
    pub fn write(&mut self, i: usize, b: Buf) -> u64 {
        let bi = b.0 as usize;
        let loc = self.plan.write_loc(i, b, self.cur[bi], self.rope_attn);
        self.cur[bi] = loc;
        self.val[bi] = None;
        self.at(loc)
    }

    /// Runs the ops of `range` (a fusion never crosses its end: the range
    /// ends after an attention op or at the program's end).
    pub fn run(
        &mut self,
        range: Range<usize>,
        mut kv_copy: Option<&mut Overlap<'_>>,
        moe: &mut Option<(DevBuf, usize)>,
    ) -> Result<(), EngineError> {
        self.next = range.start;
        while self.next < range.end {
            let i = self.next;
            self.next = i + 1;
            let op = &self.prog.ops[i];
            if self.r.profiling {
                self.r.gpu().sync().map_err(e)?;
                let t0 = std::time::Instant::now();
                self.op(i, kv_copy.as_deref_mut(), moe)?;
                self.r.gpu().sync().map_err(e)?;
                self.r.add_time(op.name(), t0.elapsed().as_secs_f64());
            } else {
                self.op(i, kv_copy.as_deref_mut(), moe)?;
            }
        }
        Ok(())
    }

    fn op(
        &mut self,
        i: usize,
        kv_copy: Option<&mut Overlap<'_>>,
        moe: &mut Option<(DevBuf, usize)>,
    ) -> Result<(), EngineError> {
        let g = self.r.gpu();
        let dev = &self.r.dev;
        let ops = &self.prog.ops;
        match &ops[i] {
            Op::Embed { table, out } => {
                let o = self.write(i, *out);
                g.embed(&dev.mats[table.0 as usize], self.a.ids, self.n, o)
                    .map_err(e)
            }
            Op::RmsNorm {
                x,
                w,
                eps_bits,
                out,
            } => {
                let xa = self.read(*x)?;
                let o = self.write(i, *out);
                let (rows, d) = (self.rows(*x), self.width(*x));
                g.norm_rows(
                    xa,
                    &dev.vecs[w.0 as usize],
                    rows,
                    d,
                    f32::from_bits(*eps_bits),
                    o,
                )
                .map_err(e)
            }
            Op::HeadRmsNorm {
                x,
                w,
                eps_bits,
                out,
            } => {
                let xa = self.read(*x)?;
                let o = self.write(i, *out);
                let hd = self.tables.vecs[w.0 as usize].len();
                let rows = self.count(*x) / hd.max(1);
                g.norm_rows(
                    xa,
                    &dev.vecs[w.0 as usize],
                    rows,
                    hd,
                    f32::from_bits(*eps_bits),
                    o,
                )
                .map_err(e)
            }
            Op::Matmul { x, jobs } => self.matmul(i, *x, jobs),
            Op::RopeKvAttend {
                layer,
                rope,
                q,
                k,
                v,
                out,
                spec,
            } => {
                self.attend(i, *layer, *rope, [*q, *k, *v], *out, spec, None)?;
                self.copy_kv(*layer, kv_copy)
            }
            Op::MlaAttend { .. } => Err(EngineError::Device(format!(
                "op {i}: mla_attend (deepseek_v3's Multi-head Latent Attention) has no resident kernel"
            ))),
            Op::Scale { x, by_bits } => {
                let xa = self.read(*x)?;
                g.scale(xa, f32::from_bits(*by_bits), self.count(*x))
                    .map_err(e)
            }
            Op::AddInto { x, y } => self.add_into(i, *x, *y),
            Op::Glu { gate, up, out, act } => {
                let c = self.count(*out);
                match act {
                    Act::Silu => {
                        let (gv, uv) = (self.read_split(*gate), self.read_split(*up));
                        let o = self.write(i, *out);
                        g.swiglu_out(gv, uv, o, c).map_err(e)
                    }
                    Act::GeluTanh => {
                        let (ga, ua) = (self.read(*gate)?, self.read(*up)?);
                        let o = self.write(i, *out);
                        g.geglu(ga, ua, o, c).map_err(e)
                    }
                }
            }
            Op::GatherWanted { x, out } => {
                let xa = self.read(*x)?;
                if self.direct && self.plan.gather_alias.contains(&i) {
                    self.cur[out.0 as usize] = self.cur[x.0 as usize];
                    return Ok(());
                }
                let o = self.write(i, *out);
                g.gather(xa, self.a.rows, self.m, self.width(*x), o)
                    .map_err(e)
            }
            Op::Repeat { x, out } => {
                let xa = self.read(*x)?;
                let o = self.write(i, *out);
                g.repeat_rows(xa, o, self.rows(*x), self.width(*x), self.width(*out))
                    .map_err(e)
            }
            Op::RoundBf16 { x } => {
                let xa = self.read(*x)?;
                g.round_bf16(xa, self.count(*x)).map_err(e)
            }
            Op::HcSinkhorn {
                raw,
                iters,
                pre,
                post,
                res,
            } => {
                let ra = self.read(*raw)?;
                let (p, q, r) = (
                    self.write(i, *pre),
                    self.write(i, *post),
                    self.write(i, *res),
                );
                g.hc_coeffs_dev(ra, p, q, r, self.rows(*raw), self.width(*pre), *iters)
                    .map_err(e)
            }
            Op::HcPre { x, pre, out } => {
                let (xa, pa) = (self.read(*x)?, self.read(*pre)?);
                let o = self.write(i, *out);
                g.hc_pre_dev(
                    xa,
                    pa,
                    o,
                    self.rows(*out),
                    self.width(*pre),
                    self.width(*out),
                )
                .map_err(e)
            }
            Op::HcPost {
                x,
                res,
                post,
                y,
                out,
            } => {
                let (xa, ra) = (self.read(*x)?, self.read(*res)?);
                let (pa, ya) = (self.read(*post)?, self.read(*y)?);
                let o = self.write(i, *out);
                let (n, h, d) = (self.rows(*y), self.width(*post), self.width(*y));
                g.hc_post_dev(xa, ra, pa, ya, o, n, h, d).map_err(e)
            }
            Op::StreamMean { x, out } => {
                let xa = self.read(*x)?;
                let o = self.write(i, *out);
                let d = self.width(*out);
                g.stream_mean(xa, o, self.rows(*x), self.width(*x) / d.max(1), d)
                    .map_err(e)
            }
            Op::Moe {
                x,
                out,
                router,
                experts,
                shared,
                routing,
            } => {
                self.flush()?;
                let xa = self.read(*x)?;
                let o = self.write(i, *out);
                let d = self.width(*x);
                let job = super::moe::MoeJob {
                    x: xa,
                    out: o,
                    d,
                    router: *router,
                    experts,
                    shared: shared.as_ref(),
                    routing,
                };
                self.moe(&job, moe)
            }
        }
    }

    /// Every job of a matmul op: wanted rows one launch each (never split);
    /// token rows by up to three matrices a launch, an output left in
    /// partials only for a lone reader and no bias. Under tensor-core
    /// numerics, one `tc_mm` a matrix.
    fn matmul(
        &mut self,
        i: usize,
        x: Buf,
        jobs: &[crate::model::exec::MatJob],
    ) -> Result<(), EngineError> {
        self.flush()?;
        let g = self.r.gpu();
        let dev = &self.r.dev;
        let xa = self.read(x)?;
        let rows = self.rows(x);
        let sp = SplitScratch {
            addr: self.a.part,
            floats: self.a.part_floats,
        };
        if self.r.numerics.model().is_some() {
            // Tensor cores: the input rounded to bf16 once (every job of an
            // op reads the same x), then a launch per matrix, whole outputs
            // (no split).
            let mut rounded = None;
            for j in jobs {
                let o = self.write(i, j.out);
                let w = &dev.mats[j.w.0 as usize];
                let input = if lmrr_kernels::cuda::Gpu::tc_rounds_first(w.cols) {
                    if rounded != Some(w.cols) {
                        g.tc_round(xa, rows * w.cols, self.a.xb).map_err(e)?;
                        rounded = Some(w.cols);
                    }
                    self.a.xb
                } else {
                    xa
                };
                g.tc_mm(input, rows, w, o).map_err(e)?;
                if let Some(b) = j.bias {
                    g.add_bias(o, dev.vecs[b.0 as usize].ptr(), rows * w.rows, w.rows)
                        .map_err(e)?;
                }
            }
            return Ok(());
        }
        let fold = jobs.len() <= 3;
        for group in jobs.chunks(3) {
            let outs: Vec<u64> = group.iter().map(|j| self.write(i, j.out)).collect();
            let wanted = group
                .iter()
                .any(|j| self.prog.decl(j.out).rows == Rows::Wanted);
            let mm: Vec<MmOut> = if wanted {
                for (j, &o) in group.iter().zip(&outs) {
                    g.mm(xa, rows, &dev.mats[j.w.0 as usize], o).map_err(e)?;
                }
                outs.iter().map(|&o| MmOut::at(o)).collect()
            } else {
                let mats: Vec<_> = group
                    .iter()
                    .zip(&outs)
                    .map(|(j, &o)| (&dev.mats[j.w.0 as usize], o))
                    .collect();
                g.mm_outs(xa, rows, &mats, sp, fold).map_err(e)?
            };
            for (j, o) in group.iter().zip(mm) {
                let cols = dev.mats[j.w.0 as usize].rows;
                if j.bias.is_some() || self.plan.readers(i, j.out) != 1 {
                    let y = g.sum_split(o, rows * cols).map_err(e)?;
                    if let Some(b) = j.bias {
                        g.add_bias(y, dev.vecs[b.0 as usize].ptr(), rows * cols, cols)
                            .map_err(e)?;
                    }
                } else if o.is_split() {
                    self.val[j.out.0 as usize] = Some(o);
                }
            }
        }
        Ok(())
    }

    /// `x += y`; folded into the norm right after it where that norm reads
    /// `x` (or, every row wanted in order, into the head's gather and norm).
    fn add_into(&mut self, i: usize, x: Buf, y: Buf) -> Result<(), EngineError> {
        let g = self.r.gpu();
        let yv = self.read_split(y);
        let xa = self.read(x)?;
        let ops = &self.prog.ops;
        let (rows, d) = (self.rows(x), self.width(x));
        // The norm the add folds into: the next op when it norms `x`, or,
        // every row wanted in order, the norm after the gather that then
        // stands for `x`.
        let fused = match (ops.get(i + 1), ops.get(i + 2)) {
            (
                Some(Op::RmsNorm {
                    x: nx,
                    w,
                    eps_bits,
                    out,
                }),
                _,
            ) if *nx == x => Some((i + 1, None, *w, *eps_bits, *out)),
            (
                Some(Op::GatherWanted { x: gx, out: hx }),
                Some(Op::RmsNorm {
                    x: nx,
                    w,
                    eps_bits,
                    out,
                }),
            ) if self.direct
                && *gx == x
                && nx == hx
                && self.plan.gather_alias.contains(&(i + 1)) =>
            {
                Some((i + 2, Some(*hx), *w, *eps_bits, *out))
            }
            _ => None,
        };
        if let Some((at, alias, w, eps_bits, out)) = fused {
            if let Some(hx) = alias {
                self.cur[hx.0 as usize] = self.cur[x.0 as usize];
            }
            let o = self.write(at, out);
            self.next = at + 1;
            let w = &self.r.dev.vecs[w.0 as usize];
            return g
                .add_norm(xa, yv, w, rows, d, f32::from_bits(eps_bits), o)
                .map_err(e);
        }
        g.add_out(xa, yv, rows * d).map_err(e)
    }

    /// RoPE, the K/V (and indexer-key) page writes and attention of one
    /// layer (over the op's sliding window, if it has one): by the fused
    /// decode kernel where the step allows it (the K rows were made
    /// unrotated into [`Loc::KRaw`]; it writes the rotated ones to
    /// staging), else `rope_kv` then paged attention.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        i: usize,
        layer: usize,
        rope: usize,
        [q, k, v]: [Buf; 3],
        out: Buf,
        spec: &crate::model::exec::AttnSpec,
        ik: Option<Buf>,
    ) -> Result<(), EngineError> {
        if spec.patched() {
            return Err(EngineError::Device(
                "an attention patch has no device kernel".into(),
            ));
        }
        let window = spec.window.map(|w| w as usize);
        let g = self.r.gpu();
        let tabs = &self.r.dev.ropes[rope];
        let a = self.a;
        let (qv, kv, vv) = (self.read_split(q), self.read_split(k), self.read_split(v));
        let o = self.write(i, out);
        if self.rope_attn && ik.is_none() {
            if qv.is_split() || kv.is_split() || vv.is_split() {
                return Err(EngineError::Device(
                    "a fused RoPE step got split q/k/v matmuls".into(),
                ));
            }
            let stage = self.at(Loc::StageK(layer));
            self.cur[k.0 as usize] = Loc::StageK(layer);
            return g
                .attention_decode_rope(
                    (qv.y, kv.y, vv.y),
                    stage,
                    (&tabs.0, &tabs.1),
                    a.table,
                    a.dst,
                    a.slot,
                    self.n,
                    &spec.shape,
                    self.layout,
                    layer,
                    spec.scale(),
                    window,
                    o,
                )
                .map_err(e);
        }
        g.rope_kv(
            (qv, kv, vv),
            (&tabs.0, &tabs.1),
            a.table.pos,
            a.dst,
            a.slot,
            self.n,
            spec.shape.q_dim(),
            spec.shape.head_dim,
            self.layout,
            layer,
        )
        .map_err(e)?;
        if let Some(ik) = ik {
            let ia = self.read(ik)?;
            g.kv_write_aux(ia, a.dst, a.slot, self.n, self.layout, layer)
                .map_err(e)?;
        }
        let qa = self.at(self.cur[q.0 as usize]);
        g.attention_paged(
            qa,
            a.table,
            self.n,
            &spec.shape,
            self.layout,
            layer,
            spec.scale(),
            window,
            o,
            a.split,
        )
        .map_err(e)
    }

    /// With `kv_copy`, layer `layer`'s K and V rows, final now, queued for
    /// the host while the next layers run (`(layers, n, kvd)` K, then V).
    fn copy_kv(&self, layer: usize, kv_copy: Option<&mut Overlap<'_>>) -> Result<(), EngineError> {
        let Some(ov) = kv_copy else {
            return Ok(());
        };
        let g = self.plan.kv;
        let (rows, per) = (self.n * g.kv_dim, g.layers * self.n * g.kv_dim);
        ov.queue(&[
            (self.at(Loc::StageK(layer)), layer * rows, rows),
            (self.at(Loc::StageV(layer)), per + layer * rows, rows),
        ])
        .map(|_| ())
        .map_err(e)
    }
}
