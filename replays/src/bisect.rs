//! Finding the culprit patch(es): binary search when one patch is responsible
//! (at most ⌈log₂ n⌉ + 1 replays), delta debugging (ddmin, Zeller & Hildebrandt)
//! when only a combination diverges. Every probe is a replay that stops at its
//! first divergence; results are cached by set.
//!
//! Invariant: a culprit is only ever named after four checks, in the spirit of
//! `git bisect` refusing an inconsistent good/bad pair: the base (good) set
//! replays clean, the full (bad) set diverges, the culprit set diverges, and
//! the bad set without the culprit replays clean. When one fails the outcome
//! says which ([`Verdict`]) and names no culprit as confirmed.

use std::collections::BTreeMap;

use serde::Serialize;

use lmrr_engine::{Patch, PatchSet};

use crate::driver::{replay, Criterion, ReplayError, ReplayOptions};
use crate::report::{bits_moved, plural, Signal};

/// One replay made by the search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    /// Patches applied (the base set included).
    pub set: String,
    pub diverged: bool,
    pub step: Option<u64>,
    pub signal: Option<Signal>,
    /// For a probe that did not diverge by its criterion: the first step
    /// where some bit moved anyway (`None`: bit-exact).
    pub bits_from: Option<(u64, Signal)>,
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.diverged, self.step, self.signal, self.bits_from) {
            (true, Some(s), Some(sig), _) => write!(f, "DIVERGES at step {s} ({sig})"),
            (true, _, _, _) => write!(f, "DIVERGES"),
            (false, _, _, None) => write!(f, "bit-exact"),
            (false, _, _, Some((step, sig))) => {
                write!(f, "same behaviour; {}", bits_moved(sig, step))
            }
        }
    }
}

/// How a search ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "kebab-case")]
pub enum Verdict {
    /// Culprit found and confirmed by both checks.
    Culprit,
    /// The base (good) set already diverges: nothing it is compared against
    /// is known good.
    BaseDiverges,
    /// The full (bad) set replays clean: there is no divergence to explain.
    BadClean,
    /// The culprit set found by the search does not diverge on its own
    /// (the probes were inconsistent).
    CulpritClean,
    /// The bad set without the culprit still diverges: another patch (or
    /// combination) of the bad set diverges too.
    RestDiverges { rest: String },
}

/// The search's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BisectOutcome {
    pub probes: Vec<Probe>,
    /// The minimal set found (on top of the base). Confirmed only when the
    /// verdict is [`Verdict::Culprit`].
    pub culprits: Option<Vec<String>>,
    /// `binary` or `ddmin`; `none` when the search was refused before it began.
    pub method: &'static str,
    pub base: String,
    /// The full set searched: base and every candidate.
    pub bad: String,
    pub verdict: Verdict,
}

impl BisectOutcome {
    /// A culprit was found and confirmed.
    pub fn found(&self) -> bool {
        self.verdict == Verdict::Culprit
    }

    /// Replays made (probes are cached: a set is never replayed twice).
    pub fn replays(&self) -> usize {
        self.probes.len()
    }
}

impl std::fmt::Display for BisectOutcome {
    /// The probe table, then the culprit or the check that failed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, p) in self.probes.iter().enumerate() {
            let role = if p.set == self.base {
                " (good)"
            } else if p.set == self.bad {
                " (bad)"
            } else {
                ""
            };
            writeln!(f, "probe {}: {:<45} {p}", i + 1, format!("{}{role}", p.set))?;
        }
        let culprit = self.culprits.clone().unwrap_or_default().join(",");
        let n = plural(self.replays() as u64, "replay");
        match &self.verdict {
            Verdict::Culprit => write!(f, "culprit ({}, {n}): {culprit}", self.method),
            Verdict::BaseDiverges => write!(
                f,
                "refused: the good set `{}` already diverges, so no patch can be blamed \
                 (pass --good with a set that replays clean; a bundle recorded with \
                 patches replays clean under its own set)",
                self.base
            ),
            Verdict::BadClean => write!(
                f,
                "refused: the bad set `{}` replays clean: there is no divergence to explain",
                self.bad
            ),
            Verdict::CulpritClean => write!(
                f,
                "refused: the search ended at `{culprit}`, but that set does not diverge \
                 on top of `{}` (inconsistent probes)",
                self.base
            ),
            Verdict::RestDiverges { rest } => write!(
                f,
                "refused: `{culprit}` diverges, but the bad set without it (`{rest}`) \
                 diverges too: more than one culprit. Bisect again with --bad {rest}"
            ),
        }
    }
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
/// set, after checking that `base` is clean and base + every candidate
/// diverges, and confirms the result (see the module header). `run` replays
/// the bundle under a full patch set.
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
    let bad: PatchSet = base.iter().chain(candidates.iter().copied()).collect();
    let finish = |s: Searcher<'_, E>, culprits: Option<&[Patch]>, method, verdict| BisectOutcome {
        probes: s.probes,
        culprits: culprits.map(|c| c.iter().map(|p| p.name().to_string()).collect()),
        method,
        base: base.to_string(),
        bad: bad.to_string(),
        verdict,
    };
    if s.diverges(&[])? {
        return Ok(finish(s, None, "none", Verdict::BaseDiverges));
    }
    if candidates.is_empty() || !s.diverges(candidates)? {
        return Ok(finish(s, None, "none", Verdict::BadClean));
    }
    // Binary search, assuming one culprit: keep the half that diverges, or the
    // other half unprobed; the survivor is probed below (cached if it was).
    let mut cur: Vec<Patch> = candidates.to_vec();
    while cur.len() > 1 {
        let half = cur.len() / 2;
        let (left, right) = (cur[..half].to_vec(), cur[half..].to_vec());
        cur = if s.diverges(&left)? { left } else { right };
    }
    let (culprits, method) = if s.diverges(&cur)? {
        (cur, "binary")
    } else {
        // No single culprit on the binary path: a combination.
        (s.ddmin(candidates.to_vec())?, "ddmin")
    };
    // Confirm: the culprit set diverges, and the bad set without it is clean.
    if !s.diverges(&culprits)? {
        return Ok(finish(s, Some(&culprits), method, Verdict::CulpritClean));
    }
    let rest: Vec<Patch> = candidates
        .iter()
        .copied()
        .filter(|p| !culprits.contains(p))
        .collect();
    if s.diverges(&rest)? {
        let rest = base
            .iter()
            .chain(rest.iter().copied())
            .collect::<PatchSet>();
        let v = Verdict::RestDiverges {
            rest: rest.to_string(),
        };
        return Ok(finish(s, Some(&culprits), method, v));
    }
    Ok(finish(s, Some(&culprits), method, Verdict::Culprit))
}

/// Every independent culprit: [`bisect`], then, while a confirmed search
/// ends in [`Verdict::RestDiverges`], [`bisect`] again over the rest of the
/// candidates. Each round names one culprit set; the last round either
/// confirms its culprit with the rest clean ([`Verdict::Culprit`]) or says
/// why it stopped. Probes are shared across rounds (a set is replayed once).
pub fn bisect_all<E>(
    base: &PatchSet,
    candidates: &[Patch],
    run: &mut dyn FnMut(&PatchSet) -> Result<Probe, E>,
) -> Result<Vec<BisectOutcome>, E> {
    let mut seen: BTreeMap<String, Probe> = BTreeMap::new();
    let mut cached = |set: &PatchSet| -> Result<Probe, E> {
        if let Some(p) = seen.get(&set.to_string()) {
            return Ok(p.clone());
        }
        let p = run(set)?;
        seen.insert(set.to_string(), p.clone());
        Ok(p)
    };
    let mut rounds = Vec::new();
    let mut cur: Vec<Patch> = candidates.to_vec();
    loop {
        let r = bisect(base, &cur, &mut cached)?;
        let next = match (&r.verdict, &r.culprits) {
            (Verdict::RestDiverges { .. }, Some(c)) => {
                let rest: Vec<Patch> = cur
                    .iter()
                    .copied()
                    .filter(|p| !c.iter().any(|n| n == p.name()))
                    .collect();
                (rest.len() < cur.len()).then_some(rest)
            }
            _ => None,
        };
        rounds.push(r);
        match next {
            Some(rest) => cur = rest,
            None => return Ok(rounds),
        }
    }
}

/// Whether a [`bisect_all`] search named every culprit: each round found one,
/// and the last one's rest replays clean.
pub fn all_found(rounds: &[BisectOutcome]) -> bool {
    rounds.last().is_some_and(|r| r.found())
        && rounds
            .iter()
            .all(|r| r.found() || matches!(r.verdict, Verdict::RestDiverges { .. }))
}

/// A [`bisect_all`] search as text: one round prints as [`BisectOutcome`]
/// does; several print round by round (cached probes cost no replay), then
/// every culprit named.
pub fn rounds_text(rounds: &[BisectOutcome]) -> String {
    if let [one] = rounds {
        return one.to_string();
    }
    let mut s = String::new();
    for (i, r) in rounds.iter().enumerate() {
        s += &format!(
            "round {}: candidates `{}` on top of `{}`\n",
            i + 1,
            r.bad,
            r.base
        );
        let text = r.to_string();
        let lines: Vec<&str> = text.lines().collect();
        let (table, last) = lines.split_at(lines.len().saturating_sub(1));
        for l in table {
            s += &format!("  {l}\n");
        }
        match (&r.verdict, &r.culprits) {
            (Verdict::RestDiverges { rest }, Some(c)) => {
                s += &format!(
                    "  culprit ({}): {}; the bad set without it (`{rest}`) still diverges: searching it\n",
                    r.method,
                    c.join(",")
                );
            }
            _ => {
                for l in last {
                    s += &format!("  {l}\n");
                }
            }
        }
    }
    let named: Vec<String> = all_culprits(rounds).iter().map(|c| c.join(",")).collect();
    if all_found(rounds) {
        s += &format!(
            "culprits ({}): {} — each diverges on top of the good set, and the bad set without them replays clean",
            plural(rounds.len() as u64, "round"),
            named.join("; ")
        );
    } else {
        s += &format!(
            "stopped after {}: named {}; the last round did not confirm a culprit",
            plural(rounds.len() as u64, "round"),
            if named.is_empty() {
                "none".into()
            } else {
                named.join("; ")
            }
        );
    }
    s
}

/// The culprit sets a [`bisect_all`] search named, in order.
pub fn all_culprits(rounds: &[BisectOutcome]) -> Vec<Vec<String>> {
    rounds.iter().filter_map(|r| r.culprits.clone()).collect()
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
        bits_from: match r {
            crate::Outcome::SameBehaviour {
                bits_from,
                bits_signal,
                ..
            } => Some((bits_from, bits_signal)),
            _ => None,
        },
    })
}
