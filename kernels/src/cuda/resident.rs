//! The resident device path: device memory the caller keeps across steps
//! (weights uploaded once, activations, paged KV) and the kernels that run
//! over it, launched asynchronously on the [`Gpu`]'s one stream with no host
//! round trip between them.
//!
//! Owns: [`DevBuf`] (raw device memory, freed on drop), [`DevMatrix`] (a
//! weight matrix in its stored form: f32, bf16 or GGUF blocks, widened in the
//! kernels exactly as on the CPU), the resident kernels' own module and
//! launcher (`RawModule`, `Launch`: `cuLaunchKernelEx`, with programmatic
//! dependent launch when [`Tuning::pdl`] is on), the launch wrappers, and
//! [`Graph`] (a captured sequence of launches, replayed as one).
//!
//! Invariants: every kernel here computes each output in the canonical order
//! of the CPU fast path (the `kernels.cu` comments say how), so a step on the
//! resident path gives the CPU's bits; `gpu_check` holds each one to the
//! one-thread references. Which kernel serves a step or a matmul
//! ([`Tuning`]) moves speed only, never bits; so does programmatic
//! dependent launch, because every resident kernel waits for the one ahead
//! of it before touching memory (`PDL_ENTRY` in kernels.cu). Addresses are raw device pointers (`u64`): a
//! wrapper's caller guarantees that every buffer it names holds the extent the
//! shapes imply; each wrapper checks that its sizes fit the kernel's 32-bit
//! indices and returns an error, never a launch, when they do not.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, LaunchConfig};

use super::{as_i32, drv, Gpu, GpuError, MAX_HEAD_DIM};
use crate::matmul::{Matrix, Weights};
pub use crate::paged::PageLayout;

pub use super::split::MmOut;
pub use super::tuning::{longest_first, prefill_groups, Tuning};

/// Tokens per warp of `matmul_tile` and per block of `matmul_rows`
/// (`MM_TOKENS` in kernels.cu).
pub const MM_TOKENS: usize = 8;
/// Chunks of a row `matmul_rows` holds partials for (`MR_MAX_CHUNKS`).
pub const MR_MAX_CHUNKS: usize = 256;
/// Rows a block of `matmul_rows4` (kernels.cu's `MR4_ROWS`).
pub const MR4_ROWS: usize = 4;
/// Chunks of a row `matmul_rows4` holds partials for (`MR4_MAX_CHUNKS`).
pub const MR4_MAX_CHUNKS: usize = 64;
/// Threads per block of `matmul_rows` (`MR_GROUPS` groups of 8).
pub const MR_THREADS: u32 = 128;
/// Chunks of a row `norm_reg` holds in registers (`NR_MAX_CHUNKS`).
pub const NR_MAX_CHUNKS: usize = 128;
/// Rows, tokens and threads of a `matmul_gemm` block (`GM_*`).
pub const GM_ROWS: usize = 32;
pub const GM_TOKS: usize = 16;
const GM_THREADS: u32 = 64;
/// The same of `matmul_gemm_wide` (`GW_*`).
pub const GW_ROWS: usize = 64;
pub const GW_TOKS: usize = 32;
pub(crate) const GW_THREADS: u32 = 256;
/// Threads per block of `attention_paged` (`ATTN_THREADS` in kernels.cu).
const ATTN_THREADS: u32 = 256;
/// Tokens of one sequence per `attention_prefill` block (`PF_TQ`).
pub const PF_TQ: usize = 16;
/// The largest head_dim `attention_prefill` holds (`PF_MAXHD`).
pub const PF_MAXHD: usize = 128;

/// Which RMSNorm kernel [`Gpu::rms_norm_resident`] runs (the resident path
/// takes `norm_reg` where the row fits it, then `norm_block`, then the warp
/// kernels); every one computes the CPU's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKernel {
    /// `rms_norm_warp` / `add_norm`: one warp per row.
    Warp,
    /// `norm_block`: one block per row, its chunks in flight at once.
    Block,
    /// `norm_reg`: `norm_block` with the row in registers.
    Reg,
    /// `norm_reg_lf`: `norm_reg` with the residual row loaded before its
    /// first store (the same values).
    RegLf,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's launch shapes are kernels.cu's: a block count or a
    /// shared-memory bound that disagreed would read or write past a row.
    #[test]
    fn the_host_constants_are_the_kernels_defines() {
        let src = crate::cuda_source::SOURCE;
        for (name, value) in [
            ("MM_TOKENS", MM_TOKENS),
            ("MR_MAX_CHUNKS", MR_MAX_CHUNKS),
            ("MR_GROUPS", MR_THREADS as usize / 8),
            ("MR4_ROWS", MR4_ROWS),
            ("MR4_MAX_CHUNKS", MR4_MAX_CHUNKS),
            ("NR_MAX_CHUNKS", NR_MAX_CHUNKS),
        ] {
            let line = format!("#define {name} {value}\n");
            assert!(src.contains(&line), "kernels.cu has no `{}`", line.trim());
        }
    }

    #[test]
    fn a_row_too_wide_for_a_kernel_is_an_error_with_both_widths() {
        assert!(width_fits("matmul_rows4", 64 * MR4_MAX_CHUNKS, MR4_MAX_CHUNKS).is_ok());
        match width_fits("matmul_rows4", 64 * MR4_MAX_CHUNKS + 1, MR4_MAX_CHUNKS) {
            Err(GpuError::Shape { what, detail }) => {
                assert_eq!(what, "matmul_rows4");
                assert!(
                    detail.contains("4097") && detail.contains("4096"),
                    "{detail}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

/// The resident kernels, loaded with the module.
pub(crate) struct Kernels {
    /// The module the handles below belong to.
    _module: RawModule,
    pub(crate) matmul_tile: Func,
    pub(crate) matmul_rows: Func,
    matmul_rows4: Func,
    matmul_multi: Func,
    rope_kv: Func,
    rms_norm_warp: Func,
    add_norm: Func,
    pub(crate) matmul_gemm: Func,
    matmul_gemm_wide: Func,
    pub(crate) matmul_gemm_multi: Func,
    norm_block: Func,
    norm_reg: Func,
    norm_reg_lf: Func,
    pub(crate) sum_chunks: Func,
    /// Which kernel each step and matmul takes ([`Tuning`]).
    pub(crate) tuning: Tuning,
    embed_rows: Func,
    pub(crate) add_rows: Func,
    gather_rows: Func,
    attention_paged: Func,
    attention_decode: Func,
    attention_decode_rope_qs: Func,
    attention_prefill: Func,
    attention_prefill_hd64: Func,
    swiglu: Func,
    pub(crate) swiglu_split: Func,
    fma_peak: Func,
}

impl Kernels {
    /// Loads the resident kernels from `ptx` (compiled for sm_90 when
    /// `tuning.pdl`, whose launches then allow programmatic dependence).
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        ptx: &str,
        tuning: Tuning,
    ) -> Result<Self, GpuError> {
        let image = std::ffi::CString::new(ptx)
            .map_err(|_| GpuError::Compile("the PTX holds a NUL byte".into()))?;
        ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `image` is a NUL-terminated PTX text; the context is
        // current on this thread.
        let m = unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(drv)?;
        let module = RawModule {
            ctx: ctx.clone(),
            m,
        };
        let f = |name: &str| -> Result<Func, GpuError> {
            let c = std::ffi::CString::new(name)
                .map_err(|_| GpuError::Compile(format!("kernel name {name:?}")))?;
            // SAFETY: the module is loaded and alive (`module`, kept below).
            unsafe { result::module::get_function(module.m, c) }
                .map(Func)
                .map_err(drv)
        };
        Ok(Self {
            matmul_tile: f("matmul_tile")?,
            matmul_rows: f("matmul_rows")?,
            matmul_rows4: f("matmul_rows4")?,
            matmul_multi: f("matmul_multi")?,
            rope_kv: f("rope_kv")?,
            rms_norm_warp: f("rms_norm_warp")?,
            add_norm: f("add_norm")?,
            matmul_gemm: f("matmul_gemm")?,
            matmul_gemm_wide: f("matmul_gemm_wide")?,
            matmul_gemm_multi: f("matmul_gemm_multi")?,
            norm_block: f("norm_block")?,
            norm_reg: f("norm_reg")?,
            norm_reg_lf: f("norm_reg_lf")?,
            sum_chunks: f("sum_chunks")?,
            tuning,
            embed_rows: f("embed_rows")?,
            add_rows: f("add_rows")?,
            gather_rows: f("gather_rows")?,
            attention_paged: f("attention_paged")?,
            attention_decode: f("attention_decode")?,
            attention_decode_rope_qs: f("attention_decode_rope_qs")?,
            attention_prefill: f("attention_prefill")?,
            attention_prefill_hd64: f("attention_prefill_hd64")?,
            swiglu: f("swiglu")?,
            swiglu_split: f("swiglu_split")?,
            fma_peak: f("fma_peak")?,
            _module: module,
        })
    }
}

/// The resident kernels' module, loaded through the driver API so that
/// their launches can carry attributes (programmatic dependent launch);
/// unloaded when dropped.
pub(crate) struct RawModule {
    ctx: Arc<CudaContext>,
    m: sys::CUmodule,
}

// SAFETY: a module handle is valid in every thread its context is bound to,
// and every use binds the context first.
unsafe impl Send for RawModule {}
// SAFETY: as for Send; the handle is never mutated after loading.
unsafe impl Sync for RawModule {}

impl Drop for RawModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by `Kernels::load` and unloaded only here.
            let _ = unsafe { result::module::unload(self.m) };
        }
    }
}

/// A kernel of [`RawModule`], launched by [`Launch`].
#[derive(Clone, Copy)]
pub(crate) struct Func(sys::CUfunction);

// SAFETY: a function handle is valid in every thread of its context; it is
// only launched after the context is bound.
unsafe impl Send for Func {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Func {}

/// The arguments of one launch of a [`Func`] on the Gpu's stream
/// (`cuLaunchKernelEx`), with programmatic stream serialization allowed
/// when [`Tuning::pdl`] is on: the kernel may then be launched before the
/// one ahead of it has finished, and waits for it itself (`PDL_ENTRY` in
/// kernels.cu). Each argument is borrowed until the launch.
pub(crate) struct Launch<'a> {
    f: sys::CUfunction,
    stream: sys::CUstream,
    pdl: bool,
    args: Vec<*mut std::ffi::c_void>,
    _args: std::marker::PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// The next kernel parameter, by reference (its bytes are read at the
    /// launch).
    pub(crate) fn arg<T>(&mut self, v: &'a T) -> &mut Self {
        self.args.push((v as *const T).cast_mut().cast());
        self
    }

    /// A matmul kernel's leading parameters: the storage kind, `x`, the
    /// weights, `y`, `(n, rows, cols)` ([`mm_dims`]) and the row stride.
    pub(crate) fn matmul_args(
        &mut self,
        w: &'a DevMatrix,
        x: &'a u64,
        y: &'a u64,
        dims: &'a (i32, i32, i32),
    ) -> &mut Self {
        self.arg(&w.kind)
            .arg(x)
            .arg(&w.buf.ptr)
            .arg(y)
            .arg(&dims.0)
            .arg(&dims.1)
            .arg(&dims.2)
            .arg(&w.row_bytes)
    }

    /// Queues the kernel.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order
    /// and type, and every address among them must hold what the kernel
    /// reads and writes at this grid.
    pub(crate) unsafe fn launch(
        &mut self,
        cfg: LaunchConfig,
    ) -> Result<(), cudarc::driver::DriverError> {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream,
            attrs: if self.pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the caller's contract; `config`, `attr` and the argument
        // pointers outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.f,
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

impl Gpu {
    /// A launch of resident kernel `f` on this device's stream (its context
    /// bound to the calling thread).
    pub(crate) fn kernel(&self, f: &Func) -> Result<Launch<'_>, GpuError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        Ok(Launch {
            f: f.0,
            stream: self.stream.cu_stream(),
            pdl: self.res.tuning.pdl,
            args: Vec::with_capacity(20),
            _args: std::marker::PhantomData,
        })
    }
}

/// A point in the stream's work ([`Gpu::mark`]).
pub struct Mark(cudarc::driver::CudaEvent);

impl Mark {
    /// Device seconds from this mark to `end` (waits for both).
    pub fn secs_to(&self, end: &Mark) -> Result<f64, GpuError> {
        self.0
            .elapsed_ms(&end.0)
            .map(|ms| f64::from(ms) / 1e3)
            .map_err(drv)
    }
}

/// Raw device memory, freed when dropped.
pub struct DevBuf {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// Device address of byte 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Device address of f32 element `i`.
    pub fn f32_at(&self, i: usize) -> u64 {
        self.ptr + 4 * i as u64
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed
            // once; the stream is synchronized before buffers are dropped by
            // their owners (a pending kernel never reads freed memory).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A weight matrix resident on the device, in its stored form.
pub struct DevMatrix {
    pub(crate) kind: i32,
    pub rows: usize,
    pub cols: usize,
    pub(crate) row_bytes: i64,
    pub(crate) buf: DevBuf,
}

impl DevMatrix {
    /// Device bytes it holds (what a pass over it streams).
    pub fn bytes(&self) -> usize {
        self.buf.bytes
    }
}

fn warps(n: usize) -> Result<LaunchConfig, GpuError> {
    let threads = n
        .checked_mul(32)
        .filter(|&t| t <= i32::MAX as usize)
        .ok_or_else(|| GpuError::Shape {
            what: "launch",
            detail: format!("{n} warps do not fit a 32-bit grid"),
        })?;
    Ok(super::grid(threads))
}

/// The three `(weights, y, rows, row bytes)` argument groups of the
/// kernels that take up to three matrices of one input (`matmul_multi`,
/// `matmul_chunk`, `matmul_fused`): an absent matrix has 0 rows.
fn mat_slots(mats: &[(&DevMatrix, u64)]) -> Result<[(u64, u64, i32, i64); 3], GpuError> {
    let slot = |i: usize| -> Result<(u64, u64, i32, i64), GpuError> {
        Ok(match mats.get(i) {
            Some((w, y)) => (w.buf.ptr, *y, as_i32("matmul", w.rows)?, w.row_bytes),
            None => (0, 0, 0, 0),
        })
    };
    Ok([slot(0)?, slot(1)?, slot(2)?])
}

/// A grid of `blocks` blocks of `MR_THREADS` threads (`matmul_rows`,
/// `matmul_multi`, `matmul_fused`, `matmul_rows_swiglu`).
/// Rows of `cols` columns fit a kernel that holds `most` 64-chunks a row;
/// otherwise an error naming the kernel and both widths.
pub(crate) fn width_fits(what: &'static str, cols: usize, most: usize) -> Result<(), GpuError> {
    if cols.div_ceil(64) > most {
        return Err(GpuError::Shape {
            what,
            detail: format!("rows of {cols} columns (at most {})", 64 * most),
        });
    }
    Ok(())
}

fn row_blocks(blocks: usize) -> Result<LaunchConfig, GpuError> {
    Ok(LaunchConfig {
        grid_dim: (as_i32("matmul", blocks)? as u32, 1, 1),
        block_dim: (MR_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(crate) fn elems(n: usize, what: &'static str) -> Result<LaunchConfig, GpuError> {
    as_i32(what, n)?;
    Ok(super::grid(n))
}

/// A matmul's `(n, rows, cols)` as the kernels' 32-bit arguments, with
/// `n · cols` (the input's extent) checked to fit them too.
pub(crate) fn mm_dims(n: usize, w: &DevMatrix) -> Result<(i32, i32, i32), GpuError> {
    as_i32("matmul", n * w.cols)?;
    Ok((
        as_i32("matmul", n)?,
        as_i32("matmul", w.rows)?,
        as_i32("matmul", w.cols)?,
    ))
}

/// Which `matmul_gemm` kernel: its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTiles {
    /// `matmul_gemm`: 32 rows × 16 tokens, 64 threads.
    Narrow,
    /// `matmul_gemm_wide`: 64 rows × 32 tokens, 256 threads.
    Wide,
}

/// Which attention kernel (each gives the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// `attention_paged`: a block per (token, head), one position per
    /// group of 8 threads at a time (wide steps).
    Paged,
    /// `attention_decode`: the same blocks, each group's K/V loads batched
    /// (small steps).
    Decode,
    /// `attention_prefill`: a block per (group of up to [`PF_TQ`] tokens of
    /// one sequence, head), each K/V tile loaded once for the group.
    Prefill,
    /// `attention_prefill_hd64`: `attention_prefill` for head_dim 64, its
    /// tiles loaded as float4 rows with the next in flight (the same
    /// operations; [`hd64_fits`] says where it may run).
    PrefillHd64,
}

impl AttnKernel {
    /// Whether the kernel walks the table's prefill groups.
    pub fn is_prefill(self) -> bool {
        matches!(self, Self::Prefill | Self::PrefillHd64)
    }
}

/// Whether `attention_prefill_hd64` may serve `shape` over pages of
/// `layout`: head_dim 64, and every K/V row 16-byte aligned (kv_dim and
/// page_len · aux_dim multiples of 4, so every page and layer starts on
/// one).
pub fn hd64_fits(shape: &crate::AttnShape, layout: &PageLayout) -> bool {
    shape.head_dim == 64 && layout.kv_dim % 4 == 0 && (layout.page_len * layout.aux_dim) % 4 == 0
}

/// Blocks of one `matmul_gemm` (or `_wide`) pass over `rows` × `n`.
pub(crate) fn gemm_tiles(tiles: GemmTiles, rows: usize, n: usize) -> usize {
    if tiles != GemmTiles::Narrow {
        rows.div_ceil(GW_ROWS) * n.div_ceil(GW_TOKS)
    } else {
        rows.div_ceil(GM_ROWS) * n.div_ceil(GM_TOKS)
    }
}

/// Device scratch for split matmuls ([`Gpu::mm_split`]): an address and
/// its capacity in floats; [`SplitScratch::NONE`] never splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitScratch {
    pub addr: u64,
    pub floats: usize,
}

impl SplitScratch {
    pub const NONE: Self = Self { addr: 0, floats: 0 };
}

/// Page-locked host floats ([`Gpu::alloc_pinned`]), allocated cacheable
/// (flags 0). cudarc's `alloc_pinned` asks for write-combined memory, which
/// the host reads uncached at a few GB/s: splitting a batch-64 step's 12.6 MB
/// of logits out of it took a third of the step on the H200.
pub struct Pinned {
    ptr: *mut f32,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value alone; it is
// only reached through `&self` / `&mut self`.
unsafe impl Send for Pinned {}
// SAFETY: shared access only reads.
unsafe impl Sync for Pinned {}

impl Pinned {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> Result<&[f32], GpuError> {
        // SAFETY: `ptr` holds `len` floats, zeroed at allocation, and copies
        // into it wait for completion (`Gpu::dtoh` synchronizes).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
    /// The buffer's address, for copies that write it while no slice of it
    /// is alive ([`super::overlap::Overlap`]).
    pub(crate) fn host_ptr(&self) -> *mut f32 {
        self.ptr
    }
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32], GpuError> {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A failure to bind or free leaves the memory to the process's end;
        // there is nothing better to do in a destructor.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed once, here.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// A captured sequence of launches on the [`Gpu`]'s stream, replayed as one
/// (CUDA graph): the same kernels, arguments and addresses as when captured.
pub struct Graph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as no two
// threads use one at the same time; `Graph` is `Send` but not `Sync`, so
// shared use needs a lock (the engine keeps its graphs behind a `Mutex`).
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the launches (asynchronously, on the stream).
    pub fn launch(&self) -> Result<(), GpuError> {
        self.0.launch().map_err(drv)
    }
}

impl Gpu {
    /// Makes the device current on the calling thread (the serving loop may
    /// run on another thread than the one that opened it).
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(drv)
    }

    /// `(free, total)` device memory, bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        self.bind()?;
        result::mem_get_info().map_err(drv)
    }

    /// `bytes` of device memory for `what`; out of memory is an error naming
    /// the bytes wanted and the bytes free.
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf, GpuError> {
        self.bind()?;
        let bytes = bytes.max(4);
        // SAFETY: a plain allocation in the bound context.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(DevBuf {
                ptr,
                bytes,
                ctx: self.ctx.clone(),
            }),
            Err(e) => {
                let free = result::mem_get_info().map(|m| m.0).unwrap_or(0);
                Err(GpuError::OutOfMemory {
                    what: what.to_string(),
                    needed: bytes,
                    free,
                    detail: format!("{e:?}"),
                })
            }
        }
    }

    /// A new buffer holding `host`.
    pub fn upload<T: Copy>(&self, host: &[T], what: &str) -> Result<DevBuf, GpuError> {
        let b = self.alloc(std::mem::size_of_val(host), what)?;
        self.htod(host, b.ptr)?;
        Ok(b)
    }

    /// Copies `host` to device address `dst` (ordered on the stream; the host
    /// slice may be reused as soon as this returns).
    pub fn htod<T: Copy>(&self, host: &[T], dst: u64) -> Result<(), GpuError> {
        if host.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller's buffer at `dst` holds `host`'s bytes; a copy
        // from pageable memory is staged before the call returns.
        unsafe { result::memcpy_htod_async(dst, host, self.stream.cu_stream()) }.map_err(drv)
    }

    /// A timing event recorded after the work queued on the stream so far
    /// (measurement: [`Mark::secs_to`] gives the device time between two).
    pub fn mark(&self) -> Result<Mark, GpuError> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map(Mark)
            .map_err(drv)
    }

    /// Copies device address `src` into `host`, waiting for the stream.
    pub fn dtoh<T: Copy>(&self, src: u64, host: &mut [T]) -> Result<(), GpuError> {
        if host.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller's buffer at `src` holds `host`'s bytes.
        unsafe { result::memcpy_dtoh_async(host, src, self.stream.cu_stream()) }.map_err(drv)?;
        self.sync()
    }

    /// Copies each `(src, host)` of `parts` (device address `src` into
    /// `host`), all queued before one wait for the stream: one round trip
    /// for several downloads. With `mark`, a timing event is recorded after
    /// the copies (measurement: the device time they took).
    pub fn dtoh_many(
        &self,
        parts: &mut [(u64, &mut [f32])],
        mark: bool,
    ) -> Result<Option<Mark>, GpuError> {
        for (src, host) in parts.iter_mut().filter(|p| !p.1.is_empty()) {
            // SAFETY: the caller's buffer at `src` holds `host`'s bytes;
            // `host` stays borrowed until the wait below has seen the copy
            // complete.
            unsafe { result::memcpy_dtoh_async(host, *src, self.stream.cu_stream()) }
                .map_err(drv)?;
        }
        let m = mark.then(|| self.mark()).transpose()?;
        self.sync()?;
        Ok(m)
    }

    /// Device-to-device copy of `bytes` (ordered on the stream).
    pub fn dtod(&self, src: u64, dst: u64, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: both buffers hold `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(drv)
    }

    /// Waits for everything queued on the stream.
    pub fn sync(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(drv)
    }

    /// Uploads a weight matrix in its stored form.
    pub fn upload_matrix(&self, w: &Matrix, what: &str) -> Result<DevMatrix, GpuError> {
        let (kind, buf) = match w.w {
            Weights::F32(s) => (0, self.upload(s, what)?),
            Weights::Bf16(s) => (1, self.upload(s, what)?),
            Weights::Quant(q, s) => (super::quant_code(q)?, self.upload(s, what)?),
        };
        as_i32("matrix", w.rows)?;
        as_i32("matrix", w.cols)?;
        Ok(DevMatrix {
            kind,
            rows: w.rows,
            cols: w.cols,
            row_bytes: (buf.bytes / w.rows.max(1)) as i64,
            buf,
        })
    }

    /// Starts capturing the stream's launches into a [`Graph`].
    pub fn begin_capture(&self) -> Result<(), GpuError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)
    }

    /// Ends a capture; `None` when nothing was captured.
    pub fn end_capture(&self) -> Result<Option<Graph>, GpuError> {
        let g = self
            .stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .map_err(drv)?;
        Ok(g.map(Graph))
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ` with no split scratch
    /// ([`Gpu::mm_split`]).
    pub fn mm(&self, x: u64, n: usize, w: &DevMatrix, y: u64) -> Result<(), GpuError> {
        self.mm_split(x, n, w, y, SplitScratch::NONE)
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ`: by `matmul_gemm` (staged tiles of
    /// rows × tokens) from [`Tuning::gemm_min`] tokens on, split over its
    /// chunks into `scratch` when its tiles alone would leave the device
    /// idle; otherwise by `matmul_rows` (a block per row and token tile, its
    /// chunks in flight at once), or `matmul_tile` where a row has more
    /// chunks than `matmul_rows` holds. Every choice gives the same bits.
    pub fn mm_split(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        scratch: SplitScratch,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let dims = mm_dims(n, w)?;
        let tun = self.res.tuning;
        if n >= tun.gemm_min.max(1) {
            let kind = if n >= tun.gemm_wide_min.max(1) {
                GemmTiles::Wide
            } else {
                GemmTiles::Narrow
            };
            let tiles = gemm_tiles(kind, w.rows, n);
            let chunks = w.cols.div_ceil(64);
            let fits = scratch.floats >= chunks * n * w.rows && scratch.addr != 0;
            let split = (fits && tiles < tun.split_blocks && chunks > 1).then(|| {
                // Chunks per block so that tiles · groups reaches the target.
                let groups = tun.split_blocks.div_ceil(tiles).min(chunks);
                chunks.div_ceil(groups)
            });
            return self.gemm_launch(x, n, w, y, kind, split.map(|cpb| (scratch.addr, cpb)));
        }
        let chunks = w.cols.div_ceil(64);
        if tun.rows4_min > 0
            && w.rows >= tun.rows4_min
            && n >= tun.rows4_tokens
            && chunks <= MR4_MAX_CHUNKS
        {
            return self.rows4_launch(x, n, w, y);
        }
        let rows_kernel = chunks <= MR_MAX_CHUNKS;
        let (f, cfg) = if rows_kernel {
            (
                &self.res.matmul_rows,
                row_blocks(w.rows * n.div_ceil(MM_TOKENS))?,
            )
        } else {
            (
                &self.res.matmul_tile,
                warps(w.rows * n.div_ceil(MM_TOKENS))?,
            )
        };
        let mut b = self.kernel(f)?;
        b.matmul_args(w, &x, &y, &dims);
        // SAFETY: matches `matmul_rows` / `matmul_tile`; x holds n·cols, y
        // n·rows floats; matmul_rows only for rows of ≤ MR_MAX_CHUNKS chunks.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ` by `matmul_rows4`: a block per
    /// four rows and token tile ([`Tuning::rows4_min`]).
    pub(crate) fn rows4_launch(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        width_fits("matmul_rows4", w.cols, MR4_MAX_CHUNKS)?;
        let dims = mm_dims(n, w)?;
        let cfg = row_blocks(w.rows.div_ceil(MR4_ROWS) * n.div_ceil(MM_TOKENS))?;
        let mut b = self.kernel(&self.res.matmul_rows4)?;
        b.matmul_args(w, &x, &y, &dims);
        // SAFETY: matches `matmul_rows4`; x holds n·cols, y n·rows floats;
        // rows of at most MR4_MAX_CHUNKS chunks (checked above), and the
        // kernel reads no row at or past `rows`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `matmul_gemm` (the kernel `tiles` names) over every chunk
    /// (`split` None), or split: `(part, cpb)`, blocks of `cpb` chunks
    /// writing each chunk's partials into `part` (chunks · n · rows
    /// floats), then `sum_chunks` into `y`.
    pub(crate) fn gemm_launch(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        tiles: GemmTiles,
        split: Option<(u64, usize)>,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let chunks = w.cols.div_ceil(64);
        let (part, cpb) = match split {
            Some((p, c)) => (p, c.clamp(1, chunks.max(1))),
            None => (0, 0),
        };
        self.gemm_pass(x, n, w, y, tiles, part, cpb)?;
        self.sum_split(MmOut { y, part, chunks }, n * w.rows)
            .map(|_| ())
    }

    /// The `matmul_gemm` launch of [`Gpu::gemm_launch`] alone: into `y`
    /// (`part` 0), or each chunk's partials into `part` by blocks of `cpb`
    /// chunks (no sum).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_pass(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        kind: GemmTiles,
        part: u64,
        cpb: usize,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let dims = mm_dims(n, w)?;
        let chunks = w.cols.div_ceil(64);
        let tiles = gemm_tiles(kind, w.rows, n);
        let cpb = if part == 0 {
            0
        } else {
            cpb.clamp(1, chunks.max(1))
        };
        let groups = if part == 0 { 1 } else { chunks.div_ceil(cpb) };
        let cpbi = as_i32("matmul", cpb)?;
        let cfg = LaunchConfig {
            grid_dim: (as_i32("matmul", tiles * groups)? as u32, 1, 1),
            block_dim: (
                if kind == GemmTiles::Narrow {
                    GM_THREADS
                } else {
                    GW_THREADS
                },
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let f = match kind {
            GemmTiles::Narrow => &self.res.matmul_gemm,
            GemmTiles::Wide => &self.res.matmul_gemm_wide,
        };
        let mut b = self.kernel(f)?;
        b.matmul_args(w, &x, &y, &dims).arg(&part).arg(&cpbi);
        // SAFETY: matches `matmul_gemm`; x holds n·cols, y n·rows floats,
        // part (when non-null) chunks·n·rows; the grid is tiles · groups.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// Several matmuls of one input `x (n, cols)` in one launch (`mats`:
    /// up to three `(W, y)` of the same storage and `cols`), each output as
    /// [`Gpu::mm`] computes it; separate launches where they cannot share one.
    pub fn mm_multi(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
        scratch: SplitScratch,
    ) -> Result<(), GpuError> {
        let shared = mats.len() <= 3
            && mats.iter().all(|(w, _)| {
                w.kind == mats[0].0.kind
                    && w.cols == mats[0].0.cols
                    && w.cols.div_ceil(64) <= MR_MAX_CHUNKS
                    && w.rows > 0
            });
        if !shared || n == 0 || n >= self.res.tuning.gemm_min.max(1) || mats.len() < 2 {
            for (w, y) in mats {
                self.mm_split(x, n, w, *y, scratch)?;
            }
            return Ok(());
        }
        self.multi_rows_launch(x, n, mats)
    }

    /// One `matmul_multi` launch (`four`: `matmul_multi4`) over up to three
    /// matrices of one storage and width, each of at most `MR_MAX_CHUNKS`
    /// chunks a row (`MR4_MAX_CHUNKS` with `four`).
    pub(crate) fn multi_rows_launch(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
    ) -> Result<(), GpuError> {
        let Some((w0, _)) = mats.first() else {
            return Ok(());
        };
        let what = "matmul_multi";
        width_fits(what, w0.cols, MR_MAX_CHUNKS)?;
        if mats.len() > 3
            || mats
                .iter()
                .any(|(w, _)| w.kind != w0.kind || w.cols != w0.cols)
        {
            return Err(GpuError::Shape {
                what,
                detail: format!("{} matrices (at most 3, one storage and width)", mats.len()),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let tiles = n.div_ceil(MM_TOKENS);
        let blocks: usize = mats.iter().map(|(w, _)| w.rows * tiles).sum();
        let (ni, ki) = (as_i32("matmul", n)?, as_i32("matmul", mats[0].0.cols)?);
        as_i32("matmul", n * mats[0].0.cols)?;
        let cfg = row_blocks(blocks)?;
        let [m0, m1, m2] = mat_slots(mats)?;
        let mut b = self.kernel(&self.res.matmul_multi)?;
        b.arg(&mats[0].0.kind).arg(&x).arg(&ni).arg(&ki);
        for m in [&m0, &m1, &m2] {
            b.arg(&m.0).arg(&m.1).arg(&m.2).arg(&m.3);
        }
        // SAFETY: matches `matmul_multi`; x holds n·cols floats, each y
        // n·rows; an absent third matrix has 0 rows and gets no block.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// How this device's resident path chooses its kernels.
    pub fn tuning(&self) -> Tuning {
        self.res.tuning
    }

    /// `x += y`, then `out = rms_norm(x)·w`, `rows` rows of `d`, one launch
    /// (`y` read where it is: a split matmul's partials are summed by the
    /// norm kernel, or by `sum_chunks` ahead of the warp kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn add_norm(
        &self,
        x: u64,
        y: MmOut,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        self.norm_launch(x, Some(y), w, rows, d, eps, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_launch(
        &self,
        x: u64,
        y: Option<MmOut>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if d.div_ceil(64) <= NR_MAX_CHUNKS {
            let min = self.res.tuning.loads_first_min;
            let kernel = if min > 0 && rows >= min {
                NormKernel::RegLf
            } else {
                NormKernel::Reg
            };
            return self.norm_blocks(kernel, x, y, w, rows, d, eps, out);
        }
        if d.div_ceil(64) <= MR_MAX_CHUNKS {
            return self.norm_blocks(NormKernel::Block, x, y, w, rows, d, eps, out);
        }
        let y = match y {
            Some(o) => Some(self.sum_split(o, rows * d)?),
            None => None,
        };
        self.norm_warp(x, y, w, rows, d, eps, out)
    }

    /// RMSNorm (after `x += y` when given) with one warp per row
    /// (`rms_norm_warp`, `add_norm`).
    #[allow(clippy::too_many_arguments)]
    fn norm_warp(
        &self,
        x: u64,
        y: Option<u64>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        let (ri, di) = (as_i32("rms_norm", rows)?, as_i32("rms_norm", d)?);
        as_i32("rms_norm", rows * d)?;
        let cfg = warps(rows)?;
        match y {
            Some(y) => {
                let mut b = self.kernel(&self.res.add_norm)?;
                b.arg(&x)
                    .arg(&y)
                    .arg(&w.ptr)
                    .arg(&out)
                    .arg(&ri)
                    .arg(&di)
                    .arg(&eps);
                // SAFETY: matches `add_norm`; x, y, out hold rows·d floats, w d.
                unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
            }
            None => {
                let mut b = self.kernel(&self.res.rms_norm_warp)?;
                b.arg(&x).arg(&w.ptr).arg(&out).arg(&ri).arg(&di).arg(&eps);
                // SAFETY: matches `rms_norm_warp`; x and out hold rows·d
                // floats, w d.
                unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
            }
        }
    }

    /// RoPE of `n` query and key rows at positions `pos`, and the rotated
    /// keys with the values `v` written into the tokens' pages (`dst`,
    /// `slot`) of `layer`: RoPE then the page writes, one launch. Each of
    /// q, k, v is read where it is: a split matmul's partials are summed
    /// here and its rows written to its `y` as well.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv(
        &self,
        qkv: (MmOut, MmOut, MmOut),
        tables: (&DevBuf, &DevBuf),
        pos: u64,
        dst: u64,
        slot: u64,
        n: usize,
        qd: usize,
        head_dim: usize,
        layout: PageLayout,
        layer: usize,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let kvd = layout.kv_dim;
        let per = qd / 2 + kvd / 2 + kvd;
        // One chunk count among the partials (q, k and v share their input,
        // so they always agree; a mismatch is summed in place first).
        let (q, k) = super::split::agree(self, qkv.0, qkv.1, n * kvd)?;
        let (q, v) = super::split::agree(self, q, qkv.2, n * kvd)?;
        let (k, v) = super::split::agree(self, k, v, n * kvd)?;
        let chunks = as_i32("rope", q.chunks.max(k.chunks).max(v.chunks))?;
        let (ni, qi, ki, di) = (
            as_i32("rope", n)?,
            as_i32("rope", qd)?,
            as_i32("rope", kvd)?,
            as_i32("rope", head_dim)?,
        );
        let li = as_i32("rope", layer)?;
        let (pl, _, aux) = layout_args(&layout)?;
        let mut b = self.kernel(&self.res.rope_kv)?;
        b.arg(&q.y)
            .arg(&k.y)
            .arg(&v.y)
            .arg(&q.part)
            .arg(&k.part)
            .arg(&v.part)
            .arg(&chunks)
            .arg(&tables.0.ptr)
            .arg(&tables.1.ptr)
            .arg(&pos)
            .arg(&dst)
            .arg(&slot)
            .arg(&ni)
            .arg(&qi)
            .arg(&ki)
            .arg(&di)
            .arg(&li)
            .arg(&pl)
            .arg(&aux);
        // SAFETY: matches `rope_kv`; q holds n·qd floats, k and v n·kvd (and
        // each non-null part chunks times its floats); positions inside the
        // tables, every page address a whole page of `layout`, every slot
        // below page_len.
        unsafe { b.launch(elems(n * per, "rope_kv")?) }
            .map(|_| ())
            .map_err(drv)
    }

    /// Page-locked host memory of `n` floats (fast device-to-host copies).
    pub fn alloc_pinned(&self, n: usize) -> Result<Pinned, GpuError> {
        self.bind()?;
        let len = n.max(1);
        let bytes = len * std::mem::size_of::<f32>();
        // SAFETY: a plain page-locked, cacheable allocation of `bytes`.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(|e| GpuError::OutOfMemory {
            what: "page-locked host buffer".into(),
            needed: bytes,
            free: 0,
            detail: format!("{e:?}"),
        })?;
        let ptr = ptr.cast::<f32>();
        if ptr.is_null() || !ptr.is_aligned() {
            return Err(GpuError::OutOfMemory {
                what: "page-locked host buffer (null or misaligned)".into(),
                needed: bytes,
                free: 0,
                detail: String::new(),
            });
        }
        // SAFETY: `ptr` holds `len` floats; zero them so every read is defined.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Pinned {
            ptr,
            len,
            ctx: self.ctx.clone(),
        })
    }

    /// Copies `n` floats from device address `src` into `dst[..n]`, waiting.
    pub fn dtoh_pinned(&self, src: u64, dst: &mut Pinned, n: usize) -> Result<(), GpuError> {
        let s = dst.as_mut_slice()?;
        let n = n.min(s.len());
        self.dtoh(src, &mut s[..n])
    }

    /// RMSNorm (after `x += y` when given) with one block per row: by
    /// `norm_reg` or `norm_reg_lf` (the row in registers, a group of 8
    /// threads per chunk; `d` at most `64 · NR_MAX_CHUNKS`) or `norm_block`
    /// (its chunks in flight at once; `d` at most `64 · MR_MAX_CHUNKS`).
    /// `kernel` is one of those three ([`NormKernel::Warp`] is
    /// [`Gpu::norm_warp`]'s).
    #[allow(clippy::too_many_arguments)]
    fn norm_blocks(
        &self,
        kernel: NormKernel,
        x: u64,
        y: Option<MmOut>,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if rows == 0 {
            return Ok(());
        }
        let (what, most, f, reg) = match kernel {
            NormKernel::Reg => ("norm_reg", NR_MAX_CHUNKS, &self.res.norm_reg, true),
            NormKernel::RegLf => ("norm_reg_lf", NR_MAX_CHUNKS, &self.res.norm_reg_lf, true),
            NormKernel::Block => ("norm_block", MR_MAX_CHUNKS, &self.res.norm_block, false),
            NormKernel::Warp => {
                return Err(GpuError::Shape {
                    what: "norm_blocks",
                    detail: "rms_norm_warp is not a block-per-row kernel".into(),
                })
            }
        };
        width_fits(what, d, most)?;
        let (ri, di) = (as_i32("rms_norm", rows)?, as_i32("rms_norm", d)?);
        as_i32("rms_norm", rows * d)?;
        let add = i32::from(y.is_some());
        let y = y.unwrap_or(MmOut::at(0));
        let yc = as_i32("rms_norm", y.chunks)?;
        // norm_reg: a group of 8 threads per chunk, whole warps.
        let threads = if reg {
            (8 * d.div_ceil(64)).div_ceil(32).max(1) as u32 * 32
        } else {
            MR_THREADS
        };
        let cfg = LaunchConfig {
            grid_dim: (ri as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.kernel(f)?;
        b.arg(&x)
            .arg(&y.y)
            .arg(&y.part)
            .arg(&yc)
            .arg(&w.ptr)
            .arg(&out)
            .arg(&ri)
            .arg(&di)
            .arg(&eps)
            .arg(&add);
        // SAFETY: matches `norm_block` / `norm_reg` / `norm_reg_lf` (the same parameters);
        // x, out (and y, or its partials chunks·rows·d, when added) hold
        // rows·d floats, w d; d within the
        // partials it holds, and norm_reg has a group for every chunk.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// Row-wise RMSNorm of `rows` rows of `d` (`norm_block`; `rms_norm_warp`
    /// for rows wider than `norm_block` holds).
    pub fn norm_rows(
        &self,
        x: u64,
        w: &DevBuf,
        rows: usize,
        d: usize,
        eps: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        self.norm_launch(x, None, w, rows, d, eps, out)
    }

    /// `out[t] = ` row `ids[t]` of `w`, widened (`ids`: n u64 on the device).
    pub fn embed(&self, w: &DevMatrix, ids: u64, n: usize, out: u64) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let (ni, di) = (as_i32("embed", n)?, as_i32("embed", w.cols)?);
        let mut b = self.kernel(&self.res.embed_rows)?;
        b.arg(&w.kind)
            .arg(&w.buf.ptr)
            .arg(&ids)
            .arg(&out)
            .arg(&ni)
            .arg(&di)
            .arg(&w.row_bytes);
        // SAFETY: matches `embed_rows`; every id is below w.rows (the caller
        // checked tokens against the vocabulary).
        unsafe { b.launch(elems(n * w.cols, "embed")?) }
            .map(|_| ())
            .map_err(drv)
    }

    /// `x[i] += y[i]` for `n` floats.
    pub fn add(&self, x: u64, y: u64, n: usize) -> Result<(), GpuError> {
        self.add_out(x, MmOut::at(y), n)
    }

    /// `out = silu(g) · u` for `n` floats.
    pub fn swiglu_dev(&self, g: u64, u: u64, out: u64, n: usize) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let ni = as_i32("swiglu", n)?;
        let mut b = self.kernel(&self.res.swiglu)?;
        b.arg(&g).arg(&u).arg(&out).arg(&ni);
        // SAFETY: matches `swiglu`; all hold n floats.
        unsafe { b.launch(elems(n, "swiglu")?) }
            .map(|_| ())
            .map_err(drv)
    }

    /// `out[j] = x[rows[j]]`, `m` rows of `d` (`rows`: m u64 on the device).
    pub fn gather(&self, x: u64, rows: u64, m: usize, d: usize, out: u64) -> Result<(), GpuError> {
        if m == 0 {
            return Ok(());
        }
        let (mi, di) = (as_i32("gather", m)?, as_i32("gather", d)?);
        let mut b = self.kernel(&self.res.gather_rows)?;
        b.arg(&x).arg(&rows).arg(&out).arg(&mi).arg(&di);
        // SAFETY: matches `gather_rows`; every row index is below x's rows.
        unsafe { b.launch(elems(m * d, "gather")?) }
            .map(|_| ())
            .map_err(drv)
    }

    /// Paged causal attention of `n` query rows: token t attends positions
    /// `0..=pos[t]` through page addresses `pages[seq_off[t]..]`; by
    /// `attention_prefill` (`_hd64` where [`hd64_fits`]) where the table
    /// lists groups, `attention_decode` for steps of at most
    /// [`Tuning::attn_decode_max`] blocks, `attention_paged` otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_paged(
        &self,
        q: u64,
        table: PageTable,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        let tun = self.res.tuning;
        let kernel = if table.n_groups > 0 && shape.head_dim <= PF_MAXHD {
            if hd64_fits(shape, &layout) {
                AttnKernel::PrefillHd64
            } else {
                AttnKernel::Prefill
            }
        } else if n * shape.n_heads <= tun.attn_decode_max {
            AttnKernel::Decode
        } else {
            AttnKernel::Paged
        };
        self.attention_with(kernel, q, table, n, shape, layout, layer, scale, out)
    }

    /// [`Gpu::attention_paged`] by the kernel named, whatever the step's
    /// size (`Prefill` needs the table's groups).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with(
        &self,
        kernel: AttnKernel,
        q: u64,
        table: PageTable,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        if !attn_shape_ok(shape, &layout) {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!(
                    "heads {}/{} × {} (head_dim ≤ {MAX_HEAD_DIM}), pages of kv_dim {}",
                    shape.n_heads, shape.n_kv_heads, shape.head_dim, layout.kv_dim
                ),
            });
        }
        let prefill = kernel.is_prefill();
        let hd64 = kernel == AttnKernel::PrefillHd64;
        if hd64 && !hd64_fits(shape, &layout) {
            return Err(GpuError::Shape {
                what: "attention (_hd64)",
                detail: format!(
                    "head_dim {} (64), kv_dim {} and page_len {} × aux_dim {} (multiples of 4)",
                    shape.head_dim, layout.kv_dim, layout.page_len, layout.aux_dim
                ),
            });
        }
        if prefill && (shape.head_dim > PF_MAXHD || table.n_groups == 0) {
            return Err(GpuError::Shape {
                what: "attention_prefill",
                detail: format!(
                    "head_dim {} (≤ {PF_MAXHD}), {} groups (> 0)",
                    shape.head_dim, table.n_groups
                ),
            });
        }
        let blocks = if prefill { table.n_groups } else { n } * shape.n_heads;
        let AttnArgs {
            nh,
            nkv,
            hd,
            li,
            pl,
            aux,
            cfg,
        } = attn_args(shape, &layout, layer, blocks)?;
        let f = match kernel {
            AttnKernel::Paged => &self.res.attention_paged,
            AttnKernel::Decode => &self.res.attention_decode,
            AttnKernel::Prefill => &self.res.attention_prefill,
            AttnKernel::PrefillHd64 => &self.res.attention_prefill_hd64,
        };
        let mut b = self.kernel(f)?;
        b.arg(&q)
            .arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos);
        if prefill {
            b.arg(&table.groups);
        }
        b.arg(&out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&scale);
        // SAFETY: matches `attention_paged` / `attention_decode` (the same
        // parameters) and `attention_prefill` (groups after pos); token t's
        // page list covers positions 0..=pos[t], each entry the address of a
        // whole page; each group's tokens share one sequence's page list
        // (`prefill_groups`) and its count is at most PF_TQ.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }
}

impl Gpu {
    /// `rope_kv` then `attention_decode` in one launch
    /// (`attention_decode_rope`, the same bits): RoPE of `q` (n · qd, in
    /// place) and of the unrotated K rows `kraw` (n · kvd) into `kout` and,
    /// with the V rows `v`, into each token's page slot `dst`/`slot`; then
    /// attention into `out`. Only for a step whose tokens are one per
    /// sequence and whose pages are in no other token's page list (no
    /// block reads a row another block writes), with head_dim even and at
    /// most 256: the caller checks the first two, this the shapes.
    /// The kernel is `attention_decode_rope_qs`, which also hands the
    /// rotated q head to the attention in shared memory.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode_rope(
        &self,
        qkv: (u64, u64, u64),
        kout: u64,
        tables: (&DevBuf, &DevBuf),
        table: PageTable,
        dst: u64,
        slot: u64,
        n: usize,
        shape: &crate::AttnShape,
        layout: PageLayout,
        layer: usize,
        scale: f32,
        out: u64,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        if !attn_shape_ok(shape, &layout) || shape.head_dim % 2 != 0 || table.n_groups != 0 {
            return Err(GpuError::Shape {
                what: "attention_decode_rope",
                detail: format!(
                    "heads {}/{} × {} (even, ≤ {MAX_HEAD_DIM}), pages of kv_dim {}, {} prefill groups (0)",
                    shape.n_heads, shape.n_kv_heads, shape.head_dim, layout.kv_dim, table.n_groups
                ),
            });
        }
        let AttnArgs {
            nh,
            nkv,
            hd,
            li,
            pl,
            aux,
            cfg,
        } = attn_args(shape, &layout, layer, n * shape.n_heads)?;
        let f = &self.res.attention_decode_rope_qs;
        let mut b = self.kernel(f)?;
        b.arg(&qkv.0)
            .arg(&qkv.1)
            .arg(&kout)
            .arg(&qkv.2)
            .arg(&tables.0.ptr)
            .arg(&tables.1.ptr)
            .arg(&table.pages)
            .arg(&table.seq_off)
            .arg(&table.pos)
            .arg(&dst)
            .arg(&slot)
            .arg(&out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&li)
            .arg(&pl)
            .arg(&aux)
            .arg(&scale);
        // SAFETY: matches `attention_decode_rope`; q holds n·qd floats,
        // kraw, kout and v n·kvd; positions inside the RoPE tables; each
        // token's page list covers 0..=pos[t] and dst[t]/slot[t] is the
        // slot of pos[t] in it (distinct over the step); out n·qd floats.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }
}

/// One decode step's attention on host operands (gpu_check), by
/// [`DecodeRopeCase::run`].
pub struct DecodeRopeCase<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_len: usize,
    /// Each token's q (n · qd), unrotated k and v rows (n · kvd).
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// The RoPE tables (positions × head_dim / 2 each).
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// Whole pages of one layer (page_len · 2 · kvd floats each).
    pub store: &'a [f32],
    /// Each page-table entry's page in `store`; token t's list starts at
    /// `seq_off[t]`; its position `pos[t]`, written into page
    /// `dst_page[t]`, slot `pos[t] % page_len`.
    pub index: &'a [u64],
    pub seq_off: &'a [u64],
    pub pos: &'a [u64],
    pub dst_page: &'a [u64],
}

impl DecodeRopeCase<'_> {
    /// Runs the step twice on the device from the same inputs: `rope_kv`
    /// then attention (the kernel [`Gpu::attention_paged`] picks), and
    /// `attention_decode_rope`; returns each path's attention output,
    /// rotated q, rotated K rows and pages.
    pub fn run(&self, gpu: &Gpu) -> Result<[[Vec<f32>; 4]; 2], GpuError> {
        let n = self.pos.len();
        let shape = crate::AttnShape {
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let layout = crate::paged::PageLayout {
            page_len: self.page_len,
            layers: 1,
            kv_dim: kvd,
            aux_dim: 0,
        };
        let pf = (self.page_len * 2 * kvd) as u64 * 4;
        let slot: Vec<u64> = self.pos.iter().map(|p| p % self.page_len as u64).collect();
        let tabs = (gpu.upload(self.cos, "cos")?, gpu.upload(self.sin, "sin")?);
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let mut outs: Vec<[Vec<f32>; 4]> = Vec::new();
        for fused in [false, true] {
            let store = gpu.upload(self.store, "pages")?;
            let table: Vec<u64> = self.index.iter().map(|i| store.ptr + i * pf).collect();
            let dst: Vec<u64> = self.dst_page.iter().map(|i| store.ptr + i * pf).collect();
            let (dq, dk, dv) = (
                gpu.upload(self.q, "q")?,
                gpu.upload(self.k, "k")?,
                gpu.upload(self.v, "v")?,
            );
            let kout = gpu.alloc(n * kvd * 4, "k out")?;
            let out = gpu.alloc(n * qd * 4, "out")?;
            let (dt, dso, dpos, ddst, dslot) = (
                gpu.upload(&table, "table")?,
                gpu.upload(self.seq_off, "seq_off")?,
                gpu.upload(self.pos, "pos")?,
                gpu.upload(&dst, "dst")?,
                gpu.upload(&slot, "slot")?,
            );
            let pt = PageTable {
                pages: dt.ptr,
                seq_off: dso.ptr,
                pos: dpos.ptr,
                groups: 0,
                n_groups: 0,
            };
            let kb = if fused {
                gpu.attention_decode_rope(
                    (dq.ptr, dk.ptr, dv.ptr),
                    kout.ptr,
                    (&tabs.0, &tabs.1),
                    pt,
                    ddst.ptr,
                    dslot.ptr,
                    n,
                    &shape,
                    layout,
                    0,
                    scale,
                    out.ptr,
                )?;
                &kout
            } else {
                gpu.rope_kv(
                    (MmOut::at(dq.ptr), MmOut::at(dk.ptr), MmOut::at(dv.ptr)),
                    (&tabs.0, &tabs.1),
                    dpos.ptr,
                    ddst.ptr,
                    dslot.ptr,
                    n,
                    qd,
                    self.head_dim,
                    layout,
                    0,
                )?;
                gpu.attention_paged(dq.ptr, pt, n, &shape, layout, 0, scale, out.ptr)?;
                &dk
            };
            let mut r = [
                vec![0.0; n * qd],
                vec![0.0; n * qd],
                vec![0.0; n * kvd],
                vec![0.0; self.store.len()],
            ];
            gpu.dtoh(out.ptr, &mut r[0])?;
            gpu.dtoh(dq.ptr, &mut r[1])?;
            gpu.dtoh(kb.ptr, &mut r[2])?;
            gpu.dtoh(store.ptr, &mut r[3])?;
            outs.push(r);
        }
        let b = outs.pop().unwrap_or_default();
        let a = outs.pop().unwrap_or_default();
        Ok([a, b])
    }
}

/// Physical limits measured on the device, for `lmrr bench`.
impl Gpu {
    /// Device-to-device copy bandwidth over a `bytes` buffer: bytes moved
    /// (read plus written) per second, median of `repeats`.
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64, GpuError> {
        let (a, b) = (
            self.alloc(bytes, "bandwidth source")?,
            self.alloc(bytes, "bandwidth target")?,
        );
        self.dtod(a.ptr, b.ptr, bytes)?;
        self.sync()?;
        let mut t: Vec<f64> = (0..repeats.max(1))
            .map(|_| {
                let t0 = std::time::Instant::now();
                self.dtod(a.ptr, b.ptr, bytes)?;
                self.sync()?;
                Ok(t0.elapsed().as_secs_f64())
            })
            .collect::<Result<_, GpuError>>()?;
        t.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / t[t.len() / 2])
    }

    /// FP32 FMA rate in FLOP/s (CUDA cores; 2 FLOPs per fma), median of
    /// `repeats` launches filling the device many times over.
    pub fn fma_peak(&self, repeats: usize) -> Result<f64, GpuError> {
        let (blocks, threads, iters) = (132 * 64u32, 256u32, 4096i32);
        let out = self.alloc((blocks * threads) as usize * 4, "fma_peak")?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let run = || -> Result<f64, GpuError> {
            let t0 = std::time::Instant::now();
            let mut b = self.kernel(&self.res.fma_peak)?;
            let (a, c) = (0.999_f32, 0.001_f32);
            b.arg(&out.ptr).arg(&iters).arg(&a).arg(&c);
            // SAFETY: matches `fma_peak`; out holds blocks·threads floats.
            unsafe { b.launch(cfg) }.map_err(drv)?;
            self.sync()?;
            Ok(t0.elapsed().as_secs_f64())
        };
        run()?;
        let mut t: Vec<f64> = (0..repeats.max(1))
            .map(|_| run())
            .collect::<Result<_, _>>()?;
        t.sort_by(f64::total_cmp);
        let flops = 2.0 * 8.0 * iters as f64 * (blocks * threads) as f64;
        Ok(flops / t[t.len() / 2])
    }
}

/// Per-call forms of the resident kernels for `gpu_check`: operands
/// uploaded, the kernel run, the result copied back.
impl Gpu {
    /// `matmul_gemm`, whole or split ([`super::MatmulKernel`]), on uploaded
    /// operands, `reps` times (synchronized); the seconds they took.
    pub(crate) fn gemm_check(
        &self,
        kernel: super::MatmulKernel,
        x: &[f32],
        n: usize,
        w: &Matrix,
        y: &mut [f32],
        reps: usize,
    ) -> Result<f64, GpuError> {
        let dw = self.upload_matrix(w, "gemm check weights")?;
        let dx = self.upload(x, "gemm check input")?;
        let dy = self.alloc(y.len() * 4, "gemm check output")?;
        let chunks = w.cols.div_ceil(64);
        use super::MatmulKernel as K;
        let tiles = match kernel {
            K::GemmWide | K::GemmWideSplit(_) => GemmTiles::Wide,
            _ => GemmTiles::Narrow,
        };
        if kernel == K::Rows4 {
            self.sync()?;
            let t0 = std::time::Instant::now();
            for _ in 0..reps.max(1) {
                self.rows4_launch(dx.ptr, n, &dw, dy.ptr)?;
            }
            self.sync()?;
            let secs = t0.elapsed().as_secs_f64();
            self.dtoh(dy.ptr, y)?;
            return Ok(secs);
        }
        let split = match kernel {
            K::GemmSplit(cpb) | K::GemmWideSplit(cpb) => {
                let part = self.alloc(chunks * n * w.rows * 4, "gemm check partials")?;
                Some((part, cpb))
            }
            _ => None,
        };
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            let sp = split.as_ref().map(|(p, c)| (p.ptr, *c));
            self.gemm_launch(dx.ptr, n, &dw, dy.ptr, tiles, sp)?;
        }
        self.sync()?;
        let secs = t0.elapsed().as_secs_f64();
        self.dtoh(dy.ptr, y)?;
        Ok(secs)
    }

    /// [`crate::rms_norm`] by `rms_norm_warp`, or by `norm_block` when
    /// `block`; with `add`, of `x + add` (the residual add first: `add_norm`
    /// or `norm_block`'s add), the sum also written back into `sum`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_resident(
        &self,
        x: &[f32],
        add: Option<(&[f32], &mut [f32])>,
        w: &[f32],
        eps: f32,
        kernel: NormKernel,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        if w.is_empty() || x.len() % w.len() != 0 || out.len() != x.len() {
            return Err(GpuError::Shape {
                what: "rms_norm",
                detail: format!("x {}, w {}, out {}", x.len(), w.len(), out.len()),
            });
        }
        let (dx, dw) = (self.upload(x, "x")?, self.upload(w, "w")?);
        let dout = self.alloc(out.len() * 4, "out")?;
        let (rows, d) = (x.len() / w.len(), w.len());
        let dy = match &add {
            Some((y, _)) if y.len() == x.len() => Some(self.upload(y, "y")?),
            Some(_) => {
                return Err(GpuError::Shape {
                    what: "add_norm",
                    detail: "y is not x's size".into(),
                })
            }
            None => None,
        };
        let yp = dy.as_ref().map(|b| b.ptr);
        let yo = yp.map(MmOut::at);
        match kernel {
            NormKernel::Block | NormKernel::Reg | NormKernel::RegLf => {
                self.norm_blocks(kernel, dx.ptr, yo, &dw, rows, d, eps, dout.ptr)?
            }
            NormKernel::Warp => self.norm_warp(dx.ptr, yp, &dw, rows, d, eps, dout.ptr)?,
        }
        if let Some((_, sum)) = add {
            self.dtoh(dx.ptr, sum)?;
        }
        self.dtoh(dout.ptr, out)
    }

    /// [`crate::attention`] by the kernel named: each sequence's keys and
    /// values are copied into device pages of `page_len` positions (layer 0
    /// of a one-layer layout), in a page order other than the positions'
    /// (the table, not the memory order, must decide). A sequence is a task,
    /// or for `Prefill` a run of consecutive tasks over one `KvView`
    /// (grouped by up to [`PF_TQ`]).
    pub fn attention_resident(
        &self,
        tasks: &[crate::AttnTask],
        shape: &crate::AttnShape,
        scale: f32,
        page_len: usize,
        kernel: AttnKernel,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        self.attention_resident_timed(tasks, shape, scale, page_len, kernel, out, 1)
            .map(|_| ())
    }

    /// [`Gpu::attention_resident`] launched `reps` times (at least once) on
    /// the same uploaded operands; returns the seconds per launch, from
    /// the first launch queued to the last one done (a figure, not a check:
    /// the device is shared).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_resident_timed(
        &self,
        tasks: &[crate::AttnTask],
        shape: &crate::AttnShape,
        scale: f32,
        page_len: usize,
        kernel: AttnKernel,
        out: &mut [f32],
        reps: usize,
    ) -> Result<f64, GpuError> {
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        if out.len() != tasks.len() * qd || tasks.iter().any(|t| t.q.len() != qd) || page_len == 0 {
            return Err(GpuError::Shape {
                what: "attention",
                detail: format!("{} tasks, out {}", tasks.len(), out.len()),
            });
        }
        let layout = PageLayout {
            page_len,
            layers: 1,
            kv_dim: kvd,
            aux_dim: 0,
        };
        let pf = layout.page_floats();
        // Sequences: for `Prefill`, each run of consecutive tasks over the
        // same rows (one `KvView`) is one sequence, its pages shared and
        // its tasks grouped by PF_TQ; otherwise every task its own.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            match runs.last_mut() {
                Some((a, c)) if kernel.is_prefill() && std::ptr::eq(tasks[*a].kv, t.kv) => *c += 1,
                _ => runs.push((i, 1)),
            }
        }
        let run_pos: Vec<usize> = runs
            .iter()
            .map(|&(a, c)| tasks[a..a + c].iter().map(|t| t.pos).max().unwrap_or(0))
            .collect();
        // Pages of all sequences, stored in reverse order of need.
        let counts: Vec<usize> = run_pos.iter().map(|p| (p + 1).div_ceil(page_len)).collect();
        let total: usize = counts.iter().sum();
        let mut host = vec![0.0f32; total.max(1) * pf];
        let mut page_of = Vec::with_capacity(total);
        let mut next = total;
        for (&(a, _), &pos) in runs.iter().zip(&run_pos) {
            let kv = tasks[a].kv;
            for b in 0..(pos + 1).div_ceil(page_len) {
                next -= 1;
                page_of.push(next);
                let page = &mut host[next * pf..(next + 1) * pf];
                for s in 0..page_len {
                    let j = b * page_len + s;
                    if j > pos {
                        break;
                    }
                    page[s * kvd..(s + 1) * kvd].copy_from_slice(kv.key(j, kvd));
                    page[(page_len + s) * kvd..(page_len + s + 1) * kvd]
                        .copy_from_slice(kv.value(j, kvd));
                }
            }
        }
        let dpages = self.upload(&host, "pages")?;
        let mut ins: Vec<u64> = page_of
            .iter()
            .map(|&p| dpages.ptr + (p * pf * 4) as u64)
            .collect();
        let mut seq_off = Vec::with_capacity(tasks.len());
        let mut groups = Vec::new();
        let mut off = 0u64;
        for (&(a, c), &pages) in runs.iter().zip(&counts) {
            seq_off.extend(std::iter::repeat_n(off, c));
            off += pages as u64;
            for g in (0..c).step_by(PF_TQ) {
                groups.push(((a + g) as u64) << 32 | PF_TQ.min(c - g) as u64);
            }
        }
        let pages_len = ins.len();
        ins.extend(&seq_off);
        ins.extend(tasks.iter().map(|t| t.pos as u64));
        ins.extend(&groups);
        let q: Vec<f32> = tasks.iter().flat_map(|t| t.q.iter().copied()).collect();
        let (din, dq) = (self.upload(&ins, "table")?, self.upload(&q, "q")?);
        let dout = self.alloc(out.len() * 4, "out")?;
        let at = |i: usize| din.ptr + 8 * i as u64;
        let table = PageTable {
            pages: at(0),
            seq_off: at(pages_len),
            pos: at(pages_len + tasks.len()),
            groups: at(pages_len + 2 * tasks.len()),
            n_groups: if kernel.is_prefill() { groups.len() } else { 0 },
        };
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            self.attention_with(
                kernel,
                dq.ptr,
                table,
                tasks.len(),
                shape,
                layout,
                0,
                scale,
                dout.ptr,
            )?;
        }
        self.sync()?;
        let per = t0.elapsed().as_secs_f64() / reps.max(1) as f64;
        self.dtoh(dout.ptr, out)?;
        Ok(per)
    }
}

/// Whether the attention kernels hold `shape` over pages of `layout`:
/// whole groups of heads per K/V head, head_dim up to [`MAX_HEAD_DIM`], the
/// pages' kv_dim the shape's.
fn attn_shape_ok(shape: &crate::AttnShape, layout: &PageLayout) -> bool {
    shape.n_kv_heads != 0
        && shape.n_heads % shape.n_kv_heads == 0
        && shape.head_dim <= MAX_HEAD_DIM
        && shape.kv_dim() == layout.kv_dim
}

/// The attention kernels' shape arguments and a launch of `blocks` blocks.
struct AttnArgs {
    nh: i32,
    nkv: i32,
    hd: i32,
    li: i32,
    pl: i32,
    aux: i32,
    cfg: LaunchConfig,
}

fn attn_args(
    shape: &crate::AttnShape,
    layout: &PageLayout,
    layer: usize,
    blocks: usize,
) -> Result<AttnArgs, GpuError> {
    let (pl, _, aux) = layout_args(layout)?;
    Ok(AttnArgs {
        nh: as_i32("attention", shape.n_heads)?,
        nkv: as_i32("attention", shape.n_kv_heads)?,
        hd: as_i32("attention", shape.head_dim)?,
        li: as_i32("attention", layer)?,
        pl,
        aux,
        cfg: LaunchConfig {
            grid_dim: (as_i32("attention", blocks)? as u32, 1, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
    })
}

fn layout_args(l: &PageLayout) -> Result<(i32, i32, i32), GpuError> {
    as_i32("kv page", l.page_floats())?;
    Ok((
        as_i32("kv page", l.page_len)?,
        as_i32("kv page", l.kv_dim)?,
        as_i32("kv page", l.aux_dim)?,
    ))
}

/// Device addresses of a step's page table (u64 arrays): every sequence's
/// page addresses, each token's offset into them, and each token's position;
/// and, where the step's spans are long, `n_groups` groups of at most
/// [`PF_TQ`] consecutive tokens of one sequence at `groups` (each
/// `first token << 32 | count`, see [`prefill_groups`]), which let
/// attention share K/V tiles (`attention_prefill`); `n_groups` 0: none.
#[derive(Debug, Clone, Copy)]
pub struct PageTable {
    pub pages: u64,
    pub seq_off: u64,
    pub pos: u64,
    pub groups: u64,
    pub n_groups: usize,
}
