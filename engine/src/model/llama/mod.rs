//! The llama family forward pass (GQA, RoPE, SwiGLU, RMSNorm, tied or untied
//! embeddings) over a batch of (sequence, token span) entries, and its
//! variants `qwen2` (q/k/v biases), `qwen3` (per-head q/k norms) and
//! `mistral` (sliding-window attention): one step program, the variant's ops
//! added where its config asks ([`variant`]).
//!
//! All tokens of all spans are stacked into one activation matrix `(n, hidden)`
//! so every matmul reads each weight row once per step. Per-token work (RoPE,
//! KV writes, attention) uses the token's own absolute position and sequence.
//! Each output element is computed by the same canonical instruction sequence
//! whatever the batch, so a span's logits do not depend on its batch-mates
//! (contract invariant I2) or on how its prompt was chunked (I3).

pub mod config;
pub mod variant;

pub use variant::Variant;

pub use crate::model::exec::StepSplit;

use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::{AttnShape, RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::exec::{
    self, Act, AttnSpec, Buf, Builder, Mat, MatJob, Op, Program, Rows, Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{stored, vector, Device, Family, KvLayout, ModelFamily, NamedTensor, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, LlamaConfig, ModelFiles};

struct Layer {
    attn_norm: Vec<f32>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    mlp_norm: Vec<f32>,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    /// The variant's vectors (`None` where it has none): projection biases,
    /// per-head q/k norm weights.
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

impl Layer {
    /// The variant's vectors with their HF names (after the layer prefix).
    fn extras(&self) -> [(&'static str, Option<&Vec<f32>>); 6] {
        [
            ("self_attn.q_proj.bias", self.q_bias.as_ref()),
            ("self_attn.k_proj.bias", self.k_bias.as_ref()),
            ("self_attn.v_proj.bias", self.v_bias.as_ref()),
            ("self_attn.o_proj.bias", self.o_bias.as_ref()),
            ("self_attn.q_norm.weight", self.q_norm.as_ref()),
            ("self_attn.k_norm.weight", self.k_norm.as_ref()),
        ]
    }
}

/// Where one layer's operands sit in [`Tables`]: its first matrix (q, then
/// k, v, o, gate, up, down), its two norms, and the variant's vectors.
struct Slots {
    m0: u32,
    attn_norm: Vector,
    mlp_norm: Vector,
    q_bias: Option<Vector>,
    k_bias: Option<Vector>,
    v_bias: Option<Vector>,
    o_bias: Option<Vector>,
    q_norm: Option<Vector>,
    k_norm: Option<Vector>,
}

/// A loaded llama-family model.
pub struct Llama {
    cfg: LlamaConfig,
    variant: Variant,
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

impl Llama {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let mut cfg = LlamaConfig::load(files)?;
        let json: serde_json::Value = config::parse_json(&files.config, &files.config_path)?;
        let variant = Variant::from_config(&json, &files.config_path, &mut cfg)?;
        let tf = TensorFile::parse(files)?;
        let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.n_kv_heads(),
            head_dim: cfg.head_dim(),
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
        let opt = |on: bool, name: String, n: usize| on.then(|| vecf(&name, n)).transpose();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: vecf(&format!("{p}.input_layernorm.weight"), d)?,
                q: tf.get(&format!("{p}.self_attn.q_proj.weight"), &[qd, d])?,
                k: tf.get(&format!("{p}.self_attn.k_proj.weight"), &[kvd, d])?,
                v: tf.get(&format!("{p}.self_attn.v_proj.weight"), &[kvd, d])?,
                o: tf.get(&format!("{p}.self_attn.o_proj.weight"), &[d, qd])?,
                mlp_norm: vecf(&format!("{p}.post_attention_layernorm.weight"), d)?,
                gate: tf.get(&format!("{p}.mlp.gate_proj.weight"), &[f, d])?,
                up: tf.get(&format!("{p}.mlp.up_proj.weight"), &[f, d])?,
                down: tf.get(&format!("{p}.mlp.down_proj.weight"), &[d, f])?,
                q_bias: opt(variant.qkv_bias, format!("{p}.self_attn.q_proj.bias"), qd)?,
                k_bias: opt(variant.qkv_bias, format!("{p}.self_attn.k_proj.bias"), kvd)?,
                v_bias: opt(variant.qkv_bias, format!("{p}.self_attn.v_proj.bias"), kvd)?,
                o_bias: opt(variant.o_bias, format!("{p}.self_attn.o_proj.bias"), d)?,
                q_norm: opt(
                    variant.qk_norm,
                    format!("{p}.self_attn.q_norm.weight"),
                    shape.head_dim,
                )?,
                k_norm: opt(
                    variant.qk_norm,
                    format!("{p}.self_attn.k_norm.weight"),
                    shape.head_dim,
                )?,
            });
        }
        let embed = tf.get("model.embed_tokens.weight", &[v, d])?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(tf.get("lm_head.weight", &[v, d])?)
        };
        let norm = vecf("model.norm.weight", d)?;
        let rope = cfg.rope_table()?;
        Ok(Self {
            cfg,
            variant,
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

    /// What the step programs name by index: matrices (embedding, head, then
    /// per layer q, k, v, o, gate, up, down), vectors (final norm, then per
    /// layer the two norms, then the variant's vectors of every layer) and
    /// the one RoPE table; and where each layer's operands sit.
    fn tables(&self) -> (Tables<'_>, Vec<Slots>) {
        let mut mats = vec![&self.embed, self.lm_head.as_ref().unwrap_or(&self.embed)];
        let mut vecs = vec![&self.norm[..]];
        let mut slots = Vec::with_capacity(self.layers.len());
        for (li, l) in self.layers.iter().enumerate() {
            mats.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
            vecs.extend([&l.attn_norm[..], &l.mlp_norm[..]]);
            let v0 = 1 + 2 * li as u32;
            slots.push(Slots {
                m0: 2 + 7 * li as u32,
                attn_norm: Vector(v0),
                mlp_norm: Vector(v0 + 1),
                q_bias: None,
                k_bias: None,
                v_bias: None,
                o_bias: None,
                q_norm: None,
                k_norm: None,
            });
        }
        for (l, s) in self.layers.iter().zip(&mut slots) {
            let places = [
                &mut s.q_bias,
                &mut s.k_bias,
                &mut s.v_bias,
                &mut s.o_bias,
                &mut s.q_norm,
                &mut s.k_norm,
            ];
            for (place, (_, v)) in places.into_iter().zip(l.extras()) {
                if let Some(v) = v {
                    vecs.push(&v[..]);
                    *place = Some(Vector(vecs.len() as u32 - 1));
                }
            }
        }
        let tables = Tables {
            mats,
            vecs,
            ropes: vec![&self.rope],
        };
        (tables, slots)
    }

    /// The step as a program over [`Self::tables`]: per layer, norm → q/k/v →
    /// RoPE + KV write + attention → o + residual → norm → gate/up → SwiGLU →
    /// down + residual; then the wanted rows' final norm and head. Patch
    /// points (`splitk-decode`, `fast-exp`) pick the attention variant. The
    /// model's variant adds its biases to the projections, its per-head q/k
    /// norms before RoPE, and its window to the attention.
    fn program(&self, slots: &[Slots], patches: &PatchSet) -> Program {
        let cfg = &self.cfg;
        let (d, ff, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kvd) = (self.shape.q_dim(), self.shape.kv_dim());
        let eps = cfg.rms_norm_eps;
        let mut spec = AttnSpec::canonical(self.shape);
        // A windowed model has no patch points: the patches are inert there.
        let full = self.variant.window.is_none();
        spec.fast_exp = full && patches.contains(Patch::FastExp);
        spec.splitk_decode = full && patches.contains(Patch::SplitkDecode);
        spec.window = self.variant.window.map(|w| w as u32);
        let mut b = Builder::default();
        let x = b.buf("x", Rows::Tokens, d);
        let h = b.buf("h", Rows::Tokens, d);
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
        // The projections' outputs before the per-head norms, when there are.
        let (q_raw, k_raw) = if self.variant.qk_norm {
            (
                b.buf("q_raw", Rows::Tokens, qd),
                b.buf("k_raw", Rows::Tokens, kvd),
            )
        } else {
            (q, k)
        };
        let job = |w: u32, out: Buf, bias: Option<Vector>| MatJob {
            w: Mat(w),
            out,
            bias,
        };
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        for (li, sl) in slots.iter().enumerate() {
            let m0 = sl.m0;
            b.rms_norm(x, sl.attn_norm, eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![
                    job(m0, q_raw, sl.q_bias),
                    job(m0 + 1, k_raw, sl.k_bias),
                    job(m0 + 2, v, sl.v_bias),
                ],
            });
            if let (Some(qn), Some(kn)) = (sl.q_norm, sl.k_norm) {
                for (raw, w, out) in [(q_raw, qn, q), (k_raw, kn, k)] {
                    b.op(Op::HeadRmsNorm {
                        x: raw,
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
            b.op(Op::Matmul {
                x: att,
                jobs: vec![job(m0 + 3, o, sl.o_bias)],
            });
            b.op(Op::AddInto { x, y: o });
            b.rms_norm(x, sl.mlp_norm, eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(m0 + 4, g, None), job(m0 + 5, u, None)],
            });
            b.op(Op::Glu {
                gate: g,
                up: u,
                out: a,
                act: Act::Silu,
            });
            b.matmul(a, Mat(m0 + 6), o);
            b.op(Op::AddInto { x, y: o });
        }
        b.op(Op::GatherWanted { x, out: hx });
        b.rms_norm(hx, Vector(0), eps, hn);
        b.matmul(hn, Mat(1), logits);
        b.finish(logits)
    }

    /// Every tensor the forward pass reads, by its HF name, with its shape and
    /// its values as the kernels see them (for [`crate::identity`]). A tied
    /// output head is the embedding, listed once.
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
            out.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].map(stored));
            for (name, v) in l.extras() {
                out.extend(v.map(|v| vector(format!("{p}.{name}"), v)));
            }
        }
        out
    }

    /// The variant this model is (plain llama, qwen2, qwen3, mistral).
    pub fn variant(&self) -> &Variant {
        &self.variant
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Turns the resident path's decode-step CUDA graphs on or off (a
    /// measurement switch: the bits are the same either way); nothing off
    /// the device.
    pub fn set_cuda_graphs(&self, on: bool) {
        self.exec.set_graphs(on);
    }

    /// Measurement switch of the resident path: while on, each step's
    /// kernels are timed on the device by events around them
    /// ([`Llama::take_cuda_step_device`]); nothing off the device.
    pub fn set_cuda_step_timing(&self, on: bool) {
        self.exec.set_step_timing(on);
    }

    /// Each step timed since the last call (empty off the device or while
    /// timing is off).
    pub fn take_cuda_step_device(&self) -> Vec<StepSplit> {
        self.exec.take_step_device()
    }

    /// On the resident path: KV pages held on the device, and pages
    /// uploaded to it so far.
    pub fn device_stats(&self) -> Option<(usize, u64)> {
        self.exec.device_stats()
    }

    pub fn attn_shape(&self) -> AttnShape {
        self.shape
    }

    /// Bytes of weights a decode step streams (every matrix once, norms aside).
    fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .map(|t| t.nbytes())
                    .sum::<usize>()
            })
            .sum();
        layers + self.lm_head.as_ref().unwrap_or(&self.embed).nbytes()
    }

    /// Parameter count.
    fn params(&self) -> usize {
        let d = self.cfg.hidden_size;
        let mats: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .map(|t| t.shape.iter().product::<usize>())
                    .sum::<usize>()
                    + 2 * d
                    + l.extras()
                        .iter()
                        .map(|(_, v)| v.map_or(0, |v| v.len()))
                        .sum::<usize>()
            })
            .sum();
        mats + self.embed.shape.iter().product::<usize>()
            + self
                .lm_head
                .as_ref()
                .map_or(0, |t| t.shape.iter().product())
            + d
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

impl ModelFamily for Llama {
    fn family(&self) -> Family {
        self.variant.family
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Engine patches `splitk-decode` and `fast-exp` act here; the cache
    /// patches act in the scheduler.
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
        self.cfg.is_eos(id)
    }

    fn config_text(&self) -> String {
        crate::identity::config_text(&self.cfg) + &self.variant.config_text()
    }

    fn named_tensors(&self) -> Vec<NamedTensor<'_>> {
        self.tensors()
    }

    /// On CUDA every variant (mistral's sliding window included) runs on
    /// the resident executor.
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

    fn numerics(&self) -> Numerics {
        self.exec.numerics()
    }

    /// The tensor-core mode needs every matrix stored as bf16.
    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        let mut exec = std::mem::take(&mut self.exec);
        let r = exec.set_numerics(numerics, &self.tables().0);
        self.exec = exec;
        r
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

    fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes()
    }

    fn param_count(&self) -> usize {
        self.params()
    }

    /// The attention patches have no sliding-window form: a windowed model
    /// has none.
    fn patch_points(&self) -> &'static [Patch] {
        if self.variant.window.is_some() {
            &[]
        } else {
            &[Patch::SplitkDecode, Patch::FastExp]
        }
    }

    /// On the CUDA resident path with `LMRR_CUDA_PROFILE=1`: the step's
    /// parts, each synchronized and timed.
    fn profile(&self) -> Vec<(&'static str, f64)> {
        self.exec.profile(&Default::default())
    }

    fn reset_profile(&self) {
        self.exec.reset_profile(&Default::default());
    }
}
