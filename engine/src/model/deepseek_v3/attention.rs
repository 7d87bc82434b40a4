//! The Multi-head Latent Attention block of a layer, as deepseek_v3 and
//! mini-v4 (deepseek_v3 plus the V4 additions) both load and program it:
//! the query (`q_a_proj` → `q_a_layernorm` → `q_b_proj`, or `q_proj` when
//! `q_lora_rank` is null), the compressed KV (`kv_a_proj_with_mqa`: the
//! latent and the shared RoPE key), [`Op::MlaAttend`] over the stored
//! latent rows, and `o_proj`.
//!
//! `kv_b_proj` is split at load into its per-head key part, transposed
//! (`k_absorb`, which multiplies the query), and its per-head value part
//! (`v_up`, which multiplies the attention output), both widened exactly
//! to f32; the identity lists `kv_b_proj` itself.
//!
//! Invariant: the block's ops are per row or per position (`exec/mla.rs`),
//! so what a token gets is a function of its sequence's tokens only.
//! A missing tensor or one of the wrong shape is an error naming it and
//! both shapes.

use crate::model::exec::{Buf, Builder, Mat, MatJob, MlaIndex, MlaShape, Op, Rows, Vector};
use crate::model::Device;
use crate::weights::{Tensor, TensorFile};
use crate::EngineError;

use super::{split_kv_b, LATENT_NORM_EPS};

/// How a layer makes its query.
enum QProj {
    /// `q_b_proj · norm(q_a_proj · x)`.
    Lora {
        a: Tensor,
        norm: Vec<f32>,
        b: Tensor,
    },
    /// `q_proj · x`.
    Plain(Tensor),
}

/// One layer's MLA weights.
pub struct MlaAttn {
    q: QProj,
    kv_a: Tensor,
    kv_norm: Vec<f32>,
    /// As stored (for the identity); the step reads the two parts below.
    kv_b: Tensor,
    /// `(heads · kv_lora_rank, qk_nope_head_dim)`: per head `W_kᵀ`.
    k_absorb: Tensor,
    /// `(heads · v_head_dim, kv_lora_rank)`: per head `W_v`.
    v_up: Tensor,
    o: Tensor,
}

/// Where a layer's MLA weights sit in a step's tables.
pub struct MlaSlots {
    kv_norm: Vector,
    /// `(q_a, its norm, q_b)` or the plain `q_proj`.
    q: Result<(Mat, Vector, Mat), Mat>,
    kv_a: Mat,
    k_absorb: Mat,
    v_up: Mat,
    o: Mat,
}

/// The step buffers an MLA block works in (one set for every layer).
pub struct MlaBufs {
    q_a: Buf,
    q_a_norm: Buf,
    q: Buf,
    ckv: Buf,
    att: Buf,
}

impl MlaBufs {
    /// Declares the buffers for `mla` with a query LoRA rank of `q_rank`
    /// (0 when the query is a plain projection).
    pub fn new(b: &mut Builder, mla: &MlaShape, q_rank: usize) -> Self {
        Self {
            q_a: b.buf("q_a", Rows::Tokens, q_rank),
            q_a_norm: b.buf("q_a_norm", Rows::Tokens, q_rank),
            q: b.buf("q", Rows::Tokens, mla.q_dim()),
            ckv: b.buf("compressed_kv", Rows::Tokens, mla.row()),
            att: b.buf("att", Rows::Tokens, mla.out_dim()),
        }
    }
}

impl MlaAttn {
    /// Loads the block under `a` (`model.layers.L.self_attn`) for a hidden
    /// size `d`, checking every shape.
    pub fn load(
        tf: &TensorFile,
        a: &str,
        mla: &MlaShape,
        d: usize,
        q_rank: Option<usize>,
    ) -> Result<Self, EngineError> {
        let vecf = |name: &str, n: usize| tf.get(name, &[n]).map(|t| t.to_f32_vec());
        let q = match q_rank {
            Some(r) => QProj::Lora {
                a: tf.get(&format!("{a}.q_a_proj.weight"), &[r, d])?,
                norm: vecf(&format!("{a}.q_a_layernorm.weight"), r)?,
                b: tf.get(&format!("{a}.q_b_proj.weight"), &[mla.q_dim(), r])?,
            },
            None => QProj::Plain(tf.get(&format!("{a}.q_proj.weight"), &[mla.q_dim(), d])?),
        };
        let kv_b = tf.get(
            &format!("{a}.kv_b_proj.weight"),
            &[mla.heads * (mla.nope + mla.v), mla.latent],
        )?;
        let (absorb, up) = split_kv_b(&kv_b.to_f32_vec(), mla);
        Ok(Self {
            q,
            kv_a: tf.get(&format!("{a}.kv_a_proj_with_mqa.weight"), &[mla.row(), d])?,
            kv_norm: vecf(&format!("{a}.kv_a_layernorm.weight"), mla.latent)?,
            k_absorb: Tensor::from_f32(
                format!("{a}.kv_b_proj.weight:k_absorb"),
                vec![mla.heads * mla.latent, mla.nope],
                absorb,
            ),
            v_up: Tensor::from_f32(
                format!("{a}.kv_b_proj.weight:v_up"),
                vec![mla.heads * mla.v, mla.latent],
                up,
            ),
            kv_b,
            o: tf.get(&format!("{a}.o_proj.weight"), &[d, mla.out_dim()])?,
        })
    }

    /// Appends the block's weights to a step's tables; where they sit.
    pub fn push<'a>(&'a self, mats: &mut Vec<&'a Tensor>, vecs: &mut Vec<&'a [f32]>) -> MlaSlots {
        let mut mat = |t: &'a Tensor| {
            mats.push(t);
            Mat(mats.len() as u32 - 1)
        };
        let mut vector = |v: &'a [f32]| {
            vecs.push(v);
            Vector(vecs.len() as u32 - 1)
        };
        let kv_norm = vector(&self.kv_norm);
        let q = match &self.q {
            QProj::Lora { a, norm, b } => Ok((mat(a), vector(norm), mat(b))),
            QProj::Plain(w) => Err(mat(w)),
        };
        let (kv_a, k_absorb, v_up, o) = (
            mat(&self.kv_a),
            mat(&self.k_absorb),
            mat(&self.v_up),
            mat(&self.o),
        );
        MlaSlots {
            kv_norm,
            q,
            kv_a,
            k_absorb,
            v_up,
            o,
        }
    }

    /// Every stored matrix (the identity's and the parameter count's:
    /// `kv_b_proj` as stored, not its two derived parts).
    pub fn mats(&self) -> Vec<&Tensor> {
        let mut out = match &self.q {
            QProj::Lora { a, b, .. } => vec![a, b],
            QProj::Plain(w) => vec![w],
        };
        out.extend([&self.kv_a, &self.kv_b, &self.o]);
        out
    }

    /// Every vector, by its HF name under `a` (`model.layers.L.self_attn`).
    pub fn vecs(&self, a: &str) -> Vec<(String, &[f32])> {
        let mut out = vec![(format!("{a}.kv_a_layernorm.weight"), &self.kv_norm[..])];
        if let QProj::Lora { norm, .. } = &self.q {
            out.push((format!("{a}.q_a_layernorm.weight"), &norm[..]));
        }
        out
    }

    /// Bytes a decode step reads: the matrices as the kernels read them
    /// (the derived `kv_b` parts, not `kv_b` itself).
    pub fn bytes_per_step(&self) -> usize {
        let q = match &self.q {
            QProj::Lora { a, b, .. } => a.nbytes() + b.nbytes(),
            QProj::Plain(w) => w.nbytes(),
        };
        q + self.kv_a.nbytes() + self.k_absorb.nbytes() + self.v_up.nbytes() + self.o.nbytes()
    }
}

/// Refuses, naming the family and the numbers, a latent row wider than the
/// CUDA portable attention kernel takes (the MLA families run there: the
/// resident executor has no latent-attention kernel).
pub fn fits_device(family: &str, mla: &MlaShape, device: &Device) -> Result<(), EngineError> {
    #[cfg(feature = "cuda")]
    if matches!(device, Device::Cuda(_)) && mla.row() > lmrr_kernels::cuda::ONE_THREAD_MAX_HEAD_DIM
    {
        return Err(EngineError::Device(format!(
            "{family} on CUDA: mla_attend attends over latent rows of {} floats \
             (kv_lora_rank {} + qk_rope_head_dim {}), wider than the portable attention \
             kernel's {}; run this model on the CPU",
            mla.row(),
            mla.latent,
            mla.rope,
            lmrr_kernels::cuda::ONE_THREAD_MAX_HEAD_DIM
        )));
    }
    let _ = (family, mla, device);
    Ok(())
}

/// The attention's lines of a config's identity text, in the order both
/// MLA families write them (`line(key, value)`).
pub fn config_lines(
    line: &mut dyn FnMut(&str, &dyn std::fmt::Display),
    q_lora_rank: Option<usize>,
    mla: &MlaShape,
) {
    line(
        "q_lora_rank",
        &q_lora_rank.map_or("none".into(), |r| r.to_string()),
    );
    line("kv_lora_rank", &mla.latent);
    line("qk_nope_head_dim", &mla.nope);
    line("qk_rope_head_dim", &mla.rope);
    line("v_head_dim", &mla.v);
    line("rope_interleave", &mla.interleave);
}

/// One layer's attention block, as [`MlaSlots::emit`] programs it.
pub struct MlaStep {
    pub layer: usize,
    pub mla: MlaShape,
    pub spec: crate::model::exec::AttnSpec,
    /// The indexer (mini-v4), whose projections are `index_jobs`.
    pub index: Option<MlaIndex>,
}

impl MlaSlots {
    /// The block on the normalised input `h` into `out` (`o_proj`'s
    /// output): the query and compressed-KV projections in one matmul op
    /// with `index_jobs` (the indexer's projections of `h`), the query
    /// LoRA's norm and up-projection, [`Op::MlaAttend`], `o_proj`.
    pub fn emit(
        &self,
        b: &mut Builder,
        bufs: &MlaBufs,
        h: Buf,
        index_jobs: Vec<MatJob>,
        at: MlaStep,
        out: Buf,
    ) {
        let job = |w: Mat, out: Buf| MatJob { w, out, bias: None };
        let first = match self.q {
            Ok((qa_w, _, _)) => job(qa_w, bufs.q_a),
            Err(q_w) => job(q_w, bufs.q),
        };
        let mut jobs = vec![first, job(self.kv_a, bufs.ckv)];
        jobs.extend(index_jobs);
        b.op(Op::Matmul { x: h, jobs });
        if let Ok((_, qn, qb_w)) = self.q {
            b.rms_norm(bufs.q_a, qn, LATENT_NORM_EPS, bufs.q_a_norm);
            b.matmul(bufs.q_a_norm, qb_w, bufs.q);
        }
        b.op(Op::MlaAttend {
            layer: at.layer,
            rope: 0,
            q: bufs.q,
            ckv: bufs.ckv,
            kv_norm: self.kv_norm,
            eps_bits: LATENT_NORM_EPS.to_bits(),
            k_absorb: self.k_absorb,
            v_up: self.v_up,
            out: bufs.att,
            mla: at.mla,
            spec: at.spec,
            index: at.index,
        });
        b.matmul(bufs.att, self.o, out);
    }
}
