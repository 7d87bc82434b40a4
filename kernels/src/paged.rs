//! The layout of a KV page as the CUDA resident path stores it (plain data,
//! with no CUDA dependency, so the host-side page bookkeeping that uses it is
//! built and tested everywhere).

/// The shape of one device KV page: per layer, `page_len` K rows, then
/// `page_len` V rows (`kv_dim` floats each), then `page_len` auxiliary rows
/// (`aux_dim` floats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLayout {
    pub page_len: usize,
    pub layers: usize,
    pub kv_dim: usize,
    pub aux_dim: usize,
}

impl PageLayout {
    /// Floats of one layer of a page.
    pub fn layer_floats(&self) -> usize {
        self.page_len * (2 * self.kv_dim + self.aux_dim)
    }
    /// Floats of a whole page.
    pub fn page_floats(&self) -> usize {
        self.layers * self.layer_floats()
    }
}
