//! GGUF (v2, v3) reader and importer to the HF directory layout.
//!
//! The reader treats the file as untrusted: every count, string length, array
//! length, dimension and offset is checked against a named limit or the file
//! size before anything is allocated. Dequantization is exact and fixed:
//! F16/BF16 widen exactly; `Q8_0`: `x = d·q`; `Q4_0`: `x = d·(q − 8)`; `Q4_1`:
//! `x = d·q + m` (a rounded product, then a rounded sum — no fma), `d` and `m`
//! f16 scales widened to f32, low nibbles holding elements 0..16 of a block and
//! high nibbles 16..32 (ggml's layout).
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that its
//! interleaved RoPE matches HF's rotate-half; the importer undoes that
//! permutation, so the written model uses HF conventions like every other.

use std::collections::BTreeMap;
use std::path::Path;

use lmrr_kernels::{QuantKind, QBLOCK};

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
    Q4_0,
    Q4_1,
    Q8_0,
    Bf16,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::Bf16,
            _ => return None,
        })
    }
    /// The block format the kernels can use in place, for quantized types.
    pub fn quant(self) -> Option<QuantKind> {
        match self {
            Self::Q4_0 => Some(QuantKind::Q4_0),
            Self::Q4_1 => Some(QuantKind::Q4_1),
            Self::Q8_0 => Some(QuantKind::Q8_0),
            Self::F32 | Self::F16 | Self::Bf16 => None,
        }
    }

    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
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
    /// Parses the header, metadata and tensor table of `bytes`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let mut c = Cursor {
            b: bytes,
            off: 0,
            path: path.display().to_string(),
        };
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
        let mut raw = Vec::new();
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
            let ty = GgmlType::from_id(tid)
                .ok_or_else(|| c.err(format!("tensor `{name}` has ggml type {tid}, supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0")))?;
            let off = c.u64()?;
            raw.push((name, dims, ty, off));
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
                    c.err(format!(
                        "tensor `{name}`: bad dimensions {dims:?} for {ty:?}"
                    ))
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
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
            // One definition of the block formats: the kernels' reference.
            let kind = t.ty.quant().expect("quantized type");
            out.resize(d.len() / kind.block_bytes() * QBLOCK, 0.0);
            lmrr_kernels::dequant_ref(kind, d, &mut out);
        }
    }
    out
}

/// Undoes llama.cpp's row permutation of `attn_q`/`attn_k` (`rows` = heads ·
/// head_dim rows of `cols` elements each — f32 values, or the bytes of a
/// quantized row): GGUF row `h·hd + 2i + j` holds HF row `h·hd + j·hd/2 + i`.
pub fn unpermute_rope_rows<T: Copy + Default>(
    w: &[T],
    heads: usize,
    rows: usize,
    cols: usize,
) -> Vec<T> {
    let hd = rows / heads;
    let mut out = vec![T::default(); w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Storage dtype of an imported model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportDtype {
    /// Dequantized values, exactly.
    F32,
    /// Dequantized values rounded to bf16 (half the size; not exact).
    Bf16,
    /// Quantized tensors (`Q4_0`/`Q4_1`/`Q8_0`) keep their GGUF blocks, stored
    /// as `U8` tensors of shape `(rows, row bytes)` with the format in the
    /// safetensors metadata (`lmrr.quant.<name>`); the kernels dequantize them
    /// on the fly to the same f32 values as [`ImportDtype::F32`]. Other tensors
    /// are stored as exact f32.
    Keep,
}

impl ImportDtype {
    /// Parses `f32`, `bf16` or `keep`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(Self::F32),
            "bf16" => Some(Self::Bf16),
            "keep" => Some(Self::Keep),
            _ => None,
        }
    }
}

/// Safetensors metadata key naming the block format of a `U8` tensor.
pub fn quant_meta_key(tensor: &str) -> String {
    format!("lmrr.quant.{tensor}")
}

fn meta_u(g: &Gguf, key: &str, path: &Path) -> Result<usize, EngineError> {
    g.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| EngineError::Gguf {
            path: path.display().to_string(),
            offset: 0,
            msg: format!("metadata `{key}` is missing or not an integer"),
        })
}

/// What [`import`] wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub tensors: usize,
    pub params: usize,
    pub vocab: usize,
    pub merges: usize,
    pub chat_template: bool,
}

/// Converts a llama-architecture GGUF file into an HF directory: `config.json`,
/// `model.safetensors`, `tokenizer.json` and (when the file has one)
/// `tokenizer_config.json` with the chat template.
pub fn import(path: &Path, out: &Path, dtype: ImportDtype) -> Result<ImportReport, EngineError> {
    let io = |p: &Path, source| EngineError::Io {
        path: p.into(),
        source,
    };
    let f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    // SAFETY: read-only map; every offset is validated by `Gguf::parse`.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io(path, e))?;
    let g = Gguf::parse(&map, path)?;
    let bad = |msg: String| EngineError::Gguf {
        path: path.display().to_string(),
        offset: 0,
        msg,
    };
    let arch = g
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    if arch != "llama" {
        return Err(bad(format!(
            "architecture `{arch}`, only `llama` is supported"
        )));
    }
    let hidden = meta_u(&g, "llama.embedding_length", path)?;
    let heads = meta_u(&g, "llama.attention.head_count", path)?;
    let kv_heads = g
        .get("llama.attention.head_count_kv")
        .and_then(Value::as_u64)
        .map_or(heads, |v| v as usize);
    let layers = meta_u(&g, "llama.block_count", path)?;
    let tokens: Vec<String> = match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => return Err(bad("metadata `tokenizer.ggml.tokens` is missing".into())),
    };
    let vocab = g
        .get("llama.vocab_size")
        .and_then(Value::as_u64)
        .map_or(tokens.len(), |v| v as usize);
    let by_name: BTreeMap<&str, &TensorInfo> =
        g.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let tied = !by_name.contains_key("output.weight");
    let cfg = crate::LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        hidden_size: hidden,
        intermediate_size: meta_u(&g, "llama.feed_forward_length", path)?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: None,
        vocab_size: vocab,
        max_position_embeddings: meta_u(&g, "llama.context_length", path)?,
        rms_norm_eps: g
            .get("llama.attention.layer_norm_rms_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5) as f32,
        rope_theta: g
            .get("llama.rope.freq_base")
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0),
        tie_word_embeddings: tied,
        hidden_act: "silu".into(),
        bos_token_id: g
            .get("tokenizer.ggml.bos_token_id")
            .and_then(Value::as_u64)
            .map(|v| v as u32),
        eos_token_id: g
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Value::as_u64)
            .map(|v| crate::config::TokenIds::One(v as u32)),
        rope_scaling: None,
        attention_bias: false,
        mlp_bias: false,
        torch_dtype: Some(match dtype {
            ImportDtype::F32 => "float32".into(),
            ImportDtype::Bf16 => "bfloat16".into(),
            ImportDtype::Keep => "gguf".into(),
        }),
    };
    // GGUF name → (HF name, rope heads to un-permute).
    let mut plan: Vec<(String, String, Option<usize>)> = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            None,
        ),
        (
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            None,
        ),
    ];
    if !tied {
        plan.push(("output.weight".into(), "lm_head.weight".into(), None));
    }
    for i in 0..layers {
        let (b, h) = (format!("blk.{i}"), format!("model.layers.{i}"));
        plan.extend([
            (
                format!("{b}.attn_norm.weight"),
                format!("{h}.input_layernorm.weight"),
                None,
            ),
            (
                format!("{b}.attn_q.weight"),
                format!("{h}.self_attn.q_proj.weight"),
                Some(heads),
            ),
            (
                format!("{b}.attn_k.weight"),
                format!("{h}.self_attn.k_proj.weight"),
                Some(kv_heads),
            ),
            (
                format!("{b}.attn_v.weight"),
                format!("{h}.self_attn.v_proj.weight"),
                None,
            ),
            (
                format!("{b}.attn_output.weight"),
                format!("{h}.self_attn.o_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_norm.weight"),
                format!("{h}.post_attention_layernorm.weight"),
                None,
            ),
            (
                format!("{b}.ffn_gate.weight"),
                format!("{h}.mlp.gate_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_up.weight"),
                format!("{h}.mlp.up_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_down.weight"),
                format!("{h}.mlp.down_proj.weight"),
                None,
            ),
        ]);
    }
    let mut data: Vec<crate::weights::TensorBytes> = Vec::with_capacity(plan.len());
    // Sorted: the file's bytes depend only on the GGUF (see `write_safetensors`).
    let mut quant_meta = BTreeMap::new();
    let mut params = 0;
    for (src, dst, rope) in plan {
        let t = by_name
            .get(src.as_str())
            .ok_or_else(|| bad(format!("tensor `{src}` is missing")))?;
        let mut shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        if shape.len() == 2 && shape[0] == 1 {
            shape.remove(0);
        }
        params += t.elements();
        if let (ImportDtype::Keep, Some(kind), [rows, cols]) = (dtype, t.ty.quant(), &shape[..]) {
            let (rows, rb) = (*rows, kind.row_bytes(*cols));
            let mut b = map[t.start..t.start + t.len].to_vec();
            if let Some(h) = rope {
                b = unpermute_rope_rows(&b, h, rows, rb);
            }
            quant_meta.insert(quant_meta_key(&dst), kind.name().to_string());
            data.push((dst, safetensors::Dtype::U8, vec![rows, rb], b));
            continue;
        }
        let mut v = dequantize(t, &map);
        if let (Some(h), [rows, cols]) = (rope, shape.as_slice()) {
            v = unpermute_rope_rows(&v, h, *rows, *cols);
        }
        let (st_dtype, bytes): (_, Vec<u8>) = match dtype {
            ImportDtype::F32 | ImportDtype::Keep => (
                safetensors::Dtype::F32,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            ImportDtype::Bf16 => (
                safetensors::Dtype::BF16,
                v.iter()
                    .flat_map(|&x| crate::synth::f32_to_bf16(x).to_le_bytes())
                    .collect(),
            ),
        };
        data.push((dst, st_dtype, shape, bytes));
    }
    let st = crate::weights::write_safetensors(&data, &quant_meta).map_err(bad)?;
    // Tokenizer.
    let merges: Vec<String> = match g.get("tokenizer.ggml.merges") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => Vec::new(),
    };
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(v)) => v.iter().map(|x| x.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let tok_json = tokenizer_json(&tokens, &types, &merges, pre);
    let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(|e| io(&p, e))
    };
    write(
        "config.json",
        &serde_json::to_vec_pretty(&cfg).expect("config serialises"),
    )?;
    write("model.safetensors", &st)?;
    write("tokenizer.json", tok_json.as_bytes())?;
    if let Some(t) = template {
        let name = |k: &str| {
            g.get(k)
                .and_then(Value::as_u64)
                .and_then(|i| tokens.get(i as usize))
                .cloned()
        };
        let tc = serde_json::json!({
            "chat_template": t,
            "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"),
            "add_bos_token": g.get("tokenizer.ggml.add_bos_token").is_some_and(|v| *v == Value::Bool(true)),
        });
        write(
            "tokenizer_config.json",
            &serde_json::to_vec_pretty(&tc).expect("json"),
        )?;
    }
    Ok(ImportReport {
        tensors: data.len(),
        params,
        vocab: tokens.len(),
        merges: merges.len(),
        chat_template: template.is_some(),
    })
}

/// A `tokenizer.json` for a GGUF `gpt2`-model (byte-level BPE) vocabulary.
/// Control (type 3) and user-defined (type 4) tokens become added tokens,
/// control ones special. The `smollm` pre-tokenizer (llama.cpp's name) splits
/// digits individually before the GPT-2 byte-level regex, as HF's does.
fn tokenizer_json(tokens: &[String], types: &[u64], merges: &[String], pre: &str) -> String {
    use serde_json::json;
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": types.get(i) == Some(&3)})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" | "refact" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        _ => byte_level,
    };
    let v = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    serde_json::to_string(&v).expect("json of strings and numbers serialises")
}
