//! Thread pool handle shared by the fast kernels.
//!
//! Kernels only ever split work over *independent outputs* (matmul rows,
//! attention (token, head) pairs), each computed by the same instruction
//! sequence whatever thread runs it; the thread count therefore never changes a
//! bit (contract invariant I5). `Threads::new(1)` runs inline with no pool.
//!
//! The pool is built for the decode step's shape: ~150 short parallel regions
//! (tens of microseconds each) per token. Workers spin on an epoch counter for
//! a while after each region, so the next region starts without a futex
//! wake-up, and park after [`SPIN_ROUNDS`] idle rounds. A region is an
//! [`Arc`]ed job with an atomic task counter: the caller claims tasks too, and
//! returns only when every task has completed, so the borrowed closure outlives
//! every call of it; a worker holding a stale job finds no task left to claim
//! and never calls its closure. A pool busy with another caller (or a nested
//! call) runs the region inline — correct, because results do not depend on
//! the thread count.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Idle rounds (`spin_loop` hints) a worker spins before parking: 0.38 ms on
/// the development machine (a `pause` costs ~35 cycles there; up to ~140 on
/// other Intel parts), longer than the serial gaps between regions of a step.
pub const SPIN_ROUNDS: u32 = 1 << 15;

/// A fixed-size worker pool, or none for single-threaded execution.
#[derive(Clone)]
pub struct Threads {
    pool: Option<Arc<Pool>>,
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
    #[error("cannot start worker thread {i} of {n}: {source}")]
    Spawn {
        i: usize,
        n: usize,
        #[source]
        source: std::io::Error,
    },
}

/// One parallel region: tasks `0..tasks` of a borrowed closure.
struct Job {
    /// The caller's closure, lifetime erased. Called only after a successful
    /// claim, and the caller waits for every claimed task to finish.
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

// SAFETY: `f` points to a `Sync` closure and is only dereferenced while the
// caller of `for_ranges` is blocked waiting for the job (see `Job::f`).
unsafe impl Send for Job {}
// SAFETY: as above; every other field is atomic.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let t = self.next.fetch_add(1, Ordering::AcqRel);
            if t >= self.tasks {
                return;
            }
            // SAFETY: the claim succeeded, so the caller is still inside
            // `for_ranges` (it returns only once `done == tasks`), and the
            // closure it borrowed is alive.
            let f = unsafe { &*self.f };
            if catch_unwind(AssertUnwindSafe(|| f(t))).is_err() {
                self.panicked.store(true, Ordering::Release);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// State shared by the caller and the workers.
struct Shared {
    /// Bumped once per published job (and at shutdown).
    epoch: AtomicU64,
    job: Mutex<Option<Arc<Job>>>,
    shutdown: AtomicBool,
    /// Per worker: parked (or about to park).
    sleeping: Vec<AtomicBool>,
}

struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the caller running a region on this pool.
    busy: Mutex<()>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(shared: Arc<Shared>, me: usize) {
    let mut seen = shared.epoch.load(Ordering::Acquire);
    loop {
        let mut rounds = 0u32;
        loop {
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            if shared.epoch.load(Ordering::Acquire) != seen {
                break;
            }
            if rounds < SPIN_ROUNDS {
                rounds += 1;
                std::hint::spin_loop();
                continue;
            }
            // Announce, re-check, park: the publisher stores the epoch before
            // reading `sleeping`, so one of the two sees the other.
            shared.sleeping[me].store(true, Ordering::SeqCst);
            if shared.epoch.load(Ordering::SeqCst) == seen
                && !shared.shutdown.load(Ordering::SeqCst)
            {
                std::thread::park();
            }
            shared.sleeping[me].store(false, Ordering::SeqCst);
        }
        seen = shared.epoch.load(Ordering::Acquire);
        let job = shared.job.lock().ok().and_then(|j| j.clone());
        if let Some(job) = job {
            job.work();
        }
    }
}

impl Threads {
    /// A pool of `n` threads (`n == 1`: run on the caller's thread). The
    /// caller is one of the `n`: `n - 1` workers are started.
    pub fn new(n: usize) -> Result<Self, ThreadsError> {
        if n == 0 {
            return Err(ThreadsError::Zero(n));
        }
        if n == 1 {
            return Ok(Self::single());
        }
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            sleeping: (0..n - 1).map(|_| AtomicBool::new(false)).collect(),
        });
        let mut pool = Pool {
            shared: shared.clone(),
            workers: Vec::with_capacity(n - 1),
            busy: Mutex::new(()),
        };
        for i in 0..n - 1 {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("lmrr-worker-{i}"))
                .spawn(move || worker(s, i))
                .map_err(|source| ThreadsError::Spawn { i, n, source })?;
            pool.workers.push(h);
        }
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
        let inline = || (0..tasks).for_each(|t| f(range(t)));
        let Some(pool) = self.pool.as_ref().filter(|_| tasks > 1) else {
            return inline();
        };
        let busy = match pool.busy.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return inline(),
        };
        let run = |t: usize| f(range(t));
        let run: &(dyn Fn(usize) + Sync) = &run;
        // SAFETY: only the lifetime is erased; this function does not return
        // before every claimed task has finished (below), so no call through
        // the pointer outlives `run`.
        let ptr: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(run) };
        let job = Arc::new(Job {
            f: ptr,
            tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        });
        let sh = &pool.shared;
        if let Ok(mut slot) = sh.job.lock() {
            *slot = Some(job.clone());
        }
        sh.epoch.fetch_add(1, Ordering::SeqCst);
        for (i, s) in sh.sleeping.iter().enumerate() {
            if s.load(Ordering::SeqCst) {
                pool.workers[i].thread().unpark();
            }
        }
        job.work();
        while job.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        if let Ok(mut slot) = sh.job.lock() {
            *slot = None;
        }
        drop(busy);
        if job.panicked.load(Ordering::Acquire) {
            panic!("a parallel task panicked (its message was printed above)");
        }
    }

    /// Runs `f` on the calling thread (kept so callers can mark a region
    /// that issues many parallel loops; the pool needs no set-up for it).
    pub fn install<R: Send, F: FnOnce() -> R + Send>(&self, f: F) -> R {
        f()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_exactly_once_across_many_regions() {
        let th = Threads::new(3).unwrap();
        let hits: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..2000 {
            let total = 1 + round % 997;
            th.for_ranges(total, 1 + round % 13, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let want: Vec<usize> = (0..1000)
            .map(|i| (0..2000).filter(|round| i < 1 + round % 997).count())
            .collect();
        let got: Vec<usize> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn regions_after_the_workers_parked_still_run() {
        let th = Threads::new(2).unwrap();
        let sum = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(30));
            th.for_ranges(100, 7, |r| {
                sum.fetch_add(r.len(), Ordering::Relaxed);
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 300);
    }

    #[test]
    fn concurrent_and_nested_callers_fall_back_to_inline() {
        let th = Threads::new(2).unwrap();
        let sum = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        th.for_ranges(50, 3, |r| {
                            // Nested region on the same pool.
                            th.for_ranges(r.len(), 1, |q| {
                                sum.fetch_add(q.len(), Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4 * 200 * 50);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_survives() {
        let th = Threads::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            th.for_ranges(64, 1, |r| {
                if r.start == 37 {
                    panic!("task 37");
                }
            })
        }));
        assert!(r.is_err());
        // The pool is still used in parallel afterwards (not silently inline):
        // tasks run on more than one thread. Each task waits (up to a
        // deadline, so that an inline pool fails rather than hangs) until a
        // second thread has taken one: a loaded machine may be slow to
        // wake the worker, but a live pool brings it.
        let sum = AtomicUsize::new(0);
        let ids = Mutex::new(std::collections::HashSet::new());
        let seen = || ids.lock().map_or(0, |s| s.len());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        for _ in 0..20 {
            th.for_ranges(64, 1, |r| {
                sum.fetch_add(r.len(), Ordering::Relaxed);
                if let Ok(mut s) = ids.lock() {
                    s.insert(std::thread::current().id());
                }
                while seen() < 2 && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 20 * 64);
        assert!(seen() > 1, "regions ran on one thread only");
    }
}
