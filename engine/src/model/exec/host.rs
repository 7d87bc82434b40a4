//! The host executor: runs a [`Program`] op by op from host buffers, each op
//! one call of [`Ops`] on the model's device — `lmrr_kernels`' canonical
//! kernels on the CPU (the reference every other executor must match bit for
//! bit), or their CUDA mirror with operands copied per call (portable, not
//! fast: the resident CUDA executor is the fast path).
//!
//! Owns the step's host buffers (one `Vec<f32>` per declared buffer, sized
//! from the step) and the KV store traffic of [`Op::RopeKvAttend`] (that of
//! [`Op::MlaAttend`] is [`super::mla`]'s). Knows no
//! family: everything it reads comes from the program and the [`Tables`].

use lmrr_kernels::{self as k, AttnTask};

use super::hyper::{self, Trace};
use super::program::{Act, Buf, Op, Program, Rows, Tables};
use super::Step;
use crate::kv::KvCache;
use crate::model::add_into;
use crate::model::ops::Ops;
use crate::patches::{Patch, PatchSet};
use crate::EngineError;

/// Runs `prog` over `step` with `ops`; returns the logits buffer
/// (`wanted rows × vocab`).
pub fn run(
    prog: &Program,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
) -> Result<Vec<f32>, EngineError> {
    run_with(prog, tables, step, kv, ops, Extras::default())
}

/// What a run may also do besides computing: keep the indexer's choices of
/// one token ([`Trace`], for `explain`), and time each op by name
/// ([`Profile`], for `lmrr bench`). Neither changes a bit.
#[derive(Default)]
pub struct Extras<'e> {
    pub trace: Option<&'e mut Trace>,
    pub profile: Option<&'e Profile>,
}

/// Seconds spent per op name since the last [`Profile::take`].
#[derive(Default)]
pub struct Profile(std::sync::Mutex<Vec<(&'static str, f64)>>);

impl Profile {
    pub(super) fn add(&self, name: &'static str, secs: f64) {
        let mut parts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match parts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, s)) => *s += secs,
            None => parts.push((name, secs)),
        }
    }

    /// The parts in first-seen order, and zeroes them.
    pub fn take(&self) -> Vec<(&'static str, f64)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The parts in first-seen order.
    pub fn parts(&self) -> Vec<(&'static str, f64)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// [`run`] with [`Extras`].
pub fn run_with(
    prog: &Program,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    mut extras: Extras,
) -> Result<Vec<f32>, EngineError> {
    let n = step.tok.len();
    let m = step.rows.len();
    let mut bufs: Vec<Vec<f32>> = prog
        .bufs
        .iter()
        .map(|d| {
            let rows = match d.rows {
                Rows::Tokens => n,
                Rows::Wanted => m,
            };
            vec![0.0; rows * d.width]
        })
        .collect();
    let t_step = std::time::Instant::now();
    for op in &prog.ops {
        let t0 = std::time::Instant::now();
        if let Op::MlaAttend { .. } = op {
            super::mla::exec(
                op,
                tables,
                step,
                kv,
                ops,
                &mut bufs,
                extras.trace.as_deref_mut(),
            )?;
        } else {
            exec(op, prog, tables, step, kv, ops, &mut bufs)?;
        }
        if let Some(p) = extras.profile {
            p.add(op.name(), t0.elapsed().as_secs_f64());
        }
    }
    if let Some(p) = extras.profile {
        p.add("step", t_step.elapsed().as_secs_f64());
    }
    Ok(std::mem::take(&mut bufs[prog.logits.0 as usize]))
}

/// `bufs[a]` for reading and `bufs[b]` for writing, `a != b`.
pub(super) fn pair(bufs: &mut [Vec<f32>], a: Buf, b: Buf) -> (&[f32], &mut [f32]) {
    let (a, b) = (a.0 as usize, b.0 as usize);
    assert_ne!(a, b, "an op reads and writes one buffer");
    if a < b {
        let (lo, hi) = bufs.split_at_mut(b);
        (&lo[a], &mut hi[0])
    } else {
        let (lo, hi) = bufs.split_at_mut(a);
        (&hi[0], &mut lo[b])
    }
}

pub(super) fn exec(
    op: &Op,
    prog: &Program,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    bufs: &mut [Vec<f32>],
) -> Result<(), EngineError> {
    match op {
        Op::Embed { table, out } => {
            let t = tables.mats[table.0 as usize];
            let d = prog.decl(*out).width;
            let out = &mut bufs[out.0 as usize];
            for (i, &id) in step.ids.iter().enumerate() {
                t.row_into(id as usize, &mut out[i * d..(i + 1) * d]);
            }
        }
        Op::RmsNorm {
            x,
            w,
            eps_bits,
            out,
        } => {
            let (x, out) = pair(bufs, *x, *out);
            ops.norm(x, tables.vecs[w.0 as usize], f32::from_bits(*eps_bits), out)?;
        }
        Op::HeadRmsNorm {
            x,
            w,
            eps_bits,
            out,
        } => {
            // Rows of the head's width: the weight's length sets them.
            let (x, out) = pair(bufs, *x, *out);
            ops.norm(x, tables.vecs[w.0 as usize], f32::from_bits(*eps_bits), out)?;
        }
        Op::Scale { x, by_bits } => {
            let by = f32::from_bits(*by_bits);
            bufs[x.0 as usize].iter_mut().for_each(|v| *v *= by);
        }
        Op::Matmul { x, jobs } => {
            let rows = match prog.decl(*x).rows {
                Rows::Tokens => step.tok.len(),
                Rows::Wanted => step.rows.len(),
            };
            let xs = std::mem::take(&mut bufs[x.0 as usize]);
            let mats: Vec<_> = jobs
                .iter()
                .map(|j| tables.mats[j.w.0 as usize].matrix())
                .collect();
            let mut outs: Vec<Vec<f32>> = jobs
                .iter()
                .map(|j| std::mem::take(&mut bufs[j.out.0 as usize]))
                .collect();
            {
                let mut work: Vec<(&k::Matrix, &mut [f32])> = mats
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|(m, o)| (m, &mut o[..]))
                    .collect();
                ops.matmuls(&xs, rows, &mut work)?;
            }
            for (j, mut o) in jobs.iter().zip(outs) {
                if let Some(b) = j.bias {
                    let b = tables.vecs[b.0 as usize];
                    for row in o.chunks_mut(b.len()) {
                        add_into(row, b);
                    }
                }
                bufs[j.out.0 as usize] = o;
            }
            bufs[x.0 as usize] = xs;
        }
        Op::RopeKvAttend {
            layer,
            rope,
            q,
            k: kb,
            v,
            out,
            spec,
        } => {
            let (qd, kvd) = (spec.shape.q_dim(), spec.shape.kv_dim());
            let table = tables.ropes[*rope];
            let mut qs = std::mem::take(&mut bufs[q.0 as usize]);
            let mut ks = std::mem::take(&mut bufs[kb.0 as usize]);
            let vs = std::mem::take(&mut bufs[v.0 as usize]);
            for (i, &(si, pos)) in step.tok.iter().enumerate() {
                ops.rope_row(table, &mut qs[i * qd..(i + 1) * qd], pos)?;
                ops.rope_row(table, &mut ks[i * kvd..(i + 1) * kvd], pos)?;
                let r = i * kvd..(i + 1) * kvd;
                kv.write(step.spans[si].seq, *layer, pos, &ks[r.clone()], &vs[r]);
            }
            {
                let views: Vec<_> = step.spans.iter().map(|s| kv.view(s.seq, *layer)).collect();
                let tasks: Vec<AttnTask> = step
                    .tok
                    .iter()
                    .enumerate()
                    .map(|(i, &(si, pos))| AttnTask {
                        q: &qs[i * qd..(i + 1) * qd],
                        kv: &views[si],
                        pos,
                    })
                    .collect();
                let patches: PatchSet = [
                    spec.fast_exp.then_some(Patch::FastExp),
                    spec.splitk_decode.then_some(Patch::SplitkDecode),
                ]
                .into_iter()
                .flatten()
                .collect();
                let out = &mut bufs[out.0 as usize];
                if let Some(w) = spec.window {
                    if spec.patched() {
                        return Err(EngineError::Device(
                            "the attention patches fast-exp and splitk-decode have no sliding-window form".into(),
                        ));
                    }
                    ops.attend_window(&tasks, &spec.shape, spec.scale(), w as usize, out)?;
                } else {
                    ops.attend_patched(
                        &tasks,
                        step.spans,
                        &step.tok,
                        &patches,
                        &spec.shape,
                        spec.scale(),
                        out,
                    )?;
                }
            }
            bufs[q.0 as usize] = qs;
            bufs[kb.0 as usize] = ks;
            bufs[v.0 as usize] = vs;
        }
        Op::AddInto { x, y } => {
            let (y, x) = pair(bufs, *y, *x);
            add_into(x, y);
        }
        Op::Glu { gate, up, out, act } => {
            let g = std::mem::take(&mut bufs[gate.0 as usize]);
            let (u, o) = pair(bufs, *up, *out);
            match act {
                Act::Silu => ops.swiglu(&g, u, o)?,
                Act::GeluTanh => ops.geglu(&g, u, o)?,
            }
            bufs[gate.0 as usize] = g;
        }
        Op::GatherWanted { x, out } => {
            let d = prog.decl(*x).width;
            let (x, out) = pair(bufs, *x, *out);
            for (j, &i) in step.rows.iter().enumerate() {
                out[j * d..(j + 1) * d].copy_from_slice(&x[i * d..(i + 1) * d]);
            }
        }
        Op::Repeat { x, out } => {
            let d = prog.decl(*x).width;
            let (x, out) = pair(bufs, *x, *out);
            hyper::repeat(x, d, out);
        }
        Op::RoundBf16 { x } => {
            for v in bufs[x.0 as usize].iter_mut() {
                *v = hyper::bf16_round(*v);
            }
        }
        Op::HcSinkhorn {
            raw,
            iters,
            pre,
            post,
            res,
        } => {
            let s = prog.decl(*pre).width;
            let r = std::mem::take(&mut bufs[raw.0 as usize]);
            let mut pr = std::mem::take(&mut bufs[pre.0 as usize]);
            let mut po = std::mem::take(&mut bufs[post.0 as usize]);
            let mut rs = std::mem::take(&mut bufs[res.0 as usize]);
            ops.hc_coeffs(&r, s, *iters, &mut pr, &mut po, &mut rs)?;
            bufs[raw.0 as usize] = r;
            bufs[pre.0 as usize] = pr;
            bufs[post.0 as usize] = po;
            bufs[res.0 as usize] = rs;
        }
        Op::HcPre { x, pre, out } => {
            let (s, d) = (prog.decl(*pre).width, prog.decl(*out).width);
            let xs = std::mem::take(&mut bufs[x.0 as usize]);
            let (p, o) = pair(bufs, *pre, *out);
            ops.hc_pre(&xs, p, s, d, o)?;
            bufs[x.0 as usize] = xs;
        }
        Op::HcPost {
            x,
            res,
            post,
            y,
            out,
        } => {
            let (s, d) = (prog.decl(*post).width, prog.decl(*y).width);
            let xs = std::mem::take(&mut bufs[x.0 as usize]);
            let rs = std::mem::take(&mut bufs[res.0 as usize]);
            let ps = std::mem::take(&mut bufs[post.0 as usize]);
            let (ys, o) = pair(bufs, *y, *out);
            ops.hc_post(&xs, &rs, &ps, ys, s, d, o)?;
            bufs[x.0 as usize] = xs;
            bufs[res.0 as usize] = rs;
            bufs[post.0 as usize] = ps;
        }
        Op::StreamMean { x, out } => {
            let (w, d) = (prog.decl(*x).width, prog.decl(*out).width);
            let (x, out) = pair(bufs, *x, *out);
            hyper::stream_mean(x, w / d, d, out);
        }
        Op::MlaAttend { .. } => super::mla::exec(op, tables, step, kv, ops, bufs, None)?,
        Op::Moe {
            x,
            out,
            router,
            experts,
            shared,
            routing,
        } => {
            let rows = match prog.decl(*x).rows {
                Rows::Tokens => step.tok.len(),
                Rows::Wanted => step.rows.len(),
            };
            let ids: Vec<u32> = match prog.decl(*x).rows {
                Rows::Tokens => step.ids.clone(),
                Rows::Wanted => step.rows.iter().map(|&i| step.ids[i]).collect(),
            };
            let (x, out) = pair(bufs, *x, *out);
            super::moe::run(
                ops,
                tables,
                x,
                &ids,
                rows,
                *router,
                experts,
                shared.as_ref(),
                routing,
                out,
            )?;
        }
    }
    Ok(())
}
