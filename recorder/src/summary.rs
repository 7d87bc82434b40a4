//! Counts and sizes of a bundle, for `lmrr inspect`.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::format::Bundle;
use crate::schema::Event;

/// For each request (in arrival `order`), how many earlier requests' history
/// (prompt, then recorded output) its prompt strictly extends.
///
/// Linear in the tokens: each prompt's prefixes are hashed once (a rolling
/// hash keyed with the length), looked up among earlier histories, and a hit
/// is confirmed by comparing tokens against one history of each distinct
/// content, so a bundle with 100,000 arrivals costs what its tokens cost.
pub fn continued_histories(
    order: &[u64],
    prompts: &BTreeMap<u64, Vec<u32>>,
    outputs: &BTreeMap<u64, Vec<u32>>,
) -> BTreeMap<u64, usize> {
    fn roll(h: u64, t: u32) -> u64 {
        (h ^ (t as u64 + 1)).wrapping_mul(0x0000_0100_0000_01B3)
    }
    /// Distinct histories sharing one (length, hash) key, with their counts.
    type Group = Vec<(Vec<u32>, usize)>;
    let mut seen: HashMap<(usize, u64), Group> = HashMap::new();
    let mut out = BTreeMap::new();
    let empty = Vec::new();
    for id in order {
        let p = prompts.get(id).unwrap_or(&empty);
        let mut n = 0;
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for (i, &t) in p.iter().enumerate().take(p.len().saturating_sub(1)) {
            h = roll(h, t);
            if let Some(group) = seen.get(&(i + 1, h)) {
                n += group
                    .iter()
                    .filter(|(hist, _)| p.starts_with(hist))
                    .map(|(_, c)| c)
                    .sum::<usize>();
            }
        }
        out.insert(*id, n);
        let mut hist = p.clone();
        hist.extend(outputs.get(id).map(|v| v.as_slice()).unwrap_or(&[]));
        if hist.is_empty() {
            continue;
        }
        let key = (
            hist.len(),
            hist.iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| roll(h, t)),
        );
        let group = seen.entry(key).or_default();
        match group.iter_mut().find(|(g, _)| *g == hist) {
            Some((_, c)) => *c += 1,
            None => group.push((hist, 1)),
        }
    }
    out
}

/// What a bundle holds.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub requests: usize,
    /// Requests whose prompt continues an earlier request's prompt and output.
    pub turns: usize,
    pub interrupts: usize,
    pub steps: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub preemptions: usize,
    pub bytes: u64,
    pub bytes_per_token: f64,
    /// zstd size of the token ids alone (prompts and sampled tokens).
    pub token_data_bytes: usize,
    pub token_data_bytes_per_token: f64,
    /// Raw size of the hashes recorded (32 bytes each, incompressible).
    pub hash_bytes: usize,
    pub frames: usize,
    pub integrity: String,
    pub truncated: bool,
}

impl Summary {
    pub fn of(b: &Bundle) -> Self {
        let mut prompts: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut outputs: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let (mut interrupts, mut steps, mut hashes, mut preemptions) = (0, 0, 0, 0);
        let mut order = Vec::new();
        for e in &b.events {
            match e {
                Event::Arrival { request, .. } => {
                    order.push(request.id);
                    prompts.insert(request.id, request.prompt.clone());
                }
                Event::Interrupt { .. } => interrupts += 1,
                Event::Disaggregated(_) => {}
                Event::Step(_) | Event::PdStep(_) => {
                    steps += 1;
                    for r in e.reports() {
                        hashes += 2;
                        for s in &r.seqs {
                            if let Some(t) = s.sampled {
                                outputs.entry(s.id).or_default().push(t);
                                hashes += 1;
                            }
                        }
                        preemptions += r
                            .decisions
                            .iter()
                            .filter(|d| matches!(d, lmrr_engine::Decision::Preempt { .. }))
                            .count();
                    }
                }
            }
        }
        // A turn: a prompt that starts with an earlier request's prompt + output.
        let turns = continued_histories(&order, &prompts, &outputs)
            .values()
            .filter(|&&n| n > 0)
            .count();
        let prompt_tokens: usize = prompts.values().map(|p| p.len()).sum();
        let generated_tokens: usize = outputs.values().map(|o| o.len()).sum();
        let all: Vec<&Vec<u32>> = prompts.values().chain(outputs.values()).collect();
        let token_data_bytes = crate::codec::encode(&all)
            .ok()
            .and_then(|raw| zstd::bulk::compress(&raw, 3).ok())
            .map_or(0, |c| c.len());
        let tokens = (prompt_tokens + generated_tokens).max(1) as f64;
        Self {
            requests: prompts.len(),
            turns,
            interrupts,
            steps,
            prompt_tokens,
            generated_tokens,
            preemptions,
            bytes: b.size,
            bytes_per_token: b.size as f64 / tokens,
            token_data_bytes,
            token_data_bytes_per_token: token_data_bytes as f64 / tokens,
            hash_bytes: hashes * 32,
            frames: b.frames,
            integrity: b.integrity.to_string(),
            truncated: matches!(b.integrity, crate::Integrity::Truncated { .. }),
        }
    }
}
