//! Fuzzes payload decoding past the frame checksums, which stop most random
//! mutations in `read_bundle`: arbitrary bytes go straight to zstd (with the
//! reader's output limit) and to the bincode decoder of every frame type.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lmrr_recorder::{codec, format::MAX_FRAME_RAW, Event, Manifest, Trailer};

fuzz_target!(|data: &[u8]| {
    let _ = codec::decode::<Vec<Event>>(data);
    let _ = codec::decode::<Manifest>(data);
    let _ = codec::decode::<Trailer>(data);
    if let Ok(raw) = zstd::bulk::decompress(data, MAX_FRAME_RAW.min(1 << 20)) {
        let _ = codec::decode::<Vec<Event>>(&raw);
    }
});
