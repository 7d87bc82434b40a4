//! A family's step as data: a sequence of fused operations over named
//! buffers, which an executor ([`super::cpu`], the CUDA executor) runs.
//!
//! A family builds one [`Program`] per step from the step's shape and its
//! patch set (its patch points pick op variants here, once, at the top of the
//! step). Buffers are `rows × width` f32 matrices whose rows are either every
//! stacked token of the step ([`Rows::Tokens`]) or the rows whose logits the
//! spans want ([`Rows::Wanted`]). Weights and vectors are named by their index
//! in the family's [`Tables`], which stay the same across steps, so an
//! executor may keep them resident and key what it caches by index.
//!
//! Invariant: every op computes each output element from the same inputs by
//! the same canonical instruction sequence whatever the step's batch, so a
//! program's results for one token do not depend on the other tokens of the
//! step (I2) or on how its sequence was chunked (I3). Ops that reduce name the
//! kernel order they follow (`lmrr_kernels`).

use lmrr_kernels::{AttnShape, RopeTable};

use super::indexer::IndexerShape;

use crate::weights::Tensor;

/// A buffer of the step, by its index in [`Program::bufs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buf(pub u16);

/// A stored weight matrix, by its index in [`Tables::mats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mat(pub u32);

/// A vector widened at load (norm weights, biases), by its index in
/// [`Tables::vecs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Vector(pub u32);

/// Which rows a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rows {
    /// One per stacked token of the step.
    Tokens,
    /// One per row whose logits a span wants, in span order.
    Wanted,
}

/// A buffer's declaration: its name (for messages and dumps), rows, width.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BufDecl {
    pub name: &'static str,
    pub rows: Rows,
    pub width: usize,
}

/// The activation of a gated MLP: `out = act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// SiLU (SwiGLU), from `lmrr_kernels::act`.
    Silu,
    /// GeLU, tanh approximation (GeGLU), from `lmrr_kernels::act`.
    GeluTanh,
}

/// One matrix product of a [`Op::Matmul`]: `out = x · Wᵀ (+ bias)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MatJob {
    pub w: Mat,
    pub out: Buf,
    /// Added after the canonical dot product, one IEEE add per element.
    pub bias: Option<Vector>,
}

/// One gated expert of an [`Op::Moe`]: `down · (silu(gate · x) ⊙ up · x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertMats {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
}

/// How an [`Op::Moe`] routes a token (`lmrr_kernels::moe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RoutingSpec {
    /// DeepSeek-V4 class ([`super::routing_v4`]): sigmoid scores, the top
    /// `k` (or, on a hash layer, the experts a hash of the token id gives),
    /// gates normalised then times the factor (`scale_bits`, an f32's bits);
    /// `scale_before_norm` is the `moe-routed-scaling` patch.
    V4 {
        k: usize,
        scale_bits: u32,
        hash_layer: Option<usize>,
        scale_before_norm: bool,
    },
    /// Softmax over the router logits, the top `k`, renormalised when
    /// `norm_topk_prob` (mixtral always, qwen3_moe by its flag).
    SoftmaxTopK { k: usize, norm_topk_prob: bool },
    /// Sigmoid scores, selection by score + `bias` among the best
    /// `topk_group` of `n_group` groups, gates from the unbiased scores
    /// (renormalised when `norm_topk_prob`) times the factor (deepseek_v3).
    SigmoidGroupTopK {
        k: usize,
        n_group: usize,
        topk_group: usize,
        bias: Vector,
        norm_topk_prob: bool,
        /// `routed_scaling_factor`, bits of an f32.
        scale_bits: u32,
    },
}

/// How attention runs. The variants are engine patches (CPU only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnSpec {
    pub shape: AttnShape,
    /// The scale of `q · k` (bits of an f32).
    pub scale_bits: u32,
    /// `fast-exp`: the approximate exp in the softmax.
    pub fast_exp: bool,
    /// `splitk-decode`: a decode query's keys split by the decoding batch.
    pub splitk_decode: bool,
    /// A sliding window: a query at `pos` attends to `[pos − W + 1, pos]`
    /// only (`lmrr_kernels::attention_window`); `None` is full causal.
    pub window: Option<u32>,
}

impl AttnSpec {
    /// Canonical attention of `shape` with scale `1/√head_dim`.
    pub fn canonical(shape: AttnShape) -> Self {
        Self {
            shape,
            scale_bits: (1.0 / (shape.head_dim as f32).sqrt()).to_bits(),
            fast_exp: false,
            splitk_decode: false,
            window: None,
        }
    }

    pub fn scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }

    /// Whether a patch variant is on.
    pub fn patched(&self) -> bool {
        self.fast_exp || self.splitk_decode
    }
}

/// The sparse indexer on a Multi-head Latent Attention layer (mini-v4, the
/// DeepSeek-V4 class): the stored row grows by the indexer key `ik`
/// (after the latent and the rotated shared key), and per token the
/// indexer's blocks, from its query `iq` and head weights `iw` (through a
/// sigmoid), choose the positions every head attends to
/// ([`super::indexer`]). `early_exit` is the `indexer-early-exit` patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MlaIndex {
    pub iq: Buf,
    pub ik: Buf,
    pub iw: Buf,
    pub shape: IndexerShape,
    pub early_exit: bool,
}

/// The shape of a Multi-head Latent Attention op ([`Op::MlaAttend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MlaShape {
    pub heads: usize,
    /// `qk_nope_head_dim`: a head's query/key part without RoPE.
    pub nope: usize,
    /// `qk_rope_head_dim`: the rotated part, its key shared by every head.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`: the compressed latent's width.
    pub latent: usize,
    /// RoPE pairs are adjacent elements `(2i, 2i+1)`; they are rotated into
    /// the halves layout (transformers' `apply_rotary_pos_emb_interleave`).
    pub interleave: bool,
}

impl MlaShape {
    /// A query row: per head `nope` then `rope` values.
    pub fn q_dim(&self) -> usize {
        self.heads * (self.nope + self.rope)
    }

    /// What the KV store keeps per layer and position (its auxiliary row):
    /// the normalised latent, then the rotated shared key.
    pub fn row(&self) -> usize {
        self.latent + self.rope
    }

    /// The output row: per head `v` values.
    pub fn out_dim(&self) -> usize {
        self.heads * self.v
    }

    /// The attention in latent space: every head against the one stored
    /// row (keys and values alike), `row()` wide.
    pub fn attn_shape(&self) -> AttnShape {
        AttnShape {
            n_heads: self.heads,
            n_kv_heads: 1,
            head_dim: self.row(),
        }
    }
}

/// One fused operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Op {
    /// `out[i] =` row `token(i)` of `table`, widened exactly.
    Embed { table: Mat, out: Buf },
    /// Row-wise RMSNorm of `x` with weight `w` into `out`.
    RmsNorm {
        x: Buf,
        w: Vector,
        eps_bits: u32,
        out: Buf,
    },
    /// Every job's product over one input (each weight row read once per step).
    Matmul { x: Buf, jobs: Vec<MatJob> },
    /// RoPE on `q` and `k` at each token's position, the token's K and V rows
    /// into the KV store at `layer`, then causal attention of `q` over the
    /// sequence's keys into `out`.
    RopeKvAttend {
        layer: usize,
        rope: usize,
        q: Buf,
        k: Buf,
        v: Buf,
        out: Buf,
        spec: AttnSpec,
    },
    /// RMSNorm of each `w.len()`-wide piece of every row of `x` (each
    /// attention head of a q or k row) with weight `w` into `out`: the
    /// canonical row norm over rows of the head's width.
    HeadRmsNorm {
        x: Buf,
        w: Vector,
        eps_bits: u32,
        out: Buf,
    },
    /// `x *= by`, elementwise, one IEEE multiply (bits of an f32).
    Scale { x: Buf, by_bits: u32 },
    /// `x += y`, elementwise (a residual add).
    AddInto { x: Buf, y: Buf },
    /// `out = act(gate) · up`, elementwise.
    Glu {
        gate: Buf,
        up: Buf,
        out: Buf,
        act: Act,
    },
    /// The wanted rows of `x` (a [`Rows::Tokens`] buffer) into `out` (a
    /// [`Rows::Wanted`] one).
    GatherWanted { x: Buf, out: Buf },
    /// Each row of `x` repeated across the row of `out` (a multiple of its
    /// width): hyper-connection streams start as copies of the embedding.
    Repeat { x: Buf, out: Buf },
    /// Every element of `x` rounded to bf16 (nearest, ties to even) and
    /// widened back, exactly (the `mhc-bf16` patch's inputs).
    RoundBf16 { x: Buf },
    /// Hyper-connection coefficients of `s` streams from the raw mixing
    /// values (`2s + s²` a row): `pre` (s), `post` (s) and the residual mix
    /// `res` (s × s) made doubly stochastic by `iters` Sinkhorn rounds
    /// (`lmrr_kernels::hc_coeffs`).
    HcSinkhorn {
        raw: Buf,
        iters: usize,
        pre: Buf,
        post: Buf,
        res: Buf,
    },
    /// A block's input from the streams `x` (s × d), weighted by `pre`
    /// (`lmrr_kernels::hc_pre`).
    HcPre { x: Buf, pre: Buf, out: Buf },
    /// New streams into `out` from the streams `x` mixed by `res` plus the
    /// block output `y` placed by `post` (`lmrr_kernels::hc_post`).
    HcPost {
        x: Buf,
        res: Buf,
        post: Buf,
        y: Buf,
        out: Buf,
    },
    /// The mean of each row's streams into `out`: a sequential sum in stream
    /// order from `+0.0`, then one multiply by `1/s`.
    StreamMean { x: Buf, out: Buf },
    /// Multi-head Latent Attention (DeepSeek-V2/V3, [`super::mla`]): per
    /// token, the latent part of `ckv` RMS-normalised by `kv_norm` and its
    /// shared key part rotated, stored as the layer's auxiliary KV row; the
    /// query absorbed into latent space (per head `k_absorb_h · q_nope`,
    /// `k_absorb` holding `heads` blocks of `latent × nope`, then the rotated
    /// `q_rope`); causal attention of every head over the stored rows
    /// ([`MlaShape::attn_shape`]); per head the first `latent` values of its
    /// output times `v_up_h` (`heads` blocks of `v × latent`) into `out`.
    MlaAttend {
        layer: usize,
        rope: usize,
        q: Buf,
        ckv: Buf,
        kv_norm: Vector,
        eps_bits: u32,
        k_absorb: Mat,
        v_up: Mat,
        out: Buf,
        mla: MlaShape,
        spec: AttnSpec,
        /// The sparse indexer of the DeepSeek-V4 class ([`MlaIndex`]), or
        /// `None`: every head over every stored row (DeepSeek-V3).
        index: Option<MlaIndex>,
    },

    /// `router · x`, the row's route ([`RoutingSpec`]), each chosen expert
    /// on the row, and `out = shared(x) (or +0.0) + Σ gate_e · expert_e(x)`,
    /// an fma chain over the chosen experts ascending
    /// (`lmrr_kernels::moe_combine`). Per row, so batch-invariant.
    Moe {
        x: Buf,
        out: Buf,
        router: Mat,
        experts: Vec<ExpertMats>,
        shared: Option<ExpertMats>,
        routing: RoutingSpec,
    },
}

/// A step: its buffers, its ops in order, and which buffer holds the logits
/// (a [`Rows::Wanted`] buffer of the vocabulary's width).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Program {
    pub bufs: Vec<BufDecl>,
    pub ops: Vec<Op>,
    pub logits: Buf,
}

/// What a family's programs name by index: the same tables, in the same
/// order, for every step whatever its shape or patches (an executor may keep
/// them resident and key what it caches by index).
pub struct Tables<'a> {
    pub mats: Vec<&'a Tensor>,
    pub vecs: Vec<&'a [f32]>,
    pub ropes: Vec<&'a RopeTable>,
}

/// A program under construction: declares buffers and appends ops.
#[derive(Default)]
pub struct Builder {
    bufs: Vec<BufDecl>,
    ops: Vec<Op>,
}

impl Builder {
    /// Ops appended so far (the next op's index).
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// No op appended yet.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Declares a buffer.
    pub fn buf(&mut self, name: &'static str, rows: Rows, width: usize) -> Buf {
        self.bufs.push(BufDecl { name, rows, width });
        Buf((self.bufs.len() - 1) as u16)
    }

    /// Appends an op.
    pub fn op(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// `out = x · Wᵀ` for one matrix.
    pub fn matmul(&mut self, x: Buf, w: Mat, out: Buf) {
        self.op(Op::Matmul {
            x,
            jobs: vec![MatJob { w, out, bias: None }],
        });
    }

    /// Row-wise RMSNorm.
    pub fn rms_norm(&mut self, x: Buf, w: Vector, eps: f32, out: Buf) {
        self.op(Op::RmsNorm {
            x,
            w,
            eps_bits: eps.to_bits(),
            out,
        });
    }

    /// The finished program, `logits` its output.
    pub fn finish(self, logits: Buf) -> Program {
        Program {
            bufs: self.bufs,
            ops: self.ops,
            logits,
        }
    }
}

impl Program {
    /// The declaration of `b`.
    pub fn decl(&self, b: Buf) -> &BufDecl {
        &self.bufs[b.0 as usize]
    }

    /// Every op's buffers exist, and every op's operands have the widths its
    /// shapes imply (against `tables`): a malformed program is a family bug,
    /// reported with the op's index and the widths.
    pub fn check(&self, tables: &Tables) -> Result<(), String> {
        let width = |b: Buf| -> Result<usize, String> {
            self.bufs
                .get(b.0 as usize)
                .map(|d| d.width)
                .ok_or_else(|| format!("buffer {} of {} undeclared", b.0, self.bufs.len()))
        };
        let mat = |m: Mat| -> Result<(usize, usize), String> {
            let t = tables
                .mats
                .get(m.0 as usize)
                .ok_or_else(|| format!("matrix {} of {} unknown", m.0, tables.mats.len()))?;
            match t.shape[..] {
                [r, c] => Ok((r, c)),
                _ => Err(format!("`{}` is not a matrix: shape {:?}", t.name, t.shape)),
            }
        };
        let vec_len = |v: Vector| -> Result<usize, String> {
            tables
                .vecs
                .get(v.0 as usize)
                .map(|v| v.len())
                .ok_or_else(|| format!("vector {} of {} unknown", v.0, tables.vecs.len()))
        };
        let same = |what: &str, a: usize, b: usize| -> Result<(), String> {
            if a == b {
                Ok(())
            } else {
                Err(format!("{what}: {a} against {b}"))
            }
        };
        for (i, op) in self.ops.iter().enumerate() {
            let r: Result<(), String> = (|| match op {
                Op::Embed { table, out } => same("embedding width", mat(*table)?.1, width(*out)?),
                Op::RmsNorm { x, w, out, .. } => {
                    same("norm input/output", width(*x)?, width(*out)?)?;
                    same("norm weight", vec_len(*w)?, width(*x)?)
                }
                Op::Matmul { x, jobs } => {
                    for j in jobs {
                        let (rows, cols) = mat(j.w)?;
                        same("matmul input", cols, width(*x)?)?;
                        same("matmul output", rows, width(j.out)?)?;
                        if let Some(b) = j.bias {
                            same("bias", vec_len(b)?, rows)?;
                        }
                    }
                    Ok(())
                }
                Op::RopeKvAttend {
                    rope,
                    q,
                    k,
                    v,
                    out,
                    spec,
                    ..
                } => {
                    let t = tables
                        .ropes
                        .get(*rope)
                        .ok_or_else(|| format!("rope table {rope} unknown"))?;
                    same("rope head_dim", t.head_dim(), spec.shape.head_dim)?;
                    same("q", width(*q)?, spec.shape.q_dim())?;
                    same("k", width(*k)?, spec.shape.kv_dim())?;
                    same("v", width(*v)?, spec.shape.kv_dim())?;
                    same("attention output", width(*out)?, spec.shape.q_dim())
                }
                Op::HeadRmsNorm { x, w, out, .. } => {
                    let (d, hd) = (width(*x)?, vec_len(*w)?);
                    same("head norm input/output", d, width(*out)?)?;
                    if hd == 0 || d % hd != 0 {
                        return Err(format!("head norm weight {hd} does not divide width {d}"));
                    }
                    Ok(())
                }
                Op::Scale { x, .. } => width(*x).map(|_| ()),
                Op::AddInto { x, y } => same("residual add", width(*x)?, width(*y)?),
                Op::Glu { gate, up, out, .. } => {
                    same("gate/up", width(*gate)?, width(*up)?)?;
                    same("gated output", width(*gate)?, width(*out)?)
                }
                Op::GatherWanted { x, out } => {
                    if self.decl(*x).rows != Rows::Tokens || self.decl(*out).rows != Rows::Wanted {
                        return Err("gather goes from a token buffer to a wanted one".into());
                    }
                    same("gather", width(*x)?, width(*out)?)
                }
                Op::Moe {
                    x,
                    out,
                    router,
                    experts,
                    shared,
                    routing,
                } => {
                    let d = width(*x)?;
                    same("moe input/output", d, width(*out)?)?;
                    let (ne, rc) = mat(*router)?;
                    same("router input", rc, d)?;
                    same("router experts", ne, experts.len())?;
                    for e in experts.iter().chain(shared) {
                        let (f, gc) = mat(e.gate)?;
                        same("expert gate input", gc, d)?;
                        same("expert up", mat(e.up)?.0, f)?;
                        same("expert up input", mat(e.up)?.1, d)?;
                        same("expert down", mat(e.down)?.0, d)?;
                        same("expert down input", mat(e.down)?.1, f)?;
                    }
                    match routing {
                        RoutingSpec::SoftmaxTopK { k, .. } => {
                            if *k == 0 || *k > ne {
                                return Err(format!("top-k {k} of {ne} experts"));
                            }
                            Ok(())
                        }
                        RoutingSpec::SigmoidGroupTopK {
                            k,
                            n_group,
                            topk_group,
                            bias,
                            ..
                        } => {
                            same("routing bias", vec_len(*bias)?, ne)?;
                            routing_shape(*k, *n_group, *topk_group).check(ne)
                        }
                        RoutingSpec::V4 { k, .. } => {
                            if *k == 0 || *k > ne {
                                return Err(format!("top-k {k} of {ne} experts"));
                            }
                            Ok(())
                        }
                    }
                }
                Op::Repeat { x, out } => {
                    let (d, w) = (width(*x)?, width(*out)?);
                    if d == 0 || w % d != 0 {
                        return Err(format!("repeat of width {d} into {w}"));
                    }
                    Ok(())
                }
                Op::RoundBf16 { x } => width(*x).map(|_| ()),
                Op::HcSinkhorn {
                    raw,
                    pre,
                    post,
                    res,
                    ..
                } => {
                    let s = width(*pre)?;
                    same("hc post", width(*post)?, s)?;
                    same("hc residual mix", width(*res)?, s * s)?;
                    same("hc raw", width(*raw)?, lmrr_kernels::hyper::hc_raw_width(s))
                }
                Op::HcPre { x, pre, out } => {
                    same("hc streams", width(*x)?, width(*pre)? * width(*out)?)
                }
                Op::HcPost {
                    x,
                    res,
                    post,
                    y,
                    out,
                } => {
                    let (s, d) = (width(*post)?, width(*y)?);
                    same("hc residual mix", width(*res)?, s * s)?;
                    same("hc streams", width(*x)?, s * d)?;
                    same("hc output", width(*out)?, s * d)
                }
                Op::StreamMean { x, out } => {
                    let (w, d) = (width(*x)?, width(*out)?);
                    if d == 0 || w % d != 0 {
                        return Err(format!("stream mean of width {w} into {d}"));
                    }
                    Ok(())
                }
                Op::MlaAttend {
                    rope,
                    q,
                    ckv,
                    kv_norm,
                    k_absorb,
                    v_up,
                    out,
                    mla,
                    spec,
                    index,
                    ..
                } => {
                    let t = tables
                        .ropes
                        .get(*rope)
                        .ok_or_else(|| format!("rope table {rope} unknown"))?;
                    same("rope head_dim", t.head_dim(), mla.rope)?;
                    if let Some(ix) = index {
                        let s = ix.shape;
                        same("indexer query", width(ix.iq)?, s.heads * s.dim)?;
                        same("indexer key", width(ix.ik)?, s.dim)?;
                        same("indexer head weights", width(ix.iw)?, s.heads)?;
                    }
                    same("q", width(*q)?, mla.q_dim())?;
                    same("compressed kv", width(*ckv)?, mla.row())?;
                    same("latent norm", vec_len(*kv_norm)?, mla.latent)?;
                    let (ar, ac) = mat(*k_absorb)?;
                    same("k absorb rows", ar, mla.heads * mla.latent)?;
                    same("k absorb cols", ac, mla.nope)?;
                    let (vr, vc) = mat(*v_up)?;
                    same("v up rows", vr, mla.heads * mla.v)?;
                    same("v up cols", vc, mla.latent)?;
                    same("attention output", width(*out)?, mla.out_dim())?;
                    if spec.shape != mla.attn_shape() || spec.window.is_some() {
                        return Err(format!(
                            "attention {:?} (window {:?}) is not the latent one {:?}",
                            spec.shape,
                            spec.window,
                            mla.attn_shape()
                        ));
                    }
                    Ok(())
                }
            })();
            r.map_err(|e| format!("op {i} ({}): {e}", op.name()))?;
        }
        width(self.logits).map(|_| ())
    }
}

impl Op {
    /// The buffers the op reads, in operand order.
    pub fn reads(&self) -> Vec<Buf> {
        match self {
            Op::Embed { .. } => vec![],
            Op::RmsNorm { x, .. }
            | Op::HeadRmsNorm { x, .. }
            | Op::Matmul { x, .. }
            | Op::Scale { x, .. }
            | Op::GatherWanted { x, .. }
            | Op::Repeat { x, .. }
            | Op::RoundBf16 { x }
            | Op::StreamMean { x, .. }
            | Op::Moe { x, .. } => vec![*x],
            Op::RopeKvAttend { q, k, v, .. } => vec![*q, *k, *v],
            Op::MlaAttend { q, ckv, index, .. } => match index {
                Some(ix) => vec![*q, *ckv, ix.iq, ix.ik, ix.iw],
                None => vec![*q, *ckv],
            },
            Op::AddInto { x, y } => vec![*x, *y],
            Op::Glu { gate, up, .. } => vec![*gate, *up],
            Op::HcSinkhorn { raw, .. } => vec![*raw],
            Op::HcPre { x, pre, .. } => vec![*x, *pre],
            Op::HcPost {
                x, res, post, y, ..
            } => vec![*x, *res, *post, *y],
        }
    }

    /// The buffers the op writes (in place ones included: RoPE rotates q
    /// and k where they are).
    pub fn writes(&self) -> Vec<Buf> {
        match self {
            Op::Embed { out, .. }
            | Op::RmsNorm { out, .. }
            | Op::HeadRmsNorm { out, .. }
            | Op::Glu { out, .. }
            | Op::GatherWanted { out, .. }
            | Op::Repeat { out, .. }
            | Op::HcPre { out, .. }
            | Op::HcPost { out, .. }
            | Op::StreamMean { out, .. }
            | Op::Moe { out, .. }
            | Op::MlaAttend { out, .. } => vec![*out],
            Op::Matmul { jobs, .. } => jobs.iter().map(|j| j.out).collect(),
            Op::RopeKvAttend { q, k, out, .. } => vec![*q, *k, *out],
            Op::Scale { x, .. } | Op::RoundBf16 { x } | Op::AddInto { x, .. } => vec![*x],
            Op::HcSinkhorn { pre, post, res, .. } => vec![*pre, *post, *res],
        }
    }
}

impl Op {
    /// The op's name, for messages and profiles.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Matmul { .. } => "matmul",
            Op::RopeKvAttend { .. } => "rope_kv_attend",
            Op::HeadRmsNorm { .. } => "head_rms_norm",
            Op::Scale { .. } => "scale",
            Op::AddInto { .. } => "add",
            Op::Glu { .. } => "glu",
            Op::GatherWanted { .. } => "gather",
            Op::Repeat { .. } => "repeat",
            Op::RoundBf16 { .. } => "round_bf16",
            Op::HcSinkhorn { .. } => "hc_sinkhorn",
            Op::HcPre { .. } => "hc_pre",
            Op::HcPost { .. } => "hc_post",
            Op::StreamMean { .. } => "stream_mean",
            Op::Moe { .. } => "moe",
            Op::MlaAttend { .. } => "mla_attend",
        }
    }
}

/// The routing shape of a [`RoutingSpec::SigmoidGroupTopK`] (its flags aside),
/// for its checks.
fn routing_shape(k: usize, n_group: usize, topk_group: usize) -> lmrr_kernels::GroupTopK {
    lmrr_kernels::GroupTopK {
        k,
        n_group,
        topk_group,
        norm_topk_prob: false,
        routed_scaling_factor: 1.0,
    }
}
