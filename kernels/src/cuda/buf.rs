//! Device memory and copies: [`DevBuf`] (raw device memory, freed on drop),
//! [`DevMatrix`] (a weight matrix in its stored form: f32, bf16 or GGUF
//! blocks, widened in the kernels exactly as on the CPU), [`Pinned`]
//! (page-locked host memory), [`SplitScratch`], and the [`Gpu`]'s
//! allocations, uploads, copies, marks and synchronization.
//!
//! Invariant: a buffer is freed only after its owner synchronized the
//! stream, so no queued kernel reads freed memory; an allocation that does
//! not fit is an [`GpuError::OutOfMemory`] naming what it was for.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::{as_i32, drv, Gpu, GpuError};
use crate::matmul::{Matrix, Weights};

/// A point in the stream's work ([`Gpu::mark`]).
pub struct Mark(pub(crate) cudarc::driver::CudaEvent);

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
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    pub(crate) ctx: Arc<CudaContext>,
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
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
    pub(crate) ctx: Arc<CudaContext>,
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
            Weights::Quant(q, s) => (super::quant_code(q), self.upload(s, what)?),
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
}
