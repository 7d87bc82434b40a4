//! Fuzzes the bundle reader: any bytes must give a bundle or an error, never a
//! panic, a hang or an allocation past the reader's limits.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = lmrr_recorder::read(data) {
        // Whatever decodes must also summarise without panicking.
        let _ = lmrr_recorder::Summary::of(&b);
    }
});
