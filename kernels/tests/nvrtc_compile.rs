//! kernels.cu compiles under NVRTC with the options the device path uses,
//! and so does every source the negative controls of `gpu_check` derive from
//! it (feature `cuda`). Needs only libnvrtc, no GPU and no driver: `.ci/run`
//! fetches NVRTC from PyPI, so a kernel that would not compile fails CI
//! instead of failing `Gpu::open` on a device; so does the compute_90 build
//! that programmatic dependent launch loads. Skipped, with the reason
//! printed, where libnvrtc cannot be loaded.
#![cfg(feature = "cuda")]

use lmrr_kernels::cuda::{compile, compile_for, negative_controls, nvrtc_present, SOURCE};

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
        "matmul_gemm",
        "rms_norm_warp",
        "norm_block",
        "matmul_fused",
        "add_norm",
        "embed_rows",
        "rope_kv",
        "attention_paged",
        "attention_decode",
        "norm_reg",
        "matmul_rows_swiglu",
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
    // Each negative control's source compiles too (else gpu_check's control
    // would fail to open, not prove anything).
    let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
    assert!(controls.len() > 10, "{} controls", controls.len());
    for c in controls {
        compile(&c.source, c.fmad).unwrap_or_else(|e| panic!("control `{}`: {e}", c.label));
    }
}
