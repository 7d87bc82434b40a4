//! Device-to-host copies that run while later kernels still run.
//!
//! A long step's K/V rows are final layer by layer: layer `l`'s rows are
//! written before layer `l + 1` starts. [`Overlap`] copies each layer's rows
//! to page-locked host memory on a second stream, ordered after the kernels
//! queued so far on the [`Gpu`]'s stream (an event each), so that the host
//! can write layer `l` into its KV store while the device computes the
//! layers after it ([`Tuning::kv_overlap_min`](super::resident::Tuning)).
//!
//! Owns: the copy stream ([`Gpu::copy_stream`], made on first use) and, per
//! [`Overlap`], the events of its copies.
//!
//! Invariants: the copies move bytes, so what the host reads is what one
//! `dtoh` after the step would read. An [`Overlap`] holds its [`Pinned`]
//! buffer borrowed until it is dropped, hands out a region only once the
//! copies that write it have completed ([`Overlap::wait`] then
//! [`Overlap::region`]), and on drop waits for every copy it queued, so no
//! copy ever writes host memory that is read, reused or freed. Never used
//! inside a graph capture (events of another stream cannot be captured).

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use super::buf::Pinned;
use super::{drv, Gpu, GpuError};

impl Gpu {
    /// The second stream, for copies that overlap the kernels (made once).
    pub(crate) fn copy_stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        let mut g = self
            .copies
            .lock()
            .map_err(|_| GpuError::Driver("the copy stream's lock was poisoned".into()))?;
        if let Some(s) = g.as_ref() {
            return Ok(s.clone());
        }
        self.bind()?;
        let s = self.ctx.new_stream().map_err(drv)?;
        *g = Some(s.clone());
        Ok(s)
    }

    /// Copies into `dst` that overlap the kernels queued after them.
    pub fn overlap<'a>(&'a self, dst: &'a mut Pinned) -> Result<Overlap<'a>, GpuError> {
        Ok(Overlap {
            copy: self.copy_stream()?,
            gpu: self,
            dst,
            slots: Vec::new(),
        })
    }
}

/// One queued group of copies: its regions of the host buffer (offset,
/// floats), the event recorded after them, and whether the host has waited
/// for it.
struct Slot {
    regions: Vec<(usize, usize)>,
    done: CudaEvent,
    waited: bool,
}

/// Copies of device memory into one page-locked host buffer, each group
/// ordered after the kernels queued before it on the main stream and run
/// on the copy stream while later ones run ([`Gpu::overlap`]).
pub struct Overlap<'a> {
    gpu: &'a Gpu,
    copy: Arc<CudaStream>,
    dst: &'a mut Pinned,
    slots: Vec<Slot>,
}

impl Overlap<'_> {
    /// Queues, after everything queued so far on the main stream, one copy
    /// per `(src, offset, floats)`: `floats` floats from device address `src`
    /// to the host buffer at `offset`. Returns the group's slot for
    /// [`Overlap::wait`]. A region outside the buffer, or overlapping one
    /// already queued, is an error and queues nothing.
    pub fn queue(&mut self, copies: &[(u64, usize, usize)]) -> Result<usize, GpuError> {
        let len = self.dst.len();
        let mut taken: Vec<(usize, usize)> = self
            .slots
            .iter()
            .flat_map(|s| s.regions.iter().copied())
            .collect();
        for &(_, off, n) in copies {
            if off.checked_add(n).is_none_or(|e| e > len) {
                return Err(GpuError::Shape {
                    what: "overlapped copy",
                    detail: format!("{n} floats at {off} into a host buffer of {len}"),
                });
            }
            if taken.iter().any(|&(o, m)| off < o + m && o < off + n) {
                return Err(GpuError::Shape {
                    what: "overlapped copy",
                    detail: format!("{n} floats at {off} overlap a region already queued"),
                });
            }
            taken.push((off, n));
        }
        self.gpu.bind()?;
        let ready = self.gpu.stream.record_event(None).map_err(drv)?;
        self.copy.wait(&ready).map_err(drv)?;
        let base = self.dst.host_ptr();
        for &(src, off, n) in copies.iter().filter(|c| c.2 > 0) {
            // SAFETY: `off + n <= len` (checked above), so the destination is
            // inside the buffer, which `self` borrows until it is dropped;
            // drop waits for this copy, and `region` hands the bytes out only
            // after `wait` saw it complete. The caller's device buffer at
            // `src` holds `n` floats (as for every raw address here).
            let r = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    base.add(off).cast(),
                    src,
                    n * std::mem::size_of::<f32>(),
                    self.copy.cu_stream(),
                )
            };
            r.result().map_err(drv)?;
        }
        let done = self.copy.record_event(None).map_err(drv)?;
        self.slots.push(Slot {
            regions: copies.iter().map(|&(_, o, n)| (o, n)).collect(),
            done,
            waited: false,
        });
        Ok(self.slots.len() - 1)
    }

    /// Groups queued so far.
    pub fn queued(&self) -> usize {
        self.slots.len()
    }

    /// Waits until slot `slot`'s copies have completed.
    pub fn wait(&mut self, slot: usize) -> Result<(), GpuError> {
        let n = self.slots.len();
        let s = self.slots.get_mut(slot).ok_or_else(|| GpuError::Shape {
            what: "overlapped copy",
            detail: format!("slot {slot} of {n} queued"),
        })?;
        if !s.waited {
            self.gpu.bind()?;
            s.done.synchronize().map_err(drv)?;
            s.waited = true;
        }
        Ok(())
    }

    /// `floats` floats of the host buffer at `offset`, which must lie within
    /// one region of a slot already waited for.
    pub fn region(&self, offset: usize, floats: usize) -> Result<&[f32], GpuError> {
        let ok = self.slots.iter().filter(|s| s.waited).any(|s| {
            s.regions
                .iter()
                .any(|&(o, m)| o <= offset && offset + floats <= o + m)
        });
        if !ok {
            return Err(GpuError::Shape {
                what: "overlapped copy",
                detail: format!("{floats} floats at {offset}: not within a completed copy"),
            });
        }
        // SAFETY: the range is inside the buffer (within a queued region) and
        // its copy has completed; no copy queued here writes it again
        // (regions never overlap), and `self` borrows the buffer, so nothing
        // else writes it while the slice lives.
        Ok(unsafe {
            std::slice::from_raw_parts(self.dst.host_ptr().add(offset).cast_const(), floats)
        })
    }
}

impl Drop for Overlap<'_> {
    fn drop(&mut self) {
        // Every copy must be finished before the buffer is read, reused or
        // freed; an error here leaves nothing better to do than to wait for
        // the whole stream.
        let _ = self.gpu.bind();
        for s in self.slots.iter().filter(|s| !s.waited) {
            if s.done.synchronize().is_err() {
                let _ = self.copy.synchronize();
                break;
            }
        }
    }
}
