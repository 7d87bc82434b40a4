//! gpu_check's operands and comparisons: random quantized blocks and KV
//! pages, the bit-difference counts every case reports, and the mini-v4
//! operand sets and decode-RoPE step that both the cases and the negative
//! controls run.

use lmrr_kernels::cuda::resident::{AttnKernel, DecodeRopeCase};
use lmrr_kernels::cuda::Gpu;
use lmrr_kernels::*;

/// The paged attention kernels, each held to the CPU.
pub const ATTN_KERNELS: [(&str, AttnKernel); 6] = [
    ("attention_paged", AttnKernel::Paged),
    ("attention_decode", AttnKernel::Decode),
    ("attention_prefill", AttnKernel::Prefill),
    ("attention_prefill_hd64", AttnKernel::PrefillHd64),
    ("attention_prefill_hd128", AttnKernel::PrefillHd128),
    ("attention_split", AttnKernel::Split),
];

/// [`ATTN_KERNELS`] that serve `shape`'s head_dim (a kernel compiled for
/// one head_dim serves no other).
pub fn attn_kernels(shape: &AttnShape) -> impl Iterator<Item = (&'static str, AttnKernel)> {
    let hd = shape.head_dim;
    ATTN_KERNELS
        .into_iter()
        .filter(move |(_, k)| k.fixed_head_dim().is_none_or(|f| f == hd))
}

pub type Rng = SplitMix64;

/// SmolLM2's attention shape (GQA 9/3 heads × 64), of the attention cases
/// and timings.
pub fn smollm2_attn() -> AttnShape {
    AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    }
}

/// Blocks with realistic f16 scales (and a few special ones).
pub fn blocks(r: &mut Rng, kind: QuantKind, n: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
    for (i, b) in out.chunks_exact_mut(bb).enumerate() {
        let h: u16 = match i % 97 {
            5 => 0x0001,  // subnormal scale
            11 => 0x8000, // -0
            _ => {
                ((r.next_u64() as u16 & 1) << 15)
                    | ((7 + (r.next_u64() % 3) as u16) << 10)
                    | (r.next_u64() as u16 & 0x3ff)
            }
        };
        // The f16 scale: first in every block but Q6_K's, which ends with it;
        // Q4_1's min and Q4_K's dmin follow it.
        let at = if kind == QuantKind::Q6K { bb - 2 } else { 0 };
        b[at..at + 2].copy_from_slice(&h.to_le_bytes());
        if kind == QuantKind::Q4_1 || kind == QuantKind::Q4K {
            let m: u16 = ((r.next_u64() as u16 & 1) << 15)
                | ((9 + (r.next_u64() % 3) as u16) << 10)
                | (r.next_u64() as u16 & 0x3ff);
            b[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    out
}

/// Random K (±3) and V (±1) rows for positions `0..len` in blocks of 16.
pub fn kv_blocks(r: &mut Rng, len: usize, kvd: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let blocks = len.div_ceil(16);
    let kb = (0..blocks).map(|_| r.uniform_vec(16 * kvd, 3.0)).collect();
    let vb = (0..blocks).map(|_| r.uniform_vec(16 * kvd, 1.0)).collect();
    (kb, vb)
}

/// `tokens` decode tasks at position `len - 1`, each over its own random
/// K/V blocks (of [`kv_blocks`]) and query, handed to `f`.
pub fn with_decode_tasks(
    r: &mut Rng,
    shape: &AttnShape,
    tokens: usize,
    len: usize,
    f: impl FnOnce(&[AttnTask]),
) {
    let blocks: Vec<_> = (0..tokens)
        .map(|_| kv_blocks(r, len, shape.kv_dim()))
        .collect();
    let views: Vec<KvView> = blocks.iter().map(|(k, v)| block_view(k, v)).collect();
    let qs: Vec<Vec<f32>> = (0..tokens)
        .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
        .collect();
    let tasks: Vec<AttnTask> = qs
        .iter()
        .zip(&views)
        .map(|(q, kv)| AttnTask {
            q,
            kv,
            pos: len - 1,
        })
        .collect();
    f(&tasks)
}

/// The blocks of [`kv_blocks`] as a KV view.
pub fn block_view<'a>(kb: &'a [Vec<f32>], vb: &'a [Vec<f32>]) -> KvView<'a> {
    KvView {
        block_len: 16,
        k: kb.iter().map(|b| b.as_slice()).collect(),
        v: vb.iter().map(|b| b.as_slice()).collect(),
    }
}

/// A decode step (9/3 heads × 64, pages of 16, tokens at `positions`, each
/// one sequence, pages listed out of order, the written slots NaN before
/// the step) run as `rope_kv` then attention and as
/// `attention_decode_rope_qs` on the device: `(fused, rope_kv, outputs)`: the
/// differing bits of the two paths' outputs, rotated q, rotated K rows and
/// pages (the attention kernels are checked against the CPU elsewhere);
/// and of the rotated q and K rows of `rope_kv` and of the fused kernel
/// against the CPU's `rope` of the same rows. Each token attends its last
/// `window` positions where one is given.
pub fn decode_rope(
    gpu: &Gpu,
    r: &mut Rng,
    positions: &[usize],
    window: Option<usize>,
) -> (usize, usize, usize) {
    let (nh, nkv, hd, page_len) = (9usize, 3usize, 64usize, 16usize);
    let (qd, kvd, n) = (nh * hd, nkv * hd, positions.len());
    let pf = page_len * 2 * kvd;
    let counts: Vec<usize> = positions
        .iter()
        .map(|p| (p + 1).div_ceil(page_len))
        .collect();
    let total: usize = counts.iter().sum();
    let mut store = r.uniform_vec(total * pf, 2.0);
    let (mut index, mut seq_off, mut dst_page) = (Vec::new(), Vec::new(), Vec::new());
    let mut next = total;
    for (&p, &c) in positions.iter().zip(&counts) {
        seq_off.push(index.len() as u64);
        for _ in 0..c {
            next -= 1;
            index.push(next as u64);
        }
        let page = index[seq_off[seq_off.len() - 1] as usize + p / page_len] as usize;
        dst_page.push(page as u64);
        for which in 0..2 {
            let at = page * pf + which * page_len * kvd + (p % page_len) * kvd;
            store[at..at + kvd].fill(f32::NAN);
        }
    }
    let max_pos = positions.iter().max().copied().unwrap_or(0);
    let table = RopeTable::new(hd, 10_000.0, max_pos + 1);
    let (cos, sin) = table.tables();
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let (q, k, v) = (
        r.uniform_vec(n * qd, 2.0),
        r.uniform_vec(n * kvd, 2.0),
        r.uniform_vec(n * kvd, 1.0),
    );
    let case = DecodeRopeCase {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        page_len,
        q: &q,
        k: &k,
        v: &v,
        cos,
        sin,
        store: &store,
        index: &index,
        seq_off: &seq_off,
        pos: &pos,
        dst_page: &dst_page,
        window,
    };
    let [a, b] = case.run(gpu).expect("gpu attention_decode_rope_qs");
    let d = a.iter().zip(&b).map(|(x, y)| diff(x, y)).sum();
    // The CPU's RoPE of each token's q and k rows at its position.
    let (mut qc, mut kc) = (q.clone(), k.clone());
    for (t, &p) in positions.iter().enumerate() {
        rope(&table, &mut qc[t * qd..(t + 1) * qd], p);
        rope(&table, &mut kc[t * kvd..(t + 1) * kvd], p);
    }
    let cpu = diff(&qc, &a[1]) + diff(&kc, &a[2]) + diff(&qc, &b[1]) + diff(&kc, &b[2]);
    (d, cpu, a.iter().map(Vec::len).sum())
}

pub fn diff(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Differing bits, except that two NaNs count as equal whatever their
/// payloads: `(differing, NaN payload only)`. x86 propagates an operand's NaN
/// payload (and makes `-NaN` for `inf − inf`); NVIDIA GPUs return the
/// canonical `0x7fffffff`. NaN where the CPU has a number (or the reverse)
/// still counts as differing.
pub fn diff_nan(a: &[f32], b: &[f32]) -> (usize, usize) {
    let mut d = a.len().abs_diff(b.len());
    let mut payload = 0;
    for (x, y) in a.iter().zip(b) {
        if x.to_bits() == y.to_bits() {
            continue;
        }
        if x.is_nan() && y.is_nan() {
            payload += 1;
        } else {
            d += 1;
        }
    }
    (d, payload)
}

/// Random mini-v4 operands for one hyper-connection / MoE / indexer case.
pub struct Hyper {
    h: usize,
    d: usize,
    n: usize,
    raw: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Hyper {
    pub fn new(r: &mut Rng, n: usize, h: usize, d: usize) -> Self {
        Self {
            h,
            d,
            n,
            raw: r.uniform_vec(n * hyper::hc_raw_width(h), 4.0),
            x: r.uniform_vec(n * h * d, 2.0),
            y: r.uniform_vec(n * d, 2.0),
        }
    }

    /// `[pre, post, res]` of the CPU and of the device.
    pub fn coeffs(&self, gpu: &Gpu, iters: usize) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let (n, h) = (self.n, self.h);
        let z = || [vec![0.0; n * h], vec![0.0; n * h], vec![0.0; n * h * h]];
        let (mut c, mut g) = (z(), z());
        let [cp, cq, cr] = &mut c;
        hc_coeffs(&self.raw, h, iters, cp, cq, cr);
        let [gp, gq, gr] = &mut g;
        gpu.hc_coeffs(&self.raw, h, iters, gp, gq, gr)
            .expect("gpu hc_coeffs");
        (c, g)
    }

    /// hc_pre then hc_post with the CPU's coefficients: `(cpu, device)` of
    /// each.
    pub fn mixes(&self, gpu: &Gpu, coeffs: &[Vec<f32>; 3]) -> [(Vec<f32>, Vec<f32>); 2] {
        let (n, h, d) = (self.n, self.h, self.d);
        let [pre, post, res] = coeffs;
        let (mut c1, mut g1) = (vec![0.0; n * d], vec![f32::NAN; n * d]);
        hc_pre(&self.x, pre, h, d, &mut c1);
        gpu.hc_pre(&self.x, pre, h, d, &mut g1).expect("gpu hc_pre");
        let (mut c2, mut g2) = (vec![0.0; n * h * d], vec![f32::NAN; n * h * d]);
        hc_post(&self.x, res, post, &self.y, h, d, &mut c2);
        gpu.hc_post(&self.x, res, post, &self.y, h, d, &mut g2)
            .expect("gpu hc_post");
        [(c1, g1), (c2, g2)]
    }
}

/// `(cpu, device)` of the expert combine of one token with `k` experts of
/// width `d`.
pub fn combine(gpu: &Gpu, r: &mut Rng, k: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let base = r.uniform_vec(d, 2.0);
    let gates = r.uniform_vec(k, 1.5);
    let rows: Vec<Vec<f32>> = (0..k).map(|_| r.uniform_vec(d, 3.0)).collect();
    let ys: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
    let (mut cpu, mut dev) = (vec![0.0; d], vec![f32::NAN; d]);
    moe_combine(&base, &gates, &ys, &mut cpu);
    gpu.moe_combine(&base, &gates, &ys, &mut dev)
        .expect("gpu moe_combine");
    (cpu, dev)
}

/// `(cpu, device)` of the indexer scores of one query (`heads × dim`)
/// against `m` keys; weights of both signs, keys scaled by `key_scale`.
pub fn scores(
    gpu: &Gpu,
    r: &mut Rng,
    heads: usize,
    dim: usize,
    m: usize,
    key_scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let q = r.uniform_vec(heads * dim, 1.0);
    let w = r.uniform_vec(heads, 2.0);
    let rows: Vec<Vec<f32>> = (0..m).map(|_| r.uniform_vec(dim, key_scale)).collect();
    let keys: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
    let (mut cpu, mut dev) = (vec![0.0; m], vec![f32::NAN; m]);
    index_scores(&q, &w, dim, &keys, &mut cpu);
    gpu.index_scores(&q, &w, dim, &keys, &mut dev)
        .expect("gpu index_scores");
    (cpu, dev)
}
