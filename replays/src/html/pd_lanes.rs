//! The timeline of a disaggregated bundle: two lanes per request, one per
//! engine. The prefill lane holds the request's arrival, its prompt's
//! chunks and the abort if it came before the decode engine took the
//! request over; the decode lane holds the K/V transfers into its reserved
//! pages (and, under `pd-abort-reuses-pages`, the orphaned writes that go
//! on after an abort), the admission, the decode steps and the finish.
//! Built from the same events as the colocated timeline, with the same run
//! merging, so a lane's size follows what happens to the request, not the
//! session's length.

use std::collections::BTreeMap;

use lmrr_engine::scheduler::RequestId;
use lmrr_engine::{PdEvent, Stage};
use lmrr_recorder::{Bundle, Event};

use super::timeline::{add_decisions, add_run, Lane, Mark, RunKind, Timeline};
use crate::driver::Catalog;

/// Lanes in arrival order, prefill then decode for each request.
pub(super) fn of(bundle: &Bundle, cat: &Catalog) -> Timeline {
    let mut lanes = Vec::with_capacity(2 * cat.order.len());
    let (mut prefill, mut decode) = (BTreeMap::new(), BTreeMap::new());
    for &id in &cat.order {
        for (engine, index) in [("prefill", &mut prefill), ("decode", &mut decode)] {
            index.insert(id, lanes.len());
            lanes.push(Lane {
                request: cat.name(id),
                request_id: id,
                turn: cat.turn(id),
                engine: Some(engine.into()),
                runs: Vec::new(),
                marks: Vec::new(),
            });
        }
    }
    let lane = |index: &BTreeMap<RequestId, usize>, id: &RequestId| index.get(id).copied();
    let mut last_step = 0;
    for e in &bundle.events {
        match e {
            Event::Arrival { step, request, .. } => {
                if let Some(i) = lane(&prefill, &request.id) {
                    lanes[i].marks.push(Mark::Arrival {
                        step: *step,
                        prompt_tokens: request.prompt.len(),
                    });
                }
            }
            Event::PdStep(p) => {
                last_step = last_step.max(p.step);
                for ev in p.before.iter().chain(&p.link) {
                    match ev {
                        PdEvent::Abort { id, stage } => {
                            let side = match stage {
                                Stage::QueuedForPrefill | Stage::Prefilling => &prefill,
                                _ => &decode,
                            };
                            if let Some(i) = lane(side, id) {
                                lanes[i].marks.push(Mark::Interrupt { step: p.step });
                            }
                        }
                        PdEvent::Transfer {
                            id, len, orphan, ..
                        } => {
                            if let Some(i) = lane(&decode, id) {
                                let kind = if *orphan {
                                    RunKind::OrphanTransfer
                                } else {
                                    RunKind::Transfer
                                };
                                add_run(&mut lanes[i], kind, p.step, *len);
                            }
                        }
                        PdEvent::Admit { id } => {
                            if let Some(i) = lane(&decode, id) {
                                lanes[i].marks.push(Mark::Admit {
                                    step: p.step,
                                    cached: 0,
                                });
                            }
                        }
                        _ => {}
                    }
                }
                add_decisions(&mut lanes, &prefill, &p.prefill);
                add_decisions(&mut lanes, &decode, &p.decode);
                for (id, reason) in &p.finished {
                    let ended_on_prefill = p
                        .link
                        .iter()
                        .any(|e| matches!(e, PdEvent::Prefilled { id: x, finish: Some(_), .. } if x == id))
                        || p.prefill.finished.iter().any(|(x, _)| x == id);
                    let side = if ended_on_prefill { &prefill } else { &decode };
                    if let Some(i) = lane(side, id) {
                        lanes[i].marks.push(Mark::Finish {
                            step: p.step,
                            reason: format!("{reason:?}").to_lowercase(),
                        });
                    }
                }
            }
            Event::Interrupt { .. } | Event::Step(_) | Event::Disaggregated(_) => {}
        }
    }
    Timeline {
        last_step,
        lanes,
        divergence: None,
    }
}
