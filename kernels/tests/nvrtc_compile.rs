//! kernels.cu compiles under NVRTC with the options the device path uses,
//! and so does every source the negative controls of `gpu_check` derive from
//! it (feature `cuda`). Needs only libnvrtc, no GPU and no driver: `.ci/run`
//! fetches NVRTC from PyPI, so a kernel that would not compile fails CI
//! instead of failing `Gpu::open` on a device. Skipped, with the reason
//! printed, where libnvrtc cannot be loaded.
#![cfg(feature = "cuda")]

use lmrr_kernels::cuda::{compile, negative_controls, nvrtc_present, SOURCE};

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
        "fma_peak",
    ] {
        assert!(
            ptx.contains(&format!(".entry {name}")),
            "no kernel {name} in the PTX"
        );
    }
    // Each negative control's source compiles too (else gpu_check's control
    // would fail to open, not prove anything).
    let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
    assert!(controls.len() > 10, "{} controls", controls.len());
    for c in controls {
        compile(&c.source, c.fmad).unwrap_or_else(|e| panic!("control `{}`: {e}", c.label));
    }
}
