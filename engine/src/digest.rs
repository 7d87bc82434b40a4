//! The one definition of a logits row's bytes and digest: what bundles record
//! per sampled token, what the session digest chains, and what replay and the
//! oracle compare. A row is its f32 values' bits, little-endian, in vocabulary
//! order; its digest is SHA-256 over those bytes.

use sha2::{Digest, Sha256};

/// Lower-case hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Little-endian bits of a logits row.
pub fn row_bytes(row: &[f32]) -> Vec<u8> {
    row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()
}

/// SHA-256 of bytes already laid out by [`row_bytes`].
pub fn bytes_digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// SHA-256 of a logits row's bytes (see the module docs).
pub fn logits_digest(row: &[f32]) -> [u8; 32] {
    bytes_digest(&row_bytes(row))
}
