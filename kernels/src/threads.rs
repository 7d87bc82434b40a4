//! Thread pool handle shared by the fast kernels.
//!
//! Kernels only ever split work over *independent outputs* (matmul rows,
//! attention (token, head) pairs), each computed by the same instruction
//! sequence whatever thread runs it; the thread count therefore never changes a
//! bit (contract invariant I5). `Threads::new(1)` runs inline with no pool.

use std::sync::Arc;

/// A fixed-size worker pool, or none for single-threaded execution.
#[derive(Clone)]
pub struct Threads {
    pool: Option<Arc<rayon::ThreadPool>>,
    n: usize,
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Threads").field("n", &self.n).finish()
    }
}

/// Error building a pool.
#[derive(Debug, thiserror::Error)]
pub enum ThreadsError {
    #[error("thread count must be at least 1, got {0}")]
    Zero(usize),
    #[error("cannot start {n} worker threads: {source}")]
    Spawn {
        n: usize,
        #[source]
        source: rayon::ThreadPoolBuildError,
    },
}

impl Threads {
    /// A pool of `n` threads (`n == 1`: run on the caller's thread).
    pub fn new(n: usize) -> Result<Self, ThreadsError> {
        if n == 0 {
            return Err(ThreadsError::Zero(n));
        }
        if n == 1 {
            return Ok(Self::single());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("lmrr-worker-{i}"))
            .build()
            .map_err(|source| ThreadsError::Spawn { n, source })?;
        Ok(Self {
            pool: Some(Arc::new(pool)),
            n,
        })
    }

    /// Single-threaded execution.
    pub fn single() -> Self {
        Self { pool: None, n: 1 }
    }

    /// Number of threads.
    pub fn count(&self) -> usize {
        self.n
    }

    /// Runs `f` over `[0, total)` cut into ranges of `grain` items (the last may
    /// be shorter). Ranges may run concurrently and in any order.
    pub fn for_ranges<F>(&self, total: usize, grain: usize, f: F)
    where
        F: Fn(std::ops::Range<usize>) + Sync + Send,
    {
        let grain = grain.max(1);
        let tasks = total.div_ceil(grain);
        let range = |t: usize| t * grain..((t + 1) * grain).min(total);
        match &self.pool {
            Some(pool) if tasks > 1 => {
                use rayon::prelude::*;
                pool.install(|| (0..tasks).into_par_iter().for_each(|t| f(range(t))));
            }
            _ => (0..tasks).for_each(|t| f(range(t))),
        }
    }

    /// Runs `f` with the pool's threads as the current rayon context, so the
    /// parallel regions inside it start without cross-thread injection.
    pub fn install<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        match &self.pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }

    /// A grain that gives each thread a few tasks, rounded up to `align`.
    pub fn grain(&self, total: usize, align: usize) -> usize {
        let tasks = if self.n == 1 { 1 } else { self.n * 4 };
        let g = total.div_ceil(tasks).max(1);
        g.div_ceil(align) * align
    }
}

/// A raw pointer that may cross threads. Used where workers write disjoint
/// regions of one output buffer.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);

impl<T> SendPtr<T> {
    /// The pointer. Closures call this (capturing the whole `SendPtr`, which is
    /// `Sync`) instead of reading the field (which would capture the bare,
    /// non-`Send` pointer).
    #[inline]
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}
// SAFETY: users only write through the pointer at indices no other worker
// touches, and the owning slice outlives the parallel region (`for_ranges` joins
// before returning).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}
