//! The page around the drawings: header, truncation banner, sections, the
//! embedded data and the hover script. Every text that comes from a bundle
//! (request names, decoded tokens, reasons) is escaped here; the embedded
//! JSON has `<` escaped so no string can close its `<script>` element.

use std::fmt::Write as _;

use super::plot::{self, PAGE_WIDTH};
use super::{timeline, HtmlError, IntegrityFacts, Kind, ReportData, Texts, Tok};

const CSS: &str = include_str!("page.css");
const JS: &str = include_str!("page.js");

/// HTML-escapes text (element content and quoted attributes).
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(o, "\\u{{{:x}}}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

/// A token's text as shown: escapes visible, whitespace marked.
fn shown(t: &str) -> String {
    let v = format!("{t:?}");
    esc(&v[1..v.len().saturating_sub(1).max(1)])
}

pub(super) fn render(r: &ReportData) -> Result<String, HtmlError> {
    let json = serde_json::to_string(r)
        .map_err(|e| HtmlError::Json(e.to_string()))?
        .replace('<', "\\u003c");
    let mut h = String::with_capacity(64 * 1024 + json.len());
    let title = match r.kind {
        Kind::Inspect => "bundle",
        Kind::Replay => "replay",
        Kind::Oracle => "recompute oracle",
        Kind::Bisect => "bisect",
    };
    let _ = writeln!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>lmrr {title}: {}</title><style>{CSS}</style></head><body>",
        esc(&r.bundle.path)
    );
    let b = &r.bundle;
    let _ = writeln!(
        h,
        "<header><h1>lmrr {title} · <code>{}</code></h1><p class=\"cmd\"><code>{}</code></p>\
         <p class=\"facts\">model {} · recorded under <code>{}</code>{}{} · {} requests · {} steps · {} bytes</p></header>",
        esc(&b.path),
        esc(&r.command),
        esc(&b.model),
        esc(&b.recorded_patches),
        if b.tp_degree > 1 {
            format!(" at tensor-parallel degree {}", b.tp_degree)
        } else {
            String::new()
        },
        r.under
            .as_ref()
            .map(|u| format!(" · {} <code>{}</code>", if r.kind == Kind::Bisect { "culprit set" } else { "replayed under" }, esc(u)))
            .unwrap_or_default(),
        b.requests,
        b.steps,
        b.bytes
    );
    let truncated_at = match &b.integrity {
        IntegrityFacts::Complete => None,
        IntegrityFacts::Truncated {
            frames,
            offset,
            why,
            last_step,
        } => {
            let _ = writeln!(
                h,
                "<section id=\"truncated\" class=\"banner\"><strong>Truncated bundle.</strong> \
                 The file ends early: {frames} complete frames, readable up to byte {offset}{} \
                 ({}). Everything after that was lost; this report covers the readable part.</section>",
                last_step
                    .map(|s| format!(", the last step it holds is {s}"))
                    .unwrap_or_else(|| ", no step".into()),
                esc(why)
            );
            Some(last_step.unwrap_or(0))
        }
    };
    if let Some(t) = &r.outcome_text {
        let class = match &r.outcome {
            Some(o) if o.is_bit_exact() => "ok",
            Some(o) if o.is_clean() => "same",
            _ => "bad",
        };
        let _ = writeln!(
            h,
            "<section id=\"verdict\" class=\"verdict {class}\"><h2>Verdict</h2><pre>{}</pre></section>",
            esc(t)
        );
    }
    // Timeline.
    let tl = &r.timeline;
    let _ = writeln!(
        h,
        "<section id=\"timeline-section\"><h2>Session timeline</h2>\
         <p class=\"legend\"><span class=\"k arrival\"></span>arrival \
         <span class=\"k prefill\"></span>prefill chunks \
         <span class=\"k decode\"></span>decode steps \
         {}<span class=\"k cached\"></span>served from the prefix cache \
         <span class=\"k interrupt\">✕</span>interrupt \
         <span class=\"k preempt\">▼</span>preemption \
         <span class=\"k finish\"></span>finish \
         <span class=\"k divergence\"></span>first divergence · hover for details</p>\
         <div class=\"scroll\">{}</div>{}</section>",
        if tl.lanes.iter().any(|l| l.engine.is_some()) {
            "<span class=\"k transfer\"></span>K/V transfer into decode pages \
             <span class=\"k orphan-transfer\"></span>transfer after its request's abort \
             (one lane per engine: prefill, decode) "
        } else {
            ""
        },
        timeline::svg(tl, truncated_at),
        if tl.lanes.len() > super::MAX_LANES {
            format!(
                "<p class=\"note\">{} more lanes are in the data part, not drawn.</p>",
                tl.lanes.len() - super::MAX_LANES
            )
        } else {
            String::new()
        }
    );
    // Divergence details.
    if let Some(d) = r.outcome.as_ref().and_then(|o| o.divergence()) {
        let _ = write!(
            h,
            "<section id=\"divergence\"><h2>First divergence</h2><dl>\
             <dt>step</dt><dd>{}</dd><dt>signal</dt><dd>{}</dd>",
            d.step,
            esc(&d.signal.to_string())
        );
        if let Some(req) = &d.request {
            let _ = write!(
                h,
                "<dt>request</dt><dd>{}{}{}</dd>",
                esc(req),
                d.turn.map(|t| format!(" (turn {t})")).unwrap_or_default(),
                d.position
                    .map(|p| format!(", position {p}"))
                    .unwrap_or_default()
            );
        }
        let _ = write!(
            h,
            "<dt>detail</dt><dd>{}</dd><dt>repro</dt><dd><code>{}</code></dd></dl>",
            esc(&d.detail),
            esc(&d.repro)
        );
        if !d.window.is_empty() {
            let _ = write!(h, "<h3>Events around it</h3><pre class=\"events\">");
            for w in &d.window {
                let _ = writeln!(h, "{}", esc(w));
            }
            h += "</pre>";
        }
        h += "</section>\n";
    }
    // Drift plots.
    if matches!(r.kind, Kind::Replay | Kind::Bisect) && r.outcome.is_some() {
        let p = plot::drift_svg(r.drift.as_ref(), PAGE_WIDTH)?;
        let panels =
            serde_json::to_string(&p.panels).map_err(|e| HtmlError::Json(e.to_string()))?;
        let folded = r.drift.as_ref().map_or(0, |d| d.folded);
        let _ = writeln!(
            h,
            "<section id=\"drift\"><h2>Drift per request</h2>\
             <p class=\"note\">Each row of the engine under test against the same row of the \
             recording's patch set run alongside, both fed the recorded tokens.{}</p>\
             <div id=\"drift-plots\" class=\"plot\" data-panels=\"{}\">{}<div id=\"hover\" hidden></div></div></section>",
            if folded > 0 {
                format!(" {folded} more requests are only in \"all rows\".")
            } else {
                String::new()
            },
            esc(&panels),
            p.svg
        );
    }
    if let Some(t) = &r.texts {
        texts(&mut h, t, r.outcome.as_ref().and_then(|o| o.divergence()));
    }
    if let (Some(bi), Some(text)) = (&r.bisect, &r.bisect_text) {
        let _ = write!(
            h,
            "<section id=\"bisect\"><h2>Bisect</h2><p>{} search over <code>{}</code> on top of <code>{}</code>, {} replays.</p>\
             <table><thead><tr><th>#</th><th>patch set</th><th>role</th><th>verdict</th><th>step</th><th>signal</th></tr></thead><tbody>",
            bi.method,
            esc(&bi.bad),
            esc(&bi.base),
            bi.probes.len()
        );
        let mut culprit_names = names(&bi.base);
        culprit_names.extend(bi.culprits.iter().flatten().map(String::as_str));
        for (i, p) in bi.probes.iter().enumerate() {
            let role = if p.set == bi.base {
                "good"
            } else if p.set == bi.bad {
                "bad"
            } else {
                ""
            };
            let is_culprit = bi.found() && names(&p.set) == culprit_names;
            let _ = write!(
                h,
                "<tr class=\"{}{}\"><td>{}</td><td><code>{}</code></td><td>{role}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                if p.diverged { "diverged" } else { "clean" },
                if is_culprit { " culprit" } else { "" },
                i + 1,
                esc(&p.set),
                esc(&p.to_string()),
                p.step.map(|s| s.to_string()).unwrap_or_default(),
                p.signal.map(|s| s.to_string()).unwrap_or_default()
            );
        }
        let _ = writeln!(
            h,
            "</tbody></table><p class=\"culprit {}\">{}</p></section>",
            if bi.found() { "found" } else { "refused" },
            esc(text.lines().last().unwrap_or_default())
        );
    }
    if let Some(turns) = &r.oracle {
        let _ = write!(
            h,
            "<section id=\"oracle\"><h2>Recompute oracle</h2>\
             <p class=\"note\">Each turn's sampled tokens, recomputed with no cache in a batch of one, against the recorded logits digests.</p>\
             <table><thead><tr><th>request</th><th>turn</th><th>tokens recomputed</th><th>result</th></tr></thead><tbody>"
        );
        for t in turns {
            let _ = write!(
                h,
                "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                if t.first_difference.is_some() {
                    "diverged"
                } else {
                    "clean"
                },
                esc(&t.request),
                t.turn,
                t.checked,
                match t.first_difference {
                    Some((s, p)) => format!("differs from step {s}, position {p}"),
                    None => "bit-identical".into(),
                }
            );
        }
        h += "</tbody></table></section>\n";
    }
    let _ = writeln!(
        h,
        "<footer>lmrr · data part: <code>#lmrr-data</code> (the numbers this page draws)</footer>\n\
         <script type=\"application/json\" id=\"lmrr-data\">{json}</script>\n<script>{JS}</script>\n</body></html>"
    );
    Ok(h)
}

fn texts(h: &mut String, t: &Texts, d: Option<&crate::report::Divergence>) {
    let side =
        |h: &mut String, label: &str, toks: &[Tok], top: Option<&crate::report::TokenInfo>| {
            let _ = write!(
                h,
                "<div class=\"side\"><h3>{}</h3><p class=\"text\">",
                esc(label)
            );
            if t.skipped_before > 0 {
                let _ = write!(
                    h,
                    "<span class=\"skip\">… {} tokens …</span>",
                    t.skipped_before
                );
            }
            for k in toks {
                let hl = Some(k.position) == t.highlight;
                let _ = write!(
                    h,
                    "<span class=\"tok{}\" title=\"position {} · token {}\">{}</span>",
                    if hl && t.tokens_differ {
                        " first-diff"
                    } else if hl {
                        " at-divergence"
                    } else {
                        ""
                    },
                    k.position,
                    k.token,
                    shown(&k.text)
                );
            }
            if t.skipped_after > 0 {
                let _ = write!(
                    h,
                    "<span class=\"skip\">… {} tokens …</span>",
                    t.skipped_after
                );
            }
            h.push_str("</p>");
            if let Some(top) = top.filter(|x| !x.top.is_empty()) {
                let _ = write!(
                h,
                "<table class=\"top\"><caption>top-5 at the divergence (token {} “{}”)</caption>\
                 <thead><tr><th>token</th><th>text</th><th>logprob</th></tr></thead><tbody>",
                top.token,
                shown(&top.text)
            );
                for (id, s, lp) in &top.top {
                    let _ = write!(
                        h,
                        "<tr{}><td>{id}</td><td>{}</td><td>{lp:.3}</td></tr>",
                        if *id == top.token {
                            " class=\"chosen\""
                        } else {
                            ""
                        },
                        shown(s)
                    );
                }
                h.push_str("</tbody></table>");
            }
            h.push_str("</div>");
        };
    let _ = write!(
        h,
        "<section id=\"texts\"><h2>Texts of <code>{}</code></h2><p class=\"note\">{}</p><div class=\"sides\">",
        esc(&t.request),
        match t.highlight {
            Some(p) if t.tokens_differ => format!("First differing token highlighted: position {p}."),
            Some(p) => format!("The tokens agree; position {p}, where the divergence was found, is outlined."),
            None => "The sampled tokens agree at every position replayed.".into(),
        }
    );
    side(
        h,
        &t.expected_label,
        &t.expected,
        d.and_then(|d| d.expected.as_ref()),
    );
    side(
        h,
        &t.actual_label,
        &t.actual,
        d.and_then(|d| d.actual.as_ref()),
    );
    h.push_str("</div></section>\n");
}

/// The patch names of a set as printed (`none` is the empty set).
fn names(set: &str) -> std::collections::BTreeSet<&str> {
    set.split(',')
        .filter(|n| !n.is_empty() && *n != "none")
        .collect()
}
