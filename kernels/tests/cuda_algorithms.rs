//! The index arithmetic of kernels.cu's warp-level tricks, emulated lane by
//! lane on the CPU against the canonical definitions: `tree8_transpose`
//! (eight outputs' lane trees by exchange) must leave lane j with exactly
//! `lane_tree` of output j's eight lane partials, bit for bit. The device
//! check (`gpu_check`) holds the kernels themselves to the references.

use lmrr_kernels::{lane_tree, SplitMix64};

/// kernels.cu's tree8_transpose, one exchange step at a time over the 8
/// lanes of a group (`v[j][o]`: lane j's partial of output o).
fn tree8_transpose(v: &[[f32; 8]; 8]) -> [f32; 8] {
    let xor = |vals: &[f32; 8], m: usize| -> [f32; 8] { std::array::from_fn(|j| vals[j ^ m]) };
    let mut w4 = [[0.0f32; 4]; 8];
    for k in 0..4 {
        let send: [f32; 8] = std::array::from_fn(|j| {
            if (j >> 2) & 1 == 1 {
                v[j][k]
            } else {
                v[j][k + 4]
            }
        });
        let recv = xor(&send, 4);
        for j in 0..8 {
            let keep = if (j >> 2) & 1 == 1 {
                v[j][k + 4]
            } else {
                v[j][k]
            };
            w4[j][k] = keep + recv[j];
        }
    }
    let mut w2 = [[0.0f32; 2]; 8];
    for k in 0..2 {
        let send: [f32; 8] = std::array::from_fn(|j| {
            if (j >> 1) & 1 == 1 {
                w4[j][k]
            } else {
                w4[j][k + 2]
            }
        });
        let recv = xor(&send, 2);
        for j in 0..8 {
            let keep = if (j >> 1) & 1 == 1 {
                w4[j][k + 2]
            } else {
                w4[j][k]
            };
            w2[j][k] = keep + recv[j];
        }
    }
    let send: [f32; 8] = std::array::from_fn(|j| if j & 1 == 1 { w2[j][0] } else { w2[j][1] });
    let recv = xor(&send, 1);
    std::array::from_fn(|j| (if j & 1 == 1 { w2[j][1] } else { w2[j][0] }) + recv[j])
}

#[test]
fn tree8_transpose_is_the_lane_tree() {
    let mut r = SplitMix64(11);
    for case in 0..2000 {
        // Wide exponents, so that any other pairing rounds differently.
        let v: [[f32; 8]; 8] = std::array::from_fn(|_| {
            std::array::from_fn(|_| {
                let x = r.uniform_vec(1, 1.0)[0];
                x * f32::powi(2.0, (r.next_u64() % 40) as i32 - 20)
            })
        });
        let got = tree8_transpose(&v);
        for o in 0..8 {
            let lanes: [f32; 8] = std::array::from_fn(|j| v[j][o]);
            assert_eq!(
                got[o].to_bits(),
                lane_tree(&lanes).to_bits(),
                "case {case}, output {o}"
            );
        }
    }
}
