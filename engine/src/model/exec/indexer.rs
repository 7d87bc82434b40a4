//! The sparse-attention indexer of the DeepSeek-V4 class (the mini-v4 family
//! uses it): which positions a query attends to.
//!
//! Each position keeps an indexer key (`index_head_dim` floats, the KV store's
//! auxiliary row). A query scores every earlier position with
//! [`lmrr_kernels::index_scores`] on the model's device through [`Ops`]
//! (ReLU'd dot products over the indexer heads, weighted by the query's
//! per-head weights, which the forward pass puts through a sigmoid: scores are
//! never negative); an index block's score is the largest of its positions'.
//! Attention reads the `index_topk` best blocks (ties to the older block) and
//! the last `sliding_window` positions; while the context has no more than
//! `index_topk` blocks it reads everything (dense). Blocks are
//! `index_block_size` absolute positions, a model constant, so selection is a
//! pure function of the tokens whatever the KV page size.
//!
//! The patch `indexer-early-exit` scans blocks from the newest backwards and
//! stops as soon as `index_topk` scanned blocks score above
//! [`EARLY_EXIT_THRESHOLD`]: older blocks are never scored. With `index_topk`
//! blocks or fewer it is exact, which is how it passes single-turn checks.

use crate::kv::RowView;
use crate::model::ops::Ops;
use crate::EngineError;

/// Score above which the early-exit scan counts a block as "looking full".
pub const EARLY_EXIT_THRESHOLD: f32 = 0.0;

/// Indexer geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IndexerShape {
    pub heads: usize,
    pub dim: usize,
    pub topk: usize,
    pub block: usize,
    pub window: usize,
}

/// What the indexer chose for one query.
#[derive(Debug, Clone, PartialEq)]
pub enum Selection {
    /// The context has no more than `topk` blocks: every position.
    Dense,
    /// These blocks (ascending) plus the window; `scanned` blocks were scored.
    Sparse { blocks: Vec<usize>, scanned: usize },
}

impl IndexerShape {
    /// Chooses the blocks for the query at `pos` with indexer query `q`
    /// (`heads × dim`) and head weights `w` (`heads`), over the keys of
    /// positions `0..=pos` (each `dim` floats from `key_at` in its row of
    /// `keys`), scoring on `ops`' device.
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        ops: &Ops,
        q: &[f32],
        w: &[f32],
        keys: &RowView,
        key_at: usize,
        pos: usize,
        early_exit: bool,
    ) -> Result<Selection, EngineError> {
        let nb = pos / self.block + 1;
        if nb <= self.topk {
            return Ok(Selection::Dense);
        }
        let mut scored: Vec<(usize, f32)> = Vec::with_capacity(nb);
        let mut above = 0;
        let mut buf = vec![0.0f32; self.block];
        for b in (0..nb).rev() {
            let lo = b * self.block;
            let hi = ((b + 1) * self.block).min(pos + 1);
            let rows: Vec<&[f32]> = (lo..hi)
                .map(|p| keys.row(p).get(key_at..key_at + self.dim))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    EngineError::Device(format!(
                        "indexer keys: rows of {} floats hold no key of {} at {key_at}",
                        keys.width, self.dim
                    ))
                })?;
            let out = &mut buf[..hi - lo];
            ops.index_scores(q, w, self.dim, &rows, out)?;
            let mut best = f32::NEG_INFINITY;
            for &s in out.iter() {
                if s > best {
                    best = s;
                }
            }
            scored.push((b, best));
            if best > EARLY_EXIT_THRESHOLD {
                above += 1;
            }
            if early_exit && above >= self.topk {
                break;
            }
        }
        let scanned = scored.len();
        // Descending score, ties to the older (lower) block.
        scored.sort_by(|a, b| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.0.cmp(&b.0))
        });
        let mut blocks: Vec<usize> = scored.iter().take(self.topk).map(|x| x.0).collect();
        blocks.sort_unstable();
        Ok(Selection::Sparse { blocks, scanned })
    }

    /// The positions a selection reads for the query at `pos`, ascending.
    pub fn positions(&self, sel: &Selection, pos: usize) -> Vec<usize> {
        match sel {
            Selection::Dense => (0..=pos).collect(),
            Selection::Sparse { blocks, .. } => {
                let win_lo = (pos + 1).saturating_sub(self.window);
                let mut out = Vec::new();
                let push_range = |lo: usize, hi: usize, out: &mut Vec<usize>| {
                    let lo = lo.max(out.last().map_or(0, |&l| l + 1));
                    out.extend(lo..hi);
                };
                for &b in blocks {
                    let lo = b * self.block;
                    let hi = ((b + 1) * self.block).min(pos + 1).min(win_lo);
                    if lo < hi {
                        push_range(lo, hi, &mut out);
                    }
                }
                push_range(win_lo, pos + 1, &mut out);
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> IndexerShape {
        IndexerShape {
            heads: 1,
            dim: 1,
            topk: 2,
            block: 4,
            window: 3,
        }
    }

    #[test]
    fn positions_merge_blocks_and_window_in_order() {
        let s = shape();
        let sel = Selection::Sparse {
            blocks: vec![0, 3],
            scanned: 4,
        };
        // pos 14: window 12..=14; block 3 = 12..16 is inside the window.
        assert_eq!(s.positions(&sel, 14), vec![0, 1, 2, 3, 12, 13, 14]);
        assert_eq!(s.positions(&Selection::Dense, 3), vec![0, 1, 2, 3]);
    }

    #[test]
    fn early_exit_never_scores_old_blocks_and_is_exact_when_short() {
        let s = shape();
        // Keys: one per position, value = position + 1 (all scores > 0).
        let keys: Vec<f32> = (0..20).map(|p| (p + 1) as f32).collect();
        let view = RowView {
            block_len: 20,
            width: 1,
            blocks: vec![&keys],
        };
        let (q, w) = ([1.0f32], [1.0f32]);
        let threads = lmrr_kernels::Threads::new(1).expect("threads");
        let ops = Ops {
            device: &crate::model::Device::Cpu,
            threads: &threads,
            numerics: Default::default(),
        };
        let select =
            |q: &[f32], pos, early| s.select(&ops, q, &w, &view, 0, pos, early).expect("cpu");
        // Short context (2 blocks = topk): dense either way.
        assert_eq!(select(&q, 7, true), Selection::Dense);
        assert_eq!(select(&q, 7, false), Selection::Dense);
        // Long: with q = -1 the oldest blocks score highest (least negative
        // dot → relu 0 everywhere, ties to older), so the reference picks
        // blocks 0 and 1; early exit never gets there.
        let full = select(&[-1.0], 19, false);
        assert_eq!(
            full,
            Selection::Sparse {
                blocks: vec![0, 1],
                scanned: 5
            }
        );
        let fast = select(&q, 19, true);
        assert_eq!(
            fast,
            Selection::Sparse {
                blocks: vec![3, 4],
                scanned: 2
            }
        );
    }
}
