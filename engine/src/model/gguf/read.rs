//! The GGUF (v2, v3) reader.
//!
//! It treats the file as untrusted: every count, string length, array
//! length, dimension and offset is checked against a named limit or the file
//! size before anything is allocated. Types are named as ggml names them
//! (`Q6_K`, never its id 14; an id ggml does not have either is "type 99
//! (unknown)"). Dequantization is exact and fixed: F16/BF16 widen exactly;
//! block formats follow the kernels' single definition
//! ([`lmrr_kernels::kquant`]), bit for bit gguf-py's.

use std::collections::BTreeMap;
use std::path::Path;

use lmrr_kernels::{BlockFormat, QuantKind};

use crate::EngineError;

/// Largest number of tensors or metadata entries accepted (SmolLM2 has 272 and 33).
pub const MAX_ENTRIES: u64 = 1 << 16;
/// Largest string (a chat template or a merge) accepted, bytes.
pub const MAX_STRING: u64 = 1 << 20;
/// Largest metadata array (a vocabulary) accepted.
pub const MAX_ARRAY: u64 = 1 << 22;
/// Largest tensor rank.
pub const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U(u64),
    I(i64),
    F(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U(v) => Some(v),
            Value::I(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F(v) => Some(v),
            Value::U(v) => Some(v as f64),
            Value::I(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// ggml tensor types the importer understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    /// A block-quantized format.
    Block(BlockFormat),
}

/// ggml's names of its tensor type ids (`ggml.h`, `enum ggml_type`); `None`
/// for ids it has never used or has retired.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    const NAMES: [&str; 42] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "NVFP4",
        "Q1_0",
    ];
    NAMES.get(id as usize).copied()
}

/// A type id as a message names it: `Q6_K`, or `type 99 (unknown)`.
pub fn describe_ggml_type(id: u32) -> String {
    ggml_type_name(id).map_or_else(|| format!("type {id} (unknown)"), str::to_string)
}

impl GgmlType {
    /// Every type the importer reads, in ggml id order.
    pub const SUPPORTED: [Self; 13] = [
        Self::F32,
        Self::F16,
        Self::Block(BlockFormat::Q4_0),
        Self::Block(BlockFormat::Q4_1),
        Self::Block(BlockFormat::Q5_0),
        Self::Block(BlockFormat::Q5_1),
        Self::Block(BlockFormat::Q8_0),
        Self::Block(BlockFormat::Q2K),
        Self::Block(BlockFormat::Q3K),
        Self::Block(BlockFormat::Q4K),
        Self::Block(BlockFormat::Q5K),
        Self::Block(BlockFormat::Q6K),
        Self::Bf16,
    ];

    /// The type of ggml id `id`, if the importer reads it.
    pub fn from_id(id: u32) -> Option<Self> {
        let name = ggml_type_name(id)?;
        Self::SUPPORTED.into_iter().find(|t| t.name() == name)
    }

    /// The ggml name (`F32`, `BF16`, `Q4_K`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Block(f) => f.name(),
        }
    }

    /// The supported types' names, comma-separated, for messages.
    pub fn supported_list() -> String {
        Self::SUPPORTED.map(Self::name).join(", ")
    }

    /// The block format the kernels can use in place, for quantized types.
    pub fn quant(self) -> Option<QuantKind> {
        match self {
            Self::Block(f) => f.storage(),
            Self::F32 | Self::F16 | Self::Bf16 => None,
        }
    }

    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Block(f) => (f.block_weights(), f.block_bytes()),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's description.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// A parsed GGUF file (metadata and tensor table; data stays in `bytes`).
#[derive(Debug)]
pub struct Gguf {
    pub version: u32,
    pub meta: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
}

struct Cursor<'a> {
    b: &'a [u8],
    off: usize,
    path: String,
}

impl Cursor<'_> {
    fn err(&self, msg: String) -> EngineError {
        EngineError::Gguf {
            path: self.path.clone(),
            offset: self.off as u64,
            msg,
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], EngineError> {
        if self.b.len() - self.off < n {
            return Err(self.err(format!(
                "needs {n} bytes, {} remain",
                self.b.len() - self.off
            )));
        }
        let s = &self.b[self.off..self.off + n];
        self.off += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn count(&mut self, what: &str, limit: u64) -> Result<u64, EngineError> {
        let n = self.u64()?;
        if n > limit {
            return Err(self.err(format!("{what} claims {n}, limit {limit}")));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, EngineError> {
        let n = self.count("string length", MAX_STRING)? as usize;
        let raw = self.take(n)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.err("string is not UTF-8".into()))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, EngineError> {
        Ok(match ty {
            0 => Value::U(self.take(1)?[0] as u64),
            1 => Value::I(self.take(1)?[0] as i8 as i64),
            2 => Value::U(u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as u64),
            3 => Value::I(i16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            4 => Value::U(self.u32()? as u64),
            5 => Value::I(self.u32()? as i32 as i64),
            6 => Value::F(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 0 {
                    return Err(self.err("nested metadata arrays are not supported".into()));
                }
                let ety = self.u32()?;
                let n = self.count("array length", MAX_ARRAY)?;
                // Each element takes at least one byte: bounded by the file.
                if n as usize > self.b.len() - self.off {
                    return Err(self.err(format!("array of {n} elements exceeds the file")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U(self.u64()?),
            11 => Value::I(self.u64()? as i64),
            12 => Value::F(f64::from_bits(self.u64()?)),
            other => return Err(self.err(format!("unknown metadata type {other}"))),
        })
    }
}

impl Gguf {
    /// Parses the header and metadata of `bytes` only, the tensor table
    /// unread: the importer checks the architecture with it before anything
    /// in the table (a tensor type it does not know) can stop it first.
    pub fn parse_metadata(
        bytes: &[u8],
        path: &Path,
    ) -> Result<BTreeMap<String, Value>, EngineError> {
        let mut c = Cursor {
            b: bytes,
            off: 0,
            path: path.display().to_string(),
        };
        Ok(Self::header(&mut c)?.2)
    }

    /// Reads the magic, version and metadata: (version, tensor count, metadata).
    fn header(c: &mut Cursor) -> Result<(u32, u64, BTreeMap<String, Value>), EngineError> {
        let bytes = c.b;
        if bytes.get(..4) != Some(b"GGUF".as_slice()) {
            return Err(EngineError::Gguf {
                path: c.path.clone(),
                offset: 0,
                msg: "not a GGUF file (bad magic)".into(),
            });
        }
        c.off = 4;
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("GGUF version {version}, supported: 2 and 3")));
        }
        let n_tensors = c.count("tensor count", MAX_ENTRIES)?;
        let n_kv = c.count("metadata count", MAX_ENTRIES)?;
        let mut meta = BTreeMap::new();
        for _ in 0..n_kv {
            let k = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            meta.insert(k, v);
        }
        Ok((version, n_tensors, meta))
    }

    /// Parses the header, metadata and tensor table of `bytes`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let mut c = Cursor {
            b: bytes,
            off: 0,
            path: path.display().to_string(),
        };
        let (version, n_tensors, meta) = Self::header(&mut c)?;
        let mut raw = Vec::new();
        // Tensors of types the importer does not read: (name, type id). The
        // table is read to its end so that the refusal can count them all.
        let mut unsupported: Vec<(String, u32)> = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(c.err(format!(
                    "tensor `{name}` has {nd} dimensions, supported 1..={MAX_DIMS}"
                )));
            }
            let dims: Vec<u64> = (0..nd).map(|_| c.u64()).collect::<Result<_, _>>()?;
            let tid = c.u32()?;
            let off = c.u64()?;
            match GgmlType::from_id(tid) {
                Some(ty) => raw.push((name, dims, ty, off)),
                None => unsupported.push((name, tid)),
            }
        }
        if let Some((first, tid)) = unsupported.first() {
            let mut types: Vec<String> = unsupported
                .iter()
                .map(|(_, t)| describe_ggml_type(*t))
                .collect();
            types.sort();
            types.dedup();
            let more = match unsupported.len() - 1 {
                0 => String::new(),
                n => format!(
                    " ({n} more tensor{} of unsupported types; all such types: {})",
                    if n == 1 { "" } else { "s" },
                    types.join(", ")
                ),
            };
            return Err(c.err(format!(
                "tensor `{first}` has type {}{more}, which lmrr does not read; supported: {}",
                describe_ggml_type(*tid),
                GgmlType::supported_list()
            )));
        }
        let align = meta
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.off.div_ceil(align) * align;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty, off) in raw {
            let n = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n > 0 && n < (1 << 40));
            let (be, bb) = ty.block();
            // Blocks run along the contiguous dimension and never cross rows.
            let len = n
                .filter(|_| dims[0] % be as u64 == 0)
                .map(|n| (n / be as u64) as usize * bb)
                .ok_or_else(|| {
                    c.err(format!("tensor `{name}`: bad dimensions {dims:?} for {ty}"))
                })?;
            let start = data_start
                .checked_add(off as usize)
                .filter(|s| s.checked_add(len).is_some_and(|e| e <= bytes.len()))
                .ok_or_else(|| c.err(format!("tensor `{name}`: data at offset {off} (+{len} bytes) lies outside the file")))?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start,
                len,
            });
        }
        Ok(Self {
            version,
            meta,
            tensors,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }
}

/// Whether `path` is a GGUF file: a `.gguf` name, or a file starting with
/// the GGUF magic (a model given where an HF directory is expected).
pub fn is_gguf_file(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_dir()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok())
        && &magic == b"GGUF"
}

/// Exact f16 → f32 (shared with the safetensors loader).
fn f16(h: u16) -> f32 {
    crate::weights::f16_to_f32(h)
}

/// Dequantizes one tensor to f32, row-major in ggml order.
pub fn dequantize(t: &TensorInfo, bytes: &[u8]) -> Vec<f32> {
    let d = &bytes[t.start..t.start + t.len];
    let h = |i: usize| u16::from_le_bytes([d[i], d[i + 1]]);
    let mut out = Vec::with_capacity(t.elements());
    match t.ty {
        GgmlType::F32 => out.extend(
            d.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend((0..d.len() / 2).map(|i| f16(h(2 * i)))),
        GgmlType::Bf16 => {
            out.extend((0..d.len() / 2).map(|i| f32::from_bits((h(2 * i) as u32) << 16)))
        }
        GgmlType::Block(fmt) => {
            // One definition of the block formats: the kernels' reference.
            out.resize(d.len() / fmt.block_bytes() * fmt.block_weights(), 0.0);
            lmrr_kernels::dequant_format_ref(fmt, d, &mut out);
        }
    }
    out
}

/// Tensor `name` of the GGUF file at `path` as f32, through the kernels' fast
/// dequantization where its format is kept as storage, checked against the
/// reference: what `scripts/check_dequant.py --gguf` compares with gguf-py
/// (`lmrr gguf-dequant FILE TENSOR`).
pub fn dequantize_file_tensor(path: &Path, name: &str) -> Result<Vec<f32>, EngineError> {
    let io = |source| EngineError::Io {
        path: path.into(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    // SAFETY: read-only map; every offset is validated by `Gguf::parse`.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io)?;
    let g = Gguf::parse(&map, path)?;
    let t = g
        .tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| EngineError::Gguf {
            path: path.display().to_string(),
            offset: 0,
            msg: format!("no tensor `{name}`"),
        })?;
    let reference = dequantize(t, &map);
    if let GgmlType::Block(fmt) = t.ty {
        let mut fast = vec![0.0f32; reference.len()];
        lmrr_kernels::dequant_format(fmt, &map[t.start..t.start + t.len], &mut fast);
        if let Some(i) = (0..fast.len()).find(|&i| fast[i].to_bits() != reference[i].to_bits()) {
            return Err(EngineError::Gguf {
                path: path.display().to_string(),
                offset: t.start as u64,
                msg: format!(
                    "tensor `{name}` ({}): fast dequantization differs from the reference at weight {i}: {:#010x} vs {:#010x}",
                    fmt.name(),
                    fast[i].to_bits(),
                    reference[i].to_bits()
                ),
            });
        }
    }
    Ok(reference)
}
