//! Timing of the CPU's decode attention at long contexts: one token per
//! sequence over every layer's K/V (30 layers of `small`'s 9/3 heads × 64,
//! and 32 layers of the 8B shape's 32/8 × 128), each layer its own K/V so
//! the rows come from memory as in a decode step, not from cache. Ignored
//! by default; run with `cargo test --release -p lmrr-kernels --test
//! attention_speed -- --ignored --nocapture`. Prints the median of several
//! repeats per case beside the floor of reading the K/V once at the
//! machine's copy bandwidth, measured in the same run, and checks the fast
//! path against the scalar reference on one layer so a faster kernel is
//! never a wrong one.

use lmrr_kernels::threads::Threads;
use lmrr_kernels::*;
use std::time::Instant;

/// A sequence's K and V pages.
type Pages = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Bytes a second of copying a buffer of `bytes`, best of 3.
fn copy_bandwidth(bytes: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    // A copy reads and writes every byte.
    2.0 * bytes as f64 / best
}

#[test]
#[ignore]
fn decode_attention_speed() {
    let th = Threads::new(2).expect("threads");
    let bw = copy_bandwidth(1 << 30);
    println!("copy bandwidth {:.1} GB/s, 2 threads", bw / 1e9);
    let mut r = SplitMix64(5);
    for &(name, layers, nh, nkv, hd, len, batch) in &[
        ("small", 30usize, 9usize, 3usize, 64usize, 4096usize, 1usize),
        ("small", 30, 9, 3, 64, 4096, 4),
        ("8b", 32, 32, 8, 128, 4096, 1),
    ] {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let kvd = shape.kv_dim();
        // Per layer and sequence its own K and V, in pages of 16.
        let kv: Vec<Vec<Pages>> = (0..layers)
            .map(|_| {
                (0..batch)
                    .map(|_| {
                        let page = |r: &mut SplitMix64| -> Vec<Vec<f32>> {
                            (0..len / 16)
                                .map(|_| r.uniform_vec(16 * kvd, 1.0))
                                .collect()
                        };
                        (page(&mut r), page(&mut r))
                    })
                    .collect()
            })
            .collect();
        let qs: Vec<Vec<f32>> = (0..batch)
            .map(|_| r.uniform_vec(shape.q_dim(), 1.0))
            .collect();
        let views: Vec<Vec<KvView>> = kv
            .iter()
            .map(|seqs| {
                seqs.iter()
                    .map(|(k, v)| KvView {
                        block_len: 16,
                        k: k.iter().map(|b| b.as_slice()).collect(),
                        v: v.iter().map(|b| b.as_slice()).collect(),
                    })
                    .collect()
            })
            .collect();
        let tasks: Vec<Vec<AttnTask>> = views
            .iter()
            .map(|vs| {
                vs.iter()
                    .zip(&qs)
                    .map(|(kv, q)| AttnTask {
                        q,
                        kv,
                        pos: len - 1,
                    })
                    .collect()
            })
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0.0f32; batch * shape.q_dim()];
        let mut want = vec![0.0f32; out.len()];
        attention(&th, &tasks[0], &shape, scale, &mut out);
        attention_ref(&tasks[0], &shape, scale, &mut want);
        let differ = out
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{name}: the fast path differs from the reference"
        );
        let mut times = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            for layer in &tasks {
                attention(&th, layer, &shape, scale, &mut out);
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let med = times[times.len() / 2];
        let floor = (layers * batch * len * 2 * kvd * 4) as f64 / bw;
        println!(
            "{name} ({nh}/{nkv} × {hd}, {layers} layers), batch {batch}, {len} positions: {:.2} ms a step's attention (median of 7), floor {:.2} ms, {:.2}× it",
            med * 1e3,
            floor * 1e3,
            med / floor
        );
    }
}
