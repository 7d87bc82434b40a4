#!/usr/bin/env python3
"""Whether a change to the CUDA source changed any kernel: the PTX of every
kernel, compiled by NVRTC as the device compiles it, of the source at a git
revision (default HEAD) against the working tree's, without a GPU.

    scripts/ptx-diff.py                  # HEAD against the working tree
    scripts/ptx-diff.py --base 680e488   # that commit against the working tree
    scripts/ptx-diff.py --base A --new B # two revisions

Two modules are compared, as kernels/src/cuda/compile.rs builds them: the
reference module (NVRTC's default architecture, no defines) and the resident
one (compute_90, ATTN_EARLY and PDL_PREFETCH defined). Per kernel the entry's
PTX is compared after dropping what only says where the text was
(.loc/.file/comments) and renumbering labels; the module-scope declarations
(shared arrays, globals) are compared as a set. Exit 0 when every kernel is
the same, 1 when one differs, appears or disappears.
"""
import argparse
import re
import sys
import threading

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import cuda_src  # noqa: E402

MODULES = {
    "reference": ([], []),
    "resident": (cuda_src.RESIDENT_DEFINES, ["--gpu-architecture=compute_90"]),
}


def normalize(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith((".loc", ".file", "//")):
            continue
        s = re.sub(r"\$L__BB\d+_", "$L__BB_", s)
        s = re.sub(r"\$L__tmp\d+", "$L__tmp", s)
        s = re.sub(r"__local_depot\d+", "__local_depot", s)
        out.append(s)
    return out


def split(ptx: str) -> tuple[dict[str, list[str]], list[str]]:
    """(entry name -> its normalized PTX, the sorted module-scope lines)."""
    entries, rest = {}, []
    lines = ptx.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"\.(?:visible|weak) \.entry (\w+)", lines[i])
        if not m:
            rest.append(lines[i])
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j] != "}":
            j += 1
        entries[m.group(1)] = normalize("\n".join(lines[i:j + 1]))
        i = j + 1
    return entries, sorted(normalize("\n".join(rest)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the old source")
    ap.add_argument("--new", default=None, help="git revision of the new source (default: the working tree)")
    ap.add_argument("--nvrtc", default=cuda_src.NVRTC)
    a = ap.parse_args()
    lib = cuda_src.load_nvrtc(a.nvrtc)
    sources = {"base": cuda_src.source(a.base), "new": cuda_src.source(a.new)}
    jobs = [(side, mod) for side in sources for mod in MODULES]
    results, errors = {}, []

    def run(side, mod):
        defs, opts = MODULES[mod]
        src = "".join(d + "\n" for d in defs) + sources[side]
        try:
            results[(side, mod)] = split(cuda_src.ptx(lib, src, cuda_src.OPTIONS + opts))
        except SystemExit as e:
            errors.append(f"{side} {mod}: {e}")

    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 2
    bad = 0
    for mod in MODULES:
        (be, bg), (ne, ng) = results[("base", mod)], results[("new", mod)]
        same = [k for k in be if k in ne and be[k] == ne[k]]
        for k in sorted(set(be) | set(ne)):
            if k not in ne:
                print(f"{mod}: {k} gone")
            elif k not in be:
                print(f"{mod}: {k} new")
            elif be[k] != ne[k]:
                print(f"{mod}: {k} differs")
        decls = "same" if bg == ng else "DIFFER"
        print(f"{mod}: {len(same)} of {len(be)} kernels identical ({len(ne)} now); module-scope declarations {decls}")
        bad += len(be) + len(ne) - 2 * len(same) + (bg != ng)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
