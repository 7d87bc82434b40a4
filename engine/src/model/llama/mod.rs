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

use lmrr_kernels::{AttnShape, AttnTask, RopeTable, Threads};

use crate::kv::KvCache;
use crate::model::ops::Ops;
use crate::model::{
    add_into, check_spans, split_rows, stacked_tokens, stored, vector, wanted_rows, Device, Family,
    KvLayout, ModelFamily, NamedTensor, SeqSpan,
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

/// Per-step scratch, `(n, width)` each.
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    a: Vec<f32>,
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
        let cfg = &self.cfg;
        let (d, ff, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kvd) = (self.shape.q_dim(), self.shape.kv_dim());
        let eps = cfg.rms_norm_eps;
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
        let tok = stacked_tokens(spans);
        let n = tok.len();
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            if n == 0 {
                return Ok(split_rows(spans, &[], vocab, threads));
            }
            let rows = wanted_rows(spans);
            return r.forward(self, kv, spans, &tok, &rows, threads);
        }
        let mut sc = Scratch {
            x: vec![0.0; n * d],
            h: vec![0.0; n * d],
            q: vec![0.0; n * qd],
            k: vec![0.0; n * kvd],
            v: vec![0.0; n * kvd],
            att: vec![0.0; n * qd],
            o: vec![0.0; n * d],
            g: vec![0.0; n * ff],
            u: vec![0.0; n * ff],
            a: vec![0.0; n * ff],
        };
        for (i, &t) in spans.iter().flat_map(|s| s.tokens).enumerate() {
            self.embed
                .row_into(t as usize, &mut sc.x[i * d..(i + 1) * d]);
        }
        let scale = 1.0 / (self.shape.head_dim as f32).sqrt();

        for (li, l) in self.layers.iter().enumerate() {
            // Attention block.
            ops.norm(&sc.x, &l.attn_norm, eps, &mut sc.h)?;
            let (wq, wk, wv) = (l.q.matrix(), l.k.matrix(), l.v.matrix());
            ops.matmuls(
                &sc.h,
                n,
                &mut [(&wq, &mut sc.q), (&wk, &mut sc.k), (&wv, &mut sc.v)],
            )?;
            for (i, &(si, pos)) in tok.iter().enumerate() {
                ops.rope_row(&self.rope, &mut sc.q[i * qd..(i + 1) * qd], pos)?;
                ops.rope_row(&self.rope, &mut sc.k[i * kvd..(i + 1) * kvd], pos)?;
                let r = i * kvd..(i + 1) * kvd;
                kv.write(spans[si].seq, li, pos, &sc.k[r.clone()], &sc.v[r]);
            }
            {
                let views: Vec<_> = spans.iter().map(|s| kv.view(s.seq, li)).collect();
                let tasks: Vec<AttnTask> = tok
                    .iter()
                    .enumerate()
                    .map(|(i, &(si, pos))| AttnTask {
                        q: &sc.q[i * qd..(i + 1) * qd],
                        kv: &views[si],
                        pos,
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
            add_into(&mut sc.x, &sc.o);
            // MLP block.
            ops.norm(&sc.x, &l.mlp_norm, eps, &mut sc.h)?;
            let (wg, wu) = (l.gate.matrix(), l.up.matrix());
            ops.matmuls(&sc.h, n, &mut [(&wg, &mut sc.g), (&wu, &mut sc.u)])?;
            ops.swiglu(&sc.g, &sc.u, &mut sc.a)?;
            ops.matmuls(&sc.a, n, &mut [(&l.down.matrix(), &mut sc.o)])?;
            add_into(&mut sc.x, &sc.o);
        }
        // Logits for the wanted rows only.
        let rows = wanted_rows(spans);
        let m = rows.len();
        let mut hx = vec![0.0; m * d];
        for (j, &i) in rows.iter().enumerate() {
            hx[j * d..(j + 1) * d].copy_from_slice(&sc.x[i * d..(i + 1) * d]);
        }
        let mut hn = vec![0.0; m * d];
        ops.norm(&hx, &self.norm, eps, &mut hn)?;
        let mut logits = vec![0.0; m * vocab];
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        ops.matmuls(&hn, m, &mut [(&head.matrix(), &mut logits)])?;
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
