//! The audit as text: the upstream's verdict and its change point first,
//! then one row per turn, each turn's reasons, and the context-fidelity
//! table. Only formats what [`super::audit`] computed.

use super::{shorten, AuditReport, Turn, Verdict};

impl AuditReport {
    /// The upstream's verdict, then the change point with the event before
    /// it and the calibration it departs from.
    fn headline(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "verdict: {}", self.verdict.as_str())?;
        let Some(c) = &self.change else {
            if let Some(cal) = &self.calibration {
                writeln!(
                    f,
                    "  no change after the calibration turns {} ({})",
                    turn_list(&cal.turns),
                    calibration_words(cal)
                )?;
            }
            return Ok(());
        };
        let when = match (&c.event, c.right_after) {
            (Some(e), true) => format!(", right after the event: {e}"),
            (Some(e), false) => format!("; the last event before it: {e}"),
            (None, _) => String::new(),
        };
        writeln!(
            f,
            "  change point: turn {} (request {}){when}",
            c.turn, c.request
        )?;
        writeln!(f, "  turn {} shows {}", c.turn, c.shows)?;
        if let Some(cal) = &self.calibration {
            writeln!(
                f,
                "  calibrated on turns {}: {}",
                turn_list(&cal.turns),
                calibration_words(cal)
            )?;
        }
        Ok(())
    }
}

fn turn_list(t: &[usize]) -> String {
    match (t.first(), t.last()) {
        (Some(a), Some(b)) if a == b => a.to_string(),
        (Some(a), Some(b)) if b - a + 1 == t.len() => format!("{a}–{b}"),
        _ => t
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn calibration_words(c: &super::Calibration) -> String {
    if c.bit_faithful {
        format!(
            "bit-faithful, {} of {} returned logprobs with the reference's bits",
            c.identical_logprobs, c.returned_logprobs
        )
    } else {
        format!(
            "{}, {} of {} returned logprobs with the reference's bits{}",
            c.worst.as_str(),
            c.identical_logprobs,
            c.returned_logprobs,
            c.max_mean_kl
                .map_or(String::new(), |k| format!(", mean KL at most {k:.4}"))
        )
    }
}

impl std::fmt::Display for AuditReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "audit of {} ({}) · upstream {} · reference {}",
            self.traffic, self.origin, self.upstream, self.model
        )?;
        if !self.integrity.starts_with("complete") {
            writeln!(f, "traffic: {}", self.integrity)?;
        }
        self.headline(f)?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<4} {:<44} {:>6} {:>7} {:>4} {:>4} {:>5} {:>8} {:>9}  verdict",
            "turn", "request", "tokens", "rank 1", "tie", "off", "impr", "mean KL", "<top-5 at"
        )?;
        for t in &self.turns {
            let mut label = format!(
                "{} \"{}\"",
                if t.endpoint.contains("chat") {
                    "chat"
                } else {
                    "cmpl"
                },
                shorten(&t.asks, 30)
            );
            if let Some(n) = t.interrupted_after_chunks {
                label = format!("{} [cut@{n}]", shorten(&label, 33));
            }
            if t.verdict == Verdict::Skipped {
                writeln!(f, "{:<4} {:<44} skipped: {}", t.turn, label, t.why)?;
                continue;
            }
            let s = &t.stats;
            writeln!(
                f,
                "{:<4} {:<44} {:>6} {:>7} {:>4} {:>4} {:>5} {:>8} {:>9}  {}{}",
                t.turn,
                label,
                s.tokens,
                s.rank1,
                s.near_ties,
                s.off,
                s.improbable,
                s.mean_kl.map_or("-".into(), |k| format!("{k:.4}")),
                s.first_below_top_k.map_or("-".into(), |i| i.to_string()),
                t.verdict.as_str(),
                if t.after_interrupt {
                    " (after an interrupt)"
                } else {
                    ""
                }
            )?;
        }
        writeln!(f)?;
        for t in &self.turns {
            if t.verdict == Verdict::Skipped {
                continue;
            }
            writeln!(f, "turn {}: {} — {}", t.turn, t.verdict.as_str(), t.why)?;
            if t.stats.returned_logprobs > 0 {
                writeln!(
                    f,
                    "  logprobs: {} of {} returned have the reference's bits; ids from {}",
                    t.stats.identical_logprobs, t.stats.returned_logprobs, t.ids_from
                )?;
            }
            if let Some(i) = t.stats.first_below_top_k {
                let x = &t.tokens[i];
                writeln!(
                    f,
                    "  first choice below the reference's top-{}: token {i} {:?} (rank {}, logprob {:.2}; reference: {:?})",
                    self.thresholds.top_k, x.text, x.rank, x.ref_logprob, x.ref_top_text
                )?;
            }
            writeln!(f, "  answer: {:?}", shorten(&t.answer, 70))?;
            for n in &t.notes {
                writeln!(f, "  note: {n}")?;
            }
        }
        let fid: Vec<&Turn> = self.turns.iter().filter(|t| t.fidelity.is_some()).collect();
        if !fid.is_empty() {
            writeln!(f)?;
            writeln!(
                f,
                "context fidelity (reference logprob of the upstream's answer, nats):"
            )?;
            writeln!(
                f,
                "{:<4} {:>7} {:>13} {:>13} {:>9}  ",
                "turn", "history", "with", "without", "per token"
            )?;
            for t in fid {
                let Some(x) = &t.fidelity else { continue };
                writeln!(
                    f,
                    "{:<4} {:>7} {:>13.2} {:>13.2} {:>+9.3}  {}",
                    t.turn,
                    format!("{} msgs", x.history_messages),
                    x.with_history,
                    x.without_history,
                    (x.with_history - x.without_history) / t.stats.tokens.max(1) as f64,
                    if x.amnesia {
                        "AMNESIA: the answer fits no history better"
                    } else {
                        "uses its history"
                    }
                )?;
            }
        }
        let count = |v: Verdict| self.turns.iter().filter(|t| t.verdict == v).count();
        let amnesia = self
            .turns
            .iter()
            .filter(|t| t.fidelity.as_ref().is_some_and(|f| f.amnesia))
            .count();
        writeln!(f)?;
        write!(
            f,
            "{} turns: {} faithful, {} drifted, {} broken, {} skipped; {} amnesia",
            self.turns.len(),
            count(Verdict::Faithful),
            count(Verdict::Drifted),
            count(Verdict::Broken),
            count(Verdict::Skipped),
            amnesia
        )
    }
}
