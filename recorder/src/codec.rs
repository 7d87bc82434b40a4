//! The one module that encodes and decodes bundle payloads (bincode 2,
//! standard configuration: little-endian, varint integers). Decoding is bounded
//! by [`crate::format::MAX_FRAME_RAW`]: bincode checks every claimed length
//! against the remaining limit before allocating.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::format::MAX_FRAME_RAW;

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_RAW>()
}

/// Encodes a value.
pub fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    bincode::serde::encode_to_vec(v, config()).map_err(|e| e.to_string())
}

/// Decodes a value that must span all of `bytes`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let (v, used) =
        bincode::serde::decode_from_slice(bytes, config()).map_err(|e| e.to_string())?;
    if used != bytes.len() {
        return Err(format!(
            "{} trailing bytes after the payload",
            bytes.len() - used
        ));
    }
    Ok(v)
}
