//! The device mirror's view of a KV store ([`KvCache::blocks`]): keys name a
//! block's storage, versions move on every write and never repeat, so a
//! mirror that kept a block at version `v` holds the host's rows exactly
//! while the host still says `v`. Checked on both stores, with the rows that
//! `block_rows` hands out for an upload.

use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
use lmrr_engine::{KvCache, KvLayout, SeqKvStore};

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
    // A sequence dropped and made again gets new keys.
    kv.remove(7);
    kv.prepare(7, 0, 1).unwrap();
    assert_ne!(kv.blocks(7).blocks[0].0, b3.blocks[0].0);
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
