//! The CUDA source (`kernels/cuda/*.cuh`, `*.cu`: one file per op family)
//! and its negative controls: plain text, built with or without the `cuda`
//! feature, so that the emulated-kernel tests (`tests/cuda_emulated/`) and
//! the NVRTC compile check see exactly what the device compiles.
//!
//! Invariant: [`SOURCE`] is the files joined in this fixed order, each
//! using only what the files before it define; it is the one text NVRTC
//! compiles, the g++ emulation includes and the negative controls mutate
//! (`scripts/cuda_src.py` reads this list to join it the same way).

/// The kernels' source, compiled at `cuda::Gpu::open`.
pub const SOURCE: &str = concat!(
    include_str!("../cuda/common.cuh"),
    include_str!("../cuda/quant.cuh"),
    include_str!("../cuda/dot.cuh"),
    include_str!("../cuda/matmul.cu"),
    include_str!("../cuda/norm.cu"),
    include_str!("../cuda/elementwise.cu"),
    include_str!("../cuda/rope.cu"),
    include_str!("../cuda/attention.cu"),
    include_str!("../cuda/attention_split.cu"),
    include_str!("../cuda/hyper.cu"),
);

/// The tensor-core kernels (`kernels/cuda/tc/`): `mma.sync` needs sm_80 or
/// later, and the g++ emulation of [`SOURCE`] cannot run PTX, so they are a
/// module of their own, checked against the CPU model of the instruction
/// ([`crate::tensor_core`]) by `tc_probe` on a GPU.
pub const TC_SOURCE: &str = concat!(
    include_str!("../cuda/tc/probe.cu"),
    include_str!("../cuda/tc/gemm.cu"),
);

/// `source` with `PDL_PREFETCH` defined: the resident kernels that load
/// weights first issue those loads before waiting for the kernel ahead of
/// them (`Tuning::pdl_prefetch`; common.cuh's `PDL_ENTRY_LATE`).
pub fn prefetch_source(source: &str) -> String {
    format!("#define PDL_PREFETCH 1\n{source}")
}

/// A negative control of the device check: `source` is [`SOURCE`] with one
/// canonical-order detail broken (or multiply-add contraction allowed when
/// `fmad`), so some kernel must give other bits; a check that cannot see it
/// proves nothing.
pub struct Control {
    pub label: &'static str,
    /// The case of `gpu_check`'s control run ([`CONTROL_CASES`]) that must
    /// differ under this control: the kernel the mutation breaks.
    pub kernel: &'static str,
    pub source: String,
    pub fmad: bool,
}

/// The target of the control that changes no line but the compile options
/// (`fmad=true`): some case must differ, whichever.
pub const ANY_CASE: &str = "any";

/// The cases `gpu_check` runs on each control's module, by name, in its
/// order: one per kernel a control can target (`gpu_check` asserts it
/// reports exactly these).
pub const CONTROL_CASES: [&str; 27] = [
    "matmul",
    "matmul_warp",
    "matmul_tile",
    "matmul_rows",
    "matmul_rows4",
    "matmul_gemm",
    "matmul_gemm_multi",
    "matmul_gemm_multi split",
    "attention_decode_rope_qs",
    "rope_kv",
    "rms_norm",
    "rms_norm_warp",
    "norm_block",
    "norm_reg",
    "norm_reg_lf",
    "attention_paged",
    "attention_decode",
    "attention_prefill",
    "attention_prefill_hd64",
    "attention_split",
    "attention_prefill_hd128",
    "rope",
    "hc_coeffs",
    "hc_pre",
    "hc_post",
    "moe_combine",
    "index_scores",
];

/// Every negative control, in `gpu_check`'s order; an error names a control
/// whose target text is no longer in [`SOURCE`] (it would test nothing).
pub fn negative_controls() -> Result<Vec<Control>, String> {
    const MUTATIONS: &[(&str, &str, &str, &str)] = &[
        (
            "lane tree (l0+l1)+(l2+l3)…",
            "matmul",
            "float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];",
            "float t0 = l[0] + l[1], t1 = l[4] + l[5], t2 = l[2] + l[3], t3 = l[6] + l[7];",
        ),
        (
            "matmul_warp lane tree xor 1 before xor 4",
            "matmul_warp",
            "l = l + __shfl_xor_sync(0xffffffffu, l, 4);\n        l = l + __shfl_xor_sync(0xffffffffu, l, 2);\n        l = l + __shfl_xor_sync(0xffffffffu, l, 1);",
            "l = l + __shfl_xor_sync(0xffffffffu, l, 1);\n        l = l + __shfl_xor_sync(0xffffffffu, l, 2);\n        l = l + __shfl_xor_sync(0xffffffffu, l, 4);",
        ),
        (
            "matmul_warp chunk partials summed as a tree",
            "matmul_warp",
            "total = total + p0;\n        if (q + 1 < chunks) total = total + p1;",
            "total = total + (q + 1 < chunks ? p0 + p1 : p0);\n        if (false) total = total + p1;",
        ),
        (
            "matmul_tile chunk partials summed as a tree",
            "matmul_tile",
            "tot = tot + p0;\n                        if (q + 1 < chunks) tot = tot + p1;",
            "tot = tot + (q + 1 < chunks ? p0 + p1 : p0);\n                        if (false) tot = tot + p1;",
        ),
        (
            "matmul_rows chunk partials summed in reverse",
            "matmul_rows",
            "for (int c = 0; c < chunks; ++c) total = total + part[tt][c];",
            "for (int c = chunks - 1; c >= 0; --c) total = total + part[tt][c];",
        ),
        (
            "matmul_rows4 chunk partials summed in reverse",
            "matmul_rows4",
            "for (int c = 0; c < chunks; ++c) total = total + part4[r][tt][c];",
            "for (int c = chunks - 1; c >= 0; --c) total = total + part4[r][tt][c];",
        ),
        (
            "matmul_rows4 lane tree xor 1 before xor 4",
            "matmul_rows4",
            "l = l + __shfl_xor_sync(0xffffffffu, l, 4);\n                    l = l + __shfl_xor_sync(0xffffffffu, l, 2);\n                    l = l + __shfl_xor_sync(0xffffffffu, l, 1);\n                    if (j == 0 && c < chunks) part4",
            "l = l + __shfl_xor_sync(0xffffffffu, l, 1);\n                    l = l + __shfl_xor_sync(0xffffffffu, l, 2);\n                    l = l + __shfl_xor_sync(0xffffffffu, l, 4);\n                    if (j == 0 && c < chunks) part4",
        ),
        (
            "matmul_gemm lane tree pairs (0,1) first",
            "matmul_gemm",
            "w4[q] = v[q] + __shfl_xor_sync(0xffffffffu, v[q + 4], 16);",
            "w4[q] = v[q] + __shfl_xor_sync(0xffffffffu, v[q + 4], 4);",
        ),
        (
            "matmul_gemm split: split_value (sum_chunks, and the kernels that fold it) adds the chunks in reverse",
            "matmul_gemm",
            "for (int c = 0; c < chunks; ++c) t = t + part[(long long)c * count + i];",
            "for (int c = chunks - 1; c >= 0; --c) t = t + part[(long long)c * count + i];",
        ),
        (
            "matmul_gemm_multi: the second matrix's blocks take the first's row count",
            "matmul_gemm_multi",
            "false>(kind, x, w1, y1, n, rows1, k,",
            "false>(kind, x, w1, y1, n, rows0, k,",
        ),
        (
            "norm_block partials summed in reverse",
            "norm_block",
            "for (int c = 0; c < chunks; ++c) ss = ss + part[c];",
            "for (int c = chunks - 1; c >= 0; --c) ss = ss + part[c];",
        ),
        (
            "norm_reg partials summed in reverse",
            "norm_reg",
            "for (int q = 0; q < chunks; ++q) ss = ss + part[q];",
            "for (int q = chunks - 1; q >= 0; --q) ss = ss + part[q];",
        ),
        (
            "attention_paged P·V as mul + add",
            "attention_paged",
            "a = fmaf(sc[j0 + i], vv, a);",
            "a = sc[j0 + i] * vv + a;",
        ),
        (
            "attention_decode P·V as mul + add",
            "attention_decode",
            "if (i < cnt) a = fmaf(sc[j0 + i], vv[i], a);",
            "if (i < cnt) a = sc[j0 + i] * vv[i] + a;",
        ),
        (
            "attention_prefill softmax sum in reverse",
            "attention_prefill",
            "for (int i = b; i < e; ++i) lt = lt + sc[tid][i];",
            "for (int i = e - 1; i >= b; --i) lt = lt + sc[tid][i];",
        ),
        (
            "attention_prefill P·V as mul + add",
            "attention_prefill",
            "for (int i = b; i < e; ++i) a = fmaf(sc[u][i], vs[i][d], a);",
            "for (int i = b; i < e; ++i) a = sc[u][i] * vs[i][d] + a;",
        ),
        (
            "attention_prefill_hd64 P·V as mul + add",
            "attention_prefill_hd64",
            "if (i >= b[r] && i < e[r]) a[r] = fmaf(sc[u0 + r * (ATTN_THREADS / MH)][i], vv, a[r]);",
            "if (i >= b[r] && i < e[r]) a[r] = sc[u0 + r * (ATTN_THREADS / MH)][i] * vv + a[r];",
        ),
        (
            "attention_prefill_hd64 scores: q's second float4 of each 8 read from the first's",
            "attention_prefill_hd64",
            "qb = *(const float4*)&qs[su][i + 4];",
            "qb = *(const float4*)&qs[su][i];",
        ),
        (
            "attention_prefill_hd128 scores: q's second float4 of each 8 read from the first's",
            "attention_prefill_hd128",
            "qb = *(const float4*)&qs[su][i + 4];",
            "qb = *(const float4*)&qs[su][i];",
        ),
        (
            "attention_prefill_hd64 each tile rescaled by its own max (no running max)",
            "attention_prefill_hd64",
            "float mn = mv > mp ? mv : mp;",
            "float mn = mv;",
        ),
        (
            "attention_decode_rope_qs q's RoPE with sin's sign flipped",
            "attention_decode_rope_qs",
            "float ci = EARLY ? ein->c : c[tid], si = EARLY ? ein->sn : sn[tid];\n        float lo = a * ci - b * si;",
            "float ci = EARLY ? ein->c : c[tid], si = EARLY ? ein->sn : sn[tid];\n        float lo = a * ci + b * si;",
        ),
        (
            "attention_decode_rope_qs q's halves swapped in shared memory",
            "attention_decode_rope_qs",
            "attn_qs[tid] = lo;\n            attn_qs[tid + half] = hi;",
            "attn_qs[tid] = hi;\n            attn_qs[tid + half] = lo;",
        ),
        (
            "attention_paged softmax sum in reverse",
            "attention_paged",
            "for (int i = j0; i < j1; ++i) lt = lt + sc[i];",
            "for (int i = j1 - 1; i >= j0; --i) lt = lt + sc[i];",
        ),
        (
            "attention_paged each tile rescaled by its own max (no running max)",
            "attention_paged",
            "float mn = tm[tt] > mr ? tm[tt] : mr;",
            "float mn = tm[tt];",
        ),
        (
            "attention_split merge over the tiles in reverse",
            "attention_split",
            "for (int u = 0; u < SPLIT_MERGE_AHEAD; ++u) {\n            if (k + u < w.tiles) {",
            "for (int u = SPLIT_MERGE_AHEAD - 1; u >= 0; --u) {\n            if (k + u < w.tiles) {",
        ),
        (
            "sigmoid through expf",
            "hc_coeffs",
            "return 1.0f / (1.0f + det_exp(-x));",
            "return 1.0f / (1.0f + expf(-x));",
        ),
        (
            "Sinkhorn rows times the reciprocal of the sum",
            "hc_coeffs",
            "m[i * h + j] = m[i * h + j] / s;  // row",
            "m[i * h + j] = m[i * h + j] * (1.0f / s);  // row",
        ),
        (
            "hc_pre mul + add instead of fmaf",
            "hc_pre",
            "acc = fmaf(pre[t * h + i], x[(t * h + i) * d + c], acc);",
            "acc = pre[t * h + i] * x[(t * h + i) * d + c] + acc;",
        ),
        (
            "hc_post post term mul + add",
            "hc_post",
            "out[idx] = fmaf(post[ti], y[t * d + c], acc);",
            "out[idx] = post[ti] * y[t * d + c] + acc;",
        ),
        (
            "moe_combine mul + add instead of fmaf",
            "moe_combine",
            "acc = fmaf(gates[e], ys[(long long)e * d + c], acc);",
            "acc = gates[e] * ys[(long long)e * d + c] + acc;",
        ),
        (
            "index_scores heads summed in reverse",
            "index_scores",
            "for (int hh = 0; hh < heads; ++hh) {",
            "for (int hh = heads - 1; hh >= 0; --hh) {",
        ),
    ];
    let mut out = vec![Control {
        label: "fmad=true",
        kernel: ANY_CASE,
        source: SOURCE.to_string(),
        fmad: true,
    }];
    for &(label, kernel, from, to) in MUTATIONS {
        if !SOURCE.contains(from) {
            return Err(format!(
                "control `{label}`: the CUDA source no longer contains its target"
            ));
        }
        out.push(Control {
            label,
            kernel,
            source: SOURCE.replace(from, to),
            fmad: false,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every control's target text is still in the source (else gpu_check
    /// would stop at its first control on a device): checked without NVRTC
    /// or a GPU, so that an edit of the CUDA source that moves a target fails here.
    #[test]
    fn every_control_finds_its_target() {
        let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
        for c in &controls[1..] {
            assert_ne!(c.source, SOURCE, "control `{}` changes nothing", c.label);
        }
    }

    /// Every control names a case gpu_check compares, and that kernel is in
    /// the source (so its differing bits can be asked of that case alone).
    #[test]
    fn every_control_targets_a_kernel_gpu_check_compares() {
        let controls = negative_controls().unwrap_or_else(|e| panic!("{e}"));
        for c in controls.iter().filter(|c| c.kernel != ANY_CASE) {
            assert!(
                CONTROL_CASES.contains(&c.kernel),
                "control `{}` targets {}, which gpu_check's control run does not compare",
                c.label,
                c.kernel
            );
            let name = c.kernel.split(' ').next().unwrap_or(c.kernel);
            // Defined as `… name(`, as a family of kernels `… name_*(`
            // (attention_split.cu's three launches), or by a macro
            // instance `MACRO(name, …)` at the start of a line
            // (attention.cu's ATTN_PREFILL).
            let by_macro = SOURCE.lines().any(|l| {
                l.split_once('(').is_some_and(|(m, rest)| {
                    !m.is_empty()
                        && m.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_')
                        && rest.starts_with(&format!("{name},"))
                })
            });
            assert!(
                SOURCE.contains(&format!(" {name}("))
                    || SOURCE.contains(&format!(" {name}_"))
                    || by_macro,
                "control `{}`: no kernel {name} in the source",
                c.label
            );
        }
    }
}
