//! The host executor's [`Op::MlaAttend`]: Multi-head Latent Attention
//! (DeepSeek-V2/V3) in its absorbed form, over the latent rows the KV store
//! keeps.
//!
//! What is stored, per layer and position, is the layer's auxiliary KV row
//! of [`MlaShape::row`] floats: the compressed latent after its RMSNorm
//! (`kv_lora_rank`), then the rotated shared key `k_pe`
//! (`qk_rope_head_dim`). No decompressed K or V is ever stored: the pool,
//! the radix cache and the cache-state hash see exactly these rows.
//!
//! Attention is computed in latent space. A head's key at position `j` is
//! `[W_k,h · c_j ; k_pe_j]` and its value `W_v,h · c_j` (`W_k,h`, `W_v,h`
//! the head's rows of `kv_b_proj`), so
//! `q_h · k_h(j) = (W_k,hᵀ q_nope,h) · c_j + q_rope,h · k_pe_j` and
//! `Σ p_j v_h(j) = W_v,h (Σ p_j c_j)`. The query is absorbed once per token
//! (`k_absorb`, `W_k,hᵀ` per head, a canonical matmul), every head attends
//! over the stored rows with the canonical attention kernel (one K/V head
//! of `row()` floats; the stored row is both key and value, and the first
//! `latent` values of each head's output are `Σ p_j c_j`), and the output
//! is decompressed per head (`v_up`, a canonical matmul).
//!
//! Invariant: every value a token's output depends on is a function of that
//! token's own inputs and the stored rows of its sequence's positions
//! `0..=pos`, each computed by the canonical kernels (matmul chunks, RMSNorm,
//! RoPE, attention tiles at absolute positions), never of the step's other
//! tokens or of how its sequence was chunked: I2, I3 and I4 hold as for
//! [`super::Op::RopeKvAttend`].
//!
//! With an indexer (mini-v4, the DeepSeek-V4 class; [`MlaIndex`]) the
//! stored row carries the position's indexer key after the latent and
//! `k_pe`; per token the indexer selects positions ([`super::indexer`]:
//! blocks of absolute positions, a pure function of the tokens) and every
//! head attends over those positions' latent rows, gathered in ascending
//! order (all of `0..=pos` while the selection is dense), the token last.
//!
//! [`attend`] runs any consecutive heads given their blocks of the absorb
//! and decompression tables: a head reads only its own query columns and
//! table blocks besides the shared stored rows, which is what lets tensor
//! parallelism (`tp/`) split the op by heads without changing a bit.

use lmrr_kernels::{self as k, AttnTask, KvView};

use super::hyper::Trace;
use super::program::{MlaIndex, MlaShape, Op, Tables};
use super::Step;
use crate::kv::KvCache;
use crate::model::ops::Ops;
use crate::patches::{Patch, PatchSet};
use crate::EngineError;

/// Rows `r0..r0 + n` of an f32 or bf16 matrix, as a matrix.
fn rows_of<'a>(m: &k::Matrix<'a>, r0: usize, n: usize) -> Result<k::Matrix<'a>, EngineError> {
    let c = m.cols;
    let w = match m.w {
        k::Weights::F32(s) => s.get(r0 * c..(r0 + n) * c).map(k::Weights::F32),
        k::Weights::Bf16(s) => s.get(r0 * c..(r0 + n) * c).map(k::Weights::Bf16),
        k::Weights::Quant(..) => None,
    };
    w.and_then(|w| k::Matrix::new(w, n, c)).ok_or_else(|| {
        EngineError::Device(format!(
            "mla_attend: rows {r0}..{} of a {}x{c} matrix are not a f32/bf16 block",
            r0 + n,
            m.rows
        ))
    })
}

/// Copies a head's rotated part `src` into `dst` in the halves layout RoPE
/// rotates: as it is, or with the pairs `(2i, 2i+1)` split into evens then
/// odds (`interleave`).
fn rope_layout(src: &[f32], interleave: bool, dst: &mut [f32]) {
    if !interleave {
        dst.copy_from_slice(src);
        return;
    }
    let half = src.len() / 2;
    for i in 0..half {
        dst[i] = src[2 * i];
        dst[half + i] = src[2 * i + 1];
    }
}

/// Runs one [`Op::MlaAttend`] over the step (module docs); `trace` keeps
/// the indexer's choices of one token (for `explain`).
pub(super) fn exec(
    op: &Op,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    bufs: &mut [Vec<f32>],
    trace: Option<&mut Trace>,
) -> Result<(), EngineError> {
    let Op::MlaAttend {
        q,
        ckv,
        out,
        k_absorb,
        v_up,
        mla,
        index,
        ..
    } = op
    else {
        return Err(EngineError::Device(format!(
            "mla executor given a {} op",
            op.name()
        )));
    };
    let mut o = std::mem::take(&mut bufs[out.0 as usize]);
    let part = Heads {
        count: mla.heads,
        absorb: tables.mats[k_absorb.0 as usize].matrix(),
        up: tables.mats[v_up.0 as usize].matrix(),
        write: true,
    };
    let idx = index.map(|ix| IndexIo {
        iq: &bufs[ix.iq.0 as usize],
        ik: &bufs[ix.ik.0 as usize],
        iw: &bufs[ix.iw.0 as usize],
    });
    let r = attend(
        op,
        tables,
        step,
        kv,
        ops,
        &part,
        &bufs[q.0 as usize],
        &bufs[ckv.0 as usize],
        idx,
        &mut o,
        trace,
    );
    bufs[out.0 as usize] = o;
    r
}

/// The indexer's inputs of one step ([`super::program::MlaIndex`]): its
/// queries (`n × heads·dim`), keys (`n × dim`) and head weights before
/// the sigmoid (`n × heads`).
#[derive(Clone, Copy)]
pub(crate) struct IndexIo<'a> {
    pub iq: &'a [f32],
    pub ik: &'a [f32],
    pub iw: &'a [f32],
}

/// The heads one call of [`attend`] computes: all of them on one device,
/// a rank's consecutive heads under tensor parallelism.
pub(crate) struct Heads<'a> {
    pub count: usize,
    /// Their `count` blocks of `k_absorb` (`latent × nope` each) and of
    /// `v_up` (`v × latent` each), in head order.
    pub absorb: k::Matrix<'a>,
    pub up: k::Matrix<'a>,
    /// Whether this call stores the step's latent rows (the first call of
    /// a step does; the others attend over what it stored).
    pub write: bool,
}

/// [`Op::MlaAttend`] for the heads `part` names: `qs` holds those heads'
/// query columns (`n × count·(nope + rope)`), `cs` the whole compressed
/// KV rows, `idx` the indexer's inputs where the op has an indexer, and
/// `o` receives those heads' output columns (`n × count·v`). Each head's
/// values are computed exactly as on one device: the stored rows are per
/// token, shared by every head, and a head's absorb, attention and
/// decompression read only its own columns.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    op: &Op,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    part: &Heads,
    qs: &[f32],
    cs: &[f32],
    idx: Option<IndexIo>,
    o: &mut [f32],
    trace: Option<&mut Trace>,
) -> Result<(), EngineError> {
    let Op::MlaAttend {
        layer,
        rope,
        kv_norm,
        eps_bits,
        mla,
        spec,
        index,
        ..
    } = op
    else {
        return Err(EngineError::Device(format!(
            "mla executor given a {} op",
            op.name()
        )));
    };
    let MlaShape {
        nope,
        rope: rd,
        v: vd,
        latent: lr,
        interleave,
        ..
    } = *mla;
    let heads = part.count;
    let n = step.tok.len();
    if n == 0 {
        return Ok(());
    }
    let (qh, row) = (nope + rd, mla.row());
    let want = (n * heads * qh, n * mla.row(), n * heads * vd);
    if (qs.len(), cs.len(), o.len()) != want {
        return Err(EngineError::Device(format!(
            "mla_attend over {heads} heads of {n} tokens: q, kv and out hold {} {} {} floats, not {want:?}",
            qs.len(),
            cs.len(),
            o.len()
        )));
    }
    let table = tables.ropes[*rope];
    let index = match (index, idx) {
        (None, _) => None,
        (Some(ix), Some(io)) => {
            let s = ix.shape;
            let want = (n * s.heads * s.dim, n * s.dim, n * s.heads);
            if (io.iq.len(), io.ik.len(), io.iw.len()) != want {
                return Err(EngineError::Device(format!(
                    "mla_attend's indexer over {n} tokens: query, key and head weights hold \
                     {} {} {} floats, not {want:?}",
                    io.iq.len(),
                    io.ik.len(),
                    io.iw.len()
                )));
            }
            Some((ix, io))
        }
        (Some(_), None) => {
            return Err(EngineError::Device(
                "mla_attend with an indexer was given no indexer inputs".into(),
            ))
        }
    };

    // The stored rows: normalised latent, rotated shared key (then the
    // indexer key).
    if part.write {
        let keys = index.map(|(ix, io)| (io.ik, ix.shape.dim));
        store(
            step, kv, ops, tables, *layer, table, mla, *kv_norm, *eps_bits, cs, keys,
        )?;
    }

    // The queries in latent space: per head [W_kᵀ q_nope ; rotated q_rope].
    let mut qa = vec![0.0f32; n * heads * row];
    let absorb = &part.absorb;
    let mut xh = vec![0.0f32; n * nope];
    let mut yh = vec![0.0f32; n * lr];
    for h in 0..heads {
        for i in 0..n {
            let src = i * heads * qh + h * qh;
            xh[i * nope..(i + 1) * nope].copy_from_slice(&qs[src..src + nope]);
        }
        let w = rows_of(absorb, h * lr, lr)?;
        ops.matmuls(&xh, n, &mut [(&w, &mut yh[..])])?;
        for i in 0..n {
            let dst = i * heads * row + h * row;
            qa[dst..dst + lr].copy_from_slice(&yh[i * lr..(i + 1) * lr]);
        }
    }
    let mut qr = vec![0.0f32; heads * rd];
    for (i, &(_, pos)) in step.tok.iter().enumerate() {
        for h in 0..heads {
            let src = i * heads * qh + h * qh + nope;
            rope_layout(
                &qs[src..src + rd],
                interleave,
                &mut qr[h * rd..(h + 1) * rd],
            );
        }
        ops.rope_row(table, &mut qr, pos)?;
        for h in 0..heads {
            let dst = i * heads * row + h * row + lr;
            qa[dst..dst + rd].copy_from_slice(&qr[h * rd..(h + 1) * rd]);
        }
    }

    // Every head over the stored rows, each both key and value: all of a
    // sequence's rows in place, or with an indexer the rows it selects,
    // gathered in ascending position order.
    let mut att = vec![0.0f32; n * heads * row];
    {
        let gathered = match index {
            Some((ix, io)) => select(step, kv, ops, *layer, mla, ix, io, trace)?,
            None => Vec::new(),
        };
        let views: Vec<KvView> = if index.is_some() {
            gathered
                .iter()
                .map(|g| KvView {
                    block_len: g.len() / row,
                    k: vec![&g[..]],
                    v: vec![&g[..]],
                })
                .collect()
        } else {
            step.spans
                .iter()
                .map(|s| {
                    let a = kv.aux_view(s.seq, *layer);
                    KvView {
                        block_len: a.block_len,
                        k: a.blocks.clone(),
                        v: a.blocks,
                    }
                })
                .collect()
        };
        let tasks: Vec<AttnTask> = step
            .tok
            .iter()
            .enumerate()
            .map(|(i, &(si, pos))| match index {
                // A token's own gathered rows; it is the last of them.
                Some(_) => AttnTask {
                    q: &qa[i * heads * row..(i + 1) * heads * row],
                    kv: &views[i],
                    pos: views[i].block_len - 1,
                },
                None => AttnTask {
                    q: &qa[i * heads * row..(i + 1) * heads * row],
                    kv: &views[si],
                    pos,
                },
            })
            .collect();
        let patches: PatchSet = [
            spec.fast_exp.then_some(Patch::FastExp),
            spec.splitk_decode.then_some(Patch::SplitkDecode),
        ]
        .into_iter()
        .flatten()
        .collect();
        ops.attend_patched(
            &tasks,
            step.spans,
            &step.tok,
            &patches,
            &k::AttnShape {
                n_heads: heads,
                ..spec.shape
            },
            spec.scale(),
            &mut att,
        )?;
    }

    // Per head, the latent output decompressed by W_v.
    let up = &part.up;
    let mut oh = vec![0.0f32; n * vd];
    for h in 0..heads {
        for i in 0..n {
            let src = i * heads * row + h * row;
            yh[i * lr..(i + 1) * lr].copy_from_slice(&att[src..src + lr]);
        }
        let w = rows_of(up, h * vd, vd)?;
        ops.matmuls(&yh, n, &mut [(&w, &mut oh[..])])?;
        for i in 0..n {
            let dst = i * heads * vd + h * vd;
            o[dst..dst + vd].copy_from_slice(&oh[i * vd..(i + 1) * vd]);
        }
    }
    Ok(())
}

/// Per token, the indexer's selection over its sequence's stored indexer
/// keys (head weights through a sigmoid first: never negative) and the
/// selected positions' latent rows (`mla.row()` floats each, the key part
/// left out), gathered in ascending position order.
#[allow(clippy::too_many_arguments)]
fn select(
    step: &Step,
    kv: &dyn KvCache,
    ops: &Ops,
    layer: usize,
    mla: &MlaShape,
    ix: &MlaIndex,
    io: IndexIo,
    mut trace: Option<&mut Trace>,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let (s, row) = (ix.shape, mla.row());
    let keys: Vec<_> = step
        .spans
        .iter()
        .map(|sp| kv.aux_view(sp.seq, layer))
        .collect();
    let mut out = Vec::with_capacity(step.tok.len());
    for (i, &(si, pos)) in step.tok.iter().enumerate() {
        let w: Vec<f32> = io.iw[i * s.heads..(i + 1) * s.heads]
            .iter()
            .map(|&x| k::sigmoid(x))
            .collect();
        let sel = s.select(
            ops,
            &io.iq[i * s.heads * s.dim..(i + 1) * s.heads * s.dim],
            &w,
            &keys[si],
            row,
            pos,
            ix.early_exit,
        )?;
        let at = s.positions(&sel, pos);
        if let Some(t) = trace.as_mut() {
            if t.token == i {
                t.chosen.push((layer, sel));
            }
        }
        let mut g = Vec::with_capacity(at.len() * row);
        for p in at {
            g.extend_from_slice(&keys[si].row(p)[..row]);
        }
        out.push(g);
    }
    Ok(out)
}

/// Stores the step's latent rows (module docs): per token, the latent part
/// of `cs` RMS-normalised by `kv_norm`, then its shared key part rotated,
/// then (`keys`: the indexer keys and their width) its indexer key.
#[allow(clippy::too_many_arguments)]
fn store(
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    tables: &Tables,
    layer: usize,
    table: &k::RopeTable,
    mla: &MlaShape,
    kv_norm: super::program::Vector,
    eps_bits: u32,
    cs: &[f32],
    keys: Option<(&[f32], usize)>,
) -> Result<(), EngineError> {
    let (n, lr, row) = (step.tok.len(), mla.latent, mla.row());
    let width = row + keys.map_or(0, |k| k.1);
    let mut lat_in = vec![0.0f32; n * lr];
    for i in 0..n {
        lat_in[i * lr..(i + 1) * lr].copy_from_slice(&cs[i * row..i * row + lr]);
    }
    let mut lat = vec![0.0f32; n * lr];
    ops.norm(
        &lat_in,
        tables.vecs[kv_norm.0 as usize],
        f32::from_bits(eps_bits),
        &mut lat,
    )?;
    let mut stored = vec![0.0f32; n * width];
    for (i, &(si, pos)) in step.tok.iter().enumerate() {
        let dst = &mut stored[i * width..(i + 1) * width];
        dst[..lr].copy_from_slice(&lat[i * lr..(i + 1) * lr]);
        rope_layout(
            &cs[i * row + lr..(i + 1) * row],
            mla.interleave,
            &mut dst[lr..row],
        );
        ops.rope_row(table, &mut dst[lr..row], pos)?;
        if let Some((ik, d)) = keys {
            dst[row..].copy_from_slice(&ik[i * d..(i + 1) * d]);
        }
        kv.write_aux(step.spans[si].seq, layer, pos, dst);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::SeqKvStore;
    use crate::model::exec::indexer::IndexerShape;
    use crate::model::exec::program::{AttnSpec, Buf, Mat, Vector};
    use crate::model::{Device, KvLayout, LogitsWanted, SeqSpan};
    use crate::weights::Tensor;

    /// Deterministic values in [-1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut r = k::SplitMix64(seed);
        (0..n)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    /// One MLA op over `n` tokens of one sequence from position 0, with or
    /// without an indexer of `topk` blocks of 4 (window 4); its output.
    fn run(n: usize, topk: Option<usize>) -> Vec<f32> {
        let mla = MlaShape {
            heads: 2,
            nope: 4,
            rope: 2,
            v: 3,
            latent: 6,
            interleave: true,
        };
        let idx = IndexerShape {
            heads: 2,
            dim: 3,
            topk: topk.unwrap_or(1),
            block: 4,
            window: 4,
        };
        let absorb = Tensor::from_f32(
            "k_absorb".into(),
            vec![mla.heads * mla.latent, mla.nope],
            noise(1, mla.heads * mla.latent * mla.nope),
        );
        let up = Tensor::from_f32(
            "v_up".into(),
            vec![mla.heads * mla.v, mla.latent],
            noise(2, mla.heads * mla.v * mla.latent),
        );
        let norm = vec![1.0f32; mla.latent];
        let rope = k::RopeTable::new(mla.rope, 10_000.0, 64);
        let tables = Tables {
            mats: vec![&absorb, &up],
            vecs: vec![&norm],
            ropes: vec![&rope],
        };
        let index = topk.map(|_| MlaIndex {
            iq: Buf(2),
            ik: Buf(3),
            iw: Buf(4),
            shape: idx,
            early_exit: false,
        });
        let op = Op::MlaAttend {
            layer: 0,
            rope: 0,
            q: Buf(0),
            ckv: Buf(1),
            kv_norm: Vector(0),
            eps_bits: 1e-6f32.to_bits(),
            k_absorb: Mat(0),
            v_up: Mat(1),
            out: Buf(5),
            mla,
            spec: AttnSpec {
                shape: mla.attn_shape(),
                scale_bits: 0.4f32.to_bits(),
                fast_exp: false,
                splitk_decode: false,
                window: None,
            },
            index,
        };
        let extra = topk.map_or(0, |_| idx.dim);
        let mut kv = SeqKvStore::new(KvLayout {
            layers: 1,
            kv_dim: 0,
            aux_dim: mla.row() + extra,
        });
        kv.prepare(7, 0, n).expect("prepare");
        let tokens: Vec<u32> = (0..n as u32).collect();
        let spans = [SeqSpan {
            seq: 7,
            start: 0,
            tokens: &tokens,
            logits: LogitsWanted::None,
        }];
        let step = Step::new(&spans);
        let th = k::Threads::new(2).expect("threads");
        let ops = Ops {
            device: &Device::Cpu,
            threads: &th,
            numerics: Default::default(),
        };
        let mut bufs = vec![
            noise(3, n * mla.q_dim()),
            noise(4, n * mla.row()),
            noise(5, n * idx.heads * idx.dim),
            noise(6, n * idx.dim),
            noise(7, n * idx.heads),
            vec![0.0; n * mla.out_dim()],
        ];
        exec(&op, &tables, &step, &mut kv, &ops, &mut bufs, None).expect("mla_attend");
        bufs.swap_remove(5)
    }

    /// With an indexer whose selection stays dense, every head attends over
    /// gathered rows `0..=pos` at their own positions: the same bits as the
    /// rows read in place (the op without an indexer). A selective one
    /// (one block of 4 and a window of 4 over 24 positions) changes them
    /// from the first position that sees two blocks.
    #[test]
    fn a_dense_indexer_selection_gives_the_bits_of_no_indexer() {
        let n = 24;
        let plain = run(n, None);
        let dense = run(n, Some(n / 4 + 1));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain), bits(&dense));
        let sparse = run(n, Some(1));
        let per = plain.len() / n;
        // Positions of the first block are dense (one block, topk 1).
        assert_eq!(bits(&plain[..4 * per]), bits(&sparse[..4 * per]));
        assert_ne!(bits(&plain[4 * per..]), bits(&sparse[4 * per..]));
    }

    /// The interleaved layout puts pair `i`'s two elements at `i` and
    /// `half + i`, which is where rotate-half RoPE pairs them.
    #[test]
    fn interleaved_pairs_land_where_rotate_half_pairs_them() {
        let src = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let mut dst = [0.0; 6];
        rope_layout(&src, true, &mut dst);
        assert_eq!(dst, [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
        rope_layout(&src, false, &mut dst);
        assert_eq!(dst, src);
    }

    #[test]
    fn a_head_block_of_rows_is_those_rows() {
        let data: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let m = k::Matrix::new(k::Weights::F32(&data), 4, 3).expect("matrix");
        let b = rows_of(&m, 2, 2).expect("rows");
        assert_eq!((b.rows, b.cols), (2, 3));
        assert!(matches!(b.w, k::Weights::F32(s) if s == &data[6..12]));
        assert!(rows_of(&m, 3, 2).is_err());
    }
}
