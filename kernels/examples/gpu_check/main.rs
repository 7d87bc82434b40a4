//! Device check for contract invariant I6: every op of the CUDA mirror against
//! the CPU fast path, bit for bit, on awkward sizes and special values.
//!
//!     cargo build --release -p lmrr-kernels --features cuda --example gpu_check
//!     target/release/examples/gpu_check        # on a machine with a GPU
//!
//! Prints one line per case and a summary; exits 1 on any differing bit, 2
//! when no device can be opened.
//!
//! Layout: `controls` (the negative controls: mutated builds, each of which
//! must make the case it names differ), `cases` (each comparison), `timing`
//! (kernel figures on resident operands), `report` (the tally and summary),
//! `util` (operands and bit-difference counts).

mod cases;
mod controls;
mod program_ops;
mod report;
mod timing;
mod util;

use lmrr_kernels::cuda::Gpu;
use lmrr_kernels::*;

use report::Report;

fn main() {
    // `gpu_check timing`: the kernel figures alone (no checks but the
    // timed kernels' agreement), for a device call short of time.
    // `gpu_check timing attention`: the long-context decode attention alone.
    if std::env::args().nth(1).as_deref() == Some("timing") {
        timing_only(std::env::args().nth(2).as_deref() == Some("attention"));
    }
    // Negative controls first: a check that cannot see a broken mirror
    // proves nothing.
    let blind = controls::run();
    let gpu = open_device();
    let th = Threads::new(2).expect("threads");
    // One random stream for every case, in this order.
    let mut r = SplitMix64(2026);
    let mut rep = Report::default();
    let (g, r, rep) = (&gpu, &mut r, &mut rep);
    cases::matmuls(g, &th, r, rep);
    cases::multi(g, &th, r, rep);
    cases::empty(g, r, rep);
    cases::norms(g, r, rep);
    cases::decode_rope_steps(g, r, rep);
    cases::det_exp(g, r, rep);
    cases::swiglu_long(g, r, rep);
    cases::rope_positions(g, r, rep);
    cases::attention_gqa(g, &th, r, rep);
    cases::attention_wide(g, &th, r, rep);
    cases::attention_window(g, &th, r, rep);
    cases::hyper_mixes(g, r, rep);
    cases::hyper_specials(g, r, rep);
    cases::moe_combines(g, r, rep);
    cases::indexer_scores(g, r, rep);
    program_ops::program_ops(g, r, rep);
    timing::matmuls(g, r);
    timing::attention_prefill(g, r, rep);
    timing::attention_decode(g, r, rep);
    timing::gemm_8b(g, r);
    timing::attention_long(g, r, rep);
    std::process::exit(rep.finish(isa(), &gpu.name(), &blind));
}

/// Device 0, named on stdout; exit 2 when none can be opened.
fn open_device() -> Gpu {
    match Gpu::open(0) {
        Ok(g) => {
            println!("device: {}", g.name());
            g
        }
        Err(e) => {
            eprintln!("SKIPPED: no device: {e}");
            std::process::exit(2);
        }
    }
}

fn timing_only(attention_only: bool) -> ! {
    let gpu = open_device();
    let mut r = SplitMix64(2026);
    let mut rep = Report::default();
    if !attention_only {
        timing::gemm_8b(&gpu, &mut r);
    }
    timing::attention_long(&gpu, &mut r, &mut rep);
    if !attention_only {
        timing::attention_prefill(&gpu, &mut r, &mut rep);
    }
    std::process::exit(rep.finish(isa(), &gpu.name(), &[]));
}
