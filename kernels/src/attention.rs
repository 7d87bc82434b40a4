//! Causal attention with GQA, tile-ordered online softmax.
//!
//! One query token at absolute position `pos` attends to keys `0..=pos` of its
//! own sequence. Keys are walked in tiles of [`ATTN_TILE`] absolute positions
//! (tile `t` covers `[t·T, (t+1)·T)`), whatever the KV storage layout. Per tile:
//! `s[j] = dot(q, k[j]) · scale` (canonical dot), tile max, `p[j] = det_exp(s[j] −
//! m_new)`, `lt = Σ p[j]` and `acc_t[d] = Σ p[j]·v[j][d]` as sequential chains
//! (fma for the latter); then the merge, in tile order:
//! `α = det_exp(m − m_new)`, `l = l·α + lt`, `acc[d] = acc[d]·α + acc_t[d]`.
//! Finally `out[d] = acc[d] / l`. A split-KV variant must merge in tile order to
//! stay inside the contract.
//!
//! The KV store is seen through [`KvView`]: fixed-length blocks of positions,
//! so a per-sequence buffer (one block) and a paged pool look the same here.

use crate::exp::det_exp;
use crate::threads::{SendPtr, Threads};
use crate::ATTN_TILE;

/// Head layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of a K or V row: `n_kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// Width of a query row: `n_heads · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
}

/// Keys and values of one sequence in one layer: block `b` holds positions
/// `[b·block_len, (b+1)·block_len)`, each position a row of `kv_dim` floats,
/// `(block_len, n_kv_heads, head_dim)`.
#[derive(Debug, Clone)]
pub struct KvView<'a> {
    pub block_len: usize,
    pub k: Vec<&'a [f32]>,
    pub v: Vec<&'a [f32]>,
}

impl KvView<'_> {
    #[inline]
    fn row<'s>(blocks: &'s [&[f32]], block_len: usize, kv_dim: usize, pos: usize) -> &'s [f32] {
        let b = blocks[pos / block_len];
        let off = (pos % block_len) * kv_dim;
        &b[off..off + kv_dim]
    }
    /// Key row of position `pos`.
    pub fn key(&self, pos: usize, kv_dim: usize) -> &[f32] {
        Self::row(&self.k, self.block_len, kv_dim, pos)
    }
    /// Value row of position `pos`.
    pub fn value(&self, pos: usize, kv_dim: usize) -> &[f32] {
        Self::row(&self.v, self.block_len, kv_dim, pos)
    }
    /// Positions the view can address.
    pub fn capacity(&self) -> usize {
        self.block_len * self.k.len().min(self.v.len())
    }
}

/// One query token: its `n_heads · head_dim` query row, its sequence's KV and
/// its absolute position.
#[derive(Debug, Clone)]
pub struct AttnTask<'a> {
    pub q: &'a [f32],
    pub kv: &'a KvView<'a>,
    pub pos: usize,
}

fn check(tasks: &[AttnTask], shape: &AttnShape, out: &[f32]) {
    assert!(
        shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
        "attention: bad GQA"
    );
    assert_eq!(
        out.len(),
        tasks.len() * shape.q_dim(),
        "attention: out is not (tasks, q_dim)"
    );
    for t in tasks {
        assert_eq!(t.q.len(), shape.q_dim(), "attention: q row width");
        assert!(
            t.pos < t.kv.capacity(),
            "attention: position {} beyond KV",
            t.pos
        );
    }
}

/// Scalar reference for all tasks and heads.
pub fn attention_ref(tasks: &[AttnTask], shape: &AttnShape, scale: f32, out: &mut [f32]) {
    check(tasks, shape, out);
    let (hd, qd) = (shape.head_dim, shape.q_dim());
    for (ti, task) in tasks.iter().enumerate() {
        for h in 0..shape.n_heads {
            let o = &mut out[ti * qd + h * hd..ti * qd + (h + 1) * hd];
            head_ref(task, h, shape, scale, o);
        }
    }
}

fn head_ref(task: &AttnTask, h: usize, shape: &AttnShape, scale: f32, out: &mut [f32]) {
    let (hd, kvd) = (shape.head_dim, shape.kv_dim());
    let kvh = h / (shape.n_heads / shape.n_kv_heads);
    let q = &task.q[h * hd..(h + 1) * hd];
    let slice = |row: &[f32]| row[kvh * hd..(kvh + 1) * hd].to_vec();
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    let mut acc = vec![0.0f32; hd];
    let mut j0 = 0;
    while j0 <= task.pos {
        let j1 = (j0 + ATTN_TILE).min(task.pos + 1);
        let s: Vec<f32> = (j0..j1)
            .map(|j| crate::dot_ref(q, &slice(task.kv.key(j, kvd))) * scale)
            .collect();
        let mut mt = f32::NEG_INFINITY;
        for &v in &s {
            if v > mt {
                mt = v;
            }
        }
        let m_new = if mt > m { mt } else { m };
        let alpha = det_exp(m - m_new);
        let p: Vec<f32> = s.iter().map(|&v| det_exp(v - m_new)).collect();
        let mut lt = 0.0f32;
        for &v in &p {
            lt += v;
        }
        let mut acc_t = vec![0.0f32; hd];
        for (j, &pj) in (j0..j1).zip(&p) {
            let vr = slice(task.kv.value(j, kvd));
            for d in 0..hd {
                acc_t[d] = pj.mul_add(vr[d], acc_t[d]);
            }
        }
        l = l * alpha + lt;
        for d in 0..hd {
            acc[d] = acc[d] * alpha + acc_t[d];
        }
        m = m_new;
        j0 = j1;
    }
    for d in 0..hd {
        out[d] = acc[d] / l;
    }
}

/// Fast path over all tasks and heads, (task, head) pairs spread over threads;
/// bitwise equal to [`attention_ref`].
pub fn attention(
    threads: &Threads,
    tasks: &[AttnTask],
    shape: &AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    check(tasks, shape, out);
    let (hd, nh) = (shape.head_dim, shape.n_heads);
    let items = tasks.len() * nh;
    let op = SendPtr(out.as_mut_ptr());
    let avx = crate::use_avx2();
    threads.for_ranges(items, threads.grain(items, 1), |range| {
        for item in range {
            let (ti, h) = (item / nh, item % nh);
            // SAFETY: item `(ti, h)` owns `out[item·hd .. (item+1)·hd]`
            // exclusively, and `out` outlives `for_ranges`.
            let o = unsafe { std::slice::from_raw_parts_mut(op.get().add(item * hd), hd) };
            #[cfg(target_arch = "x86_64")]
            if avx {
                // SAFETY: AVX2+FMA detected; shapes checked by `check`.
                unsafe { avx2::head(&tasks[ti], h, shape, scale, o) };
                continue;
            }
            let _ = avx;
            head_ref(&tasks[ti], h, shape, scale, o);
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{AttnShape, AttnTask};
    use crate::exp::det_exp;
    use crate::x86::{dot8, exp8};
    use crate::ATTN_TILE;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn head(
        task: &AttnTask,
        h: usize,
        shape: &AttnShape,
        scale: f32,
        out: &mut [f32],
    ) {
        let (hd, kvd) = (shape.head_dim, shape.kv_dim());
        let kvh = h / (shape.n_heads / shape.n_kv_heads);
        let q = task.q.as_ptr().add(h * hd);
        let kptr = |j: usize| task.kv.key(j, kvd).as_ptr().add(kvh * hd);
        let vptr = |j: usize| task.kv.value(j, kvd).as_ptr().add(kvh * hd);
        let mut m = f32::NEG_INFINITY;
        let mut l = 0.0f32;
        let mut acc = vec![0.0f32; hd];
        let mut acc_t = vec![0.0f32; hd];
        let mut s = [0.0f32; ATTN_TILE];
        let mut p = [0.0f32; ATTN_TILE];
        let vd = hd / 8 * 8;
        let mut j0 = 0;
        while j0 <= task.pos {
            let j1 = (j0 + ATTN_TILE).min(task.pos + 1);
            let nt = j1 - j0;
            // Scores, 8 keys per micro-kernel call.
            let mut j = 0;
            while j < nt {
                let mut ks = [q; 8];
                for (r, kp) in ks.iter_mut().enumerate() {
                    *kp = kptr(j0 + (j + r).min(nt - 1));
                }
                let v = _mm256_mul_ps(dot8::<f32, 8, 1>(&[q], &ks, hd), _mm256_set1_ps(scale));
                let mut buf = [0.0f32; 8];
                _mm256_storeu_ps(buf.as_mut_ptr(), v);
                let take = (nt - j).min(8);
                s[j..j + take].copy_from_slice(&buf[..take]);
                j += 8;
            }
            let mut mt = f32::NEG_INFINITY;
            for &v in &s[..nt] {
                if v > mt {
                    mt = v;
                }
            }
            let m_new = if mt > m { mt } else { m };
            let alpha = det_exp(m - m_new);
            let mn = _mm256_set1_ps(m_new);
            crate::x86::map8(&s[..nt], &mut p[..nt], |v| exp8(_mm256_sub_ps(v, mn)));
            let mut lt = 0.0f32;
            for &v in &p[..nt] {
                lt += v;
            }
            acc_t.iter_mut().for_each(|a| *a = 0.0);
            for jj in 0..nt {
                let pj = p[jj];
                let pv = _mm256_set1_ps(pj);
                let vr = vptr(j0 + jj);
                let mut d = 0;
                while d < vd {
                    let a = _mm256_loadu_ps(acc_t.as_ptr().add(d));
                    let a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr.add(d)), a);
                    _mm256_storeu_ps(acc_t.as_mut_ptr().add(d), a);
                    d += 8;
                }
                for d in vd..hd {
                    acc_t[d] = pj.mul_add(*vr.add(d), acc_t[d]);
                }
            }
            l = l * alpha + lt;
            let av = _mm256_set1_ps(alpha);
            let mut d = 0;
            while d < vd {
                let a = _mm256_loadu_ps(acc.as_ptr().add(d));
                let t = _mm256_loadu_ps(acc_t.as_ptr().add(d));
                _mm256_storeu_ps(
                    acc.as_mut_ptr().add(d),
                    _mm256_add_ps(_mm256_mul_ps(a, av), t),
                );
                d += 8;
            }
            for d in vd..hd {
                acc[d] = acc[d] * alpha + acc_t[d];
            }
            m = m_new;
            j0 = j1;
        }
        let lv = _mm256_set1_ps(l);
        let mut d = 0;
        while d < vd {
            let a = _mm256_loadu_ps(acc.as_ptr().add(d));
            _mm256_storeu_ps(out.as_mut_ptr().add(d), _mm256_div_ps(a, lv));
            d += 8;
        }
        for d in vd..hd {
            out[d] = acc[d] / l;
        }
    }
}
