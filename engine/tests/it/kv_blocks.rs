//! The device mirror's view of a KV store ([`KvCache::blocks`]): keys name a
//! block's storage, versions move on every write and never repeat, so a
//! mirror that kept a block at version `v` holds the host's rows exactly
//! while the host still says `v`. Checked on both stores, with the rows that
//! `block_rows` hands out for an upload; and `write_run` and `write_step`
//! (on 1, 2 and 3 threads) against the per-row writes they replace (the
//! same rows, slot digests and page hashes; fresh versions on exactly the
//! blocks written; of two runs writing one slot, the later one's rows).

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use lmrr_engine::kv::{RowView, STEP_PARALLEL_FLOATS};
use lmrr_engine::pool::{BlockTable, PageId, PagePool, PagedKv};
use lmrr_engine::{BlockRows, EngineError, KvBlocks, KvCache, KvLayout, KvRun, SeqId, SeqKvStore};
use lmrr_kernels::{KvView, Threads};

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    kv_dim: 3,
    aux_dim: 0,
};

fn row(v: f32) -> [f32; 3] {
    [v, v + 0.5, -v]
}

#[test]
fn seq_store_versions_move_on_write_only() {
    let mut kv = SeqKvStore::new(LAYOUT);
    kv.prepare(7, 0, 70).unwrap();
    let b0 = kv.blocks(7);
    assert_eq!(b0.block_len, 64);
    assert_eq!(b0.blocks.len(), 2, "70 positions are two blocks of 64");
    assert!(
        b0.blocks.iter().all(|&(_, v)| v == 0),
        "never written: version 0"
    );
    kv.write(7, 1, 3, &row(1.0), &row(2.0));
    let b1 = kv.blocks(7);
    assert_eq!(b1.blocks[0].0, b0.blocks[0].0, "the key stays");
    assert_ne!(b1.blocks[0].1, 0);
    assert_eq!(b1.blocks[1], b0.blocks[1], "block 1 untouched");
    kv.write(7, 0, 65, &row(3.0), &row(4.0));
    let b2 = kv.blocks(7);
    assert_eq!(b2.blocks[0], b1.blocks[0]);
    assert!(
        b2.blocks[1].1 > b1.blocks[0].1,
        "a later write, a later version"
    );
    // Growing the buffer moves no version (the rows are the same).
    kv.prepare(7, 70, 200).unwrap();
    let b3 = kv.blocks(7);
    assert_eq!(&b3.blocks[..2], &b2.blocks[..]);
    assert_eq!(b3.blocks.len(), 270usize.div_ceil(64));
    // The rows an upload reads: layer 1, block 0, position 3.
    let r = kv.block_rows(7, 0, 1);
    assert_eq!(&r.k[9..12], &row(1.0));
    assert_eq!(&r.v[9..12], &row(2.0));
    let r = kv.block_rows(7, 1, 0);
    assert_eq!(&r.k[3..6], &row(3.0));
    // A sequence dropped and made again takes the dropped one's kept
    // buffers with their keys and versions (the rows are unchanged, so a
    // mirror's copy of them stays good and nothing is uploaded), until
    // its first write moves the version.
    let held = kv.bytes();
    kv.remove(7);
    kv.prepare(7, 0, 1).unwrap();
    assert_eq!(kv.bytes(), held);
    let b4 = kv.blocks(7);
    assert_eq!(&b4.blocks[..], &b3.blocks[..1]);
    assert_eq!(&kv.block_rows(7, 0, 1).k[9..12], &row(1.0));
    kv.write(7, 0, 0, &row(5.0), &row(6.0));
    let b5 = kv.blocks(7);
    assert_eq!(b5.blocks[0].0, b3.blocks[0].0);
    assert!(b5.blocks[0].1 > b3.blocks[0].1);
    // A store's second sequence, made while the first is held, gets its
    // own keys.
    kv.prepare(8, 0, 1).unwrap();
    assert_ne!(kv.blocks(8).blocks[0].0, b5.blocks[0].0);
}

#[test]
fn versions_never_repeat_across_stores() {
    let (mut a, mut b) = (SeqKvStore::new(LAYOUT), SeqKvStore::new(LAYOUT));
    for kv in [&mut a, &mut b] {
        kv.prepare(1, 0, 1).unwrap();
        kv.write(1, 0, 0, &row(1.0), &row(1.0));
    }
    let (va, vb) = (a.blocks(1).blocks[0], b.blocks(1).blocks[0]);
    assert_ne!(va.0, vb.0, "two stores, two keys");
    assert_ne!(va.1, vb.1, "two writes, two versions");
}

#[test]
fn paged_pool_blocks_are_its_pages() {
    let pool = PagePool::new(4, 8, LAYOUT).unwrap();
    let mut kv = PagedKv::new(pool);
    let (p0, p1) = (
        kv.pool.alloc().unwrap().unwrap(),
        kv.pool.alloc().unwrap().unwrap(),
    );
    kv.tables.insert(
        5,
        BlockTable {
            pages: vec![p0, p1],
            len: 0,
        },
    );
    kv.prepare(5, 0, 6).unwrap();
    let b = kv.blocks(5);
    assert_eq!(b.block_len, 4);
    assert_eq!(b.blocks.len(), 2);
    kv.write(5, 1, 5, &row(9.0), &row(8.0));
    let after = kv.blocks(5);
    assert_eq!(after.blocks[0], b.blocks[0]);
    assert_eq!(after.blocks[1].0, b.blocks[1].0);
    assert_ne!(after.blocks[1].1, b.blocks[1].1);
    let r = kv.block_rows(5, 1, 1);
    assert_eq!(r.k.len(), 4 * 3, "a whole page");
    assert_eq!(&r.k[3..6], &row(9.0));
    assert_eq!(&r.v[3..6], &row(8.0));
    // A second sequence sharing page p0 (a prefix-cache hit) names the same
    // block: the mirror's device page is reused, not uploaded again.
    kv.pool.incref(p0);
    kv.tables.insert(
        6,
        BlockTable {
            pages: vec![p0],
            len: 4,
        },
    );
    assert_eq!(kv.blocks(6).blocks[0], after.blocks[0]);
    // Nothing beyond the held positions is listed.
    kv.tables.insert(
        9,
        BlockTable {
            pages: vec![p0, p1],
            len: 3,
        },
    );
    assert_eq!(kv.blocks(9).blocks.len(), 1);
}

/// A write plan: per run `(seq, layer, pos0, len)`, in the order written.
type Runs = Vec<(SeqId, usize, usize, usize)>;

/// The K and V rows of `len` positions from `pos0`, `(len, kv_dim)` each:
/// every (seq, layer, pos, round) its own values, so a row that lands one
/// slot off, in another layer or from an older round shows.
fn run_rows(seq: SeqId, layer: usize, pos0: usize, len: usize, round: u32) -> (Vec<f32>, Vec<f32>) {
    let x = |pos: usize| {
        (seq * 100_000) as f32 + (layer * 10_000) as f32 + pos as f32 + round as f32 * 0.25
    };
    let k = (pos0..pos0 + len).flat_map(|p| row(x(p))).collect();
    let v = (pos0..pos0 + len)
        .flat_map(|p| [-x(p), 2.0 * x(p), 1.0 + x(p)])
        .collect();
    (k, v)
}

/// The order the CUDA step writes in: per layer, per sequence, its runs
/// (lengths `cuts` cycled until the sequence is covered); then, as a later
/// step might, one run rewriting positions already written (round 1).
fn plan(seqs: &[(SeqId, usize)], cuts: &[usize]) -> Runs {
    let mut runs = Vec::new();
    for layer in 0..LAYOUT.layers {
        for (i, &(seq, len)) in seqs.iter().enumerate() {
            let mut pos = 0;
            for &c in cuts.iter().cycle().skip(i) {
                if pos == len {
                    break;
                }
                let m = c.max(1).min(len - pos);
                runs.push((seq, layer, pos, m));
                pos += m;
            }
        }
    }
    runs
}

fn bits(rows: &[f32]) -> Vec<u32> {
    rows.iter().map(|x| x.to_bits()).collect()
}

/// Writes `runs` into `rows` one `write` per position and into `in_runs`
/// one `write_run` per run (round 0; the last run again in round 1), then
/// checks ([`assert_same`]) that both hold the same rows and that the
/// versions moved, to fresh values, on exactly the blocks the runs touched.
fn write_both<S: KvCache>(rows: &mut S, in_runs: &mut S, seqs: &[(SeqId, usize)], runs: &Runs) {
    let before: Vec<_> = seqs.iter().map(|&(s, _)| rows.blocks(s)).collect();
    let before_runs: Vec<_> = seqs.iter().map(|&(s, _)| in_runs.blocks(s)).collect();
    let last = runs.last().copied().map(|r| (r, 1));
    for ((seq, layer, pos0, len), round) in runs.iter().map(|&r| (r, 0)).chain(last) {
        let (k, v) = run_rows(seq, layer, pos0, len, round);
        let d = LAYOUT.kv_dim;
        for j in 0..len {
            rows.write(
                seq,
                layer,
                pos0 + j,
                &k[j * d..(j + 1) * d],
                &v[j * d..(j + 1) * d],
            );
        }
        in_runs.write_run(seq, layer, pos0, &k, &v);
    }
    let touched = |seq: SeqId, blk: usize, bl: usize| {
        runs.iter()
            .any(|&(s, _, p0, n)| s == seq && p0 / bl <= blk && blk <= (p0 + n - 1) / bl)
    };
    assert_same(
        rows,
        in_runs,
        LAYOUT.layers,
        seqs,
        [&before, &before_runs],
        touched,
    );
}

/// Checks that `rows` and `other` hold the same rows in layers `0..layers`
/// (bitwise, through `view` and `block_rows`), that since `before` (their
/// blocks then) the versions moved on exactly the blocks `touched(seq,
/// block, block_len)` names in both, and that each of `other`'s is fresh:
/// held by no other block and seen nowhere before.
fn assert_same<S: KvCache>(
    rows: &S,
    other: &S,
    layers: usize,
    seqs: &[(SeqId, usize)],
    [before, before_other]: [&[KvBlocks]; 2],
    touched: impl Fn(SeqId, usize, usize) -> bool,
) {
    let mut seen: Vec<u64> = before
        .iter()
        .chain(before_other.iter())
        .flat_map(|b| b.blocks.iter().map(|&(_, v)| v))
        .filter(|&v| v != 0)
        .collect();
    let mut fresh = Vec::new();
    for (i, &(seq, len)) in seqs.iter().enumerate() {
        for layer in 0..layers {
            let (a, b) = (rows.view(seq, layer), other.view(seq, layer));
            assert_eq!(a.block_len, b.block_len);
            let all = |blocks: &[&[f32]]| blocks.iter().map(|b| bits(b)).collect::<Vec<_>>();
            assert_eq!(all(&a.k), all(&b.k), "seq {seq} layer {layer}: K");
            assert_eq!(all(&a.v), all(&b.v), "seq {seq} layer {layer}: V");
        }
        let (a, b) = (rows.blocks(seq), other.blocks(seq));
        assert_eq!(a.block_len, b.block_len);
        assert_eq!(a.blocks.len(), len.div_ceil(a.block_len));
        for blk in 0..a.blocks.len() {
            for layer in 0..layers {
                let (ra, rb) = (
                    rows.block_rows(seq, blk, layer),
                    other.block_rows(seq, blk, layer),
                );
                assert_eq!(
                    bits(ra.k),
                    bits(rb.k),
                    "seq {seq} block {blk} layer {layer}: K"
                );
                assert_eq!(
                    bits(ra.v),
                    bits(rb.v),
                    "seq {seq} block {blk} layer {layer}: V"
                );
            }
            let touched = touched(seq, blk, a.block_len);
            let (was, was_other) = (before[i].blocks[blk], before_other[i].blocks[blk]);
            assert_eq!(
                a.blocks[blk] != was,
                touched,
                "seq {seq} block {blk}, per row"
            );
            assert_eq!(
                b.blocks[blk] != was_other,
                touched,
                "seq {seq} block {blk}, other"
            );
            assert_eq!(b.blocks[blk].0, was_other.0, "the key stays");
            if touched {
                seen.push(a.blocks[blk].1);
                fresh.push(b.blocks[blk].1);
            }
        }
    }
    let n = fresh.len();
    fresh.sort_unstable();
    fresh.dedup();
    assert_eq!(fresh.len(), n, "no two blocks share a version");
    assert!(
        fresh.iter().all(|v| *v != 0 && !seen.contains(v)),
        "every version the other store leaves is new"
    );
}

/// Sequences of a run test: lengths that end mid-block and a one-position
/// sequence (a decode step's run of length 1).
const SEQS: [(SeqId, usize); 3] = [(1, 150), (2, 1), (3, 71)];

/// Run lengths: 1, runs inside a block, runs across one or two boundaries
/// of 7- and 64-position blocks, one run of a whole sequence.
const CUTS: [usize; 6] = [1, 5, 9, 64, 70, 3];

#[test]
fn seq_store_runs_leave_what_rows_leave() {
    let new = || {
        let mut kv = SeqKvStore::new(LAYOUT);
        for &(seq, len) in &SEQS {
            kv.prepare(seq, 0, len).unwrap();
        }
        kv
    };
    for cuts in [&CUTS[..], &[1], &[150]] {
        write_both(&mut new(), &mut new(), &SEQS, &plan(&SEQS, cuts));
    }
}

/// A store that keeps the provided `write_run` (a loop over `write`).
struct PerRow(SeqKvStore);

impl KvCache for PerRow {
    fn len(&self, seq: SeqId) -> usize {
        self.0.len(seq)
    }
    fn prepare(&mut self, seq: SeqId, start: usize, n: usize) -> Result<(), EngineError> {
        self.0.prepare(seq, start, n)
    }
    fn write(&mut self, seq: SeqId, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.0.write(seq, layer, pos, k, v)
    }
    fn view(&self, seq: SeqId, layer: usize) -> KvView<'_> {
        self.0.view(seq, layer)
    }
    fn write_aux(&mut self, seq: SeqId, layer: usize, pos: usize, row: &[f32]) {
        self.0.write_aux(seq, layer, pos, row)
    }
    fn aux_view(&self, seq: SeqId, layer: usize) -> RowView<'_> {
        self.0.aux_view(seq, layer)
    }
    fn blocks(&self, seq: SeqId) -> KvBlocks {
        self.0.blocks(seq)
    }
    fn block_rows(&self, seq: SeqId, block: usize, layer: usize) -> BlockRows<'_> {
        self.0.block_rows(seq, block, layer)
    }
}

#[test]
fn the_provided_write_run_is_the_row_loop() {
    let new = || {
        let mut kv = PerRow(SeqKvStore::new(LAYOUT));
        for &(seq, len) in &SEQS {
            kv.prepare(seq, 0, len).unwrap();
        }
        kv
    };
    write_both(&mut new(), &mut new(), &SEQS, &plan(&SEQS, &CUTS));
}

/// A pool of `ps`-position pages holding `seqs`, their pages handed out
/// round-robin so that no sequence's pages are adjacent in storage.
fn paged(ps: usize, seqs: &[(SeqId, usize)]) -> PagedKv {
    paged_in(LAYOUT, ps, seqs)
}

/// [`paged`] in `layout`.
fn paged_in(layout: KvLayout, ps: usize, seqs: &[(SeqId, usize)]) -> PagedKv {
    let total = seqs.iter().map(|&(_, n)| n.div_ceil(ps)).sum();
    let mut kv = PagedKv::new(PagePool::new(ps, total, layout).unwrap());
    let most = seqs.iter().map(|&(_, n)| n.div_ceil(ps)).max().unwrap_or(0);
    for i in 0..most {
        for &(seq, n) in seqs {
            if i < n.div_ceil(ps) {
                let p = kv.pool.alloc().unwrap().unwrap();
                kv.tables.entry(seq).or_default().pages.push(p);
            }
        }
    }
    for &(seq, n) in seqs {
        kv.prepare(seq, 0, n).unwrap();
    }
    kv
}

/// [`write_both`] on two pools, then `finish_step` on each: every slot
/// digest, fill count and page hash the same.
fn paged_runs_hold(ps: usize, seqs: &[(SeqId, usize)], cuts: &[usize]) {
    let (mut rows, mut in_runs) = (paged(ps, seqs), paged(ps, seqs));
    write_both(&mut rows, &mut in_runs, seqs, &plan(seqs, cuts));
    assert_same_digests(&mut rows, &mut in_runs);
}

/// `finish_step` on both pools, then every slot digest, fill count and page
/// hash the same.
fn assert_same_digests(rows: &mut PagedKv, other: &mut PagedKv) {
    rows.finish_step();
    other.finish_step();
    let ps = rows.pool.page_size();
    assert_eq!(rows.pool.used_pages(), other.pool.used_pages());
    for p in 0..rows.pool.used_pages() as PageId {
        for s in 0..ps {
            assert_eq!(
                rows.pool.slot_digest(p, s),
                other.pool.slot_digest(p, s),
                "page size {ps}: page {p} slot {s}"
            );
        }
        assert_eq!(rows.pool.filled(p), other.pool.filled(p), "page {p}");
        assert_eq!(rows.pool.page_hash(p), other.pool.page_hash(p), "page {p}");
    }
}

#[test]
fn paged_runs_leave_what_rows_leave() {
    for ps in [1, 7, 64] {
        for cuts in [&CUTS[..], &[1], &[150]] {
            paged_runs_hold(ps, &SEQS, cuts);
        }
    }
}

/// Random sequence lengths, page sizes and run cuts.
#[test]
fn paged_runs_leave_what_rows_leave_on_random_plans() {
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let plans = (
        prop::sample::select(vec![1usize, 2, 3, 7, 16, 64]),
        prop::collection::vec(1usize..90, 1..4),
        prop::collection::vec(1usize..40, 1..8),
    );
    let r = runner.run(&plans, |(ps, lens, cuts)| {
        let seqs: Vec<(SeqId, usize)> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as SeqId * 3 + 1, n))
            .collect();
        paged_runs_hold(ps, &seqs, &cuts);
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// A slot written again in a later step is digested again: a pool written
/// over two steps (the second rewriting positions 5..80 of sequence 1 in
/// layer 0, across pages, row by row) ends with the slot digests and page
/// hashes of a pool that got the same final rows in one step.
#[test]
fn a_later_step_digests_its_slots_again() {
    for ps in [1, 7, 64] {
        let (mut two, mut one) = (paged(ps, &SEQS), paged(ps, &SEQS));
        for &(seq, layer, pos0, len) in &plan(&SEQS, &CUTS) {
            let (k, v) = run_rows(seq, layer, pos0, len, 0);
            two.write_run(seq, layer, pos0, &k, &v);
            one.write_run(seq, layer, pos0, &k, &v);
        }
        two.finish_step();
        let (k, v) = run_rows(1, 0, 5, 75, 1);
        let d = LAYOUT.kv_dim;
        for j in 0..75 {
            let r = j * d..(j + 1) * d;
            two.write(1, 0, 5 + j, &k[r.clone()], &v[r]);
        }
        one.write_run(1, 0, 5, &k, &v);
        two.finish_step();
        one.finish_step();
        for p in 0..one.pool.used_pages() as PageId {
            for s in 0..ps {
                assert_eq!(
                    two.pool.slot_digest(p, s),
                    one.pool.slot_digest(p, s),
                    "page size {ps}: page {p} slot {s}"
                );
            }
            assert_eq!(two.pool.filled(p), one.pool.filled(p), "page {p}");
            assert_eq!(two.pool.page_hash(p), one.pool.page_hash(p), "page {p}");
        }
    }
}

/// A layout in which a step of a few dozen rows is past
/// [`STEP_PARALLEL_FLOATS`], so that `write_step` spreads it over threads.
const STEP_LAYOUT: KvLayout = KvLayout {
    layers: 4,
    kv_dim: 192,
    aux_dim: 0,
};

/// Floats a step of `runs` copies (K and V, every layer).
fn step_floats(runs: &[KvRun]) -> usize {
    2 * STEP_LAYOUT.layers * STEP_LAYOUT.kv_dim * runs.iter().map(|r| r.n).sum::<usize>()
}

/// A step's stacked rows, `(layers, rows, kv_dim)` each for K and V: every
/// float its own value in [1, 2) (K or V, its index and `round` in the
/// mantissa), so a row that lands one slot off, in another layer or from
/// another step shows.
fn stacked(rows: usize, round: u32) -> (Vec<f32>, Vec<f32>) {
    let n = STEP_LAYOUT.layers * rows * STEP_LAYOUT.kv_dim;
    assert!(n < 1 << 20, "{n} floats: the index must fit 20 bits");
    let x =
        |kv: u32, i: usize| f32::from_bits(0x3f80_0000 | (round & 3) << 21 | kv << 20 | i as u32);
    (
        (0..n).map(|i| x(0, i)).collect(),
        (0..n).map(|i| x(1, i)).collect(),
    )
}

/// Runs stacked one after another: `(seq, pos0, n)` each.
fn stack(runs: &[(SeqId, usize, usize)]) -> Vec<KvRun> {
    let mut row0 = 0;
    runs.iter()
        .map(|&(seq, pos0, n)| {
            let r = KvRun { seq, pos0, row0, n };
            row0 += n;
            r
        })
        .collect()
}

/// Writes each step of `steps` (round = its index) into a store one `write`
/// per row, layer-outer and runs in order, and into one store per thread
/// count 1, 2, 3 with `write_step` (on 1 thread) or `write_layers` a layer
/// at a time (2) or two at a time (3); after each step checks
/// ([`assert_same`]) that each holds the per-row store's rows and fresh
/// versions on exactly the blocks the step's runs touched, then calls
/// `after` on the pair.
fn steps_hold<S: KvCache>(
    new: impl Fn() -> S,
    seqs: &[(SeqId, usize)],
    steps: &[Vec<KvRun>],
    mut after: impl FnMut(&mut S, &mut S),
) {
    let threads: Vec<Threads> = (1..=3).map(|n| Threads::new(n).unwrap()).collect();
    let mut rows = new();
    let mut others: Vec<S> = threads.iter().map(|_| new()).collect();
    let (layers, d) = (STEP_LAYOUT.layers, STEP_LAYOUT.kv_dim);
    for (round, runs) in steps.iter().enumerate() {
        let n = runs.iter().map(|r| r.row0 + r.n).max().unwrap_or(0);
        let (k, v) = stacked(n, round as u32);
        let blocks =
            |kv: &S| -> Vec<KvBlocks> { seqs.iter().map(|&(s, _)| kv.blocks(s)).collect() };
        let before = blocks(&rows);
        for l in 0..layers {
            for r in runs {
                for j in 0..r.n {
                    let at = (l * n + r.row0 + j) * d..(l * n + r.row0 + j + 1) * d;
                    rows.write(r.seq, l, r.pos0 + j, &k[at.clone()], &v[at]);
                }
            }
        }
        let touched = |seq: SeqId, blk: usize, bl: usize| {
            runs.iter().any(|r| {
                r.seq == seq && r.n > 0 && r.pos0 / bl <= blk && blk <= (r.pos0 + r.n - 1) / bl
            })
        };
        for (i, (other, th)) in others.iter_mut().zip(&threads).enumerate() {
            let before_other = blocks(other);
            // One thread count writes the step's layers in pieces (as a
            // device step hands each layer over when it completes): one
            // write_layers call per layer, then per two layers.
            match i {
                1 | 2 => {
                    let per = k.len() / layers;
                    let mut l = 0;
                    while l < layers {
                        let e = (l + i).min(layers);
                        other.write_layers(
                            runs,
                            l..e,
                            &k[l * per..e * per],
                            &v[l * per..e * per],
                            th,
                        );
                        l = e;
                    }
                }
                _ => other.write_step(runs, layers, &k, &v, th),
            }
            assert_same(
                &rows,
                other,
                layers,
                seqs,
                [&before, &before_other],
                touched,
            );
            after(&mut rows, other);
        }
    }
}

/// Sequences of a step test: lengths that end mid-block, a one-position
/// sequence, one shorter than a block.
const STEP_SEQS: [(SeqId, usize); 4] = [(1, 150), (2, 1), (3, 71), (4, 20)];

/// Steps over [`STEP_SEQS`]: every sequence written in runs of [`CUTS`]
/// (across 7- and 64-position boundaries), then positions 5..80 of 1 and
/// 60..71 of 3 written again in the same step (the later runs win); a
/// decode step (each sequence's last position); a small step whose runs
/// overlap twice, with a run of no rows. The first is past
/// [`STEP_PARALLEL_FLOATS`], the others are not.
fn step_plans() -> Vec<Vec<KvRun>> {
    let mut prefill = Vec::new();
    for (i, &(seq, len)) in STEP_SEQS.iter().enumerate() {
        let mut pos = 0;
        for &c in CUTS.iter().cycle().skip(i) {
            if pos == len {
                break;
            }
            let m = c.min(len - pos);
            prefill.push((seq, pos, m));
            pos += m;
        }
    }
    prefill.extend([(1, 5, 75), (3, 60, 11)]);
    let decode: Vec<_> = STEP_SEQS.iter().map(|&(s, len)| (s, len - 1, 1)).collect();
    let overlap = [
        (1, 3, 10),
        (3, 60, 8),
        (1, 6, 4),
        (2, 0, 0),
        (3, 63, 3),
        (1, 12, 1),
    ];
    let steps = vec![stack(&prefill), stack(&decode), stack(&overlap)];
    assert!(step_floats(&steps[0]) >= STEP_PARALLEL_FLOATS);
    assert!(step_floats(&steps[2]) < STEP_PARALLEL_FLOATS);
    steps
}

/// A batch decode step just past [`STEP_PARALLEL_FLOATS`]: sequences of 1
/// to 13 positions, each written at its last.
fn decode_batch() -> (Vec<(SeqId, usize)>, Vec<KvRun>) {
    let n = STEP_PARALLEL_FLOATS / (2 * STEP_LAYOUT.layers * STEP_LAYOUT.kv_dim) + 6;
    let seqs: Vec<(SeqId, usize)> = (0..n).map(|i| (10 + i as SeqId, 1 + i * 5 % 13)).collect();
    let runs = stack(
        &seqs
            .iter()
            .map(|&(s, len)| (s, len - 1, 1))
            .collect::<Vec<_>>(),
    );
    assert!(step_floats(&runs) >= STEP_PARALLEL_FLOATS);
    (seqs, runs)
}

#[test]
fn seq_store_write_step_leaves_what_rows_leave_on_any_thread_count() {
    let new = |seqs: &[(SeqId, usize)]| {
        let mut kv = SeqKvStore::new(STEP_LAYOUT);
        for &(seq, len) in seqs {
            kv.prepare(seq, 0, len).unwrap();
        }
        kv
    };
    steps_hold(|| new(&STEP_SEQS), &STEP_SEQS, &step_plans(), |_, _| {});
    let (seqs, runs) = decode_batch();
    steps_hold(|| new(&seqs), &seqs, &[runs], |_, _| {});
}

#[test]
fn the_provided_write_step_is_the_row_loop() {
    let new = || {
        let mut kv = PerRow(SeqKvStore::new(STEP_LAYOUT));
        for &(seq, len) in &STEP_SEQS {
            kv.prepare(seq, 0, len).unwrap();
        }
        kv
    };
    steps_hold(new, &STEP_SEQS, &step_plans(), |_, _| {});
}

/// The pools also end each step with the same slot digests and page hashes.
#[test]
fn paged_write_step_leaves_what_rows_leave_on_any_thread_count() {
    let (seqs, runs) = decode_batch();
    for ps in [1, 7, 64] {
        steps_hold(
            || paged_in(STEP_LAYOUT, ps, &STEP_SEQS),
            &STEP_SEQS,
            &step_plans(),
            assert_same_digests,
        );
        steps_hold(
            || paged_in(STEP_LAYOUT, ps, &seqs),
            &seqs,
            std::slice::from_ref(&runs),
            assert_same_digests,
        );
    }
}

/// Random sequence lengths, page sizes and runs (anywhere in a sequence,
/// so runs of a step overlap at times).
#[test]
fn paged_write_step_leaves_what_rows_leave_on_random_steps() {
    let mut runner = TestRunner::new(Config {
        cases: 32,
        failure_persistence: None,
        ..Config::default()
    });
    let plans = (
        prop::sample::select(vec![1usize, 3, 7, 64]),
        prop::collection::vec(1usize..90, 1..5),
        prop::collection::vec((0usize..5, 0usize..90, 0usize..40), 1..12),
    );
    let r = runner.run(&plans, |(ps, lens, picks)| {
        let seqs: Vec<(SeqId, usize)> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as SeqId * 3 + 1, n))
            .collect();
        let runs: Vec<(SeqId, usize, usize)> = picks
            .iter()
            .map(|&(i, pos, n)| {
                let (seq, len) = seqs[i % seqs.len()];
                let pos0 = pos % len;
                (seq, pos0, n.min(len - pos0))
            })
            .collect();
        steps_hold(
            || paged_in(STEP_LAYOUT, ps, &seqs),
            &seqs,
            &[stack(&runs)],
            assert_same_digests,
        );
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}
