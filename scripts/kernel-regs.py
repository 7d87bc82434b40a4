#!/usr/bin/env python3
"""Registers, spills and static shared memory of every kernel of the CUDA
source (kernels/cuda/, joined as kernels/src/cuda_source.rs joins it), as ptxas assigns them for a GPU architecture,
without a GPU: NVRTC compiles the source as the resident module is compiled
(`--fmad=false --prec-div=true --prec-sqrt=true --ftz=false`, `ATTN_EARLY`
and `PDL_PREFETCH` defined) straight to SASS with `-Xptxas=-v` and the report is read back.

    scripts/kernel-regs.py                          # sm_90, the resident module's defines
    scripts/kernel-regs.py --no-prefetch            # as compiled under LMRR_CUDA_PDL=0
    scripts/kernel-regs.py --arch sm_80 --kernel attention_decode_rope_qs

libnvrtc 13 is looked for where .ci/run unpacks it (target/nvrtc/...) unless
--nvrtc names it. Registers bound the blocks an SM holds: 65,536 registers
an SM, allocated per warp in units of 256.
"""
import argparse
import ctypes
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cuda_src  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvrtc", default=os.path.join(ROOT, "target/nvrtc/nvidia/cu13/lib/libnvrtc.so.13"))
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, prepended as #define")
    ap.add_argument("--no-prefetch", action="store_true", help="without ATTN_EARLY and PDL_PREFETCH (plain launches: LMRR_CUDA_PDL=0)")
    ap.add_argument("--kernel", help="only kernels whose name holds this")
    ap.add_argument("--threads", type=int, default=0, help="block size: also print blocks an SM by registers")
    a = ap.parse_args()
    try:
        lib = ctypes.CDLL(a.nvrtc)
    except OSError as e:
        print(f"kernel-regs: cannot load libnvrtc at {a.nvrtc}: {e} (run .ci/run once, or pass --nvrtc)", file=sys.stderr)
        return 2
    defs = [] if a.no_prefetch else ["#define ATTN_EARLY 1", "#define PDL_PREFETCH 1"]
    for d in a.defines:
        name, _, value = d.partition("=")
        defs.append(f"#define {name} {value or 1}")
    src = ("\n".join(defs) + "\n" + cuda_src.source()).encode()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None) != 0:
        print("kernel-regs: nvrtcCreateProgram failed", file=sys.stderr)
        return 1
    opts = [b"--fmad=false", b"--prec-div=true", b"--prec-sqrt=true", b"--ftz=false",
            f"-arch={a.arch}".encode(), b"-Xptxas=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    if rc != 0:
        print(log, file=sys.stderr)
        return 1
    rows, cur, spill = [], None, ""
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur, spill = m.group(1), ""
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            spill = f"{m.group(1)}/{m.group(2)}"
            continue
        m = re.search(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?$", line)
        if m and cur:
            rows.append((cur, int(m.group(1)), spill or "0/0", int(m.group(2) or 0)))
            cur = None
    if a.kernel:
        rows = [r for r in rows if a.kernel in r[0]]
    head = f"{'kernel':<34} {'registers':>9} {'spill st/ld':>11} {'smem bytes':>10}"
    if a.threads:
        head += f" {'blocks/SM by registers':>23}"
    print(head)
    for name, regs, sp, smem in sorted(rows):
        line = f"{name:<34} {regs:>9} {sp:>11} {smem:>10}"
        if a.threads:
            per_warp = -(-regs * 32 // 256) * 256
            warps = -(-a.threads // 32)
            line += f" {65536 // (per_warp * warps):>23}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
