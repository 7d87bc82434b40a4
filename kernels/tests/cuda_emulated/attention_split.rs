//! The decode attention split over the KV length (`attention_split_scores`,
//! `_pv`, `_merge`) against the CPU's attention: a batch of decode tokens
//! of different context lengths (one tile, segment edges, many segments of
//! SPLIT_TILES tiles), GQA at head_dim 64 and 128, pages of several sizes; and its
//! own negative controls (each mutation of the split source must change
//! bits on the same case).

use crate::harness::*;
use lmrr_kernels::*;

/// The split kernels' file, as `cuda_source::SOURCE` holds it.
const SPLIT_SRC: &str = include_str!("../../cuda/attention_split.cu");

/// One batch: a decode token per sequence, at `positions`, each sequence's
/// pages its own. Returns the runner's line and arrays and the CPU answer.
fn batch(
    r: &mut SplitMix64,
    th: &Threads,
    shape: AttnShape,
    positions: &[usize],
    page_len: usize,
) -> (String, Vec<Vec<u8>>, Vec<f32>) {
    let kvd = shape.kv_dim();
    let mut store: Vec<f32> = Vec::new();
    let (mut keys, mut vals) = (Vec::new(), Vec::new());
    let mut index: Vec<u64> = Vec::new();
    let mut seq_off: Vec<u64> = Vec::new();
    for &p in positions {
        let pages = (p + 1).div_ceil(page_len);
        let k = r.uniform_vec(pages * page_len * kvd, 3.0);
        let v = r.uniform_vec(pages * page_len * kvd, 1.0);
        seq_off.push(index.len() as u64);
        let first = store.len() / (page_len * 2 * kvd);
        for b in 0..pages {
            store.extend_from_slice(&k[b * page_len * kvd..(b + 1) * page_len * kvd]);
            store.extend_from_slice(&v[b * page_len * kvd..(b + 1) * page_len * kvd]);
            index.push((first + b) as u64);
        }
        keys.push(k);
        vals.push(v);
    }
    let views: Vec<KvView> = keys
        .iter()
        .zip(&vals)
        .map(|(k, v)| KvView {
            block_len: page_len,
            k: k.chunks(page_len * kvd).collect(),
            v: v.chunks(page_len * kvd).collect(),
        })
        .collect();
    let qs: Vec<Vec<f32>> = positions
        .iter()
        .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
        .collect();
    let tasks: Vec<AttnTask> = positions
        .iter()
        .zip(&qs)
        .zip(&views)
        .map(|((&pos, q), kv)| AttnTask { q, kv, pos })
        .collect();
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
    attention(th, &tasks, &shape, scale, &mut cpu);
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let line = format!(
        "attention {} {} {} {} {page_len} {} 7",
        positions.len(),
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
        scale.to_bits()
    );
    let arrays = vec![
        bytes(&qs.concat()),
        bytes(&store),
        bytes64(&index),
        bytes64(&seq_off),
        bytes64(&pos),
    ];
    (line, arrays, cpu)
}

fn run(bin: &std::path::PathBuf, line: &str, arrays: &[Vec<u8>]) -> Vec<f32> {
    let refs: Vec<&[u8]> = arrays.iter().map(|a| a.as_slice()).collect();
    floats(&job_on(bin, line, &refs)[0])
}

#[test]
fn split_decode_attention_matches_the_cpu() {
    let Some(bin) = emulator() else { return };
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(41);
    let gqa = |n_heads, n_kv_heads, head_dim| AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    // Positions: one tile (0, 31), a segment's last and first tile (127,
    // 128 at 4 tiles a segment), more tiles than the merge loads ahead (511,
    // 512 and on), many segments (1100, 2100), within one batch.
    for (shape, positions, page_len) in [
        (
            gqa(4, 2, 64),
            vec![0usize, 31, 32, 127, 128, 511, 512, 1100],
            16usize,
        ),
        (gqa(4, 1, 128), vec![2100, 5, 700], 32),
        (gqa(3, 3, 80), vec![95, 600], 7),
    ] {
        let (line, arrays, cpu) = batch(&mut r, &th, shape, &positions, page_len);
        // A block per segment, then two blocks a row taking every other
        // segment (one launch shape for any context).
        for (code, how) in [("7", "a block per segment"), ("8", "two blocks a row")] {
            let line = format!("{} {code}", line.trim_end_matches(" 7"));
            let dev = run(bin, &line, &arrays);
            assert_eq!(
                differing(&cpu, &dev),
                0,
                "attention_split_* ({how}) {shape:?}, positions {positions:?}, pages of {page_len}"
            );
        }
    }
}

/// The check above can fail: each mutation of the split source changes
/// bits on one of its cases.
#[test]
fn the_split_check_sees_each_broken_step() {
    if emulator().is_none() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(43);
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let (line, arrays, cpu) = batch(&mut r, &th, shape, &[1100, 40], 16);
    let mutations: &[(&str, &str, &str)] = &[
        (
            "p taken from the max before its tile",
            "det_exp(scr[jj] - ma[g * SPLIT_TILES + (jj - jb0) / ATTN_TILE])",
            "det_exp(scr[jj] - mb[g * SPLIT_TILES + (jj - jb0) / ATTN_TILE])",
        ),
        (
            "the merge over the tiles in reverse",
            "for (int u = 0; u < SPLIT_MERGE_AHEAD; ++u) {\n            if (k + u < w.tiles) {",
            "for (int u = SPLIT_MERGE_AHEAD - 1; u >= 0; --u) {\n            if (k + u < w.tiles) {",
        ),
        (
            "a score's lane tree xor 1 first",
            "lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);\n                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);\n                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);",
            "lv = lv + __shfl_xor_sync(0xffffffffu, lv, 1);\n                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 2);\n                        lv = lv + __shfl_xor_sync(0xffffffffu, lv, 4);",
        ),
        (
            "a tile's P·V chain from its last position",
            "for (int i = 0; i < ATTN_TILE; ++i) {\n                if (i < cnt) {",
            "for (int i = ATTN_TILE - 1; i >= 0; --i) {\n                if (i < cnt) {",
        ),
    ];
    let source = cuda_source::SOURCE;
    assert!(source.contains(SPLIT_SRC), "the split source is in SOURCE");
    for (i, &(label, from, to)) in mutations.iter().enumerate() {
        assert!(
            SPLIT_SRC.contains(from),
            "control `{label}`: `{from}` is not in attention_split.cu"
        );
        let bad = source.replace(SPLIT_SRC, &SPLIT_SRC.replace(from, to));
        let bin = build(&format!("split_control_{i}"), &bad, false);
        let d = differing(&cpu, &run(&bin, &line, &arrays));
        println!("negative control `{label}`: {d} differing values");
        assert!(
            d > 0,
            "control `{label}`: the split gives the CPU's bits anyway"
        );
    }
}
