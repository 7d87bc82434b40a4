//! The device's side of `lmrr bench --device cuda`: its copy bandwidth and
//! FP32 FMA rate measured in the run (the limits the figures are given
//! against), and the kernel choices of its resident path in words.

use anyhow::Result;

/// The device's copy bandwidth and FP32 FMA rate (`--device cuda`).
#[cfg(feature = "cuda")]
pub(super) fn device_limits(
    m: &dyn lmrr_engine::ModelFamily,
    mib: usize,
    repeats: usize,
) -> Result<(f64, Option<f64>)> {
    let lmrr_engine::Device::Cuda(g) = m.device() else {
        anyhow::bail!("the model is not on a CUDA device");
    };
    let bw = g.copy_bandwidth(mib << 20, repeats + 4)?;
    let peak = g.fma_peak(repeats + 2)?;
    Ok((bw, Some(peak)))
}

/// Which kernels the resident path chooses (`Tuning`), in words.
#[cfg(feature = "cuda")]
pub(super) fn device_tuning(m: &dyn lmrr_engine::ModelFamily) -> Option<String> {
    let lmrr_engine::Device::Cuda(g) = m.device() else {
        return None;
    };
    Some(g.tuning().describe())
}

#[cfg(not(feature = "cuda"))]
pub(super) fn device_tuning(_m: &dyn lmrr_engine::ModelFamily) -> Option<String> {
    None
}

#[cfg(not(feature = "cuda"))]
pub(super) fn device_limits(
    _m: &dyn lmrr_engine::ModelFamily,
    _mib: usize,
    _repeats: usize,
) -> Result<(f64, Option<f64>)> {
    anyhow::bail!("this lmrr was built without CUDA support")
}
