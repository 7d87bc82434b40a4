//! deepseek_v3 beyond conformance: what its KV store holds per position (the
//! normalised latent, then the rotated shared key, and nothing else), that
//! attention reads exactly those rows, and that a config inconsistent with
//! the tensors is refused by name with the numbers.

use std::path::{Path, PathBuf};

use lmrr_engine::{KvCache, LogitsWanted, Model, SeqKvStore, SeqSpan};
use lmrr_kernels::Threads;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conformance/deepseek_v3")
}

/// The fixture's config as JSON.
fn config() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap()
}

/// A copy of the fixture in a temporary directory with `edit` applied to its
/// config; the load's error text.
fn load_error(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let mut cfg = config();
    edit(&mut cfg);
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec(&cfg).unwrap(),
    )
    .unwrap();
    match Model::load_dir(dir.path()) {
        Ok(_) => panic!("an inconsistent config loaded"),
        Err(e) => format!("{e:#}"),
    }
}

/// One named f32 tensor of the fixture, as f64.
fn tensor(name: &str) -> Vec<f64> {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect()
}

/// `w · rmsnorm(x)` in f64, transformers' definition.
fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| w * (v * r)).collect()
}

/// `W · x` for a row-major `(rows, x.len())` matrix, in f64.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Position 0 of layer 0 holds `[kv_a_layernorm(latent) ; k_pe]`, where at
/// position 0 RoPE is the identity scaled by YaRN's attention factor (1 for
/// this config) and `rope_interleave` puts pair element `2i` at `i` and
/// `2i + 1` at `half + i`. Computed here from the safetensors file in f64,
/// independently of the engine; and the KV layout has no K/V rows.
#[test]
fn the_kv_store_holds_the_normalised_latent_then_the_rotated_shared_key() {
    let m = Model::load_dir(&fixture()).unwrap();
    let cfg = config();
    let (d, r, rd) = (64, 32, 8);
    assert_eq!(cfg["kv_lora_rank"], r);
    assert_eq!(cfg["qk_rope_head_dim"], rd);
    let layout = m.net.kv_layout();
    assert_eq!((layout.kv_dim, layout.aux_dim), (0, r + rd));

    let tok = 90u32;
    let mut kv = SeqKvStore::new(layout);
    let span = SeqSpan {
        seq: 1,
        start: 0,
        tokens: &[tok, 7, 200],
        logits: LogitsWanted::None,
    };
    m.net.forward(&mut kv, &[span], &Threads::single()).unwrap();
    let got: Vec<f64> = kv.aux_view(1, 0).row(0).iter().map(|&x| x as f64).collect();

    let embed = tensor("model.embed_tokens.weight");
    let x = &embed[tok as usize * d..(tok as usize + 1) * d];
    let h = rms_norm(x, &tensor("model.layers.0.input_layernorm.weight"), 1e-6);
    let ckv = matvec(
        &tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
        &h,
    );
    let latent = rms_norm(
        &ckv[..r],
        &tensor("model.layers.0.self_attn.kv_a_layernorm.weight"),
        1e-6,
    );
    let pe = &ckv[r..];
    let mut want = latent;
    want.extend((0..rd / 2).map(|i| pe[2 * i]));
    want.extend((0..rd / 2).map(|i| pe[2 * i + 1]));
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "element {i}: stored {g}, expected {w}"
        );
    }
}

/// Attention reads the stored rows and nothing else: one corrupted latent
/// row of an earlier position changes the next token's logits, and putting
/// the row back restores them bit for bit.
#[test]
fn attention_reads_exactly_the_stored_latent_rows() {
    let m = Model::load_dir(&fixture()).unwrap();
    let th = Threads::single();
    let prompt = [292u32, 289, 96, 258, 197, 16];
    let next = [170u32];
    let run = |corrupt: Option<&dyn Fn(&mut SeqKvStore)>| -> Vec<u32> {
        let mut kv = SeqKvStore::new(m.net.kv_layout());
        let span = SeqSpan {
            seq: 1,
            start: 0,
            tokens: &prompt,
            logits: LogitsWanted::None,
        };
        m.net.forward(&mut kv, &[span], &th).unwrap();
        if let Some(f) = corrupt {
            f(&mut kv);
        }
        let span = SeqSpan {
            seq: 1,
            start: prompt.len(),
            tokens: &next,
            logits: LogitsWanted::Last,
        };
        let out = m.net.forward(&mut kv, &[span], &th).unwrap();
        out[0].iter().map(|x| x.to_bits()).collect()
    };
    let clean = run(None);
    let (layer, pos) = (1, 2);
    let flip = |kv: &mut SeqKvStore| {
        let mut row = kv.aux_view(1, layer).row(pos).to_vec();
        row[3] += 0.5;
        kv.write_aux(1, layer, pos, &row);
    };
    assert_ne!(
        run(Some(&flip)),
        clean,
        "a corrupted latent row went unseen"
    );
    let flip_back = |kv: &mut SeqKvStore| {
        let row = kv.aux_view(1, layer).row(pos).to_vec();
        let mut bad = row.clone();
        bad[3] += 0.5;
        kv.write_aux(1, layer, pos, &bad);
        kv.write_aux(1, layer, pos, &row);
    };
    assert_eq!(run(Some(&flip_back)), clean);
    let pe = |kv: &mut SeqKvStore| {
        let mut row = kv.aux_view(1, layer).row(pos).to_vec();
        let last = row.len() - 1;
        row[last] = -row[last] + 0.25;
        kv.write_aux(1, layer, pos, &row);
    };
    assert_ne!(run(Some(&pe)), clean, "a corrupted k_pe went unseen");
}

/// Dimensions that disagree with the tensors, a missing tensor, and a
/// routing the experts cannot be split into are refused naming the tensor
/// or field and the numbers.
#[test]
fn a_config_inconsistent_with_the_tensors_is_refused_by_name() {
    let e = load_error(|c| c["kv_lora_rank"] = 16.into());
    assert!(
        e.contains("kv_b_proj") && e.contains("16") && e.contains("32"),
        "{e}"
    );
    let e = load_error(|c| c["qk_rope_head_dim"] = 4.into());
    assert!(
        e.contains("q_b_proj") && e.contains("80") && e.contains("96"),
        "{e}"
    );
    let e = load_error(|c| c["q_lora_rank"] = serde_json::Value::Null);
    assert!(e.contains("q_proj.weight"), "{e}");
    let e = load_error(|c| c["num_hidden_layers"] = 4.into());
    assert!(e.contains("model.layers.3."), "{e}");
    let e = load_error(|c| c["n_group"] = 3.into());
    assert!(e.contains("n_group") && e.contains('8'), "{e}");
    let e = load_error(|c| c["attention_bias"] = true.into());
    assert!(e.contains("attention_bias"), "{e}");
}
