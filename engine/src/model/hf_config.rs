//! What HF text-model configs share, read once for every family: the RoPE
//! parameters (with `rope_scaling` types `linear`, `llama3` and `yarn`), the
//! EOS ids of `config.json` merged with `generation_config.json`'s, and the
//! refusal of config fields that change the arithmetic where a family does not
//! implement them.
//!
//! RoPE is written two ways in the wild: `rope_theta` beside a `rope_scaling`
//! object (older transformers and most published checkpoints), or one
//! `rope_parameters` object holding `rope_theta` too (what transformers writes
//! since its v5); a family with per-layer-type RoPE (gemma3_text) nests one
//! such object per layer type. Both spellings give the same [`RopeParams`].
//! The inverse frequencies follow transformers' `modeling_rope_utils.py`
//! (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
//! `_compute_yarn_parameters`) formula by formula, evaluated in f64 with
//! `libm` where transformers uses f32 torch ops: the table is a pure function
//! of the config on every platform, within f32 rounding of transformers'.
//!
//! Invariant: a field whose value would change the arithmetic is either
//! implemented exactly or refused, naming the field and its value. An unknown
//! `rope_type`, or an unknown key inside a RoPE object, is refused too: a
//! silent approximation would pass every determinism check while computing
//! another model.

use std::path::Path;

use lmrr_kernels::RopeTable;
use serde_json::Value;

use crate::EngineError;

/// The RoPE types implemented, as `rope_type` spells them.
pub const ROPE_TYPES: [&str; 4] = ["default", "linear", "llama3", "yarn"];

/// How the inverse frequencies are adjusted (transformers' `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `θ^(−2i/d)` as they are.
    Default,
    /// Every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.x: long wavelengths divided by `factor`, short ones kept, a
    /// smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: a ramp between interpolated and extrapolated frequencies, and
    /// cos/sin multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        /// Resolved as transformers does (from `mscale`/`mscale_all_dim` or
        /// `factor` when the config gives none).
        attention_factor: f64,
        /// `mscale_all_dim` as given (MLA families fold it into the softmax
        /// scale; see [`RopeParams::yarn_softmax_mscale`]).
        mscale_all_dim: f64,
    },
}

/// The RoPE of one attention kind.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    /// The fraction of the head dimension rotated (1 unless the config says).
    pub partial_rotary_factor: f64,
    pub scaling: RopeScaling,
}

fn bad(path: &Path, field: &'static str, value: impl ToString, why: impl ToString) -> EngineError {
    EngineError::ConfigValue {
        path: path.into(),
        field,
        value: value.to_string(),
        why: why.to_string(),
    }
}

/// Keys a RoPE object may hold for every type.
const COMMON_KEYS: [&str; 4] = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];

/// The keys each type reads besides [`COMMON_KEYS`].
fn type_keys(rope_type: &str) -> &'static [&'static str] {
    match rope_type {
        // `factor` appears in default objects of some checkpoints; the
        // default type does not read it (as in transformers).
        "default" => &["factor"],
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        _ => &[],
    }
}

/// YaRN's `mscale` of the paper: `0.1 · m · ln(s) + 1` for a scale `s > 1`.
pub fn yarn_get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * libm::log(scale) + 1.0
    }
}

impl RopeParams {
    /// The RoPE of a config object `v` (all of `config.json`) read from
    /// `path`; `default_theta` where the config gives no base.
    pub fn from_config(v: &Value, path: &Path, default_theta: f64) -> Result<Self, EngineError> {
        let obj = rope_object(v);
        if let Some(o) = obj {
            if nested_by_layer_type(o) {
                return Err(bad(
                    path,
                    "rope_parameters",
                    Value::Object(o.clone()),
                    "per-layer-type RoPE, which this family does not have",
                ));
            }
        }
        Self::from_object(v, obj, path, default_theta)
    }

    /// The RoPE of layers of type `layer_type` (`sliding_attention`,
    /// `full_attention`) in a config whose `rope_parameters` is nested by layer
    /// type; a flat one applies to every type.
    pub fn for_layer_type(
        v: &Value,
        path: &Path,
        layer_type: &str,
        default_theta: f64,
    ) -> Result<Self, EngineError> {
        match rope_object(v) {
            Some(o) if nested_by_layer_type(o) => {
                let inner = o
                    .get(layer_type)
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        bad(
                            path,
                            "rope_parameters",
                            Value::Object(o.clone()),
                            format!("no RoPE for layer type `{layer_type}`"),
                        )
                    })?;
                Self::from_object(v, Some(inner), path, default_theta)
            }
            o => Self::from_object(v, o, path, default_theta),
        }
    }

    fn from_object(
        v: &Value,
        obj: Option<&serde_json::Map<String, Value>>,
        path: &Path,
        default_theta: f64,
    ) -> Result<Self, EngineError> {
        let top_theta = v.get("rope_theta").filter(|t| !t.is_null());
        let inner_theta = obj
            .and_then(|o| o.get("rope_theta"))
            .filter(|t| !t.is_null());
        let num = |field: &'static str, x: &Value| {
            x.as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| bad(path, field, x, "must be a finite number"))
        };
        let theta = match (top_theta, inner_theta) {
            (Some(a), Some(b)) if num("rope_theta", a)? != num("rope_theta", b)? => {
                return Err(bad(
                    path,
                    "rope_theta",
                    a,
                    format!("differs from rope_parameters.rope_theta = {b}"),
                ))
            }
            (_, Some(t)) | (Some(t), None) => num("rope_theta", t)?,
            (None, None) => default_theta,
        };
        if !theta.is_finite() || theta <= 1.0 {
            return Err(bad(path, "rope_theta", theta, "must be finite and > 1"));
        }
        let partial = match obj
            .and_then(|o| o.get("partial_rotary_factor"))
            .or_else(|| v.get("partial_rotary_factor"))
            .filter(|p| !p.is_null())
        {
            Some(p) => num("partial_rotary_factor", p)?,
            None => 1.0,
        };
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(bad(
                path,
                "partial_rotary_factor",
                partial,
                "must be in (0, 1]",
            ));
        }
        let Some(o) = obj else {
            return Ok(Self {
                theta,
                partial_rotary_factor: partial,
                scaling: RopeScaling::Default,
            });
        };
        let field = rope_field(v);
        let rope_type = match o.get("rope_type").or_else(|| o.get("type")) {
            None | Some(Value::Null) => "default",
            Some(Value::String(s)) => s.as_str(),
            Some(other) => return Err(bad(path, field, other, "rope_type must be a string")),
        };
        if !ROPE_TYPES.contains(&rope_type) {
            return Err(bad(
                path,
                field,
                Value::Object(o.clone()),
                format!(
                    "rope_type `{rope_type}` is not implemented (implemented: {})",
                    ROPE_TYPES.join(", ")
                ),
            ));
        }
        if let Some(k) = o.keys().find(|k| {
            !COMMON_KEYS.contains(&k.as_str()) && !type_keys(rope_type).contains(&k.as_str())
        }) {
            return Err(bad(
                path,
                field,
                Value::Object(o.clone()),
                format!(
                    "key `{k}` = {} is not read by rope_type `{rope_type}` here (known: {})",
                    o[k],
                    type_keys(rope_type).join(", ")
                ),
            ));
        }
        // A value of the object, `None` when absent or null.
        let get = |k: &str| o.get(k).filter(|x| !x.is_null());
        let getf = |k: &'static str| get(k).map(|x| num(k, x)).transpose();
        let need = |k: &'static str| {
            getf(k)?.ok_or_else(|| {
                bad(
                    path,
                    field,
                    Value::Object(o.clone()),
                    format!("rope_type `{rope_type}` needs `{k}`"),
                )
            })
        };
        // transformers takes a top-level `original_max_position_embeddings`
        // first, then the object's, then `max_position_embeddings`.
        let original_max = || -> Result<f64, EngineError> {
            let top = v
                .get("original_max_position_embeddings")
                .filter(|x| !x.is_null());
            match top {
                Some(t) => num("original_max_position_embeddings", t),
                None => match getf("original_max_position_embeddings")? {
                    Some(x) => Ok(x),
                    None => v
                        .get("max_position_embeddings")
                        .map(|x| num("max_position_embeddings", x))
                        .transpose()?
                        .ok_or_else(|| {
                            bad(
                                path,
                                field,
                                Value::Object(o.clone()),
                                "needs original_max_position_embeddings",
                            )
                        }),
                },
            }
        };
        let positive = |k: &'static str, x: f64| {
            if x > 0.0 {
                Ok(x)
            } else {
                Err(bad(
                    path,
                    field,
                    Value::Object(o.clone()),
                    format!("`{k}` = {x} must be > 0"),
                ))
            }
        };
        let scaling = match rope_type {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: positive("factor", need("factor")?)?,
            },
            "llama3" => {
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if !(low > 0.0 && high > low) {
                    return Err(bad(
                        path,
                        field,
                        Value::Object(o.clone()),
                        "needs 0 < low_freq_factor < high_freq_factor",
                    ));
                }
                RopeScaling::Llama3 {
                    factor: positive("factor", need("factor")?)?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: positive(
                        "original_max_position_embeddings",
                        original_max()?,
                    )?,
                }
            }
            _ => {
                let original = positive("original_max_position_embeddings", original_max()?)?;
                // A null factor is max_position_embeddings / original (DeepSeek-V3).
                let factor = match getf("factor")? {
                    Some(f) => f,
                    None => {
                        let max = v
                            .get("max_position_embeddings")
                            .map(|x| num("max_position_embeddings", x))
                            .transpose()?
                            .unwrap_or(original);
                        max / original
                    }
                };
                let factor = positive("factor", factor)?;
                let mscale = getf("mscale")?.unwrap_or(0.0);
                let mscale_all_dim = getf("mscale_all_dim")?.unwrap_or(0.0);
                let attention_factor = match getf("attention_factor")? {
                    Some(a) => a,
                    None if mscale != 0.0 && mscale_all_dim != 0.0 => {
                        yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
                    }
                    None => yarn_get_mscale(factor, 1.0),
                };
                // `beta_fast or 32` in transformers: zero means the default too.
                let or = |x: Option<f64>, d: f64| x.filter(|&b| b != 0.0).unwrap_or(d);
                let truncate = match get("truncate") {
                    None => true,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        return Err(bad(path, field, other, "`truncate` must be true or false"))
                    }
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: or(getf("beta_fast")?, 32.0),
                    beta_slow: or(getf("beta_slow")?, 1.0),
                    truncate,
                    attention_factor,
                    mscale_all_dim,
                }
            }
        };
        Ok(Self {
            theta,
            partial_rotary_factor: partial,
            scaling,
        })
    }

    /// The rotated dimensions of a head of `head_dim` (transformers'
    /// `int(head_dim · partial_rotary_factor)`).
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// The inverse frequency of each rotated pair for a rotary dimension
    /// `dim` (even), and the attention factor multiplying cos and sin.
    pub fn inv_freq(&self, dim: usize) -> (Vec<f64>, f64) {
        let base = lmrr_kernels::rope::default_inv_freq(dim, self.theta);
        match self.scaling {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let inv = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
                ..
            } => {
                let d = dim as f64;
                let correction_dim = |rotations: f64| {
                    d * libm::log(original / (rotations * 2.0 * std::f64::consts::PI))
                        / (2.0 * libm::log(self.theta))
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = libm::floor(low);
                    high = libm::ceil(high);
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                let inv = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        // `1 / θ^(2i/d)` written as `θ^(−2i/d)`, as everywhere here.
                        let (extrapolation, interpolation) = (f, f / factor);
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (inv, attention_factor)
            }
        }
    }

    /// The cos/sin table of a head of `head_dim` for positions `0..max_pos`.
    /// A partial rotary factor below 1 is refused by the families, which
    /// rotate whole heads; the table covers `rotary_dim(head_dim)`.
    pub fn table(&self, head_dim: usize, max_pos: usize) -> RopeTable {
        let (inv, attention) = self.inv_freq(self.rotary_dim(head_dim));
        RopeTable::from_inv_freq(&inv, attention, max_pos)
    }

    /// YaRN's extra softmax scale for MLA families: transformers'
    /// `yarn_apply_mscale` multiplies the attention scale by `m²` with
    /// `m = yarn_get_mscale(factor, mscale_all_dim)` when `mscale_all_dim` is
    /// set; 1 otherwise.
    pub fn yarn_softmax_mscale(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn {
                factor,
                mscale_all_dim,
                ..
            } if mscale_all_dim != 0.0 => {
                let m = yarn_get_mscale(factor, mscale_all_dim);
                m * m
            }
            _ => 1.0,
        }
    }

    /// The scaling as a `rope_scaling` object with every value resolved
    /// (defaults and derived values written out), `None` for the default
    /// type: [`Self::from_config`] reads it back to the same parameters.
    pub fn scaling_json(&self) -> Option<Value> {
        match self.scaling {
            RopeScaling::Default => None,
            RopeScaling::Linear { factor } => {
                Some(serde_json::json!({"rope_type": "linear", "factor": factor}))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => Some(serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            })),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
                mscale_all_dim,
            } => Some(serde_json::json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "truncate": truncate,
                "attention_factor": attention_factor,
                "mscale_all_dim": mscale_all_dim,
            })),
        }
    }

    /// Canonical text of what the scaling changes, for config digests: empty
    /// for the default type (so configs without scaling keep their digest),
    /// else one line per parameter, floats as their bits.
    pub fn scaling_text(&self) -> String {
        let f = |x: f64| format!("f64:{:016x}", x.to_bits());
        let mut t = String::new();
        if self.partial_rotary_factor != 1.0 {
            t += &format!("partial_rotary_factor={}\n", f(self.partial_rotary_factor));
        }
        match &self.scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => {
                t += &format!("rope_type=linear\nrope_factor={}\n", f(*factor))
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                t += &format!(
                    "rope_type=llama3\nrope_factor={}\nrope_low_freq_factor={}\nrope_high_freq_factor={}\nrope_original_max_position_embeddings={}\n",
                    f(*factor),
                    f(*low_freq_factor),
                    f(*high_freq_factor),
                    f(*original_max_position_embeddings)
                )
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
                mscale_all_dim,
            } => {
                t += &format!(
                    "rope_type=yarn\nrope_factor={}\nrope_original_max_position_embeddings={}\nrope_beta_fast={}\nrope_beta_slow={}\nrope_truncate={truncate}\nrope_attention_factor={}\nrope_mscale_all_dim={}\n",
                    f(*factor),
                    f(*original_max_position_embeddings),
                    f(*beta_fast),
                    f(*beta_slow),
                    f(*attention_factor),
                    f(*mscale_all_dim)
                )
            }
        }
        t
    }
}

/// The config's RoPE object: `rope_parameters`, else `rope_scaling`.
fn rope_object(v: &Value) -> Option<&serde_json::Map<String, Value>> {
    v.get("rope_parameters")
        .and_then(Value::as_object)
        .or_else(|| v.get("rope_scaling").and_then(Value::as_object))
}

/// The name of the field [`rope_object`] read, for messages.
fn rope_field(v: &Value) -> &'static str {
    if v.get("rope_parameters").is_some_and(Value::is_object) {
        "rope_parameters"
    } else {
        "rope_scaling"
    }
}

/// Whether a RoPE object holds one object per layer type.
fn nested_by_layer_type(o: &serde_json::Map<String, Value>) -> bool {
    !o.is_empty() && o.values().all(|x| x.is_object() || x.is_null())
}

/// The EOS ids: `config.json`'s `eos_token_id` (an integer or a list) and
/// `generation_config.json`'s, merged, sorted, deduplicated.
pub fn eos_token_ids(
    config: &Value,
    config_path: &Path,
    generation_config: Option<(&[u8], &Path)>,
) -> Result<Vec<u32>, EngineError> {
    let ids = |v: Option<&Value>, path: &Path| -> Result<Vec<u32>, EngineError> {
        let one = |x: &Value| {
            x.as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| {
                    bad(
                        path,
                        "eos_token_id",
                        x,
                        "must be a token id or a list of them",
                    )
                })
        };
        match v {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(x) => Ok(vec![one(x)?]),
        }
    };
    let mut out = ids(config.get("eos_token_id"), config_path)?;
    if let Some((bytes, path)) = generation_config {
        let g: Value = serde_json::from_slice(bytes).map_err(|e| EngineError::Config {
            path: path.into(),
            msg: e.to_string(),
        })?;
        out.extend(ids(g.get("eos_token_id"), path)?);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Config fields that change the arithmetic in some family, with the value
/// that leaves it unchanged (`null` also does). A family names those it
/// implements; [`refuse_unimplemented`] refuses the others when set.
pub const ARITHMETIC_FIELDS: [(&str, Value); 11] = [
    ("attn_logit_softcapping", Value::Null),
    ("final_logit_softcapping", Value::Null),
    ("query_pre_attn_scalar", Value::Null),
    ("attention_bias", Value::Bool(false)),
    ("mlp_bias", Value::Bool(false)),
    ("use_qk_norm", Value::Bool(false)),
    ("use_sliding_window", Value::Bool(false)),
    ("embedding_multiplier", Value::Null),
    ("residual_multiplier", Value::Null),
    ("attention_multiplier", Value::Null),
    ("logits_scaling", Value::Null),
];

/// Refuses, naming it and its value, the first field of [`ARITHMETIC_FIELDS`]
/// set to a value that changes the arithmetic and not in `implemented`; and
/// a `layer_types` entry other than `full_attention` unless `layer_types` is
/// implemented.
pub fn refuse_unimplemented(
    v: &Value,
    path: &Path,
    implemented: &[&str],
) -> Result<(), EngineError> {
    for (field, neutral) in &ARITHMETIC_FIELDS {
        if implemented.contains(field) {
            continue;
        }
        match v.get(*field) {
            None | Some(Value::Null) => {}
            // A multiplier of exactly 1 changes nothing.
            Some(x) if *x == *neutral || (neutral.is_null() && x.as_f64() == Some(1.0)) => {}
            Some(x) => {
                return Err(bad(
                    path,
                    field,
                    x,
                    "changes the arithmetic and is not implemented for this family",
                ))
            }
        }
    }
    if !implemented.contains(&"layer_types") {
        if let Some(types) = v.get("layer_types").and_then(Value::as_array) {
            if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
                return Err(bad(
                    path,
                    "layer_types",
                    t,
                    "only full_attention layers are implemented for this family",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p() -> &'static Path {
        Path::new("config.json")
    }

    #[test]
    fn both_spellings_of_rope_give_the_same_parameters() {
        let old = json!({"rope_theta": 500000.0, "max_position_embeddings": 8192,
            "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        let new = json!({"max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        let a = RopeParams::from_config(&old, p(), 1e4).unwrap();
        assert_eq!(a, RopeParams::from_config(&new, p(), 1e4).unwrap());
        assert_eq!(a.theta, 500000.0);
        let again = json!({"rope_theta": a.theta, "rope_scaling": a.scaling_json()});
        assert_eq!(a, RopeParams::from_config(&again, p(), 1e4).unwrap());
    }

    #[test]
    fn the_default_type_keeps_the_unscaled_table_bits() {
        let v = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}});
        let r = RopeParams::from_config(&v, p(), 1.0).unwrap();
        let (a, b) = (r.table(16, 64), RopeTable::new(16, 10000.0, 64));
        assert_eq!(a.tables(), b.tables());
        assert!(r.scaling_text().is_empty());
    }

    #[test]
    fn unknown_types_keys_and_conflicts_are_refused_by_name() {
        let cases = [
            (
                json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                "rope_type `dynamic`",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}}),
                "key `mrope_section`",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear"}}),
                "needs `factor`",
            ),
            (
                json!({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}),
                "differs",
            ),
            (
                json!({"partial_rotary_factor": 1.5}),
                "partial_rotary_factor",
            ),
        ];
        for (v, want) in cases {
            let e = RopeParams::from_config(&v, p(), 1e4)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
    }

    #[test]
    fn linear_divides_every_frequency_by_its_factor() {
        let v = json!({"rope_scaling": {"type": "linear", "factor": 4.0}});
        let (inv, a) = RopeParams::from_config(&v, p(), 1e4).unwrap().inv_freq(8);
        let base = lmrr_kernels::rope::default_inv_freq(8, 1e4);
        assert_eq!(a, 1.0);
        for (x, b) in inv.iter().zip(base) {
            assert_eq!(*x, b / 4.0);
        }
    }

    #[test]
    fn yarn_attention_factor_follows_mscale_rules() {
        let v = json!({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn",
            "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0}});
        let r = RopeParams::from_config(&v, p(), 1e4).unwrap();
        assert_eq!(r.inv_freq(16).1, 1.0);
        let m = 0.1 * libm::log(40.0) + 1.0;
        assert_eq!(r.yarn_softmax_mscale(), m * m);
        let v = json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 64}});
        let r = RopeParams::from_config(&v, p(), 1e4).unwrap();
        assert_eq!(r.inv_freq(16).1, 0.1 * libm::log(4.0) + 1.0);
        assert_eq!(r.yarn_softmax_mscale(), 1.0);
    }

    #[test]
    fn eos_ids_merge_config_and_generation_config() {
        let c = json!({"eos_token_id": 2});
        let g = br#"{"eos_token_id": [7, 2, 5]}"#;
        let ids = eos_token_ids(&c, p(), Some((g, Path::new("generation_config.json")))).unwrap();
        assert_eq!(ids, [2, 5, 7]);
        let e = eos_token_ids(&json!({"eos_token_id": "x"}), p(), None).unwrap_err();
        assert!(e.to_string().contains("eos_token_id"), "{e}");
    }

    #[test]
    fn set_arithmetic_fields_are_refused_unless_implemented() {
        let v = json!({"attn_logit_softcapping": 50.0, "attention_bias": false});
        let e = refuse_unimplemented(&v, p(), &[]).unwrap_err().to_string();
        assert!(
            e.contains("attn_logit_softcapping") && e.contains("50"),
            "{e}"
        );
        refuse_unimplemented(&v, p(), &["attn_logit_softcapping"]).unwrap();
        let v = json!({"layer_types": ["full_attention", "sliding_attention"]});
        assert!(refuse_unimplemented(&v, p(), &[]).is_err());
        refuse_unimplemented(&json!({"embedding_multiplier": 1.0}), p(), &[]).unwrap();
    }
}
