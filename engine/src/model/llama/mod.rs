//! The llama family forward pass (GQA, RoPE, SwiGLU, RMSNorm, tied or untied
//! embeddings) over a batch of (sequence, token span) entries.
//!
//! All tokens of all spans are stacked into one activation matrix `(n, hidden)`
//! so every matmul reads each weight row once per step. Per-token work (RoPE,
//! KV writes, attention) uses the token's own absolute position and sequence.
//! Each output element is computed by the same canonical instruction sequence
//! whatever the batch, so a span's logits do not depend on its batch-mates
//! (contract invariant I2) or on how its prompt was chunked (I3).

pub mod config;
#[cfg(feature = "cuda")]
mod cuda;

/// Where one timed resident step's wall time went (measurement:
/// [`Llama::set_cuda_step_timing`]), seconds. The host parts are the
/// calling thread's clock; `kernels` and `copies` are the device's, by
/// events recorded before the step's first launch, after its last, and
/// after the downloads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepSplit {
    /// The step's kernels on the device, first launch to last.
    pub kernels: f64,
    /// The downloads (logits and K/V rows) on the device after them.
    pub copies: f64,
    /// Host work before the first launch (page checks, the inputs' upload).
    pub before: f64,
    /// The launch calls themselves (a graph, or every kernel).
    pub launch: f64,
    /// From the last launch call's return until the downloads are done.
    pub wait: f64,
    /// Host work after the downloads (the K/V rows into the host store, the
    /// logits rows handed out).
    pub after: f64,
}

use lmrr_kernels::{AttnShape, RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::exec::{
    self, Act, AttnSpec, Buf, Builder, Mat, MatJob, Op, Program, Rows, Step, Tables, Vector,
};
use crate::model::ops::Ops;
use crate::model::{
    check_spans, split_rows, stored, vector, Device, Family, KvLayout, ModelFamily, NamedTensor,
    SeqSpan,
};
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
}

/// A loaded llama-family model.
pub struct Llama {
    cfg: LlamaConfig,
    embed: Tensor,
    /// `None` when tied to `embed`.
    lm_head: Option<Tensor>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: RopeTable,
    shape: AttnShape,
    device: Device,
    /// Weights and KV pages on the device, when `device` is CUDA.
    #[cfg(feature = "cuda")]
    resident: Option<cuda::Resident>,
}

impl Llama {
    /// Loads and checks every tensor against the config.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let cfg = LlamaConfig::parse(&files.config, &files.config_path)?;
        let tf = TensorFile::parse(files)?;
        let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let shape = AttnShape {
            n_heads: cfg.num_attention_heads,
            n_kv_heads: cfg.n_kv_heads(),
            head_dim: cfg.head_dim(),
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
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
        Ok(Self {
            cfg,
            embed,
            lm_head,
            norm,
            layers,
            rope,
            shape,
            device: Device::Cpu,
            #[cfg(feature = "cuda")]
            resident: None,
        })
    }

    /// What the step programs name by index: matrices (embedding, head, then
    /// per layer q, k, v, o, gate, up, down), vectors (final norm, then per
    /// layer the two norms) and the one RoPE table.
    fn tables(&self) -> Tables<'_> {
        let mut mats = vec![&self.embed, self.lm_head.as_ref().unwrap_or(&self.embed)];
        let mut vecs = vec![&self.norm[..]];
        for l in &self.layers {
            mats.extend([&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]);
            vecs.extend([&l.attn_norm[..], &l.mlp_norm[..]]);
        }
        Tables {
            mats,
            vecs,
            ropes: vec![&self.rope],
        }
    }

    /// The step as a program over [`Self::tables`]: per layer, norm → q/k/v →
    /// RoPE + KV write + attention → o + residual → norm → gate/up → SwiGLU →
    /// down + residual; then the wanted rows' final norm and head. Patch
    /// points (`splitk-decode`, `fast-exp`) pick the attention variant.
    fn program(&self, patches: &PatchSet) -> Program {
        let cfg = &self.cfg;
        let (d, ff, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
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
        let v = b.buf("v", Rows::Tokens, kvd);
        let att = b.buf("att", Rows::Tokens, qd);
        let o = b.buf("o", Rows::Tokens, d);
        let g = b.buf("gate", Rows::Tokens, ff);
        let u = b.buf("up", Rows::Tokens, ff);
        let a = b.buf("act", Rows::Tokens, ff);
        let hx = b.buf("last", Rows::Wanted, d);
        let hn = b.buf("last_norm", Rows::Wanted, d);
        let logits = b.buf("logits", Rows::Wanted, vocab);
        let job = |w: u32, out: Buf| MatJob {
            w: Mat(w),
            out,
            bias: None,
        };
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        for li in 0..self.layers.len() {
            let (m0, v0) = (2 + 7 * li as u32, 1 + 2 * li as u32);
            b.rms_norm(x, Vector(v0), eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(m0, q), job(m0 + 1, k), job(m0 + 2, v)],
            });
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
            b.rms_norm(x, Vector(v0 + 1), eps, h);
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(m0 + 4, g), job(m0 + 5, u)],
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
        }
        out
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Turns the resident path's decode-step CUDA graphs on or off (a
    /// measurement switch: the bits are the same either way); nothing off
    /// the device.
    pub fn set_cuda_graphs(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.set_graphs(on);
        }
        let _ = on;
    }

    /// Measurement switch of the resident path: while on, each step's
    /// kernels are timed on the device by events around them
    /// ([`Llama::take_cuda_step_device`]); nothing off the device.
    pub fn set_cuda_step_timing(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.set_step_timing(on);
        }
        let _ = on;
    }

    /// Each step timed since the last call (empty off the device or while
    /// timing is off).
    pub fn take_cuda_step_device(&self) -> Vec<StepSplit> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            return r.take_step_device();
        }
        Vec::new()
    }

    /// On the resident path: KV pages held on the device, and pages
    /// uploaded to it so far.
    pub fn device_stats(&self) -> Option<(usize, u64)> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            return Some(r.kv_stats());
        }
        None
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
        };
        // Validate everything before touching the KV store.
        ops.check_patches(patches)?;
        check_spans(kv, spans, self.cfg.max_position_embeddings, vocab)?;
        for s in spans {
            kv.prepare(s.seq, s.start, s.tokens.len())?;
        }
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            let tok = crate::model::stacked_tokens(spans);
            if tok.is_empty() {
                return Ok(split_rows(spans, &[], vocab, threads));
            }
            let rows = crate::model::wanted_rows(spans);
            return r.forward(self, kv, spans, &tok, &rows, threads);
        }
        let step = Step::new(spans);
        let prog = self.program(patches);
        let logits = exec::host::run(&prog, &self.tables(), &step, kv, &ops)?;
        Ok(split_rows(spans, &logits, vocab, threads))
    }
}

impl ModelFamily for Llama {
    fn family(&self) -> Family {
        Family::Llama
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
        crate::identity::config_text(&self.cfg)
    }

    fn named_tensors(&self) -> Vec<NamedTensor<'_>> {
        self.tensors()
    }

    fn set_device(&mut self, device: Device) -> Result<(), EngineError> {
        #[cfg(feature = "cuda")]
        {
            self.resident = None;
            if let Device::Cuda(g) = &device {
                self.resident = Some(cuda::Resident::new(g.clone(), self)?);
            }
        }
        self.device = device;
        Ok(())
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes()
    }

    fn param_count(&self) -> usize {
        self.params()
    }

    fn patch_points(&self) -> &'static [Patch] {
        &[Patch::SplitkDecode, Patch::FastExp]
    }

    /// On the CUDA resident path with `LMRR_CUDA_PROFILE=1`: the step's
    /// parts, each synchronized and timed.
    fn profile(&self) -> Vec<(&'static str, f64)> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            return r.profile();
        }
        Vec::new()
    }

    fn reset_profile(&self) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.reset_profile();
        }
    }
}
