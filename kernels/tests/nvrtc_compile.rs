//! The CUDA source compiles under NVRTC with the options the device path
//! uses, and so does every source the negative controls of `gpu_check`
//! derive from it (feature `cuda`). Needs only libnvrtc, no GPU and no
//! driver: `.ci/run` fetches NVRTC from PyPI, so a kernel that would not
//! compile fails CI instead of failing `Gpu::open` on a device; so does the
//! compute_90 build that programmatic dependent launch loads. Skipped, with
//! the reason printed, where libnvrtc cannot be loaded, unless
//! `LMRR_REQUIRE_TOOLS=1` (CI), where that is a failure.
#![cfg(feature = "cuda")]

use lmrr_kernels::cuda::{
    compile, compile_for, compile_many, negative_controls, nvrtc_present, resident_source, SOURCE,
};

/// Whether NVRTC is here; panics without it under `LMRR_REQUIRE_TOOLS=1`.
fn nvrtc() -> bool {
    if nvrtc_present() {
        return true;
    }
    let why = "no libnvrtc on this machine (set LD_LIBRARY_PATH to an NVRTC 13 lib folder)";
    if std::env::var("LMRR_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
        panic!("LMRR_REQUIRE_TOOLS=1 and {why}");
    }
    // Straight to stderr: libtest hides a passing test's eprintln!.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
    false
}

/// Every kernel the source defines: the resident path's, the one-thread
/// references gpu_check holds them to, and the bench's FMA probe.
const KERNELS: [&str; 48] = [
    "matmul",
    "matmul_warp",
    "rms_norm",
    "exp_slice",
    "swiglu",
    "swiglu_split",
    "rope",
    "attention",
    "hc_coeffs",
    "hc_pre",
    "hc_post",
    "moe_combine",
    "index_scores",
    "matmul_tile",
    "matmul_rows",
    "matmul_rows4",
    "matmul_multi",
    "add_norm",
    "norm_block",
    "norm_reg",
    "norm_reg_lf",
    "matmul_gemm",
    "matmul_gemm_wide",
    "matmul_gemm_multi",
    "sum_chunks",
    "rms_norm_warp",
    "embed_rows",
    "add_rows",
    "gather_rows",
    "rope_kv",
    "attention_paged",
    "attention_decode",
    "attention_decode_rope_qs",
    "attention_prefill",
    "attention_prefill_hd64",
    "attention_prefill_hd128",
    "attention_split_scores",
    "attention_split_pv",
    "attention_split_merge",
    "fma_peak",
    "add_bias",
    "scale_elems",
    "geglu",
    "repeat_rows",
    "round_bf16",
    "stream_mean",
    "moe_combine_idx",
    "kv_write_aux",
];

/// The text of kernel `name` in `ptx`, up to the next entry.
fn entry(ptx: &str, name: &str) -> String {
    let at = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no kernel {name} in the PTX"));
    ptx[at..]
        .split(".entry ")
        .nth(1)
        .map_or(String::new(), |s| s.to_string())
}

/// Whether kernel `name` of `ptx` issues a global load before its wait.
fn loads_before_wait(ptx: &str, name: &str) -> bool {
    let body = entry(ptx, name);
    body.find("ld.global").expect("a load") < body.find("griddepcontrol.wait").expect("a wait")
}

#[test]
fn every_kernel_compiles_and_no_other() {
    if !nvrtc() {
        return;
    }
    let ptx = compile(SOURCE, false).unwrap_or_else(|e| panic!("{e}"));
    for name in KERNELS {
        entry(&ptx, name);
    }
    let count = ptx.matches(".entry ").count();
    assert_eq!(count, KERNELS.len(), "kernels in the PTX");
    // At NVRTC's default architecture PDL_ENTRY is empty.
    assert!(
        !ptx.contains("griddepcontrol"),
        "griddepcontrol at the default architecture"
    );
}

#[test]
fn the_resident_module_waits_in_every_kernel_and_loads_first_where_it_may() {
    if !nvrtc() {
        return;
    }
    // The resident module is the source with exactly the two defines it
    // has always had by default, in that order (its PTX is therefore the
    // one measured).
    assert_eq!(
        resident_source(SOURCE),
        format!("#define ATTN_EARLY 1\n#define PDL_PREFETCH 1\n{SOURCE}")
    );
    let sm90 = compile_for(SOURCE, false, Some("compute_90")).unwrap_or_else(|e| panic!("{e}"));
    let res = compile_for(&resident_source(SOURCE), false, Some("compute_90"))
        .unwrap_or_else(|e| panic!("{e}"));
    // Every resident kernel waits for the one ahead of it, then lets the
    // next launch; the same kernels with and without the early loads.
    let waits = sm90.matches("griddepcontrol.wait").count();
    assert!(
        waits >= 20 && waits == sm90.matches("griddepcontrol.launch_dependents").count(),
        "{waits} griddepcontrol.wait in the compute_90 PTX"
    );
    let waiting = |ptx: &str| -> Vec<String> {
        ptx.split(".entry ")
            .skip(1)
            .filter(|k| k.contains("griddepcontrol.wait"))
            .map(|k| k.split('(').next().unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(waiting(&res), waiting(&sm90), "the kernels that wait");
    assert_eq!(
        res.matches("griddepcontrol.wait").count(),
        res.matches("griddepcontrol.launch_dependents").count(),
        "a launch_dependents with every wait"
    );
    // matmul_rows loads weights before its wait only with PDL_PREFETCH;
    // attention_decode_rope_qs its step inputs only with ATTN_EARLY;
    // attention_paged never.
    for (name, resident, plain) in [
        ("matmul_rows", true, false),
        ("attention_decode_rope_qs", true, false),
        ("attention_paged", false, false),
    ] {
        assert_eq!(loads_before_wait(&res, name), resident, "{name}, resident");
        assert_eq!(loads_before_wait(&sm90, name), plain, "{name}, plain");
    }
    // norm_reg_lf issues every global load before its first global store
    // (no load waits behind a store the compiler must take to alias it);
    // norm_reg does not, so the check can tell the two apart.
    let loads_after_store = |name: &str| {
        let k = entry(&res, name);
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
    // No launch bounds beyond the source's own: none on these, and on
    // matmul_rows and matmul_multi theirs (16 blocks an SM, which holds them
    // to 32 registers whatever weight() decodes).
    let min_blocks = |name: &str| {
        let k = entry(&res, name);
        let head = k.split('{').next().unwrap_or("").to_string();
        head.split(".minnctapersm")
            .nth(1)
            .map(|r| r.split_whitespace().next().unwrap_or("").to_string())
    };
    for name in [
        "attention_decode",
        "attention_decode_rope_qs",
        "matmul_rows4",
    ] {
        assert_eq!(min_blocks(name), None, "{name}");
    }
    for name in ["matmul_rows", "matmul_multi"] {
        assert_eq!(min_blocks(name).as_deref(), Some("16"), "{name}");
    }
}

#[test]
fn every_negative_control_compiles() {
    if !nvrtc() {
        return;
    }
    // Each negative control's source compiles too (else gpu_check's control
    // would fail to open, not prove anything), and still holds the kernel
    // it targets. Compiled as gpu_check compiles them: several at once.
    let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
    assert!(controls.len() > 10, "{} controls", controls.len());
    let items: Vec<(&str, bool)> = controls
        .iter()
        .map(|c| (c.source.as_str(), c.fmad))
        .collect();
    for (c, r) in controls.iter().zip(compile_many(&items, 2)) {
        let ptx = r.unwrap_or_else(|e| panic!("control `{}`: {e}", c.label));
        if c.kernel != lmrr_kernels::cuda::ANY_CASE {
            let name = c.kernel.split(' ').next().unwrap_or(c.kernel);
            // A case named for a family of kernels (attention_split: its
            // three launches) holds a kernel of that family.
            if !ptx.contains(&format!(".entry {name}(")) {
                assert!(
                    ptx.contains(&format!(".entry {name}_")),
                    "control `{}`: no kernel {name} or {name}_* in the PTX",
                    c.label
                );
            }
        }
    }
}

#[test]
fn the_tensor_core_module_compiles_for_sm_80_with_its_mma() {
    if !nvrtc() {
        return;
    }
    let src = lmrr_kernels::cuda_source::TC_SOURCE;
    let ptx = compile_for(src, false, Some("compute_80")).unwrap_or_else(|e| panic!("{e}"));
    for name in [
        "tc_probe_bf16",
        "tc_gemm_64x64",
        "tc_round_bf16",
        "tc_mm_32x32",
        "tc_mm_64x64",
        "tc_mm_128x128",
        "tc_mv_8",
        "tc_mv_16",
    ] {
        entry(&ptx, name);
    }
    assert_eq!(
        ptx.matches(".entry ").count(),
        8,
        "kernels in the tensor-core PTX"
    );
    // The inner product is the instruction the CPU model describes, and
    // nothing else multiplies: bf16 inputs, f32 accumulate.
    assert!(ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
    assert!(
        !ptx.contains("fma.rn.f32"),
        "a CUDA-core fma in the tensor-core module"
    );
}
