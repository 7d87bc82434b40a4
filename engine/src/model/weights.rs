//! Model files and tensor storage.
//!
//! [`ModelFiles`] holds the three files of an HF directory: `model.safetensors`
//! memory-mapped (or generated in memory by [`crate::synth`]), the two JSON files
//! read whole. [`Tensor`] is a typed view into that storage: f32 and bf16 are
//! used in place when aligned (bf16 widens to f32 exactly inside the kernels);
//! f16 is widened to f32 once at load; GGUF block-quantized matrices (stored by
//! `import-gguf --dtype keep` as `U8` tensors of shape `(rows, row bytes)`, the
//! format named in the safetensors metadata key `lmrr.quant.<name>`) are used
//! in place and dequantized inside the kernels. Every tensor is checked for
//! name, dtype and shape against what the model expects, with errors naming
//! all three.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lmrr_kernels::{Matrix, QuantKind, Weights};

use crate::EngineError;

/// Bytes of `model.safetensors`.
pub enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// The files of a model, from disk or memory.
pub struct ModelFiles {
    pub config: Vec<u8>,
    pub config_path: PathBuf,
    pub tokenizer: Vec<u8>,
    pub tokenizer_path: PathBuf,
    pub weights: Arc<Backing>,
    pub weights_path: PathBuf,
    /// Human description of the origin (directory or generator).
    pub origin: String,
    /// `tokenizer_config.json`, when the directory has one (chat template).
    pub tokenizer_config: Option<(Vec<u8>, PathBuf)>,
}

fn read(path: &Path) -> Result<Vec<u8>, EngineError> {
    std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.into(),
        source,
    })
}

impl ModelFiles {
    /// Opens `dir/config.json`, `dir/tokenizer.json` and maps `dir/model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self, EngineError> {
        if crate::gguf::is_gguf_file(dir) {
            return Err(EngineError::GgufAsModel { path: dir.into() });
        }
        if !dir.is_dir() {
            let why = if dir.exists() {
                "not a directory (a model is a directory with config.json, model.safetensors and tokenizer.json)"
            } else {
                "no such directory"
            };
            return Err(EngineError::Io {
                path: dir.into(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, why),
            });
        }
        let need = |file: &'static str| {
            let p = dir.join(file);
            if p.is_file() {
                Ok(p)
            } else {
                Err(EngineError::MissingFile {
                    dir: dir.into(),
                    file,
                })
            }
        };
        let config_path = need("config.json")?;
        let tokenizer_path = need("tokenizer.json")?;
        let weights_path = need("model.safetensors")?;
        let f = std::fs::File::open(&weights_path).map_err(|source| EngineError::Io {
            path: weights_path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; a file truncated by another process while
        // mapped is outside what any reader can defend against (as in every
        // mmap-based loader). Bounds are still checked by safetensors' parser.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| EngineError::Io {
            path: weights_path.clone(),
            source,
        })?;
        let tc_path = dir.join("tokenizer_config.json");
        let tokenizer_config = if tc_path.is_file() {
            Some((read(&tc_path)?, tc_path))
        } else {
            None
        };
        Ok(Self {
            tokenizer_config,
            config: read(&config_path)?,
            config_path,
            tokenizer: read(&tokenizer_path)?,
            tokenizer_path,
            weights: Arc::new(Backing::Mapped(map)),
            weights_path,
            origin: dir.display().to_string(),
        })
    }

    /// Files held in memory; `name` is used in paths of messages.
    pub fn in_memory(name: &str, config: Vec<u8>, tokenizer: Vec<u8>, weights: Vec<u8>) -> Self {
        let base = PathBuf::from(name);
        Self {
            config,
            config_path: base.join("config.json"),
            tokenizer,
            tokenizer_path: base.join("tokenizer.json"),
            weights: Arc::new(Backing::Owned(weights)),
            weights_path: base.join("model.safetensors"),
            origin: name.to_string(),
            tokenizer_config: None,
        }
    }

    /// The raw weight bytes.
    pub fn weight_bytes(&self) -> &[u8] {
        self.weights.bytes()
    }
}

/// One tensor to write: name, dtype, shape, little-endian element bytes.
pub type TensorBytes = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Serialises `tensors` and `metadata` as a `model.safetensors` file, the same
/// bytes on every run: the header is JSON with keys in sorted order (the
/// `safetensors` crate takes the metadata as a `HashMap` and writes it in that
/// map's per-process random order), and the data is laid out by descending
/// element size, then name, so every F32 tensor starts 4-byte aligned (the
/// header is padded with spaces to a multiple of 8, as the format requires).
pub fn write_safetensors(
    tensors: &[TensorBytes],
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<u8>, String> {
    use serde_json::{json, Map, Value};
    let mut order: Vec<&TensorBytes> = tensors.iter().collect();
    order.sort_by(|a, b| b.1.bitsize().cmp(&a.1.bitsize()).then(a.0.cmp(&b.0)));
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in &order {
        let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let expected = elements.and_then(|n| n.checked_mul(dtype.bitsize()).map(|b| b / 8));
        if expected != Some(bytes.len()) || dtype.bitsize() % 8 != 0 {
            return Err(format!(
                "tensor `{name}`: {} bytes for {dtype:?} of shape {shape:?}",
                bytes.len()
            ));
        }
        if header.contains_key(name.as_str()) {
            return Err(format!("tensor `{name}` appears twice"));
        }
        let dtype = serde_json::to_value(dtype).map_err(|e| e.to_string())?;
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    // serde_json's map is ordered by key: the header text is canonical.
    let mut text = serde_json::to_vec(&Value::Object(header)).map_err(|e| e.to_string())?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend((text.len() as u64).to_le_bytes());
    out.extend(text);
    for (_, _, _, bytes) in order {
        out.extend_from_slice(bytes);
    }
    Ok(out)
}

/// Element storage of a tensor.
enum Data {
    /// `len` elements of `T` at byte offset `off` of the backing (aligned).
    Mapped {
        backing: Arc<Backing>,
        off: usize,
        len: usize,
    },
    F32(Vec<f32>),
    U16(Vec<u16>),
}

/// Storage dtype as used by the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    /// GGUF blocks, `kind.row_bytes(cols)` bytes per row.
    Quant(QuantKind),
}

/// A loaded tensor (row-major).
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    data: Data,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?} {:?})", self.name, self.shape, self.dtype)
    }
}

/// Exact f16 → f32 (the kernels' definition, shared with the GGUF importer).
pub use lmrr_kernels::f16_to_f32;

impl Tensor {
    fn typed<T>(&self) -> &[T] {
        match &self.data {
            Data::Mapped { backing, off, len } => {
                let b = &backing.bytes()[*off..*off + len * std::mem::size_of::<T>()];
                // SAFETY: alignment of `off` for `T` was checked at load, the
                // range is in bounds (sliced above), and f32/u16 accept any bits.
                unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, *len) }
            }
            Data::F32(v) => {
                // SAFETY: only called with T = f32 for this variant (see `weights`).
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const T, v.len()) }
            }
            Data::U16(v) => {
                // SAFETY: only called with T = u16 for this variant (see `weights`).
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const T, v.len()) }
            }
        }
    }

    /// The kernel view of this tensor.
    pub fn weights(&self) -> Weights<'_> {
        match self.dtype {
            DType::F32 => Weights::F32(self.typed::<f32>()),
            DType::Bf16 => Weights::Bf16(self.typed::<u16>()),
            DType::Quant(kind) => Weights::Quant(kind, self.typed::<u8>()),
        }
    }

    /// As a `(shape[0], shape[1])` matrix.
    pub fn matrix(&self) -> Matrix<'_> {
        let (r, c) = (self.shape[0], self.shape.get(1).copied().unwrap_or(1));
        // Shape was checked against the element count at load.
        Matrix::new(self.weights(), r, c).expect("tensor shape matches its length")
    }

    /// Row `r` of a matrix, widened to f32 (embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.matrix().row_into(r, out, true);
    }

    /// All elements widened to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.weights() {
            Weights::F32(s) => s.to_vec(),
            Weights::Bf16(s) => s
                .iter()
                .map(|&b| lmrr_kernels::matmul::bf16_to_f32(b))
                .collect(),
            Weights::Quant(kind, s) => {
                let mut out = vec![0.0; kind.weights_in(s.len())];
                lmrr_kernels::dequant(kind, s, &mut out);
                out
            }
        }
    }

    /// Bytes the kernels stream to read this tensor once.
    pub fn nbytes(&self) -> usize {
        let n: usize = self.shape.iter().product();
        match self.dtype {
            DType::F32 => n * 4,
            DType::Bf16 => n * 2,
            DType::Quant(kind) => n / kind.block_weights() * kind.block_bytes(),
        }
    }
}

/// Parsed `model.safetensors`: the tensor table, checked on every lookup.
pub struct TensorFile<'a> {
    files: &'a ModelFiles,
    st: safetensors::SafeTensors<'a>,
    /// The header's free-form metadata (block formats of quantized tensors).
    meta: std::collections::HashMap<String, String>,
}

impl<'a> TensorFile<'a> {
    pub fn parse(files: &'a ModelFiles) -> Result<Self, EngineError> {
        let st = safetensors::SafeTensors::deserialize(files.weight_bytes()).map_err(|e| {
            EngineError::SafeTensors {
                path: files.weights_path.clone(),
                msg: e.to_string(),
            }
        })?;
        let meta = safetensors::SafeTensors::read_metadata(files.weight_bytes())
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .unwrap_or_default();
        Ok(Self { files, st, meta })
    }

    /// Loads tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        let path = &self.files.weights_path;
        let view = self
            .st
            .tensor(name)
            .map_err(|_| EngineError::MissingTensor {
                path: path.clone(),
                name: name.into(),
            })?;
        if view.dtype() == safetensors::Dtype::U8 {
            return self.get_quant(name, shape, view);
        }
        if view.shape() != shape {
            return Err(EngineError::TensorShape {
                path: path.clone(),
                name: name.into(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        let bytes = view.data();
        let base = self.files.weight_bytes().as_ptr() as usize;
        let off = bytes.as_ptr() as usize - base;
        let len: usize = shape.iter().product();
        let mapped = |elem: usize| Data::Mapped {
            backing: self.files.weights.clone(),
            off,
            len: bytes.len() / elem,
        };
        let le_u16 = || {
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
        };
        let (dtype, data) = match view.dtype() {
            safetensors::Dtype::F32
                if bytes.as_ptr() as usize % 4 == 0 && cfg!(target_endian = "little") =>
            {
                (DType::F32, mapped(4))
            }
            safetensors::Dtype::F32 => (
                DType::F32,
                Data::F32(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
            ),
            safetensors::Dtype::BF16
                if bytes.as_ptr() as usize % 2 == 0 && cfg!(target_endian = "little") =>
            {
                (DType::Bf16, mapped(2))
            }
            safetensors::Dtype::BF16 => (DType::Bf16, Data::U16(le_u16().collect())),
            safetensors::Dtype::F16 => (DType::F32, Data::F32(le_u16().map(f16_to_f32).collect())),
            other => {
                return Err(EngineError::TensorDtype {
                    path: path.clone(),
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let t = Tensor {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
            data,
        };
        debug_assert_eq!(t.weights_len(), len);
        Ok(t)
    }

    /// A `U8` tensor holding GGUF blocks of a `(rows, cols)` matrix; its format
    /// comes from the metadata key `lmrr.quant.<name>`.
    fn get_quant(
        &self,
        name: &str,
        shape: &[usize],
        view: safetensors::tensor::TensorView<'a>,
    ) -> Result<Tensor, EngineError> {
        let path = &self.files.weights_path;
        let key = crate::gguf::quant_meta_key(name);
        let kind = self
            .meta
            .get(&key)
            .and_then(|k| QuantKind::parse(k))
            .ok_or_else(|| EngineError::TensorDtype {
                path: path.clone(),
                name: name.into(),
                dtype: format!(
                    "U8 without a block format (metadata `{key}` = {:?}; expected one of {})",
                    self.meta.get(&key),
                    QuantKind::ALL.map(QuantKind::name).join(", ")
                ),
            })?;
        let expected = match shape {
            [rows, cols] if cols % kind.block_weights() == 0 => {
                vec![*rows, kind.row_bytes(*cols)]
            }
            _ => {
                return Err(EngineError::TensorDtype {
                    path: path.clone(),
                    name: name.into(),
                    dtype: format!(
                        "{} for a tensor of shape {shape:?} (needs a matrix with columns a multiple of {})",
                        kind.name(),
                        kind.block_weights()
                    ),
                })
            }
        };
        if view.shape() != expected {
            return Err(EngineError::TensorShape {
                path: path.clone(),
                name: name.into(),
                expected,
                found: view.shape().to_vec(),
            });
        }
        let bytes = view.data();
        let off = bytes.as_ptr() as usize - self.files.weight_bytes().as_ptr() as usize;
        Ok(Tensor {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::Quant(kind),
            data: Data::Mapped {
                backing: self.files.weights.clone(),
                off,
                len: bytes.len(),
            },
        })
    }
}

impl Tensor {
    fn weights_len(&self) -> usize {
        match self.weights() {
            Weights::F32(s) => s.len(),
            Weights::Bf16(s) => s.len(),
            Weights::Quant(kind, s) => kind.weights_in(s.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::f16_to_f32;

    #[test]
    fn f16_widening_is_exact() {
        // Independent expectations: values exactly representable in f16.
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24)); // smallest subnormal
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24)); // largest subnormal
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }
}
