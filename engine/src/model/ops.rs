//! The canonical kernels a family's forward pass calls, dispatched to the
//! model's [`Device`]. Every device computes the same bits (I6), so a family
//! writes its arithmetic once, against these.

use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::{self as k, AttnShape, AttnTask, RopeTable, Threads};

#[cfg(feature = "cuda")]
use crate::model::gpu_err;
use crate::model::{Device, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::EngineError;
use lmrr_kernels::attention_variants::{attention_variant, ExpKind};

/// The error of a kernel that has no device form.
#[cfg(feature = "cuda")]
fn no_device_kernel(what: &str) -> EngineError {
    EngineError::Device(format!(
        "{what} has no CUDA kernel; run this model on the CPU"
    ))
}

/// Kernels on one device, under one numerics mode (which only the
/// matmuls read: the tensor-core mode changes nothing else).
#[derive(Clone, Copy)]
pub struct Ops<'a> {
    pub device: &'a Device,
    pub threads: &'a Threads,
    pub numerics: Numerics,
}

/// The error of a tensor-core matmul over weights not stored as bf16.
pub fn not_bf16(w: &k::Matrix) -> EngineError {
    let kind = match w.w {
        k::Weights::F32(_) => "f32".to_string(),
        k::Weights::Bf16(_) => "bf16".to_string(),
        k::Weights::Quant(q, _) => format!("{q:?}"),
    };
    EngineError::Device(format!(
        "tensor-core numerics multiply bf16 weights, and a {}x{} matrix of this model is stored as {kind}; \
         use a bf16 checkpoint (gen-model --dtype bf16) or the canonical numerics",
        w.rows, w.cols
    ))
}

impl Ops<'_> {
    /// `y = x · Wᵀ` for each job, `x` of `n` rows.
    pub fn matmuls(
        &self,
        x: &[f32],
        n: usize,
        jobs: &mut [(&k::Matrix, &mut [f32])],
    ) -> Result<(), EngineError> {
        if let Some(m) = self.numerics.model() {
            return match self.device {
                Device::Cpu => {
                    for (w, y) in jobs.iter_mut() {
                        let k::Weights::Bf16(bits) = w.w else {
                            return Err(not_bf16(w));
                        };
                        k::tensor_core::tc_matmul(self.threads, m, x, n, bits, w.rows, w.cols, y);
                    }
                    Ok(())
                }
                #[cfg(feature = "cuda")]
                Device::Cuda(_) => Err(EngineError::Device(
                    "tensor-core numerics on CUDA run on the resident executor only".into(),
                )),
            };
        }
        match self.device {
            Device::Cpu => k::matmul_many(self.threads, x, n, jobs),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => {
                for (w, y) in jobs.iter_mut() {
                    g.matmul(x, n, w, y).map_err(gpu_err)?;
                }
            }
        }
        Ok(())
    }

    /// Row-wise RMSNorm of `x` with weight `w`.
    pub fn norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::rms_norm(x, w, eps, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.rms_norm(x, w, eps, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// RoPE of one row at `pos`, in place.
    pub fn rope_row(
        &self,
        table: &RopeTable,
        x: &mut [f32],
        pos: usize,
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::rope(table, x, pos),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.rope(table, x, pos).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// `out = silu(g) · u`.
    pub fn swiglu(&self, g_: &[f32], u: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::swiglu(g_, u, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.swiglu(g_, u, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// `out = gelu_tanh(g) · u` (GeGLU); the CPU only (no device kernel).
    pub fn geglu(&self, g: &[f32], u: &[f32], out: &mut [f32]) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::geglu(g, u, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => return Err(no_device_kernel("geglu")),
        }
        Ok(())
    }

    /// Canonical causal attention of each task over its last `window`
    /// positions.
    pub fn attend_window(
        &self,
        tasks: &[AttnTask],
        shape: &AttnShape,
        scale: f32,
        window: usize,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => {
                k::attention_window(self.threads, tasks, shape, scale, Some(window), out)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g
                .attention_window(tasks, shape, scale, Some(window), out)
                .map_err(gpu_err)?,
        }
        Ok(())
    }

    /// Refuses the attention patches off the CPU (they have no device kernel).
    pub fn check_patches(&self, patches: &PatchSet) -> Result<(), EngineError> {
        let attention_patch =
            patches.contains(Patch::FastExp) || patches.contains(Patch::SplitkDecode);
        if attention_patch && !matches!(self.device, Device::Cpu) {
            return Err(EngineError::Device(
                "the engine patches fast-exp and splitk-decode run on the CPU only; drop them or use the CPU".into(),
            ));
        }
        Ok(())
    }

    /// Attention of stacked token `i` = `tasks[i]` (`tok[i]` = its span and
    /// position) under the attention patches: `splitk-decode` splits a decode
    /// query's keys into as many parts as the step has decoding sequences (at
    /// most 4), `fast-exp` swaps the softmax exp. Without them, canonical.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_patched(
        &self,
        tasks: &[AttnTask],
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        patches: &PatchSet,
        shape: &AttnShape,
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
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
        let fast = patches.contains(Patch::FastExp);
        if !fast && split_of.iter().all(|&s| s == 1) {
            return self.attend(tasks, shape, scale, out);
        }
        self.check_patches(patches)?;
        let splits: Vec<usize> = tok.iter().map(|&(si, _)| split_of[si]).collect();
        let exp = if fast { ExpKind::Fast } else { ExpKind::Det };
        attention_variant(self.threads, tasks, &splits, shape, scale, exp, out);
        Ok(())
    }

    /// Canonical causal attention of each task.
    pub fn attend(
        &self,
        tasks: &[AttnTask],
        shape: &AttnShape,
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::attention(self.threads, tasks, shape, scale, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.attention(tasks, shape, scale, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// Hyper-connection coefficients ([`k::hyper::hc_coeffs`]).
    pub fn hc_coeffs(
        &self,
        raw: &[f32],
        h: usize,
        iters: usize,
        pre: &mut [f32],
        post: &mut [f32],
        res: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::hc_coeffs(raw, h, iters, pre, post, res),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g
                .hc_coeffs(raw, h, iters, pre, post, res)
                .map_err(gpu_err)?,
        }
        Ok(())
    }

    /// Block input from the streams ([`k::hyper::hc_pre`]).
    pub fn hc_pre(
        &self,
        x: &[f32],
        pre: &[f32],
        h: usize,
        d: usize,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::hc_pre(x, pre, h, d, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.hc_pre(x, pre, h, d, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// New streams from the block output ([`k::hyper::hc_post`]).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post(
        &self,
        x: &[f32],
        res: &[f32],
        post: &[f32],
        y: &[f32],
        h: usize,
        d: usize,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::hc_post(x, res, post, y, h, d, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.hc_post(x, res, post, y, h, d, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// One token's expert combine ([`k::hyper::moe_combine`]).
    pub fn moe_combine(
        &self,
        base: &[f32],
        gates: &[f32],
        ys: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::moe_combine(base, gates, ys, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.moe_combine(base, gates, ys, out).map_err(gpu_err)?,
        }
        Ok(())
    }

    /// Indexer scores of one query against `keys` ([`k::hyper::index_scores`]).
    pub fn index_scores(
        &self,
        q: &[f32],
        w: &[f32],
        dim: usize,
        keys: &[&[f32]],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        match self.device {
            Device::Cpu => k::index_scores(q, w, dim, keys, out),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => g.index_scores(q, w, dim, keys, out).map_err(gpu_err)?,
        }
        Ok(())
    }
}
