//! Model directories: loading, determinism of `gen-model`, and clear errors for
//! every kind of bad input (never a panic).

use std::path::Path;

use lmrr_engine::synth::SynthDtype;
use lmrr_engine::{generate, EngineError, GenerateOptions, Model, Preset, SynthSpec};
use lmrr_kernels::Threads;

fn tiny_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    SynthSpec::embedded_default().write_dir(d.path()).unwrap();
    d
}

fn load_err(dir: &Path) -> String {
    match Model::load_dir(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites `model.safetensors` in `dir`, replacing tensor `name` by `new`.
fn replace_tensor(
    dir: &Path,
    name: &str,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    views.push((
        name.into(),
        safetensors::tensor::TensorView::new(dtype, shape, &data).unwrap(),
    ));
    let out = safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(&p, out).unwrap();
}

#[test]
fn a_directory_loads_and_matches_the_in_memory_model() {
    let d = tiny_dir();
    let disk = Model::load_dir(d.path()).unwrap();
    let mem = Model::from_files(SynthSpec::embedded_default().build()).unwrap();
    let p = mem.tokenizer.encode("determinism").unwrap();
    assert_eq!(p, disk.tokenizer.encode("determinism").unwrap());
    let th = Threads::single();
    let opts = GenerateOptions {
        max_tokens: 8,
        stop_at_eos: false,
        ..Default::default()
    };
    let a = generate(mem.net(), &p, &opts, &th).unwrap();
    let b = generate(disk.net(), &p, &opts, &th).unwrap();
    assert_eq!(a.digest, b.digest);
}

#[test]
fn gen_model_is_byte_identical_for_a_seed_and_differs_across_seeds() {
    let a = SynthSpec::embedded_default().build();
    let b = SynthSpec::embedded_default().build();
    assert_eq!(a.config, b.config);
    assert_eq!(a.tokenizer, b.tokenizer);
    assert!(a.weight_bytes() == b.weight_bytes());
    let c = SynthSpec::new(Preset::Tiny, 1).build();
    assert!(a.weight_bytes() != c.weight_bytes());
    // On disk too.
    let (d1, d2) = (tiny_dir(), tiny_dir());
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(
            std::fs::read(d1.path().join(f)).unwrap() == std::fs::read(d2.path().join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn tiny_preset_has_about_a_million_parameters() {
    let m = Model::from_files(SynthSpec::embedded_default().build()).unwrap();
    let n = m.net.param_count();
    assert!((800_000..1_300_000).contains(&n), "{n} parameters");
}

#[test]
fn f32_and_bf16_storage_of_the_same_values_give_the_same_logits() {
    // bf16 weights widen exactly; an f32 file holding the widened values must give
    // identical bits. Build the f32 twin by widening every bf16 tensor.
    let d = tiny_dir();
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let widened: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::BF16);
            let data = v
                .data()
                .chunks_exact(2)
                .flat_map(|c| {
                    f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes()
                })
                .collect();
            (n, v.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<_> = widened
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let d32 = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(d.path().join(f), d32.path().join(f)).unwrap();
    }
    std::fs::write(
        d32.path().join("model.safetensors"),
        safetensors::tensor::serialize(views, None).unwrap(),
    )
    .unwrap();
    let a = Model::load_dir(d.path()).unwrap();
    let b = Model::load_dir(d32.path()).unwrap();
    let prompt = a.tokenizer.encode("same values, other storage").unwrap();
    let opts = GenerateOptions {
        max_tokens: 6,
        stop_at_eos: false,
        ..Default::default()
    };
    let th = Threads::new(2).unwrap();
    assert_eq!(
        generate(a.net(), &prompt, &opts, &th).unwrap().digest,
        generate(b.net(), &prompt, &opts, &th).unwrap().digest
    );
    // And the f32 generator path loads.
    let f = SynthSpec {
        preset: Preset::Tiny,
        seed: 0,
        dtype: SynthDtype::F32,
    }
    .build();
    Model::from_files(f).unwrap();
}

#[test]
fn missing_files_are_named() {
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        let d = tiny_dir();
        std::fs::remove_file(d.path().join(f)).unwrap();
        let e = load_err(d.path());
        assert!(e.contains(f) && e.contains("has no"), "{e}");
    }
    let e = load_err(Path::new("/nonexistent/lmrr-model"));
    assert!(e.contains("/nonexistent/lmrr-model"), "{e}");
}

#[test]
fn a_missing_config_field_is_named() {
    let d = tiny_dir();
    let p = d.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("config.json") && e.contains("hidden_size"),
        "{e}"
    );
}

#[test]
fn a_bad_config_value_is_named_with_its_value() {
    let d = tiny_dir();
    let p = d.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["num_key_value_heads"] = serde_json::json!(3);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("num_key_value_heads") && e.contains('3') && e.contains("4"),
        "{e}"
    );
}

#[test]
fn a_tensor_of_the_wrong_shape_names_tensor_expected_and_found() {
    let d = tiny_dir();
    let name = "model.layers.2.self_attn.k_proj.weight";
    replace_tensor(
        d.path(),
        name,
        safetensors::Dtype::BF16,
        vec![32, 128],
        vec![0; 32 * 128 * 2],
    );
    let e = load_err(d.path());
    assert!(
        e.contains(name) && e.contains("[32, 128]") && e.contains("[64, 128]"),
        "{e}"
    );
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_missing_tensor_is_named() {
    let d = tiny_dir();
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    std::fs::write(&p, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.norm.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn an_unsupported_dtype_is_named() {
    let d = tiny_dir();
    replace_tensor(
        d.path(),
        "model.norm.weight",
        safetensors::Dtype::I8,
        vec![128],
        vec![1; 128],
    );
    let e = load_err(d.path());
    assert!(e.contains("model.norm.weight") && e.contains("I8"), "{e}");
}

#[test]
fn a_corrupt_safetensors_file_is_an_error() {
    let d = tiny_dir();
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("safetensors"), "{e}");
}

#[test]
fn a_prompt_longer_than_the_context_reports_both_numbers() {
    let m = Model::from_files(SynthSpec::embedded_default().build()).unwrap();
    let ctx = m.net.context();
    let prompt = vec![5u32; ctx + 3];
    let e = generate(
        m.net(),
        &prompt,
        &GenerateOptions::default(),
        &Threads::single(),
    )
    .unwrap_err();
    assert!(
        matches!(e, EngineError::PromptTooLong { tokens, context } if tokens == ctx + 3 && context == ctx)
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&(ctx + 3).to_string()) && msg.contains(&ctx.to_string()),
        "{msg}"
    );
}

#[test]
fn out_of_vocabulary_tokens_and_bad_options_are_errors() {
    let m = Model::from_files(SynthSpec::embedded_default().build()).unwrap();
    let th = Threads::single();
    let e = generate(m.net(), &[1, 5000], &GenerateOptions::default(), &th).unwrap_err();
    assert!(
        e.to_string().contains("5000") && e.to_string().contains("1024"),
        "{e}"
    );
    let opts = GenerateOptions {
        prefill_chunk: Some(0),
        ..Default::default()
    };
    assert!(generate(m.net(), &[1, 2], &opts, &th).is_err());
    let mut opts = GenerateOptions::default();
    opts.sampling.top_p = 1.5;
    assert!(generate(m.net(), &[1, 2], &opts, &th)
        .unwrap_err()
        .to_string()
        .contains("top_p"));
    assert!(matches!(
        generate(m.net(), &[], &GenerateOptions::default(), &th),
        Err(EngineError::EmptyPrompt)
    ));
}

/// A copy of the sharded conformance checkpoint (six shards and an index)
/// that a test may break.
fn sharded_copy() -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conformance/llama");
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

/// Rewrites the index's `weight_map` entry of `tensor` to `shard`.
fn move_in_index(dir: &Path, tensor: &str, shard: &str) {
    let p = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["weight_map"][tensor] = serde_json::Value::String(shard.into());
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// The sharded checkpoint's tensors written again as one `model.safetensors`
/// (no index), beside copies of its other files.
fn unsharded_copy(sharded: &Path) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for e in std::fs::read_dir(sharded).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (n, v) in st.tensors() {
                tensors.push((n, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
            }
        } else if name != "model.safetensors.index.json" {
            std::fs::copy(&p, d.path().join(&name)).unwrap();
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, dt, sh, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, sh.clone(), data).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(d.path().join("model.safetensors"), out).unwrap();
    d
}

#[test]
fn a_sharded_checkpoint_has_the_identity_and_logits_of_its_tensors_in_one_file() {
    let sharded = sharded_copy();
    let one = unsharded_copy(sharded.path());
    let (a, b) = (
        Model::load_dir(sharded.path()).unwrap(),
        Model::load_dir(one.path()).unwrap(),
    );
    assert!(a.weight_file_bytes() > 0);
    assert_eq!(a.identity(), b.identity());
    let th = Threads::single();
    let opts = GenerateOptions {
        max_tokens: 4,
        ..GenerateOptions::default()
    };
    let ids: Vec<u32> = vec![1, 7, 42, 99, 5];
    let ga = generate(a.net(), &ids, &opts, &th).unwrap();
    let gb = generate(b.net(), &ids, &opts, &th).unwrap();
    assert_eq!(ga.tokens, gb.tokens);
    assert_eq!(ga.digest, gb.digest);
}

#[test]
fn a_missing_shard_is_named() {
    let d = sharded_copy();
    std::fs::remove_file(d.path().join("model-00003-of-00006.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model-00003-of-00006.safetensors"), "{e}");
}

#[test]
fn a_truncated_shard_is_an_error_naming_it() {
    let d = sharded_copy();
    let p = d.path().join("model-00002-of-00006.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model-00002-of-00006.safetensors"), "{e}");
}

#[test]
fn a_tensor_the_index_places_in_the_wrong_shard_is_named() {
    let d = sharded_copy();
    // The embedding lives in shard 1; the index now says shard 6.
    move_in_index(
        d.path(),
        "model.embed_tokens.weight",
        "model-00006-of-00006.safetensors",
    );
    let e = load_err(d.path());
    assert!(e.contains("model.embed_tokens.weight"), "{e}");
}

#[test]
fn a_shard_outside_the_directory_is_refused() {
    let d = sharded_copy();
    move_in_index(d.path(), "lm_head.weight", "../elsewhere.safetensors");
    let e = load_err(d.path());
    assert!(e.contains("lm_head.weight"), "{e}");
    assert!(e.contains("elsewhere"), "{e}");
}
