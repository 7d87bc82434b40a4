//! What a device executor needs to know about a [`Program`] before it runs
//! one: the KV geometry its attention ops imply, where each attention op's
//! K, V and indexer-key rows are made (so that they are made straight into
//! the step's per-layer staging, which goes back to the host store), how many
//! ops read each value a matmul writes (a split matmul's partials may be
//! left for one fused reader only), and the most split partials a token of
//! the step holds. Pure host logic, the same on every device; computed once
//! per program.
//!
//! Invariant: the plan moves where values live, never what they are: every
//! op reads the location the value it reads was last written to.

use std::collections::HashMap;

use super::super::program::{Buf, Op, Program, Rows, Tables};

/// Where a value lives on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// The buffer's own region of the step's arena.
    Own(Buf),
    /// Layer `l`'s K rows of the step (`layers × n × kv_dim` staging).
    StageK(usize),
    /// Layer `l`'s V rows.
    StageV(usize),
    /// Layer `l`'s auxiliary rows (`layers × n × aux_dim`; no program the
    /// resident executor runs today has them).
    StageAux(usize),
    /// Unrotated K rows for the fused decode attention, which writes the
    /// rotated ones to [`Loc::StageK`] itself.
    KRaw,
}

/// Where an attention op's K rows are made: staging, or, when the step
/// takes the fused decode kernel, [`Loc::KRaw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    K(usize),
    V(usize),
    Aux(usize),
}

/// The per-layer KV state a program's attention ops keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeom {
    pub layers: usize,
    pub kv_dim: usize,
    pub aux_dim: usize,
}

/// A program analysed for a device executor.
#[derive(Debug, Clone)]
pub struct Plan {
    pub kv: KvGeom,
    /// Per op: the writes that go somewhere other than the buffer's region.
    redirect: Vec<Vec<(Buf, Target)>>,
    /// Per op: the buffers it writes in place (reads and writes).
    in_place: Vec<Vec<Buf>>,
    /// Per op: for each buffer it writes, the ops reading that value before
    /// the buffer is written again.
    readers: Vec<Vec<(Buf, u32)>>,
    /// The most split partials per token one matmul op of token rows holds
    /// (every job's chunks × rows).
    pub part_per_token: usize,
    /// The most columns of any matmul's matrix (the width of the bf16 input
    /// tensor-core numerics round once per op).
    pub max_cols: usize,
    /// The program has a MoE op (its routing runs on the host).
    pub has_moe: bool,
    /// Per attention op, by op index: its layer.
    pub attends: Vec<(usize, usize)>,
    /// Every attention op is plain (no patch, an even head_dim of at most
    /// 256; a sliding window is the fused kernel's too), so that a decode
    /// step may take the fused kernel.
    pub fusable_attention: bool,
    /// The attention ops' query heads (the first one's).
    pub heads: usize,
    /// Per token, the most scratch floats per tile of context any plain
    /// attention op's split form needs ([`lmrr_kernels::split_kv_floats`]
    /// of its heads).
    pub split_per_tile: usize,
    /// The gather ops (by index) whose output may stand for its input when
    /// every row is wanted in order: no later op writes either.
    pub gather_alias: Vec<usize>,
}

impl Plan {
    /// Analyses `prog` over `tables`; an error names what a device executor
    /// cannot place (a program bug, or a shape no device kernel takes).
    pub fn new(prog: &Program, tables: &Tables) -> Result<Self, String> {
        let ops = &prog.ops;
        let mut kv: Option<KvGeom> = None;
        let mut redirect: Vec<Vec<(Buf, Target)>> = vec![Vec::new(); ops.len()];
        let mut attends = Vec::new();
        let mut layers_seen = std::collections::HashSet::new();
        for (j, op) in ops.iter().enumerate() {
            if let Op::MlaAttend { .. } = op {
                return Err(format!(
                    "op {j}: mla_attend (deepseek_v3's Multi-head Latent Attention) has no \
                     resident kernel; the family runs it on the host executor"
                ));
            }
            let (layer, k, v, ik, geom) = match op {
                Op::RopeKvAttend {
                    layer, k, v, spec, ..
                } => (*layer, *k, *v, None, (spec.shape.kv_dim(), 0)),
                _ => continue,
            };
            if !layers_seen.insert(layer) {
                return Err(format!("op {j}: layer {layer} attends twice"));
            }
            let g = kv.get_or_insert(KvGeom {
                layers: 0,
                kv_dim: geom.0,
                aux_dim: geom.1,
            });
            if (g.kv_dim, g.aux_dim) != geom {
                return Err(format!(
                    "op {j}: KV rows of {} + {} floats, against {} + {} before",
                    geom.0, geom.1, g.kv_dim, g.aux_dim
                ));
            }
            g.layers = g.layers.max(layer + 1);
            attends.push((j, layer));
            let mut place = |b: Buf, t: Target| -> Result<(), String> {
                let p = producer(ops, j, b).ok_or_else(|| {
                    format!(
                        "op {j}: `{}` is read before any op writes it",
                        prog.decl(b).name
                    )
                })?;
                redirect[p].push((b, t));
                Ok(())
            };
            place(k, Target::K(layer))?;
            place(v, Target::V(layer))?;
            if let Some(ik) = ik {
                place(ik, Target::Aux(layer))?;
            }
        }
        if layers_seen.len() != kv.map_or(0, |g| g.layers) {
            return Err(format!(
                "attention layers {:?} are not 0..{}",
                {
                    let mut l: Vec<_> = layers_seen.into_iter().collect();
                    l.sort_unstable();
                    l
                },
                kv.map_or(0, |g| g.layers)
            ));
        }
        let readers = ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                op.writes()
                    .into_iter()
                    .map(|b| (b, readers_after(ops, i, b)))
                    .collect()
            })
            .collect();
        let part_per_token = ops
            .iter()
            .filter_map(|op| match op {
                Op::Matmul { jobs, .. } => Some(jobs),
                _ => None,
            })
            .filter(|jobs| jobs.iter().all(|j| prog.decl(j.out).rows == Rows::Tokens))
            .map(|jobs| {
                jobs.iter()
                    .map(|j| {
                        let s = &tables.mats[j.w.0 as usize].shape;
                        let (rows, cols) = (
                            s.first().copied().unwrap_or(0),
                            s.get(1).copied().unwrap_or(0),
                        );
                        cols.div_ceil(64) * rows
                    })
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        let max_cols = ops
            .iter()
            .filter_map(|op| match op {
                Op::Matmul { jobs, .. } => Some(jobs),
                _ => None,
            })
            .flatten()
            .map(|j| {
                tables.mats[j.w.0 as usize]
                    .shape
                    .get(1)
                    .copied()
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let fusable_attention = !attends.is_empty()
            && ops.iter().all(|o| match o {
                Op::RopeKvAttend { spec, .. } => {
                    !spec.patched() && spec.shape.head_dim % 2 == 0 && spec.shape.head_dim <= 256
                }
                _ => true,
            });
        let heads = ops
            .iter()
            .find_map(|o| match o {
                Op::RopeKvAttend { spec, .. } => Some(spec.shape.n_heads),
                _ => None,
            })
            .unwrap_or(0);
        let split_per_tile = ops
            .iter()
            .map(|o| match o {
                Op::RopeKvAttend { spec, .. } => {
                    lmrr_kernels::split_kv_floats(spec.shape.n_heads, 1, spec.shape.head_dim)
                }
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let gather_alias = ops
            .iter()
            .enumerate()
            .filter_map(|(i, o)| match o {
                Op::GatherWanted { x, out } => ops[i + 1..]
                    .iter()
                    .all(|later| {
                        let w = later.writes();
                        !w.contains(x) && !w.contains(out)
                    })
                    .then_some(i),
                _ => None,
            })
            .collect();
        let in_place = ops
            .iter()
            .map(|op| {
                let r = op.reads();
                op.writes().into_iter().filter(|b| r.contains(b)).collect()
            })
            .collect();
        Ok(Self {
            in_place,
            fusable_attention,
            heads,
            split_per_tile,
            gather_alias,
            kv: kv.unwrap_or(KvGeom {
                layers: 0,
                kv_dim: 0,
                aux_dim: 0,
            }),
            redirect,
            readers,
            part_per_token,
            max_cols,
            has_moe: ops.iter().any(|o| matches!(o, Op::Moe { .. })),
            attends,
        })
    }

    /// Where op `i` writes buffer `b`, given where `b` is now (`cur`):
    /// staging for an attention op's operands (its unrotated K rows in
    /// [`Loc::KRaw`] when `fused_k`), the same place for an op that writes
    /// in place, else the buffer's own region.
    pub fn write_loc(&self, i: usize, b: Buf, cur: Loc, fused_k: bool) -> Loc {
        if let Some((_, t)) = self.redirect[i].iter().find(|(x, _)| *x == b) {
            return match *t {
                Target::K(_) if fused_k => Loc::KRaw,
                Target::K(l) => Loc::StageK(l),
                Target::V(l) => Loc::StageV(l),
                Target::Aux(l) => Loc::StageAux(l),
            };
        }
        if self.in_place[i].contains(&b) {
            cur
        } else {
            Loc::Own(b)
        }
    }

    /// How many ops read the value op `i` writes to `b` before `b` is
    /// written again.
    pub fn readers(&self, i: usize, b: Buf) -> u32 {
        self.readers[i]
            .iter()
            .find(|(x, _)| *x == b)
            .map_or(0, |r| r.1)
    }
}

/// The last op before `j` that writes `b` and does not also read it (an
/// in-place op keeps the value where its producer put it).
fn producer(ops: &[Op], j: usize, b: Buf) -> Option<usize> {
    (0..j)
        .rev()
        .find(|&p| ops[p].writes().contains(&b) && !ops[p].reads().contains(&b))
}

/// The ops after `i` that read `b` before an op writes it again (an op that
/// reads and writes it counts, and ends the run).
fn readers_after(ops: &[Op], i: usize, b: Buf) -> u32 {
    let mut n = 0;
    for op in &ops[i + 1..] {
        if op.reads().contains(&b) {
            n += 1;
        }
        if op.writes().contains(&b) {
            break;
        }
    }
    n
}

/// Float offsets of each buffer's region in a step's arena of `n` token rows
/// and `m` wanted rows, each region 64-float aligned; and the arena's size.
pub fn arena(prog: &Program, n: usize, m: usize) -> (Vec<usize>, usize) {
    let mut off = Vec::with_capacity(prog.bufs.len());
    let mut at = 0usize;
    for d in &prog.bufs {
        off.push(at);
        let rows = match d.rows {
            Rows::Tokens => n,
            Rows::Wanted => m,
        };
        at += (rows * d.width).div_ceil(64) * 64;
    }
    (off, at)
}

/// A table of what `write_loc` decides for every op, for tests and dumps:
/// per op, each buffer written and where.
pub fn placements(plan: &Plan, prog: &Program, fused_k: bool) -> Vec<Vec<(Buf, Loc)>> {
    let mut cur: HashMap<Buf, Loc> = HashMap::new();
    prog.ops
        .iter()
        .enumerate()
        .map(|(i, op)| {
            op.writes()
                .into_iter()
                .map(|b| {
                    let now = cur.get(&b).copied().unwrap_or(Loc::Own(b));
                    let l = plan.write_loc(i, b, now, fused_k);
                    cur.insert(b, l);
                    (b, l)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use lmrr_kernels::{AttnShape, RopeTable};

    use super::*;
    use crate::model::exec::{AttnSpec, Builder, Mat, MatJob, Vector};
    use crate::weights::Tensor;

    const D: usize = 8;
    const SHAPE: AttnShape = AttnShape {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
    };

    fn mat(name: &str, rows: usize, cols: usize) -> Tensor {
        Tensor::from_bf16(name.into(), vec![rows, cols], vec![0x3f80; rows * cols])
    }

    /// A two-layer llama-shaped program: embed, per layer norm → q/k/v →
    /// attention → o + residual, then the wanted rows' norm and head.
    fn program() -> (Program, Vec<usize>) {
        program_with(AttnSpec::canonical(SHAPE))
    }

    /// [`program`] with every attention op's spec `spec`.
    fn program_with(spec: AttnSpec) -> (Program, Vec<usize>) {
        let mut b = Builder::default();
        let x = b.buf("x", Rows::Tokens, D);
        let h = b.buf("h", Rows::Tokens, D);
        let q = b.buf("q", Rows::Tokens, SHAPE.q_dim());
        let k = b.buf("k", Rows::Tokens, SHAPE.kv_dim());
        let v = b.buf("v", Rows::Tokens, SHAPE.kv_dim());
        let att = b.buf("att", Rows::Tokens, SHAPE.q_dim());
        let o = b.buf("o", Rows::Tokens, D);
        let hx = b.buf("last", Rows::Wanted, D);
        let hn = b.buf("last_norm", Rows::Wanted, D);
        let logits = b.buf("logits", Rows::Wanted, 16);
        b.op(Op::Embed {
            table: Mat(0),
            out: x,
        });
        let mut qkv_ops = Vec::new();
        for layer in 0..2u32 {
            b.rms_norm(x, Vector(0), 1e-5, h);
            let m0 = 1 + 4 * layer;
            let job = |w: u32, out| MatJob {
                w: Mat(w),
                out,
                bias: None,
            };
            qkv_ops.push(b.len());
            b.op(Op::Matmul {
                x: h,
                jobs: vec![job(m0, q), job(m0 + 1, k), job(m0 + 2, v)],
            });
            b.op(Op::RopeKvAttend {
                layer: layer as usize,
                rope: 0,
                q,
                k,
                v,
                out: att,
                spec,
            });
            b.matmul(att, Mat(m0 + 3), o);
            b.op(Op::AddInto { x, y: o });
        }
        b.op(Op::GatherWanted { x, out: hx });
        b.rms_norm(hx, Vector(0), 1e-5, hn);
        b.matmul(hn, Mat(0), logits);
        (b.finish(logits), qkv_ops)
    }

    fn with_tables<T>(f: impl FnOnce(&Tables) -> T) -> T {
        let mut mats = vec![mat("embed", 16, D)];
        for l in 0..2 {
            mats.push(mat(&format!("{l}.q"), SHAPE.q_dim(), D));
            mats.push(mat(&format!("{l}.k"), SHAPE.kv_dim(), D));
            mats.push(mat(&format!("{l}.v"), SHAPE.kv_dim(), D));
            mats.push(mat(&format!("{l}.o"), D, SHAPE.q_dim()));
        }
        let norm = vec![1.0f32; D];
        let rope = RopeTable::new(SHAPE.head_dim, 10_000.0, 64);
        let tables = Tables {
            mats: mats.iter().collect(),
            vecs: vec![&norm],
            ropes: vec![&rope],
        };
        f(&tables)
    }

    #[test]
    fn each_layers_k_and_v_are_made_into_its_staging_and_k_raw_when_fused() {
        let (prog, qkv) = program();
        with_tables(|t| {
            let plan = Plan::new(&prog, t).expect("plan");
            assert_eq!(
                plan.kv,
                KvGeom {
                    layers: 2,
                    kv_dim: SHAPE.kv_dim(),
                    aux_dim: 0
                }
            );
            let (q, k, v) = (Buf(2), Buf(3), Buf(4));
            for fused in [false, true] {
                let at = placements(&plan, &prog, fused);
                for (layer, &i) in qkv.iter().enumerate() {
                    let k_at = if fused { Loc::KRaw } else { Loc::StageK(layer) };
                    assert_eq!(
                        at[i],
                        vec![(q, Loc::Own(q)), (k, k_at), (v, Loc::StageV(layer))]
                    );
                }
                // The residual add writes x where x is: its own region.
                let add = qkv[0] + 3;
                assert_eq!(at[add], vec![(Buf(0), Loc::Own(Buf(0)))]);
            }
            assert!(plan.fusable_attention);
            assert_eq!((plan.heads, plan.has_moe), (2, false));
        });
    }

    #[test]
    fn readers_count_until_the_next_write_and_the_gather_may_alias() {
        let (prog, qkv) = program();
        with_tables(|t| {
            let plan = Plan::new(&prog, t).expect("plan");
            // q, k and v: the attention alone; o: the residual add alone.
            for b in [Buf(2), Buf(3), Buf(4)] {
                assert_eq!(plan.readers(qkv[0], b), 1);
            }
            assert_eq!(plan.readers(qkv[0] + 2, Buf(6)), 1);
            // x after the first layer's add: the next norm and the next add
            // (which writes it again).
            assert_eq!(plan.readers(qkv[0] + 3, Buf(0)), 2);
            let gather = prog.ops.len() - 3;
            assert_eq!(plan.gather_alias, vec![gather]);
            assert_eq!(
                plan.part_per_token,
                D.div_ceil(64) * (SHAPE.q_dim() + 2 * SHAPE.kv_dim())
            );
        });
    }

    /// A sliding window is an argument of every attention kernel, the fused
    /// decode one included; an attention patch has no device kernel.
    #[test]
    fn a_window_keeps_the_fused_decode_attention_and_a_patch_does_not() {
        let mut windowed = AttnSpec::canonical(SHAPE);
        windowed.window = Some(16);
        let mut patched = AttnSpec::canonical(SHAPE);
        patched.fast_exp = true;
        for (spec, fusable) in [(windowed, true), (patched, false)] {
            let (prog, _) = program_with(spec);
            with_tables(|t| {
                let plan = Plan::new(&prog, t).expect("plan");
                assert_eq!(plan.fusable_attention, fusable, "{spec:?}");
            });
        }
    }

    #[test]
    fn a_program_that_reads_k_before_writing_it_is_refused_by_name() {
        let (mut prog, qkv) = program();
        prog.ops.remove(qkv[0]);
        with_tables(|t| {
            let err = Plan::new(&prog, t).expect_err("k is never made");
            assert!(err.contains("`k` is read before any op writes it"), "{err}");
        });
    }

    #[test]
    fn arena_regions_are_aligned_and_disjoint() {
        let (prog, _) = program();
        let (off, total) = arena(&prog, 5, 2);
        let mut end = 0;
        for (d, &o) in prog.bufs.iter().zip(&off) {
            assert_eq!(o % 64, 0);
            assert!(o >= end, "{} overlaps the region before it", d.name);
            let rows = if d.rows == Rows::Tokens { 5 } else { 2 };
            end = o + rows * d.width;
        }
        assert!(total >= end);
    }
}
