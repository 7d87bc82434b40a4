//! NVRTC: the CUDA source compiled with the device path's options
//! (`--fmad=false`, IEEE division and square root, no flush to zero), as
//! PTX for NVRTC's default architecture or for sm_90 with programmatic
//! dependent launch, one program or many at once (`gpu_check`'s negative
//! controls), or as a CUBIN for the device's own architecture.
//!
//! [`device_module`] is how [`super::Gpu`] gets each of its two modules (the
//! reference kernels and the resident ones): the device's CUBIN through the
//! on-disk cache ([`super::cache`]), so that NVRTC runs once per machine;
//! PTX (compiled again by the driver at load) only where this NVRTC cannot
//! target the device's architecture. The cache key is derived from the very
//! text and options handed to NVRTC here, so a change to either misses.

use std::ffi::{c_char, c_int, CStr, CString};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::cache::{self, Format, Key, KeyInputs, ModuleCache};
use super::GpuError;
pub use crate::cuda_source::prefetch_source;

/// Whether libnvrtc can be loaded here (no GPU needed).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library by name.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// The device path's NVRTC options: `fmad` as given, IEEE division and
/// square root, no flush to zero, then `--gpu-architecture=arch` if any
/// (the order cudarc's `CompileOptions` writes them in).
pub fn options(fmad: bool, arch: Option<&str>) -> Vec<String> {
    let mut o = vec![
        "--ftz=false".to_string(),
        "--prec-sqrt=true".to_string(),
        "--prec-div=true".to_string(),
        format!("--fmad={fmad}"),
    ];
    if let Some(a) = arch {
        o.push(format!("--gpu-architecture={a}"));
    }
    o
}

/// Compiles `source` with the device path's NVRTC options (`fmad` as
/// given) and returns the PTX: what [`Gpu::open_compiled`] loads.
///
/// [`Gpu::open_compiled`]: super::Gpu::open_compiled
pub fn compile(source: &str, fmad: bool) -> Result<String, GpuError> {
    compile_for(source, fmad, None)
}

/// [`compile`] for a virtual architecture (`Some("compute_90")`: the
/// resident kernels with programmatic dependent launch) or NVRTC's default.
pub fn compile_for(source: &str, fmad: bool, arch: Option<&str>) -> Result<String, GpuError> {
    let ptx = nvrtc_compile(source, &options(fmad, arch), Format::Ptx)?;
    String::from_utf8(ptx).map_err(|_| GpuError::Compile("NVRTC's PTX is not UTF-8".into()))
}

/// An NVRTC program, destroyed when dropped.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

/// `source` compiled by NVRTC with `opts` into `format`'s bytes (PTX
/// without its closing NUL). A failed compile returns NVRTC's log.
pub fn nvrtc_compile(source: &str, opts: &[String], format: Format) -> Result<Vec<u8>, GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    let text = CString::new(source)
        .map_err(|_| GpuError::Compile("the CUDA source holds a NUL byte".into()))?;
    let prog = Program(
        nvrtc::create_program(&text, Some(c"kernels.cu"))
            .map_err(|e| GpuError::Compile(format!("creating the program: {e:?}")))?,
    );
    // Options are ours, never NUL-bearing; checked anyway rather than
    // letting cudarc's `compile_program` unwrap.
    if opts.iter().any(|o| o.contains('\0')) {
        return Err(GpuError::Compile(format!(
            "an NVRTC option holds a NUL: {opts:?}"
        )));
    }
    // SAFETY: `prog` is a live program; `text` outlives it.
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, opts) } {
        // SAFETY: as above; the log is NUL-terminated by NVRTC.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .ok()
            .map(|l| {
                // SAFETY: NVRTC writes a NUL-terminated log of the size it gave.
                unsafe { CStr::from_ptr(l.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        return Err(GpuError::Compile(format!("{e:?} with {opts:?}: {log}")));
    }
    let mut out = match format {
        Format::Ptx => {
            // SAFETY: `prog` compiled successfully above.
            let ptx = unsafe { nvrtc::get_ptx(prog.0) }
                .map_err(|e| GpuError::Compile(format!("reading the PTX: {e:?}")))?;
            ptx.into_iter().map(|c| c as u8).collect::<Vec<u8>>()
        }
        Format::Cubin => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled for a real architecture above; `size`
            // is a valid out-pointer.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| GpuError::Compile(format!("sizing the CUBIN: {e:?}")))?;
            let mut bin = vec![0u8; size];
            // SAFETY: `bin` holds the `size` bytes NVRTC said it writes.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, bin.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| GpuError::Compile(format!("reading the CUBIN: {e:?}")))?;
            bin
        }
    };
    if format == Format::Ptx {
        while out.last() == Some(&0) {
            out.pop();
        }
    }
    if out.is_empty() {
        return Err(GpuError::Compile(format!(
            "NVRTC returned an empty {}",
            format.ext()
        )));
    }
    Ok(out)
}

/// What the cache key needs of the device and the toolchain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Toolchain {
    /// Compute capability, `(major, minor)`.
    pub capability: (i32, i32),
    /// `cuDriverGetVersion`.
    pub driver: i32,
    /// `nvrtcVersion`, `(major, minor)`.
    pub nvrtc: (i32, i32),
    /// Whether NVRTC lists the device's architecture (it can write its CUBIN).
    pub cubin: bool,
}

impl Toolchain {
    /// The device of `ctx`, the driver and NVRTC, asked.
    pub fn of(ctx: &cudarc::driver::CudaContext) -> Result<Self, GpuError> {
        use cudarc::driver::sys::{self as drv_sys, CUdevice_attribute as A};
        let attr = |a| ctx.attribute(a).map_err(super::drv);
        let capability = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let mut driver: c_int = 0;
        // SAFETY: a valid out-pointer; the driver is loaded (a context exists).
        unsafe { drv_sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(super::drv)?;
        if !nvrtc_present() {
            return Err(GpuError::NoNvrtc);
        }
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: valid out-pointers; libnvrtc is present (checked above).
        unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| GpuError::Compile(format!("nvrtcVersion: {e:?}")))?;
        let mut count: c_int = 0;
        // SAFETY: a valid out-pointer.
        let archs = unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut count) }
            .result()
            .ok()
            .and_then(|()| {
                let mut archs = vec![0 as c_int; usize::try_from(count).ok()?];
                // SAFETY: `archs` holds the `count` entries NVRTC writes.
                unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
                    .result()
                    .ok()?;
                Some(archs)
            })
            .unwrap_or_default();
        let cubin = archs.contains(&(capability.0 * 10 + capability.1));
        Ok(Self {
            capability,
            driver,
            nvrtc: (major, minor),
            cubin,
        })
    }

    /// The device's real architecture, `sm_90` for 9.0.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }
}

/// A module to build: the exact text NVRTC compiles and what the plain PTX
/// form would target (`None`: NVRTC's default; `Some("compute_90")`: the
/// resident kernels under programmatic dependent launch).
pub struct ModuleSpec<'a> {
    /// "reference kernels", "resident kernels": named on stderr when built.
    pub what: &'static str,
    pub text: &'a str,
    pub fmad: bool,
    pub ptx_arch: Option<&'static str>,
}

/// `spec`'s module for the device of `tc`, loaded by `load`: the device's
/// CUBIN where NVRTC can write it, else PTX, taken from `cache` if a whole
/// entry is there and `load` accepts it, compiled (and stored) otherwise.
pub fn device_module<T>(
    spec: &ModuleSpec<'_>,
    tc: &Toolchain,
    cache: &ModuleCache,
    load: impl FnMut(Format, &[u8]) -> Result<T, GpuError>,
) -> Result<T, GpuError> {
    let mut load = load;
    let (format, arch) = if tc.cubin {
        (Format::Cubin, tc.sm())
    } else {
        (
            Format::Ptx,
            spec.ptx_arch.map(str::to_string).unwrap_or_default(),
        )
    };
    let opts = options(spec.fmad, (!arch.is_empty()).then_some(arch.as_str()));
    let key = Key::of(&KeyInputs {
        source: spec.text,
        options: &opts,
        format,
        capability: tc.capability,
        driver: tc.driver,
        nvrtc: tc.nvrtc,
    });
    let what = match format {
        Format::Cubin => format!("the CUDA {} for {}", spec.what, tc.sm()),
        Format::Ptx => format!(
            "the CUDA {} as PTX (this NVRTC cannot target {})",
            spec.what,
            tc.sm()
        ),
    };
    cache::get_or_build(
        cache,
        &key,
        format,
        &what,
        || nvrtc_compile(spec.text, &opts, format),
        |bytes| load(format, bytes),
    )
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
