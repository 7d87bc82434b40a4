//! The matmul kernels (`matmul_warp`, `_tile`, `_rows`, `_rows4`, `_gemm`,
//! `_gemm_wide`, split or not, `matmul_multi`, `matmul_gemm_multi`) against
//! the CPU's matmul in every weight storage (f32, bf16, Q4_0, Q4_1, Q8_0,
//! Q4_K, Q6_K), on shapes with ragged rows, tokens and chunks.

use crate::harness::*;
use lmrr_kernels::*;

#[test]
fn matmul_kernels_match_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(5);
    // (rows, cols, tokens): tails of rows, tokens and chunks; more chunks
    // than matmul_rows has groups (1088 = 17 chunks); gemm's row and token
    // tiles both partial; split gemm with 1, 2, 5 and 3 chunks per block.
    for &(rows, cols, n) in &[
        (7usize, 96usize, 3usize),
        (33, 160, 17),
        (20, 1088, 9),
        (65, 64, 40),
        // Whole and partial wide tiles (64 rows × 32 tokens), ragged chunks.
        (130, 224, 70),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let st = Stored::new(&mut r, rows * cols, 0.5);
        for (label, kind, w, raw) in st.each() {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(&th, &x, n, &m, &mut cpu);
            for kernel in [
                "warp",
                "tile",
                "rows",
                "rows4",
                "gemm",
                "gemm_split1",
                "gemm_split2",
                "gemm_split5",
                "gemm_wide",
                "gemm_wide_split3",
            ] {
                let out = job(
                    &format!("matmul {kernel} {kind} {n} {rows} {cols}"),
                    &[&bytes(&x), &raw],
                );
                let dev = floats(&out[0]);
                assert_eq!(
                    differing(&cpu, &dev),
                    0,
                    "matmul_{kernel} {label} {n}×{cols}·{cols}×{rows}"
                );
            }
        }
    }
}

/// Every matmul kernel on Q4_K and Q6_K rows (super-blocks of 256, so a
/// chunk of 64 reads a quarter of one and a row several) against the CPU's
/// matmul of the same blocks: ragged rows and tokens, one to five
/// super-blocks a row.
#[test]
fn matmul_kernels_read_k_quants_as_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(17);
    for &(rows, cols, n) in &[(7usize, 256usize, 3usize), (33, 768, 17), (65, 1280, 40)] {
        let x = r.uniform_vec(n * cols, 2.0);
        for (label, kind, q, raw) in kquant_blocks(&mut r, rows * cols) {
            let m = Matrix::new(Weights::Quant(q, &raw), rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(&th, &x, n, &m, &mut cpu);
            for kernel in [
                "warp",
                "tile",
                "rows",
                "rows4",
                "gemm",
                "gemm_split2",
                "gemm_wide",
            ] {
                let out = job(
                    &format!("matmul {kernel} {kind} {n} {rows} {cols}"),
                    &[&bytes(&x), &raw],
                );
                assert_eq!(
                    differing(&cpu, &floats(&out[0])),
                    0,
                    "matmul_{kernel} {label} {n}×{cols}·{cols}×{rows}"
                );
            }
        }
    }
}

/// `matmul_multi` (a block per row and token tile over up to three
/// matrices) against three CPU matmuls: ragged row counts, one and two
/// token tiles, a partial last chunk, an absent third matrix.
#[test]
fn matmul_multi_matches_three_matmuls() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(6);
    let cases: &[(usize, usize, [usize; 3])] = &[
        (192, 5, [24, 8, 8]),
        (200, 11, [25, 7, 9]),
        (576, 1, [13, 6, 0]),
    ];
    for &(cols, n, rows) in cases {
        let x = r.uniform_vec(n * cols, 2.0);
        let ws: Vec<Vec<f32>> = rows.iter().map(|&o| r.uniform_vec(o * cols, 0.5)).collect();
        let out = job(
            &format!("multi 0 {n} {cols} {} {} {}", rows[0], rows[1], rows[2]),
            &[&bytes(&x), &bytes(&ws[0]), &bytes(&ws[1]), &bytes(&ws[2])],
        );
        for (i, w) in ws.iter().enumerate() {
            let m = Matrix::new(Weights::F32(w), rows[i], cols).expect("shape");
            let mut cpu = vec![0.0; n * rows[i]];
            matmul(&th, &x, n, &m, &mut cpu);
            assert_eq!(
                differing(&cpu, &floats(&out[i])),
                0,
                "matmul_multi {n}×{cols} matrix {i} of {rows:?}"
            );
        }
    }
}

/// `matmul_gemm_multi` (up to three matrices of one input in one launch,
/// each split over its chunks or not) against the CPU's matmul of each, in
/// every storage.
#[test]
fn gemm_multi_matches_each_matmul() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(21);
    // (tokens, cols, rows of each, chunks a block of each, 0: unsplit):
    // ragged rows, tokens and chunks; an absent third matrix; splits of
    // 1, 2 and 3 chunks beside an unsplit one; one matrix alone (split
    // and not), as `mm_outs` launches o and down under gemm_multi.
    for &(n, cols, rows, cpb) in &[
        (40usize, 224usize, [130usize, 64, 20], [1usize, 0, 2]),
        (33, 160, [70, 9, 0], [0, 3, 0]),
        (19, 192, [66, 0, 0], [2, 0, 0]),
        (35, 128, [64, 0, 0], [0, 0, 0]),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let st: Vec<Stored> = rows
            .iter()
            .map(|&m| Stored::new(&mut r, m.max(1) * cols, 0.5))
            .collect();
        let each: Vec<_> = st.iter().map(|s| s.each()).collect();
        for kind in 0..5 {
            let raws: Vec<&Vec<u8>> = each.iter().map(|e| &e[kind].3).collect();
            let empty = Vec::new();
            let arrays: Vec<&[u8]> = (0..3)
                .map(|i| {
                    if rows[i] == 0 {
                        &empty[..]
                    } else {
                        &raws[i][..]
                    }
                })
                .collect();
            let out = job(
                &format!(
                    "gemm_multi {} {n} {cols} {} {} {} {} {} {}",
                    each[0][kind].1, rows[0], rows[1], rows[2], cpb[0], cpb[1], cpb[2]
                ),
                &[&bytes(&x), arrays[0], arrays[1], arrays[2]],
            );
            for i in 0..3 {
                let label = each[i][kind].0;
                if rows[i] == 0 {
                    assert!(floats(&out[i]).is_empty(), "absent matrix {i}");
                    continue;
                }
                let m = Matrix::new(each[i][kind].2, rows[i], cols).expect("shape");
                let mut cpu = vec![0.0; n * rows[i]];
                matmul(&th, &x, n, &m, &mut cpu);
                assert_eq!(
                    differing(&cpu, &floats(&out[i])),
                    0,
                    "matmul_gemm_multi {label}: matrix {i} {n}×{cols}·{cols}×{} (cpb {})",
                    rows[i],
                    cpb[i]
                );
            }
        }
    }
}
