//! Radix prefix cache over token ids, at page granularity (after SGLang's
//! RadixCache with `page_size > 1`, and vLLM's block-level prefix caching).
//!
//! Each node below the root stands for one *full* page: its key is the page's
//! `page_size` token ids, its value the pool page holding their K/V. A path from
//! the root spells a token prefix. Only full pages enter the tree, so a cached
//! page is immutable: nobody ever writes a position of it again.
//!
//! Invariants: the tree holds exactly one reference on each of its pages; a
//! leaf whose page has no other reference (refcount 1) is evictable; eviction
//! picks the least recently used such leaf, ties by node id — a logical clock,
//! never the wall clock. The structure hash is a Merkle hash over (key, page
//! content hash, children in key order), so it depends on what is cached, not
//! on node ids or insertion order.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::pool::{Hash, PageId, PagePool};

type NodeId = usize;

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    pub pages: Vec<PageId>,
    pub tokens: usize,
}

#[derive(Debug)]
struct Node {
    parent: Option<NodeId>,
    key: Vec<u32>,
    page: PageId,
    children: BTreeMap<Vec<u32>, NodeId>,
    last_use: u64,
}

/// The prefix tree.
#[derive(Debug, Default)]
pub struct RadixCache {
    nodes: Vec<Option<Node>>,
    free_slots: Vec<NodeId>,
    root: BTreeMap<Vec<u32>, NodeId>,
    clock: u64,
}

impl RadixCache {
    pub fn new() -> Self {
        Self::default()
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn children(&self, parent: Option<NodeId>) -> &BTreeMap<Vec<u32>, NodeId> {
        match parent {
            None => &self.root,
            Some(p) => &self.node(p).children,
        }
    }

    /// Pages caching the longest prefix of `tokens` found in the tree, and the
    /// number of tokens they cover; with `touch`, marks the path as used. Does
    /// not take references. The reference engine only ever caches full pages,
    /// so `tokens` is then `pages.len() · page_size`; a partial leaf (only the
    /// `abort-inserts-partial` patch creates them) extends a match by its key.
    pub fn match_prefix(&mut self, tokens: &[u32], page_size: usize, touch: bool) -> Match {
        if touch {
            self.clock += 1;
        }
        let mut out = Vec::new();
        let mut at: Option<NodeId> = None;
        for key in tokens.chunks_exact(page_size) {
            let Some(&id) = self.children(at).get(key) else {
                break;
            };
            out.push(self.node(id).page);
            if touch {
                if let Some(n) = self.nodes[id].as_mut() {
                    n.last_use = self.clock;
                }
            }
            at = Some(id);
        }
        let mut matched = out.len() * page_size;
        {
            let rest = &tokens[matched..];
            let partial = self
                .children(at)
                .iter()
                .find(|(k, _)| k.len() < page_size && !k.is_empty() && rest.starts_with(k))
                .map(|(k, &id)| (k.len(), id));
            if let Some((len, id)) = partial {
                out.push(self.node(id).page);
                matched += len;
                if touch {
                    if let Some(n) = self.nodes[id].as_mut() {
                        n.last_use = self.clock;
                    }
                }
            }
        }
        Match {
            pages: out,
            tokens: matched,
        }
    }

    /// Adds a leaf holding a *partial* page (`key` shorter than a page) under
    /// the full-page path `prefix` — only the `abort-inserts-partial` patch does
    /// this. Takes a reference on `page`. Returns whether a node was added.
    pub fn insert_partial(
        &mut self,
        prefix: &[u32],
        key: &[u32],
        page: PageId,
        pool: &mut PagePool,
    ) -> bool {
        let ps = pool.page_size();
        if key.is_empty() || key.len() >= ps {
            return false;
        }
        let mut at: Option<NodeId> = None;
        for k in prefix.chunks_exact(ps) {
            match self.children(at).get(k) {
                Some(&id) => at = Some(id),
                None => return false,
            }
        }
        if self.children(at).contains_key(key) {
            return false;
        }
        self.clock += 1;
        let node = Node {
            parent: at,
            key: key.to_vec(),
            page,
            children: BTreeMap::new(),
            last_use: self.clock,
        };
        self.add_node(at, node);
        pool.incref(page);
        true
    }

    /// Caches the full pages of `tokens` (`pages[i]` holds positions
    /// `i·P..(i+1)·P`). Pages already cached under the same prefix are kept; new
    /// nodes take one reference on their page. Returns the number of new nodes.
    pub fn insert(&mut self, tokens: &[u32], pages: &[PageId], pool: &mut PagePool) -> usize {
        let ps = pool.page_size();
        self.clock += 1;
        let mut at: Option<NodeId> = None;
        let mut added = 0;
        for (key, &page) in tokens.chunks_exact(ps).zip(pages) {
            let existing = self.children(at).get(key).copied();
            let id = match existing {
                Some(id) => id,
                None => {
                    let node = Node {
                        parent: at,
                        key: key.to_vec(),
                        page,
                        children: BTreeMap::new(),
                        last_use: 0,
                    };
                    let id = self.add_node(at, node);
                    pool.incref(page);
                    added += 1;
                    id
                }
            };
            if let Some(n) = self.nodes[id].as_mut() {
                n.last_use = self.clock;
            }
            at = Some(id);
        }
        added
    }

    /// Evicts least-recently-used leaves whose page only the tree holds, until
    /// `want` pages have been freed or nothing is evictable. Returns pages freed.
    pub fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize {
        let mut freed = 0;
        while freed < want {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
                .filter(|(_, n)| n.children.is_empty() && pool.refcount(n.page) == 1)
                .min_by_key(|(id, n)| (n.last_use, *id))
                .map(|(id, _)| id);
            let Some(id) = victim else { break };
            self.remove_leaf(id, pool);
            freed += 1;
        }
        freed
    }

    /// Stores `node` (whose `parent` is `at`) and links it under its key.
    fn add_node(&mut self, at: Option<NodeId>, node: Node) -> NodeId {
        let key = node.key.clone();
        let id = match self.free_slots.pop() {
            Some(s) => {
                self.nodes[s] = Some(node);
                s
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        match at {
            None => self.root.insert(key, id),
            Some(p) => self.nodes[p]
                .as_mut()
                .expect("live parent")
                .children
                .insert(key, id),
        };
        id
    }

    fn remove_leaf(&mut self, id: NodeId, pool: &mut PagePool) {
        let node = self.nodes[id].take().expect("live leaf");
        match node.parent {
            None => self.root.remove(&node.key),
            Some(p) => self.nodes[p]
                .as_mut()
                .expect("live parent")
                .children
                .remove(&node.key),
        };
        self.free_slots.push(id);
        pool.decref(node.page);
    }

    /// Pages that [`Self::evict`] could free now, leaves first, never touching a
    /// page in `protect` (or its ancestors, which stay interior).
    pub fn evictable(&self, pool: &PagePool, protect: &[PageId]) -> usize {
        fn rec(
            t: &RadixCache,
            children: &BTreeMap<Vec<u32>, NodeId>,
            pool: &PagePool,
            protect: &[PageId],
        ) -> (bool, usize) {
            let mut all = true;
            let mut count = 0;
            for &id in children.values() {
                let n = t.node(id);
                let (sub_all, sub_count) = rec(t, &n.children, pool, protect);
                count += sub_count;
                if sub_all && pool.refcount(n.page) == 1 && !protect.contains(&n.page) {
                    count += 1;
                } else {
                    all = false;
                }
            }
            (all, count)
        }
        rec(self, &self.root, pool, protect).1
    }

    /// Number of cached pages.
    pub fn len(&self) -> usize {
        self.nodes.iter().filter(|n| n.is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every cached page.
    pub fn pages(&self) -> Vec<PageId> {
        self.nodes.iter().flatten().map(|n| n.page).collect()
    }

    /// Merkle hash of the tree: what is cached, and with `content` the page
    /// content hashes too.
    pub fn structure_hash(&self, pool: &PagePool, content: bool) -> Hash {
        fn rec(
            t: &RadixCache,
            children: &BTreeMap<Vec<u32>, NodeId>,
            pool: &PagePool,
            content: bool,
        ) -> Hash {
            let mut h = Sha256::new();
            h.update((children.len() as u64).to_le_bytes());
            for (key, &id) in children {
                let n = t.node(id);
                for tok in key {
                    h.update(tok.to_le_bytes());
                }
                if content {
                    h.update(pool.page_hash(n.page));
                }
                h.update(rec(t, &n.children, pool, content));
            }
            h.finalize().into()
        }
        rec(self, &self.root, pool, content)
    }
}
