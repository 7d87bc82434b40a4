//! GGUF: the untrusted reader ([`read`]) and the importer to an HF directory
//! ([`import`]), with the architectures it maps ([`arch`]) and the
//! vocabulary conversion to `tokenizer.json` ([`vocab`]).

pub mod arch;
pub mod import;
pub mod read;
pub mod vocab;

pub use import::*;
pub use read::*;
