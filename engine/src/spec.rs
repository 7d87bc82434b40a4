//! What a user names on a command line, resolved: `--model` (an HF-layout
//! directory, `synthetic:PRESET[:SEED]`, or nothing for the embedded
//! default) and `--device` (`cpu` or `cuda`). Front ends (the `lmrr`
//! binary, its server and tools) share these so that every command reads a
//! model spec and a device name the same way.

use crate::{Device, EngineError, Model, SynthSpec};

/// The synthetic model a spec names (`synthetic:PRESET[:SEED]`, the seed
/// optionally written `seedN`), `None` when the spec is not synthetic.
pub fn synthetic_spec(spec: &str) -> Result<Option<SynthSpec>, EngineError> {
    let Some(rest) = spec.strip_prefix("synthetic:") else {
        return Ok(None);
    };
    let bad = |msg: String| EngineError::Config {
        path: spec.into(),
        msg,
    };
    let mut parts = rest.split(':');
    let preset = parts.next().unwrap_or("").parse().map_err(bad)?;
    let seed = match parts.next() {
        None => 0,
        Some(x) => x.trim_start_matches("seed").parse().map_err(|_| {
            bad(format!(
                "bad seed `{x}` (a number, optionally written seedN)"
            ))
        })?,
    };
    if let Some(extra) = parts.next() {
        return Err(bad(format!(
            "`{extra}` after the seed: a synthetic spec is synthetic:PRESET[:SEED]"
        )));
    }
    Ok(Some(SynthSpec::new(preset, seed)))
}

impl Model {
    /// Loads what `--model` names: a directory, `synthetic:PRESET[:SEED]`,
    /// or (`None`) the embedded default.
    pub fn from_spec(spec: Option<&str>) -> Result<Self, EngineError> {
        match spec {
            None => Self::synthetic(SynthSpec::embedded_default()),
            Some(s) => match synthetic_spec(s)? {
                Some(sp) => Self::synthetic(sp),
                None => Self::load_dir(std::path::Path::new(s)),
            },
        }
    }

    /// Moves the model's kernels to the device `--device` names (`cpu`, or
    /// `cuda`: device 0); returns the device's name off the CPU.
    pub fn set_device_named(&mut self, device: &str) -> Result<Option<String>, EngineError> {
        match device {
            "cpu" => {
                self.net.set_device(Device::Cpu)?;
                Ok(None)
            }
            #[cfg(feature = "cuda")]
            "cuda" => {
                let gpu = lmrr_kernels::cuda::Gpu::open(0)
                    .map_err(|e| EngineError::Device(format!("opening CUDA device 0: {e}")))?;
                let name = gpu.name();
                self.net
                    .set_device(Device::Cuda(std::sync::Arc::new(gpu)))?;
                Ok(Some(name))
            }
            #[cfg(not(feature = "cuda"))]
            "cuda" => Err(EngineError::Device(
                "this lmrr was built without CUDA support (cargo build --release --features cuda)"
                    .into(),
            )),
            other => Err(EngineError::Device(format!(
                "unknown device `{other}` (cpu, cuda)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_specs_parse_and_bad_ones_say_why() {
        let s = synthetic_spec("synthetic:tiny:seed7").unwrap().unwrap();
        assert_eq!(s, SynthSpec::new("tiny".parse().unwrap(), 7));
        assert_eq!(
            synthetic_spec("synthetic:small").unwrap().unwrap(),
            SynthSpec::new("small".parse().unwrap(), 0)
        );
        assert!(synthetic_spec("/models/x").unwrap().is_none());
        for (bad, says) in [
            ("synthetic:huge", "unknown preset `huge`"),
            ("synthetic:tiny:x9", "bad seed `x9`"),
            ("synthetic:tiny:1:2", "`2` after the seed"),
        ] {
            let e = synthetic_spec(bad).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = Model::from_spec(Some("synthetic:tiny"))
            .and_then(|mut m| m.set_device_named("tpu"))
            .expect_err("no such device")
            .to_string();
        assert!(e.contains("unknown device `tpu`"), "{e}");
    }
}
