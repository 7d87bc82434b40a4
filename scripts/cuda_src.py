"""The CUDA source as the device compiles it, for the scripts that read it
without a GPU (kernel-regs.py, ptx-diff.py): the files that
kernels/src/cuda_source.rs joins into `SOURCE` (its `include_str!`s, in
their order), read from the working tree or from a git revision, and NVRTC
(libnvrtc 13, where .ci/run unpacks it) with the device path's options.
"""
import ctypes
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVRTC = os.path.join(ROOT, "target/nvrtc/nvidia/cu13/lib/libnvrtc.so.13")
# kernels/src/cuda/compile.rs's options (fmad off, IEEE division and sqrt,
# no flush to zero).
OPTIONS = ["--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"]
# The defines the resident module is compiled with under programmatic
# dependent launch (kernels/src/cuda_source.rs's resident_source).
RESIDENT_DEFINES = ["#define ATTN_EARLY 1", "#define PDL_PREFETCH 1"]
SOURCE_RS = "kernels/src/cuda_source.rs"


def _read(path: str, rev: str | None) -> str:
    if rev is None:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return f.read()
    return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def source(rev: str | None = None) -> str:
    """`SOURCE` of the working tree (rev None) or of git revision `rev`."""
    rs = _read(SOURCE_RS, rev)
    m = re.search(r"pub const SOURCE: &str = (.*?);", rs, re.S)
    if not m:
        raise SystemExit(f"no `pub const SOURCE` in {SOURCE_RS}" + (f" at {rev}" if rev else ""))
    parts = re.findall(r'include_str!\("([^"]+)"\)', m.group(1))
    base = os.path.dirname(SOURCE_RS)
    return "".join(_read(os.path.normpath(os.path.join(base, p)), rev) for p in parts)


def load_nvrtc(path: str = NVRTC):
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise SystemExit(f"cannot load libnvrtc at {path}: {e} (run .ci/run once, or pass --nvrtc)")


def compile_program(lib, src: str, opts: list[str], name: str = "kernels.cu"):
    """Compiles `src`; returns (program handle, log). Exits on a compile error."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) != 0:
        raise SystemExit("nvrtcCreateProgram failed")
    o = [x.encode() for x in opts]
    rc = lib.nvrtcCompileProgram(prog, len(o), (ctypes.c_char_p * len(o))(*o))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    if rc != 0:
        raise SystemExit(f"NVRTC could not compile the source:\n{log}")
    return prog, log


def ptx(lib, src: str, opts: list[str]) -> str:
    prog, _ = compile_program(lib, src, opts)
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    return buf.value.decode()
