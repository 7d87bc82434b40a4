//! Replay outcomes and divergence reports.

use serde::Serialize;

/// Which signal diverged first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Signal {
    /// A recorded scheduling decision could not be executed (the engine state
    /// no longer allows it).
    Decision,
    /// The cache-state hash (radix tree, pages, refcounts) differs.
    CacheState,
    /// A logits row's digest differs.
    Logits,
    /// A sampled token differs.
    Token,
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Decision => "scheduling decision",
            Self::CacheState => "cache-state hash",
            Self::Logits => "logits digest",
            Self::Token => "sampled token",
        })
    }
}

/// A token with its text and the top log-probabilities of its row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenInfo {
    pub token: u32,
    pub text: String,
    /// `(token, text, logprob)`, most likely first.
    pub top: Vec<(u32, String, f32)>,
}

/// Drift between expected and actual logits rows in one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriftRow {
    pub step: u64,
    pub rows: usize,
    pub max_abs_dlogit: f32,
    pub mean_kl: f64,
    /// Fraction of rows whose argmax agrees.
    pub top1_agreement: f64,
    /// The requests whose rows were compared, the one with the largest
    /// |Δlogit| first.
    pub requests: Vec<String>,
}

impl DriftRow {
    /// The step's row from `(request, max |Δlogit|, KL, top-1 agrees)` per
    /// compared row; `None` when no row was compared.
    pub fn of(step: u64, rows: &[(String, f32, f64, bool)]) -> Option<Self> {
        if rows.is_empty() {
            return None;
        }
        let mut by_drift: Vec<&(String, f32, f64, bool)> = rows.iter().collect();
        by_drift.sort_by(|a, b| b.1.total_cmp(&a.1));
        Some(Self {
            step,
            rows: rows.len(),
            max_abs_dlogit: rows.iter().map(|p| p.1).fold(0.0, f32::max),
            mean_kl: rows.iter().map(|p| p.2).sum::<f64>() / rows.len() as f64,
            top1_agreement: rows.iter().filter(|p| p.3).count() as f64 / rows.len() as f64,
            requests: by_drift.iter().map(|p| p.0.clone()).collect(),
        })
    }
}

/// The first divergence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    pub step: u64,
    pub signal: Signal,
    pub detail: String,
    pub request: Option<String>,
    pub request_id: Option<u64>,
    /// 1-based turn of the request in its conversation.
    pub turn: Option<usize>,
    pub position: Option<usize>,
    pub expected: Option<TokenInfo>,
    pub actual: Option<TokenInfo>,
    pub drift: Vec<DriftRow>,
    pub window: Vec<String>,
    pub repro: String,
}

/// Result of a replay or an oracle run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "kebab-case")]
pub enum Outcome {
    BitExact {
        steps: u64,
        tokens: u64,
        truncated: bool,
    },
    /// No divergence by a behaviour or tokens criterion, but the bits moved:
    /// never reported as bit-exact.
    SameBehaviour {
        steps: u64,
        tokens: u64,
        truncated: bool,
        criterion: crate::Criterion,
        /// First step where some bit (logits, K/V contents) differed.
        bits_from: u64,
        /// The first signal that differed there.
        bits_signal: Signal,
    },
    Diverged(Box<Divergence>),
}

impl Outcome {
    /// Every bit as recorded.
    pub fn is_bit_exact(&self) -> bool {
        matches!(self, Self::BitExact { .. })
    }
    /// No divergence by the replay's criterion (bit-exact, or the same
    /// behaviour with different bits).
    pub fn is_clean(&self) -> bool {
        !matches!(self, Self::Diverged(_))
    }
    pub fn divergence(&self) -> Option<&Divergence> {
        match self {
            Self::Diverged(d) => Some(d),
            _ => None,
        }
    }
}

/// "logits differ from step 3": what moved first when only the bits did.
pub fn bits_moved(signal: Signal, step: u64) -> String {
    let what = match signal {
        Signal::CacheState => "K/V contents differ",
        Signal::Logits | Signal::Token => "logits differ",
        Signal::Decision => "decisions differ",
    };
    format!("{what} from step {step}")
}

fn truncated_note(f: &mut std::fmt::Formatter<'_>, truncated: bool) -> std::fmt::Result {
    if truncated {
        write!(
            f,
            " (bundle truncated: checked up to its last complete frame)"
        )?;
    }
    Ok(())
}

/// "1 step", "2 steps", "3 candidate patches".
pub fn plural(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {noun}")
    } else if noun.ends_with("ch") || noun.ends_with('s') || noun.ends_with('x') {
        format!("{n} {noun}es")
    } else {
        format!("{n} {noun}s")
    }
}

fn token_line(t: &TokenInfo) -> String {
    let top: Vec<String> = t
        .top
        .iter()
        .map(|(id, s, lp)| format!("{id} {s:?} {lp:.3}"))
        .collect();
    format!(
        "{} {:?}   top-5: {}",
        t.token,
        t.text,
        if top.is_empty() {
            "(not recorded)".into()
        } else {
            top.join(" · ")
        }
    )
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BitExact {
                steps,
                tokens,
                truncated,
            } => {
                write!(
                    f,
                    "bit-exact: {}, {}",
                    plural(*steps, "step"),
                    plural(*tokens, "token")
                )?;
                truncated_note(f, *truncated)
            }
            Self::SameBehaviour {
                steps,
                tokens,
                truncated,
                criterion,
                bits_from,
                bits_signal,
            } => {
                let same = match criterion {
                    crate::Criterion::Tokens => "same tokens",
                    _ => "same behaviour",
                };
                write!(
                    f,
                    "{same}; {}: {}, {}",
                    bits_moved(*bits_signal, *bits_from),
                    plural(*steps, "step"),
                    plural(*tokens, "token")
                )?;
                truncated_note(f, *truncated)
            }
            Self::Diverged(d) => {
                writeln!(f, "DIVERGED at step {}: first signal: {}", d.step, d.signal)?;
                if let Some(r) = &d.request {
                    write!(f, "  request   {r}")?;
                    if let Some(t) = d.turn {
                        write!(f, " (turn {t})")?;
                    }
                    if let Some(p) = d.position {
                        write!(f, ", position {p}")?;
                    }
                    writeln!(f)?;
                }
                writeln!(f, "  detail    {}", d.detail)?;
                if let Some(e) = &d.expected {
                    writeln!(f, "  expected  {}", token_line(e))?;
                }
                if let Some(a) = &d.actual {
                    writeln!(f, "  actual    {}", token_line(a))?;
                }
                if !d.drift.is_empty() && d.drift.iter().all(|r| r.max_abs_dlogit == 0.0) {
                    writeln!(
                        f,
                        "  drift     none: logits bit-identical over the {} compared",
                        plural(d.drift.len() as u64, "step")
                    )?;
                } else if !d.drift.is_empty() {
                    writeln!(
                        f,
                        "  drift     step   rows  max|Δlogit|        KL   top-1  requests"
                    )?;
                    for r in &d.drift {
                        writeln!(
                            f,
                            "            {:>4} {:>6} {:>12.3e} {:>9.2e} {:>6.0}%  {}",
                            r.step,
                            r.rows,
                            r.max_abs_dlogit,
                            r.mean_kl,
                            100.0 * r.top1_agreement,
                            r.requests.join(", ")
                        )?;
                    }
                }
                if !d.window.is_empty() {
                    writeln!(f, "  events")?;
                    for w in &d.window {
                        writeln!(f, "    {w}")?;
                    }
                }
                write!(f, "  repro     {}", d.repro)
            }
        }
    }
}
