//! GGUF: the untrusted reader ([`read`]) and the importer to an HF directory
//! ([`import`]).

pub mod import;
pub mod read;

pub use import::*;
pub use read::*;
