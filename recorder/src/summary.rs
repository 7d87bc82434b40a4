//! Counts and sizes of a bundle, for `lmrr inspect`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::format::Bundle;
use crate::schema::Event;

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
                Event::Step(r) => {
                    steps += 1;
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
        // A turn: a prompt that starts with an earlier request's prompt + output.
        let mut turns = 0;
        for (i, id) in order.iter().enumerate() {
            let p = &prompts[id];
            let continues = order[..i].iter().any(|e| {
                let mut hist = prompts[e].clone();
                hist.extend(outputs.get(e).map(|v| v.as_slice()).unwrap_or(&[]));
                !hist.is_empty() && p.len() > hist.len() && p.starts_with(&hist)
            });
            turns += usize::from(continues);
        }
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
