//! The determinism contract, bitwise, on the synthetic tiny model:
//! I1 run-to-run, I2 batch, I3 chunking, I5 threads, I7 sampling.

use std::sync::OnceLock;

use lmrr_engine::{
    generate, GenerateOptions, KvCache, LogitsWanted, Model, SamplingParams, SeqKvStore, SeqSpan,
    SynthSpec,
};
use lmrr_kernels::Threads;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::from_files(SynthSpec::embedded_default().build()).unwrap())
}

fn store(m: &Model) -> SeqKvStore {
    SeqKvStore::new(m.net.kv_layout())
}

/// Deterministic token sequence of length `n` (ids below 1000).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 1000) as u32 + 3
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits of every position of `toks`, one sequence alone, fed in `chunk`s.
fn all_logits(m: &Model, toks: &[u32], chunk: usize, th: &Threads) -> Vec<u32> {
    let mut kv = store(m);
    let mut out = Vec::new();
    for part in toks.chunks(chunk) {
        let span = SeqSpan {
            seq: 7,
            start: kv.len(7),
            tokens: part,
            logits: LogitsWanted::All,
        };
        out.extend(m.net.forward(&mut kv, &[span], th).unwrap().remove(0));
    }
    bits(&out)
}

#[test]
fn i1_same_input_same_bits_every_run() {
    let m = model();
    let th = Threads::new(2).unwrap();
    let t = tokens(1, 90);
    let a = all_logits(m, &t, 90, &th);
    let b = all_logits(m, &t, 90, &th);
    assert_eq!(a, b);
    // A second, independently built model instance too.
    let m2 = Model::from_files(SynthSpec::embedded_default().build()).unwrap();
    assert_eq!(a, all_logits(&m2, &t, 90, &th));
}

#[test]
fn i3_chunked_prefill_equals_one_shot_at_every_position() {
    let m = model();
    let th = Threads::new(2).unwrap();
    let t = tokens(2, 150);
    let whole = all_logits(m, &t, t.len(), &th);
    for chunk in [1, 7, 64] {
        assert_eq!(all_logits(m, &t, chunk, &th), whole, "chunk {chunk}");
    }
}

#[test]
fn i5_thread_count_never_changes_a_bit() {
    let m = model();
    let t = tokens(3, 80);
    let one = all_logits(m, &t, 80, &Threads::single());
    for n in [2, 3] {
        assert_eq!(
            all_logits(m, &t, 80, &Threads::new(n).unwrap()),
            one,
            "threads {n}"
        );
    }
}

#[test]
fn i2_a_sequence_alone_equals_it_batched_with_three_others() {
    let m = model();
    let th = Threads::new(2).unwrap();
    let target = tokens(4, 70);
    let alone = all_logits(m, &target, 70, &Threads::single());
    let vocab = m.net.vocab_size();
    // Three batch-mates of different lengths, already at different positions.
    let mates: Vec<Vec<u32>> = vec![tokens(5, 130), tokens(6, 45), tokens(7, 200)];
    let mut kv = store(m);
    let pre = [33usize, 0, 101];
    for (i, (mt, &p)) in mates.iter().zip(&pre).enumerate() {
        if p > 0 {
            let s = SeqSpan {
                seq: 100 + i as u64,
                start: 0,
                tokens: &mt[..p],
                logits: LogitsWanted::None,
            };
            m.net.forward(&mut kv, &[s], &th).unwrap();
        }
    }
    // Feed the target in uneven pieces while mates advance by other amounts.
    let pieces = [5usize, 1, 17, 1, 1, 30, 15];
    let mut pos = 0;
    let mut mate_pos = pre;
    let mut got = Vec::new();
    for (step, &len) in pieces.iter().enumerate() {
        let mut spans = vec![SeqSpan {
            seq: 1,
            start: pos,
            tokens: &target[pos..pos + len],
            logits: LogitsWanted::All,
        }];
        for (i, mt) in mates.iter().enumerate() {
            let adv = (step * 3 + i * 5) % 11 + 1;
            let s = mate_pos[i];
            if s + adv <= mt.len() {
                spans.push(SeqSpan {
                    seq: 100 + i as u64,
                    start: s,
                    tokens: &mt[s..s + adv],
                    logits: LogitsWanted::Last,
                });
                mate_pos[i] += adv;
            }
        }
        // Put the target at a different index of the batch each step.
        let r = step % spans.len();
        spans.rotate_left(r);
        let outs = m.net.forward(&mut kv, &spans, &th).unwrap();
        let idx = spans.iter().position(|s| s.seq == 1).unwrap();
        assert_eq!(outs[idx].len(), len * vocab);
        got.extend(bits(&outs[idx]));
        pos += len;
    }
    assert_eq!(pos, target.len());
    assert_eq!(got, alone);
}

#[test]
fn generate_digest_is_invariant_to_threads_and_prefill_chunk() {
    let m = model();
    let prompt = tokens(8, 100);
    let run = |threads: usize, chunk: Option<usize>| {
        let opts = GenerateOptions {
            max_tokens: 24,
            prefill_chunk: chunk,
            stop_at_eos: false,
            ..Default::default()
        };
        generate(m.net(), &prompt, &opts, &Threads::new(threads).unwrap()).unwrap()
    };
    let base = run(1, None);
    for (th, ch) in [
        (2, None),
        (3, None),
        (2, Some(1)),
        (1, Some(7)),
        (3, Some(64)),
    ] {
        let g = run(th, ch);
        assert_eq!(g.tokens, base.tokens, "threads {th} chunk {ch:?}");
        assert_eq!(g.digest, base.digest, "threads {th} chunk {ch:?}");
    }
}

#[test]
fn i7_sampled_tokens_do_not_depend_on_batch_mates() {
    // Decode two sampled sequences together, then each alone: same tokens.
    let m = model();
    let th = Threads::new(2).unwrap();
    let params = [
        SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed: 11,
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 0,
            top_p: 1.0,
            seed: 12,
        },
    ];
    let prompts = [tokens(9, 20), tokens(10, 37)];
    let decode = |which: &[usize]| -> Vec<Vec<u32>> {
        let mut kv = store(m);
        let mut seqs: Vec<Vec<u32>> = which.iter().map(|&i| prompts[i].clone()).collect();
        let mut fed = vec![0usize; which.len()];
        let mut out = vec![Vec::new(); which.len()];
        for _ in 0..20 {
            let spans: Vec<SeqSpan> = which
                .iter()
                .enumerate()
                .map(|(j, &i)| SeqSpan {
                    seq: i as u64,
                    start: fed[j],
                    tokens: &seqs[j][fed[j]..],
                    logits: LogitsWanted::Last,
                })
                .collect();
            let logits = m.net.forward(&mut kv, &spans, &th).unwrap();
            for (j, &i) in which.iter().enumerate() {
                fed[j] = seqs[j].len();
                let tok = lmrr_engine::sample(&logits[j], &params[i], seqs[j].len() as u64);
                seqs[j].push(tok);
                out[j].push(tok);
            }
        }
        out
    };
    let both = decode(&[0, 1]);
    assert_eq!(decode(&[0])[0], both[0]);
    assert_eq!(decode(&[1])[0], both[1]);
    assert_ne!(both[0], both[1]);
}

#[test]
fn greedy_output_does_not_collapse_and_logits_are_finite() {
    let m = model();
    let th = Threads::new(2).unwrap();
    for prompt in [
        "The quick brown fox",
        "Hello world, this is a test of",
        "<|im_start|>user\nwrite a tic tac toe html page<|im_end|>\n",
    ] {
        let p = m.tokenizer.encode(prompt).unwrap();
        let opts = GenerateOptions {
            max_tokens: 64,
            stop_at_eos: false,
            keep_logits: true,
            ..Default::default()
        };
        let g = generate(m.net(), &p, &opts, &th).unwrap();
        assert_eq!(g.tokens.len(), 64);
        assert!(
            g.logits.iter().flatten().all(|v| v.is_finite()),
            "non-finite logits for {prompt:?}"
        );
        let longest_run = g
            .tokens
            .chunk_by(|a, b| a == b)
            .map(|r| r.len())
            .max()
            .unwrap_or(0);
        let mut distinct = g.tokens.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(
            longest_run < 16,
            "{prompt:?}: run of {longest_run} identical tokens"
        );
        assert!(
            distinct.len() >= 16,
            "{prompt:?}: only {} distinct tokens",
            distinct.len()
        );
    }
}
