//! One value per thread on resident buffers: embedding rows, residual
//! adds, SwiGLU, row gathers.

use crate::cuda::buf::DevMatrix;
use crate::cuda::launch::*;
use crate::cuda::split::MmOut;
use crate::cuda::{as_i32, Gpu, GpuError};

impl Gpu {
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
    }
}
