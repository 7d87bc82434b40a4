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
//! A sliding window of `W` positions ([`attention_window`]) limits the keys of
//! position `pos` to `[max(0, pos − W + 1), pos]`, walked in the same absolute
//! tiles: the first tile is cut at the window's first key, every later tile is
//! whole. Without a window the first key is 0 and the walk is the one above,
//! instruction for instruction.
//!
//! The KV store is seen through [`KvView`]: fixed-length blocks of positions,
//! so a per-sequence buffer (one block) and a paged pool look the same here.
//!
//! Threads take (token, K/V head) groups: a group's query heads walk the
//! tiles together, so each K and V tile comes from memory once for all of
//! them; where a step has fewer groups than threads, a group is cut into
//! parts of its heads. Which thread or group computes a head moves no bit.

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
        shape.n_kv_heads > 0 && shape.n_heads.is_multiple_of(shape.n_kv_heads),
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

/// The first key a query at `pos` attends to under `window` (`None`: all).
#[inline]
pub fn first_key(pos: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// The end (exclusive) of the tile that starts at key `j0`: the next
/// multiple of [`ATTN_TILE`], cut at `pos + 1`.
#[inline]
fn tile_end(j0: usize, pos: usize) -> usize {
    ((j0 / ATTN_TILE + 1) * ATTN_TILE).min(pos + 1)
}

fn check_window(window: Option<usize>) {
    assert!(window != Some(0), "attention: a window of zero positions");
}

/// Scalar reference for all tasks and heads.
pub fn attention_ref(tasks: &[AttnTask], shape: &AttnShape, scale: f32, out: &mut [f32]) {
    attention_window_ref(tasks, shape, scale, None, out)
}

/// Scalar reference of sliding-window attention: each task's keys are
/// `[first_key(pos, window), pos]`.
pub fn attention_window_ref(
    tasks: &[AttnTask],
    shape: &AttnShape,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    check(tasks, shape, out);
    check_window(window);
    let (hd, qd) = (shape.head_dim, shape.q_dim());
    for (ti, task) in tasks.iter().enumerate() {
        for h in 0..shape.n_heads {
            let o = &mut out[ti * qd + h * hd..ti * qd + (h + 1) * hd];
            head_ref(task, h, shape, scale, first_key(task.pos, window), o);
        }
    }
}

fn head_ref(task: &AttnTask, h: usize, shape: &AttnShape, scale: f32, lo: usize, out: &mut [f32]) {
    let (hd, kvd) = (shape.head_dim, shape.kv_dim());
    let kvh = h / (shape.n_heads / shape.n_kv_heads);
    let q = &task.q[h * hd..(h + 1) * hd];
    let slice = |row: &[f32]| row[kvh * hd..(kvh + 1) * hd].to_vec();
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    let mut acc = vec![0.0f32; hd];
    let mut j0 = lo;
    while j0 <= task.pos {
        let j1 = tile_end(j0, task.pos);
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
    attention_window(threads, tasks, shape, scale, None, out)
}

/// Fast sliding-window attention, bitwise equal to [`attention_window_ref`].
pub fn attention_window(
    threads: &Threads,
    tasks: &[AttnTask],
    shape: &AttnShape,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    check(tasks, shape, out);
    check_window(window);
    let (hd, nh, nkv) = (shape.head_dim, shape.n_heads, shape.n_kv_heads);
    // One item per (token, K/V head): its query heads walk the tiles
    // together, so each K and V tile is read from memory once for all of
    // them (the others find it in L1). Every head's arithmetic is its own,
    // in its own order: the grouping moves no bit.
    // Where there are fewer groups than threads (a decode step of few
    // sequences, few K/V heads), a group's heads are cut into parts of
    // `sub` heads so that every thread has one.
    let group = nh / nkv;
    let groups = tasks.len() * nkv;
    let sub = group.div_ceil(threads.count().div_ceil(groups).clamp(1, group));
    let parts = group.div_ceil(sub);
    let items = groups * parts;
    let op = SendPtr(out.as_mut_ptr());
    let avx = crate::use_avx2();
    threads.for_ranges(items, threads.grain(items, 1), |range| {
        for item in range {
            let (gi, part) = (item / parts, item % parts);
            let (ti, kvh) = (gi / nkv, gi % nkv);
            let h0 = kvh * group + part * sub;
            let n = sub.min((kvh + 1) * group - h0);
            // SAFETY: item `(ti, kvh, part)` owns the rows of its heads,
            // `out[(ti·nh + h0)·hd .. (ti·nh + h0 + n)·hd]`, exclusively,
            // and `out` outlives `for_ranges`.
            let o = unsafe {
                std::slice::from_raw_parts_mut(op.get().add((ti * nh + h0) * hd), n * hd)
            };
            let lo = first_key(tasks[ti].pos, window);
            #[cfg(target_arch = "x86_64")]
            if avx {
                // SAFETY: AVX2+FMA detected; shapes checked by `check`.
                unsafe { avx2::heads(&tasks[ti], h0, n, shape, scale, lo, o) };
                continue;
            }
            let _ = avx;
            for (g, oh) in o.chunks_exact_mut(hd).enumerate() {
                head_ref(&tasks[ti], h0 + g, shape, scale, lo, oh);
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{tile_end, AttnShape, AttnTask};
    use crate::exp::det_exp;
    use crate::x86::{dot8, exp8};
    use crate::ATTN_TILE;
    use std::arch::x86_64::*;

    /// Heads `h0 .. h0 + n` (one K/V head's) of `task` into `out` (`n`
    /// rows of `head_dim`): tile by tile, every head's step on a tile before
    /// the next tile, so the tile's K and V rows stay in L1 for the heads
    /// after the first.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn heads(
        task: &AttnTask,
        h0: usize,
        n: usize,
        shape: &AttnShape,
        scale: f32,
        lo: usize,
        out: &mut [f32],
    ) {
        let hd = shape.head_dim;
        let mut st: Vec<Head> = (h0..h0 + n).map(|h| Head::new(task, h, shape)).collect();
        let mut acc_t = vec![0.0f32; hd];
        let mut j0 = lo;
        while j0 <= task.pos {
            let j1 = tile_end(j0, task.pos);
            for h in st.iter_mut() {
                h.tile(task, shape, scale, j0, j1, &mut acc_t);
            }
            j0 = j1;
        }
        for (h, o) in st.iter().zip(out.chunks_exact_mut(hd)) {
            h.finish(o);
        }
    }

    /// P·V of a tile with 512-bit registers: `acc_t[d] = Σ_j p[j]·v[j][d]`,
    /// each element's FMA chain in position order from +0.0 (the AVX2
    /// loop's bits), up to 128 dimensions a pass in registers.
    #[target_feature(enable = "avx512f")]
    unsafe fn pv16(p: &[f32], v: &[*const f32], hd: usize, acc_t: &mut [f32]) {
        let vd = hd / 16 * 16;
        let mut d0 = 0;
        while d0 < vd {
            let nv = ((vd - d0) / 16).min(8);
            let mut a = [_mm512_setzero_ps(); 8];
            for (&pj, &vr) in p.iter().zip(v) {
                let pv = _mm512_set1_ps(pj);
                let vr = vr.add(d0);
                for (u, au) in a.iter_mut().enumerate() {
                    if u < nv {
                        *au = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vr.add(16 * u)), *au);
                    }
                }
            }
            for (u, au) in a.iter().enumerate().take(nv) {
                _mm512_storeu_ps(acc_t.as_mut_ptr().add(d0 + 16 * u), *au);
            }
            d0 += 16 * nv;
        }
        for d in vd..hd {
            acc_t[d] = 0.0;
        }
        for (&pj, &vr) in p.iter().zip(v) {
            for d in vd..hd {
                acc_t[d] = pj.mul_add(*vr.add(d), acc_t[d]);
            }
        }
    }

    /// One head's running state: max, sum, output accumulator.
    struct Head {
        q: *const f32,
        kvh: usize,
        m: f32,
        l: f32,
        acc: Vec<f32>,
    }

    impl Head {
        fn new(task: &AttnTask, h: usize, shape: &AttnShape) -> Self {
            let hd = shape.head_dim;
            Self {
                // SAFETY: `check` holds q to n_heads · head_dim floats.
                q: unsafe { task.q.as_ptr().add(h * hd) },
                kvh: h / (shape.n_heads / shape.n_kv_heads),
                m: f32::NEG_INFINITY,
                l: 0.0,
                acc: vec![0.0; hd],
            }
        }

        /// The tile of keys `j0..j1`: its scores, its max, p, lt and P·V
        /// (into `acc_t`, scratch), then the running state rescaled.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn tile(
            &mut self,
            task: &AttnTask,
            shape: &AttnShape,
            scale: f32,
            j0: usize,
            j1: usize,
            acc_t: &mut [f32],
        ) {
            let (hd, kvd, q) = (shape.head_dim, shape.kv_dim(), self.q);
            let kptr = |j: usize| task.kv.key(j, kvd).as_ptr().add(self.kvh * hd);
            let vptr = |j: usize| task.kv.value(j, kvd).as_ptr().add(self.kvh * hd);
            let mut s = [0.0f32; ATTN_TILE];
            let mut p = [0.0f32; ATTN_TILE];
            let vd = hd / 8 * 8;
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
            let m_new = if mt > self.m { mt } else { self.m };
            let alpha = det_exp(self.m - m_new);
            let mn = _mm256_set1_ps(m_new);
            crate::x86::map8(&s[..nt], &mut p[..nt], |v| exp8(_mm256_sub_ps(v, mn)));
            let mut lt = 0.0f32;
            for &v in &p[..nt] {
                lt += v;
            }
            // P·V: every element's chain is p_j·v_j in position order from
            // +0.0, whatever the vector width.
            if crate::x86_512::use_avx512() {
                let mut vs = [q; ATTN_TILE];
                for (jj, v) in vs.iter_mut().enumerate().take(nt) {
                    *v = vptr(j0 + jj);
                }
                pv16(&p[..nt], &vs[..nt], hd, acc_t);
            } else {
                // P·V: per block of up to 64 dimensions, its accumulators in
                // registers across the tile's positions (each element's chain
                // still p_j·v_j in position order from +0.0).
                let mut d0 = 0;
                while d0 < vd {
                    let nv = ((vd - d0) / 8).min(8);
                    let mut a = [_mm256_setzero_ps(); 8];
                    for (jj, &pj) in p[..nt].iter().enumerate() {
                        let pv = _mm256_set1_ps(pj);
                        let vr = vptr(j0 + jj).add(d0);
                        for (u, au) in a.iter_mut().enumerate() {
                            if u < nv {
                                *au = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr.add(8 * u)), *au);
                            }
                        }
                    }
                    for (u, au) in a.iter().enumerate().take(nv) {
                        _mm256_storeu_ps(acc_t.as_mut_ptr().add(d0 + 8 * u), *au);
                    }
                    d0 += 8 * nv;
                }
                for d in vd..hd {
                    acc_t[d] = 0.0;
                }
                for (jj, &pj) in p[..nt].iter().enumerate() {
                    let vr = vptr(j0 + jj);
                    for d in vd..hd {
                        acc_t[d] = pj.mul_add(*vr.add(d), acc_t[d]);
                    }
                }
            }
            self.l = self.l * alpha + lt;
            let av = _mm256_set1_ps(alpha);
            let acc = &mut self.acc;
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
            self.m = m_new;
        }

        /// `out = acc / l`.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn finish(&self, out: &mut [f32]) {
            let (acc, hd) = (&self.acc, self.acc.len());
            let vd = hd / 8 * 8;
            let lv = _mm256_set1_ps(self.l);
            let mut d = 0;
            while d < vd {
                let a = _mm256_loadu_ps(acc.as_ptr().add(d));
                _mm256_storeu_ps(out.as_mut_ptr().add(d), _mm256_div_ps(a, lv));
                d += 8;
            }
            for d in vd..hd {
                out[d] = acc[d] / self.l;
            }
        }
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::SplitMix64;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// KV storage of `data` cut into blocks of `block_len` positions (the
    /// tail NaN: never read).
    fn blocks(data: &[f32], kv_dim: usize, block_len: usize) -> Vec<Vec<f32>> {
        data.chunks(block_len * kv_dim)
            .map(|c| {
                let mut b = c.to_vec();
                b.resize(block_len * kv_dim, f32::NAN);
                b
            })
            .collect()
    }

    /// Softmax attention of one head over keys `[lo, pos]` in f64, straight
    /// from the definition (an independent expectation).
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        hd: usize,
        lo: usize,
        pos: usize,
        scale: f32,
    ) -> Vec<f64> {
        let s: Vec<f64> = (lo..=pos)
            .map(|j| {
                let d: f64 = (0..hd).map(|i| q[i] as f64 * k[j * hd + i] as f64).sum();
                d * scale as f64
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f64 = p.iter().sum();
        (0..hd)
            .map(|i| {
                (lo..=pos)
                    .zip(&p)
                    .map(|(j, pj)| pj * v[j * hd + i] as f64)
                    .sum::<f64>()
                    / l
            })
            .collect()
    }

    #[test]
    fn windowed_fast_path_matches_reference_and_definition() {
        let mut r = SplitMix64(41);
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 12,
        };
        let (kvd, qd, len) = (shape.kv_dim(), shape.q_dim(), 120);
        let k = r.uniform_vec(len * kvd, 1.5);
        let v = r.uniform_vec(len * kvd, 1.0);
        let positions = [0usize, 1, 5, 31, 32, 33, 63, 64, 70, 119];
        let qs: Vec<Vec<f32>> = positions.iter().map(|_| r.uniform_vec(qd, 1.0)).collect();
        let scale = 0.3;
        for window in [1usize, 2, 7, 32, 33, 40, 64, 200] {
            let mut want: Option<Vec<u32>> = None;
            for block_len in [1usize, 5, 16, 120] {
                let (kb, vb) = (blocks(&k, kvd, block_len), blocks(&v, kvd, block_len));
                let view = KvView {
                    block_len,
                    k: kb.iter().map(|b| b.as_slice()).collect(),
                    v: vb.iter().map(|b| b.as_slice()).collect(),
                };
                let tasks: Vec<AttnTask> = positions
                    .iter()
                    .zip(&qs)
                    .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
                    .collect();
                let mut refo = vec![0.0; tasks.len() * qd];
                attention_window_ref(&tasks, &shape, scale, Some(window), &mut refo);
                let want = want.get_or_insert_with(|| bits(&refo));
                assert_eq!(&bits(&refo), want, "layout changed the reference");
                for n in 1..=3 {
                    let th = Threads::new(n).unwrap();
                    let mut got = vec![0.0; refo.len()];
                    attention_window(&th, &tasks, &shape, scale, Some(window), &mut got);
                    assert_eq!(
                        &bits(&got),
                        want,
                        "window {window} block {block_len} threads {n}"
                    );
                }
            }
            // Against the definition, head by head (kv head `h / 2`).
            let out = want.unwrap();
            for (ti, &pos) in positions.iter().enumerate() {
                let lo = first_key(pos, Some(window));
                for h in 0..shape.n_heads {
                    let kvh = h / 2;
                    let hd = shape.head_dim;
                    let sel = |m: &[f32]| -> Vec<f32> {
                        (0..len)
                            .flat_map(|j| m[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd].to_vec())
                            .collect()
                    };
                    let e = naive(
                        &qs[ti][h * hd..(h + 1) * hd],
                        &sel(&k),
                        &sel(&v),
                        hd,
                        lo,
                        pos,
                        scale,
                    );
                    for (d, e) in e.iter().enumerate() {
                        let g = f32::from_bits(out[ti * qd + h * hd + d]) as f64;
                        assert!(
                            (g - e).abs() < 1e-5,
                            "window {window} pos {pos} head {h}: {g} against {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_window_covering_the_prefix_is_full_attention_bit_for_bit() {
        let mut r = SplitMix64(42);
        let shape = AttnShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 16,
        };
        let len = 70;
        let k = r.uniform_vec(len * 16, 1.0);
        let v = r.uniform_vec(len * 16, 1.0);
        let view = KvView {
            block_len: len,
            k: vec![&k],
            v: vec![&v],
        };
        let q = r.uniform_vec(32, 1.0);
        let tasks: Vec<AttnTask> = [0usize, 33, 69]
            .iter()
            .map(|&pos| AttnTask {
                q: &q,
                kv: &view,
                pos,
            })
            .collect();
        let th = Threads::single();
        let mut full = vec![0.0; 3 * 32];
        attention(&th, &tasks, &shape, 0.25, &mut full);
        let mut win = vec![0.0; 3 * 32];
        attention_window(&th, &tasks, &shape, 0.25, Some(70), &mut win);
        assert_eq!(bits(&full), bits(&win));
        // A window of one key returns that key's value exactly.
        attention_window(&th, &tasks, &shape, 0.25, Some(1), &mut win);
        assert_eq!(bits(&win[32..48]), bits(&v[33 * 16..34 * 16]));
    }
}
