//! The CUDA kernels (`kernels/cuda/`, joined as `cuda_source::SOURCE`) run
//! on the CPU through a CUDA emulation (`kernels/cuda/emu/`: the same source
//! compiled by the host's C++ compiler, a block's threads run as fibers,
//! shuffles and barriers emulated), against the CPU references, bit for
//! bit. This checks the kernels' index arithmetic and reduction orders on
//! every machine, CI included; the device itself is checked by `gpu_check`
//! (register, memory-model and compiler differences can only show there).
//! Skipped, with the reason printed, where no `g++` is found, unless
//! `LMRR_REQUIRE_TOOLS=1` (CI), where that is a failure.
//!
//! One test binary, split by responsibility: `harness` (building and
//! running the emulation), `matmul`, `norm`, `attention` (with RoPE, the
//! page writes and embedding rows), `attention_split` (the decode split
//! over the KV length, with its own negative controls), `attention_window` (every attention
//! kernel under sliding windows, with its own negative controls),
//! `program_ops` (the step programs' op
//! kernels), `tc_gemm` (the tensor-core GEMM's tiles and fragment indices,
//! with an emulated mma) and `controls` (the negative controls: every test
//! can fail).

mod attention;
mod attention_split;
mod attention_window;
mod controls;
mod harness;
mod matmul;
mod norm;
mod program_ops;
mod tc_gemm;
