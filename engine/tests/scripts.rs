//! Session scripts: the shipped incident example runs and obeys I4; malformed
//! scripts are refused before anything runs, naming the line or the request.

use lmrr_engine::session::SessionEvent;
use lmrr_engine::{
    generate, run_session, EngineConfig, FinishReason, GenerateOptions, Model, Scheduler, Script,
    SynthSpec,
};
use lmrr_kernels::Threads;

fn model() -> Model {
    Model::from_files(SynthSpec::embedded_default().build()).unwrap()
}

fn incident() -> Script {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/incident.toml");
    Script::load(&path).unwrap()
}

#[test]
fn the_incident_runs_turn2_carries_turn1_and_hits_the_cache() {
    let m = model();
    let s = incident();
    let mut sch =
        Scheduler::new(&m.llama, EngineConfig::default(), Threads::new(2).unwrap()).unwrap();
    let mut interrupts = 0;
    let res = run_session(&m, &s, &mut sch, |e| {
        if let SessionEvent::Interrupt { name, .. } = e {
            assert_eq!(name, "turn1");
            interrupts += 1;
        }
    })
    .unwrap();
    assert_eq!(interrupts, 1);
    let (t1, t2) = (&res.requests[0], &res.requests[1]);
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
        let g = generate(&m.llama, &r.prompt, &opts, &Threads::single()).unwrap();
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

#[test]
fn a_request_that_can_never_fit_is_refused_before_anything_runs() {
    let m = model();
    let s = Script::parse("[[request]]\nid = \"ok\"\nprompt = \"hi\"\nmax_tokens = 4\n[[request]]\nid = \"big\"\nprompt = \"hello there\"\nmax_tokens = 100\n", "s.toml").unwrap();
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 8,
        ..Default::default()
    };
    let mut sch = Scheduler::new(&m.llama, cfg, Threads::single()).unwrap();
    let mut events = 0;
    let e = run_session(&m, &s, &mut sch, |_| events += 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("request `big`") && e.contains("pool has 8"),
        "{e}"
    );
    assert_eq!((events, sch.steps()), (0, 0));
}
