//! The determinism contract, bitwise, on every family's tiny synthetic model:
//! I1 run-to-run, I2 batch, I3 chunking, I5 threads, I7 sampling, and the
//! page size of the KV store with prefix pages shared (I-page). On mini-v4
//! every test's sequences run past the first sparse position, so the indexer,
//! its keys in the KV store's auxiliary rows and the sparse gather are under
//! test; chunk and page sizes are chosen not to line up with its index blocks.

use crate::families;

use families::{assert_reaches_sparse, model};
use lmrr_engine::mini_v4::indexer::Selection;
use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
use lmrr_engine::{
    generate, GenerateOptions, KvCache, LogitsWanted, Model, PatchSet, Preset, SamplingParams,
    SeqKvStore, SeqSpan,
};
use lmrr_kernels::Threads;

per_family!(
    i1_same_input_same_bits_every_run,
    i3_chunked_prefill_equals_one_shot_at_every_position,
    i5_thread_count_never_changes_a_bit,
    a_recycled_store_buffer_never_changes_a_bit,
    i2_a_sequence_alone_equals_it_batched_with_three_others,
    page_size_and_shared_prefix_pages_never_change_a_bit,
    generate_digest_is_invariant_to_threads_and_prefill_chunk,
    i7_sampled_tokens_do_not_depend_on_batch_mates,
    greedy_output_does_not_collapse_and_logits_are_finite,
    sparse_attention_starts_where_the_tests_assume,
);

// The same contract under tensor-core numerics (llama's tiny model, bf16
// weights, on the CPU model of sm_90's mma): the GPU's tensor cores are held
// to these bits by tc_probe and scripts/device-check.sh.
per_numerics!(
    i1_same_input_same_bits_every_run,
    i3_chunked_prefill_equals_one_shot_at_every_position,
    i5_thread_count_never_changes_a_bit,
    i2_a_sequence_alone_equals_it_batched_with_three_others,
    page_size_and_shared_prefix_pages_never_change_a_bit,
    generate_digest_is_invariant_to_threads_and_prefill_chunk,
    i7_sampled_tokens_do_not_depend_on_batch_mates,
    greedy_output_does_not_collapse_and_logits_are_finite,
);

#[test]
fn tensor_core_numerics_are_another_arithmetic_and_need_bf16_weights() {
    use lmrr_kernels::tensor_core::Numerics;
    // The mode is really on: the same tokens give other logits bits.
    let th = Threads::single();
    let t = tokens(3, 40);
    let canonical = all_logits(model(Preset::Tiny), &t, 40, &th);
    let tc = families::with_tensor_cores(|| all_logits(model(Preset::Tiny), &t, 40, &th));
    assert_ne!(canonical, tc);
    assert_eq!(model(Preset::Tiny).net.numerics(), Numerics::Canonical);
    // f32 weights are refused, naming the storage and the way out.
    let mut spec = lmrr_engine::SynthSpec::new(Preset::Tiny, 0);
    spec.dtype = lmrr_engine::synth::SynthDtype::F32;
    let mut m = Model::synthetic(spec).unwrap();
    let e = m
        .net
        .set_numerics(Numerics::TensorCoreSm90)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stored as f32") && e.contains("bf16"), "{e}");
    assert_eq!(
        m.net.numerics(),
        Numerics::Canonical,
        "a refused switch changes nothing"
    );
    // A family without the mode says so.
    let mut v = families::fresh(Preset::MiniV4Tiny);
    let e = v
        .net
        .set_numerics(Numerics::TensorCoreSm90)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor-core-sm90 numerics"), "{e}");
}

/// `families::sparse_from`, which every test above uses to check that its
/// sequences reach sparse attention, against the indexer's own choices: every
/// layer reads everything up to the position before, and from it on a
/// selection of `index_topk` blocks. llama has no indexer: nothing to explain.
fn sparse_attention_starts_where_the_tests_assume(p: Preset) {
    let m = model(p);
    let th = Threads::single();
    let t = tokens(14, 100);
    let none = PatchSet::none();
    let Some(from) = families::sparse_from(m) else {
        assert!(m.net.explain(&t, 80, &th, &none).unwrap().is_none());
        return;
    };
    let v = m.mini_v4().unwrap();
    let layers = v.config().num_hidden_layers;
    let dense = v.chosen_blocks(&t, from - 1, &th, &none).unwrap();
    assert_eq!(dense.len(), layers);
    assert!(dense.iter().all(|c| c.selection == Selection::Dense));
    for pos in [from, 99] {
        let chosen = v.chosen_blocks(&t, pos, &th, &none).unwrap();
        assert_eq!(chosen.len(), layers);
        for c in chosen {
            match c.selection {
                Selection::Sparse { blocks, .. } => {
                    assert_eq!(blocks.len(), v.config().index_topk, "layer {}", c.layer)
                }
                Selection::Dense => panic!("layer {} dense at {pos}", c.layer),
            }
        }
    }
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

/// A sequence in buffers its store kept from a removed, longer one (whose
/// rows past the new sequence's length are still there) has a fresh store's
/// logits at every position, fed whole or in chunks.
fn a_recycled_store_buffer_never_changes_a_bit(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    let (old, new) = (tokens(21, 150), tokens(22, 90));
    assert_reaches_sparse(m, new.len(), "recycled");
    for chunk in [90, 23] {
        let mut kv = store(m);
        let old_span = SeqSpan {
            seq: 7,
            start: 0,
            tokens: &old,
            logits: LogitsWanted::Last,
        };
        m.net.forward(&mut kv, &[old_span], &th).unwrap();
        let held = kv.bytes();
        kv.remove(7);
        assert_eq!(kv.bytes(), held, "the removed sequence's buffers are kept");
        let mut out = Vec::new();
        for part in new.chunks(chunk) {
            let span = SeqSpan {
                seq: 8,
                start: kv.len(8),
                tokens: part,
                logits: LogitsWanted::All,
            };
            out.extend(m.net.forward(&mut kv, &[span], &th).unwrap().remove(0));
        }
        assert_eq!(kv.bytes(), held, "the new sequence took the kept buffers");
        assert_eq!(bits(&out), all_logits(m, &new, 90, &th), "chunk {chunk}");
        kv.trim();
        assert_eq!(kv.bytes(), held, "trim frees only kept buffers");
    }
}

fn i1_same_input_same_bits_every_run(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    let t = tokens(1, 90);
    assert_reaches_sparse(m, t.len(), "I1");
    let a = all_logits(m, &t, 90, &th);
    let b = all_logits(m, &t, 90, &th);
    assert_eq!(a, b);
    // A second, independently built model instance too.
    let m2 = families::fresh(p);
    assert_eq!(a, all_logits(&m2, &t, 90, &th));
}

fn i3_chunked_prefill_equals_one_shot_at_every_position(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    let t = tokens(2, 150);
    assert_reaches_sparse(m, t.len(), "I3");
    let whole = all_logits(m, &t, t.len(), &th);
    // 7 and 23 cut mini-v4's 16-position index blocks anywhere; 64 at their
    // edges, where the first sparse position starts a chunk.
    for chunk in [1, 7, 23, 64] {
        assert_eq!(all_logits(m, &t, chunk, &th), whole, "chunk {chunk}");
    }
}

fn i5_thread_count_never_changes_a_bit(p: Preset) {
    let m = model(p);
    let t = tokens(3, 80);
    assert_reaches_sparse(m, t.len(), "I5");
    let one = all_logits(m, &t, 80, &Threads::single());
    for n in [2, 3] {
        assert_eq!(
            all_logits(m, &t, 80, &Threads::new(n).unwrap()),
            one,
            "threads {n}"
        );
    }
}

fn i2_a_sequence_alone_equals_it_batched_with_three_others(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    let target = tokens(4, 70);
    assert_reaches_sparse(m, target.len(), "I2");
    let alone = all_logits(m, &target, 70, &Threads::single());
    let vocab = m.net.vocab_size();
    // Three batch-mates of different lengths, already at different positions.
    let mates: Vec<Vec<u32>> = vec![tokens(5, 130), tokens(6, 45), tokens(7, 200)];
    let mut kv = store(m);
    let pre = [33usize, 0, 101];
    for (i, (mt, &len)) in mates.iter().zip(&pre).enumerate() {
        if len > 0 {
            let s = SeqSpan {
                seq: 100 + i as u64,
                start: 0,
                tokens: &mt[..len],
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

/// A pool with `ps`-position pages for sequences of up to `n` positions each.
fn paged(m: &Model, ps: usize, seqs: usize, n: usize) -> PagedKv {
    let pages = seqs * n.div_ceil(ps);
    PagedKv::new(PagePool::new(ps, pages, m.net.kv_layout()).unwrap())
}

/// Gives `seq` pages for `n` more positions.
fn grow(kv: &mut PagedKv, seq: u64, n: usize) {
    let ps = kv.pool.page_size();
    let t = kv.tables.entry(seq).or_default();
    while t.pages.len() * ps < t.len + n {
        let p = kv.pool.alloc().unwrap().expect("the pool is sized for it");
        t.pages.push(p);
    }
}

/// Feeds `seqs` (id, tokens) together, from what `kv` holds of each on, in
/// pieces of `piece` tokens; returns the logits bits of the positions fed.
fn feed(
    m: &Model,
    kv: &mut PagedKv,
    seqs: &[(u64, &[u32])],
    piece: usize,
    th: &Threads,
) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); seqs.len()];
    loop {
        let mut spans = Vec::new();
        for &(id, toks) in seqs {
            let at = kv.len(id);
            if at < toks.len() {
                let len = piece.min(toks.len() - at);
                grow(kv, id, len);
                spans.push(SeqSpan {
                    seq: id,
                    start: at,
                    tokens: &toks[at..at + len],
                    logits: LogitsWanted::All,
                });
            }
        }
        if spans.is_empty() {
            return out;
        }
        let rows = m.net.forward(kv, &spans, th).unwrap();
        kv.finish_step();
        for (span, r) in spans.iter().zip(rows) {
            let i = seqs.iter().position(|s| s.0 == span.seq).unwrap();
            out[i].extend(bits(&r));
        }
    }
}

/// I-page and prefix-cache hits at the forward pass: through a paged pool
/// the logits are the same bits whatever the page size (1 to 64, across
/// mini-v4's 16-position index blocks), whatever pages the table holds
/// (interleaved with a batch-mate's, in descending order), and when the
/// first full pages are another sequence's, written by it (a prefix-cache
/// hit: K, V and indexer keys read from shared pages, only the rest computed).
fn page_size_and_shared_prefix_pages_never_change_a_bit(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    let vocab = m.net.vocab_size();
    let a = tokens(11, 110);
    let mate = tokens(12, 60);
    // `b` shares `a`'s first 75 tokens, then goes its own way.
    let shared_tokens = 75;
    let b = [&a[..shared_tokens], &tokens(13, 30)].concat();
    assert_reaches_sparse(m, a.len(), "I-page");
    assert_reaches_sparse(m, b.len(), "I-page (prefix hit)");
    let want_a = all_logits(m, &a, a.len(), &th);
    let want_b = all_logits(m, &b, b.len(), &th);
    for ps in [1, 7, 16, 64] {
        let mut kv = paged(m, ps, 3, a.len());
        // Descending page ids for `a`: every page is another block of the pool.
        let n_a = a.len().div_ceil(ps);
        let mut ids: Vec<_> = (0..n_a)
            .map(|_| kv.pool.alloc().unwrap().unwrap())
            .collect();
        ids.reverse();
        kv.tables.insert(1, BlockTable { pages: ids, len: 0 });
        let got = feed(m, &mut kv, &[(1, &a), (2, &mate)], 13, &th);
        assert_eq!(got[0], want_a, "page size {ps}");
        // A prefix hit: `b` holds `a`'s full pages of the shared tokens.
        let full = shared_tokens / ps;
        let pages = kv.tables[&1].pages[..full].to_vec();
        for &pg in &pages {
            kv.pool.incref(pg);
        }
        kv.tables.insert(
            3,
            BlockTable {
                len: full * ps,
                pages,
            },
        );
        let got = feed(m, &mut kv, &[(3, &b)], 9, &th);
        assert_eq!(
            got[0],
            want_b[full * ps * vocab..],
            "page size {ps}, {} positions from shared pages",
            full * ps
        );
    }
}

fn generate_digest_is_invariant_to_threads_and_prefill_chunk(p: Preset) {
    let m = model(p);
    let prompt = tokens(8, 100);
    assert_reaches_sparse(m, prompt.len(), "generate");
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
        (2, Some(23)),
    ] {
        let g = run(th, ch);
        assert_eq!(g.tokens, base.tokens, "threads {th} chunk {ch:?}");
        assert_eq!(g.digest, base.digest, "threads {th} chunk {ch:?}");
    }
}

fn i7_sampled_tokens_do_not_depend_on_batch_mates(p: Preset) {
    // Decode two sampled sequences together, then each alone: same tokens.
    let m = model(p);
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
    // Both cross into sparse attention while decoding (mini-v4).
    let prompts = [tokens(9, 50), tokens(10, 61)];
    assert_reaches_sparse(m, prompts[0].len() + 20, "I7");
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

fn greedy_output_does_not_collapse_and_logits_are_finite(p: Preset) {
    let m = model(p);
    let th = Threads::new(2).unwrap();
    for prompt in [
        "The quick brown fox",
        "Hello world, this is a test of",
        "<|im_start|>user\nwrite a tic tac toe html page<|im_end|>\n",
    ] {
        let ids = m.tokenizer.encode(prompt).unwrap();
        let opts = GenerateOptions {
            max_tokens: 64,
            stop_at_eos: false,
            keep_logits: true,
            ..Default::default()
        };
        let g = generate(m.net(), &ids, &opts, &th).unwrap();
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
