//! Finding the culprit patch(es): binary search when one patch is responsible
//! (at most ⌈log₂ n⌉ + 1 replays), delta debugging (ddmin, Zeller & Hildebrandt)
//! when only a combination diverges. Every probe is a replay that stops at its
//! first divergence; results are cached by set.

use std::collections::BTreeMap;

use serde::Serialize;

use lmrr_engine::{Patch, PatchSet};

use crate::driver::{replay, Criterion, ReplayError, ReplayOptions};
use crate::report::Signal;

/// One replay made by the search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    /// Patches applied (the base set included).
    pub set: String,
    pub diverged: bool,
    pub step: Option<u64>,
    pub signal: Option<Signal>,
}

/// The search's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BisectOutcome {
    pub probes: Vec<Probe>,
    /// The minimal set found (on top of the base), or `None` if even the whole
    /// candidate set replays clean.
    pub culprits: Option<Vec<String>>,
    /// `binary` or `ddmin`.
    pub method: &'static str,
    pub base: String,
}

struct Searcher<'f, E> {
    base: PatchSet,
    cache: BTreeMap<Vec<Patch>, bool>,
    probes: Vec<Probe>,
    run: &'f mut dyn FnMut(&PatchSet) -> Result<Probe, E>,
}

impl<E> Searcher<'_, E> {
    fn diverges(&mut self, subset: &[Patch]) -> Result<bool, E> {
        let mut key = subset.to_vec();
        key.sort();
        if let Some(&d) = self.cache.get(&key) {
            return Ok(d);
        }
        let set: PatchSet = self.base.iter().chain(key.iter().copied()).collect();
        let p = (self.run)(&set)?;
        let d = p.diverged;
        self.probes.push(p);
        self.cache.insert(key, d);
        Ok(d)
    }

    fn ddmin(&mut self, mut c: Vec<Patch>) -> Result<Vec<Patch>, E> {
        let mut n = 2usize;
        while c.len() >= 2 {
            let chunks: Vec<Vec<Patch>> = (0..n)
                .map(|i| c[i * c.len() / n..(i + 1) * c.len() / n].to_vec())
                .collect();
            let mut reduced = false;
            for ch in &chunks {
                if !ch.is_empty() && self.diverges(ch)? {
                    c = ch.clone();
                    n = 2;
                    reduced = true;
                    break;
                }
            }
            if !reduced && n > 2 {
                for ch in &chunks {
                    let comp: Vec<Patch> = c.iter().copied().filter(|p| !ch.contains(p)).collect();
                    if !comp.is_empty() && self.diverges(&comp)? {
                        c = comp;
                        n = (n - 1).max(2);
                        reduced = true;
                        break;
                    }
                }
            }
            if !reduced {
                if n >= c.len() {
                    break;
                }
                n = (2 * n).min(c.len());
            }
        }
        Ok(c)
    }
}

/// Searches `candidates` (applied on top of `base`) for a minimal diverging
/// set. `run` replays the bundle under a full patch set.
pub fn bisect<E>(
    base: &PatchSet,
    candidates: &[Patch],
    run: &mut dyn FnMut(&PatchSet) -> Result<Probe, E>,
) -> Result<BisectOutcome, E> {
    let mut s = Searcher {
        base: base.clone(),
        cache: BTreeMap::new(),
        probes: Vec::new(),
        run,
    };
    let mut cur: Vec<Patch> = candidates.to_vec();
    let mut verified = false;
    // Binary search, assuming one culprit: keep the half that diverges, or the
    // other half unprobed; verify the last survivor if it was never probed.
    while cur.len() > 1 {
        let half = cur.len() / 2;
        let (left, right) = (cur[..half].to_vec(), cur[half..].to_vec());
        if s.diverges(&left)? {
            cur = left;
            verified = true;
        } else {
            cur = right;
            verified = false;
        }
    }
    let single = match cur.first() {
        Some(_) if verified => true,
        Some(_) => s.diverges(&cur)?,
        None => false,
    };
    let finish = |s: Searcher<'_, E>, culprits: Option<Vec<Patch>>, method| BisectOutcome {
        probes: s.probes,
        culprits: culprits.map(|c| c.iter().map(|p| p.name().to_string()).collect()),
        method,
        base: base.to_string(),
    };
    if single {
        return Ok(finish(s, Some(cur), "binary"));
    }
    // No single culprit on the binary path: is there any divergence at all?
    if candidates.is_empty() || !s.diverges(candidates)? {
        return Ok(finish(s, None, "binary"));
    }
    let c = s.ddmin(candidates.to_vec())?;
    Ok(finish(s, Some(c), "ddmin"))
}

/// One bisect probe: replays `bundle` under `set`, stopping at the first
/// divergence by `criterion`.
pub fn probe(
    bundle: &lmrr_recorder::Bundle,
    model: &lmrr_engine::Model,
    set: &PatchSet,
    threads: &lmrr_kernels::Threads,
    criterion: Criterion,
) -> Result<Probe, ReplayError> {
    let mut o = ReplayOptions::new(set.clone(), threads.clone());
    o.stop_at_first = true;
    o.criterion = criterion;
    let r = replay(bundle, model, &o)?;
    let d = r.divergence();
    Ok(Probe {
        set: set.to_string(),
        diverged: d.is_some(),
        step: d.map(|d| d.step),
        signal: d.map(|d| d.signal),
    })
}
