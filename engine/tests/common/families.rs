//! Every model family's test model, for tests that must hold on each of them
//! (included by the test files of every crate with `#[path]`, so the list of
//! families and the test generator exist once).
//!
//! A test is written once as `fn name(p: Preset)` and instantiated per family
//! by [`per_family!`]: `llama::name` and `mini_v4::name`.

#![allow(dead_code)]

use std::cell::Cell;
use std::sync::OnceLock;

use lmrr_engine::{Model, Preset, SynthSpec};
use lmrr_kernels::tensor_core::Numerics;

thread_local! {
    /// Set while a test runs under [`with_tensor_cores`].
    static TENSOR_CORES: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with [`model`] and [`fresh`] handing out llama's tiny model
/// under tensor-core numerics (the CPU model of sm_90's mma): the tests of
/// [`per_numerics!`] hold in that arithmetic too.
pub fn with_tensor_cores<R>(f: impl FnOnce() -> R) -> R {
    TENSOR_CORES.set(true);
    let r = f();
    TENSOR_CORES.set(false);
    r
}

/// One tiny synthetic model per family, in listing order.
pub const FAMILIES: [Preset; 2] = [Preset::Tiny, Preset::MiniV4Tiny];

/// The family's tiny model (seed 0; llama's is the embedded default), built
/// once per test binary.
pub fn model(p: Preset) -> &'static Model {
    static LLAMA: OnceLock<Model> = OnceLock::new();
    static LLAMA_TC: OnceLock<Model> = OnceLock::new();
    static MINI_V4: OnceLock<Model> = OnceLock::new();
    let cell = match p {
        Preset::Tiny if TENSOR_CORES.get() => &LLAMA_TC,
        Preset::Tiny => &LLAMA,
        Preset::MiniV4Tiny => &MINI_V4,
        other => panic!("{other} is not a test preset"),
    };
    cell.get_or_init(|| fresh(p))
}

/// A newly built instance of the family's tiny model (with its synthetic
/// spec, as `--model synthetic:NAME` loads it).
pub fn fresh(p: Preset) -> Model {
    let mut m = Model::synthetic(SynthSpec::new(p, 0)).unwrap();
    if TENSOR_CORES.get() {
        m.net.set_numerics(Numerics::TensorCoreSm90).unwrap();
    }
    m
}

/// `--model` value of the family's tiny model.
pub fn cli_name(p: Preset) -> String {
    format!("synthetic:{}", p.name())
}

/// The first position whose attention is sparse (the indexer chooses blocks),
/// `None` for a family whose attention is always dense. A position `p` sees
/// `p / block + 1` index blocks and goes sparse once they exceed `topk`.
pub fn sparse_from(m: &Model) -> Option<usize> {
    m.mini_v4()
        .map(|v| v.config().index_topk * v.config().index_block_size)
}

/// Asserts that a sequence of `len` positions reaches the sparse path of a
/// family that has one, so an invariance test over it covers the indexer.
pub fn assert_reaches_sparse(m: &Model, len: usize, what: &str) {
    if let Some(from) = sparse_from(m) {
        assert!(
            len > from,
            "{what}: {len} positions never reach sparse attention (from position {from})"
        );
    }
}

/// Generates one `#[test]` per family for each `fn name(p: Preset)` listed:
/// `llama::name` and `mini_v4::name` (spelled out for the two presets of
/// [`FAMILIES`]: a macro cannot loop over a constant).
#[allow(unused_macros)]
macro_rules! per_family {
    ($($name:ident),+ $(,)?) => {
        mod llama {
            $(#[test]
            fn $name() {
                super::$name(lmrr_engine::Preset::Tiny)
            })+
        }
        mod mini_v4 {
            $(#[test]
            fn $name() {
                super::$name(lmrr_engine::Preset::MiniV4Tiny)
            })+
        }
    };
}

/// Generates `tensor_cores::name` for each `fn name(p: Preset)` listed:
/// llama's tiny model under tensor-core numerics ([`with_tensor_cores`]).
#[allow(unused_macros)]
macro_rules! per_numerics {
    ($($name:ident),+ $(,)?) => {
        mod tensor_cores {
            $(#[test]
            fn $name() {
                super::families::with_tensor_cores(|| super::$name(lmrr_engine::Preset::Tiny))
            })+
        }
    };
}
