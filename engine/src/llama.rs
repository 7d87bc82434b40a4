//! The llama family forward pass (GQA, RoPE, SwiGLU, RMSNorm, tied or untied
//! embeddings) over a batch of (sequence, token span) entries.
//!
//! All tokens of all spans are stacked into one activation matrix `(n, hidden)`
//! so every matmul reads each weight row once per step. Per-token work (RoPE,
//! KV writes, attention) uses the token's own absolute position and sequence.
//! Each output element is computed by the same canonical instruction sequence
//! whatever the batch, so a span's logits do not depend on its batch-mates
//! (contract invariant I2) or on how its prompt was chunked (I3).

use lmrr_kernels::{self as k, AttnShape, AttnTask, RopeTable, Threads};

use crate::kv::{KvCache, SeqId};
use crate::patches::{Patch, PatchSet};
use crate::weights::{Tensor, TensorFile};
use crate::{EngineError, LlamaConfig, ModelFiles};
use lmrr_kernels::attention_variants::{attention_variant, ExpKind};

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

/// A tensor's values as the kernels see them: stored (f32, bf16 or GGUF
/// blocks, widened exactly on use), or already widened at load (norm weights).
pub enum TensorValues<'a> {
    Stored(&'a Tensor),
    F32(&'a [f32]),
}

/// Where the forward pass's kernels run. Every device gives the same bits
/// (contract invariant I6); the CUDA path copies operands per call (portable
/// mode, not a fast path) and runs no engine patch.
#[derive(Clone, Default)]
pub enum Device {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<lmrr_kernels::cuda::Gpu>),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => write!(f, "cuda ({})", g.name()),
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu_err(e: lmrr_kernels::cuda::GpuError) -> EngineError {
    EngineError::Device(e.to_string())
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
}

/// Which logits rows a span wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    /// The span's last position only.
    Last,
    /// Every position of the span.
    All,
}

/// One entry of a batch: `tokens` of sequence `seq` at positions
/// `start..start + tokens.len()`.
#[derive(Debug, Clone)]
pub struct SeqSpan<'a> {
    pub seq: SeqId,
    pub start: usize,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
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
        })
    }

    /// Every tensor the forward pass reads, by its HF name, with its shape and
    /// its values as the kernels see them (for [`crate::identity`]). A tied
    /// output head is the embedding, listed once.
    pub fn named_tensors(&self) -> Vec<(String, Vec<usize>, TensorValues<'_>)> {
        fn stored(t: &Tensor) -> (String, Vec<usize>, TensorValues<'_>) {
            (t.name.clone(), t.shape.clone(), TensorValues::Stored(t))
        }
        fn vector(name: String, v: &[f32]) -> (String, Vec<usize>, TensorValues<'_>) {
            (name, vec![v.len()], TensorValues::F32(v))
        }
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

    /// Runs the forward pass's kernels on `device` from now on.
    pub fn set_device(&mut self, device: Device) {
        self.device = device;
    }

    /// Where the kernels run.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn matmuls(
        &self,
        threads: &Threads,
        x: &[f32],
        n: usize,
        jobs: &mut [(&k::Matrix, &mut [f32])],
    ) -> Result<(), EngineError> {
        match &self.device {
            Device::Cpu => k::matmul_many(threads, x, n, jobs),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => {
                for (w, y) in jobs.iter_mut() {
                    g.matmul(x, n, w, y).map_err(gpu_err)?;
                }
            }
        }
        Ok(())
    }

    fn norm(&self, x: &[f32], w: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        let eps = self.cfg.rms_norm_eps;
        match &self.device {
            Device::Cpu => k::rms_norm(x, w, eps, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.rms_norm(x, w, eps, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    fn rope_row(&self, x: &mut [f32], pos: usize) -> Result<(), EngineError> {
        match &self.device {
            Device::Cpu => k::rope(&self.rope, x, pos),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.rope(&self.rope, x, pos).map_err(gpu_err)?,
        }
        Ok(())
    }

    fn swiglu(&self, g_: &[f32], u: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        match &self.device {
            Device::Cpu => k::swiglu(g_, u, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.swiglu(g_, u, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    fn attend(
        &self,
        threads: &Threads,
        tasks: &[AttnTask],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match &self.device {
            Device::Cpu => k::attention(threads, tasks, &self.shape, scale, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g
                .attention(tasks, &self.shape, scale, out)
                .map_err(gpu_err)?,
        }
        Ok(())
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn attn_shape(&self) -> AttnShape {
        self.shape
    }

    /// Maximum positions per sequence.
    pub fn context(&self) -> usize {
        self.cfg.max_position_embeddings
    }

    /// Bytes of weights a decode step streams (every matrix once, norms aside).
    pub fn weight_bytes_per_step(&self) -> usize {
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
    pub fn param_count(&self) -> usize {
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

    /// Runs one step over `spans`, writing their K/V into `kv`. Returns, per
    /// span, its wanted logits rows concatenated (`rows × vocab`).
    pub fn forward(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        self.forward_patched(kv, spans, threads, &PatchSet::none())
    }

    /// [`Self::forward`] with engine patches applied (`splitk-decode`,
    /// `fast-exp` act here; the cache patches act in the scheduler).
    pub fn forward_patched(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        threads.install(|| self.forward_in_pool(kv, spans, threads, patches))
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
        // Validate everything before touching the KV store.
        let engine_patch =
            patches.contains(Patch::FastExp) || patches.contains(Patch::SplitkDecode);
        if engine_patch && !matches!(self.device, Device::Cpu) {
            return Err(EngineError::Device(
                "the engine patches fast-exp and splitk-decode run on the CPU only; drop them or use the CPU".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for s in spans {
            if !seen.insert(s.seq) {
                return Err(EngineError::DuplicateSeq { seq: s.seq });
            }
            let held = kv.len(s.seq);
            if s.start != held {
                return Err(EngineError::KvPosition {
                    seq: s.seq,
                    start: s.start,
                    held,
                });
            }
            if s.start + s.tokens.len() > self.context() {
                return Err(EngineError::ContextOverflow {
                    seq: s.seq,
                    pos: s.start + s.tokens.len() - 1,
                    context: self.context(),
                });
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::TokenOutOfRange { token: t, vocab });
            }
        }
        for s in spans {
            kv.prepare(s.seq, s.start, s.tokens.len())?;
        }
        // Token i of the stacked batch: (span index, absolute position).
        let tok: Vec<(usize, usize)> = spans
            .iter()
            .enumerate()
            .flat_map(|(si, s)| (0..s.tokens.len()).map(move |j| (si, s.start + j)))
            .collect();
        let n = tok.len();
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
        // Patched attention: split-K follows the number of decoding sequences.
        let decoding = spans
            .iter()
            .filter(|s| s.tokens.len() == 1 && s.start > 0)
            .count();
        let split_of: Vec<usize> = spans
            .iter()
            .map(|s| {
                if patches.contains(Patch::SplitkDecode) && s.tokens.len() == 1 && s.start > 0 {
                    decoding.min(4)
                } else {
                    1
                }
            })
            .collect();
        let variant =
            (patches.contains(Patch::FastExp) || split_of.iter().any(|&s| s > 1)).then_some(());

        for (li, l) in self.layers.iter().enumerate() {
            // Attention block.
            self.norm(&sc.x, &l.attn_norm, &mut sc.h)?;
            let (wq, wk, wv) = (l.q.matrix(), l.k.matrix(), l.v.matrix());
            self.matmuls(
                threads,
                &sc.h,
                n,
                &mut [(&wq, &mut sc.q), (&wk, &mut sc.k), (&wv, &mut sc.v)],
            )?;
            for (i, &(si, pos)) in tok.iter().enumerate() {
                self.rope_row(&mut sc.q[i * qd..(i + 1) * qd], pos)?;
                self.rope_row(&mut sc.k[i * kvd..(i + 1) * kvd], pos)?;
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
                if variant.is_some() {
                    let splits: Vec<usize> = tok.iter().map(|&(si, _)| split_of[si]).collect();
                    let exp = if patches.contains(Patch::FastExp) {
                        ExpKind::Fast
                    } else {
                        ExpKind::Det
                    };
                    attention_variant(
                        threads,
                        &tasks,
                        &splits,
                        &self.shape,
                        scale,
                        exp,
                        &mut sc.att,
                    );
                } else {
                    self.attend(threads, &tasks, scale, &mut sc.att)?;
                }
            }
            self.matmuls(threads, &sc.att, n, &mut [(&l.o.matrix(), &mut sc.o)])?;
            add_into(&mut sc.x, &sc.o);
            // MLP block.
            self.norm(&sc.x, &l.mlp_norm, &mut sc.h)?;
            let (wg, wu) = (l.gate.matrix(), l.up.matrix());
            self.matmuls(threads, &sc.h, n, &mut [(&wg, &mut sc.g), (&wu, &mut sc.u)])?;
            self.swiglu(&sc.g, &sc.u, &mut sc.a)?;
            self.matmuls(threads, &sc.a, n, &mut [(&l.down.matrix(), &mut sc.o)])?;
            add_into(&mut sc.x, &sc.o);
        }
        // Logits for the wanted rows only.
        let mut rows = Vec::new();
        let mut i0 = 0;
        for s in spans {
            let len = s.tokens.len();
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => rows.extend(len.checked_sub(1).map(|j| i0 + j)),
                LogitsWanted::All => rows.extend(i0..i0 + len),
            }
            i0 += len;
        }
        let m = rows.len();
        let mut hx = vec![0.0; m * d];
        for (j, &i) in rows.iter().enumerate() {
            hx[j * d..(j + 1) * d].copy_from_slice(&sc.x[i * d..(i + 1) * d]);
        }
        let mut hn = vec![0.0; m * d];
        self.norm(&hx, &self.norm, &mut hn)?;
        let mut logits = vec![0.0; m * vocab];
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.matmuls(threads, &hn, m, &mut [(&head.matrix(), &mut logits)])?;
        // Split back per span.
        let mut out = Vec::with_capacity(spans.len());
        let mut r0 = 0;
        for s in spans {
            let cnt = match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => usize::from(!s.tokens.is_empty()),
                LogitsWanted::All => s.tokens.len(),
            };
            out.push(logits[r0 * vocab..(r0 + cnt) * vocab].to_vec());
            r0 += cnt;
        }
        Ok(out)
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
