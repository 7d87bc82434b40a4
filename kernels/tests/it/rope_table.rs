//! The RoPE tables' bits, pinned. Every logit depends on them, so a platform
//! (a C library's `pow`/`sin`/`cos`) or a `libm` upgrade that moved one bit
//! would break every recorded bundle; this test names the table that moved.
//!
//! The expected values were not taken from the code under test: they come from
//! `rope_table_reference.py` beside this file, which evaluates the same
//! definition with correctly rounded `pow`, `cos` and `sin` (mpmath, 200-bit
//! precision, then rounded to f64 and to f32). `libm` is not correctly rounded
//! everywhere; where its result differs, the difference is listed here
//! explicitly with the reason.

use lmrr_kernels::RopeTable;
use sha2::{Digest, Sha256};

/// SHA-256 of the f32 bits (little-endian) of the cos table then the sin table.
fn digest(cos: &[f32], sin: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in cos.iter().chain(sin) {
        h.update(v.to_bits().to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// One configuration: its table digest and three single entries
/// `(pos, i, cos bits, sin bits)`, all printed by the reference script.
struct Pin {
    head_dim: usize,
    theta: f64,
    max_pos: usize,
    sha256: &'static str,
    entries: [(usize, usize, u32, u32); 3],
}

const PINS: [Pin; 4] = [
    Pin {
        head_dim: 8,
        theta: 10_000.0,
        max_pos: 4,
        sha256: "a8a96f6a66c65fdd68d35766f04b108e69a97c58491c18f63803ff5afc1216db",
        entries: [
            (1, 0, 0x3f0a5140, 0x3f576aa4), // cos(1), sin(1)
            (3, 1, 0x3f7490ef, 0x3e974e6d),
            (3, 3, 0x3f7fffb5, 0x3b449b93),
        ],
    },
    Pin {
        head_dim: 48,
        theta: 10_000.0,
        max_pos: 1024,
        sha256: "511fd3306dc5dcfe9e6dc4b8df8cf33882d78754bc25c8ee8284e725756f66ad",
        entries: [
            (1, 0, 0x3f0a5140, 0x3f576aa4),
            (3, 1, 0xbee94858, 0x3f63e221),
            (1023, 23, 0x3f7d1e93, 0x3e192eb6),
        ],
    },
    // The `tiny` synthetic preset (the embedded default model).
    Pin {
        head_dim: 32,
        theta: 100_000.0,
        max_pos: 2048,
        sha256: "be525605f6103fab2eb39e1b21aa1b1226ce635a0e8a27f8f1cbb86b409fe47b",
        entries: [
            (1, 0, 0x3f0a5140, 0x3f576aa4),
            (3, 1, 0x3de09c14, 0x3f7e74ac),
            (2047, 15, 0x3f7fc61c, 0x3d2c209a),
        ],
    },
    // The `small` synthetic preset and SmolLM2-135M.
    Pin {
        head_dim: 64,
        theta: 100_000.0,
        max_pos: 8192,
        sha256: "ad98b906f8857e64238a58f768b64bc93baffba62bddc76e84a478452fae7de0",
        entries: [
            (1, 0, 0x3f0a5140, 0x3f576aa4),
            (3, 1, 0xbeff996f, 0x3f5dd16b),
            (8191, 31, 0x3f7e3d0e, 0x3defd6b1),
        ],
    },
];

#[test]
fn rope_tables_match_the_correctly_rounded_reference_bit_for_bit() {
    for p in &PINS {
        let t = RopeTable::new(p.head_dim, p.theta, p.max_pos);
        let (cos, sin) = t.tables();
        let half = p.head_dim / 2;
        for &(pos, i, c, s) in &p.entries {
            let k = pos * half + i;
            assert_eq!(
                (cos[k].to_bits(), sin[k].to_bits()),
                (c, s),
                "head_dim {} theta {} pos {pos} i {i}",
                p.head_dim,
                p.theta
            );
        }
        assert_eq!(
            digest(cos, sin),
            p.sha256,
            "RoPE table (head_dim {}, theta {}, {} positions) changed",
            p.head_dim,
            p.theta,
            p.max_pos
        );
    }
}

/// A Llama-3-like table (head_dim 128, θ = 500,000) where `libm` and the
/// correctly rounded reference differ in exactly one of its 1,048,576 entries:
/// `libm::pow(5e5, -12/128)` is 0x3fd2b3dc533bac4a, one ulp above the correctly
/// rounded 0x3fd2b3dc533bac49, and at position 3531 that moves the angle
/// enough to change cos's f32 by one ulp. The engine's definition is `libm`'s
/// (the same on every platform); this pins both the digest and the one
/// difference, so neither can move unnoticed.
#[test]
fn the_one_entry_where_libm_pow_is_not_correctly_rounded_is_pinned() {
    const REFERENCE: &str = "df35f45b1c17a329deeb8aaf8cdd71f56e90b4fed8ec2b527dffa4ac0894d9d7";
    let (hd, pos, i) = (128, 3531, 6);
    let t = RopeTable::new(hd, 500_000.0, 8192);
    let (cos, sin) = t.tables();
    let k = pos * hd / 2 + i;
    assert_eq!(
        (cos[k].to_bits(), sin[k].to_bits()),
        (0x3e1fd9c3, 0x3f7cdc91)
    );
    let mut fixed = cos.to_vec();
    fixed[k] = f32::from_bits(0x3e1fd9c4); // the reference's value
    assert_eq!(digest(&fixed, sin), REFERENCE);
    // Spot entries agree as printed by the reference.
    assert_eq!(
        (cos[hd / 2].to_bits(), sin[hd / 2].to_bits()),
        (0x3f0a5140, 0x3f576aa4)
    );
    let last = 8191 * hd / 2 + 63;
    assert_eq!(
        (cos[last].to_bits(), sin[last].to_bits()),
        (0x3f7ff2c0, 0x3ca4bb02)
    );
    assert_eq!(
        (cos[3 * hd / 2 + 1].to_bits(), sin[3 * hd / 2 + 1].to_bits()),
        (0xbf442bf2, 0x3f247a1c)
    );
}
