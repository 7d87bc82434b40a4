//! The `gemma3_text` family: Gemma 3's decoder as one step program.
//!
//! Per layer: input norm → q/k/v → per-head q/k norms → RoPE (the local
//! table on sliding layers, the global one elsewhere) + KV write + attention
//! (over the sliding window on sliding layers, scale
//! `query_pre_attn_scalar^(−1/2)`) → o → post-attention norm → residual add;
//! pre-feedforward norm → gate/up → GeGLU (tanh GeLU) → down →
//! post-feedforward norm → residual add. The embedding rows are scaled by
//! `√hidden_size`; the head is the (unscaled) embedding when tied.
//!
//! Gemma's RMSNorm multiplies by `1 + w` in f32 (transformers'
//! `Gemma3RMSNorm`: `output * (1.0 + self.weight.float())`). The `1 + w` is
//! one f32 add of the same operands wherever it happens, so it is folded
//! into the stored vector at load, bit-identical to adding it per call; the
//! canonical RMSNorm then multiplies by it.
//!
//! The embedding scale is what `Gemma3TextScaledWordEmbedding` multiplies
//! by: `√hidden_size` as an f32 tensor cast to the embedding weight's dtype,
//! so rounded to bf16 for bf16 weights (and kept in f32 otherwise).
//!
//! Invariant: the program is a pure function of the config and the step's
//! shape; every op is a canonical kernel (`lmrr_kernels`), so a position's
//! logits do not depend on its batch-mates, chunking, page size or threads.
//! Design source: transformers' `modeling_gemma3.py`; issue 37 item 3.

pub mod config;

use lmrr_kernels::{AttnShape, RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::exec::{
    self, Act, AttnSpec, Buf, Builder, Mat, MatJob, Op, Program, Rows, Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{stored, vector, Device, Family, KvLayout, ModelFamily, NamedTensor, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::weights::{DType, Tensor, TensorFile};
use crate::{EngineError, ModelFiles};

pub use config::Gemma3Config;

/// The per-layer norms, in [`Tables`] order, with their HF names.
const NORMS: [&str; 6] = [
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_norm",
    "self_attn.k_norm",
];

struct Layer {
    /// [`NORMS`], each `1 + w` (see the module docs).
    norms: [Vec<f32>; 6],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// q, k, v, o biases when `attention_bias`.
    biases: Option<[Vec<f32>; 4]>,
}

/// A loaded `gemma3_text` model.
pub struct Gemma3 {
    cfg: Gemma3Config,
    embed: Tensor,
    lm_head: Option<Tensor>,
    /// The final norm, `1 + w`.
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope_local: RopeTable,
    rope_global: RopeTable,
    shape: AttnShape,
    embed_scale: f32,
    device: Device,
    /// Its programs, and on CUDA the resident executor.
    exec: exec::Executors,
}

/// `x` rounded to bf16 (nearest, ties to even), as an f32.
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// `1 + w`, elementwise in f32.
fn one_plus(w: Vec<f32>) -> Vec<f32> {
    w.into_iter().map(|x| 1.0 + x).collect()
}

impl Gemma3 {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = Gemma3Config::load(files)?;
        let tf = TensorFile::parse(files)?;
        let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
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
            let norm = |j: usize| {
                let n = if j < 4 { d } else { hd };
                vecf(&format!("{p}.{}.weight", NORMS[j]), n).map(one_plus)
            };
            let bias = |x: &str, n: usize| vecf(&format!("{p}.self_attn.{x}_proj.bias"), n);
            let biases = if cfg.attention_bias {
                Some([
                    bias("q", qd)?,
                    bias("k", kvd)?,
                    bias("v", kvd)?,
                    bias("o", d)?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                norms: [norm(0)?, norm(1)?, norm(2)?, norm(3)?, norm(4)?, norm(5)?],
                q: tf.get(&format!("{p}.self_attn.q_proj.weight"), &[qd, d])?,
                k: tf.get(&format!("{p}.self_attn.k_proj.weight"), &[kvd, d])?,
                v: tf.get(&format!("{p}.self_attn.v_proj.weight"), &[kvd, d])?,
                o: tf.get(&format!("{p}.self_attn.o_proj.weight"), &[d, qd])?,
                gate: tf.get(&format!("{p}.mlp.gate_proj.weight"), &[f, d])?,
                up: tf.get(&format!("{p}.mlp.up_proj.weight"), &[f, d])?,
                down: tf.get(&format!("{p}.mlp.down_proj.weight"), &[d, f])?,
                biases,
            });
        }
        let embed = tf.get("model.embed_tokens.weight", &[v, d])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(tf.get("lm_head.weight", &[v, d])?)
        };
        let norm = one_plus(vecf("model.norm.weight", d)?);
        // `torch.tensor(hidden_size ** 0.5)` is the f64 root rounded to f32.
        let scale = (d as f64).sqrt() as f32;
        let embed_scale = match embed.dtype {
            DType::Bf16 => round_bf16(scale),
            _ => scale,
        };
        let ctx = cfg.max_position_embeddings;
        let rope_local = cfg.rope_local.table(hd, ctx);
        let rope_global = cfg.rope_global.table(hd, ctx);
        Ok(Self {
            cfg,
            embed,
            lm_head,
            norm,
            layers,
            rope_local,
            rope_global,
            shape,
            embed_scale,
            device: Device::Cpu,
            exec: exec::Executors::default(),
        })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    /// The embedding scale the step multiplies by.
    pub fn embed_scale(&self) -> f32 {
        self.embed_scale
    }

    /// Matrices: embedding, head, then per layer q, k, v, o, gate, up, down.
    /// Vectors: the final norm, per layer its six norms ([`NORMS`]), then
    /// per layer its four biases when there are. RoPE: local, global.
    fn tables(&self) -> Tables<'_> {
        let mut mats = vec![&self.embed, self.lm_head.as_ref().unwrap_or(&self.embed)];
        let mut vecs = vec![&self.norm[..]];
        for l in &self.layers {
            mats.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
            vecs.extend(l.norms.iter().map(|v| &v[..]));
        }
        for l in &self.layers {
            if let Some(b) = &l.biases {
                vecs.extend(b.iter().map(|v| &v[..]));
            }
        }
        Tables {
            mats,
            vecs,
            ropes: vec![&self.rope_local, &self.rope_global],
        }
    }

    /// The step as a program over [`Self::tables`] (see the module docs).
    fn program(&self) -> Program {
        let cfg = &self.cfg;
        let (d, ff, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kvd) = (self.shape.q_dim(), self.shape.kv_dim());
        let eps = cfg.rms_norm_eps;
        let nl = self.layers.len() as u32;
        let mut b = Builder::default();
        let x = b.buf("x", Rows::Tokens, d);
        let h = b.buf("h", Rows::Tokens, d);
        let q_raw = b.buf("q_raw", Rows::Tokens, qd);
        let k_raw = b.buf("k_raw", Rows::Tokens, kvd);
        let q = b.buf("q", Rows::Tokens, qd);
        let k = b.buf("k", Rows::Tokens, kvd);
        let v = b.buf("v", Rows::Tokens, kvd);
        let att = b.buf("att", Rows::Tokens, qd);
        let o = b.buf("o", Rows::Tokens, d);
        let g = b.buf("gate", Rows::Tokens, ff);
        let u = b.buf("up", Rows::Tokens, ff);
        let a = b.buf("act", Rows::Tokens, ff);
        let hx = b.buf("last", Rows::Wanted, d);
        let hn = b.buf("last_norm", Rows::Wanted, d);
        let logits = b.buf("logits", Rows::Wanted, vocab);
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        b.op(Op::Scale {
            x,
            by_bits: self.embed_scale.to_bits(),
        });
        let mut spec = AttnSpec::canonical(self.shape);
        spec.scale_bits = cfg.attn_scale().to_bits();
        for (li, sliding) in cfg.sliding.iter().enumerate() {
            let (m0, v0) = (2 + 7 * li as u32, 1 + 6 * li as u32);
            let bias0 = 1 + 6 * nl + 4 * li as u32;
            let bias = |j: u32| cfg.attention_bias.then_some(Vector(bias0 + j));
            let job = |w: u32, out: Buf, bias: Option<Vector>| MatJob {
                w: Mat(w),
                out,
                bias,
            };
            b.rms_norm(x, Vector(v0), eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![
                    job(m0, q_raw, bias(0)),
                    job(m0 + 1, k_raw, bias(1)),
                    job(m0 + 2, v, bias(2)),
                ],
            });
            for (raw, w, out) in [(q_raw, v0 + 4, q), (k_raw, v0 + 5, k)] {
                b.op(Op::HeadRmsNorm {
                    x: raw,
                    w: Vector(w),
                    eps_bits: eps.to_bits(),
                    out,
                });
            }
            let mut spec = spec;
            spec.window = if *sliding {
                cfg.sliding_window.map(|w| w as u32)
            } else {
                None
            };
            b.op(Op::RopeKvAttend {
                layer: li,
                rope: if *sliding { 0 } else { 1 },
                q,
                k,
                v,
                out: att,
                spec,
            });
            b.op(Op::Matmul {
                x: att,
                jobs: vec![job(m0 + 3, o, bias(3))],
            });
            b.rms_norm(o, Vector(v0 + 1), eps, h);
            b.op(Op::AddInto { x, y: h });
            b.rms_norm(x, Vector(v0 + 2), eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(m0 + 4, g, None), job(m0 + 5, u, None)],
            });
            b.op(Op::Glu {
                gate: g,
                up: u,
                out: a,
                act: Act::GeluTanh,
            });
            b.matmul(a, Mat(m0 + 6), o);
            b.rms_norm(o, Vector(v0 + 3), eps, h);
            b.op(Op::AddInto { x, y: h });
        }
        b.op(Op::GatherWanted { x, out: hx });
        b.rms_norm(hx, Vector(0), eps, hn);
        b.matmul(hn, Mat(1), logits);
        b.finish(logits)
    }

    /// Every tensor the forward pass reads, by its HF name, with its values
    /// as the kernels see them: the norms as `1 + w` (folded at load).
    fn tensors(&self) -> Vec<NamedTensor<'_>> {
        let mut out = vec![
            stored(&self.embed),
            vector("model.norm.weight".into(), &self.norm),
        ];
        out.extend(self.lm_head.as_ref().map(stored));
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (name, v) in NORMS.iter().zip(&l.norms) {
                out.push(vector(format!("{p}.{name}.weight"), v));
            }
            out.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].map(stored));
            if let Some(b) = &l.biases {
                for (x, v) in ["q", "k", "v", "o"].iter().zip(b) {
                    out.push(vector(format!("{p}.self_attn.{x}_proj.bias"), v));
                }
            }
        }
        out
    }

    fn mats(l: &Layer) -> [&Tensor; 7] {
        [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
    }

    fn forward_in_pool(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let vocab = self.cfg.vocab_size;
        let ops = Ops {
            device: &self.device,
            threads,
            numerics: self.exec.numerics(),
        };
        let context = self.cfg.max_position_embeddings;
        exec::begin_step(&ops, kv, spans, context, vocab, &PatchSet::none())?;
        let tables = self.tables();
        let prog = self.exec.program(&PatchSet::none(), || self.program());
        self.exec
            .run(&ops, kv, spans, vocab, &prog, &tables, Default::default())
    }
}

impl ModelFamily for Gemma3 {
    fn family(&self) -> Family {
        Family::Gemma3Text
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// No engine patch acts here (the attention patches have no
    /// sliding-window form); the cache patches act in the scheduler.
    fn forward_patched(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        _patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        threads.install(|| self.forward_in_pool(kv, spans, threads))
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
        self.cfg.is_eos(id)
    }

    fn config_text(&self) -> String {
        let mut t = self.cfg.config_text();
        t += &format!("embed_scale=f32:{:08x}\n", self.embed_scale.to_bits());
        t
    }

    fn named_tensors(&self) -> Vec<NamedTensor<'_>> {
        self.tensors()
    }

    /// On CUDA the resident executor runs the program, its sliding-window
    /// and global layers alike.
    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        let mut exec = std::mem::take(&mut self.exec);
        let r = exec.set_device(&device, &self.tables());
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
            let tables = self.tables();
            let prog = self.exec.program(&none, || self.program());
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

    fn weight_bytes_per_step(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| Self::mats(l).iter().map(|t| t.nbytes()).sum::<usize>())
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.embed).nbytes()
    }

    fn param_count(&self) -> usize {
        let n = |t: &Tensor| t.shape.iter().product::<usize>();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                Self::mats(l).iter().map(|t| n(t)).sum::<usize>()
                    + l.norms.iter().map(Vec::len).sum::<usize>()
                    + l.biases
                        .as_ref()
                        .map_or(0, |b| b.iter().map(Vec::len).sum())
            })
            .sum();
        layers + n(&self.embed) + self.lm_head.as_ref().map_or(0, n) + self.norm.len()
    }

    fn patch_points(&self) -> &'static [Patch] {
        &[]
    }
}
