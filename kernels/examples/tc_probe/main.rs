//! Measures the tensor core's inner product against the CPU model
//! (`lmrr_kernels::tensor_core`): runs `mma.sync.m16n8k16.f32.bf16.bf16.f32`
//! on named distinguishing vectors and on random tiles of six classes
//! (`tensor_core::probe`), then counts, for every candidate design, the
//! outputs it gets wrong.
//!
//!     cargo build --release -p lmrr-kernels --features cuda --example tc_probe
//!     target/release/examples/tc_probe [TILES_PER_CLASS]   # on a GPU machine
//!     target/release/examples/tc_probe --from DIR [TILES]  # anywhere
//!
//! Prints the crafted vectors (hardware beside the model), the candidates
//! that match a first sample of every class, then the full tally of
//! `SM90_BF16` and of its negative controls over every tile; then checks
//! the tensor-core GEMM kernels (`kernels/cuda/tc/gemm.cu`) against the
//! CPU's `tc_matmul` and across batch and tile shapes, and times them
//! (see `gemm.rs`). With
//! `TC_PROBE_OUT=dir` it also writes the hardware's outputs
//! (`<dir>/<class>.f32`, little-endian, 128 a tile, tiles from seed
//! `SEED`, and `crafted.f32`) which `--from DIR` reads instead of running
//! the GPU: a CPU refits or re-checks a model without one. Exits 0 when the model
//! matches every output and every control misses some, 1 otherwise, 2 when
//! no device can be opened.

use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use lmrr_kernels::tensor_core::probe::{self, Class, Tile, OUTPUTS};
use lmrr_kernels::tensor_core::{candidates, negative_controls, TcModel, SM90_BF16};

/// The seed the random tiles are drawn from (the CPU regenerates them).
const SEED: u64 = 0x7c_2026;
/// Tiles of each class the whole candidate grid is fitted on.
const FIT_TILES: usize = 256;

mod gemm;

struct Probe {
    ctx: Arc<CudaContext>,
    module: Arc<cudarc::driver::CudaModule>,
    func: cudarc::driver::CudaFunction,
}

/// Where the hardware's outputs come from.
enum Source {
    Gpu(Probe),
    /// A directory written by an earlier run with `TC_PROBE_OUT`.
    Files(std::path::PathBuf),
}

impl Source {
    fn outputs(&self, file: &str, tiles: &[Tile]) -> Result<Vec<f32>, String> {
        match self {
            Source::Gpu(p) => p.run(tiles),
            Source::Files(dir) => {
                let path = dir.join(format!("{file}.f32"));
                let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                let want = tiles.len() * OUTPUTS * 4;
                if bytes.len() < want {
                    return Err(format!(
                        "{} holds {} bytes, {want} needed for {} tiles",
                        path.display(),
                        bytes.len(),
                        tiles.len()
                    ));
                }
                Ok(bytes[..want]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect())
            }
        }
    }
}

/// The file stem a class's outputs are saved under.
fn stem(class: Class) -> String {
    class.name().replace([' ', ','], "_")
}

impl Probe {
    fn open() -> Result<Self, String> {
        let ctx = CudaContext::new(0).map_err(|e| format!("no device: {e:?}"))?;
        let ptx = lmrr_kernels::cuda::compile::compile_for(
            lmrr_kernels::cuda_source::TC_SOURCE,
            false,
            Some("compute_80"),
        )
        .map_err(|e| format!("compiling the probe: {e}"))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| format!("loading the probe: {e:?}"))?;
        let func = module
            .load_function("tc_probe_bf16")
            .map_err(|e| format!("{e:?}"))?;
        Ok(Self { ctx, module, func })
    }

    /// The hardware's 128 outputs of each tile.
    fn run(&self, tiles: &[Tile]) -> Result<Vec<f32>, String> {
        let s = self.ctx.default_stream();
        let e = |e: cudarc::driver::DriverError| format!("{e:?}");
        let a: Vec<u16> = tiles.iter().flat_map(|t| t.a).collect();
        let b: Vec<u16> = tiles.iter().flat_map(|t| t.b).collect();
        let c: Vec<f32> = tiles.iter().flat_map(|t| t.c).collect();
        let (da, db, dc) = (
            s.clone_htod(&a).map_err(e)?,
            s.clone_htod(&b).map_err(e)?,
            s.clone_htod(&c).map_err(e)?,
        );
        let mut dd = s.alloc_zeros::<f32>(c.len()).map_err(e)?;
        let n = tiles.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: (tiles.len().div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = s.launch_builder(&self.func);
        l.arg(&da).arg(&db).arg(&dc).arg(&mut dd).arg(&n);
        // SAFETY: the kernel reads 256 + 128 + 128 values and writes 128 per
        // tile, for `n` tiles, which the buffers hold.
        unsafe { l.launch(cfg) }.map_err(e)?;
        s.clone_dtoh(&dd).map_err(e)
    }
}

fn describe(m: &TcModel) -> String {
    format!(
        "block {:>2}, {} bits below the {}, {:?}, overflow {:?}{}{}",
        m.block,
        m.frac_bits,
        match m.align {
            lmrr_kernels::tensor_core::Align::ExponentField => "exponent field",
            lmrr_kernels::tensor_core::Align::LeadingBit => "leading bit",
        },
        m.rounding,
        m.overflow,
        if m.flush_inputs {
            ", flush bf16 subnormals"
        } else {
            ""
        },
        if m.flush_f32 {
            ", flush f32 subnormals"
        } else {
            ""
        },
    )
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let from = match args.iter().position(|a| a == "--from") {
        Some(i) if i + 1 < args.len() => {
            let dir = args.remove(i + 1);
            args.remove(i);
            Some(std::path::PathBuf::from(dir))
        }
        Some(_) => {
            eprintln!("error: --from needs a directory");
            std::process::exit(1)
        }
        None => None,
    };
    let per_class: usize = match args.first().map(|s| s.parse()) {
        None => 8192,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("error: TILES_PER_CLASS must be a count, not '{}'", args[0]);
            std::process::exit(1)
        }
    };
    let (source, name) = match from {
        Some(dir) => {
            let name = format!("outputs saved in {}", dir.display());
            (Source::Files(dir), name)
        }
        None => match Probe::open() {
            Ok(p) => {
                let name = p.ctx.name().unwrap_or_else(|_| "?".into());
                (Source::Gpu(p), name)
            }
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                std::process::exit(2);
            }
        },
    };
    println!("device: {name}; seed {SEED:#x}; {per_class} tiles (x128 outputs) per class");
    let out_dir = match source {
        Source::Gpu(_) => std::env::var_os("TC_PROBE_OUT").map(std::path::PathBuf::from),
        Source::Files(_) => None,
    };
    let save = |file: &str, hw: &[f32]| {
        if let Some(dir) = &out_dir {
            let _ = std::fs::create_dir_all(dir);
            let bytes: Vec<u8> = hw.iter().flat_map(|x| x.to_le_bytes()).collect();
            let path = dir.join(format!("{file}.f32"));
            if let Err(e) = std::fs::write(&path, bytes) {
                eprintln!("warning: writing {}: {e}", path.display());
            }
        }
    };
    let fail = |e: String| -> ! {
        eprintln!("error: {e}");
        std::process::exit(1)
    };

    // 1. Crafted vectors.
    let mut crafted = probe::crafted();
    let mut ctiles: Vec<Tile> = crafted.iter().map(|v| v.tile()).collect();
    let chw = match (source.outputs("crafted", &ctiles), &source) {
        (Ok(v), _) => v,
        // A run saved before crafted vectors were saved: go on without.
        (Err(e), Source::Files(_)) => {
            println!("crafted vectors skipped: {e}");
            (crafted.clear(), ctiles.clear(), Vec::new()).2
        }
        (Err(e), Source::Gpu(_)) => fail(e),
    };
    save("crafted", &chw);
    println!("\n## crafted vectors (output 0 of each tile)");
    println!(
        "{:<50} {:>12} {:>12}  same",
        "vector", "hardware", "SM90_BF16"
    );
    for (i, v) in crafted.iter().enumerate() {
        let (hw, m) = (chw[i * OUTPUTS], ctiles[i].model(&SM90_BF16, 0));
        println!(
            "{:<50} {:>12} {:>12}  {}",
            v.name,
            format!("{:#010x}", hw.to_bits()),
            format!("{:#010x}", m.to_bits()),
            if probe::same(m, hw) { "yes" } else { "NO" }
        );
    }

    // 2. Random tiles, every class.
    let mut sets: Vec<(Class, Vec<Tile>, Vec<f32>)> = Vec::new();
    for class in Class::ALL {
        let t = probe::tiles(class, SEED, per_class);
        let hw = source.outputs(&stem(class), &t).unwrap_or_else(|e| fail(e));
        save(&stem(class), &hw);
        let odd_nans = hw
            .iter()
            .filter(|&&x| probe::nan_payloads_differ(x))
            .count();
        if odd_nans > 0 {
            println!(
                "{}: {odd_nans} NaNs with a payload other than {:#x}",
                class.name(),
                lmrr_kernels::tensor_core::CANONICAL_NAN
            );
        }
        sets.push((class, t, hw));
    }

    // 3. The candidate grid on the crafted vectors and a first sample.
    let cands = candidates();
    let fits: Vec<&TcModel> = std::thread::scope(|s| {
        let hs: Vec<_> = cands
            .iter()
            .map(|m| {
                let (sets, ctiles, chw) = (&sets, &ctiles, &chw);
                s.spawn(move || {
                    let mut bad = probe::mismatches(m, ctiles, chw).0;
                    for (_, t, hw) in sets.iter() {
                        let n = FIT_TILES.min(t.len());
                        bad += probe::mismatches(m, &t[..n], &hw[..n * OUTPUTS]).0;
                    }
                    (m, bad)
                })
            })
            .collect();
        let mut r: Vec<(&TcModel, usize)> = hs
            .into_iter()
            .map(|h| h.join().expect("fit thread"))
            .collect();
        r.sort_by_key(|&(_, bad)| bad);
        println!("\n## candidate designs on the crafted vectors and {FIT_TILES} tiles a class (fewest mismatches first)");
        for (m, bad) in r.iter().take(12) {
            println!("{bad:>8}  {}", describe(m));
        }
        r.into_iter()
            .filter(|&(_, bad)| bad == 0)
            .map(|(m, _)| m)
            .collect()
    });
    println!(
        "{} of {} candidates match every sampled output",
        fits.len(),
        cands.len()
    );

    // 4. The model and its controls on every tile.
    let mut tally: Vec<(String, TcModel)> = vec![("SM90_BF16".into(), SM90_BF16)];
    tally.extend(
        negative_controls(SM90_BF16)
            .into_iter()
            .map(|(n, m)| (format!("control: {n}"), m)),
    );
    println!("\n## every tile ({} outputs a class)", per_class * OUTPUTS);
    print!("{:<44}", "design");
    for class in Class::ALL {
        print!(" {:>17}", class.name());
    }
    println!();
    let mut ok = true;
    for (label, m) in &tally {
        let counts: Vec<(usize, Option<(usize, usize)>)> = std::thread::scope(|s| {
            let hs: Vec<_> = sets
                .iter()
                .map(|(_, t, hw)| s.spawn(move || probe::mismatches(m, t, hw)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("tally thread"))
                .collect()
        });
        print!("{label:<44}");
        for (n, _) in &counts {
            print!(" {n:>17}");
        }
        println!();
        let total: usize = counts.iter().map(|c| c.0).sum();
        let is_model = label == "SM90_BF16";
        if is_model && total > 0 {
            ok = false;
            for ((class, t, hw), (_, first)) in sets.iter().zip(&counts) {
                if let Some((ti, o)) = first {
                    let (i, j) = (o / 8, o % 8);
                    println!(
                        "  first mismatch in {}: tile {ti} output ({i},{j}): hardware {:#010x}, model {:#010x}; c {:#010x}, a {:04x?}, b {:04x?}",
                        class.name(),
                        hw[ti * OUTPUTS + o].to_bits(),
                        t[*ti].model(m, *o).to_bits(),
                        t[*ti].c[*o].to_bits(),
                        &t[*ti].a[i * 16..(i + 1) * 16],
                        &t[*ti].b[j * 16..(j + 1) * 16],
                    );
                }
            }
        }
        if !is_model && total == 0 {
            ok = false;
            println!("  this control is not told from the hardware: the probe is blind to it");
        }
    }
    if let Source::Gpu(p) = &source {
        ok &= gemm::run(p);
    }
    let all = 6 * per_class * OUTPUTS + crafted.len();
    println!(
        "\nresult: {} ({all} inner products on {name})",
        if ok {
            match source {
                Source::Gpu(_) => {
                    "SM90_BF16 matches every output, every control misses, the GEMMs match it"
                }
                Source::Files(_) => "SM90_BF16 matches every output, every control misses",
            }
        } else {
            "MISMATCH"
        }
    );
    std::process::exit(if ok { 0 } else { 1 });
}
