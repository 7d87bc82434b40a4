//! NVRTC: the CUDA source compiled with the device path's options
//! (`--fmad=false`, IEEE division and square root, no flush to zero), for
//! NVRTC's default architecture or for sm_90 with programmatic dependent
//! launch, one program or many at once (`gpu_check`'s negative controls).

use super::GpuError;
pub use crate::cuda_source::prefetch_source;

/// Whether libnvrtc can be loaded here (no GPU needed).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library by name.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` with the device path's NVRTC options (`fmad` as
/// given) and returns the PTX: what [`Gpu::open_with`] loads.
pub fn compile(source: &str, fmad: bool) -> Result<String, GpuError> {
    compile_for(source, fmad, None)
}

/// [`compile`] for a virtual architecture (`Some("compute_90")`: the
/// resident kernels with programmatic dependent launch) or NVRTC's default.
pub fn compile_for(
    source: &str,
    fmad: bool,
    arch: Option<&'static str>,
) -> Result<String, GpuError> {
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(fmad),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some("kernels.cu".into()),
        arch,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| GpuError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// [`compile`] of each `(source, fmad)` of `items`, on up to `threads`
/// threads at once (NVRTC compiles distinct programs concurrently), results
/// in `items`' order: `gpu_check`'s negative controls, each a whole-module
/// compile, in the time of a few.
pub fn compile_many(items: &[(&str, bool)], threads: usize) -> Vec<Result<String, GpuError>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<String, GpuError>>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(src, fmad)) = items.get(i) else {
                    break;
                };
                let r = compile(src, fmad);
                if let Ok(mut slot) = slots[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|m| {
            m.into_inner()
                .ok()
                .flatten()
                .unwrap_or_else(|| Err(GpuError::Compile("a compile thread failed".into())))
        })
        .collect()
}

/// `source` as the resident module is compiled under programmatic
/// dependent launch: `ATTN_EARLY` and `PDL_PREFETCH` defined, so that the
/// kernels load what no kernel ahead of them writes (weights, the step's
/// inputs) before waiting for it (common.cuh's `PDL_ENTRY_EARLY`,
/// `DecodeIn`).
pub fn resident_source(source: &str) -> String {
    format!("#define ATTN_EARLY 1\n{}", prefetch_source(source))
}
