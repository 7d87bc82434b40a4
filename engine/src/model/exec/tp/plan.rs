//! The sharded plan of a [`Program`] at a degree: for each op, the layout
//! its operands must have on the ranks, what the ranks do, and the layout of
//! what it writes; and for each matrix a rank multiplies, the slice it holds.
//!
//! Layouts follow the buffers through the program ([`Layout`]: whole on
//! every rank, or cut into per-rank column ranges). The rules are in the
//! module header of [`super`]; the plan is a pure function of the program,
//! the tables' shapes and the degree, and every refusal names the numbers.

use std::collections::HashMap;
use std::ops::Range;

use lmrr_kernels::CHUNK;

use super::TpError;
use crate::model::exec::program::{Buf, Mat, Op, Program, Tables};

/// Where a buffer's columns live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Every rank holds the whole buffer (the same values).
    Full,
    /// Rank `r` holds columns `ranges[r]` of every row; the ranges are
    /// contiguous, ascending and cover the width.
    Split(Vec<Range<usize>>),
}

/// How a rank's slice of a matrix is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cut {
    /// Output rows `[a, b)` (column-parallel).
    Rows(usize, usize),
    /// Input columns `[a, b)` (row-parallel).
    Cols(usize, usize),
}

/// What the ranks do for one op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Every rank runs the op over whole operands.
    Replicated,
    /// Rank 0 runs the op (it writes the KV store), the others receive its
    /// outputs.
    Once,
    /// Each rank computes its output rows of every job (`outs[job][rank]`).
    ColMatmul { outs: Vec<Vec<Range<usize>>> },
    /// Each rank computes the chunk partials of its input columns
    /// (`ranges[rank]`), the partials are gathered, every rank sums them.
    RowMatmul { ranges: Vec<Range<usize>> },
    /// Each rank runs the elementwise op over its own columns.
    Split,
    /// Each rank runs RoPE and attention over its heads (`q[rank]`,
    /// `kv[rank]` column ranges); the K/V rows are gathered for the store.
    HeadAttend {
        q: Vec<Range<usize>>,
        kv: Vec<Range<usize>>,
    },
    /// Routed expert `e` runs on rank `owner[e]`, the shared expert on rank
    /// 0; their outputs are gathered and every rank combines them.
    ExpertMoe { owner: Vec<usize> },
    /// Multi-head Latent Attention by heads: rank 0 stores the step's
    /// latent rows (per token, shared by every head), then each rank runs
    /// its heads (`heads[rank]`, head indices) over them with its blocks of
    /// the absorb and decompression tables; the output columns are
    /// gathered, so every rank holds the whole output.
    MlaHeads { heads: Vec<Range<usize>> },
}

/// One op of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Layouts the op's operands (and outputs) must have before it runs.
    pub need: Vec<(Buf, Layout)>,
    pub action: Action,
    /// Layouts of what it wrote.
    pub after: Vec<(Buf, Layout)>,
}

/// A program's sharded plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub degree: usize,
    pub stages: Vec<Stage>,
    /// Each rank's slice of each matrix it multiplies in a sharded matmul
    /// (`cuts[i].1[rank]`); matrices absent here are read whole (replicated
    /// weights, experts on their rank).
    pub cuts: Vec<(Mat, Vec<Cut>)>,
}

/// `n` cut into `degree` contiguous ranges, the first `n % degree` one
/// longer.
pub fn even(n: usize, degree: usize) -> Vec<Range<usize>> {
    let (q, rem) = (n / degree, n % degree);
    let mut a = 0;
    (0..degree)
        .map(|r| {
            let len = q + usize::from(r < rem);
            let range = a..a + len;
            a += len;
            range
        })
        .collect()
}

/// `heads` heads of `head_dim` columns cut into `degree` equal groups.
fn by_heads(
    what: &str,
    heads: usize,
    head_dim: usize,
    degree: usize,
) -> Result<Vec<Range<usize>>, TpError> {
    if !heads.is_multiple_of(degree) {
        return Err(TpError::Heads {
            what: what.to_string(),
            heads,
            degree,
        });
    }
    let per = heads / degree * head_dim;
    Ok((0..degree).map(|r| r * per..(r + 1) * per).collect())
}

impl Plan {
    /// The plan of `prog` over `degree` ranks.
    pub fn new(prog: &Program, tables: &Tables, degree: usize) -> Result<Self, TpError> {
        if degree == 0 || degree > super::MAX_DEGREE {
            return Err(TpError::Degree(degree));
        }
        // Which buffers feed attention as heads: (heads, head_dim, what).
        let mut heads: HashMap<Buf, (usize, usize, &'static str)> = HashMap::new();
        for op in prog.ops.iter().rev() {
            match op {
                Op::RopeKvAttend { q, k, v, spec, .. } => {
                    let s = spec.shape;
                    heads.insert(*q, (s.n_heads, s.head_dim, "attention query"));
                    heads.insert(*k, (s.n_kv_heads, s.head_dim, "attention key/value"));
                    heads.insert(*v, (s.n_kv_heads, s.head_dim, "attention key/value"));
                }
                Op::HeadRmsNorm { x, out, .. } => {
                    if let Some(h) = heads.get(out).copied() {
                        heads.insert(*x, h);
                    }
                }
                Op::MlaAttend {
                    q,
                    mla,
                    index: None,
                    ..
                } if mla.heads % degree == 0 => {
                    heads.insert(*q, (mla.heads, mla.nope + mla.rope, "MLA query"));
                }
                _ => {}
            }
        }
        let mut lay = vec![Layout::Full; prog.bufs.len()];
        let mut stages = Vec::with_capacity(prog.ops.len());
        let mut cuts: Vec<(Mat, Vec<Cut>)> = Vec::new();
        let mut cut = |m: Mat, c: Vec<Cut>| {
            if !cuts.iter().any(|(a, b)| *a == m && *b == c) {
                cuts.push((m, c));
            }
        };
        let full = |bs: Vec<Buf>| -> Vec<(Buf, Layout)> {
            bs.into_iter().map(|b| (b, Layout::Full)).collect()
        };
        for (i, op) in prog.ops.iter().enumerate() {
            let perr = |msg: String| TpError::Program {
                op: i,
                name: op.name(),
                msg,
            };
            let mut reads_writes = op.reads();
            reads_writes.extend(op.writes());
            let stage = match op {
                Op::Matmul { x, jobs } => match lay[x.0 as usize].clone() {
                    Layout::Split(ranges) => {
                        for j in jobs {
                            let t = tables.mats[j.w.0 as usize];
                            let (rows, cols) = (t.shape[0], t.shape.get(1).copied().unwrap_or(1));
                            for (rank, r) in ranges.iter().enumerate() {
                                if r.start % CHUNK != 0 && !r.is_empty() {
                                    return Err(TpError::Chunk {
                                        matrix: t.name.clone(),
                                        rows,
                                        cols,
                                        degree,
                                        rank,
                                        start: r.start,
                                        chunk: CHUNK,
                                        ranges: ranges.iter().map(|r| (r.start, r.end)).collect(),
                                    });
                                }
                            }
                            cut(
                                j.w,
                                ranges.iter().map(|r| Cut::Cols(r.start, r.end)).collect(),
                            );
                        }
                        let outs: Vec<Buf> = jobs.iter().map(|j| j.out).collect();
                        Stage {
                            need: full(outs.clone()),
                            action: Action::RowMatmul { ranges },
                            after: full(outs),
                        }
                    }
                    Layout::Full => {
                        let mut outs = Vec::with_capacity(jobs.len());
                        let mut need = vec![(*x, Layout::Full)];
                        for j in jobs {
                            let rows = tables.mats[j.w.0 as usize].shape[0];
                            let r = match heads.get(&j.out) {
                                Some(&(h, hd, what)) if h * hd == rows => {
                                    by_heads(what, h, hd, degree)?
                                }
                                _ => even(rows, degree),
                            };
                            cut(j.w, r.iter().map(|r| Cut::Rows(r.start, r.end)).collect());
                            need.push((j.out, Layout::Split(r.clone())));
                            outs.push(r);
                        }
                        let after = need[1..].to_vec();
                        Stage {
                            need,
                            action: Action::ColMatmul { outs },
                            after,
                        }
                    }
                },
                Op::RopeKvAttend {
                    q, k, v, out, spec, ..
                } => {
                    let s = spec.shape;
                    let qr = by_heads("attention query", s.n_heads, s.head_dim, degree)?;
                    let kvr = by_heads("attention key/value", s.n_kv_heads, s.head_dim, degree)?;
                    let (ql, kvl) = (Layout::Split(qr.clone()), Layout::Split(kvr.clone()));
                    Stage {
                        need: vec![
                            (*q, ql.clone()),
                            (*k, kvl.clone()),
                            (*v, kvl.clone()),
                            (*out, ql.clone()),
                        ],
                        action: Action::HeadAttend { q: qr, kv: kvr },
                        after: vec![(*q, ql.clone()), (*k, kvl), (*out, ql)],
                    }
                }
                Op::Glu { gate, up, out, .. } => match &lay[gate.0 as usize] {
                    l @ Layout::Split(_) if *l == lay[up.0 as usize] => Stage {
                        need: vec![(*out, l.clone())],
                        action: Action::Split,
                        after: vec![(*out, l.clone())],
                    },
                    _ => replicated(reads_writes, full),
                },
                Op::HeadRmsNorm { x, w, out, .. } => {
                    let wl = tables.vecs[w.0 as usize].len();
                    match &lay[x.0 as usize] {
                        l @ Layout::Split(r)
                            if wl > 0
                                && r.iter().all(|r| r.start % wl == 0 && r.len() % wl == 0) =>
                        {
                            Stage {
                                need: vec![(*out, l.clone())],
                                action: Action::Split,
                                after: vec![(*out, l.clone())],
                            }
                        }
                        _ => replicated(reads_writes, full),
                    }
                }
                Op::Scale { x, .. } | Op::RoundBf16 { x } => match &lay[x.0 as usize] {
                    Layout::Split(_) => Stage {
                        need: vec![],
                        action: Action::Split,
                        after: vec![],
                    },
                    Layout::Full => replicated(reads_writes, full),
                },
                Op::AddInto { x, y } => match &lay[x.0 as usize] {
                    l @ Layout::Split(_) if *l == lay[y.0 as usize] => Stage {
                        need: vec![],
                        action: Action::Split,
                        after: vec![],
                    },
                    _ => replicated(reads_writes, full),
                },
                Op::Moe {
                    x, out, experts, ..
                } => {
                    let e = experts.len();
                    Stage {
                        need: full(vec![*x, *out]),
                        action: Action::ExpertMoe {
                            owner: (0..e).map(|i| i * degree / e.max(1)).collect(),
                        },
                        after: full(vec![*out]),
                    }
                }
                Op::MlaAttend {
                    q,
                    ckv,
                    out,
                    k_absorb,
                    v_up,
                    mla,
                    index: None,
                    ..
                } if mla.heads % degree == 0 => {
                    let per = mla.heads / degree;
                    let hs: Vec<Range<usize>> =
                        (0..degree).map(|r| r * per..(r + 1) * per).collect();
                    let rows = |w: usize| hs.iter().map(move |h| Cut::Rows(h.start * w, h.end * w));
                    cut(*k_absorb, rows(mla.latent).collect());
                    cut(*v_up, rows(mla.v).collect());
                    let qr = by_heads("MLA query", mla.heads, mla.nope + mla.rope, degree)?;
                    Stage {
                        need: vec![
                            (*q, Layout::Split(qr)),
                            (*ckv, Layout::Full),
                            (*out, Layout::Full),
                        ],
                        action: Action::MlaHeads { heads: hs },
                        after: vec![(*out, Layout::Full)],
                    }
                }
                Op::MlaAttend { .. } => Stage {
                    need: full(reads_writes),
                    action: Action::Once,
                    after: full(op.writes()),
                },
                Op::Embed { .. }
                | Op::RmsNorm { .. }
                | Op::GatherWanted { .. }
                | Op::Repeat { .. }
                | Op::HcSinkhorn { .. }
                | Op::HcPre { .. }
                | Op::HcPost { .. }
                | Op::StreamMean { .. } => replicated(reads_writes, full),
            };
            for (b, l) in stage.need.iter().chain(&stage.after) {
                if let Layout::Split(r) = l {
                    let w = prog.decl(*b).width;
                    if r.len() != degree || r.last().map(|r| r.end) != Some(w) {
                        return Err(perr(format!(
                            "buffer `{}` ({w} wide) cut as {r:?} over {degree} ranks",
                            prog.decl(*b).name
                        )));
                    }
                }
            }
            for (b, l) in &stage.after {
                lay[b.0 as usize] = l.clone();
            }
            stages.push(stage);
        }
        Ok(Self {
            degree,
            stages,
            cuts,
        })
    }

    /// Rank `rank`'s cut of `m`, where the plan cuts it.
    pub fn cut_of(&self, m: Mat, rank: usize) -> impl Iterator<Item = Cut> + '_ {
        self.cuts
            .iter()
            .filter(move |(a, _)| *a == m)
            .map(move |(_, c)| c[rank])
    }
}

fn replicated(bufs: Vec<Buf>, full: impl Fn(Vec<Buf>) -> Vec<(Buf, Layout)>) -> Stage {
    Stage {
        need: full(bufs.clone()),
        action: Action::Replicated,
        after: full(bufs),
    }
}
