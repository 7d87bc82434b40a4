//! SmolLM2-135M-Instruct, imported from its GGUF (`scripts/get-smollm2.sh`).
//! Runs when the model is present (`LMRR_SMOLLM2=DIR`, or the default cache
//! directory). Ignored by default, so a run without the model shows them as
//! ignored; `.ci/run` adds `--include-ignored` when it fetched the model.

use std::path::PathBuf;

use lmrr_engine::{generate, GenerateOptions, Model};
use lmrr_kernels::Threads;

/// The imported model's directory. The tests that call this are ignored by
/// default; run with `--include-ignored` they fail, naming the path, when the
/// model is absent.
fn model_dir() -> PathBuf {
    let dir = std::env::var_os("LMRR_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| {
            let cache = std::env::var_os("LMRR_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/lmrr"))
                })?;
            Some(cache.join("smollm2-135m-instruct"))
        })
        .expect("LMRR_SMOLLM2 or HOME is set");
    assert!(
        dir.join("model.safetensors").is_file(),
        "no SmolLM2 at {} (run scripts/get-smollm2.sh, or set LMRR_SMOLLM2)",
        dir.display()
    );
    dir
}

const QUESTION: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_answers_the_capital_of_france() {
    let dir = model_dir();
    let m = Model::load_dir(&dir).unwrap();
    let c = m.llama().unwrap().config();
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.vocab_size,
            c.rope_theta
        ),
        (576, 30, 49152, 100_000.0)
    );
    let p = m.tokenizer.encode(QUESTION).unwrap();
    assert_eq!(
        (p[0], m.tokenizer.token_id("<|im_end|>")),
        (1, Some(2)),
        "special tokens"
    );
    let g = generate(
        m.net(),
        &p,
        &GenerateOptions {
            max_tokens: 16,
            ..Default::default()
        },
        &Threads::new(2).unwrap(),
    )
    .unwrap();
    let text = m.tokenizer.decode(&g.tokens).unwrap();
    assert_eq!(text, "The capital of France is Paris.<|im_end|>");
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_is_bit_exact_across_threads_and_chunking() {
    let dir = model_dir();
    let m = Model::load_dir(&dir).unwrap();
    let p = m
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog. 12345 is a number, ünïcödé too.")
        .unwrap();
    let run = |t: usize, chunk: Option<usize>| {
        let opts = GenerateOptions {
            max_tokens: 6,
            prefill_chunk: chunk,
            stop_at_eos: false,
            ..Default::default()
        };
        generate(m.net(), &p, &opts, &Threads::new(t).unwrap())
            .unwrap()
            .digest
    };
    let base = run(1, None);
    assert_eq!(run(2, Some(5)), base);
    assert_eq!(run(3, Some(1)), base);
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_tokenizer_round_trips_varied_text() {
    let dir = model_dir();
    let m = Model::load_dir(&dir).unwrap();
    for s in [
        "Hello, world!",
        "  leading spaces and\ttabs\n\nnewlines",
        "fn main() { println!(\"{}\", 1 + 2); }",
        "数字 1234567890 and émojis 🚀",
        "<|im_start|>system\nYou are helpful<|im_end|>",
    ] {
        let ids = m.tokenizer.encode(s).unwrap();
        assert_eq!(m.tokenizer.decode(&ids).unwrap(), s, "{ids:?}");
    }
    // Digits are split one by one (the `smollm` pre-tokenizer).
    assert_eq!(m.tokenizer.encode("2024").unwrap().len(), 4);
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_keep_import_is_bit_identical_to_the_f32_import() {
    // The GGUF sits next to the model directory (scripts/get-smollm2.sh).
    let dir = model_dir();
    let gguf = PathBuf::from(format!("{}.Q4_1.gguf", dir.display()));
    if !gguf.is_file() {
        let why = format!("no GGUF at {} (run scripts/get-smollm2.sh)", gguf.display());
        if std::env::var("LMRR_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
            panic!("LMRR_REQUIRE_TOOLS=1 and {why}");
        }
        // Straight to stderr: libtest hides a passing test's eprintln!.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
        return;
    }
    use lmrr_engine::gguf::{import, ImportDtype};
    let tmp = tempfile::tempdir().unwrap();
    let (keep, f32_dir) = (tmp.path().join("keep"), tmp.path().join("f32"));
    import(&gguf, &keep, ImportDtype::Keep).unwrap();
    import(&gguf, &f32_dir, ImportDtype::F32).unwrap();
    let size = |d: &std::path::Path| {
        std::fs::metadata(d.join("model.safetensors"))
            .unwrap()
            .len()
    };
    assert!(
        size(&keep) * 5 < size(&f32_dir),
        "{} vs {}",
        size(&keep),
        size(&f32_dir)
    );
    let run = |d: &std::path::Path| {
        let m = Model::load_dir(d).unwrap();
        let p = m
            .tokenizer
            .encode("Zorblax likes teal. def f(x): return x ** 2  # 12345 ünïcödé")
            .unwrap();
        let opts = GenerateOptions {
            max_tokens: 8,
            prefill_chunk: Some(7),
            stop_at_eos: false,
            keep_logits: true,
            ..Default::default()
        };
        let g = generate(m.net(), &p, &opts, &Threads::new(2).unwrap()).unwrap();
        let bits: Vec<u32> = g.logits.iter().flatten().map(|x| x.to_bits()).collect();
        (g.tokens, g.digest, bits)
    };
    let (a, b) = (run(&keep), run(&f32_dir));
    assert_eq!(a.0, b.0, "tokens");
    assert!(a.2 == b.2 && !a.2.is_empty(), "logits bits differ");
    assert_eq!(a.1, b.1, "digest");
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_in_its_own_chat_template_resolves_the_france_near_tie_like_f64() {
    // With SmolLM2's template (default system prompt included) the first
    // answer token is a 0.08-wide near-tie between "The" and "L"; the exact
    // f64 reference ranks "The" first (docs/REFERENCE.md), llama.cpp "L".
    let dir = model_dir();
    let m = Model::load_dir(&dir).unwrap();
    let text = m.chat_prompt("What is the capital of France?").unwrap();
    assert!(
        text.contains("named SmolLM"),
        "default system prompt: {text}"
    );
    let p = m.tokenizer.encode(&text).unwrap();
    let opts = GenerateOptions {
        max_tokens: 12,
        keep_logits: true,
        ..Default::default()
    };
    let g = generate(m.net(), &p, &opts, &Threads::new(2).unwrap()).unwrap();
    let reply = m.tokenizer.decode(&g.tokens).unwrap();
    assert_eq!(reply, "The capital of France is Paris.<|im_end|>");
    let row = &g.logits[0];
    let (the, l) = (
        m.tokenizer.token_id("The").unwrap() as usize,
        m.tokenizer.token_id("L").unwrap() as usize,
    );
    let gap = row[the] - row[l];
    assert!(gap > 0.0 && gap < 0.2, "The − L = {gap}");
}
