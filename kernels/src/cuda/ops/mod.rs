//! The resident path's launch wrappers, one module per op family (the
//! kernels' own files in kernels/cuda/ are split the same way). Each
//! wrapper checks its sizes against the kernels' 32-bit indices and limits
//! and returns an error, never a launch, when they do not fit; the caller
//! guarantees that every address it passes holds the extent the shapes
//! imply.

pub mod attention;
pub mod attention_split;
pub mod elementwise;
pub mod matmul;
pub mod norm;
pub mod program;
