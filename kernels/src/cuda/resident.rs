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
use crate::quant::QuantKind;

pub use super::split::MmOut;

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
/// Threads a `matmul_chunk` block holds at most (`MC_MAX_THREADS`): a row's
/// chunks must fit one block, so rows of at most this many chunks.
pub const MC_MAX_THREADS: usize = 256;
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

/// Which kernel the resident path takes for a step or a matmul. Tuning
/// only: every choice computes the same bits (device-check.sh holds each
/// path to the CPU), so these move speed and nothing else. Each can be set
/// by its environment variable to measure another choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// `LMRR_CUDA_FUSED_MAX`: steps of at most this many tokens (and
    /// wanted logits rows) run fused (`matmul_fused`: the norms, residual
    /// adds and SwiGLU inside the matmuls; 6 launches a layer); 0: never.
    pub fused_max: usize,
    /// `LMRR_CUDA_SWIGLU_MAX`: in steps of at most this many tokens that are
    /// not fused whole, gate/up computes SwiGLU in its epilogue
    /// (`matmul_fused` with no norm: one launch a layer fewer); 0: never.
    /// Off: measured slower on the H200 (batch 1 671 against 716 tok/s,
    /// batch 8 3,323 against 3,420).
    pub swiglu_max: usize,
    /// `LMRR_CUDA_GEMM_MIN`: matmuls of at least this many tokens take
    /// `matmul_gemm` (staged tiles) rather than `matmul_rows`.
    pub gemm_min: usize,
    /// `LMRR_CUDA_GEMM_WIDE_MIN`: from this many tokens, `matmul_gemm_wide`
    /// (tiles of 64 rows × 32 tokens, 256 threads) instead of `matmul_gemm`
    /// (32 × 16, 64 threads).
    pub gemm_wide_min: usize,
    /// `LMRR_CUDA_GEMM_PIPELINED=1`: the wide tiles by
    /// `matmul_gemm_pipelined` (the next chunk's loads held in registers
    /// during this one's FMAs); off (0): `matmul_gemm_wide`, staging then
    /// computing, two blocks an SM. Off since the lane-major tiles: the held
    /// loads spill at 128 registers (H200, 4096-token gate/up: 418 against
    /// 340 µs; 512-token prefill 22,090 against 25,674 tok/s).
    pub gemm_pipelined: bool,
    /// `LMRR_CUDA_DOWN_SWIGLU=1`: in steps that take `matmul_rows`, down
    /// reads SwiGLU(gate, up) made in its own loads (`matmul_rows_swiglu`:
    /// one launch a layer fewer). Off: measured slower on the H200 (batch 1
    /// 728 against 792 tok/s, batch 8 2,550 against 3,603), each of down's
    /// blocks recomputing the whole row's SwiGLU.
    pub down_swiglu: bool,
    /// `LMRR_CUDA_ATTN_DECODE_MAX`: attention steps of at most this many
    /// blocks (tokens × heads) take `attention_decode` (a block's loads in
    /// flight together, more registers) rather than `attention_paged`; 0:
    /// never.
    pub attn_decode_max: usize,
    /// `LMRR_CUDA_PDL` (default 1; sm_90 and later, ignored on an earlier
    /// device): programmatic dependent launch, each resident kernel
    /// launched while the one ahead of it runs and waiting for it inside
    /// (`PDL_ENTRY`), the kernels compiled for sm_90. Measured faster on the
    /// H200 at every batch (batch 1 836 against 784 tok/s, graphs off 761
    /// against 620); 0: plain launches, the kernels at NVRTC's default
    /// architecture.
    pub pdl: bool,
    /// `LMRR_CUDA_PDL_PREFETCH` (default 1, with [`Tuning::pdl`]): the
    /// resident module compiled with `PDL_PREFETCH`, so that `matmul_rows`,
    /// `matmul_multi`, `matmul_rows_swiglu`, `matmul_fused` and `norm_reg`
    /// load their first weights before waiting for the kernel ahead of them
    /// (weights are never written while steps run: the same values).
    /// Measured faster on the H200 (three rounds, batch 1 912-961 against
    /// 834-838 tok/s, batch 8 3,654-3,880 against 3,439-3,527, bf16 batch 1
    /// 888 against 767); 0: every kernel waits first.
    pub pdl_prefetch: bool,
    /// `LMRR_CUDA_ATTN_PREFETCH` (with [`Tuning::pdl_prefetch`]):
    /// `attention_decode` loads the step's inputs and the K/V rows that
    /// earlier steps wrote (below the first position its span writes now)
    /// before its wait; rows of this step's positions and q after it. Off:
    /// bit-identical on the H200 but slower (two alternating rounds: batch 1
    /// 700-702 against 940-951 tok/s, batch 8 3,216-3,265 against
    /// 3,749-3,878, after 512 tokens 434-437 against 505-508); the held
    /// rows cost the kernel its occupancy.
    pub attn_prefetch: bool,
    /// `LMRR_CUDA_ATTN_PREFILL` (default 1): attention over a step's tokens
    /// in groups of up to [`PF_TQ`] of one sequence (`attention_prefill`:
    /// each K/V tile loaded once for the group), where the step's
    /// [`PageTable`] lists groups (steps whose spans are long); 0:
    /// `attention_paged`, a block per token and head.
    pub attn_prefill: bool,
    /// `LMRR_CUDA_ATTN_PREFILL_GROUP` (1..=[`PF_TQ`], default 16): tokens
    /// per `attention_prefill` group. Fewer: more blocks (a 512-token
    /// prefill has 32 groups of 16 per head), each K/V tile loaded for
    /// fewer tokens.
    pub attn_prefill_group: usize,
    /// `LMRR_CUDA_ATTN_PREFILL_HD64` (default 1): where `attention_prefill`
    /// serves a step of head_dim 64 ([`hd64_fits`]), `attention_prefill_hd64`
    /// does (float4 tiles, the next tile's loads in flight, fewer
    /// shared-memory reads; the same bits). Measured on the H200: 75.8
    /// against 169.8 µs a layer of a 512-token prefill (606 against 1,212
    /// at 2,048); 512-token prefill 43,989 against 35,570 tok/s, 2,048
    /// tokens 43,739 against 31,236.
    pub attn_prefill_hd64: bool,
    /// `LMRR_CUDA_ROPE_ATTN` (default 1): a decode step's RoPE and K/V page
    /// writes made by its attention blocks (`attention_decode_rope`), one
    /// launch a layer fewer, where the step qualifies
    /// ([`Gpu::attention_decode_rope`]). Measured on the H200: batch 1 937
    /// against 910 tok/s, batch 8 3,919 against 3,752.
    pub rope_attn: bool,
    /// `LMRR_CUDA_SPLIT_BLOCKS`: a `matmul_gemm` whose tiles are fewer
    /// than this many blocks is split over its chunks (partials, then
    /// `sum_chunks`) to about this many blocks; 0: never split.
    pub split_blocks: usize,
    /// `LMRR_CUDA_GEMM_MULTI` (default 1): in steps of wide gemm tiles, the
    /// matmuls of one input (q, k, v; gate, up) in one `matmul_gemm_multi`
    /// launch, each block the block it is in its own launch (the same
    /// bits), rather than a launch each; a single matrix (o, down) takes
    /// it too. With [`Tuning::fold_sums`], measured on the H200: batch 64
    /// 17,420 against 16,762 tok/s.
    pub gemm_multi: bool,
    /// `LMRR_CUDA_FOLD_SUMS` (default 1): a split gemm's chunk partials are
    /// summed by the kernel that reads its output (`rope_kv`,
    /// `norm_reg`/`norm_block`, `swiglu_split`, `add_rows`, each through
    /// `split_value`: sum_chunks' bits) rather than by a `sum_chunks` launch
    /// ahead of it. Measured on the H200 with [`Tuning::gemm_multi`] (above);
    /// alone it was slower at batch 64 (16,319 against 17,218 tok/s).
    pub fold_sums: bool,
    /// `LMRR_CUDA_KV_OVERLAP_MIN` (default 256; 0: off): in steps of at
    /// least this many tokens that are not replayed from a graph, each
    /// layer's K/V rows are copied to the host on a second stream as soon as
    /// the layer has made them, and the host writes them into its KV store
    /// while the later layers run ([`super::overlap`]), rather than one
    /// download after the step. Measured on the H200: 512-token prefill
    /// 38,332 against 35,425 tok/s.
    pub kv_overlap_min: usize,
    /// `LMRR_CUDA_KV_EARLY_MIN` (default 1; 0: off): in steps of at least
    /// this many tokens (and not overlapped layer by layer), the K/V rows
    /// are copied to the host on the second stream right after the last
    /// layer, and the host writes them into its KV store while the head
    /// runs and the logits come back (decode graphs capture the layers and
    /// the head apart for it). Measured on the H200: batch 64 18,277
    /// against 16,981 tok/s (at 16, the default then); on the H100
    /// (2026-12-05e, two alternating rounds) at 1: batch 1 957.9 / 959.0
    /// against 953.0, batch 8 4,286 / 4,325 against 4,113 / 4,115 (the
    /// step's copies, 14–95 µs, run during the head).
    pub kv_early_min: usize,
    /// `LMRR_CUDA_CHUNK_MAX` (0: off): matmuls of at most this many tokens
    /// (below [`Tuning::gemm_min`]) take `matmul_chunk` — a thread per
    /// (row, 64-chunk), its chunk's weights loaded at once, a block of
    /// several rows — rather than `matmul_rows` / `matmul_multi` (a block
    /// per row). The same bits.
    pub chunk_max: usize,
    /// `LMRR_CUDA_CHUNK_THREADS` (32..=256, default 128): the threads a
    /// `matmul_chunk` block aims at (whole rows of chunks: 14 rows of 9
    /// chunks make 126).
    pub chunk_threads: usize,
    /// `LMRR_CUDA_ATTN_DECODE_HD64` (0/1, off: measured slower):
    /// where `attention_decode` (or `attention_decode_rope`) serves a step
    /// of head_dim 64 ([`hd64_fits`]), `attention_decode_hd64` (or
    /// `attention_decode_rope_hd64`) does: a thread per position's score,
    /// the tile maxima by warp shuffles, every thread its own running max,
    /// three barriers a pass instead of seven (the same bits). Off: slower on
    /// the H100 (two alternating rounds, batch 1 835/838 against 943/941
    /// tok/s, batch 8 3,550/3,663 against 3,966/3,873, after 512 tokens
    /// 437/439 against 478/489; gpu_check's kernel time 11.1 against 9.6 µs
    /// at 64 positions).
    pub attn_decode_hd64: bool,
    /// `LMRR_CUDA_GATE_UP_SWIGLU` (0/1): in steps that take `matmul_rows`
    /// (below [`Tuning::gemm_min`] tokens), gate and up of each row in one
    /// block and SwiGLU in its epilogue (`gate_up_swiglu`,
    /// [`Gpu::gate_up_swiglu`]): one launch a layer fewer, the same bits.
    /// Off: slower on an H100 (2026-12-05f, `scripts/device-ab.sh`): the
    /// batch-1 step's kernels 1.106 ms against 1.042 (898–900 against
    /// 948–949 tok/s), batch 8 3,169–3,249 against 3,833–3,895 tok/s; a
    /// block's two matrices cost more than the launch it saves.
    pub gate_up_swiglu: bool,
    /// `LMRR_CUDA_HEAD_DIRECT` (0/1): where a step wants every token's
    /// logits row, in order (every decode step), the head's residual add
    /// and final norm are one `norm_reg` launch over the rows where they
    /// are, with no `add_rows` or `gather_rows` launch (two launches a step
    /// fewer; the same operations on the same rows). On since 2026-12-05f:
    /// on an H100 the batch-1 step's kernels took 1.042–1.043 ms against
    /// 1.044–1.045 (`scripts/device-ab.sh`; a small gain, within the
    /// rounds' spread at batch 8).
    pub head_direct: bool,
    /// `LMRR_CUDA_SWIGLU4` (0/1): the resident SwiGLU (of unsplit gate and
    /// up outputs: prefill steps, decode steps below
    /// [`Tuning::gemm_min`]) four elements a thread (`swiglu4`, float4
    /// loads; the same operations on each element) where the count is a
    /// multiple of 4 and the buffers 16-byte aligned. Off: no faster on an
    /// H100 (2026-12-05f): a 512-token prefill at 48,178–48,194 tok/s
    /// against 48,171–48,223 by default.
    pub swiglu4: bool,
    /// `LMRR_CUDA_LOADS_FIRST_MIN` (rows; 0 = never): norms of at least
    /// this many rows take `norm_reg_lf`, which loads the whole residual
    /// row before storing the sums (one round trip a row, not one an
    /// element; the same values). Measured on an H100 (2026-12-05f,
    /// `docs/gpu-runs-2026-12-05f.txt`): alone each batch-1 norm takes
    /// 3.24 µs against 4.64 (ncu, graphs off), and prefill gains (64
    /// tokens 25,627 / 26,045 against 24,019 / 24,536 tok/s, 512 tokens
    /// 49,117 / 49,132 against 48,910 / 48,819), but in a batch-1 decode
    /// chain (graphs, programmatic dependent launch) the step's kernels
    /// take 1.081–1.085 ms against 1.050 and batch 8 is unchanged. Default
    /// 128: a step's norms take it when the step carries 128 tokens or more
    /// (prefill; a chunked prefill's smaller steps do not), no decode batch
    /// up to the 64 measured does.
    pub loads_first_min: usize,
    /// `LMRR_CUDA_ROWS4_MIN` (rows; 0 = never; default 32,768: an lm
    /// head, no layer's matrix): matrices of at least this many rows, in
    /// steps of at least [`Tuning::rows4_tokens`] tokens that take
    /// `matmul_rows`, by `matmul_rows4` instead: four rows a block, each
    /// thread's loads of the four rows in flight at once (the same
    /// operations; rows of at most `64 · MR4_MAX_CHUNKS` columns). For the
    /// `small` preset's 49,152-row head, measured on an H100 (2026-12-06,
    /// two alternating rounds, `docs/gpu-runs-2026-12-06.txt`): batch 8
    /// 4,322 / 4,338 against 4,138 / 4,129 tok/s (the step's kernels 1.722
    /// against 1.790 ms), batch 1 939.9 / 941.3 against 938.7 / 949.6 (1.047
    /// against 1.042 ms: slower, hence the token floor).
    pub rows4_min: usize,
    /// `LMRR_CUDA_ROWS4_TOKENS` (default 8, one full token tile): the
    /// fewest tokens a step has for [`Tuning::rows4_min`] to apply.
    pub rows4_tokens: usize,
    /// `LMRR_CUDA_ROWS4_MAX` (rows; default 0 = no maximum): matrices of
    /// more rows than this keep `matmul_rows` whatever
    /// [`Tuning::rows4_min`] says, so that the layers' matrices can take
    /// `matmul_rows4` at a token count where the lm head does not
    /// (`ROWS4_MIN=1 ROWS4_TOKENS=1 ROWS4_MAX=32767`: o and down of a
    /// batch-1 step, the head by `matmul_rows`).
    pub rows4_max: usize,
    /// `LMRR_CUDA_ROPE_QS` (0/1, default 1): where `attention_decode_rope`
    /// serves a step, `attention_decode_rope_qs` does: the rotated q head
    /// handed from the RoPE prologue to the attention in shared memory,
    /// one barrier and one reload of q from global memory fewer a block
    /// (the same operations). Measured on an H100 (2026-12-06, two
    /// alternating rounds): batch 1 961.0 / 959.5 against 938.7 / 949.6
    /// tok/s (the step's kernels 1.028 / 1.029 against 1.044 / 1.041 ms),
    /// batch 64 19,565 / 19,501 against 19,076 / 19,232, batch 8 4,125 /
    /// 4,161 against 4,138 / 4,129.
    pub rope_qs: bool,
    /// `LMRR_CUDA_MULTI4` (0/1): steps that take `matmul_multi` (q/k/v,
    /// gate/up below [`Tuning::gemm_min`] tokens) take `matmul_multi4`
    /// instead, `matmul_rows4`'s blocks of four rows (the same operations).
    /// gpu_check on an H100 (2026-12-06) timed `matmul_rows4` alone on one
    /// token of gate/up at 3.3 µs against `matmul_rows`' 4.4. Not yet
    /// measured in a step: off.
    pub multi4: bool,
    /// `LMRR_CUDA_LB_ATTN_DECODE` (blocks; default 0 = none): the decode
    /// attention kernels (`attention_decode`, `_rope`, `_rope_qs`)
    /// compiled with launch bounds asking for this many blocks an SM, which
    /// caps their registers (kernels.cu's `ATTN_DECODE_BOUNDS`; ptxas for
    /// sm_90: 96 registers without, two blocks an SM; 64 with 4, no
    /// spills). Register allocation only: the same operations. With
    /// [`Tuning::pdl`] (the resident module compiled for sm_90).
    pub lb_attn_decode: usize,
    /// `LMRR_CUDA_LB_ATTN_PREFILL` (blocks; default 0 = none):
    /// `attention_prefill_hd64` likewise (82 registers, two blocks an SM,
    /// without: 288 blocks of a 512-token prefill do not fit one wave on
    /// 132 SMs; 80 with 3, 64 with 4, each with a few spilled bytes).
    pub lb_attn_prefill: usize,
    /// `LMRR_CUDA_LB_ROWS4` (blocks; default 0 = none): `matmul_rows4` and
    /// `matmul_multi4` likewise (75 and 94 registers without, six and five
    /// blocks an SM; 59 and 56 with 8, no spills).
    pub lb_rows4: usize,
    /// `LMRR_CUDA_LB_MULTI` (blocks; default 0 = none): `matmul_multi`
    /// likewise (40 registers without, twelve blocks an SM, so a batch-1
    /// gate/up's 3,072 blocks take two rounds of 132 × 12 slots; 32 with
    /// 16, no spills).
    pub lb_multi: usize,
    /// `LMRR_CUDA_ATTN_EARLY` (0/1, default 1): `attention_decode_rope_qs`
    /// compiled with `ATTN_EARLY`: each block loads the step's inputs it
    /// reads (position, page slot and page, its page list, its cos/sin pair,
    /// the pages of its first K rows: kernels.cu's `DecodeIn`) before the
    /// PDL wait, so that after it only q/k/v and the K/V rows are loaded.
    /// The host uploads those inputs before the step and no kernel writes
    /// them: the same values. With [`Tuning::pdl`]. Measured on an H200
    /// (2026-12-06b, `docs/gpu-runs-2026-12-06b.txt`, alternating with the
    /// form before in one call): batch 1 984.1 / 967.5 / 980.5 / 963.0 /
    /// 981.3 against 817.5 / 810.0 / 819.9 / 803.2 / 807.4 tok/s (the step's
    /// kernels 1.004–1.009 against 1.205–1.210 ms), batch 8 4,168–4,332
    /// against 3,740–3,935, batch 64 unchanged (19,699 / 19,931 against
    /// 19,674–20,098).
    pub attn_early: bool,
    /// `LMRR_CUDA_PF_LONGEST_FIRST` (0/1, default 1): a prefill step's
    /// attention groups listed longest first ([`longest_first`]: by the
    /// position of each group's last token, descending), so that the blocks
    /// that walk the most K/V tiles are dispatched first rather than last
    /// (a 512-token prefill's 288 blocks of `attention_prefill_hd64` exceed
    /// the 264 an H100 or H200 holds at once, and in span order the ones left
    /// waiting are the longest). Which block serves which group moves no
    /// bit: each writes its own tokens' rows. Measured faster on an H100
    /// (2026-12-06c, `docs/gpu-runs-2026-12-06c.txt`, alternating with span
    /// order in one call): 512-token prefill 50,281 / 50,315 / 50,311
    /// against 48,985 / 48,977 / 49,149 tok/s, 2,048 tokens
    /// 49,935 / 50,010 against 47,409 / 47,220, 8 × 64 tokens 59,638 /
    /// 58,555 against 58,146 / 57,867, 64 × 64 unchanged; 0: span order.
    pub pf_longest_first: bool,
    /// `LMRR_CUDA_ROWS_NORM_MAX` (default 0: never): in steps of at most
    /// this many tokens, o and down are each one launch with the residual
    /// add and RMSNorm that follow them (`matmul_rows_norm`: `matmul_rows`,
    /// then the last of its blocks to finish adds and norms the rows;
    /// [`Gpu::rows_norm_serves`]), where they would take `matmul_rows`
    /// then `norm_reg`: 60 launches fewer a step of the `small` preset.
    /// Measured slower on an H100 (2026-12-06c, alternating in one call):
    /// batch 1 896.5 / 890.4 / 903.4 against 942.9 / 963.1 / 965.3 tok/s
    /// (the step's kernels 1.083–1.090 against 1.023–1.028 ms), batch 8
    /// 2,961 against 4,357–4,365 (the last block norms the 8 rows one
    /// after another). Each of the 576 blocks fences and counts on one
    /// address before the norm can start, where `norm_reg`'s block was
    /// already resident under PDL with its weights loaded. Bit-identical
    /// (gpu_check, device-check core under it); off.
    pub rows_norm_max: usize,
}

impl Default for Tuning {
    /// The choices measured fastest on the H200 (docs/PERFORMANCE.md).
    fn default() -> Self {
        Self {
            fused_max: 0,
            swiglu_max: 0,
            gemm_min: 64,
            gemm_wide_min: 64,
            gemm_pipelined: false,
            attn_decode_max: 132,
            down_swiglu: false,
            pdl: true,
            pdl_prefetch: true,
            attn_prefetch: false,
            attn_prefill: true,
            attn_prefill_group: PF_TQ,
            attn_prefill_hd64: true,
            rope_attn: true,
            split_blocks: 4096,
            gemm_multi: true,
            fold_sums: true,
            kv_overlap_min: 256,
            kv_early_min: 1,
            chunk_max: 0,
            chunk_threads: 128,
            attn_decode_hd64: false,
            gate_up_swiglu: false,
            head_direct: true,
            swiglu4: false,
            loads_first_min: 128,
            rows4_min: 32_768,
            rows4_tokens: 8,
            rows4_max: 0,
            rope_qs: true,
            multi4: false,
            lb_attn_decode: 0,
            lb_attn_prefill: 0,
            lb_rows4: 0,
            lb_multi: 0,
            attn_early: true,
            pf_longest_first: true,
            rows_norm_max: 0,
        }
    }
}

impl Tuning {
    /// The defaults, with any of the environment variables applied.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::from_vars(|var| std::env::var(var).ok())
    }

    /// The defaults, with the variables `get` returns applied; a value that
    /// is not a count (or 0/1 for `LMRR_CUDA_GEMM_PIPELINED`) is an error
    /// naming it.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, GpuError> {
        let mut t = Self::default();
        for (var, slot) in [
            ("LMRR_CUDA_FUSED_MAX", &mut t.fused_max),
            ("LMRR_CUDA_SWIGLU_MAX", &mut t.swiglu_max),
            ("LMRR_CUDA_GEMM_MIN", &mut t.gemm_min),
            ("LMRR_CUDA_GEMM_WIDE_MIN", &mut t.gemm_wide_min),
            ("LMRR_CUDA_SPLIT_BLOCKS", &mut t.split_blocks),
            ("LMRR_CUDA_ATTN_DECODE_MAX", &mut t.attn_decode_max),
            ("LMRR_CUDA_ATTN_PREFILL_GROUP", &mut t.attn_prefill_group),
            ("LMRR_CUDA_KV_OVERLAP_MIN", &mut t.kv_overlap_min),
            ("LMRR_CUDA_KV_EARLY_MIN", &mut t.kv_early_min),
            ("LMRR_CUDA_CHUNK_MAX", &mut t.chunk_max),
            ("LMRR_CUDA_CHUNK_THREADS", &mut t.chunk_threads),
            ("LMRR_CUDA_LOADS_FIRST_MIN", &mut t.loads_first_min),
            ("LMRR_CUDA_ROWS4_MIN", &mut t.rows4_min),
            ("LMRR_CUDA_ROWS4_TOKENS", &mut t.rows4_tokens),
            ("LMRR_CUDA_ROWS4_MAX", &mut t.rows4_max),
            ("LMRR_CUDA_LB_ATTN_DECODE", &mut t.lb_attn_decode),
            ("LMRR_CUDA_LB_ATTN_PREFILL", &mut t.lb_attn_prefill),
            ("LMRR_CUDA_LB_ROWS4", &mut t.lb_rows4),
            ("LMRR_CUDA_LB_MULTI", &mut t.lb_multi),
            ("LMRR_CUDA_ROWS_NORM_MAX", &mut t.rows_norm_max),
        ] {
            if let Some(v) = get(var) {
                *slot = v.trim().parse().map_err(|_| {
                    GpuError::Config(format!("{var}={v:?} is not a count (want 0, 1, 2, …)"))
                })?;
            }
        }
        for (var, slot) in [
            ("LMRR_CUDA_GEMM_PIPELINED", &mut t.gemm_pipelined),
            ("LMRR_CUDA_DOWN_SWIGLU", &mut t.down_swiglu),
            ("LMRR_CUDA_PDL", &mut t.pdl),
            ("LMRR_CUDA_PDL_PREFETCH", &mut t.pdl_prefetch),
            ("LMRR_CUDA_ATTN_PREFETCH", &mut t.attn_prefetch),
            ("LMRR_CUDA_ATTN_PREFILL", &mut t.attn_prefill),
            ("LMRR_CUDA_ATTN_PREFILL_HD64", &mut t.attn_prefill_hd64),
            ("LMRR_CUDA_ROPE_ATTN", &mut t.rope_attn),
            ("LMRR_CUDA_GEMM_MULTI", &mut t.gemm_multi),
            ("LMRR_CUDA_FOLD_SUMS", &mut t.fold_sums),
            ("LMRR_CUDA_ATTN_DECODE_HD64", &mut t.attn_decode_hd64),
            ("LMRR_CUDA_GATE_UP_SWIGLU", &mut t.gate_up_swiglu),
            ("LMRR_CUDA_HEAD_DIRECT", &mut t.head_direct),
            ("LMRR_CUDA_SWIGLU4", &mut t.swiglu4),
            ("LMRR_CUDA_ROPE_QS", &mut t.rope_qs),
            ("LMRR_CUDA_MULTI4", &mut t.multi4),
            ("LMRR_CUDA_ATTN_EARLY", &mut t.attn_early),
            ("LMRR_CUDA_PF_LONGEST_FIRST", &mut t.pf_longest_first),
        ] {
            if let Some(v) = get(var) {
                *slot = match v.trim() {
                    "1" => true,
                    "0" => false,
                    _ => return Err(GpuError::Config(format!("{var}={v:?}: want 0 or 1"))),
                };
            }
        }
        if let Some(v) = get("LMRR_CUDA_LOADS_FIRST") {
            return Err(GpuError::Config(format!(
                "LMRR_CUDA_LOADS_FIRST={v:?}: replaced by LMRR_CUDA_LOADS_FIRST_MIN \
                 (the rows from which norms load first; 0 = never, 1 = always)"
            )));
        }
        // matmul_fused holds at most MM_TOKENS tokens of partials.
        t.fused_max = t.fused_max.min(MM_TOKENS);
        t.swiglu_max = t.swiglu_max.min(MM_TOKENS);
        // attention_prefill holds at most PF_TQ tokens a group.
        t.attn_prefill_group = t.attn_prefill_group.clamp(1, PF_TQ);
        // matmul_chunk's blocks are at most MC_MAX_THREADS threads.
        t.chunk_threads = t.chunk_threads.clamp(32, MC_MAX_THREADS);
        // Blocks an SM: at most 2,048 threads (8 of attention's 256, 16 of
        // matmul_rows4's 128) or 32 blocks on any device so far.
        t.lb_attn_decode = t.lb_attn_decode.min(8);
        t.lb_attn_prefill = t.lb_attn_prefill.min(8);
        t.lb_rows4 = t.lb_rows4.min(16);
        t.lb_multi = t.lb_multi.min(16);
        Ok(t)
    }
}

#[cfg(test)]
mod tuning_tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Tuning, GpuError> {
        Tuning::from_vars(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn variables_set_each_choice_and_fused_steps_stay_within_the_kernel() {
        let t = with(&[
            ("LMRR_CUDA_FUSED_MAX", "64"),
            ("LMRR_CUDA_SWIGLU_MAX", "4"),
            ("LMRR_CUDA_GEMM_MIN", " 9 "),
            ("LMRR_CUDA_GEMM_WIDE_MIN", "128"),
            ("LMRR_CUDA_SPLIT_BLOCKS", "0"),
            ("LMRR_CUDA_GEMM_PIPELINED", "1"),
            ("LMRR_CUDA_ATTN_DECODE_MAX", "0"),
            ("LMRR_CUDA_DOWN_SWIGLU", "1"),
            ("LMRR_CUDA_PDL", "0"),
            ("LMRR_CUDA_PDL_PREFETCH", "0"),
            ("LMRR_CUDA_ATTN_PREFETCH", "1"),
            ("LMRR_CUDA_ATTN_PREFILL", "0"),
            ("LMRR_CUDA_ATTN_PREFILL_GROUP", "100"),
            ("LMRR_CUDA_GEMM_MULTI", "0"),
            ("LMRR_CUDA_FOLD_SUMS", "0"),
            ("LMRR_CUDA_ATTN_PREFILL_HD64", "0"),
            ("LMRR_CUDA_ROPE_ATTN", "0"),
            ("LMRR_CUDA_KV_OVERLAP_MIN", "256"),
            ("LMRR_CUDA_KV_EARLY_MIN", "16"),
            ("LMRR_CUDA_CHUNK_MAX", "8"),
            ("LMRR_CUDA_CHUNK_THREADS", "4096"),
            ("LMRR_CUDA_ATTN_DECODE_HD64", "1"),
            ("LMRR_CUDA_GATE_UP_SWIGLU", "1"),
            ("LMRR_CUDA_HEAD_DIRECT", "0"),
            ("LMRR_CUDA_SWIGLU4", "1"),
            ("LMRR_CUDA_LOADS_FIRST_MIN", "1"),
            ("LMRR_CUDA_ROWS4_MIN", "1000"),
            ("LMRR_CUDA_ROWS4_TOKENS", "1"),
            ("LMRR_CUDA_ROWS4_MAX", "50000"),
            ("LMRR_CUDA_LB_ATTN_DECODE", "4"),
            ("LMRR_CUDA_LB_ATTN_PREFILL", "3"),
            ("LMRR_CUDA_LB_ROWS4", "99"),
            ("LMRR_CUDA_ATTN_EARLY", "0"),
            ("LMRR_CUDA_LB_MULTI", "12"),
            ("LMRR_CUDA_PF_LONGEST_FIRST", "0"),
            ("LMRR_CUDA_ROWS_NORM_MAX", "3"),
            ("LMRR_CUDA_ROPE_QS", "0"),
            ("LMRR_CUDA_MULTI4", "1"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            t,
            Tuning {
                fused_max: MM_TOKENS,
                swiglu_max: 4,
                gemm_min: 9,
                gemm_wide_min: 128,
                split_blocks: 0,
                gemm_pipelined: true,
                attn_decode_max: 0,
                down_swiglu: true,
                pdl: false,
                pdl_prefetch: false,
                attn_prefetch: true,
                attn_prefill: false,
                attn_prefill_group: PF_TQ,
                attn_prefill_hd64: false,
                rope_attn: false,
                gemm_multi: false,
                fold_sums: false,
                kv_overlap_min: 256,
                kv_early_min: 16,
                chunk_max: 8,
                chunk_threads: MC_MAX_THREADS,
                attn_decode_hd64: true,
                gate_up_swiglu: true,
                head_direct: false,
                swiglu4: true,
                loads_first_min: 1,
                rows4_min: 1000,
                rows4_tokens: 1,
                rows4_max: 50_000,
                rope_qs: false,
                multi4: true,
                lb_attn_decode: 4,
                lb_attn_prefill: 3,
                lb_rows4: 16,
                lb_multi: 12,
                attn_early: false,
                pf_longest_first: false,
                rows_norm_max: 3,
            }
        );
        assert_eq!(with(&[]).ok(), Some(Tuning::default()));
    }

    #[test]
    fn longest_first_orders_groups_by_their_last_position() {
        // Two spans: 20 tokens at positions 0.. and 20 at 100.. (a chunk
        // after a cached prefix), in groups of 8.
        let pos: Vec<u64> = (0..20).chain(100..120).collect();
        let mut g = prefill_groups([20usize, 20].into_iter(), 8).expect("groups");
        let parts = |v: &[u64]| -> Vec<(u64, u64)> {
            v.iter().map(|x| (x >> 32, x & 0xffff_ffff)).collect()
        };
        longest_first(&mut g, &pos);
        assert_eq!(
            parts(&g),
            vec![(36, 4), (28, 8), (20, 8), (16, 4), (8, 8), (0, 8)]
        );
        // Equal last positions keep their order; a group past `pos` sorts last.
        let mut h = vec![1u64 << 32 | 1, 2u64 << 32 | 1, 9u64 << 32 | 1, 1];
        longest_first(&mut h, &[5, 7, 7]);
        assert_eq!(parts(&h), vec![(1, 1), (2, 1), (0, 1), (9, 1)]);
    }

    #[test]
    fn prefill_groups_cut_spans_and_skip_short_ones() {
        let g = |lens: &[usize], group| prefill_groups(lens.iter().copied(), group);
        let parts = |v: Vec<u64>| -> Vec<(u64, u64)> {
            v.iter().map(|x| (x >> 32, x & 0xffff_ffff)).collect()
        };
        assert_eq!(
            g(&[40, 1, 16], 16).map(parts),
            Some(vec![(0, 16), (16, 16), (32, 8), (40, 1), (41, 16)])
        );
        assert_eq!(g(&[20], 8).map(parts), Some(vec![(0, 8), (8, 8), (16, 4)]));
        // Above PF_TQ, the kernel's limit.
        assert_eq!(g(&[17], 64).map(parts), Some(vec![(0, 16), (16, 1)]));
        // Decode steps and mostly-short steps: no groups.
        assert_eq!(g(&[1; 64], 16), None);
        assert_eq!(g(&[3, 3, 3, 20], 16), None);
        assert_eq!(g(&[], 16), None);
    }

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
            ("MC_MAX_THREADS", MC_MAX_THREADS),
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

    #[test]
    fn a_bad_value_is_an_error_naming_the_variable() {
        for (var, v) in [
            ("LMRR_CUDA_GEMM_MIN", "lots"),
            ("LMRR_CUDA_SPLIT_BLOCKS", "-1"),
            ("LMRR_CUDA_GEMM_PIPELINED", "yes"),
            ("LMRR_CUDA_DOWN_SWIGLU", "2"),
            ("LMRR_CUDA_LOADS_FIRST_MIN", "some"),
            ("LMRR_CUDA_ROWS4_MIN", "4.5"),
        ] {
            match with(&[(var, v)]) {
                Err(GpuError::Config(m)) => assert!(m.contains(var) && m.contains(v), "{m}"),
                other => panic!("{var}={v}: {other:?}"),
            }
        }
        // The variable of 2026-12-05e, a module-wide switch, now says what
        // replaced it rather than being ignored.
        match with(&[("LMRR_CUDA_LOADS_FIRST", "1")]) {
            Err(GpuError::Config(m)) => {
                assert!(m.contains("LMRR_CUDA_LOADS_FIRST_MIN"), "{m}")
            }
            other => panic!("LMRR_CUDA_LOADS_FIRST=1: {other:?}"),
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
    matmul_rows_swiglu: Func,
    gate_up_swiglu: Func,
    matmul_multi: Func,
    matmul_multi4: Func,
    matmul_chunk: Func,
    rope_kv: Func,
    rms_norm_warp: Func,
    add_norm: Func,
    pub(crate) matmul_gemm: Func,
    matmul_gemm_wide: Func,
    matmul_gemm_pipelined: Func,
    pub(crate) matmul_gemm_multi: Func,
    norm_block: Func,
    norm_reg: Func,
    norm_reg_lf: Func,
    matmul_rows_norm: Func,
    /// `matmul_rows_norm`'s count of finished blocks: 0 between launches
    /// (the last block's `atomicInc` wraps it back).
    rows_norm_counter: DevBuf,
    matmul_fused: Func,
    pub(crate) sum_chunks: Func,
    /// Which kernel each step and matmul takes ([`Tuning`]).
    pub(crate) tuning: Tuning,
    embed_rows: Func,
    pub(crate) add_rows: Func,
    gather_rows: Func,
    attention_paged: Func,
    attention_decode: Func,
    attention_decode_rope: Func,
    attention_decode_rope_qs: Func,
    attention_decode_hd64: Func,
    attention_decode_rope_hd64: Func,
    attention_prefill: Func,
    attention_prefill_hd64: Func,
    swiglu: Func,
    swiglu4: Func,
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
        // SAFETY: a 4-byte allocation in the bound context, zeroed before
        // any launch can read it.
        let counter = unsafe { result::malloc_sync(4) }.map_err(drv)?;
        let rows_norm_counter = DevBuf {
            ptr: counter,
            bytes: 4,
            ctx: ctx.clone(),
        };
        // SAFETY: the 4 bytes just allocated.
        unsafe { result::memset_d8_sync(counter, 0, 4) }.map_err(drv)?;
        Ok(Self {
            matmul_tile: f("matmul_tile")?,
            matmul_rows: f("matmul_rows")?,
            matmul_rows4: f("matmul_rows4")?,
            matmul_rows_swiglu: f("matmul_rows_swiglu")?,
            gate_up_swiglu: f("gate_up_swiglu")?,
            matmul_multi: f("matmul_multi")?,
            matmul_multi4: f("matmul_multi4")?,
            matmul_chunk: f("matmul_chunk")?,
            rope_kv: f("rope_kv")?,
            rms_norm_warp: f("rms_norm_warp")?,
            add_norm: f("add_norm")?,
            matmul_gemm: f("matmul_gemm")?,
            matmul_gemm_wide: f("matmul_gemm_wide")?,
            matmul_gemm_pipelined: f("matmul_gemm_pipelined")?,
            matmul_gemm_multi: f("matmul_gemm_multi")?,
            norm_block: f("norm_block")?,
            norm_reg: f("norm_reg")?,
            norm_reg_lf: f("norm_reg_lf")?,
            matmul_rows_norm: f("matmul_rows_norm")?,
            rows_norm_counter,
            matmul_fused: f("matmul_fused")?,
            sum_chunks: f("sum_chunks")?,
            tuning,
            embed_rows: f("embed_rows")?,
            add_rows: f("add_rows")?,
            gather_rows: f("gather_rows")?,
            attention_paged: f("attention_paged")?,
            attention_decode: f("attention_decode")?,
            attention_decode_rope: f("attention_decode_rope")?,
            attention_decode_rope_qs: f("attention_decode_rope_qs")?,
            attention_decode_hd64: f("attention_decode_hd64")?,
            attention_decode_rope_hd64: f("attention_decode_rope_hd64")?,
            attention_prefill: f("attention_prefill")?,
            attention_prefill_hd64: f("attention_prefill_hd64")?,
            swiglu: f("swiglu")?,
            swiglu4: f("swiglu4")?,
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

    /// One storage, shape and row stride with `other` (two matrices one
    /// kernel reads by the same offsets, as `gate_up_swiglu` does).
    fn same_layout(&self, other: &DevMatrix) -> bool {
        (self.kind, self.rows, self.cols, self.row_bytes)
            == (other.kind, other.rows, other.cols, other.row_bytes)
    }
}

/// Whether `swiglu4` can serve `n` floats at `g`, `u`, `out`: a multiple of
/// 4 at 16-byte aligned addresses.
fn swiglu4_fits(g: u64, u: u64, out: u64, n: usize) -> bool {
    n % 4 == 0 && [g, u, out].iter().all(|p| p % 16 == 0)
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

/// Which `matmul_gemm` kernel: its tiles, and whether staging is pipelined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTiles {
    /// `matmul_gemm`: 32 rows × 16 tokens, 64 threads.
    Narrow,
    /// `matmul_gemm_wide`: 64 rows × 32 tokens, 256 threads.
    Wide,
    /// `matmul_gemm_pipelined`: the wide tiles, staging pipelined.
    Pipelined,
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
    /// `attention_decode_hd64`: `attention_decode`'s blocks for head_dim 64,
    /// a thread per position, the tile maxima by warp shuffles, fewer
    /// barriers (the same values; [`hd64_fits`]).
    DecodeHd64,
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

/// What [`Gpu::mm_fused`] does with each output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    /// `y = x·Wᵀ`.
    Store,
    /// `y = y + x·Wᵀ` (one matrix: the residual add).
    Accumulate,
    /// `y0 = silu(x·W0ᵀ) · (x·W1ᵀ)` (two matrices of the same rows).
    Swiglu,
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
            Weights::Quant(q, s) => (
                match q {
                    QuantKind::Q4_0 => 2,
                    QuantKind::Q4_1 => 3,
                    QuantKind::Q8_0 => 4,
                },
                self.upload(s, what)?,
            ),
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
            let kind = match (n >= tun.gemm_wide_min.max(1), tun.gemm_pipelined) {
                (false, _) => GemmTiles::Narrow,
                (true, false) => GemmTiles::Wide,
                (true, true) => GemmTiles::Pipelined,
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
        if self.chunk_serves(n, &[(w, y)]) {
            return self.chunk_launch(x, n, None, Fused::Store, &[(w, y)]);
        }
        let chunks = w.cols.div_ceil(64);
        if tun.rows4_min > 0
            && w.rows >= tun.rows4_min
            && (tun.rows4_max == 0 || w.rows <= tun.rows4_max)
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

    /// Whether [`Gpu::mm_rows_norm`] serves `w` in a step of `n` tokens
    /// with a norm of width `d`: the tuning asks for it
    /// ([`Tuning::rows_norm_max`], in steps below [`Tuning::gemm_min`]),
    /// the rows fit `matmul_rows` (at most `MR_MAX_CHUNKS` chunks), and the
    /// norm's row is `w`'s output row and fits one block of `MR_THREADS`
    /// threads (a group of 8 a chunk).
    pub fn rows_norm_serves(&self, n: usize, w: &DevMatrix, d: usize) -> bool {
        let tun = self.res.tuning;
        n > 0
            && n <= tun.rows_norm_max
            && n < tun.gemm_min.max(1)
            && w.rows == d
            && w.cols.div_ceil(64) <= MR_MAX_CHUNKS
            && d.div_ceil(64) * 8 <= MR_THREADS as usize
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ`, then `resid += y` and
    /// `hout = rms_norm(resid) · nw` (rows of `rows`), one
    /// `matmul_rows_norm` launch: the bits of [`Gpu::mm`] then
    /// [`Gpu::add_norm`]. Only where [`Gpu::rows_norm_serves`].
    #[allow(clippy::too_many_arguments)]
    pub fn mm_rows_norm(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        resid: u64,
        nw: &DevBuf,
        eps: f32,
        hout: u64,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let dims = mm_dims(n, w)?;
        if w.cols.div_ceil(64) > MR_MAX_CHUNKS
            || w.rows.div_ceil(64) * 8 > MR_THREADS as usize
            || nw.bytes < 4 * w.rows
        {
            return Err(GpuError::Shape {
                what: "matmul_rows_norm",
                detail: format!(
                    "{n} tokens, {} rows (≤ {} for the norm's block) of {} cols (≤ {} chunks), \
                     norm weight of {} bytes",
                    w.rows,
                    64 * MR_THREADS as usize / 8,
                    w.cols,
                    MR_MAX_CHUNKS,
                    nw.bytes
                ),
            });
        }
        let cfg = row_blocks(w.rows * n.div_ceil(MM_TOKENS))?;
        let counter = self.res.rows_norm_counter.ptr;
        let mut b = self.kernel(&self.res.matmul_rows_norm)?;
        b.matmul_args(w, &x, &y, &dims)
            .arg(&resid)
            .arg(&nw.ptr)
            .arg(&hout)
            .arg(&eps)
            .arg(&counter);
        // SAFETY: matches `matmul_rows_norm`; x holds n·cols floats, y,
        // resid and hout n·rows, nw rows (checked); the rows fit matmul_rows'
        // partials and the norm's groups fit the block (checked); the
        // counter is 0 between launches, and launches on this stream are
        // ordered (each waits for the one ahead before its count).
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
            GemmTiles::Pipelined => &self.res.matmul_gemm_pipelined,
        };
        let mut b = self.kernel(f)?;
        b.matmul_args(w, &x, &y, &dims).arg(&part).arg(&cpbi);
        // SAFETY: matches `matmul_gemm`; x holds n·cols, y n·rows floats,
        // part (when non-null) chunks·n·rows; the grid is tiles · groups.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// Whether [`Gpu::chunk_launch`] serves `mats` in a step of `n` tokens
    /// ([`Tuning::chunk_max`]): one to three matrices of one storage and
    /// width, rows of at most [`MC_MAX_THREADS`] chunks.
    fn chunk_serves(&self, n: usize, mats: &[(&DevMatrix, u64)]) -> bool {
        let tun = self.res.tuning;
        n > 0
            && n <= tun.chunk_max
            && n < tun.gemm_min.max(1)
            && (1..=3).contains(&mats.len())
            && mats
                .iter()
                .all(|(w, _)| w.kind == mats[0].0.kind && w.cols == mats[0].0.cols && w.rows > 0)
            && mats[0].0.cols.div_ceil(64) <= MC_MAX_THREADS
    }

    /// `y = x (n, cols) · Wᵀ` for each `(W, y)` of `mats` (one to three, one
    /// storage and width, rows of at most [`MC_MAX_THREADS`] chunks) by one
    /// `matmul_chunk` launch: a thread per (row, chunk), blocks of whole
    /// rows near [`Tuning::chunk_threads`] threads; the bits of
    /// [`Gpu::mm`]. Vector loads where x, the rows and the widths allow.
    /// With `norm` and `mode`, [`Gpu::mm_fused`]'s forms (the same bits).
    pub(crate) fn chunk_launch(
        &self,
        x: u64,
        n: usize,
        norm: Option<(&DevBuf, f32)>,
        mode: Fused,
        mats: &[(&DevMatrix, u64)],
    ) -> Result<(), GpuError> {
        let Some(((w0, _), rest)) = mats.split_first() else {
            return Ok(());
        };
        let cols = w0.cols;
        let chunks = cols.div_ceil(64);
        if n == 0 || chunks == 0 {
            return Ok(());
        }
        let pairs = mode == Fused::Swiglu;
        if mats.len() > 3
            || chunks > MC_MAX_THREADS / if pairs { 2 } else { 1 }
            || rest
                .iter()
                .any(|(w, _)| w.kind != w0.kind || w.cols != cols)
            || (pairs && (mats.len() != 2 || mats[1].0.rows != w0.rows))
            || (mode == Fused::Accumulate && mats.len() != 1)
        {
            return Err(GpuError::Shape {
                what: "matmul_chunk",
                detail: format!(
                    "{mode:?}: {} matrices of {:?} rows × {cols} (at most 3, one storage and width; at most {} columns, {} for SwiGLU pairs)",
                    mats.len(),
                    mats.iter().map(|m| m.0.rows).collect::<Vec<_>>(),
                    64 * MC_MAX_THREADS,
                    32 * MC_MAX_THREADS
                ),
            });
        }
        // Rows a block: whole rows near the target; SwiGLU pairs an even count.
        let rpb = if pairs {
            ((self.res.tuning.chunk_threads / chunks) & !1).max(2)
        } else {
            (self.res.tuning.chunk_threads / chunks).max(1)
        };
        let threads = (rpb * chunks).div_ceil(32) * 32;
        let total: usize = mats.iter().map(|(w, _)| w.rows).sum();
        let units = if pairs {
            w0.rows.div_ceil(rpb / 2)
        } else {
            total.div_ceil(rpb)
        };
        let blocks = units * n.div_ceil(MM_TOKENS);
        let vec = cols % 4 == 0
            && x % 16 == 0
            && mats
                .iter()
                .all(|(w, _)| w.row_bytes % 16 == 0 && w.buf.ptr % 16 == 0);
        let (ni, ki) = (as_i32("matmul", n)?, as_i32("matmul", cols)?);
        as_i32("matmul", n * cols)?;
        as_i32("matmul", total)?;
        let cfg = LaunchConfig {
            grid_dim: (as_i32("matmul", blocks)? as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let [m0, m1, m2] = mat_slots(mats)?;
        let (veci, rpbi) = (i32::from(vec), as_i32("matmul", rpb)?);
        let (nw, eps) = norm.map_or((0u64, 0.0f32), |(w, e)| (w.ptr, e));
        let mode_i: i32 = match mode {
            Fused::Store => 0,
            Fused::Accumulate => 1,
            Fused::Swiglu => 2,
        };
        let mut b = self.kernel(&self.res.matmul_chunk)?;
        b.arg(&w0.kind)
            .arg(&veci)
            .arg(&x)
            .arg(&ni)
            .arg(&ki)
            .arg(&rpbi)
            .arg(&nw)
            .arg(&eps)
            .arg(&mode_i);
        for m in [&m0, &m1, &m2] {
            b.arg(&m.0).arg(&m.1).arg(&m.2).arg(&m.3);
        }
        // SAFETY: matches `matmul_chunk`; x holds n·cols floats, each y
        // n·rows (y0 n·rows0 in the SwiGLU form), nw (when set) cols; absent
        // matrices have 0 rows and no thread reads them; the block's rows of
        // chunks fit MC_MAX_THREADS (checked above); vector loads only where
        // every address they form is 16-byte aligned.
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
        if self.chunk_serves(n, mats) {
            return self.chunk_launch(x, n, None, Fused::Store, mats);
        }
        if !shared || n == 0 || n >= self.res.tuning.gemm_min.max(1) || mats.len() < 2 {
            for (w, y) in mats {
                self.mm_split(x, n, w, *y, scratch)?;
            }
            return Ok(());
        }
        // Four rows a block where the tuning asks and the rows fit it.
        let four = self.res.tuning.multi4 && mats[0].0.cols.div_ceil(64) <= MR4_MAX_CHUNKS;
        self.multi_rows_launch(x, n, mats, four)
    }

    /// One `matmul_multi` launch (`four`: `matmul_multi4`) over up to three
    /// matrices of one storage and width, each of at most `MR_MAX_CHUNKS`
    /// chunks a row (`MR4_MAX_CHUNKS` with `four`).
    pub(crate) fn multi_rows_launch(
        &self,
        x: u64,
        n: usize,
        mats: &[(&DevMatrix, u64)],
        four: bool,
    ) -> Result<(), GpuError> {
        let Some((w0, _)) = mats.first() else {
            return Ok(());
        };
        let most = if four { MR4_MAX_CHUNKS } else { MR_MAX_CHUNKS };
        let what = if four {
            "matmul_multi4"
        } else {
            "matmul_multi"
        };
        width_fits(what, w0.cols, most)?;
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
        let per = if four { MR4_ROWS } else { 1 };
        let blocks: usize = mats.iter().map(|(w, _)| w.rows.div_ceil(per) * tiles).sum();
        let (ni, ki) = (as_i32("matmul", n)?, as_i32("matmul", mats[0].0.cols)?);
        as_i32("matmul", n * mats[0].0.cols)?;
        let cfg = row_blocks(blocks)?;
        let [m0, m1, m2] = mat_slots(mats)?;
        let f = if four {
            &self.res.matmul_multi4
        } else {
            &self.res.matmul_multi
        };
        let mut b = self.kernel(f)?;
        b.arg(&mats[0].0.kind).arg(&x).arg(&ni).arg(&ki);
        for m in [&m0, &m1, &m2] {
            b.arg(&m.0).arg(&m.1).arg(&m.2).arg(&m.3);
        }
        // SAFETY: matches `matmul_multi` / `matmul_multi4` (the same
        // arguments); x holds n·cols floats, each y n·rows; an absent third
        // matrix has 0 rows and gets no block; matmul_multi4 only for rows
        // of at most MR4_MAX_CHUNKS chunks, and it reads no row at or past
        // a matrix's `rows`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `y (n, rows) = SwiGLU(g, u) · Wᵀ` by `matmul_rows_swiglu` (g and u
    /// `(n, cols)`): matmul_rows' bits on the swiglu kernel's values, one
    /// launch. `cols` at most `64 · MR_MAX_CHUNKS`.
    pub fn mm_rows_swiglu(
        &self,
        g: u64,
        u: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
    ) -> Result<(), GpuError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        width_fits("matmul_rows_swiglu", w.cols, MR_MAX_CHUNKS)?;
        let (ni, ri, ki) = mm_dims(n, w)?;
        let cfg = row_blocks(w.rows * n.div_ceil(MM_TOKENS))?;
        let mut b = self.kernel(&self.res.matmul_rows_swiglu)?;
        b.arg(&w.kind)
            .arg(&g)
            .arg(&u)
            .arg(&w.buf.ptr)
            .arg(&y)
            .arg(&ni)
            .arg(&ri)
            .arg(&ki)
            .arg(&w.row_bytes);
        // SAFETY: matches `matmul_rows_swiglu`; g and u hold n·cols floats,
        // y n·rows; cols within the partials matmul_rows holds.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `y (n, rows) = SwiGLU(x · Gᵀ, x · Uᵀ)` by `gate_up_swiglu`: gate and
    /// up (one storage and shape, `cols` at most `64 · MR_MAX_CHUNKS`) row
    /// by row in one block, each output the swiglu kernel's value of
    /// [`Gpu::mm`]'s two (the same bits), one launch and no `(n, rows)`
    /// gate/up outputs. For steps below [`Tuning::gemm_min`] tokens.
    pub fn gate_up_swiglu(
        &self,
        x: u64,
        n: usize,
        gate: &DevMatrix,
        up: &DevMatrix,
        y: u64,
    ) -> Result<(), GpuError> {
        if !gate.same_layout(up) {
            return Err(GpuError::Shape {
                what: "gate_up_swiglu",
                detail: format!(
                    "gate {}×{} (storage {}), up {}×{} (storage {}): one shape and storage wanted",
                    gate.rows, gate.cols, gate.kind, up.rows, up.cols, up.kind
                ),
            });
        }
        if n == 0 || gate.rows == 0 {
            return Ok(());
        }
        width_fits("gate_up_swiglu", gate.cols, MR_MAX_CHUNKS)?;
        let (ni, ri, ki) = mm_dims(n, gate)?;
        let mut cfg = row_blocks(gate.rows * n.div_ceil(MM_TOKENS))?;
        cfg.block_dim.0 = 2 * MR_THREADS;
        let mut b = self.kernel(&self.res.gate_up_swiglu)?;
        b.arg(&gate.kind)
            .arg(&x)
            .arg(&gate.buf.ptr)
            .arg(&up.buf.ptr)
            .arg(&y)
            .arg(&ni)
            .arg(&ri)
            .arg(&ki)
            .arg(&gate.row_bytes);
        // SAFETY: matches `gate_up_swiglu`; x holds n·cols floats, y
        // n·rows; gate and up share rows, cols and row bytes (checked
        // above), cols within the partials the kernel holds.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// Whether a step of `n` tokens takes [`Gpu::gate_up_swiglu`] for this
    /// gate and up ([`Tuning::gate_up_swiglu`], below
    /// [`Tuning::gemm_min`] tokens, one storage and shape, rows the
    /// kernel's partials hold).
    pub fn gate_up_swiglu_serves(&self, n: usize, gate: &DevMatrix, up: &DevMatrix) -> bool {
        let t = self.res.tuning;
        t.gate_up_swiglu
            && n > 0
            && n < t.gemm_min.max(1)
            && gate.same_layout(up)
            && gate.cols.div_ceil(64) <= MR_MAX_CHUNKS
    }

    /// [`Gpu::gate_up_swiglu`] on host operands (for `gpu_check`).
    pub fn gate_up_swiglu_resident(
        &self,
        x: &[f32],
        n: usize,
        gate: &Matrix,
        up: &Matrix,
    ) -> Result<Vec<f32>, GpuError> {
        if x.len() != n * gate.cols {
            return Err(GpuError::Shape {
                what: "gate_up_swiglu",
                detail: format!("x {}, n {n} × cols {}", x.len(), gate.cols),
            });
        }
        let dx = self.upload(x, "x")?;
        let (dg, du) = (
            self.upload_matrix(gate, "gate")?,
            self.upload_matrix(up, "up")?,
        );
        let dy = self.alloc(n * gate.rows * 4, "y")?;
        self.gate_up_swiglu(dx.ptr, n, &dg, &du, dy.ptr)?;
        let mut y = vec![0.0; n * gate.rows];
        self.dtoh(dy.ptr, &mut y)?;
        Ok(y)
    }

    /// [`Gpu::mm_rows_swiglu`] on host operands (for `gpu_check`).
    pub fn rows_swiglu_resident(
        &self,
        g: &[f32],
        u: &[f32],
        n: usize,
        w: &Matrix,
    ) -> Result<Vec<f32>, GpuError> {
        if g.len() != n * w.cols || u.len() != g.len() {
            return Err(GpuError::Shape {
                what: "matmul_rows_swiglu",
                detail: format!("g {}, u {}, n {n} × cols {}", g.len(), u.len(), w.cols),
            });
        }
        let (dg, du) = (self.upload(g, "g")?, self.upload(u, "u")?);
        let dw = self.upload_matrix(w, "w")?;
        let dy = self.alloc(n * w.rows * 4, "y")?;
        self.mm_rows_swiglu(dg.ptr, du.ptr, n, &dw, dy.ptr)?;
        let mut y = vec![0.0; n * w.rows];
        self.dtoh(dy.ptr, &mut y)?;
        Ok(y)
    }

    /// [`Gpu::mm_rows_norm`] on host operands (gpu_check): `x (n, cols)`,
    /// `w`, the residual `resid (n, rows)` and the norm weight `nw (rows)`;
    /// returns `(y, resid + y, rms_norm(resid + y) · nw)`. Launched
    /// `launches` times on the same buffers and counter from the same
    /// inputs (the residual uploaded again before each), so that a counter
    /// not back at 0 after a launch shows in the next one's outputs.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub fn rows_norm_resident(
        &self,
        x: &[f32],
        n: usize,
        w: &Matrix,
        resid: &[f32],
        nw: &[f32],
        eps: f32,
        launches: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>), GpuError> {
        if x.len() != n * w.cols || resid.len() != n * w.rows || nw.len() != w.rows {
            return Err(GpuError::Shape {
                what: "matmul_rows_norm",
                detail: format!(
                    "x {}, resid {}, nw {} for n {n} × ({} rows, {} cols)",
                    x.len(),
                    resid.len(),
                    nw.len(),
                    w.rows,
                    w.cols
                ),
            });
        }
        let dx = self.upload(x, "x")?;
        let dw = self.upload_matrix(w, "w")?;
        let dnw = self.upload(nw, "norm weight")?;
        let dr = self.alloc(n * w.rows * 4, "residual")?;
        let dy = self.alloc(n * w.rows * 4, "y")?;
        let dh = self.alloc(n * w.rows * 4, "norm out")?;
        for _ in 0..launches.max(1) {
            self.htod(resid, dr.ptr)?;
            self.mm_rows_norm(dx.ptr, n, &dw, dy.ptr, dr.ptr, &dnw, eps, dh.ptr)?;
        }
        let mut out = (
            vec![0.0; n * w.rows],
            vec![0.0; n * w.rows],
            vec![0.0; n * w.rows],
        );
        self.dtoh(dy.ptr, &mut out.0)?;
        self.dtoh(dr.ptr, &mut out.1)?;
        self.dtoh(dh.ptr, &mut out.2)?;
        Ok(out)
    }

    /// How this device's resident path chooses its kernels.
    pub fn tuning(&self) -> Tuning {
        self.res.tuning
    }

    /// `matmul_fused`: up to three matmuls of `x (n, cols)` in one launch,
    /// the input first normalized in the kernel when `norm` is given, and
    /// the outputs stored, accumulated into `y` (the residual), or joined by
    /// SwiGLU ([`Fused`]). Each output is the value the separate kernels
    /// give; `cols` at most `64 · MR_MAX_CHUNKS`, one storage for all.
    pub fn mm_fused(
        &self,
        x: u64,
        n: usize,
        norm: Option<(&DevBuf, f32)>,
        mode: Fused,
        mats: &[(&DevMatrix, u64)],
    ) -> Result<(), GpuError> {
        if n == 0 || mats.is_empty() {
            return Ok(());
        }
        let cols = mats[0].0.cols;
        let bad = mats.len() > 3
            || mats
                .iter()
                .any(|(w, _)| w.kind != mats[0].0.kind || w.cols != cols || w.rows == 0)
            || cols.div_ceil(64) > MR_MAX_CHUNKS
            || match mode {
                Fused::Swiglu => mats.len() != 2 || mats[0].0.rows != mats[1].0.rows,
                Fused::Accumulate => mats.len() != 1,
                Fused::Store => false,
            };
        if bad {
            return Err(GpuError::Shape {
                what: "matmul_fused",
                detail: format!(
                    "{:?}: {} matrices of {:?} rows × {cols} (one storage, at most 3, at most {} columns)",
                    mode,
                    mats.len(),
                    mats.iter().map(|m| m.0.rows).collect::<Vec<_>>(),
                    64 * MR_MAX_CHUNKS
                ),
            });
        }
        let halve = if mode == Fused::Swiglu { 2 } else { 1 };
        if self.chunk_serves(n, mats) && cols.div_ceil(64) <= MC_MAX_THREADS / halve {
            return self.chunk_launch(x, n, norm, mode, mats);
        }
        let tiles = n.div_ceil(MM_TOKENS);
        let rows_launched: usize = match mode {
            Fused::Swiglu => mats[0].0.rows,
            _ => mats.iter().map(|(w, _)| w.rows).sum(),
        };
        let cfg = row_blocks(rows_launched * tiles)?;
        let (ni, ki) = (as_i32("matmul", n)?, as_i32("matmul", cols)?);
        as_i32("matmul", n * cols)?;
        let [m0, m1, m2] = mat_slots(mats)?;
        let (nw, eps) = norm.map_or((0u64, 0.0f32), |(w, e)| (w.ptr, e));
        let mode_i: i32 = match mode {
            Fused::Store => 0,
            Fused::Accumulate => 1,
            Fused::Swiglu => 2,
        };
        let mut b = self.kernel(&self.res.matmul_fused)?;
        b.arg(&mats[0].0.kind)
            .arg(&x)
            .arg(&ni)
            .arg(&ki)
            .arg(&nw)
            .arg(&eps)
            .arg(&mode_i);
        for m in [&m0, &m1, &m2] {
            b.arg(&m.0).arg(&m.1).arg(&m.2).arg(&m.3);
        }
        // SAFETY: matches `matmul_fused`; x holds n·cols floats, each y
        // n·rows (the norm weight cols); in SwiGLU mode both matrices have
        // the rows launched; absent matrices have 0 rows and get no block.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
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
        if self.res.tuning.swiglu4 && swiglu4_fits(g, u, out, n) {
            return self.swiglu4_dev(g, u, out, n);
        }
        let mut b = self.kernel(&self.res.swiglu)?;
        b.arg(&g).arg(&u).arg(&out).arg(&ni);
        // SAFETY: matches `swiglu`; all hold n floats.
        unsafe { b.launch(elems(n, "swiglu")?) }
            .map(|_| ())
            .map_err(drv)
    }

    /// [`Gpu::swiglu_dev`] by `swiglu4`, four elements a thread whatever
    /// [`Tuning::swiglu4`] says (the same bits); `n` a multiple of 4 and
    /// every address 16-byte aligned, else an error.
    pub fn swiglu4_dev(&self, g: u64, u: u64, out: u64, n: usize) -> Result<(), GpuError> {
        if !swiglu4_fits(g, u, out, n) {
            return Err(GpuError::Shape {
                what: "swiglu4",
                detail: format!(
                    "{n} floats at {g:#x}, {u:#x}, {out:#x}: a multiple of 4 at 16-byte aligned addresses wanted"
                ),
            });
        }
        if n == 0 {
            return Ok(());
        }
        let n4 = as_i32("swiglu", n)? / 4;
        let mut b = self.kernel(&self.res.swiglu4)?;
        b.arg(&g).arg(&u).arg(&out).arg(&n4);
        // SAFETY: matches `swiglu4`; all hold n floats, n a multiple of 4,
        // every address 16-byte aligned (checked above).
        unsafe { b.launch(elems(n / 4, "swiglu")?) }
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
    /// `attention_prefill` where the table lists groups (and
    /// [`Tuning::attn_prefill`]), `attention_decode` for steps of at most
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
        let kernel = if table.n_groups > 0 && tun.attn_prefill && shape.head_dim <= PF_MAXHD {
            if tun.attn_prefill_hd64 && hd64_fits(shape, &layout) {
                AttnKernel::PrefillHd64
            } else {
                AttnKernel::Prefill
            }
        } else if n * shape.n_heads <= tun.attn_decode_max {
            if tun.attn_decode_hd64 && hd64_fits(shape, &layout) {
                AttnKernel::DecodeHd64
            } else {
                AttnKernel::Decode
            }
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
        let hd64 = matches!(kernel, AttnKernel::PrefillHd64 | AttnKernel::DecodeHd64);
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
            AttnKernel::DecodeHd64 => &self.res.attention_decode_hd64,
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

/// Which kernel runs [`Gpu::attention_decode_rope`]: every one the same
/// bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeRopeKernel {
    /// `attention_decode_rope`: the prologue rotates q in global memory and
    /// the attention body loads it back.
    Rope,
    /// `attention_decode_rope_qs`: the rotated q head handed to the body in
    /// shared memory ([`Tuning::rope_qs`]).
    RopeQs,
    /// `attention_decode_rope_hd64` (head_dim 64, [`hd64_fits`];
    /// [`Tuning::attn_decode_hd64`]).
    Hd64,
}

impl Gpu {
    /// The [`DecodeRopeKernel`] the tuning picks for this shape.
    pub fn decode_rope_kernel(
        &self,
        shape: &crate::AttnShape,
        layout: &PageLayout,
    ) -> DecodeRopeKernel {
        let t = &self.res.tuning;
        if t.attn_decode_hd64 && hd64_fits(shape, layout) {
            DecodeRopeKernel::Hd64
        } else if t.rope_qs {
            DecodeRopeKernel::RopeQs
        } else {
            DecodeRopeKernel::Rope
        }
    }

    /// `rope_kv` then `attention_decode` in one launch
    /// (`attention_decode_rope`, the same bits): RoPE of `q` (n · qd, in
    /// place) and of the unrotated K rows `kraw` (n · kvd) into `kout` and,
    /// with the V rows `v`, into each token's page slot `dst`/`slot`; then
    /// attention into `out`. Only for a step whose tokens are one per
    /// sequence and whose pages are in no other token's page list (no
    /// block reads a row another block writes), with head_dim even and at
    /// most 256: the caller checks the first two, this the shapes.
    /// `kernel` is [`Gpu::decode_rope_kernel`]'s choice in the resident
    /// path (gpu_check runs each); [`DecodeRopeKernel::Hd64`] only where
    /// [`hd64_fits`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode_rope(
        &self,
        kernel: DecodeRopeKernel,
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
        let f = match kernel {
            DecodeRopeKernel::Hd64 if hd64_fits(shape, &layout) => {
                &self.res.attention_decode_rope_hd64
            }
            DecodeRopeKernel::Hd64 => {
                return Err(GpuError::Shape {
                    what: "attention_decode_rope_hd64",
                    detail: format!(
                        "head_dim {} (64), kv_dim {} and page_len·aux_dim {} (multiples of 4)",
                        shape.head_dim,
                        layout.kv_dim,
                        layout.page_len * layout.aux_dim
                    ),
                })
            }
            DecodeRopeKernel::RopeQs => &self.res.attention_decode_rope_qs,
            DecodeRopeKernel::Rope => &self.res.attention_decode_rope,
        };
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
    /// `kernel`'s form of `attention_decode_rope`; returns each path's
    /// attention output, rotated q, rotated K rows and pages.
    pub fn run(&self, gpu: &Gpu, kernel: DecodeRopeKernel) -> Result<[[Vec<f32>; 4]; 2], GpuError> {
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
                    kernel,
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
            K::GemmPipelined | K::GemmPipelinedSplit(_) => GemmTiles::Pipelined,
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
        if kernel == K::Chunk {
            self.sync()?;
            let t0 = std::time::Instant::now();
            for _ in 0..reps.max(1) {
                self.chunk_launch(dx.ptr, n, None, Fused::Store, &[(&dw, dy.ptr)])?;
            }
            self.sync()?;
            let secs = t0.elapsed().as_secs_f64();
            self.dtoh(dy.ptr, y)?;
            return Ok(secs);
        }
        let split = match kernel {
            K::GemmSplit(cpb) | K::GemmWideSplit(cpb) | K::GemmPipelinedSplit(cpb) => {
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

    /// [`Gpu::mm_fused`] on host operands: `x (n, cols)`, the norm weight
    /// when given, the matrices, and (for [`Fused::Accumulate`]) the
    /// starting `y`; returns each matrix's output (SwiGLU: the one result).
    /// `chunk`: by `matmul_chunk`'s forms rather than `matmul_fused`.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_resident(
        &self,
        x: &[f32],
        n: usize,
        norm: Option<(&[f32], f32)>,
        mode: Fused,
        mats: &[&Matrix],
        y_start: &[f32],
        chunk: bool,
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let dx = self.upload(x, "x")?;
        let dn = match norm {
            Some((w, _)) => Some(self.upload(w, "norm")?),
            None => None,
        };
        let dm: Vec<DevMatrix> = mats
            .iter()
            .map(|m| self.upload_matrix(m, "w"))
            .collect::<Result<_, _>>()?;
        let outs: Vec<DevBuf> = mats
            .iter()
            .map(|m| self.alloc(n * m.rows * 4, "y"))
            .collect::<Result<_, _>>()?;
        if mode == Fused::Accumulate {
            if let Some(o) = outs.first() {
                if y_start.len() != n * mats[0].rows {
                    return Err(GpuError::Shape {
                        what: "matmul_fused",
                        detail: format!("y {} for {n} × {}", y_start.len(), mats[0].rows),
                    });
                }
                self.htod(y_start, o.ptr)?;
            }
        }
        let pairs: Vec<(&DevMatrix, u64)> = dm.iter().zip(&outs).map(|(m, o)| (m, o.ptr)).collect();
        let nm = match (&dn, norm) {
            (Some(b), Some((_, eps))) => Some((b, eps)),
            _ => None,
        };
        if chunk {
            self.chunk_launch(dx.ptr, n, nm, mode, &pairs)?;
        } else {
            self.mm_fused(dx.ptr, n, nm, mode, &pairs)?;
        }
        let take = if mode == Fused::Swiglu { 1 } else { outs.len() };
        outs.iter()
            .zip(mats)
            .take(take)
            .map(|(o, m)| {
                let mut v = vec![0.0; n * m.rows];
                self.dtoh(o.ptr, &mut v)?;
                Ok(v)
            })
            .collect()
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

/// `attention_prefill`'s groups of a step whose spans hold `span_lens`
/// tokens each, stacked in that order: every span cut into runs of at most
/// `group` tokens (clamped to 1..=[`PF_TQ`]), each `first token << 32 |
/// count`. None where the groups would be less than half full on average
/// (steps of short spans, decode: `attention_paged`'s block per token
/// serves them better).
pub fn prefill_groups(
    span_lens: impl Iterator<Item = usize> + Clone,
    group: usize,
) -> Option<Vec<u64>> {
    let group = group.clamp(1, PF_TQ);
    let n: usize = span_lens.clone().sum();
    let count: usize = span_lens.clone().map(|l| l.div_ceil(group)).sum();
    if n == 0 || count * group > 2 * n || n > u32::MAX as usize {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    let mut first = 0usize;
    for len in span_lens {
        let mut at = 0;
        while at < len {
            let c = group.min(len - at);
            out.push(((first + at) as u64) << 32 | c as u64);
            at += c;
        }
        first += len;
    }
    Some(out)
}

/// Orders `groups` ([`prefill_groups`]' `first << 32 | count`) longest
/// first: by the position of each group's last token (`pos`, a position per
/// stacked token), descending, ties in their order ([`Tuning::pf_longest_first`]).
/// A group whose tokens are past `pos` keeps its place among the shortest.
pub fn longest_first(groups: &mut [u64], pos: &[u64]) {
    let last = |g: u64| {
        let (first, count) = ((g >> 32) as usize, (g & 0xffff_ffff) as usize);
        (first + count)
            .checked_sub(1)
            .and_then(|i| pos.get(i))
            .copied()
            .unwrap_or(0)
    };
    groups.sort_by_key(|&g| std::cmp::Reverse(last(g)));
}
