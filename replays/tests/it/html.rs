//! The HTML report's data part: locked by an insta snapshot (the numbers the
//! page draws come from the same structures as the text report), embedded
//! verbatim in the page, and the page of a truncated bundle says where it ends.

use lmrr_engine::{Model, PatchSet};
use lmrr_kernels::Threads;
use lmrr_replays::html::ReportData;
use lmrr_replays::{replay_traced, ReplayOptions};

fn incident() -> (lmrr_recorder::Bundle, Model) {
    let path = format!("{}/incident.lmrr", env!("CARGO_MANIFEST_DIR"));
    let b = lmrr_recorder::open(std::path::Path::new(&path)).unwrap();
    let spec = b.manifest.model.synthetic.unwrap();
    (b, Model::synthetic(spec).unwrap())
}

fn report(b: &lmrr_recorder::Bundle, m: &Model, patches: &str) -> ReportData {
    let set = PatchSet::parse(patches).unwrap();
    let mut opts = ReplayOptions::new(set.clone(), Threads::new(2).unwrap());
    opts.repro = format!("lmrr replay replays/incident.lmrr --patches {patches}");
    opts.trace_steps = u64::MAX;
    let (o, t) = replay_traced(b, m, &opts).unwrap();
    ReportData::replay(
        b,
        "replays/incident.lmrr",
        &opts.repro,
        m,
        &set.to_string(),
        &o,
        &t,
    )
}

fn data_part(html: &str) -> serde_json::Value {
    let start = html.find(r#"id="lmrr-data">"#).unwrap() + r#"id="lmrr-data">"#.len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

#[test]
fn incident_report_data_under_abort_inserts_partial() {
    let (b, m) = incident();
    let r = report(&b, &m, "abort-inserts-partial");
    // The outcome in the page is the text report's own.
    let text = lmrr_replays::replay(&b, &m, &{
        let mut o = ReplayOptions::new(
            PatchSet::parse("abort-inserts-partial").unwrap(),
            Threads::new(2).unwrap(),
        );
        o.repro = "lmrr replay replays/incident.lmrr --patches abort-inserts-partial".into();
        o
    })
    .unwrap();
    assert_eq!(
        r.outcome.as_ref(),
        Some(&text),
        "trace_steps changed the outcome"
    );
    let html = r.to_html().unwrap();
    assert_eq!(data_part(&html), serde_json::to_value(&r).unwrap());
    for id in [
        "id=\"timeline\"",
        "id=\"divergence-marker\"",
        "id=\"drift-plots\"",
        "id=\"texts\"",
    ] {
        assert!(html.contains(id), "page lacks {id}");
    }
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    s.bind(|| {
        insta::assert_snapshot!("html__incident_abort-inserts-partial", r.to_json().unwrap())
    });
}

#[test]
fn numerical_patch_draws_drift_and_svg() {
    let (b, m) = incident();
    let r = report(&b, &m, "fast-exp");
    let d = r
        .drift
        .as_ref()
        .expect("drift rows under a numerical patch");
    assert!(lmrr_replays::html::plot::has_drift(d));
    assert_eq!(d.marker, Some(0));
    let svg = r.drift_svg().unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("max |Δlogit|"));
}

#[test]
fn truncated_bundle_page_says_where() {
    let path = format!("{}/incident.lmrr", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(path).unwrap();
    let b = lmrr_recorder::read(&bytes[..bytes.len() * 2 / 3]).unwrap();
    let r = ReportData::inspect(&b, "cut.lmrr", "lmrr inspect cut.lmrr");
    let html = r.to_html().unwrap();
    assert!(html.contains(r#"id="truncated""#), "no truncation banner");
    assert!(html.contains("the last step it holds is"));
    assert!(html.contains("bundle truncated after step"));
}
