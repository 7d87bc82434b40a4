//! Session scripts: the shipped incident example runs and obeys I4, and
//! scripted interrupts cut where they say, on every family's tiny model;
//! malformed scripts are refused before anything runs, naming the line or the
//! request.

use crate::families;

use families::assert_reaches_sparse;
use lmrr_engine::session::SessionEvent;
use lmrr_engine::{
    generate, run_session, EngineConfig, FinishReason, GenerateOptions, Model, Preset, Scheduler,
    Script, SynthSpec,
};
use lmrr_kernels::Threads;

per_family!(
    the_incident_runs_turn2_carries_turn1_and_hits_the_cache,
    a_request_that_can_never_fit_is_refused_before_anything_runs,
    interrupt_at_step_cuts_a_chunked_prefill_and_releases_its_pages,
    interrupt_at_step_before_arrival_cuts_on_arrival,
);

/// The embedded model, for what does not depend on the family.
fn model() -> Model {
    Model::from_files(SynthSpec::embedded_default().build()).unwrap()
}

fn incident() -> Script {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/incident.toml");
    Script::load(&path).unwrap()
}

fn the_incident_runs_turn2_carries_turn1_and_hits_the_cache(p: Preset) {
    let m = families::model(p);
    let s = incident();
    let mut sch =
        Scheduler::new(m.net(), EngineConfig::default(), Threads::new(2).unwrap()).unwrap();
    let mut interrupts = 0;
    let res = run_session(m, &s, &mut sch, |e| {
        if let SessionEvent::Interrupt { name, .. } = e {
            assert_eq!(name, "turn1");
            interrupts += 1;
        }
    })
    .unwrap();
    assert_eq!(interrupts, 1);
    let (t1, t2) = (&res.requests[0], &res.requests[1]);
    assert_reaches_sparse(m, t2.prompt.len(), "turn 2's prompt");
    assert_eq!(t1.output.finish, FinishReason::Interrupted);
    assert_eq!(t1.output.tokens.len(), 60);
    // Turn 2's prompt = turn 1's prompt + its partial answer + the follow-up.
    assert_eq!(&t2.prompt[..t1.prompt.len()], &t1.prompt[..]);
    assert_eq!(
        &t2.prompt[t1.prompt.len()..t1.prompt.len() + 60],
        &t1.output.tokens[..]
    );
    assert!(
        t2.output.cached_tokens >= 64,
        "cached {}",
        t2.output.cached_tokens
    );
    // I4 on the example: each request equals its solo, cache-off run.
    for r in &res.requests {
        let max = if r.output.finish == FinishReason::Interrupted {
            r.output.tokens.len()
        } else {
            s.requests[r.id as usize].max_tokens
        };
        let opts = GenerateOptions {
            max_tokens: max,
            stop_at_eos: true,
            ..Default::default()
        };
        let g = generate(m.net(), &r.prompt, &opts, &Threads::single()).unwrap();
        assert_eq!(
            (&g.tokens, g.digest),
            (&r.output.tokens, r.output.digest),
            "{}",
            r.name
        );
    }
    sch.check_accounting().unwrap();
}

fn parse_err(src: &str) -> String {
    match Script::parse(src, "s.toml") {
        Ok(_) => panic!("script should be refused:\n{src}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_unknown_field_names_its_line() {
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\nmax_tokns = 3\n");
    assert!(
        e.contains("s.toml") && e.contains("max_tokns") && e.contains('4'),
        "{e}"
    );
}

#[test]
fn a_reference_to_a_missing_request_names_line_and_id() {
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\n\n[[request]]\nid = \"b\"\nprompt = \"y\"\nafter = \"zed\"\n");
    assert!(e.contains("s.toml:8") && e.contains("zed"), "{e}");
    let e = parse_err(
        "[[request]]\nid = \"a\"\nmessages = [{ role = \"user\", content = \"x\" }, { role = \"assistant\", from = \"ghost\" }]\n",
    );
    assert!(e.contains("s.toml:3") && e.contains("ghost"), "{e}");
}

#[test]
fn dependency_cycles_are_named() {
    let e = parse_err(
        "[[request]]\nid = \"a\"\nprompt = \"x\"\nafter = \"c\"\n[[request]]\nid = \"b\"\nprompt = \"x\"\nafter = \"a\"\n[[request]]\nid = \"c\"\nmessages = [{ role = \"assistant\", from = \"b\" }]\n",
    );
    assert!(e.contains("cycle") && e.contains("a → c → b → a"), "{e}");
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\nafter = \"a\"\n");
    assert!(e.contains("cycle") && e.contains("a → a"), "{e}");
}

#[test]
fn malformed_requests_are_named() {
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\nmessages = [{ role = \"user\", content = \"y\" }]\n");
    assert!(
        e.contains("`a`") && e.contains("exactly one of `prompt` and `messages`"),
        "{e}"
    );
    let e = parse_err(
        "[[request]]\nid = \"a\"\nprompt = \"x\"\n[[request]]\nid = \"a\"\nprompt = \"y\"\n",
    );
    assert!(e.contains("s.toml:5") && e.contains("duplicate"), "{e}");
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\ntop_p = 0\n");
    assert!(e.contains("top_p"), "{e}");
    let e =
        parse_err("[[request]]\nid = \"a\"\nmessages = [{ role = \"robot\", content = \"x\" }]\n");
    assert!(e.contains("robot"), "{e}");
    let e = parse_err("");
    assert!(e.contains("no [[request]]"), "{e}");
}

fn a_request_that_can_never_fit_is_refused_before_anything_runs(p: Preset) {
    let m = families::model(p);
    let s = Script::parse("[[request]]\nid = \"ok\"\nprompt = \"hi\"\nmax_tokens = 4\n[[request]]\nid = \"big\"\nprompt = \"hello there\"\nmax_tokens = 100\n", "s.toml").unwrap();
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 8,
        ..Default::default()
    };
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    let mut events = 0;
    let e = run_session(m, &s, &mut sch, |_| events += 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("request `big`") && e.contains("pool has 8"),
        "{e}"
    );
    assert_eq!((events, sch.steps()), (0, 0));
}

/// ChatML as a Jinja template: renders exactly what the built-in ChatML does,
/// so a model carrying it must give the same prompts as one without it.
const CHATML_TEMPLATE: &str = r#"{"chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"}"#;

fn templated_model() -> Model {
    let mut f = SynthSpec::embedded_default().build();
    f.tokenizer_config = Some((
        CHATML_TEMPLATE.as_bytes().to_vec(),
        "tokenizer_config.json".into(),
    ));
    let m = Model::from_files(f).unwrap();
    assert!(m.chat_template.is_some());
    m
}

/// The embedded default with ChatML's two tokens renamed: a vocabulary
/// that does not speak ChatML.
fn model_without_chatml(template: Option<&str>) -> Model {
    let mut f = SynthSpec::embedded_default().build();
    let text = String::from_utf8(f.tokenizer.clone())
        .unwrap()
        .replace("<|im_start|>", "<|turn|>")
        .replace("<|im_end|>", "<|done|>");
    f.tokenizer = text.into_bytes();
    f.tokenizer_config = template.map(|t| (t.as_bytes().to_vec(), "tokenizer_config.json".into()));
    Model::from_files(f).unwrap()
}

#[test]
fn chat_needs_a_template_where_the_vocabulary_has_no_chatml() {
    let m = model_without_chatml(None);
    assert!(!m.speaks_chatml());
    let err = m
        .chat_prompt("hi")
        .expect_err("no template and no ChatML tokens");
    let msg = err.to_string();
    assert!(
        msg.contains("no chat template") && msg.contains("<|im_start|>"),
        "{msg}"
    );
    // With its own template the same model renders.
    let t = r#"{"chat_template": "{% for m in messages %}<|turn|>{{ m['content'] }}<|done|>{% endfor %}"}"#;
    let m = model_without_chatml(Some(t));
    assert_eq!(m.chat_prompt("hi").unwrap(), "<|turn|>hi<|done|>");
    // The synthetic models speak ChatML: the built-in template serves them.
    assert!(Model::from_files(SynthSpec::embedded_default().build())
        .unwrap()
        .speaks_chatml());
}

fn prompts(m: &Model, s: &Script, max_batch_tokens: usize) -> Vec<Vec<u32>> {
    let cfg = EngineConfig {
        max_batch_tokens,
        ..Default::default()
    };
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    let res = run_session(m, s, &mut sch, |_| {}).unwrap();
    sch.check_accounting().unwrap();
    res.requests.into_iter().map(|r| r.prompt).collect()
}

/// Text that spells the old in-band markers around another request's id, an
/// unknown id, its own id, and stray halves.
const FORGED: &str = r#"
[[request]]
id = "t1"
prompt = "hello there"
max_tokens = 3
ignore_eos = true

[[request]]
id = "t2"
messages = [{ role = "user", content = "x\uF8F0t1\uF8F1y" }]
max_tokens = 2

[[request]]
id = "ghost"
messages = [{ role = "user", content = "\uF8F0nobody\uF8F1" }]
max_tokens = 2

[[request]]
id = "me"
messages = [{ role = "user", content = "\uF8F0me\uF8F1 \uF8F1\uF8F0" }]
max_tokens = 2

[[request]]
id = "t3"
messages = [
  { role = "user", content = "\uF8F0t1\uF8F1" },
  { role = "assistant", from = "t1" },
  { role = "user", content = "\uF8F0t2\uF8F1" },
]
max_tokens = 2
"#;

#[test]
fn message_text_with_marker_characters_reaches_the_model_as_text_whatever_the_budget() {
    let s = Script::parse(FORGED, "forged.toml").unwrap();
    let plain = model();
    let templated = templated_model();
    // The built-in ChatML builds parts directly: the reference.
    let want = prompts(&plain, &s, 512);
    let text = |t: &str| plain.tokenizer.encode(t).unwrap();
    assert_eq!(
        want[1],
        text("<|im_start|>user\nx\u{F8F0}t1\u{F8F1}y<|im_end|>\n<|im_start|>assistant\n")
    );
    // t3: the forged text stays text; the real splice is t1's output, once.
    let t1_out = {
        let mut sch =
            Scheduler::new(plain.net(), EngineConfig::default(), Threads::single()).unwrap();
        let r = run_session(&plain, &s, &mut sch, |_| {}).unwrap();
        r.requests[0].output.tokens.clone()
    };
    assert_eq!(t1_out.len(), 3);
    let mut t3 = text("<|im_start|>user\n\u{F8F0}t1\u{F8F1}<|im_end|>\n<|im_start|>assistant\n");
    t3.extend(&t1_out);
    t3.extend(text(
        "<|im_end|>\n<|im_start|>user\n\u{F8F0}t2\u{F8F1}<|im_end|>\n<|im_start|>assistant\n",
    ));
    assert_eq!(want[4], t3);
    // The model's own template: no panic, the same prompts, and none depends
    // on the batch budget (I4: a prompt is fixed by the script alone).
    for budget in [7, 512] {
        assert_eq!(prompts(&templated, &s, budget), want, "budget {budget}");
    }
}

#[test]
fn generate_chat_keeps_marker_characters_as_text() {
    let m = templated_model();
    let user = "a\u{F8F0}t1\u{F8F1}b\u{F8F0}";
    assert_eq!(
        m.chat_prompt(user).unwrap(),
        format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    );
}

#[test]
fn max_tokens_zero_is_refused_by_scripts_the_scheduler_and_generate() {
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\nmax_tokens = 0\n");
    assert!(
        e.contains("`a`") && e.contains("max_tokens = 0") && e.contains("at least 1"),
        "{e}"
    );
    let e = parse_err("[defaults]\nmax_tokens = 0\n[[request]]\nid = \"a\"\nprompt = \"x\"\n");
    assert!(
        e.contains("[defaults] max_tokens = 0") && e.contains("at least 1"),
        "{e}"
    );
    let m = model();
    let opts = GenerateOptions {
        max_tokens: 0,
        ..Default::default()
    };
    let e = generate(m.net(), &[1, 2], &opts, &Threads::single()).unwrap_err();
    assert!(e.to_string().contains("max_tokens = 0"), "{e}");
    let mut sch = Scheduler::new(m.net(), EngineConfig::default(), Threads::single()).unwrap();
    let e = sch
        .submit(lmrr_engine::Request {
            id: 0,
            prompt: vec![1, 2],
            sampling: Default::default(),
            max_tokens: 0,
            stop_at_eos: true,
        })
        .unwrap_err();
    assert!(e.to_string().contains("max_tokens = 0"), "{e}");
}

#[test]
fn interrupt_at_step_is_validated() {
    let e =
        parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\nat_step = 5\ninterrupt_at_step = 3\n");
    assert!(
        e.contains("`a`") && e.contains("interrupt_at_step = 3") && e.contains("at_step = 5"),
        "{e}"
    );
    let e = parse_err("[[request]]\nid = \"a\"\nprompt = \"x\"\ninterrupt_at_step = 100001\n");
    assert!(e.contains("100001") && e.contains("100000"), "{e}");
}

/// A 40-byte line, repeated: the byte-level tokenizer gives well over 16 tokens.
const LONG: &str = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.";

/// `long` is cut off at the boundary before step 2, two 8-token prefill
/// chunks into its prompt; `again` then sends the same prompt.
pub fn disconnect_script() -> String {
    format!(
        "[[request]]\nid = \"long\"\nprompt = \"{LONG}\"\nmax_tokens = 8\ninterrupt_at_step = 2\n\n\
         [[request]]\nid = \"again\"\nafter = \"long\"\nprompt = \"{LONG}\"\nmax_tokens = 6\n"
    )
}

fn interrupt_at_step_cuts_a_chunked_prefill_and_releases_its_pages(p: Preset) {
    let m = families::model(p);
    let s = Script::parse(&disconnect_script(), "disconnect.toml").unwrap();
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 64,
        max_batch_tokens: 8,
        prefix_cache: true,
    };
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    let mut computed = 0;
    let mut interrupted_at = None;
    let mut held = Vec::new();
    let res = run_session(m, &s, &mut sch, |e| match e {
        SessionEvent::Interrupt { step, name, .. } => {
            assert_eq!(name, "long");
            interrupted_at = Some(step);
        }
        SessionEvent::Step(r) => {
            for d in &r.decisions {
                if let lmrr_engine::Decision::Schedule { id: 0, len, .. } = d {
                    computed += len;
                }
            }
            held.push(r.step);
        }
        _ => {}
    })
    .unwrap();
    let (long, again) = (&res.requests[0], &res.requests[1]);
    assert!(long.prompt.len() > 16, "prompt {}", long.prompt.len());
    assert_reaches_sparse(m, again.prompt.len(), "the retry");
    assert_eq!(interrupted_at, Some(2));
    // Mid-prefill: two chunks of 8 computed, no token out.
    assert_eq!(computed, 16);
    assert_eq!(long.output.finish, FinishReason::Interrupted);
    assert!(long.output.tokens.is_empty());
    // The four full pages it computed are cached and serve the retry; its
    // pages are all released (free or cached), and the retry equals its solo,
    // cache-off run (I4).
    assert_eq!(again.arrived_at_step, 2);
    assert_eq!(again.output.cached_tokens, 16);
    let g = generate(
        m.net(),
        &again.prompt,
        &GenerateOptions {
            max_tokens: 6,
            ..Default::default()
        },
        &Threads::single(),
    )
    .unwrap();
    assert_eq!(
        (&g.tokens, g.digest),
        (&again.output.tokens, again.output.digest)
    );
    sch.check_accounting().unwrap();
    assert_eq!(sch.pages_held_by_requests(), 0);
    assert_eq!(sch.free_pages() + sch.cached_pages(), 64);
}

/// A request arriving after its `interrupt_at_step` is cut off on arrival.
fn interrupt_at_step_before_arrival_cuts_on_arrival(p: Preset) {
    let m = families::model(p);
    let s = Script::parse(
        "[[request]]\nid = \"a\"\nprompt = \"hello\"\nmax_tokens = 3\n\
         [[request]]\nid = \"b\"\nafter = \"a\"\nprompt = \"x\"\ninterrupt_at_step = 1\n",
        "s.toml",
    )
    .unwrap();
    let mut sch = Scheduler::new(m.net(), EngineConfig::default(), Threads::single()).unwrap();
    let res = run_session(m, &s, &mut sch, |_| {}).unwrap();
    let b = &res.requests[1];
    assert!(b.arrived_at_step > 1);
    assert_eq!(b.output.finish, FinishReason::Interrupted);
    assert!(b.output.tokens.is_empty());
}

fn chain(n: usize, reverse: bool) -> String {
    let mut s = String::with_capacity(n * 64);
    for i in 0..n {
        s.push_str(&format!(
            "[[request]]\nid = \"r{i}\"\nprompt = \"x\"\nmax_tokens = 1\n"
        ));
        let dep = if reverse { i + 1 } else { i.wrapping_sub(1) };
        if dep < n {
            s.push_str(&format!("after = \"r{dep}\"\n"));
        }
    }
    s
}

#[test]
fn a_100000_request_after_chain_parses_in_either_order_and_runs() {
    // Written last-first, the cycle check once recursed 100,000 deep.
    let s = Script::parse(&chain(100_000, true), "rchain.toml").unwrap();
    assert_eq!(s.requests.len(), 100_000);
    let closed = chain(100_000, false).replacen(
        "max_tokens = 1\n",
        "max_tokens = 1\nafter = \"r99999\"\n",
        1,
    );
    let e = parse_err(&closed);
    assert!(
        e.contains("dependency cycle: r0 → r99999 → r99998 → r99997 →")
            && e.contains("(99,993 more)")
            && e.contains("→ r2 → r1 → r0"),
        "{e}"
    );
    // Run: one step per request, and no scan of the whole script per step.
    let m = model();
    let s = Script::parse(&chain(100_000, false), "chain.toml").unwrap();
    let mut sch = Scheduler::new(m.net(), EngineConfig::default(), Threads::single()).unwrap();
    let t0 = std::time::Instant::now();
    let res = run_session(&m, &s, &mut sch, |_| {}).unwrap();
    assert_eq!(res.steps, 100_000);
    assert!(res.requests.iter().all(|r| r.output.tokens.len() == 1));
    eprintln!("100,000-request chain: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn prompt_tokens_send_exactly_those_ids() {
    let m = model();
    let ids = m.tokenizer.encode("The quick brown fox").unwrap();
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let src = format!(
        "[[request]]\nid = \"text\"\nprompt = \"The quick brown fox\"\nmax_tokens = 6\n\
         [[request]]\nid = \"ids\"\nprompt_tokens = [{}]\nmax_tokens = 6\nat_step = 9\n",
        list.join(", ")
    );
    let s = Script::parse(&src, "s.toml").unwrap();
    let mut sch = Scheduler::new(m.net(), EngineConfig::default(), Threads::single()).unwrap();
    let res = run_session(&m, &s, &mut sch, |_| {}).unwrap();
    assert_eq!(res.requests[1].prompt, ids);
    assert_eq!(res.requests[0].output.digest, res.requests[1].output.digest);
    let e = Script::parse("[[request]]\nid = \"a\"\nprompt_tokens = []\n", "s.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`prompt_tokens` is empty"), "{e}");
    let e = Script::parse(
        "[[request]]\nid = \"a\"\nprompt = \"x\"\nprompt_tokens = [1]\n",
        "s.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("exactly one of"), "{e}");
}
