//! Replay of a disaggregated bundle (its first event is
//! `Event::Disaggregated`): the same lockstep as [`crate::driver`], over a
//! [`PdEngine`] whose two engines execute their recorded decisions and go on
//! with the recorded tokens, while the deployment's own events (bootstraps,
//! reservations, transfers, admissions, aborts at their stage) are decided
//! afresh and compared with the recording.
//!
//! Per step the signals are compared in the step's own order: the boundary
//! events, the prefill engine's report, the link's events, the decode
//! engine's report. A difference in the deployment's events is a
//! [`Signal::Decision`] naming the first event that differs: it is where a
//! disaggregation patch acts (a transfer that goes on after an abort, a
//! reservation never released).

use std::collections::BTreeMap;

use lmrr_engine::scheduler::RequestId;
use lmrr_engine::{Model, PatchSet, PdConfig, PdEngine, PdEvent, PdStep, Side};
use lmrr_recorder::{Bundle, Event, Integrity};

use crate::driver::{
    attribute, compare, divergence, drift, window, Catalog, Criterion, ReplayError, ReplayOptions,
    RowDrift, Sampled, Trace,
};
use crate::report::{Divergence, DriftRow, Outcome, Signal};

/// The deployment of a disaggregated bundle (`None`: colocated).
pub fn pd_config(bundle: &Bundle) -> Option<PdConfig> {
    match bundle.events.first() {
        Some(Event::Disaggregated(c)) => Some(*c),
        _ => None,
    }
}

/// One line per event, for reports and windows.
pub(crate) fn describe(e: &PdEvent, cat: &Catalog) -> String {
    match e {
        PdEvent::Abort { id, stage } => format!("abort {} ({stage})", cat.name(*id)),
        PdEvent::Bootstrap { id, positions } => {
            format!("bootstrap {} ({positions} positions)", cat.name(*id))
        }
        PdEvent::Reserve { id, pages } => {
            format!(
                "decode reserves {} pages for {}",
                pages.len(),
                cat.name(*id)
            )
        }
        PdEvent::Prefilled { id, token, finish } => match finish {
            Some(f) => format!("{} prefilled → {token}, ends ({f})", cat.name(*id)),
            None => format!("{} prefilled → {token}", cat.name(*id)),
        },
        PdEvent::Transfer {
            id,
            start,
            len,
            pages,
            orphan,
            ..
        } => format!(
            "transfer {} {start}..{} → decode page{} {}{}",
            cat.name(*id),
            start.saturating_add(*len),
            if pages.len() == 1 { "" } else { "s" },
            pages
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(","),
            if *orphan {
                " (orphaned: its request was aborted)"
            } else {
                ""
            }
        ),
        PdEvent::Complete {
            id,
            pages_sent,
            pages_total,
        } if pages_sent < pages_total => format!(
            "transfer of {} reported complete after {pages_sent} of {pages_total} pages",
            cat.name(*id)
        ),
        PdEvent::Complete { id, .. } => format!("transfer of {} complete", cat.name(*id)),
        PdEvent::Admit { id } => format!("decode admits {}", cat.name(*id)),
        PdEvent::Leak { id, pages } => {
            format!(
                "{} aborted: its {pages} decode pages are never released",
                cat.name(*id)
            )
        }
    }
}

fn event_id(e: &PdEvent) -> RequestId {
    match e {
        PdEvent::Abort { id, .. }
        | PdEvent::Bootstrap { id, .. }
        | PdEvent::Reserve { id, .. }
        | PdEvent::Prefilled { id, .. }
        | PdEvent::Transfer { id, .. }
        | PdEvent::Complete { id, .. }
        | PdEvent::Admit { id }
        | PdEvent::Leak { id, .. } => *id,
    }
}

/// The first difference between two event lists, as a divergence.
fn events_differ(
    step: u64,
    what: &str,
    rec: &[PdEvent],
    got: &[PdEvent],
    cat: &Catalog,
    opts: &ReplayOptions,
) -> Option<Divergence> {
    if rec == got {
        return None;
    }
    let i = rec.iter().zip(got).take_while(|(a, b)| a == b).count();
    let show = |e: Option<&PdEvent>| e.map_or("nothing".to_string(), |e| describe(e, cat));
    // The event the replay added (a patch acting), else the one it lost.
    let who = match (rec.get(i), got.get(i)) {
        (_, Some(g)) if !rec.contains(g) => Some(g),
        (r, g) => r.or(g),
    }
    .map(|e| (event_id(e), None));
    Some(divergence(
        step,
        Signal::Decision,
        format!(
            "the deployment's {what} differ: expected `{}`, got `{}`",
            show(rec.get(i)),
            show(got.get(i))
        ),
        who,
        cat,
        opts,
    ))
}

/// Compares a replayed step with the recording under `criterion`.
fn compare_step(
    rec: &PdStep,
    got: &PdStep,
    cat: &Catalog,
    model: &Model,
    opts: &ReplayOptions,
    criterion: Criterion,
) -> Option<Divergence> {
    let events = criterion != Criterion::Tokens;
    // The rows a transfer carries drift with the K/V (numerics, not
    // behaviour): their digests count under the bits criterion only.
    let strip = |es: &[PdEvent]| -> Vec<PdEvent> {
        es.iter()
            .cloned()
            .map(|mut e| {
                if let PdEvent::Transfer { digest, .. } = &mut e {
                    *digest = [0; 32];
                }
                e
            })
            .collect()
    };
    let (rec_link, got_link) = (strip(&rec.link), strip(&got.link));
    let rows_differ = criterion == Criterion::Bits && rec.link != got.link && rec_link == got_link;
    let side = |side: Side, d: Option<Divergence>| {
        d.map(|mut d| {
            d.detail = format!("{side} engine: {}", d.detail);
            d
        })
    };
    events
        .then(|| {
            events_differ(
                rec.step,
                "boundary events",
                &rec.before,
                &got.before,
                cat,
                opts,
            )
        })
        .flatten()
        .or_else(|| {
            side(
                Side::Prefill,
                compare(&rec.prefill, &got.prefill, cat, model, opts, criterion),
            )
        })
        .or_else(|| {
            events
                .then(|| events_differ(rec.step, "link events", &rec_link, &got_link, cat, opts))
                .flatten()
        })
        .or_else(|| {
            rows_differ.then(|| {
                let i = rec.link.iter().zip(&got.link).take_while(|(a, b)| a == b).count();
                divergence(
                    rec.step,
                    Signal::CacheState,
                    format!(
                        "the K/V rows of `{}` differ from the recording's (same positions and pages)",
                        rec.link.get(i).map_or(String::new(), |e| describe(e, cat))
                    ),
                    rec.link.get(i).map(|e| (event_id(e), None)),
                    cat,
                    opts,
                )
            })
        })
        .or_else(|| {
            side(
                Side::Decode,
                compare(&rec.decode, &got.decode, cat, model, opts, criterion),
            )
        })
}

/// Rows sampled in the latest step on both engines.
fn rows<'a>(e: &'a PdEngine) -> BTreeMap<(Side, RequestId), &'a Vec<f32>> {
    [Side::Prefill, Side::Decode]
        .into_iter()
        .flat_map(|s| {
            e.engine(s)
                .last_rows()
                .iter()
                .map(move |(id, r)| ((s, *id), r))
        })
        .collect()
}

/// [`crate::driver::replay_traced`] for a disaggregated bundle.
pub(crate) fn replay_pd(
    bundle: &Bundle,
    model: &Model,
    opts: &ReplayOptions,
    recorded: PatchSet,
    cfg: PdConfig,
) -> Result<(Outcome, Trace), ReplayError> {
    let m = &bundle.manifest;
    let cat = Catalog::of(bundle);
    let mut trace = Trace::default();
    let mut b = PdEngine::new(
        model.net(),
        m.engine,
        cfg,
        opts.threads.clone(),
        opts.patches.clone(),
    )?;
    b.set_top_logprobs(m.top_logprobs as usize);
    b.set_keep_rows(true);
    let mut a = if opts.patches != recorded {
        let mut a = PdEngine::new(model.net(), m.engine, cfg, opts.threads.clone(), recorded)?;
        a.set_keep_rows(true);
        Some(a)
    } else {
        None
    };
    let mut first: Option<Divergence> = None;
    let mut first_bits: Option<(u64, Signal)> = None;
    let mut drift_rows: Vec<DriftRow> = Vec::new();
    let (mut steps, mut tokens) = (0u64, 0u64);
    for e in &bundle.events {
        let rec = match e {
            Event::Arrival { request, .. } => {
                match b.submit(request.clone()) {
                    Err(_) if first.is_some() => break,
                    r => r?,
                }
                if let Some(a) = a.as_mut() {
                    a.submit(request.clone())?;
                }
                continue;
            }
            Event::Interrupt { id, .. } => {
                match b.interrupt(*id) {
                    Err(_) if first.is_some() => break,
                    r => r?,
                };
                if let Some(a) = a.as_mut() {
                    a.interrupt(*id)?;
                }
                continue;
            }
            Event::PdStep(r) => r,
            Event::Disaggregated(_) | Event::Step(_) => continue,
        };
        if let Some(a) = a.as_mut() {
            a.step_replay(rec).map_err(|source| ReplayError::Baseline {
                step: rec.step,
                source,
            })?;
        }
        let got = match b.step_replay(rec) {
            Ok(g) => g,
            Err(err) => {
                if first.is_none() {
                    let who = attribute(&rec.decode.decisions)
                        .or_else(|| attribute(&rec.prefill.decisions));
                    first = Some(divergence(
                        rec.step,
                        Signal::Decision,
                        err.to_string(),
                        who,
                        &cat,
                        opts,
                    ));
                }
                break;
            }
        };
        trace.last_step = Some(rec.step);
        for (_, r) in got.reports() {
            for s in &r.seqs {
                if let Some(token) = s.sampled {
                    trace.sampled.entry(s.id).or_default().push(Sampled {
                        step: rec.step,
                        position: s.start.saturating_add(s.len),
                        token,
                    });
                }
            }
        }
        let mut pairs = Vec::new();
        if let Some(a) = &a {
            let exp = rows(a);
            for (key, r) in rows(&b) {
                if let Some(e) = exp.get(&key) {
                    let (max_abs_dlogit, kl, top1_agrees) = drift(e, r);
                    trace.drift.push(RowDrift {
                        step: rec.step,
                        request: key.1,
                        max_abs_dlogit,
                        kl,
                        top1_agrees,
                    });
                    pairs.push((cat.name(key.1), max_abs_dlogit, kl, top1_agrees));
                }
            }
        }
        steps += 1;
        tokens += got
            .reports()
            .iter()
            .map(|(_, r)| r.seqs.iter().filter(|s| s.sampled.is_some()).count() as u64)
            .sum::<u64>();
        if first.is_none() {
            first = compare_step(rec, &got, &cat, model, opts, opts.criterion);
        }
        if first_bits.is_none() && opts.criterion != Criterion::Bits {
            first_bits = compare_step(rec, &got, &cat, model, opts, Criterion::Bits)
                .map(|d| (d.step, d.signal));
        }
        if let Some(d) = &first {
            if rec.step <= d.step + opts.drift_steps as u64 {
                drift_rows.extend(DriftRow::of(rec.step, &pairs));
            }
            let go_on = (opts.drift_steps as u64).max(opts.trace_steps);
            if opts.stop_at_first || rec.step >= d.step.saturating_add(go_on) {
                break;
            }
        }
    }
    let truncated = matches!(bundle.integrity, Integrity::Truncated { .. });
    let outcome = match (first, first_bits) {
        (None, None) => Outcome::BitExact {
            steps,
            tokens,
            truncated,
        },
        (None, Some((bits_from, bits_signal))) => Outcome::SameBehaviour {
            steps,
            tokens,
            truncated,
            criterion: opts.criterion,
            bits_from,
            bits_signal,
        },
        (Some(mut d), _) => {
            d.drift = drift_rows;
            d.window = window(bundle, &cat, model, d.step.saturating_sub(3), d.step + 2);
            Outcome::Diverged(Box::new(d))
        }
    };
    Ok((outcome, trace))
}

/// The window lines of a recorded disaggregated step: its boundary events,
/// then the prefill engine, the link and the decode engine, each when it did
/// something.
pub(crate) fn step_lines(
    p: &PdStep,
    cat: &Catalog,
    schedule: impl Fn(&lmrr_engine::StepReport) -> String,
) -> Vec<String> {
    let mut out = Vec::new();
    let events = |es: &[PdEvent]| {
        es.iter()
            .map(|e| describe(e, cat))
            .collect::<Vec<_>>()
            .join(" · ")
    };
    if !p.before.is_empty() {
        out.push(format!("before step {}: {}", p.step, events(&p.before)));
    }
    // An engine with nothing to do in the step gets no line.
    if !p.prefill.decisions.is_empty() {
        out.push(format!("step {} prefill: {}", p.step, schedule(&p.prefill)));
    }
    if !p.link.is_empty() {
        out.push(format!("step {} link: {}", p.step, events(&p.link)));
    }
    if !p.decode.decisions.is_empty() {
        out.push(format!("step {} decode: {}", p.step, schedule(&p.decode)));
    }
    out
}
