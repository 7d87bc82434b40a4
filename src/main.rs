//! `lmrr`: the command-line edge. Parses arguments, calls the libraries, prints.
//! No engine logic lives here.

mod bench;
mod demo;
mod disagg;
mod harm;
mod inspect;
mod probe;
mod proxy;
mod replay;
mod rerecord;
mod serve;

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use lmrr_engine::digest::hex;
use lmrr_engine::synth::SynthDtype;
use lmrr_engine::{
    run_session, EngineConfig, GenerateOptions, Model, Patch, PatchSet, Preset, SamplingParams,
    Script, SynthSpec,
};
use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::Threads;
use lmrr_recorder::{Manifest, Recorder};
use lmrr_replays::report::plural;

/// rr for LLM inference: a deterministic engine whose logits are a pure function
/// of the tokens, bit for bit.
///
/// With no command, runs the incident demo on the embedded default model (a
/// seeded synthetic llama, no download): record, replay, bisect, oracle.
#[derive(Parser, Debug)]
#[command(name = "lmrr", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Write a complete HF-layout model with seeded synthetic weights.
    GenModel(GenModelArgs),
    /// Generate a continuation and print its digest.
    Generate(GenerateArgs),
    /// Run a session script (multi-request, multi-turn) on the serving core.
    Run(RunArgs),
    /// Print a bundle's manifest, counts, size and integrity verdict (session
    /// or traffic bundle).
    Inspect(inspect::InspectArgs),
    /// Re-execute a bundle bit-exactly; report the first divergence; bisect patches.
    Replay(replay::ReplayArgs),
    /// Re-run a bundle's session on the current engine; write fresh hashes; show what changed.
    Rerecord(rerecord::RerecordArgs),
    /// List the engine patch catalog.
    Patches,
    /// Convert a llama GGUF file (e.g. SmolLM2) into an HF model directory.
    ImportGguf(ImportArgs),
    /// Teacher-forced logits of a text at every position, written for comparison tools.
    Score(ScoreArgs),
    /// Token ids of each string of a JSON array, printed as a JSON array of arrays.
    Tokenize(TokenizeArgs),
    /// Measure kernels, prefill and decode against the memory bandwidth.
    Bench(bench::BenchArgs),
    /// Serve the OpenAI API on the serving core, recording what happens.
    Serve(serve::ServeArgs),
    /// Forward OpenAI traffic to another server and record it for `lmrr audit`.
    Proxy(proxy::ProxyArgs),
    /// Check a server's recorded answers against lmrr's reference engine.
    Audit(proxy::AuditArgs),
    /// Context-fidelity sweeps: needles at depths × lengths, and recall
    /// after an interrupt, under patch sets or against a server.
    Probe(probe::ProbeArgs),
    /// Raw little-endian f32 of one GGUF tensor on stdout (for
    /// scripts/check_dequant.py).
    #[command(hide = true)]
    GgufDequant { file: PathBuf, tensor: String },
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Model: an HF directory, or `synthetic:PRESET[:SEED]` (default: embedded).
    #[arg(long)]
    model: Option<String>,
    /// Session script (TOML; format in README.md).
    #[arg(long)]
    script: PathBuf,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
    /// Where the kernels run: `cpu`, or `cuda` (builds with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The matmuls' arithmetic: `canonical` (FMA order, f32 activations) or
    /// `tensor-core-sm90` (bf16 activations and weights, sm_90 tensor cores
    /// or their CPU model; bf16 models only). Recorded in the bundle.
    #[arg(long, default_value = "canonical")]
    numerics: String,
    /// Tensor-parallel ranks: on the CPU, N ranks of the rank simulator
    /// (each holding its slice of the weights); on CUDA a degree above 1 is
    /// refused (multi-GPU needs NCCL, not built yet). Never changes a bit.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Positions per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Pages in the KV pool.
    #[arg(long, default_value_t = 256)]
    pool_pages: usize,
    /// Tokens per step (decode + chunked prefill).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Disable the radix prefix cache.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Record the session into this `.lmrr` bundle.
    #[arg(long)]
    record: Option<PathBuf>,
    /// Engine patches to run with (comma-separated; see `lmrr patches`).
    #[arg(long, default_value = "", value_parser = parse_patches)]
    patches: PatchSet,
    #[command(flatten)]
    disagg: disagg::DisaggArgs,
}

pub(crate) fn parse_patches(s: &str) -> Result<PatchSet, String> {
    PatchSet::parse(s)
}

#[derive(clap::Args, Debug)]
struct ImportArgs {
    /// The GGUF file.
    file: PathBuf,
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
    /// Weight storage: f32 (exact dequantized values), bf16 (rounded), or keep
    /// (quantized blocks as in the GGUF, dequantized on the fly to the same f32
    /// values as `f32`, bit for bit; block formats without a kept kernel are
    /// stored as f32).
    #[arg(long, default_value = "keep", value_parser = ["f32", "bf16", "keep"])]
    dtype: String,
}

#[derive(clap::Args, Debug)]
struct TokenizeArgs {
    /// Model: an HF directory, or `synthetic:PRESET[:SEED]`.
    #[arg(long)]
    model: Option<String>,
    /// A JSON file holding an array of strings.
    #[arg(long)]
    strings_file: PathBuf,
}

#[derive(clap::Args, Debug)]
struct ScoreArgs {
    /// Model: an HF directory, or `synthetic:PRESET[:SEED]`.
    #[arg(long)]
    model: Option<String>,
    /// File holding the text to score.
    #[arg(long)]
    text_file: PathBuf,
    /// Output: u32 token count, the token ids (u32), then one f32 row of
    /// `vocab` logits per position, all little-endian.
    #[arg(long)]
    out: PathBuf,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Where the kernels run: `cpu`, or `cuda` (builds with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(clap::Args, Debug)]
struct GenModelArgs {
    /// Model family: `llama` or `mini-v4`.
    #[arg(long, default_value = "llama")]
    arch: String,
    /// `tiny` (for tests) or `small` (for benchmarks; llama: SmolLM2-135M's
    /// shape); llama also `1b` and `8b` (Llama 3.2 1B's and Llama 3 8B's
    /// shapes, for GPU benchmarks: 2.4 and 15 GB in bf16). `mini-v4-tiny`
    /// and `mini-v4-small` name a mini-v4 preset whatever `--arch`.
    #[arg(long)]
    preset: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight storage: bf16 or f32.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    dtype: SynthDtype,
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
}

fn parse_dtype(s: &str) -> Result<SynthDtype, String> {
    match s {
        "bf16" => Ok(SynthDtype::Bf16),
        "f32" => Ok(SynthDtype::F32),
        _ => Err(format!("unknown dtype `{s}` (bf16, f32)")),
    }
}

#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// Model: an HF directory, or `synthetic:PRESET[:SEED]`. Default: the
    /// embedded synthetic tiny model, seed 0.
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value = "The quick brown fox")]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sampling seed (the draw at a position depends only on it and the logits).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt tokens per prefill step (default: whole prompt). Never changes a bit.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Keep generating after the EOS token.
    #[arg(long)]
    ignore_eos: bool,
    /// Send the prompt as one user message through the model's chat template
    /// (its own, from tokenizer_config.json; the built-in ChatML only for a
    /// vocabulary with ChatML's tokens) and print the reply.
    #[arg(long)]
    chat: bool,
    /// Where the kernels run: `cpu`, or `cuda` (builds with `--features
    /// cuda`). Never changes a bit.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The matmuls' arithmetic: `canonical` or `tensor-core-sm90` (see
    /// `lmrr run --help`).
    #[arg(long, default_value = "canonical")]
    numerics: String,
    /// Tensor-parallel ranks: on the CPU, N ranks of the rank simulator
    /// (each holding its slice of the weights); on CUDA a degree above 1 is
    /// refused (multi-GPU needs NCCL, not built yet). Never changes a bit.
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

impl Default for GenerateArgs {
    fn default() -> Self {
        Self {
            model: None,
            prompt: "The quick brown fox".into(),
            max_tokens: 32,
            seed: 0,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            threads: None,
            prefill_chunk: None,
            ignore_eos: false,
            chat: false,
            device: "cpu".into(),
            numerics: "canonical".into(),
            tp: 1,
        }
    }
}

/// Resolves `--model`: a directory, `synthetic:PRESET[:SEED]`, or the default.
pub(crate) fn load_model(spec: Option<&str>) -> Result<Model> {
    Model::from_spec(spec).with_context(|| match spec {
        Some(s) => format!("loading model `{s}`"),
        None => format!("loading {}", SynthSpec::embedded_default().name()),
    })
}

/// Most worker threads per available core. The pool's workers spin while
/// waiting for work, so threads beyond the cores only steal time from each
/// other; threads never change a bit, so capping is always safe.
const MAX_THREADS_PER_CORE: usize = 1;

pub(crate) fn threads(n: Option<usize>) -> Result<Threads> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cap = cores * MAX_THREADS_PER_CORE;
    let n = match n {
        None => cores,
        Some(n) if n > cap => {
            eprintln!(
                "warning: --threads {n}: using {cap}, the cores available (more would only spin against each other; the bits are the same either way)"
            );
            cap
        }
        Some(n) => n,
    };
    Ok(Threads::new(n)?)
}

/// Runs the model over `--tp` ranks (the CPU's rank simulator);
/// `LMRR_TP_FAIL=RANK:STEP` makes that rank fail at that step (a test hook).
pub(crate) fn set_tp(model: &mut Model, degree: usize) -> Result<()> {
    let fail = match std::env::var("LMRR_TP_FAIL") {
        Ok(s) => Some(lmrr_engine::exec::tp::TpConfig::parse_fail(&s).context("LMRR_TP_FAIL")?),
        Err(_) => None,
    };
    model
        .net
        .set_tp(lmrr_engine::exec::tp::TpConfig { degree, fail })
        .with_context(|| format!("--tp {degree}"))
}

/// Puts the model's matmuls under the numerics `--numerics` names.
pub(crate) fn set_numerics(model: &mut Model, numerics: &str) -> Result<()> {
    let n = Numerics::parse(numerics).with_context(|| {
        let known: Vec<&str> = Numerics::ALL.iter().map(|n| n.name()).collect();
        format!(
            "--numerics {numerics}: unknown (known: {})",
            known.join(", ")
        )
    })?;
    model
        .net
        .set_numerics(n)
        .with_context(|| format!("--numerics {numerics}"))
}

/// Moves the model's kernels to `device` (`cpu` or `cuda`).
pub(crate) fn set_device(model: &mut Model, device: &str) -> Result<()> {
    if let Some(name) = model
        .set_device_named(device)
        .with_context(|| format!("--device {device}"))?
    {
        eprintln!("device: {name}");
    }
    Ok(())
}

fn run_generate(a: &GenerateArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens 0: a request generates at least 1 token (as in a session script)");
    }
    let mut model = load_model(a.model.as_deref())?;
    set_device(&mut model, &a.device)?;
    set_numerics(&mut model, &a.numerics)?;
    set_tp(&mut model, a.tp)?;
    let th = threads(a.threads)?;
    let shown = if a.chat {
        model.chat_prompt(&a.prompt)?
    } else {
        a.prompt.clone()
    };
    let prompt = if a.chat {
        model.tokenizer.encode(&shown)?
    } else {
        model.tokenizer.encode_prompt(&shown)?
    };
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        prefill_chunk: a.prefill_chunk,
        stop_at_eos: !a.ignore_eos,
        keep_logits: false,
    };
    let t0 = std::time::Instant::now();
    let g = lmrr_engine::generate(model.net(), &prompt, &opts, &th)?;
    let dt = t0.elapsed().as_secs_f64();
    let text = model.tokenizer.decode(&g.tokens)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{shown}{text}")?;
    writeln!(out, "digest: {}", hex(&g.digest))?;
    eprintln!(
        "model {} · prompt {} · generated {} ({:?}) · {:.2}s · {}",
        model.origin,
        plural(prompt.len() as u64, "token"),
        g.tokens.len(),
        g.finish,
        dt,
        plural(th.count() as u64, "thread")
    );
    Ok(())
}

/// `lmrr run`: 0 = the session ran; 1 = it livelocked (a finding: the report
/// is printed and the bundle holds every step up to it); 2 = error.
fn run_run(a: &RunArgs) -> Result<u8> {
    let script = Script::load(&a.script)?;
    let mut model = load_model(a.model.as_deref())?;
    set_device(&mut model, &a.device)?;
    set_numerics(&mut model, &a.numerics)?;
    set_tp(&mut model, a.tp)?;
    let th = threads(a.threads)?;
    let cfg = EngineConfig {
        page_size: a.page_size,
        pool_pages: a.pool_pages,
        max_batch_tokens: a.max_batch_tokens,
        prefix_cache: !a.no_prefix_cache,
    };
    let threads_n = th.count();
    let inert = a.patches.inert_for(model.net.family());
    if !inert.is_empty() {
        let names: Vec<&str> = inert.iter().map(|p| p.name()).collect();
        eprintln!(
            "warning: {} cannot act on a {} model: inert in this run",
            names.join(", "),
            model.net.family()
        );
    }
    let mut sch = disagg::Engine::new(
        model.net(),
        cfg,
        a.disagg.config(cfg),
        th,
        a.patches.clone(),
    )?;
    // Validate against the model and pool before creating any file.
    script.check_fits(&model, &sch)?;
    let mut recorder = match &a.record {
        None => None,
        Some(path) => {
            let manifest = session_manifest(
                &model,
                cfg,
                &a.patches,
                &a.script.display().to_string(),
                &script.source,
                threads_n,
            );
            sch.set_top_logprobs(TOP_LOGPROBS);
            let f = std::fs::File::create(path)
                .with_context(|| format!("creating {}", path.display()))?;
            let mut r = Recorder::new(std::io::BufWriter::new(f), &manifest)?;
            if let Some(c) = sch.pd_config() {
                r.disaggregated(c);
            }
            Some(r)
        }
    };
    let t0 = std::time::Instant::now();
    let res = run_session(&model, &script, &mut sch, |e| {
        if let Some(r) = recorder.as_mut() {
            r.observe(e)
        }
    });
    // Whatever happened, the bundle gets its trailer: nothing recorded is lost.
    if let (Some(r), Some(path)) = (recorder, &a.record) {
        let w = r
            .finish()
            .with_context(|| format!("recording {}", path.display()))?;
        let f = w
            .into_inner()
            .map_err(|e| anyhow::anyhow!("flushing {}: {}", path.display(), e.error()))?;
        f.sync_all()
            .with_context(|| format!("syncing {}", path.display()))?;
    }
    let res = match res {
        Ok(r) => r,
        Err(e @ lmrr_engine::EngineError::Livelock { .. }) => {
            eprintln!("{e}");
            if let Some(path) = &a.record {
                eprintln!(
                    "the bundle {} holds every step up to the livelock: `lmrr replay {}` re-executes it",
                    path.display(),
                    path.display()
                );
            }
            return Ok(1);
        }
        Err(e) => return Err(e.into()),
    };
    let dt = t0.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    for r in &res.requests {
        let o = &r.output;
        writeln!(
            out,
            "=== {} · arrived at step {} · prompt {} ({} from cache) · generated {} · {}",
            r.name,
            r.arrived_at_step,
            plural(r.prompt.len() as u64, "token"),
            o.cached_tokens,
            o.tokens.len(),
            o.finish
        )?;
        writeln!(out, "{}", model.tokenizer.decode(&r.prompt)?)?;
        writeln!(out, "--- output")?;
        writeln!(out, "{}", model.tokenizer.decode(&o.tokens)?)?;
        writeln!(out, "digest: {}", hex(&o.digest))?;
    }
    eprintln!(
        "model {} · {} · {} · {:.2}s · {} cached at the end",
        model.origin,
        plural(res.requests.len() as u64, "request"),
        plural(res.steps, "step"),
        dt,
        plural(sch.cached_pages() as u64, "page")
    );
    Ok(0)
}

fn run_tokenize(a: &TokenizeArgs) -> Result<()> {
    let model = load_model(a.model.as_deref())?;
    let raw = std::fs::read(&a.strings_file)
        .with_context(|| format!("reading {}", a.strings_file.display()))?;
    let strings: Vec<String> = serde_json::from_slice(&raw).with_context(|| {
        format!(
            "{}: expected a JSON array of strings",
            a.strings_file.display()
        )
    })?;
    let ids = strings
        .iter()
        .map(|s| model.tokenizer.encode(s))
        .collect::<Result<Vec<_>, _>>()?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

fn run_score(a: &ScoreArgs) -> Result<()> {
    use lmrr_engine::{KvCache, LogitsWanted, SeqKvStore, SeqSpan};
    let mut model = load_model(a.model.as_deref())?;
    set_device(&mut model, &a.device)?;
    let text = std::fs::read_to_string(&a.text_file)
        .with_context(|| format!("reading {}", a.text_file.display()))?;
    let ids = model.tokenizer.encode_prompt(&text)?;
    let th = threads(a.threads)?;
    let mut kv = SeqKvStore::new(model.net.kv_layout());
    let span = SeqSpan {
        seq: 0,
        start: kv.len(0),
        tokens: &ids,
        logits: LogitsWanted::All,
    };
    let rows = model.net.forward(&mut kv, &[span], &th)?.remove(0);
    let mut out = Vec::with_capacity(4 + ids.len() * 4 + rows.len() * 4);
    out.extend((ids.len() as u32).to_le_bytes());
    out.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    out.extend(rows.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(&a.out, out).with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "{} tokens × {} logits → {}",
        ids.len(),
        model.net.vocab_size(),
        a.out.display()
    );
    Ok(())
}

fn run_import(a: &ImportArgs) -> Result<()> {
    use lmrr_engine::gguf::{import, ImportDtype};
    let dtype = ImportDtype::parse(&a.dtype)
        .with_context(|| format!("unknown --dtype `{}` (f32, bf16, keep)", a.dtype))?;
    // Every import error names the file itself.
    let r = import(&a.file, &a.out, dtype)?;
    println!(
        "wrote {}: {} tensors, {:.1}M parameters ({}), vocabulary {} with {} merges{}",
        a.out.display(),
        r.tensors,
        r.params as f64 / 1e6,
        a.dtype,
        r.vocab,
        r.merges,
        if r.chat_template {
            ", chat template"
        } else {
            ""
        }
    );
    let per_type = |m: &std::collections::BTreeMap<&str, usize>| {
        let v: Vec<String> = m.iter().map(|(t, n)| format!("{n} {t}")).collect();
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    if dtype == ImportDtype::Keep && !r.dequantized.is_empty() {
        println!(
            "kept as stored: {}; stored as f32 (no kept kernel for the type): {}",
            per_type(&r.kept),
            per_type(&r.dequantized)
        );
    }
    Ok(())
}

fn run_gguf_dequant(file: &std::path::Path, tensor: &str) -> Result<()> {
    use std::io::Write;
    let v = lmrr_engine::gguf::dequantize_file_tensor(file, tensor)?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::io::stdout().lock().write_all(&bytes)?;
    Ok(())
}

fn run_patches() -> Result<()> {
    let mut out = std::io::stdout().lock();
    for p in Patch::CATALOG {
        let mut family = p
            .family()
            .map_or("every family".to_string(), |f| f.to_string());
        if p.disaggregated_only() {
            family += ", disaggregated deployments (`--disaggregate`)";
        }
        writeln!(out, "{:<22} {:?}, {family}", p.name(), p.class())?;
        writeln!(out, "    {}", p.doc())?;
    }
    Ok(())
}

/// Top-k logprobs recorded per sampled token.
pub(crate) const TOP_LOGPROBS: usize = 5;

/// The manifest of a recording made by this binary.
pub(crate) fn session_manifest(
    model: &Model,
    cfg: EngineConfig,
    patches: &PatchSet,
    script_path: &str,
    script: &str,
    threads: usize,
) -> Manifest {
    let mut m = Manifest::for_session(
        model,
        cfg,
        patches,
        script_path,
        script,
        TOP_LOGPROBS as u32,
        threads as u32,
        env!("CARGO_PKG_VERSION"),
        env!("LMRR_GIT_REV"),
    );
    // Where the kernels ran (the host's ISA covers only the CPU path).
    if !matches!(model.net.device(), lmrr_engine::Device::Cpu) {
        m.host.isa = format!("{} (kernels on {:?})", m.host.isa, model.net.device());
    }
    m
}

/// Opens a bundle; errors name the file once (an I/O error names it itself).
pub(crate) fn open_bundle(path: &std::path::Path) -> Result<lmrr_recorder::Bundle> {
    lmrr_recorder::open(path).map_err(|e| match e {
        e @ lmrr_recorder::BundleError::Io { .. } => {
            anyhow::Error::new(e).context("reading bundle")
        }
        e => anyhow::Error::new(e).context(format!("reading bundle {}", path.display())),
    })
}

fn run_gen_model(a: &GenModelArgs) -> Result<()> {
    let family = match a.arch.as_str() {
        "llama" => lmrr_engine::Family::Llama,
        "mini-v4" => lmrr_engine::Family::MiniV4,
        other => bail!("unknown --arch `{other}` (llama, mini-v4)"),
    };
    let preset = match a.preset.parse::<Preset>() {
        Ok(p) if p.name().starts_with("mini-v4") => p,
        _ => Preset::of(family, &a.preset).map_err(anyhow::Error::msg)?,
    };
    let spec = SynthSpec {
        preset,
        seed: a.seed,
        dtype: a.dtype,
    };
    spec.write_dir(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {} to {}", spec.name(), a.out.display());
    Ok(())
}

/// Keeps freed memory in glibc's heap. Every step hands each sequence its
/// logits rows as fresh vectors (196 KB each on a 49 k vocabulary, so above
/// glibc's default mmap threshold), and the scheduler drops them once
/// sampled: by default each row is mapped, page-faulted in and unmapped
/// again, 12.6 MB a step at batch 64, which took 4–6 ms, more than a third
/// of a batch-64 GPU step. With the thresholds raised the rows reuse
/// resident heap pages (0.85 ms for the same copies on this machine).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator thresholds; it is called first
    // thing in main, before any other thread exists. A refusal (return 0)
    // leaves glibc's defaults, which are correct, only slower. 32 MiB is the
    // largest mmap threshold glibc documents for 64-bit systems.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

fn main() -> std::process::ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let res = match &cli.cmd {
        None => demo::run(),
        Some(Cmd::Generate(a)) => run_generate(a),
        Some(Cmd::GenModel(a)) => run_gen_model(a),
        Some(Cmd::Run(a)) => match run_run(a) {
            Ok(code) => return std::process::ExitCode::from(code),
            Err(e) => Err(e),
        },
        Some(Cmd::Inspect(a)) => inspect::run(a),
        Some(Cmd::Replay(a)) => match replay::run(a) {
            Ok(code) => return std::process::ExitCode::from(code),
            Err(e) => Err(e),
        },
        Some(Cmd::Patches) => run_patches(),
        Some(Cmd::ImportGguf(a)) => run_import(a),
        Some(Cmd::GgufDequant { file, tensor }) => run_gguf_dequant(file, tensor),
        Some(Cmd::Score(a)) => run_score(a),
        Some(Cmd::Tokenize(a)) => run_tokenize(a),
        Some(Cmd::Rerecord(a)) => rerecord::run(a),
        Some(Cmd::Bench(a)) => bench::run(a),
        Some(Cmd::Serve(a)) => serve::run(a),
        Some(Cmd::Proxy(a)) => proxy::run_proxy(a),
        Some(Cmd::Probe(a)) => match probe::run(a) {
            Ok(code) => return std::process::ExitCode::from(code),
            Err(e) => Err(e),
        },
        Some(Cmd::Audit(a)) => match proxy::run_audit(a) {
            Ok(code) => return std::process::ExitCode::from(code),
            Err(e) => Err(e),
        },
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A reader that stopped reading (`lmrr inspect B | head`) is not an error.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
