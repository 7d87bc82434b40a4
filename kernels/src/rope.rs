//! Rotary position embedding, HF "rotate_half" convention: for `i < d/2`,
//! `y[i] = x[i]·c − x[i+d/2]·s` and `y[i+d/2] = x[i+d/2]·c + x[i]·s`, each
//! product rounded, no fma.
//!
//! The cos/sin table is computed once on the host in f64 and rounded to f32:
//! `inv_freq[i] = θ^(−2i/d)`, angle `= pos · inv_freq[i]`, entries
//! `cos(angle) · a` and `sin(angle) · a` with the attention factor `a` (1 by
//! default, which leaves every bit as it is; YaRN's scales the table). RoPE
//! scaling (linear, llama3, YaRN) changes only the inverse frequencies and
//! `a`; the engine computes those in f64 as well and builds the table with
//! [`RopeTable::from_inv_freq`]. Every device reads
//! the same table, so no device ever evaluates a transcendental for RoPE.
//! `pow`, `cos` and `sin` come from the pure-Rust `libm` crate (version pinned
//! in the workspace), never from the platform's C library, whose results
//! differ between glibc, musl and macOS: the table has the same bits on every
//! platform. `kernels/tests/it/rope_table.rs` pins them against an independent,
//! correctly rounded computation (`rope_table_reference.py`).

/// Host-computed cos/sin table, `(max_pos, head_dim / 2)` each.
#[derive(Debug, Clone)]
pub struct RopeTable {
    half: usize,
    max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for positions `0..max_pos`. `head_dim` must be even.
    pub fn new(head_dim: usize, theta: f64, max_pos: usize) -> Self {
        assert!(
            head_dim.is_multiple_of(2) && head_dim > 0,
            "rope: head_dim must be even"
        );
        Self::from_inv_freq(&default_inv_freq(head_dim, theta), 1.0, max_pos)
    }

    /// Builds the table for positions `0..max_pos` from the inverse frequency
    /// of each rotated pair (`head_dim / 2` of them) and the attention factor
    /// that multiplies every cos and sin (before the rounding to f32).
    pub fn from_inv_freq(inv_freq: &[f64], attention_factor: f64, max_pos: usize) -> Self {
        assert!(!inv_freq.is_empty(), "rope: no frequencies");
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &f in inv_freq {
                let a = p as f64 * f;
                cos.push((libm::cos(a) * attention_factor) as f32);
                sin.push((libm::sin(a) * attention_factor) as f32);
            }
        }
        Self {
            half,
            max_pos,
            cos,
            sin,
        }
    }

    /// Positions covered.
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Head dimension the table was built for.
    pub fn head_dim(&self) -> usize {
        self.half * 2
    }

    /// The whole tables, `(cos, sin)`, each `(max_pos, head_dim / 2)` row-major.
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    pub(crate) fn row(&self, pos: usize) -> (&[f32], &[f32]) {
        assert!(
            pos < self.max_pos,
            "rope: position {pos} beyond table ({})",
            self.max_pos
        );
        let r = pos * self.half..(pos + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

/// The unscaled inverse frequencies `θ^(−2i/d)` for `i < d/2`, in f64 by
/// `libm` (the definition every table starts from).
pub fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| libm::pow(theta, -((2 * i) as f64) / head_dim as f64))
        .collect()
}

/// Scalar reference: rotates every head of `x` (`[heads · head_dim]`) in place.
pub fn rope_ref(table: &RopeTable, x: &mut [f32], pos: usize) {
    let d = table.head_dim();
    assert_eq!(x.len() % d, 0, "rope: input not a whole number of heads");
    let (c, s) = table.row(pos);
    let h = d / 2;
    for head in x.chunks_mut(d) {
        for i in 0..h {
            let (a, b) = (head[i], head[i + h]);
            head[i] = a * c[i] - b * s[i];
            head[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// Fast path, bitwise equal to [`rope_ref`].
pub fn rope(table: &RopeTable, x: &mut [f32], pos: usize) {
    let d = table.head_dim();
    assert_eq!(x.len() % d, 0, "rope: input not a whole number of heads");
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        let (c, s) = table.row(pos);
        for head in x.chunks_mut(d) {
            // SAFETY: AVX2+FMA detected; `head` has `d` elements, `c`/`s` `d/2`.
            unsafe { avx2(head, c, s) };
        }
        return;
    }
    rope_ref(table, x, pos)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(head: &mut [f32], c: &[f32], s: &[f32]) {
    use std::arch::x86_64::*;
    let h = c.len();
    let (lo, hi) = head.split_at_mut(h);
    let mut i = 0;
    while i + 8 <= h {
        let a = _mm256_loadu_ps(lo.as_ptr().add(i));
        let b = _mm256_loadu_ps(hi.as_ptr().add(i));
        let cv = _mm256_loadu_ps(c.as_ptr().add(i));
        let sv = _mm256_loadu_ps(s.as_ptr().add(i));
        _mm256_storeu_ps(
            lo.as_mut_ptr().add(i),
            _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)),
        );
        _mm256_storeu_ps(
            hi.as_mut_ptr().add(i),
            _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)),
        );
        i += 8;
    }
    for j in i..h {
        let (a, b) = (lo[j], hi[j]);
        lo[j] = a * c[j] - b * s[j];
        hi[j] = b * c[j] + a * s[j];
    }
}
