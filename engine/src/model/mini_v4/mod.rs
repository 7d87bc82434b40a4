//! The mini-v4 family: a miniature of DeepSeek-V4-Flash's structure
//! (`docs/MINI-V4.md`), over a batch of (sequence, token span) entries.
//!
//! Per layer, two sub-blocks (attention, then MoE), each wrapped in
//! hyper-connections: the residual stream is `hc_mult` streams; from the
//! RMS-normalised streams a learned projection (the "MHC mixing GEMM", f32,
//! canonical matmul) gives pre-mix weights (streams → block input), post-mix
//! weights (block output → streams) and a residual mix made doubly stochastic
//! by Sinkhorn–Knopp ([`lmrr_kernels::hyper`]). Attention is deepseek_v3's
//! Multi-head Latent Attention (the block is
//! [`crate::model::deepseek_v3::attention`]'s) over the positions the
//! indexer selects ([`indexer`]); the MoE is one shared expert plus routed
//! experts ([`routing`]), combined in expert-index order.
//!
//! Invariants: every token's arithmetic is its own (routing, selection and
//! combine are per token; matmul rows are independent), so logits do not
//! depend on batch-mates (I2), chunking (I3) or the KV page size (index
//! blocks are absolute positions). What a position keeps, its normalised
//! latent, rotated RoPE key and indexer key (one auxiliary row), is in the
//! KV store and so under the page hashes.
//!
//! Patch points, chosen once per step: `mhc-bf16` (the mixing projection's
//! weights and inputs rounded to bf16, products accumulated in f32),
//! `moe-routed-scaling` ([`routing`]), `indexer-early-exit` ([`indexer`]).

pub mod config;

pub use crate::model::exec::{indexer, routing_v4 as routing};

use std::fmt::Write as _;

use lmrr_kernels::{self as k, RopeTable, Threads};

use crate::kv::{KvCache, SeqKvStore};
use crate::model::deepseek_v3::attention::{self, MlaAttn, MlaBufs, MlaStep};
use crate::model::exec::hyper::Trace;
use crate::model::exec::{
    self, AttnSpec, Buf, Builder, ExpertMats, Mat, MatJob, MlaIndex, MlaShape, Op, Program,
    RoutingSpec, Rows, Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{
    stored, vector, Device, Family, KvLayout, LogitsWanted, ModelFamily, NamedTensor, SeqSpan,
};
use crate::patches::{Patch, PatchSet};
use crate::synth::f32_to_bf16;
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, ModelFiles};

pub use config::MiniV4Config;
use indexer::{IndexerShape, Selection};

/// The mixing projection of one sub-block.
struct Hc {
    norm: Vec<f32>,
    proj: Tensor,
    /// `proj` rounded to bf16, for `mhc-bf16`.
    proj_bf16: Tensor,
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
    attn: MlaAttn,
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
    mla: MlaShape,
    indexer: IndexerShape,
    device: Device,
    /// Time per op, for `lmrr bench` (measurement only).
    profile: exec::host::Profile,
    /// Its programs, and on CUDA the resident executor.
    exec: exec::Executors,
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

fn hc_of(tf: &TensorFile, p: &str, h: usize, d: usize) -> Result<Hc, EngineError> {
    let w = k::hyper::hc_raw_width(h);
    let proj = tf.get(&format!("{p}.proj.weight"), &[w, h * d])?;
    let proj_bf16 = Tensor::from_bf16(
        format!("{p}.proj.weight (bf16)"),
        vec![w, h * d],
        proj.to_f32_vec().into_iter().map(f32_to_bf16).collect(),
    );
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

/// Appends `w` to the tables' matrices; its index.
fn push_mat<'a>(t: &mut Tables<'a>, w: &'a Tensor) -> Mat {
    t.mats.push(w);
    Mat(t.mats.len() as u32 - 1)
}

/// Appends `v` to the tables' vectors; its index.
fn push_vec<'a>(t: &mut Tables<'a>, v: &'a [f32]) -> Vector {
    t.vecs.push(v);
    Vector(t.vecs.len() as u32 - 1)
}

impl MiniV4 {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = MiniV4Config::parse(&files.config, &files.config_path)?;
        let tf = TensorFile::parse(files)?;
        let (d, v, h) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
        let mla = cfg.mla();
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
                attn: MlaAttn::load(&tf, &format!("{p}.self_attn"), &mla, d, cfg.q_lora_rank)?,
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
        let rope = RopeTable::new(mla.rope, cfg.rope_theta, cfg.max_position_embeddings);
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
            mla,
            indexer,
            device: Device::Cpu,
            profile: exec::host::Profile::default(),
            exec: exec::Executors::default(),
        })
    }

    pub fn config(&self) -> &MiniV4Config {
        &self.cfg
    }

    /// The step as a program, with the tables it names: per layer the
    /// attention sub-block (mixing coefficients → streams to block input →
    /// norm → the MLA query and compressed KV and the indexer's q, k, head
    /// weights → latent attention over the indexer's positions → o → block
    /// output back into the streams), then the MoE sub-block the
    /// same way around the router, shared expert and routed experts; then the
    /// wanted rows' stream mean, final norm and head. Patch points pick op
    /// variants here, once: `mhc-bf16` (bf16 mixing inputs and weights),
    /// `moe-routed-scaling`, `indexer-early-exit`, the attention patches.
    fn plan<'a>(&'a self, patches: &PatchSet) -> (Tables<'a>, Program) {
        let cfg = &self.cfg;
        let (d, vocab, h) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
        let (ih, idim) = (cfg.index_n_heads, cfg.index_head_dim);
        let eps = cfg.rms_norm_eps;
        let pts = Points::of(patches);
        let spec = AttnSpec {
            shape: self.mla.attn_shape(),
            scale_bits: cfg.softmax_scale().to_bits(),
            fast_exp: patches.contains(Patch::FastExp),
            splitk_decode: patches.contains(Patch::SplitkDecode),
            window: None,
        };
        let mut t = Tables {
            mats: Vec::new(),
            vecs: Vec::new(),
            ropes: vec![&self.rope],
        };
        let mut b = Builder::default();
        let tok = |b: &mut Builder, name, w| b.buf(name, Rows::Tokens, w);
        let e0 = tok(&mut b, "embedding", d);
        let mut x = tok(&mut b, "streams", h * d);
        let mut x2 = tok(&mut b, "streams_next", h * d);
        let xn = tok(&mut b, "streams_norm", h * d);
        let raw = tok(&mut b, "mix_raw", k::hyper::hc_raw_width(h));
        let pre = tok(&mut b, "mix_pre", h);
        let post = tok(&mut b, "mix_post", h);
        let res = tok(&mut b, "mix_res", h * h);
        let b_in = tok(&mut b, "block_in", d);
        let hn = tok(&mut b, "block_norm", d);
        let mb = MlaBufs::new(&mut b, &self.mla, cfg.q_lora_rank.unwrap_or(0));
        let iq = tok(&mut b, "index_q", ih * idim);
        let ik = tok(&mut b, "index_k", idim);
        let iw = tok(&mut b, "index_w", ih);
        let o = tok(&mut b, "block_out", d);
        let hx = b.buf("last_streams", Rows::Wanted, h * d);
        let hm = b.buf("last", Rows::Wanted, d);
        let hnf = b.buf("last_norm", Rows::Wanted, d);
        let logits = b.buf("logits", Rows::Wanted, vocab);
        t.mats.push(&self.embed);
        b.op(Op::Embed {
            table: Mat(0),
            out: e0,
        });
        b.op(Op::Repeat { x: e0, out: x });
        let job = |w: Mat, out: Buf| MatJob { w, out, bias: None };
        for (li, l) in self.layers.iter().enumerate() {
            // Attention sub-block.
            self.mix(
                &mut t,
                &mut b,
                &l.hc_attn,
                pts,
                [x, xn, raw, pre, post, res],
            );
            b.op(Op::HcPre { x, pre, out: b_in });
            b.rms_norm(b_in, push_vec(&mut t, &l.attn_norm), eps, hn);
            let slots = l.attn.push(&mut t.mats, &mut t.vecs);
            let ws = [&l.idx_q, &l.idx_k, &l.idx_w].map(|w| push_mat(&mut t, w));
            let index = MlaIndex {
                iq,
                ik,
                iw,
                shape: self.indexer,
                early_exit: pts.early_exit,
            };
            let at = MlaStep {
                layer: li,
                mla: self.mla,
                spec,
                index: Some(index),
            };
            let index_jobs = vec![job(ws[0], iq), job(ws[1], ik), job(ws[2], iw)];
            slots.emit(&mut b, &mb, hn, index_jobs, at, o);
            b.op(Op::HcPost {
                x,
                res,
                post,
                y: o,
                out: x2,
            });
            std::mem::swap(&mut x, &mut x2);
            // MoE sub-block.
            self.mix(&mut t, &mut b, &l.hc_ffn, pts, [x, xn, raw, pre, post, res]);
            b.op(Op::HcPre { x, pre, out: b_in });
            b.rms_norm(b_in, push_vec(&mut t, &l.mlp_norm), eps, hn);
            let mut expert = |e: &'a Expert| ExpertMats {
                gate: push_mat(&mut t, &e.gate),
                up: push_mat(&mut t, &e.up),
                down: push_mat(&mut t, &e.down),
            };
            let shared = expert(&l.shared);
            let experts: Vec<ExpertMats> = l.experts.iter().map(&mut expert).collect();
            let router = push_mat(&mut t, &l.router);
            b.op(Op::Moe {
                x: hn,
                out: o,
                router,
                experts,
                shared: Some(shared),
                routing: RoutingSpec::V4 {
                    k: cfg.num_experts_per_tok,
                    scale_bits: cfg.routed_scaling_factor.to_bits(),
                    hash_layer: (li < cfg.n_hash_layers).then_some(li),
                    scale_before_norm: pts.routed_scaling,
                },
            });
            b.op(Op::HcPost {
                x,
                res,
                post,
                y: o,
                out: x2,
            });
            std::mem::swap(&mut x, &mut x2);
        }
        // Streams merged (sequential sum, then the mean), then the head.
        b.op(Op::GatherWanted { x, out: hx });
        b.op(Op::StreamMean { x: hx, out: hm });
        b.rms_norm(hm, push_vec(&mut t, &self.norm), eps, hnf);
        let head = push_mat(&mut t, self.lm_head.as_ref().unwrap_or(&self.embed));
        b.matmul(hnf, head, logits);
        (t, b.finish(logits))
    }

    /// The mixing coefficients of one sub-block: the streams' RMSNorm, the
    /// mixing projection (+ bias; in bf16 under `mhc-bf16`), Sinkhorn.
    fn mix<'a>(
        &'a self,
        t: &mut Tables<'a>,
        b: &mut Builder,
        hc: &'a Hc,
        pts: Points,
        [x, xn, raw, pre, post, res]: [Buf; 6],
    ) {
        b.rms_norm(x, push_vec(t, &hc.norm), self.cfg.rms_norm_eps, xn);
        if pts.mhc_bf16 {
            b.op(Op::RoundBf16 { x: xn });
        }
        // Both copies are in the tables whatever the patches, so the tables
        // are the same for every step.
        let (proj, proj_bf16) = (push_mat(t, &hc.proj), push_mat(t, &hc.proj_bf16));
        b.op(Op::Matmul {
            x: xn,
            jobs: vec![MatJob {
                w: if pts.mhc_bf16 { proj_bf16 } else { proj },
                out: raw,
                bias: Some(push_vec(t, &hc.bias)),
            }],
        });
        b.op(Op::HcSinkhorn {
            raw,
            iters: self.cfg.hc_sinkhorn_iters,
            pre,
            post,
            res,
        });
    }

    fn forward_in_pool(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let cfg = &self.cfg;
        let ops = Ops {
            device: &self.device,
            threads,
            numerics: self.exec.numerics(),
        };
        let (context, vocab) = (cfg.max_position_embeddings, cfg.vocab_size);
        exec::begin_step(&ops, kv, spans, context, vocab, patches)?;
        let (tables, fresh) = self.plan(patches);
        let prog = self.exec.program(patches, || fresh);
        let extras = exec::host::Extras {
            trace,
            profile: Some(&self.profile),
        };
        self.exec
            .run(&ops, kv, spans, vocab, &prog, &tables, extras)
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
            let a = format!("{p}.self_attn");
            out.extend(l.attn.vecs(&a).into_iter().map(|(n, v)| vector(n, v)));
            out.extend(l.attn.mats().into_iter().map(stored));
            out.push(vector(
                format!("{p}.post_attention_layernorm.weight"),
                &l.mlp_norm,
            ));
            out.extend([&l.idx_q, &l.idx_k, &l.idx_w, &l.router].map(stored));
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
        let mut trace = Trace {
            token: pos,
            chosen: Vec::new(),
        };
        threads.install(|| {
            self.forward_in_pool(&mut kv, &[span], threads, patches, Some(&mut trace))
        })?;
        Ok(trace
            .chosen
            .into_iter()
            .map(|(layer, selection)| Chosen { layer, selection })
            .collect())
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

    /// No K/V rows: per layer and position one auxiliary row, the latent
    /// after `kv_a_layernorm`, the rotated `k_pe`, then the indexer key.
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.cfg.num_hidden_layers,
            kv_dim: 0,
            aux_dim: self.mla.row() + self.cfg.index_head_dim,
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

    /// On CUDA the host executor runs the step with the device's portable
    /// kernels (operands copied per call), as for deepseek_v3: the resident
    /// executor has no MLA kernel. A latent row wider than the portable
    /// attention kernel takes is refused here, naming the op.
    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        attention::fits_device("mini-v4", &self.mla, &device)?;
        let mut exec = std::mem::take(&mut self.exec);
        let r = {
            let (tables, _) = self.plan(&PatchSet::none());
            exec.set_device(&Device::Cpu, &tables)
        };
        self.exec = exec;
        r?;
        self.device = device;
        Ok(())
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn set_tp(&mut self, tp: exec::tp::TpConfig) -> Result<(), EngineError> {
        self.exec.set_tp(tp)?;
        let none = PatchSet::none();
        let r = {
            let (tables, fresh) = self.plan(&none);
            let prog = self.exec.program(&none, || fresh);
            self.exec.tp_check(&prog, &tables)
        };
        if r.is_err() {
            self.exec.set_tp(exec::tp::TpConfig::default())?;
        }
        r
    }

    fn tp_degree(&self) -> usize {
        self.exec.tp_degree()
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
                [&l.idx_q, &l.idx_k, &l.idx_w, &l.router]
                    .iter()
                    .map(|t| t.nbytes())
                    .sum::<usize>()
                    + l.attn.bytes_per_step()
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

    /// Seconds per op of the program (by op name) and the step in all.
    fn profile(&self) -> Vec<(&'static str, f64)> {
        self.exec.profile(&self.profile)
    }

    fn reset_profile(&self) {
        self.exec.reset_profile(&self.profile);
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
