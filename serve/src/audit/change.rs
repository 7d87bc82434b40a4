//! The audit's change point: an upstream judged against itself.
//!
//! Per-turn verdicts measure a level (how far each answer is from the
//! reference). A cache-corruption bug shows as a *change*: an upstream that
//! matched the reference and stops matching right after an interrupt or a
//! prefix-cache hit, whatever the level of its new drift. So the turns
//! before the first such event (an interrupted turn before this one, or a
//! response whose usage reports cached prompt tokens) calibrate the
//! upstream, and every later turn is judged against that calibration:
//!
//! - a calibration in which every returned logprob had the reference's bits
//!   (*bit-faithful*) makes any later turn that is not bit-faithful a change;
//! - otherwise (an upstream with its own arithmetic, e.g. llama.cpp), a later
//!   turn changes only when its per-turn verdict is worse than every
//!   calibration turn's and its mean KL exceeds [`CHANGE_FACTOR`] times the
//!   calibration's worst (and the drift threshold), so steady noise is no
//!   change.
//!
//! The change point is the first turn that changed; the event named with it
//! is the last event at or before it. The upstream's verdict is `broken after
//! interrupt` (or `broken after cache hit`, or `changed` when no event
//! precedes it) when there is a change point, else its worst turn's verdict.
//! Invariant: a pure function of the turns, so the same audit gives the same
//! change point.

use serde::Serialize;

use super::{Thresholds, Turn, Verdict};

/// For an upstream that was not bit-faithful while calibrating: how many
/// times its calibrated worst mean KL a later turn must exceed to count as a
/// change. llama.cpp's mean KL moves little from turn to turn of one
/// conversation (docs/REFERENCE.md, "Auditing a server"); an order of
/// magnitude is a different regime, not noise.
pub const CHANGE_FACTOR: f64 = 10.0;

/// What may change an upstream's behaviour between two turns.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Event {
    /// The turn before was interrupted (its client left).
    Interrupt {
        /// The interrupted turn.
        turn: usize,
        request: u64,
        after_chunks: u32,
    },
    /// The upstream reported this many cached prompt tokens.
    CacheHit { turn: usize, cached_tokens: u64 },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Interrupt {
                turn,
                request,
                after_chunks,
            } => write!(
                f,
                "turn {turn} (request {request}) was interrupted: its client left after {after_chunks} chunks"
            ),
            Self::CacheHit {
                turn,
                cached_tokens,
            } => write!(
                f,
                "turn {turn} was served {cached_tokens} prompt tokens from the upstream's cache"
            ),
        }
    }
}

/// The turns before the first event, summarised.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    pub turns: Vec<usize>,
    /// Every token the reference's choice, every returned logprob its bits.
    pub bit_faithful: bool,
    pub identical_logprobs: usize,
    pub returned_logprobs: usize,
    /// The worst mean KL of a calibration turn.
    pub max_mean_kl: Option<f64>,
    /// The worst per-turn verdict among them.
    pub worst: Verdict,
}

/// The first turn that departs from the calibration.
#[derive(Debug, Clone, Serialize)]
pub struct ChangePoint {
    pub turn: usize,
    pub request: u64,
    /// The last event at or before the change point.
    pub event: Option<Event>,
    /// Whether that event is this very turn's (nothing in between).
    pub right_after: bool,
    /// What the turn shows, in words.
    pub shows: String,
}

/// An upstream's verdict over the whole traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum UpstreamVerdict {
    #[serde(rename = "faithful")]
    Faithful,
    #[serde(rename = "drifted")]
    Drifted,
    #[serde(rename = "broken")]
    Broken,
    #[serde(rename = "broken after interrupt")]
    BrokenAfterInterrupt,
    #[serde(rename = "broken after cache hit")]
    BrokenAfterCacheHit,
    /// A change with no event before it.
    #[serde(rename = "changed")]
    Changed,
    /// No turn could be audited.
    #[serde(rename = "nothing audited")]
    Nothing,
}

impl UpstreamVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Faithful => "faithful",
            Self::Drifted => "drifted",
            Self::Broken => "broken",
            Self::BrokenAfterInterrupt => "broken after interrupt",
            Self::BrokenAfterCacheHit => "broken after cache hit",
            Self::Changed => "changed",
            Self::Nothing => "nothing audited",
        }
    }
}

fn severity(v: Verdict) -> u8 {
    match v {
        Verdict::Skipped | Verdict::Faithful => 0,
        Verdict::Drifted => 1,
        Verdict::Broken => 2,
    }
}

fn bit_faithful(t: &Turn) -> bool {
    let s = &t.stats;
    s.tokens > 0
        && s.returned_logprobs == s.tokens
        && s.identical_logprobs == s.tokens
        && s.rank1 == s.tokens
}

/// The event that precedes `t` (an interrupt before it wins over a cache hit).
fn event_of(t: &Turn, prev: Option<&Turn>) -> Option<Event> {
    if t.after_interrupt {
        if let Some(p) = prev {
            return Some(Event::Interrupt {
                turn: p.turn,
                request: p.request,
                after_chunks: p.interrupted_after_chunks.unwrap_or(0),
            });
        }
    }
    t.cached_tokens
        .filter(|&n| n > 0)
        .map(|cached_tokens| Event::CacheHit {
            turn: t.turn,
            cached_tokens,
        })
}

/// Calibration, change point and the upstream's verdict for `turns`.
pub fn judge(
    turns: &[Turn],
    th: &Thresholds,
) -> (Option<Calibration>, Option<ChangePoint>, UpstreamVerdict) {
    let audited: Vec<&Turn> = turns
        .iter()
        .filter(|t| t.verdict != Verdict::Skipped)
        .collect();
    let worst = audited
        .iter()
        .map(|t| t.verdict)
        .max_by_key(|&v| severity(v));
    let level = match worst {
        None => UpstreamVerdict::Nothing,
        Some(Verdict::Broken) => UpstreamVerdict::Broken,
        Some(Verdict::Drifted) => UpstreamVerdict::Drifted,
        Some(_) => UpstreamVerdict::Faithful,
    };
    // Events per turn, in traffic order (a skipped turn's interrupt still
    // precedes the next turn).
    let events: Vec<Option<Event>> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| event_of(t, i.checked_sub(1).and_then(|j| turns.get(j))))
        .collect();
    let first_event = events.iter().position(Option::is_some);
    let cal_turns: Vec<&Turn> = turns
        .iter()
        .take(first_event.unwrap_or(turns.len()))
        .filter(|t| t.verdict != Verdict::Skipped)
        .collect();
    if cal_turns.is_empty() || first_event.is_none() {
        return (None, None, level);
    }
    let kls: Vec<f64> = cal_turns.iter().filter_map(|t| t.stats.mean_kl).collect();
    let cal = Calibration {
        turns: cal_turns.iter().map(|t| t.turn).collect(),
        bit_faithful: cal_turns.iter().all(|t| bit_faithful(t)),
        identical_logprobs: cal_turns.iter().map(|t| t.stats.identical_logprobs).sum(),
        returned_logprobs: cal_turns.iter().map(|t| t.stats.returned_logprobs).sum(),
        max_mean_kl: kls.iter().copied().reduce(f64::max),
        worst: cal_turns
            .iter()
            .map(|t| t.verdict)
            .max_by_key(|&v| severity(v))
            .unwrap_or(Verdict::Faithful),
    };
    let start = first_event.unwrap_or(turns.len());
    let changed = |t: &Turn| -> Option<String> {
        if t.verdict == Verdict::Skipped {
            return None;
        }
        let s = &t.stats;
        if cal.bit_faithful {
            if bit_faithful(t) {
                return None;
            }
            return Some(format!(
                "{} of {} returned logprobs have the reference's bits, {} of {} tokens its choice{}",
                s.identical_logprobs,
                s.returned_logprobs,
                s.rank1,
                s.tokens,
                s.mean_kl
                    .map_or(String::new(), |k| format!(", mean KL {k:.3}"))
            ));
        }
        let worse = severity(t.verdict) > severity(cal.worst);
        let bar = th
            .kl_drift
            .max(CHANGE_FACTOR * cal.max_mean_kl.unwrap_or(0.0));
        let kl_jump = match s.mean_kl {
            Some(k) => k > bar,
            None => true,
        };
        (worse && kl_jump).then(|| {
            format!(
                "{} where the calibration turns were at worst {}{}",
                t.verdict.as_str(),
                cal.worst.as_str(),
                s.mean_kl.map_or(String::new(), |k| format!(
                    ", mean KL {k:.3} against at most {bar:.3}"
                ))
            )
        })
    };
    let change = turns.iter().enumerate().skip(start).find_map(|(i, t)| {
        let shows = changed(t)?;
        let at = (start..=i).rev().find(|&j| events[j].is_some());
        Some(ChangePoint {
            turn: t.turn,
            request: t.request,
            event: at.and_then(|j| events[j].clone()),
            right_after: at == Some(i),
            shows,
        })
    });
    let verdict = match &change {
        None => level,
        Some(c) => match c.event {
            Some(Event::Interrupt { .. }) => UpstreamVerdict::BrokenAfterInterrupt,
            Some(Event::CacheHit { .. }) => UpstreamVerdict::BrokenAfterCacheHit,
            None => UpstreamVerdict::Changed,
        },
    };
    (Some(cal), change, verdict)
}
