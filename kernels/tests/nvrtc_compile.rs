//! kernels.cu compiles under NVRTC with the options the device path uses,
//! and so does every source the negative controls of `gpu_check` derive from
//! it (feature `cuda`). Needs only libnvrtc, no GPU and no driver: `.ci/run`
//! fetches NVRTC from PyPI, so a kernel that would not compile fails CI
//! instead of failing `Gpu::open` on a device; so does the compute_90 build
//! that programmatic dependent launch loads. Skipped, with the reason
//! printed, where libnvrtc cannot be loaded.
#![cfg(feature = "cuda")]

use lmrr_kernels::cuda::{
    compile, compile_for, compile_many, negative_controls, nvrtc_present, SOURCE,
};

#[test]
fn kernels_cu_compiles_under_nvrtc() {
    if !nvrtc_present() {
        eprintln!(
            "SKIPPED: no libnvrtc on this machine (set LD_LIBRARY_PATH to an NVRTC 13 lib folder)"
        );
        return;
    }
    let ptx = compile(SOURCE, false).unwrap_or_else(|e| panic!("{e}"));
    for name in [
        "matmul_warp",
        "matmul_tile",
        "matmul_rows",
        "matmul_multi",
        "matmul_chunk",
        "matmul_gemm",
        "rms_norm_warp",
        "norm_block",
        "matmul_fused",
        "add_norm",
        "embed_rows",
        "rope_kv",
        "attention_paged",
        "attention_decode",
        "attention_decode_hd64",
        "attention_decode_rope_hd64",
        "attention_decode_rope_qs",
        "attention_prefill",
        "matmul_gemm_wide",
        "norm_reg",
        "norm_reg_lf",
        "matmul_rows4",
        "matmul_multi4",
        "matmul_rows_swiglu",
        "gate_up_swiglu",
        "swiglu4",
        "matmul_gemm_pipelined",
        "fma_peak",
    ] {
        assert!(
            ptx.contains(&format!(".entry {name}")),
            "no kernel {name} in the PTX"
        );
    }
    // At NVRTC's default architecture PDL_ENTRY is empty; for compute_90
    // (programmatic dependent launch) every resident kernel waits for the
    // one ahead of it, then lets the next launch.
    assert!(
        !ptx.contains("griddepcontrol"),
        "griddepcontrol at the default architecture"
    );
    let sm90 = compile_for(SOURCE, false, Some("compute_90")).unwrap_or_else(|e| panic!("{e}"));
    let waits = sm90.matches("griddepcontrol.wait").count();
    assert!(
        waits >= 21 && waits == sm90.matches("griddepcontrol.launch_dependents").count(),
        "{waits} griddepcontrol.wait in the compute_90 PTX"
    );
    // With PDL_PREFETCH (LMRR_CUDA_PDL_PREFETCH) the same kernels wait,
    // some of them after their first weight loads, and matmul_rows' wait
    // comes after a load of the weights.
    let pre = compile_for(
        &lmrr_kernels::cuda::prefetch_source(SOURCE),
        false,
        Some("compute_90"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    // norm_reg_lf (LMRR_CUDA_LOADS_FIRST_MIN) issues every global load
    // before its first global store, as the resident module compiles it
    // (with the default prefetch): no load waits behind a store the
    // compiler must take to alias it. norm_reg, the default form, does not
    // (a store between loads), so the check can tell the two apart.
    let loads_after_store = |name: &str| {
        let k = pre
            .split(".entry ")
            .find(|k| k.starts_with(&format!("{name}(")))
            .unwrap_or_else(|| panic!("{name} in the resident PTX"));
        let first_store = k.find("st.global").expect("a norm stores");
        k[first_store..].contains("ld.global")
    };
    assert!(
        !loads_after_store("norm_reg_lf"),
        "norm_reg_lf loads after a store"
    );
    assert!(
        loads_after_store("norm_reg"),
        "norm_reg no longer loads after a store: the norm_reg_lf check tells nothing"
    );
    // Each kernel's text: the kernels that wait are the same ones, each
    // wait with its launch_dependents.
    let waiting = |ptx: &str| -> Vec<String> {
        ptx.split(".entry ")
            .skip(1)
            .filter(|k| k.contains("griddepcontrol.wait"))
            .map(|k| k.split('(').next().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(
        waiting(&pre),
        waiting(&sm90),
        "the kernels that wait, with PDL_PREFETCH"
    );
    assert_eq!(
        pre.matches("griddepcontrol.wait").count(),
        pre.matches("griddepcontrol.launch_dependents").count(),
        "a launch_dependents with every wait, with PDL_PREFETCH"
    );
    let rows = |ptx: &str| -> String {
        let at = ptx.find(".entry matmul_rows(").expect("matmul_rows");
        ptx[at..]
            .split(".entry ")
            .nth(1)
            .map_or(String::new(), |s| s.to_string())
    };
    let body = rows(&pre);
    let (wait, load) = (
        body.find("griddepcontrol.wait")
            .expect("a wait in matmul_rows"),
        body.find("ld.global").expect("a load in matmul_rows"),
    );
    assert!(
        load < wait,
        "matmul_rows loads no weight before its wait under PDL_PREFETCH"
    );
    let plain = rows(&sm90);
    assert!(
        plain.find("griddepcontrol.wait") < plain.find("ld.global"),
        "matmul_rows loads before its wait without PDL_PREFETCH"
    );
    // With ATTN_PREFETCH too (LMRR_CUDA_ATTN_PREFETCH), attention_decode
    // loads before its wait; attention_paged still waits first.
    let attn = compile_for(
        &format!(
            "#define ATTN_PREFETCH 1\n{}",
            lmrr_kernels::cuda::prefetch_source(SOURCE)
        ),
        false,
        Some("compute_90"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let entry = |ptx: &str, name: &str| -> String {
        let at = ptx.find(&format!(".entry {name}(")).expect(name);
        ptx[at..]
            .split(".entry ")
            .nth(1)
            .map_or(String::new(), |s| s.to_string())
    };
    // Whether kernel `name` of `ptx` issues a global load before its wait.
    let loads_before_wait = |ptx: &str, name: &str| -> bool {
        let body = entry(ptx, name);
        body.find("ld.global").expect("a load") < body.find("griddepcontrol.wait").expect("a wait")
    };
    for (name, early) in [("attention_decode", true), ("attention_paged", false)] {
        assert_eq!(
            loads_before_wait(&attn, name),
            early,
            "{name}: a load before the wait under ATTN_PREFETCH"
        );
    }
    // The launch bounds of LMRR_CUDA_LB_* (resident_source defines them):
    // the kernels they name ask for that many blocks an SM, and without
    // them the decode attention and rows4 kernels carry no bounds at all.
    let lb = lmrr_kernels::cuda::resident::Tuning {
        lb_attn_decode: 4,
        lb_attn_prefill: 3,
        lb_rows4: 8,
        lb_multi: 16,
        ..Default::default()
    };
    // The resident module's PTX under a tuning (resident_source's defines).
    let resident = |t: &lmrr_kernels::cuda::resident::Tuning| {
        compile_for(
            &lmrr_kernels::cuda::resident_source(SOURCE, t),
            false,
            Some("compute_90"),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let bounded = resident(&lb);
    let plain = resident(&Default::default());
    for (name, blocks) in [
        ("attention_decode", 4),
        ("attention_decode_rope", 4),
        ("attention_decode_rope_qs", 4),
        ("attention_prefill_hd64", 3),
        ("matmul_rows4", 8),
        ("matmul_multi4", 8),
        ("matmul_multi", 16),
    ] {
        let head = |ptx: &str| -> String {
            let body = entry(ptx, name);
            body.split('{').next().unwrap_or("").to_string()
        };
        assert!(
            head(&bounded).contains(&format!(".minnctapersm {blocks}")),
            "{name}: no .minnctapersm {blocks} under LB_*: {}",
            head(&bounded)
        );
        assert!(
            !head(&plain).contains(".minnctapersm"),
            "{name}: launch bounds without LB_*"
        );
    }
    // ATTN_EARLY (LMRR_CUDA_ATTN_EARLY, the default): attention_decode_rope_qs
    // loads the step's inputs before its wait; without it, nothing before
    // the wait.
    assert!(lmrr_kernels::cuda::resident::Tuning::default().attn_early);
    let late = resident(&lmrr_kernels::cuda::resident::Tuning {
        attn_early: false,
        ..Default::default()
    });
    for (ptx, before) in [(&plain, true), (&late, false)] {
        assert_eq!(
            loads_before_wait(ptx, "attention_decode_rope_qs"),
            before,
            "attention_decode_rope_qs: a load before the wait with ATTN_EARLY {before}"
        );
    }
    // Each negative control's source compiles too (else gpu_check's control
    // would fail to open, not prove anything).
    let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
    assert!(controls.len() > 10, "{} controls", controls.len());
    // Compiled as gpu_check compiles them: on several threads at once.
    let items: Vec<(&str, bool)> = controls
        .iter()
        .map(|c| (c.source.as_str(), c.fmad))
        .collect();
    for (c, r) in controls.iter().zip(compile_many(&items, 2)) {
        let ptx = r.unwrap_or_else(|e| panic!("control `{}`: {e}", c.label));
        assert!(
            ptx.contains(".entry matmul_rows"),
            "control `{}`: no matmul_rows in its PTX",
            c.label
        );
    }
}
