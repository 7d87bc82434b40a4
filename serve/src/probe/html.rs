//! The probe as one self-contained HTML page: per patch set a heat map of
//! needle depth × context length (green recalled, amber read but not
//! recalled, red lost; a ring where the cell's answer differs from `none`'s),
//! each cell a link to the bundle it was recorded in, with its answer on
//! hover; then the recall table. The report's JSON is embedded as
//! `#lmrr-probe-data`; no script, no network.

use std::path::Path;

use super::{NeedleCell, ProbeReport, RECALL_WORDS};

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A link to `bundle` relative to the page's folder when it lies inside it.
fn href(bundle: &str, page_dir: &Path) -> String {
    let (file, frag) = match bundle.split_once('#') {
        Some((f, x)) => (f, format!("#{x}")),
        None => (bundle, String::new()),
    };
    let abs = std::fs::canonicalize(file).unwrap_or_else(|_| Path::new(file).to_path_buf());
    let rel = match abs.strip_prefix(page_dir) {
        Ok(r) => r.display().to_string(),
        Err(_) => format!("file://{}", abs.display()),
    };
    format!("{rel}{frag}")
}

fn cell(c: &NeedleCell, page_dir: &Path) -> String {
    let class = match c.status() {
        "recalled" => "ok",
        "read" => "read",
        _ => "lost",
    };
    let ring = if c.same_as_reference == Some(false) {
        " differs"
    } else {
        ""
    };
    let title = format!(
        "{}% of {} tokens ({} in the prompt{}) · {} · {}\nanswer: {:?}\nbundle: {}",
        c.depth,
        c.length,
        c.prompt_tokens,
        c.needle_at
            .map_or(String::new(), |a| format!(", needle at token {a}")),
        c.patches,
        match c.status() {
            "recalled" => "recalled the value",
            "read" => "read (the answer depends on the value) but not recalled",
            _ => "lost: the answer is the same whatever the needle says",
        },
        c.answer,
        c.bundle
    );
    format!(
        "<td class=\"cell {class}{ring}\" data-status=\"{}\"><a href=\"{}\" title=\"{}\">{}</a></td>",
        c.status(),
        esc(&href(&c.bundle, page_dir)),
        esc(&title),
        match c.status() {
            "recalled" => "R",
            "read" => "r",
            _ => "·",
        }
    )
}

/// The page; bundle links are made relative to `page_dir`.
pub fn page(r: &ProbeReport, page_dir: &Path) -> Result<String, serde_json::Error> {
    let data = serde_json::to_string(r)?.replace("</", "<\\/");
    let mut h = String::new();
    h.push_str("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>lmrr probe</title><style>\n");
    h.push_str(
        "body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}\
         .panels{display:flex;flex-wrap:wrap;gap:24px}.panel{border:1px solid #ddd;padding:12px;border-radius:6px}\
         table.heat{border-collapse:separate;border-spacing:3px}table.heat th{font-weight:normal;color:#555;padding:2px 6px}\
         td.cell{width:44px;height:32px;text-align:center;border-radius:4px}td.cell a{display:block;color:#000;text-decoration:none;line-height:32px}\
         td.ok{background:#4caf50}td.read{background:#ffc107}td.lost{background:#e53935}td.lost a{color:#fff}\
         td.differs{outline:3px solid #222;outline-offset:-3px}\
         .legend span{display:inline-block;width:14px;height:14px;border-radius:3px;vertical-align:middle;margin:0 4px 0 12px}\
         table.recall{border-collapse:collapse;margin-top:8px}table.recall td,table.recall th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}\
         tr.forgot td{background:#fdecea}code{font-size:12px}\n",
    );
    h.push_str("</style></head><body>\n");
    h.push_str(&format!(
        "<h1>lmrr probe · {}</h1><p>patch sets: {} · {:.1} s</p>\n",
        esc(&r.target),
        esc(&r.patch_sets.join(", ")),
        r.seconds
    ));
    if !r.needle.is_empty() {
        h.push_str(
            "<h2>Needle: depth × context length</h2><p class=\"legend\">\
             <span style=\"background:#4caf50\"></span>recalled\
             <span style=\"background:#ffc107\"></span>read, not recalled (the answer depends on the needle)\
             <span style=\"background:#e53935\"></span>lost (the answer is bit-identical whatever the needle says)\
             <span style=\"outline:3px solid #222;outline-offset:-3px\"></span>answer differs from <code>none</code>. \
             Each cell links to its recording.</p>\n<div class=\"panels\" id=\"heatmaps\">\n",
        );
        for p in &r.patch_sets {
            h.push_str(&format!(
                "<div class=\"panel\" data-patches=\"{}\"><h3>{}</h3><table class=\"heat\"><tr><th>tokens \\ depth</th>",
                esc(p),
                esc(p)
            ));
            for d in &r.sweep.depths {
                h.push_str(&format!("<th>{d}%</th>"));
            }
            h.push_str("</tr>\n");
            for &l in &r.sweep.lengths {
                h.push_str(&format!("<tr><th>{l}</th>"));
                for &d in &r.sweep.depths {
                    match r
                        .needle
                        .iter()
                        .find(|c| &c.patches == p && c.depth == d && c.length == l)
                    {
                        Some(c) => h.push_str(&cell(c, page_dir)),
                        None => h.push_str("<td></td>"),
                    }
                }
                h.push_str("</tr>\n");
            }
            h.push_str("</table></div>\n");
        }
        h.push_str("</div>\n");
    }
    if !r.recall.is_empty() {
        h.push_str(&format!(
            "<h2>Recall after a retry (interrupted or not)</h2><p>The facts ({}) are stated, a first try completes, \
             the retry hits the cache and is cut (or ends by itself), then the user asks for the facts.</p>\
             <table class=\"recall\" id=\"recall\"><tr><th>patches</th><th>retry</th><th>recalled</th><th>vs none</th><th>answer</th><th>recording</th></tr>\n",
            esc(&RECALL_WORDS.join(", "))
        ));
        for x in &r.recall {
            // Shaded: an answer the reference does not give, or (with no
            // reference in the sweep) one that misses a fact.
            let forgot = match x.same_as_reference {
                Some(same) => !same,
                None => x.recalled.len() < RECALL_WORDS.len(),
            };
            h.push_str(&format!(
                "<tr class=\"{}\"><td>{}</td><td>{} after {}</td><td>{}/{}</td><td>{}</td><td>{}</td><td><a href=\"{}\">bundle</a></td></tr>\n",
                if forgot { "forgot" } else { "" },
                esc(&x.patches),
                if x.interrupted { "interrupted" } else { "ends" },
                x.cut,
                x.recalled.len(),
                RECALL_WORDS.len(),
                match x.same_as_reference {
                    Some(true) => "same",
                    Some(false) => "<b>differs</b>",
                    None => "–",
                },
                esc(&x.answer),
                esc(&href(&x.bundle, page_dir))
            ));
        }
        h.push_str("</table>\n");
    }
    h.push_str(&format!(
        "<script type=\"application/json\" id=\"lmrr-probe-data\">{data}</script>\n</body></html>\n"
    ));
    Ok(h)
}
