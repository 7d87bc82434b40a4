//! `lmrr probe`: context-fidelity sweeps, the test the incident's
//! investigation asked for (single-generation statistics cannot see amnesia).
//!
//! Two probes, each run under several patch sets on the local engine
//! ([`local`]) or against any OpenAI-compatible server ([`remote`], through
//! `lmrr proxy`'s client code):
//!
//! - **needle**: a fact ("The secret code is 4721.") at depths 0–100% of a
//!   haystack of filler sentences, at several context lengths, then a
//!   question that needs it. Each cell runs twice, with two values of the
//!   same token length (A and B), everything else equal. *recalled*: the
//!   answer to A contains A. *read*: the answers differ between A and B —
//!   locally, bit for bit: the output digest covers every sampled logits row,
//!   so equal digests prove nothing of the needle reached the answer (the
//!   contract makes the rows a pure function of the tokens). On a synthetic
//!   model, which recalls nothing, *read* is the measure.
//! - **recall**: the incident's shape. A user states facts and asks for a
//!   poem (a short first try that completes, so the prefix cache holds it),
//!   asks again (a cache hit) and is interrupted after `cut` tokens, then
//!   asks for the facts back with the history the client saw. A row without
//!   the interrupt (the retry stops at `cut` tokens by itself) is the
//!   control.
//!
//! When the sweep includes `none`, every cell also says whether its answer
//! is the reference's, token for token. Each cell names the bundle it was
//! recorded in (a session bundle locally, a traffic bundle remotely), which
//! `lmrr replay` / `lmrr audit` re-examine.
//!
//! Invariants: prompts are a pure function of the configuration (no clock,
//! no randomness), so the same sweep on the same engine gives the same
//! table; A and B differ only in the needle's value and tokenize to the same
//! length (refused otherwise), so positions line up.

pub mod html;
pub mod local;
pub mod remote;

use serde::Serialize;

/// Filler sentences, cycled to build the haystack. Bland, factual, and free
/// of numbers, so nothing competes with the needle.
pub const FILLER: &[&str] = &[
    "The river bends twice before it reaches the old mill.",
    "Farmers in the valley grow barley, oats and a little rye.",
    "A narrow path climbs from the village to the chapel on the hill.",
    "In autumn the wind carries the smell of wet leaves through the streets.",
    "The library keeps its maps in long wooden drawers.",
    "Most houses along the square have green shutters and tiled roofs.",
    "The baker opens early and closes when the bread is gone.",
    "Children play by the fountain while their parents talk in the shade.",
    "Every spring the meadow turns yellow with wild flowers.",
    "The station master rings a brass bell before each train leaves.",
];

/// Needle values: pairs of the same digit count; the first pair whose two
/// values tokenize to the same length is used.
pub const NEEDLE_VALUES: &[(&str, &str)] = &[
    ("4721", "8396"),
    ("5183", "2947"),
    ("7360", "1852"),
    ("6029", "3714"),
];

/// The facts of the recall probe, and the words that show each was recalled.
pub const RECALL_FACTS: &str =
    "My name is Zorblax and my favourite colour is teal. Please write a short poem about the sea.";
pub const RECALL_WORDS: &[&str] = &["Zorblax", "teal"];
pub const RECALL_QUESTION: &str = "What is my name and my favourite colour?";

/// The needle sentence for `value`.
pub fn needle(value: &str) -> String {
    format!("The secret code is {value}.")
}

/// The question after the haystack.
pub const NEEDLE_QUESTION: &str = "What is the secret code? Answer with the number only.";

/// A sweep's shape.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    /// Needle depths, percent of the haystack (0 = first sentence).
    pub depths: Vec<u32>,
    /// Target prompt lengths, tokens.
    pub lengths: Vec<usize>,
    /// Tokens generated for a needle answer.
    pub needle_tokens: usize,
    /// Interrupt points of the recall probe (tokens, or chunks remotely).
    pub cuts: Vec<u32>,
    /// Tokens generated for the recall answer.
    pub recall_tokens: usize,
}

impl Default for Sweep {
    fn default() -> Self {
        Self {
            depths: vec![0, 25, 50, 75, 100],
            lengths: vec![256, 512, 1024],
            needle_tokens: 12,
            cuts: vec![8, 30],
            recall_tokens: 24,
        }
    }
}

/// The haystack's user message: `n` filler sentences with the needle
/// inserted before sentence `round(depth × n / 100)`, then the question.
pub fn haystack(n: usize, depth: u32, value: &str) -> String {
    let at = ((depth.min(100) as usize) * n + 50) / 100;
    let mut parts: Vec<String> = Vec::with_capacity(n + 2);
    for i in 0..=n {
        if i == at {
            parts.push(needle(value));
        }
        if i < n {
            parts.push(FILLER[i % FILLER.len()].to_string());
        }
    }
    format!("{}\n\n{NEEDLE_QUESTION}", parts.join(" "))
}

/// One needle cell.
#[derive(Debug, Clone, Serialize)]
pub struct NeedleCell {
    pub patches: String,
    pub depth: u32,
    /// The target length.
    pub length: usize,
    /// The prompt's real length, tokens (locally) or characters / 4
    /// (remotely, with no tokenizer).
    pub prompt_tokens: usize,
    /// Where the needle begins, tokens (locally).
    pub needle_at: Option<usize>,
    pub value: String,
    pub answer: String,
    pub recalled: bool,
    pub read: bool,
    /// The answer is the `none` sweep's, token for token (when it ran).
    pub same_as_reference: Option<bool>,
    /// Where the cell was recorded.
    pub bundle: String,
}

impl NeedleCell {
    /// `recalled`, `read`, or `lost` (the needle did not reach the answer).
    pub fn status(&self) -> &'static str {
        if self.recalled {
            "recalled"
        } else if self.read {
            "read"
        } else {
            "lost"
        }
    }
}

/// One recall row.
#[derive(Debug, Clone, Serialize)]
pub struct RecallRow {
    pub patches: String,
    /// Tokens (chunks remotely) the retry produced before it ended.
    pub cut: u32,
    /// Whether the retry was interrupted (else it stopped at `cut` itself).
    pub interrupted: bool,
    pub partial: String,
    pub answer: String,
    /// Which of [`RECALL_WORDS`] the answer contains.
    pub recalled: Vec<String>,
    pub same_as_reference: Option<bool>,
    pub bundle: String,
}

/// A whole probe.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// The model or URL probed.
    pub target: String,
    pub patch_sets: Vec<String>,
    pub sweep: Sweep,
    pub needle: Vec<NeedleCell>,
    pub recall: Vec<RecallRow>,
    pub seconds: f64,
}

impl ProbeReport {
    /// Marks each cell against the `none` sweep's answer with the same key.
    pub fn compare_to_reference(&mut self, tokens: &std::collections::BTreeMap<String, Vec<u32>>) {
        let key_n = |c: &NeedleCell, p: &str| format!("n|{p}|{}|{}", c.depth, c.length);
        let key_r = |r: &RecallRow, p: &str| format!("r|{p}|{}|{}", r.cut, r.interrupted);
        if !self.patch_sets.iter().any(|p| p == "none") {
            return;
        }
        for c in &mut self.needle {
            if let (Some(a), Some(b)) = (
                tokens.get(&key_n(c, &c.patches)),
                tokens.get(&key_n(c, "none")),
            ) {
                c.same_as_reference = Some(a == b);
            }
        }
        for r in &mut self.recall {
            if let (Some(a), Some(b)) = (
                tokens.get(&key_r(r, &r.patches)),
                tokens.get(&key_r(r, "none")),
            ) {
                r.same_as_reference = Some(a == b);
            }
        }
    }

    /// Where a patch set departs from `none`: first the needles it loses and
    /// the facts it forgets that the reference keeps, then the cells whose
    /// answer merely differs from the reference's.
    pub fn findings(&self, patches: &str) -> Vec<String> {
        let (mut worse, mut differs) = (Vec::new(), Vec::new());
        for c in self.needle.iter().filter(|c| c.patches == patches) {
            let r = self
                .needle
                .iter()
                .find(|r| r.patches == "none" && r.depth == c.depth && r.length == c.length);
            let Some(r) = r else { continue };
            let at = format!("needle at {}% of {} tokens", c.depth, c.length);
            if r.status() != c.status() {
                worse.push(format!("{at}: {} (reference: {})", c.status(), r.status()));
            } else if c.same_as_reference == Some(false) {
                differs.push(format!(
                    "{at}: answer differs ({:?})",
                    shorten(&c.answer, 40)
                ));
            }
        }
        for x in self.recall.iter().filter(|x| x.patches == patches) {
            let r = self
                .recall
                .iter()
                .find(|r| r.patches == "none" && r.cut == x.cut && r.interrupted == x.interrupted);
            let Some(r) = r else { continue };
            let at = format!(
                "recall {} {}",
                if x.interrupted {
                    "after a retry cut at"
                } else {
                    "after a retry that ends at"
                },
                x.cut
            );
            if r.recalled.len() > x.recalled.len() {
                worse.push(format!(
                    "{at}: recalls {} of {} (reference: {})",
                    x.recalled.len(),
                    RECALL_WORDS.len(),
                    r.recalled.len()
                ));
            } else if x.same_as_reference == Some(false) {
                differs.push(format!(
                    "{at}: answer differs ({:?})",
                    shorten(&x.answer, 40)
                ));
            }
        }
        worse.extend(differs);
        worse
    }
}

fn shorten(s: &str, n: usize) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() <= n {
        one
    } else {
        let mut t: String = one.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

impl std::fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "probe of {} · patch sets {} · {:.1} s",
            self.target,
            self.patch_sets.join(", "),
            self.seconds
        )?;
        if !self.needle.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "needle (R recalled, r read but not recalled, . lost: the answer is bit-identical whatever the needle says; * differs from none)"
            )?;
            for p in &self.patch_sets {
                writeln!(f, "{p}")?;
                write!(f, "  {:>7} ", "length")?;
                for d in &self.sweep.depths {
                    write!(f, "{:>5}", format!("{d}%"))?;
                }
                writeln!(f)?;
                for &l in &self.sweep.lengths {
                    write!(f, "  {l:>7} ")?;
                    for &d in &self.sweep.depths {
                        let c = self
                            .needle
                            .iter()
                            .find(|c| &c.patches == p && c.depth == d && c.length == l);
                        let s = c.map_or("-".to_string(), |c| {
                            let mark = match c.status() {
                                "recalled" => "R",
                                "read" => "r",
                                _ => ".",
                            };
                            let star = if c.same_as_reference == Some(false) {
                                "*"
                            } else {
                                ""
                            };
                            format!("{mark}{star}")
                        });
                        write!(f, "{s:>5}")?;
                    }
                    writeln!(f)?;
                }
            }
        }
        if !self.recall.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "recall after a retry of the facts' turn ({})",
                RECALL_WORDS.join(", ")
            )?;
            writeln!(
                f,
                "  {:<22} {:<17} {:>8} {:>8}  answer",
                "patches", "retry", "recalled", "vs none"
            )?;
            for r in &self.recall {
                writeln!(
                    f,
                    "  {:<22} {:<17} {:>8} {:>8}  {:?}",
                    shorten(&r.patches, 22),
                    format!(
                        "{} after {}",
                        if r.interrupted { "cut" } else { "ends" },
                        r.cut
                    ),
                    format!("{}/{}", r.recalled.len(), RECALL_WORDS.len()),
                    match r.same_as_reference {
                        Some(true) => "same",
                        Some(false) => "DIFFERS",
                        None => "-",
                    },
                    shorten(&r.answer, 60)
                )?;
            }
        }
        for p in self.patch_sets.iter().filter(|p| *p != "none") {
            let fs = self.findings(p);
            if self.patch_sets.iter().any(|p| p == "none") {
                writeln!(f)?;
                if fs.is_empty() {
                    write!(f, "{p}: the same as none in every cell")?;
                } else {
                    writeln!(f, "{p}: {} cell(s) depart from none:", fs.len())?;
                    for (i, x) in fs.iter().enumerate() {
                        if i == 8 {
                            writeln!(f, "  … {} more", fs.len() - 8)?;
                            break;
                        }
                        writeln!(f, "  {x}")?;
                    }
                }
            }
        }
        Ok(())
    }
}
