//! The HF family `deepseek_v3`: Multi-head Latent Attention (MLA) and a
//! mixture of experts with group-limited sigmoid routing and shared
//! experts, as transformers' `modeling_deepseek_v3.py` defines them.
//!
//! Per layer: RMSNorm → q (`q_a_proj` → `q_a_layernorm` → `q_b_proj`, or
//! `q_proj` when `q_lora_rank` is null) and the compressed KV
//! (`kv_a_proj_with_mqa`: the latent and the shared RoPE key) → MLA
//! ([`Op::MlaAttend`], `exec/mla.rs`) → `o_proj` + residual → RMSNorm → a
//! dense SwiGLU MLP (the first `first_k_dense_replace` layers) or the MoE
//! ([`Op::Moe`] with [`RoutingSpec::SigmoidGroupTopK`] and the shared
//! experts as one MLP) + residual; then the wanted rows' final norm and head.
//!
//! What the KV store keeps per layer and position is the compressed latent
//! after `kv_a_layernorm` and the rotated `k_pe` (the auxiliary row of
//! [`KvLayout`], `kv_lora_rank + qk_rope_head_dim` floats; no K/V rows), so
//! the pool, the radix cache and the cache-state hash hold exactly what
//! transformers' cache holds. Attention runs in latent space: `kv_b_proj` is
//! split at load into its per-head key part, transposed (`k_absorb`, which
//! multiplies the query) and its per-head value part (`v_up`, which
//! multiplies the attention output), both widened exactly to f32; the
//! identity lists `kv_b_proj` itself.
//!
//! Invariant: each token's logits are a function of its sequence's tokens
//! only (the program's ops are per-row or per-position; attention tiles sit
//! at absolute positions), so batch, chunking, page size, cache hits and
//! thread count change no bit. Bad input (a missing tensor, a shape against
//! the config) is an error naming the tensor and both shapes.

pub mod attention;
pub mod config;

use lmrr_kernels::{RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::exec::{
    self, Act, AttnSpec, Buf, Builder, ExpertMats, Mat, MatJob, MlaShape, Op, Program, RoutingSpec,
    Rows, Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{stored, vector, Device, Family, KvLayout, ModelFamily, NamedTensor, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, ModelFiles};
use attention::{MlaAttn, MlaBufs, MlaSlots, MlaStep};

pub use config::DeepseekV3Config;

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers builds
/// them with `DeepseekV3RMSNorm`'s default, not `rms_norm_eps`.
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// One gated MLP's matrices: gate, up, down.
struct Mlp {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

enum Ffn {
    Dense(Mlp),
    Moe {
        router: Tensor,
        /// `e_score_correction_bias`.
        bias: Vec<f32>,
        experts: Vec<Mlp>,
        shared: Option<Mlp>,
    },
}

struct Layer {
    attn_norm: Vec<f32>,
    attn: MlaAttn,
    mlp_norm: Vec<f32>,
    ffn: Ffn,
}

/// A loaded `deepseek_v3` model.
pub struct DeepseekV3 {
    cfg: DeepseekV3Config,
    embed: Tensor,
    /// `None` when tied to `embed`.
    lm_head: Option<Tensor>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: RopeTable,
    mla: MlaShape,
    device: Device,
    exec: exec::Executors,
}

/// Where a layer's weights sit in [`DeepseekV3::tables`].
struct Slots {
    attn_norm: Vector,
    mlp_norm: Vector,
    attn: MlaSlots,
    ffn: FfnSlots,
}

enum FfnSlots {
    Dense(ExpertMats),
    Moe {
        router: Mat,
        bias: Vector,
        experts: Vec<ExpertMats>,
        shared: Option<ExpertMats>,
    },
}

fn mlp(tf: &TensorFile, prefix: &str, d: usize, f: usize) -> Result<Mlp, EngineError> {
    Ok(Mlp {
        gate: tf.get(&format!("{prefix}.gate_proj.weight"), &[f, d])?,
        up: tf.get(&format!("{prefix}.up_proj.weight"), &[f, d])?,
        down: tf.get(&format!("{prefix}.down_proj.weight"), &[d, f])?,
    })
}

fn push<'a>(mats: &mut Vec<&'a Tensor>, t: &'a Tensor) -> Mat {
    mats.push(t);
    Mat(mats.len() as u32 - 1)
}

fn push_mlp<'a>(mats: &mut Vec<&'a Tensor>, m: &'a Mlp) -> ExpertMats {
    ExpertMats {
        gate: push(mats, &m.gate),
        up: push(mats, &m.up),
        down: push(mats, &m.down),
    }
}

fn push_vec<'a>(vecs: &mut Vec<&'a [f32]>, v: &'a [f32]) -> Vector {
    vecs.push(v);
    Vector(vecs.len() as u32 - 1)
}

/// `kv_b_proj` (`(heads · (nope + v), latent)`, per head its `nope` key rows
/// then its `v` value rows) split into the per-head transposed key part
/// `(heads · latent, nope)` and the value part `(heads · v, latent)`, f32.
/// Pure rearrangement: every value is one of `kv_b`'s, widened exactly.
pub fn split_kv_b(kv_b: &[f32], mla: &MlaShape) -> (Vec<f32>, Vec<f32>) {
    let (lr, nope, vd) = (mla.latent, mla.nope, mla.v);
    let per = nope + vd;
    let mut absorb = vec![0.0f32; mla.heads * lr * nope];
    let mut up = Vec::with_capacity(mla.heads * vd * lr);
    for h in 0..mla.heads {
        for i in 0..nope {
            let src = &kv_b[(h * per + i) * lr..(h * per + i + 1) * lr];
            for (c, &w) in src.iter().enumerate() {
                absorb[(h * lr + c) * nope + i] = w;
            }
        }
        up.extend_from_slice(&kv_b[(h * per + nope) * lr..(h * per + per) * lr]);
    }
    (absorb, up)
}

impl DeepseekV3 {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = DeepseekV3Config::load(files)?;
        let tf = TensorFile::parse(files)?;
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let mla = cfg.mla_shape();
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = MlaAttn::load(&tf, &format!("{p}.self_attn"), &mla, d, cfg.q_lora_rank)?;
            let ffn = if cfg.is_moe(i) {
                let m = format!("{p}.mlp");
                let ne = cfg.n_routed_experts;
                let fe = cfg.moe_intermediate_size;
                let experts = (0..ne)
                    .map(|j| mlp(&tf, &format!("{m}.experts.{j}"), d, fe))
                    .collect::<Result<_, _>>()?;
                let shared = match cfg.n_shared_experts {
                    0 => None,
                    s => Some(mlp(&tf, &format!("{m}.shared_experts"), d, fe * s)?),
                };
                Ffn::Moe {
                    router: tf.get(&format!("{m}.gate.weight"), &[ne, d])?,
                    bias: vecf(&format!("{m}.gate.e_score_correction_bias"), ne)?,
                    experts,
                    shared,
                }
            } else {
                Ffn::Dense(mlp(&tf, &format!("{p}.mlp"), d, cfg.intermediate_size)?)
            };
            layers.push(Layer {
                attn_norm: vecf(&format!("{p}.input_layernorm.weight"), d)?,
                attn,
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
            mla,
            device: Device::Cpu,
            exec: exec::Executors::default(),
        })
    }

    pub fn config(&self) -> &DeepseekV3Config {
        &self.cfg
    }

    /// What the step programs name by index, and where each layer's weights
    /// sit in it: matrices (embedding, head, then per layer its attention's
    /// and its MLP's), vectors (final norm, then per layer its norms and
    /// routing bias).
    fn tables(&self) -> (Tables<'_>, Vec<Slots>) {
        let mut mats = vec![&self.embed, self.lm_head.as_ref().unwrap_or(&self.embed)];
        let mut vecs = vec![&self.norm[..]];
        let mut slots = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let attn_norm = push_vec(&mut vecs, &l.attn_norm);
            let mlp_norm = push_vec(&mut vecs, &l.mlp_norm);
            let attn = l.attn.push(&mut mats, &mut vecs);
            let ffn = match &l.ffn {
                Ffn::Dense(m) => FfnSlots::Dense(push_mlp(&mut mats, m)),
                Ffn::Moe {
                    router,
                    bias,
                    experts,
                    shared,
                } => FfnSlots::Moe {
                    router: push(&mut mats, router),
                    bias: push_vec(&mut vecs, bias),
                    experts: experts.iter().map(|m| push_mlp(&mut mats, m)).collect(),
                    shared: shared.as_ref().map(|m| push_mlp(&mut mats, m)),
                },
            };
            slots.push(Slots {
                attn_norm,
                mlp_norm,
                attn,
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

    /// The step as a program over [`Self::tables`] (module docs). Patch
    /// points (`splitk-decode`, `fast-exp`) pick the attention variant.
    fn program(&self, slots: &[Slots], patches: &PatchSet) -> Program {
        let cfg = &self.cfg;
        let mla = self.mla;
        let (d, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let eps = cfg.rms_norm_eps;
        let spec = AttnSpec {
            shape: mla.attn_shape(),
            scale_bits: cfg.softmax_scale().to_bits(),
            fast_exp: patches.contains(Patch::FastExp),
            splitk_decode: patches.contains(Patch::SplitkDecode),
            window: None,
        };
        let mut b = Builder::default();
        let x = b.buf("x", Rows::Tokens, d);
        let h = b.buf("h", Rows::Tokens, d);
        let mb = MlaBufs::new(&mut b, &mla, cfg.q_lora_rank.unwrap_or(0));
        let o = b.buf("o", Rows::Tokens, d);
        let ff = cfg.intermediate_size;
        let g = b.buf("gate", Rows::Tokens, ff);
        let u = b.buf("up", Rows::Tokens, ff);
        let a = b.buf("act", Rows::Tokens, ff);
        let hx = b.buf("last", Rows::Wanted, d);
        let hn = b.buf("last_norm", Rows::Wanted, d);
        let logits = b.buf("logits", Rows::Wanted, vocab);
        let job = |w: Mat, out: Buf| MatJob { w, out, bias: None };
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        for (li, s) in slots.iter().enumerate() {
            b.rms_norm(x, s.attn_norm, eps, h);
            let at = MlaStep {
                layer: li,
                mla,
                spec,
                index: None,
            };
            s.attn.emit(&mut b, &mb, h, Vec::new(), at, o);
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
                FfnSlots::Moe {
                    router,
                    bias,
                    experts,
                    shared,
                } => b.op(Op::Moe {
                    x: h,
                    out: o,
                    router: *router,
                    experts: experts.clone(),
                    shared: *shared,
                    routing: RoutingSpec::SigmoidGroupTopK {
                        k: cfg.num_experts_per_tok,
                        n_group: cfg.n_group,
                        topk_group: cfg.topk_group,
                        bias: *bias,
                        norm_topk_prob: cfg.norm_topk_prob,
                        scale_bits: cfg.routed_scaling_factor.to_bits(),
                    },
                }),
            }
            b.op(Op::AddInto { x, y: o });
        }
        b.op(Op::GatherWanted { x, out: hx });
        b.rms_norm(hx, Vector(0), eps, hn);
        b.matmul(hn, Mat(1), logits);
        b.finish(logits)
    }

    /// Every stored matrix of a layer (the identity's and the parameter
    /// count's: `kv_b_proj` as stored, not its two derived parts).
    fn layer_mats(l: &Layer) -> Vec<&Tensor> {
        let mut out = l.attn.mats();
        match &l.ffn {
            Ffn::Dense(m) => out.extend([&m.gate, &m.up, &m.down]),
            Ffn::Moe {
                router,
                experts,
                shared,
                ..
            } => {
                out.push(router);
                for m in experts.iter().chain(shared) {
                    out.extend([&m.gate, &m.up, &m.down]);
                }
            }
        }
        out
    }

    /// Every vector of a layer, by its HF name.
    fn layer_vecs(i: usize, l: &Layer) -> Vec<(String, &[f32])> {
        let p = format!("model.layers.{i}");
        let mut out = vec![
            (format!("{p}.input_layernorm.weight"), &l.attn_norm[..]),
            (
                format!("{p}.post_attention_layernorm.weight"),
                &l.mlp_norm[..],
            ),
        ];
        out.extend(l.attn.vecs(&format!("{p}.self_attn")));
        if let Ffn::Moe { bias, .. } = &l.ffn {
            out.push((format!("{p}.mlp.gate.e_score_correction_bias"), &bias[..]));
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
        exec::begin_step(
            &ops,
            kv,
            spans,
            self.cfg.max_position_embeddings,
            vocab,
            patches,
        )?;
        let (tables, slots) = self.tables();
        let prog = self.exec.program(patches, || self.program(&slots, patches));
        self.exec
            .run(&ops, kv, spans, vocab, &prog, &tables, Default::default())
    }
}

impl ModelFamily for DeepseekV3 {
    fn family(&self) -> Family {
        Family::DeepseekV3
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

    /// No K/V rows: per layer and position one auxiliary row, the latent
    /// after `kv_a_layernorm` then the rotated `k_pe`.
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.cfg.num_hidden_layers,
            kv_dim: 0,
            aux_dim: self.mla.row(),
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
        let mut out = vec![
            stored(&self.embed),
            vector("model.norm.weight".into(), &self.norm),
        ];
        out.extend(self.lm_head.as_ref().map(stored));
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(
                Self::layer_vecs(i, l)
                    .into_iter()
                    .map(|(n, v)| vector(n, v)),
            );
            out.extend(Self::layer_mats(l).into_iter().map(stored));
        }
        out
    }

    /// On CUDA the host executor runs the step with the device's portable
    /// kernels (operands copied per call): the resident executor has no MLA
    /// kernel, so nothing is uploaded for it. A latent row wider than the
    /// portable attention kernel takes is refused here, naming the op.
    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        attention::fits_device("deepseek_v3", &self.mla, &device)?;
        let mut exec = std::mem::take(&mut self.exec);
        let r = {
            let (tables, _) = self.tables();
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

    /// A decode step streams the attention matrices (the derived `kv_b`
    /// parts as the kernels read them), the routers and shared experts,
    /// `num_experts_per_tok` routed experts per MoE layer, the dense MLPs
    /// and the head.
    fn weight_bytes_per_step(&self) -> usize {
        let k = self.cfg.num_experts_per_tok;
        let mlp = |m: &Mlp| m.gate.nbytes() + m.up.nbytes() + m.down.nbytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn.bytes_per_step()
                    + match &l.ffn {
                        Ffn::Dense(m) => mlp(m),
                        Ffn::Moe {
                            router,
                            experts,
                            shared,
                            ..
                        } => {
                            router.nbytes()
                                + experts.first().map_or(0, mlp) * k
                                + shared.as_ref().map_or(0, mlp)
                        }
                    }
            })
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.embed).nbytes()
    }

    fn param_count(&self) -> usize {
        let n = |t: &Tensor| t.shape.iter().product::<usize>();
        let layers: usize = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Self::layer_mats(l).into_iter().map(n).sum::<usize>()
                    + Self::layer_vecs(i, l)
                        .iter()
                        .map(|(_, v)| v.len())
                        .sum::<usize>()
            })
            .sum();
        layers + n(&self.embed) + self.lm_head.as_ref().map_or(0, n) + self.norm.len()
    }

    fn patch_points(&self) -> &'static [Patch] {
        &[Patch::SplitkDecode, Patch::FastExp]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each derived value sits where the head's key/value split puts it:
    /// `kv_b` row `h·(nope+v) + i` is head `h`'s key row `i`, so column `c`
    /// of it is `k_absorb[h·latent + c][i]`; rows `h·(nope+v) + nope + j`
    /// are head `h`'s value rows, `v_up[h·v + j]`.
    #[test]
    fn kv_b_splits_into_the_transposed_key_and_the_value_blocks() {
        let mla = MlaShape {
            heads: 2,
            nope: 3,
            rope: 2,
            v: 2,
            latent: 4,
            interleave: true,
        };
        let per = mla.nope + mla.v;
        // Value encodes (row, col) so every slot is distinguishable.
        let kv_b: Vec<f32> = (0..mla.heads * per * mla.latent)
            .map(|x| (x / mla.latent * 100 + x % mla.latent) as f32)
            .collect();
        let (absorb, up) = split_kv_b(&kv_b, &mla);
        assert_eq!(absorb.len(), mla.heads * mla.latent * mla.nope);
        assert_eq!(up.len(), mla.heads * mla.v * mla.latent);
        for h in 0..mla.heads {
            for c in 0..mla.latent {
                for i in 0..mla.nope {
                    let row = h * per + i;
                    assert_eq!(
                        absorb[(h * mla.latent + c) * mla.nope + i],
                        (row * 100 + c) as f32
                    );
                }
            }
            for j in 0..mla.v {
                for c in 0..mla.latent {
                    let row = h * per + mla.nope + j;
                    assert_eq!(up[(h * mla.v + j) * mla.latent + c], (row * 100 + c) as f32);
                }
            }
        }
    }
}
