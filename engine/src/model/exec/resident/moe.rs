//! The resident executor's MoE op: router logits on the device, brought
//! back (the step's one host round trip per MoE op) and routed on the host
//! by the host executor's own [`route`]; each chosen expert over its rows
//! (gathered in row order), the shared expert over every row, and the
//! combine per row on the device.
//!
//! Invariant: the same bits as the host executor's MoE
//! (`exec::moe::run`): the route is the same function of the same logits,
//! each expert's rows are the same rows (a matmul row does not depend on
//! the others), and `moe_combine_idx` is `moe_combine`'s fma chain over the
//! chosen experts ascending, from the shared output or `+0.0`.

use lmrr_kernels::cuda::resident::{DevBuf, MmOut, SplitScratch};
use lmrr_kernels::Route;

use super::launch::Runner;
use crate::model::exec::moe::route;
use crate::model::exec::{ExpertMats, Mat, RoutingSpec};
use crate::model::gpu_err;
use crate::EngineError;

/// One MoE op's operands on the device.
pub(super) struct MoeJob<'o> {
    pub x: u64,
    pub out: u64,
    pub d: usize,
    pub router: Mat,
    pub experts: &'o [ExpertMats],
    pub shared: Option<&'o ExpertMats>,
    pub routing: &'o RoutingSpec,
}

impl Runner<'_> {
    pub(super) fn moe(
        &mut self,
        job: &MoeJob,
        slot: &mut Option<(DevBuf, usize)>,
    ) -> Result<(), EngineError> {
        let g = self.r.gpu();
        let dev = &self.r.dev;
        let e = gpu_err;
        let (n, d) = (self.n, job.d);
        if n == 0 {
            return Ok(());
        }
        let ne = job.experts.len();
        let ff = |m: Mat| dev.mats[m.0 as usize].rows;
        let f = job
            .experts
            .iter()
            .chain(job.shared)
            .map(|x| ff(x.gate))
            .max()
            .unwrap_or(0);
        // Routes, from the router logits brought back.
        let k_max = match *job.routing {
            RoutingSpec::V4 { k, .. }
            | RoutingSpec::SoftmaxTopK { k, .. }
            | RoutingSpec::SigmoidGroupTopK { k, .. } => k,
        };
        let entries_cap = n * k_max.max(1);
        // Scratch (floats): logits, gathered rows, gate, up, act, expert
        // outputs, the shared expert's gate/up/act/output, the row lists
        // (u64), the combine's entry rows and offsets (i32), its gates.
        let fl = [
            n * ne,
            entries_cap * d,
            entries_cap * f,
            entries_cap * f,
            entries_cap * f,
            entries_cap * d,
            n * f,
            n * f,
            n * f,
            n * d,
            2 * entries_cap,
            entries_cap + n + 1,
            entries_cap,
        ];
        let mut at = [0u64; 13];
        let mut off = 0usize;
        for (a, &c) in at.iter_mut().zip(&fl) {
            *a = 4 * off as u64;
            off += c.div_ceil(64) * 64;
        }
        let base = self.r.moe_scratch(slot, off)?;
        let [lg, xe, ge, ue, ae, ye, gs, us, as_, bs, rl, ix, gt] = at.map(|o| base + o);
        g.mm(job.x, n, &dev.mats[job.router.0 as usize], lg)
            .map_err(e)?;
        let mut logits = vec![0.0f32; n * ne];
        g.dtoh(lg, &mut logits).map_err(e)?;
        let ids: Vec<u32> = self
            .spans
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let routes: Vec<Route> = logits
            .chunks(ne.max(1))
            .zip(&ids)
            .map(|(l, &t)| route(job.routing, self.tables, t, l))
            .collect();
        // Entries by expert, rows ascending within each; each row's entries
        // in its route's (ascending expert) order for the combine.
        let mut start = vec![0usize; ne + 1];
        for r in &routes {
            for &x in &r.experts {
                if x >= ne {
                    return Err(EngineError::Device(format!(
                        "a route names expert {x} of {ne}"
                    )));
                }
                start[x + 1] += 1;
            }
        }
        for x in 0..ne {
            start[x + 1] += start[x];
        }
        let total = start[ne];
        if total > entries_cap {
            return Err(EngineError::Device(format!(
                "{total} routed entries for {n} rows of top-{k_max}"
            )));
        }
        let mut fill = start.clone();
        let mut rows_of = vec![0u64; total];
        let mut idx = vec![0i32; total];
        let mut offs = vec![0i32; n + 1];
        let mut gates = vec![0.0f32; total];
        let mut at_entry = 0usize;
        for (t, r) in routes.iter().enumerate() {
            for (&x, &gate) in r.experts.iter().zip(&r.gates) {
                let q = fill[x];
                fill[x] += 1;
                rows_of[q] = t as u64;
                idx[at_entry] = q as i32;
                gates[at_entry] = gate;
                at_entry += 1;
            }
            offs[t + 1] = at_entry as i32;
        }
        // One upload: the row lists (u64), then the combine's entry rows and
        // offsets (i32) and its gates (f32), at the offsets of `rl`, `ix`
        // and `gt` in the scratch (consecutive regions).
        let mut up: Vec<u8> = Vec::with_capacity(((gt - rl) as usize) + 4 * total);
        up.extend(rows_of.iter().flat_map(|r| r.to_le_bytes()));
        up.resize((ix - rl) as usize, 0);
        up.extend(idx.iter().chain(&offs).flat_map(|v| v.to_le_bytes()));
        up.resize((gt - rl) as usize, 0);
        up.extend(gates.iter().flat_map(|v| v.to_le_bytes()));
        g.htod(&up, rl).map_err(e)?;
        let sp = SplitScratch {
            addr: self.a.part,
            floats: self.a.part_floats,
        };
        // One expert over `rows` rows at `xa` into `y`, through g/u/a.
        let expert = |mats: &ExpertMats,
                      xa: u64,
                      rows: usize,
                      (gg, uu, aa): (u64, u64, u64),
                      y: u64|
         -> Result<(), EngineError> {
            let w = |m: Mat| &dev.mats[m.0 as usize];
            let gu = g
                .mm_outs(xa, rows, &[(w(mats.gate), gg), (w(mats.up), uu)], sp, true)
                .map_err(e)?;
            g.swiglu_out(gu[0], gu[1], aa, rows * ff(mats.gate))
                .map_err(e)?;
            let dn = g
                .mm_outs(aa, rows, &[(w(mats.down), y)], sp, false)
                .map_err(e)?;
            debug_assert!(dn.iter().all(|o: &MmOut| !o.is_split()));
            Ok(())
        };
        // Every routed row gathered in one launch: entries are laid out by
        // expert, rows ascending within each, so expert x's rows are the
        // block of its entries.
        g.gather(job.x, rl, total, d, xe).map_err(e)?;
        for (x, mats) in job.experts.iter().enumerate() {
            let (s, c) = (start[x], start[x + 1] - start[x]);
            if c == 0 {
                continue;
            }
            let xs = xe + 4 * (s * d) as u64;
            let fo = |b: u64| b + 4 * (s * f) as u64;
            expert(
                mats,
                xs,
                c,
                (fo(ge), fo(ue), fo(ae)),
                ye + 4 * (s * d) as u64,
            )?;
        }
        let shared_out = match job.shared {
            Some(mats) => {
                expert(mats, job.x, n, (gs, us, as_), bs)?;
                bs
            }
            None => 0,
        };
        g.moe_combine_dev(shared_out, gt, ye, ix, ix + 4 * total as u64, job.out, n, d)
            .map_err(e)
    }
}
