//! The index arithmetic of kernels.cu's warp-level tricks, emulated lane by
//! lane on the CPU against the canonical definitions: `tree8_xor` (eight
//! outputs' lane trees by exchange, lane j holding output `q ^ j` in slot q)
//! must leave lane j with exactly `lane_tree` of output j's eight lane
//! partials, bit for bit; the staged layout of `gemm_tiles` (`gm_pos`,
//! `gm_row`) must place every value once, and its reads must find them. The
//! device check (`gpu_check`) holds the kernels themselves to the references.

use lmrr_kernels::{lane_tree, SplitMix64};

/// kernels.cu's tree8_xor, one exchange step at a time over the 8 lanes of a
/// group (`v[j][q]`: lane j's partial of output `q ^ j`).
fn tree8_xor(v: &[[f32; 8]; 8]) -> [f32; 8] {
    // What lane j receives when every lane sends `send[lane]` under xor m.
    let xor = |send: &[f32; 8], m: usize| -> [f32; 8] { std::array::from_fn(|j| send[j ^ m]) };
    let mut w4 = [[0.0f32; 4]; 8];
    for q in 0..4 {
        let recv = xor(&std::array::from_fn(|j| v[j][q + 4]), 4);
        for j in 0..8 {
            w4[j][q] = v[j][q] + recv[j];
        }
    }
    let mut w2 = [[0.0f32; 2]; 8];
    for q in 0..2 {
        let recv = xor(&std::array::from_fn(|j| w4[j][q + 2]), 2);
        for j in 0..8 {
            w2[j][q] = w4[j][q] + recv[j];
        }
    }
    let recv = xor(&std::array::from_fn(|j| w2[j][1]), 1);
    std::array::from_fn(|j| w2[j][0] + recv[j])
}

#[test]
fn tree8_xor_is_the_lane_tree() {
    let mut r = SplitMix64(11);
    for case in 0..2000 {
        // Wide exponents, so that any other pairing rounds differently.
        let v: [[f32; 8]; 8] = std::array::from_fn(|_| {
            std::array::from_fn(|_| {
                let x = r.uniform_vec(1, 1.0)[0];
                x * f32::powi(2.0, (r.next_u64() % 40) as i32 - 20)
            })
        });
        let got = tree8_xor(&v);
        for o in 0..8 {
            // Lane j holds output o in slot o ^ j.
            let lanes: [f32; 8] = std::array::from_fn(|j| v[j][o ^ j]);
            assert_eq!(
                got[o].to_bits(),
                lane_tree(&lanes).to_bits(),
                "case {case}, output {o}"
            );
        }
    }
}

/// kernels.cu's gm_pos and gm_row: where staged element i of a chunk sits
/// in its row, and where staged row r starts.
fn gm_pos(i: usize) -> usize {
    (i & 7) * 8 + ((i >> 3) ^ (i & 4))
}
fn gm_row(r: usize) -> usize {
    r * 64 + (r >> 3) * 2
}

/// The staged tile of 64 rows (`GM_STAGE(64)` floats): every (row, element)
/// has its own float, and the 8-byte reads of `gemm_tiles` (lane j, steps
/// 2·sp and 2·sp + 1, row `q ^ j` of its cell) find exactly those elements,
/// 8-byte aligned.
#[test]
fn gemm_staging_places_and_finds_every_value() {
    let (rows, floats) = (64usize, 64 * 64 + 64 / 8 * 2);
    let mut owner = vec![None; floats];
    for r in 0..rows {
        for i in 0..64 {
            let at = gm_row(r) + gm_pos(i);
            assert!(at < floats, "row {r} element {i} at {at}");
            assert_eq!(owner[at], None, "row {r} element {i} at {at} taken");
            owner[at] = Some((r, i));
        }
    }
    for cell in 0..rows / 8 {
        for j in 0..8 {
            let (b, jx, sw) = (gm_row(cell * 8) + j * 8, j << 6, j & 4);
            for q in 0..8 {
                for sp in 0..4 {
                    let at = b + ((q << 6) ^ jx) + ((2 * sp) ^ sw);
                    assert_eq!(at % 2, 0, "cell {cell} lane {j} q {q} sp {sp}: unaligned");
                    let row = cell * 8 + (q ^ j);
                    assert_eq!(owner[at], Some((row, j + 8 * 2 * sp)));
                    assert_eq!(owner[at + 1], Some((row, j + 8 * (2 * sp + 1))));
                }
            }
        }
    }
}

/// A warp's 8-byte reads in `gemm_tiles`: 8 lanes × 2 cells (rows 8 apart),
/// 16 distinct addresses, must cover the 32 banks once (no bank conflict),
/// for every step pair and row slot; and a warp's staging stores (32
/// consecutive elements of one row) must hit 32 distinct banks.
#[test]
fn gemm_staging_is_free_of_bank_conflicts() {
    for sp in 0..4 {
        for q in 0..8 {
            for base_cell in (0..8).step_by(2) {
                let mut banks = [0u32; 32];
                for cell in [base_cell, base_cell + 1] {
                    for j in 0..8 {
                        let at =
                            gm_row(cell * 8) + j * 8 + ((q << 6) ^ (j << 6)) + ((2 * sp) ^ (j & 4));
                        banks[at % 32] += 1;
                        banks[(at + 1) % 32] += 1;
                    }
                }
                assert_eq!(banks, [1; 32], "sp {sp} q {q} cells {base_cell}+1");
            }
        }
    }
    for r in 0..16 {
        for half in 0..2 {
            let mut banks = [0u32; 32];
            for i in half * 32..half * 32 + 32 {
                banks[(gm_row(r) + gm_pos(i)) % 32] += 1;
            }
            assert_eq!(banks, [1; 32], "row {r} half {half}");
        }
    }
}
