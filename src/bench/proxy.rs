//! `lmrr bench --proxy`: the latency `lmrr proxy` adds per streamed chunk.

use anyhow::Result;

pub(super) fn run_proxy(rounds: usize) -> Result<()> {
    let b = lmrr_serve::proxy_bench::bench(rounds, 200, std::time::Duration::from_millis(2))?;
    println!(
        "lmrr proxy: {} rounds × {} chunks, one every {} ms, loopback; latency = arrival − upstream write",
        b.rounds,
        b.chunks_per_round,
        b.interval.as_millis()
    );
    println!(
        "  direct    median {:>7.1} µs   p99 {:>7.1} µs   ({} chunks)",
        b.direct.median_us, b.direct.p99_us, b.direct.chunks
    );
    println!(
        "  proxied   median {:>7.1} µs   p99 {:>7.1} µs   ({} chunks; logprobs stripped, every chunk recorded)",
        b.proxied.median_us, b.proxied.p99_us, b.proxied.chunks
    );
    println!(
        "  added per chunk: {:.1} µs (median over rounds of the difference of medians; limit 1000 µs)",
        b.added_median_us
    );
    Ok(())
}
