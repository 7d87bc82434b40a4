//! The `small` preset: SmolLM2-135M's shape, finite activations, no collapse.

use lmrr_engine::{generate, GenerateOptions, Model, Preset, SynthSpec};
use lmrr_kernels::Threads;

#[test]
fn small_preset_has_the_smollm2_shape_and_generates_varied_text() {
    let m = Model::from_files(SynthSpec::new(Preset::Small, 0).build()).unwrap();
    let c = m.llama().unwrap().config();
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.n_kv_heads(),
            c.intermediate_size
        ),
        (576, 30, 9, 3, 1536)
    );
    assert!(c.vocab_size >= 32_000);
    assert_eq!(m.tokenizer.vocab_size(), c.vocab_size);
    let p = m
        .tokenizer
        .encode("<|im_start|>user\nwrite a tic tac toe html page<|im_end|>\n")
        .unwrap();
    let opts = GenerateOptions {
        max_tokens: 64,
        stop_at_eos: false,
        keep_logits: true,
        ..Default::default()
    };
    let g = generate(m.net(), &p, &opts, &Threads::new(2).unwrap()).unwrap();
    assert!(g.logits.iter().flatten().all(|v| v.is_finite()));
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
        longest_run < 16 && distinct.len() >= 16,
        "run {longest_run}, distinct {}",
        distinct.len()
    );
}
