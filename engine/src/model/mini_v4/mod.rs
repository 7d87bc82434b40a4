//! The mini-v4 family: a miniature of DeepSeek-V4-Flash's structure
//! (`docs/MINI-V4.md`), over a batch of (sequence, token span) entries.
//!
//! Per layer, two sub-blocks (attention, then MoE), each wrapped in
//! hyper-connections: the residual stream is `hc_mult` streams; from the
//! RMS-normalised streams a learned projection (the "MHC mixing GEMM", f32,
//! canonical matmul) gives pre-mix weights (streams → block input), post-mix
//! weights (block output → streams) and a residual mix made doubly stochastic
//! by Sinkhorn–Knopp ([`lmrr_kernels::hyper`]). Attention is GQA with RoPE
//! over the positions the indexer selects ([`indexer`]); the MoE is one shared
//! expert plus routed experts ([`routing`]), combined in expert-index order.
//!
//! Invariants: every token's arithmetic is its own (routing, selection and
//! combine are per token; matmul rows are independent), so logits do not
//! depend on batch-mates (I2), chunking (I3) or the KV page size (index
//! blocks are absolute positions). What a position keeps, K, V and its
//! indexer key, is in the KV store and so under the page hashes.
//!
//! Patch points, chosen once per step: `mhc-bf16` (the mixing projection's
//! weights and inputs rounded to bf16, products accumulated in f32),
//! `moe-routed-scaling` ([`routing`]), `indexer-early-exit` ([`indexer`]).

pub mod config;
pub mod indexer;
pub mod routing;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use lmrr_kernels::{self as k, AttnShape, AttnTask, KvView, Matrix, RopeTable, Threads, Weights};

use crate::kv::{KvCache, SeqKvStore};
use crate::model::ops::Ops;
use crate::model::{
    check_spans, split_rows, stacked_tokens, stored, vector, wanted_rows, Device, Family, KvLayout,
    LogitsWanted, ModelFamily, NamedTensor, SeqSpan,
};
use crate::patches::{Patch, PatchSet};
use crate::synth::f32_to_bf16;
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, ModelFiles};

pub use config::MiniV4Config;
use indexer::{IndexerShape, Selection};
use routing::Routing;

/// The mixing projection of one sub-block.
struct Hc {
    norm: Vec<f32>,
    proj: Tensor,
    /// `proj` rounded to bf16, for `mhc-bf16`.
    proj_bf16: Vec<u16>,
    bias: Vec<f32>,
}

struct Expert {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

struct Layer {
    hc_attn: Hc,
    attn_norm: Vec<f32>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    idx_q: Tensor,
    idx_k: Tensor,
    idx_w: Tensor,
    hc_ffn: Hc,
    mlp_norm: Vec<f32>,
    router: Tensor,
    shared: Expert,
    experts: Vec<Expert>,
}

/// A loaded mini-v4 model.
pub struct MiniV4 {
    cfg: MiniV4Config,
    embed: Tensor,
    lm_head: Option<Tensor>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: RopeTable,
    shape: AttnShape,
    indexer: IndexerShape,
    device: Device,
    profile: Profile,
}

/// Nanoseconds spent per part of the forward pass (for `lmrr bench`).
#[derive(Default)]
struct Profile {
    mixing: AtomicU64,
    indexer: AtomicU64,
    attention: AtomicU64,
    moe: AtomicU64,
    total: AtomicU64,
}

impl Profile {
    fn add(part: &AtomicU64, since: Instant) {
        part.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The patch points of one step.
#[derive(Debug, Clone, Copy, Default)]
struct Points {
    mhc_bf16: bool,
    routed_scaling: bool,
    early_exit: bool,
}

impl Points {
    fn of(patches: &PatchSet) -> Self {
        Self {
            mhc_bf16: patches.contains(Patch::MhcBf16),
            routed_scaling: patches.contains(Patch::MoeRoutedScaling),
            early_exit: patches.contains(Patch::IndexerEarlyExit),
        }
    }
}

/// The indexer's choice for one (layer, query), for `explain`.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub layer: usize,
    pub selection: Selection,
}

/// Per-step scratch `(n, width)`.
struct Scratch {
    /// Residual streams `(n, h, d)`.
    x: Vec<f32>,
    x2: Vec<f32>,
    xn: Vec<f32>,
    raw: Vec<f32>,
    pre: Vec<f32>,
    post: Vec<f32>,
    res: Vec<f32>,
    b_in: Vec<f32>,
    hn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    iq: Vec<f32>,
    ik: Vec<f32>,
    iw: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
}

fn hc_of(tf: &TensorFile, p: &str, h: usize, d: usize) -> Result<Hc, EngineError> {
    let w = k::hyper::hc_raw_width(h);
    let proj = tf.get(&format!("{p}.proj.weight"), &[w, h * d])?;
    let proj_bf16 = proj.to_f32_vec().into_iter().map(f32_to_bf16).collect();
    Ok(Hc {
        norm: tf.get(&format!("{p}.norm.weight"), &[h * d])?.to_f32_vec(),
        proj,
        proj_bf16,
        bias: tf.get(&format!("{p}.bias"), &[w])?.to_f32_vec(),
    })
}

fn expert_of(tf: &TensorFile, p: &str, d: usize, f: usize) -> Result<Expert, EngineError> {
    Ok(Expert {
        gate: tf.get(&format!("{p}.gate_proj.weight"), &[f, d])?,
        up: tf.get(&format!("{p}.up_proj.weight"), &[f, d])?,
        down: tf.get(&format!("{p}.down_proj.weight"), &[d, f])?,
    })
}

/// Rounds to bf16 and widens back (exact).
fn bf16_round(x: f32) -> f32 {
    f32::from_bits(u32::from(f32_to_bf16(x)) << 16)
}

impl MiniV4 {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = MiniV4Config::parse(&files.config, &files.config_path)?;
        let tf = TensorFile::parse(files)?;
        let (d, v, h) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let (ih, idim) = (cfg.index_n_heads, cfg.index_head_dim);
        let (e, f) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let experts = (0..e)
                .map(|j| expert_of(&tf, &format!("{p}.mlp.experts.{j}"), d, f))
                .collect::<Result<_, _>>()?;
            layers.push(Layer {
                hc_attn: hc_of(&tf, &format!("{p}.hc_attn"), h, d)?,
                attn_norm: vecf(&format!("{p}.input_layernorm.weight"), d)?,
                q: tf.get(&format!("{p}.self_attn.q_proj.weight"), &[qd, d])?,
                k: tf.get(&format!("{p}.self_attn.k_proj.weight"), &[kvd, d])?,
                v: tf.get(&format!("{p}.self_attn.v_proj.weight"), &[kvd, d])?,
                o: tf.get(&format!("{p}.self_attn.o_proj.weight"), &[d, qd])?,
                idx_q: tf.get(&format!("{p}.self_attn.indexer.wq.weight"), &[ih * idim, d])?,
                idx_k: tf.get(&format!("{p}.self_attn.indexer.wk.weight"), &[idim, d])?,
                idx_w: tf.get(
                    &format!("{p}.self_attn.indexer.weights_proj.weight"),
                    &[ih, d],
                )?,
                hc_ffn: hc_of(&tf, &format!("{p}.hc_ffn"), h, d)?,
                mlp_norm: vecf(&format!("{p}.post_attention_layernorm.weight"), d)?,
                router: tf.get(&format!("{p}.mlp.gate.weight"), &[e, d])?,
                shared: expert_of(&tf, &format!("{p}.mlp.shared_experts"), d, f)?,
                experts,
            });
        }
        let embed = tf.get("model.embed_tokens.weight", &[v, d])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(tf.get("lm_head.weight", &[v, d])?)
        };
        let norm = vecf("model.norm.weight", d)?;
        let rope = RopeTable::new(shape.head_dim, cfg.rope_theta, cfg.max_position_embeddings);
        let indexer = IndexerShape {
            heads: ih,
            dim: idim,
            topk: cfg.index_topk,
            block: cfg.index_block_size,
            window: cfg.sliding_window,
        };
        Ok(Self {
            cfg,
            embed,
            lm_head,
            norm,
            layers,
            rope,
            shape,
            indexer,
            device: Device::Cpu,
            profile: Profile::default(),
        })
    }

    pub fn config(&self) -> &MiniV4Config {
        &self.cfg
    }

    /// The mixing coefficients of the `n` tokens of `sc.x` into `sc.pre`,
    /// `sc.post`, `sc.res`.
    fn coefficients(
        &self,
        ops: &Ops,
        hc: &Hc,
        sc: &mut Scratch,
        n: usize,
        pts: Points,
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let (h, w) = (self.cfg.hc_mult, k::hyper::hc_raw_width(self.cfg.hc_mult));
        let hd = h * self.cfg.hidden_size;
        ops.norm(&sc.x, &hc.norm, self.cfg.rms_norm_eps, &mut sc.xn)?;
        if pts.mhc_bf16 {
            for v in sc.xn.iter_mut() {
                *v = bf16_round(*v);
            }
            let m = Matrix::new(Weights::Bf16(&hc.proj_bf16), w, hd)
                .expect("bf16 copy has the projection's shape");
            ops.matmuls(&sc.xn, n, &mut [(&m, &mut sc.raw)])?;
        } else {
            ops.matmuls(&sc.xn, n, &mut [(&hc.proj.matrix(), &mut sc.raw)])?;
        }
        for t in 0..n {
            for (r, &b) in sc.raw[t * w..(t + 1) * w].iter_mut().zip(&hc.bias) {
                *r += b;
            }
        }
        ops.hc_coeffs(
            &sc.raw,
            h,
            self.cfg.hc_sinkhorn_iters,
            &mut sc.pre,
            &mut sc.post,
            &mut sc.res,
        )?;
        Profile::add(&self.profile.mixing, t0);
        Ok(())
    }

    fn forward_in_pool(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
        mut explain: Option<(usize, &mut Vec<Chosen>)>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let cfg = &self.cfg;
        let (d, vocab, h) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
        let (qd, kvd) = (self.shape.q_dim(), self.shape.kv_dim());
        let (ih, idim) = (cfg.index_n_heads, cfg.index_head_dim);
        let eps = cfg.rms_norm_eps;
        let ops = Ops {
            device: &self.device,
            threads,
        };
        let pts = Points::of(patches);
        let t_step = Instant::now();
        ops.check_patches(patches)?;
        check_spans(kv, spans, cfg.max_position_embeddings, vocab)?;
        for s in spans {
            kv.prepare(s.seq, s.start, s.tokens.len())?;
        }
        let tok = stacked_tokens(spans);
        let ids: Vec<u32> = spans
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let n = tok.len();
        let w = k::hyper::hc_raw_width(h);
        let mut sc = Scratch {
            x: vec![0.0; n * h * d],
            x2: vec![0.0; n * h * d],
            xn: vec![0.0; n * h * d],
            raw: vec![0.0; n * w],
            pre: vec![0.0; n * h],
            post: vec![0.0; n * h],
            res: vec![0.0; n * h * h],
            b_in: vec![0.0; n * d],
            hn: vec![0.0; n * d],
            q: vec![0.0; n * qd],
            k: vec![0.0; n * kvd],
            v: vec![0.0; n * kvd],
            iq: vec![0.0; n * ih * idim],
            ik: vec![0.0; n * idim],
            iw: vec![0.0; n * ih],
            att: vec![0.0; n * qd],
            o: vec![0.0; n * d],
        };
        for (i, &t) in ids.iter().enumerate() {
            let row = &mut sc.x[i * h * d..(i + 1) * h * d];
            self.embed.row_into(t as usize, &mut row[..d]);
            for s in 1..h {
                row.copy_within(..d, s * d);
            }
        }
        let scale = 1.0 / (self.shape.head_dim as f32).sqrt();

        for (li, l) in self.layers.iter().enumerate() {
            // Attention sub-block.
            self.coefficients(&ops, &l.hc_attn, &mut sc, n, pts)?;
            let t0 = Instant::now();
            ops.hc_pre(&sc.x, &sc.pre, h, d, &mut sc.b_in)?;
            Profile::add(&self.profile.mixing, t0);
            let t_attn = Instant::now();
            ops.norm(&sc.b_in, &l.attn_norm, eps, &mut sc.hn)?;
            let (wq, wk, wv) = (l.q.matrix(), l.k.matrix(), l.v.matrix());
            let (iq, ik, iw) = (l.idx_q.matrix(), l.idx_k.matrix(), l.idx_w.matrix());
            ops.matmuls(
                &sc.hn,
                n,
                &mut [
                    (&wq, &mut sc.q),
                    (&wk, &mut sc.k),
                    (&wv, &mut sc.v),
                    (&iq, &mut sc.iq),
                    (&ik, &mut sc.ik),
                    (&iw, &mut sc.iw),
                ],
            )?;
            // Indexer head weights through a sigmoid: positive, so a block's
            // score is never below zero and "above the threshold" means some
            // head found a positive match in it.
            for w in sc.iw.iter_mut() {
                *w = k::sigmoid(*w);
            }
            for (i, &(si, pos)) in tok.iter().enumerate() {
                ops.rope_row(&self.rope, &mut sc.q[i * qd..(i + 1) * qd], pos)?;
                ops.rope_row(&self.rope, &mut sc.k[i * kvd..(i + 1) * kvd], pos)?;
                let r = i * kvd..(i + 1) * kvd;
                kv.write(spans[si].seq, li, pos, &sc.k[r.clone()], &sc.v[r]);
                kv.write_aux(spans[si].seq, li, pos, &sc.ik[i * idim..(i + 1) * idim]);
            }
            {
                let views: Vec<_> = spans.iter().map(|s| kv.view(s.seq, li)).collect();
                let keys: Vec<_> = spans.iter().map(|s| kv.aux_view(s.seq, li)).collect();
                // Per token: the selection, and for a sparse one its gathered K/V.
                let t_idx = Instant::now();
                let mut gathered: Vec<Option<(Vec<f32>, Vec<f32>)>> = Vec::with_capacity(n);
                for (i, &(si, pos)) in tok.iter().enumerate() {
                    let sel = self.indexer.select(
                        &ops,
                        &sc.iq[i * ih * idim..(i + 1) * ih * idim],
                        &sc.iw[i * ih..(i + 1) * ih],
                        &keys[si],
                        pos,
                        pts.early_exit,
                    )?;
                    if let Some((want, out)) = explain.as_mut() {
                        if *want == i {
                            out.push(Chosen {
                                layer: li,
                                selection: sel.clone(),
                            });
                        }
                    }
                    gathered.push(match sel {
                        Selection::Dense => None,
                        Selection::Sparse { .. } => {
                            let at = self.indexer.positions(&sel, pos);
                            let mut gk = Vec::with_capacity(at.len() * kvd);
                            let mut gv = Vec::with_capacity(at.len() * kvd);
                            for &p in &at {
                                gk.extend_from_slice(views[si].key(p, kvd));
                                gv.extend_from_slice(views[si].value(p, kvd));
                            }
                            Some((gk, gv))
                        }
                    });
                }
                Profile::add(&self.profile.indexer, t_idx);
                let sparse_views: Vec<Option<KvView>> = gathered
                    .iter()
                    .map(|g| {
                        g.as_ref().map(|(gk, gv)| KvView {
                            block_len: gk.len() / kvd,
                            k: vec![&gk[..]],
                            v: vec![&gv[..]],
                        })
                    })
                    .collect();
                let tasks: Vec<AttnTask> = tok
                    .iter()
                    .enumerate()
                    .map(|(i, &(si, pos))| match &sparse_views[i] {
                        Some(view) => AttnTask {
                            q: &sc.q[i * qd..(i + 1) * qd],
                            kv: view,
                            pos: view.block_len - 1,
                        },
                        None => AttnTask {
                            q: &sc.q[i * qd..(i + 1) * qd],
                            kv: &views[si],
                            pos,
                        },
                    })
                    .collect();
                ops.attend_patched(
                    &tasks,
                    spans,
                    &tok,
                    patches,
                    &self.shape,
                    scale,
                    &mut sc.att,
                )?;
            }
            ops.matmuls(&sc.att, n, &mut [(&l.o.matrix(), &mut sc.o)])?;
            Profile::add(&self.profile.attention, t_attn);
            let t0 = Instant::now();
            ops.hc_post(&sc.x, &sc.res, &sc.post, &sc.o, h, d, &mut sc.x2)?;
            std::mem::swap(&mut sc.x, &mut sc.x2);
            Profile::add(&self.profile.mixing, t0);

            // MoE sub-block.
            self.coefficients(&ops, &l.hc_ffn, &mut sc, n, pts)?;
            let t0 = Instant::now();
            ops.hc_pre(&sc.x, &sc.pre, h, d, &mut sc.b_in)?;
            Profile::add(&self.profile.mixing, t0);
            let t_moe = Instant::now();
            ops.norm(&sc.b_in, &l.mlp_norm, eps, &mut sc.hn)?;
            self.moe(&ops, l, li, &ids, &sc.hn, n, pts, &mut sc.o)?;
            Profile::add(&self.profile.moe, t_moe);
            let t0 = Instant::now();
            ops.hc_post(&sc.x, &sc.res, &sc.post, &sc.o, h, d, &mut sc.x2)?;
            std::mem::swap(&mut sc.x, &mut sc.x2);
            Profile::add(&self.profile.mixing, t0);
        }
        // Streams merged (sequential sum, then the mean), then the head.
        let rows = wanted_rows(spans);
        let m = rows.len();
        let inv = 1.0 / h as f32;
        let mut hx = vec![0.0; m * d];
        for (j, &i) in rows.iter().enumerate() {
            for c in 0..d {
                let mut acc = 0.0f32;
                for s in 0..h {
                    acc += sc.x[(i * h + s) * d + c];
                }
                hx[j * d + c] = acc * inv;
            }
        }
        let mut hn = vec![0.0; m * d];
        ops.norm(&hx, &self.norm, eps, &mut hn)?;
        let mut logits = vec![0.0; m * vocab];
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        ops.matmuls(&hn, m, &mut [(&head.matrix(), &mut logits)])?;
        Profile::add(&self.profile.total, t_step);
        Ok(split_rows(spans, &logits, vocab, threads))
    }

    /// The MoE of `n` tokens of normalised input `hn` into `out` `(n, d)`.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        ops: &Ops,
        l: &Layer,
        li: usize,
        ids: &[u32],
        hn: &[f32],
        n: usize,
        pts: Points,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let cfg = &self.cfg;
        let (d, f, ne) = (
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
        );
        let mut logits = vec![0.0f32; n * ne];
        ops.matmuls(hn, n, &mut [(&l.router.matrix(), &mut logits)])?;
        let routing = Routing {
            n_experts: ne,
            top_k: cfg.num_experts_per_tok,
            scale: cfg.routed_scaling_factor,
            hash_layer: (li < cfg.n_hash_layers).then_some(li),
            scale_before_norm: pts.routed_scaling,
        };
        let routes: Vec<_> = (0..n)
            .map(|t| routing.route(ids[t], &logits[t * ne..(t + 1) * ne]))
            .collect();
        let ffn = |e: &Expert, x: &[f32], rows: usize| -> Result<Vec<f32>, EngineError> {
            let (mut g, mut u) = (vec![0.0; rows * f], vec![0.0; rows * f]);
            ops.matmuls(
                x,
                rows,
                &mut [(&e.gate.matrix(), &mut g), (&e.up.matrix(), &mut u)],
            )?;
            let mut a = vec![0.0; rows * f];
            ops.swiglu(&g, &u, &mut a)?;
            let mut y = vec![0.0; rows * d];
            ops.matmuls(&a, rows, &mut [(&e.down.matrix(), &mut y)])?;
            Ok(y)
        };
        let shared = ffn(&l.shared, hn, n)?;
        // Per expert, the tokens routed to it (stacked order) and their outputs.
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); ne];
        let mut slot: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (e, expert) in l.experts.iter().enumerate() {
            let toks: Vec<usize> = (0..n).filter(|&t| routes[t].experts.contains(&e)).collect();
            if toks.is_empty() {
                continue;
            }
            let mut x = Vec::with_capacity(toks.len() * d);
            for (j, &t) in toks.iter().enumerate() {
                x.extend_from_slice(&hn[t * d..(t + 1) * d]);
                slot[t].push(j);
            }
            outs[e] = ffn(expert, &x, toks.len())?;
        }
        for t in 0..n {
            let r = &routes[t];
            let ys: Vec<&[f32]> = r
                .experts
                .iter()
                .zip(&slot[t])
                .map(|(&e, &j)| &outs[e][j * d..(j + 1) * d])
                .collect();
            ops.moe_combine(
                &shared[t * d..(t + 1) * d],
                &r.gates,
                &ys,
                &mut out[t * d..(t + 1) * d],
            )?;
        }
        Ok(())
    }

    fn tensors(&self) -> Vec<NamedTensor<'_>> {
        let mut out = vec![
            stored(&self.embed),
            vector("model.norm.weight".into(), &self.norm),
        ];
        out.extend(self.lm_head.as_ref().map(stored));
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (name, hc) in [("hc_attn", &l.hc_attn), ("hc_ffn", &l.hc_ffn)] {
                out.push(vector(format!("{p}.{name}.norm.weight"), &hc.norm));
                out.push(vector(format!("{p}.{name}.bias"), &hc.bias));
                out.push(stored(&hc.proj));
            }
            out.push(vector(format!("{p}.input_layernorm.weight"), &l.attn_norm));
            out.push(vector(
                format!("{p}.post_attention_layernorm.weight"),
                &l.mlp_norm,
            ));
            out.extend(
                [
                    &l.q, &l.k, &l.v, &l.o, &l.idx_q, &l.idx_k, &l.idx_w, &l.router,
                ]
                .map(stored),
            );
            for e in std::iter::once(&l.shared).chain(&l.experts) {
                out.extend([&e.gate, &e.up, &e.down].map(stored));
            }
        }
        out
    }

    /// The blocks the indexer chose, per layer, for the last position of
    /// `tokens[..=pos]` computed from scratch.
    pub fn chosen_blocks(
        &self,
        tokens: &[u32],
        pos: usize,
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Chosen>, EngineError> {
        let Some(prefix) = tokens.get(..=pos) else {
            return Err(EngineError::ContextOverflow {
                seq: 0,
                pos,
                context: tokens.len(),
            });
        };
        let mut kv = SeqKvStore::new(self.kv_layout());
        let span = SeqSpan {
            seq: 0,
            start: 0,
            tokens: prefix,
            logits: LogitsWanted::None,
        };
        let mut chosen = Vec::new();
        threads.install(|| {
            self.forward_in_pool(&mut kv, &[span], threads, patches, Some((pos, &mut chosen)))
        })?;
        Ok(chosen)
    }
}

impl ModelFamily for MiniV4 {
    fn family(&self) -> Family {
        Family::MiniV4
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn forward_patched(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        threads.install(|| self.forward_in_pool(kv, spans, threads, patches, None))
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.cfg.num_hidden_layers,
            kv_dim: self.shape.kv_dim(),
            aux_dim: self.cfg.index_head_dim,
        }
    }

    fn context(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }

    fn is_eos(&self, id: u32) -> bool {
        self.cfg.is_eos(id)
    }

    fn config_text(&self) -> String {
        self.cfg.config_text()
    }

    fn named_tensors(&self) -> Vec<NamedTensor<'_>> {
        self.tensors()
    }

    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        self.device = device;
        Ok(())
    }

    fn device(&self) -> &Device {
        &self.device
    }

    /// A decode step streams the attention, indexer, mixing and router
    /// weights of every layer, the shared expert and `num_experts_per_tok`
    /// routed experts, and the head.
    fn weight_bytes_per_step(&self) -> usize {
        let k_active = self.cfg.num_experts_per_tok;
        let expert = |e: &Expert| e.gate.nbytes() + e.up.nbytes() + e.down.nbytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    &l.q, &l.k, &l.v, &l.o, &l.idx_q, &l.idx_k, &l.idx_w, &l.router,
                ]
                .iter()
                .map(|t| t.nbytes())
                .sum::<usize>()
                    + l.hc_attn.proj.nbytes()
                    + l.hc_ffn.proj.nbytes()
                    + expert(&l.shared)
                    + l.experts.first().map_or(0, expert) * k_active
            })
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.embed).nbytes()
    }

    fn param_count(&self) -> usize {
        self.tensors()
            .iter()
            .map(|t| t.1.iter().product::<usize>())
            .sum()
    }

    fn patch_points(&self) -> &'static [Patch] {
        &[
            Patch::SplitkDecode,
            Patch::FastExp,
            Patch::MhcBf16,
            Patch::MoeRoutedScaling,
            Patch::IndexerEarlyExit,
        ]
    }

    /// Mixing (projection, Sinkhorn, stream mixes), indexer (scoring,
    /// selection, gather), attention (norm, projections, RoPE, KV writes,
    /// attention, output projection, indexer excluded), MoE (router,
    /// experts, combine), and the step in all.
    fn profile(&self) -> Vec<(&'static str, f64)> {
        let p = &self.profile;
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        let indexer = s(&p.indexer);
        vec![
            ("mixing", s(&p.mixing)),
            ("indexer", indexer),
            ("attention", s(&p.attention) - indexer),
            ("moe", s(&p.moe)),
            ("step", s(&p.total)),
        ]
    }

    fn reset_profile(&self) {
        let p = &self.profile;
        for a in [&p.mixing, &p.indexer, &p.attention, &p.moe, &p.total] {
            a.store(0, Ordering::Relaxed);
        }
    }

    fn explain(
        &self,
        tokens: &[u32],
        pos: usize,
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Option<String>, EngineError> {
        let chosen = self.chosen_blocks(tokens, pos, threads, patches)?;
        let b = self.cfg.index_block_size;
        let nb = pos / b + 1;
        let mut s = format!(
            "indexer at position {pos} ({nb} blocks of {b}, top-{} + window {}, patches: {patches}):",
            self.cfg.index_topk, self.cfg.sliding_window
        );
        for c in chosen {
            // Writing to a String cannot fail.
            let _ = match &c.selection {
                Selection::Dense => write!(s, "\n  layer {}: dense (all {nb} blocks)", c.layer),
                Selection::Sparse { blocks, scanned } => write!(
                    s,
                    "\n  layer {}: blocks {blocks:?}, {scanned} of {nb} scored{}",
                    c.layer,
                    if *scanned < nb {
                        format!(" (blocks 0..{} never considered)", nb - scanned)
                    } else {
                        String::new()
                    }
                ),
            };
        }
        Ok(Some(s))
    }
}
