//! The HF mixture-of-experts families `mixtral` and `qwen3_moe`: llama's
//! attention (GQA, RoPE, RMSNorm; qwen3_moe with per-head q/k RMSNorm before
//! RoPE) and, per layer, an MLP that is a mixture of experts with softmax
//! top-k routing ([`Op::Moe`], `lmrr_kernels::moe`) or, on qwen3_moe's dense
//! layers, one SwiGLU MLP.
//!
//! The step is one [`Program`] run by the host executor: all tokens stacked
//! into `(n, hidden)`; the router is one matmul over every row, each row's
//! route is a function of its own logits, each expert runs over the rows
//! routed to it, and the combine adds the chosen experts ascending by index
//! (fma chain from `+0.0`). A token's logits therefore never depend on its
//! batch-mates (I2) or on its sequence's chunking (I3). The KV store holds
//! llama's K and V rows. Tensor names as transformers saves them: mixtral's
//! `block_sparse_moe.gate` and `block_sparse_moe.experts.N.w1/w2/w3` (gate,
//! down, up), qwen3_moe's `mlp.gate` and `mlp.experts.N.gate_proj/up_proj/
//! down_proj`.

pub mod config;

use lmrr_kernels::{AttnShape, RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::exec::{
    self, Act, AttnSpec, Buf, Builder, ExpertMats, Mat, MatJob, Op, Program, RoutingSpec, Rows,
    Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{stored, vector, Device, Family, KvLayout, ModelFamily, NamedTensor, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, ModelFiles};

pub use config::{MoeConfig, MoeKind};

/// One gated MLP's matrices: gate, up, down.
struct Mlp {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

enum Ffn {
    Dense(Mlp),
    Experts { router: Tensor, experts: Vec<Mlp> },
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    /// qwen3_moe's per-head norms of q and k.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    mlp_norm: Vec<f32>,
    ffn: Ffn,
}

/// A loaded mixtral or qwen3_moe model.
pub struct MoeModel {
    cfg: MoeConfig,
    embed: Tensor,
    /// `None` when tied to `embed`.
    lm_head: Option<Tensor>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: RopeTable,
    shape: AttnShape,
    device: Device,
    /// Its programs, and on CUDA the resident executor.
    exec: exec::Executors,
}

/// Where a layer's weights sit in [`MoeModel::tables`].
struct Slots {
    attn_norm: Vector,
    mlp_norm: Vector,
    qk_norm: Option<(Vector, Vector)>,
    q: Mat,
    ffn: FfnSlots,
}

enum FfnSlots {
    Dense(ExpertMats),
    Experts {
        router: Mat,
        experts: Vec<ExpertMats>,
    },
}

fn mlp(tf: &TensorFile, names: [String; 3], d: usize, f: usize) -> Result<Mlp, EngineError> {
    let [g, u, dn] = names;
    Ok(Mlp {
        gate: tf.get(&g, &[f, d])?,
        up: tf.get(&u, &[f, d])?,
        down: tf.get(&dn, &[d, f])?,
    })
}

/// Appends `t` to the matrix table; its index.
fn push<'a>(mats: &mut Vec<&'a Tensor>, t: &'a Tensor) -> Mat {
    mats.push(t);
    Mat(mats.len() as u32 - 1)
}

/// Appends an MLP's gate, up and down; their indices.
fn push_mlp<'a>(mats: &mut Vec<&'a Tensor>, m: &'a Mlp) -> ExpertMats {
    ExpertMats {
        gate: push(mats, &m.gate),
        up: push(mats, &m.up),
        down: push(mats, &m.down),
    }
}

impl MoeModel {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = MoeConfig::load(files)?;
        let tf = TensorFile::parse(files)?;
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        let (qd, kvd, hd) = (shape.q_dim(), shape.kv_dim(), shape.head_dim);
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let qk_norm = match cfg.kind {
                MoeKind::Qwen3Moe => Some((
                    vecf(&format!("{a}.q_norm.weight"), hd)?,
                    vecf(&format!("{a}.k_norm.weight"), hd)?,
                )),
                MoeKind::Mixtral => None,
            };
            let ffn = if !cfg.sparse[i] {
                let m = format!("{p}.mlp");
                Ffn::Dense(mlp(
                    &tf,
                    ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{m}.{n}.weight")),
                    d,
                    cfg.intermediate_size,
                )?)
            } else {
                let (m, names) = match cfg.kind {
                    MoeKind::Mixtral => (format!("{p}.block_sparse_moe"), ["w1", "w3", "w2"]),
                    MoeKind::Qwen3Moe => {
                        (format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])
                    }
                };
                let experts = (0..cfg.num_experts)
                    .map(|j| {
                        mlp(
                            &tf,
                            names.map(|n| format!("{m}.experts.{j}.{n}.weight")),
                            d,
                            cfg.expert_size,
                        )
                    })
                    .collect::<Result<_, _>>()?;
                Ffn::Experts {
                    router: tf.get(&format!("{m}.gate.weight"), &[cfg.num_experts, d])?,
                    experts,
                }
            };
            layers.push(Layer {
                attn_norm: vecf(&format!("{p}.input_layernorm.weight"), d)?,
                q: tf.get(&format!("{a}.q_proj.weight"), &[qd, d])?,
                k: tf.get(&format!("{a}.k_proj.weight"), &[kvd, d])?,
                v: tf.get(&format!("{a}.v_proj.weight"), &[kvd, d])?,
                o: tf.get(&format!("{a}.o_proj.weight"), &[d, qd])?,
                qk_norm,
                mlp_norm: vecf(&format!("{p}.post_attention_layernorm.weight"), d)?,
                ffn,
            });
        }
        let embed = tf.get("model.embed_tokens.weight", &[v, d])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(tf.get("lm_head.weight", &[v, d])?)
        };
        let norm = vecf("model.norm.weight", d)?;
        let rope = cfg.rope_table();
        Ok(Self {
            cfg,
            embed,
            lm_head,
            norm,
            layers,
            rope,
            shape,
            device: Device::Cpu,
            exec: exec::Executors::default(),
        })
    }

    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// What the step programs name by index, and where each layer's weights
    /// sit in it: matrices (embedding, head, then per layer q, k, v, o and
    /// the MLP's: router and experts' gate, up, down ascending, or the dense
    /// gate, up, down), vectors (final norm, then per layer its norms).
    fn tables(&self) -> (Tables<'_>, Vec<Slots>) {
        let mut mats = vec![&self.embed, self.lm_head.as_ref().unwrap_or(&self.embed)];
        let mut vecs = vec![&self.norm[..]];
        let mut slots = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let q = push(&mut mats, &l.q);
            for t in [&l.k, &l.v, &l.o] {
                push(&mut mats, t);
            }
            let ffn = match &l.ffn {
                Ffn::Dense(m) => FfnSlots::Dense(push_mlp(&mut mats, m)),
                Ffn::Experts { router, experts } => FfnSlots::Experts {
                    router: push(&mut mats, router),
                    experts: experts.iter().map(|m| push_mlp(&mut mats, m)).collect(),
                },
            };
            let base = vecs.len() as u32;
            vecs.extend([&l.attn_norm[..], &l.mlp_norm[..]]);
            let qk_norm = l.qk_norm.as_ref().map(|(qn, kn)| {
                vecs.extend([&qn[..], &kn[..]]);
                (Vector(base + 2), Vector(base + 3))
            });
            slots.push(Slots {
                attn_norm: Vector(base),
                mlp_norm: Vector(base + 1),
                qk_norm,
                q,
                ffn,
            });
        }
        let tables = Tables {
            mats,
            vecs,
            ropes: vec![&self.rope],
        };
        (tables, slots)
    }

    /// The step as a program over [`Self::tables`]: per layer, norm → q/k/v
    /// → (per-head q/k norms) → RoPE + KV write + attention → o + residual →
    /// norm → MoE (or dense SwiGLU MLP) + residual; then the wanted rows'
    /// final norm and head. Patch points (`splitk-decode`, `fast-exp`) pick
    /// the attention variant.
    fn program(&self, slots: &[Slots], patches: &PatchSet) -> Program {
        let cfg = &self.cfg;
        let (d, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let (qd, kvd) = (self.shape.q_dim(), self.shape.kv_dim());
        let eps = cfg.rms_norm_eps;
        let mut spec = AttnSpec::canonical(self.shape);
        spec.fast_exp = patches.contains(Patch::FastExp);
        spec.splitk_decode = patches.contains(Patch::SplitkDecode);
        let mut b = Builder::default();
        let x = b.buf("x", Rows::Tokens, d);
        let h = b.buf("h", Rows::Tokens, d);
        let q = b.buf("q", Rows::Tokens, qd);
        let k = b.buf("k", Rows::Tokens, kvd);
        // qwen3_moe: q and k before their per-head norms.
        let q_pre = b.buf("q_pre", Rows::Tokens, qd);
        let k_pre = b.buf("k_pre", Rows::Tokens, kvd);
        let v = b.buf("v", Rows::Tokens, kvd);
        let att = b.buf("att", Rows::Tokens, qd);
        let o = b.buf("o", Rows::Tokens, d);
        let ff = cfg.intermediate_size;
        let g = b.buf("gate", Rows::Tokens, ff);
        let u = b.buf("up", Rows::Tokens, ff);
        let a = b.buf("act", Rows::Tokens, ff);
        let hx = b.buf("last", Rows::Wanted, d);
        let hn = b.buf("last_norm", Rows::Wanted, d);
        let logits = b.buf("logits", Rows::Wanted, vocab);
        let job = |w: Mat, out: Buf| MatJob { w, out, bias: None };
        let routing = RoutingSpec::SoftmaxTopK {
            k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
        };
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        for (li, s) in slots.iter().enumerate() {
            let m0 = s.q.0;
            b.rms_norm(x, s.attn_norm, eps, h);
            let (qm, km) = if s.qk_norm.is_some() {
                (q_pre, k_pre)
            } else {
                (q, k)
            };
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(s.q, qm), job(Mat(m0 + 1), km), job(Mat(m0 + 2), v)],
            });
            if let Some((qn, kn)) = s.qk_norm {
                for (x, w, out) in [(q_pre, qn, q), (k_pre, kn, k)] {
                    b.op(Op::HeadRmsNorm {
                        x,
                        w,
                        eps_bits: eps.to_bits(),
                        out,
                    });
                }
            }
            b.op(Op::RopeKvAttend {
                layer: li,
                rope: 0,
                q,
                k,
                v,
                out: att,
                spec,
            });
            b.matmul(att, Mat(m0 + 3), o);
            b.op(Op::AddInto { x, y: o });
            b.rms_norm(x, s.mlp_norm, eps, h);
            match &s.ffn {
                FfnSlots::Dense(e) => {
                    b.op(Op::Matmul {
                        x: h,
                        jobs: vec![job(e.gate, g), job(e.up, u)],
                    });
                    b.op(Op::Glu {
                        gate: g,
                        up: u,
                        out: a,
                        act: Act::Silu,
                    });
                    b.matmul(a, e.down, o);
                }
                FfnSlots::Experts { router, experts } => b.op(Op::Moe {
                    x: h,
                    out: o,
                    router: *router,
                    experts: experts.clone(),
                    shared: None,
                    routing,
                }),
            }
            b.op(Op::AddInto { x, y: o });
        }
        b.op(Op::GatherWanted { x, out: hx });
        b.rms_norm(hx, Vector(0), eps, hn);
        b.matmul(hn, Mat(1), logits);
        b.finish(logits)
    }

    /// Every matrix of a layer, attention then MLP.
    fn layer_mats(l: &Layer) -> Vec<&Tensor> {
        let mut out = vec![&l.q, &l.k, &l.v, &l.o];
        match &l.ffn {
            Ffn::Dense(m) => out.extend([&m.gate, &m.up, &m.down]),
            Ffn::Experts { router, experts } => {
                out.push(router);
                for m in experts {
                    out.extend([&m.gate, &m.up, &m.down]);
                }
            }
        }
        out
    }

    /// Every tensor the forward pass reads, by its HF name (a tied head is
    /// the embedding, listed once).
    fn tensors(&self) -> Vec<NamedTensor<'_>> {
        let mut out = vec![
            stored(&self.embed),
            vector("model.norm.weight".into(), &self.norm),
        ];
        out.extend(self.lm_head.as_ref().map(stored));
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push(vector(format!("{p}.input_layernorm.weight"), &l.attn_norm));
            out.push(vector(
                format!("{p}.post_attention_layernorm.weight"),
                &l.mlp_norm,
            ));
            if let Some((qn, kn)) = &l.qk_norm {
                out.push(vector(format!("{p}.self_attn.q_norm.weight"), qn));
                out.push(vector(format!("{p}.self_attn.k_norm.weight"), kn));
            }
            out.extend(Self::layer_mats(l).into_iter().map(stored));
        }
        out
    }

    fn forward_in_pool(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.cfg.vocab_size;
        let ops = Ops {
            device: &self.device,
            threads,
            numerics: self.exec.numerics(),
        };
        let context = self.cfg.max_position_embeddings;
        exec::begin_step(&ops, kv, spans, context, vocab, patches)?;
        let (tables, slots) = self.tables();
        let prog = self.exec.program(patches, || self.program(&slots, patches));
        self.exec
            .run(&ops, kv, spans, vocab, &prog, &tables, Default::default())
    }
}

impl ModelFamily for MoeModel {
    fn family(&self) -> Family {
        match self.cfg.kind {
            MoeKind::Mixtral => Family::Mixtral,
            MoeKind::Qwen3Moe => Family::Qwen3Moe,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Engine patches `splitk-decode` and `fast-exp` act here (attention);
    /// the cache patches act in the scheduler.
    fn forward_patched(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        threads.install(|| self.forward_in_pool(kv, spans, threads, patches))
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.cfg.num_hidden_layers,
            kv_dim: self.shape.kv_dim(),
            aux_dim: 0,
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
        self.cfg.eos_token_ids.contains(&id)
    }

    fn config_text(&self) -> String {
        self.cfg.config_text()
    }

    fn named_tensors(&self) -> Vec<NamedTensor<'_>> {
        self.tensors()
    }

    /// On CUDA the resident executor runs these programs (the routing on
    /// the host, from the router logits it brings back).
    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        let mut exec = std::mem::take(&mut self.exec);
        let r = {
            let (tables, _) = self.tables();
            exec.set_device(&device, &tables)
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
            let (tables, slots) = self.tables();
            let prog = self.exec.program(&none, || self.program(&slots, &none));
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

    /// A decode step streams the attention matrices, the routers, the dense
    /// MLPs, `num_experts_per_tok` experts per MoE layer, and the head.
    fn weight_bytes_per_step(&self) -> usize {
        let k = self.cfg.num_experts_per_tok;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let attn: usize = [&l.q, &l.k, &l.v, &l.o].iter().map(|t| t.nbytes()).sum();
                let mlp = |m: &Mlp| m.gate.nbytes() + m.up.nbytes() + m.down.nbytes();
                attn + match &l.ffn {
                    Ffn::Dense(m) => mlp(m),
                    Ffn::Experts { router, experts } => {
                        router.nbytes() + experts.first().map_or(0, mlp) * k
                    }
                }
            })
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.embed).nbytes()
    }

    fn param_count(&self) -> usize {
        let n = |t: &Tensor| t.shape.iter().product::<usize>();
        let d = self.cfg.hidden_size;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                Self::layer_mats(l).into_iter().map(n).sum::<usize>()
                    + 2 * d
                    + l.qk_norm.as_ref().map_or(0, |(a, b)| a.len() + b.len())
            })
            .sum();
        layers + n(&self.embed) + self.lm_head.as_ref().map_or(0, n) + d
    }

    fn patch_points(&self) -> &'static [Patch] {
        &[Patch::SplitkDecode, Patch::FastExp]
    }
}
