"""attnlab's C kernels as PyTorch operators written in C++ (ops.cpp), for compiled decode steps.

An operator written in Python (torch.library) costs a call into the interpreter each time a compiled graph runs it:
about 6 us more per call than these, which inductor's C++ wrapper calls directly (bench/ops_overhead.py). They run
the same C functions with the same arguments as the Python operators, so they give the same bits; where they cannot
be built (no C++ compiler, no torch headers) the Python operators run, after one warning (ATTNLAB_CPU_KERNELS=0:
neither, and no warning).

    if ops.usable():                                 # built and loaded once, on first use outside a trace
        y = torch.ops.attnlab_cpp.qlinear(x, blocks, bias, "q4_1")

The operators' schemas and fake (shape) functions are defined next to their Python twins: attnlab_cpp::qlinear in
attnlab.model.qlinear, attnlab_cpp::quantized_attend in attnlab.cache.quantized_kernel; ops.cpp implements them.

Built with qmatmul.c and qattn.c against this torch's headers through libtorch's stable ABI (no Python headers),
into the same cache folder as the C kernels (attnlab.kernels.cpu.kernel_dir), under a name that hashes the sources,
flags, both compilers' versions, torch's version and the CPU's flags.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from attnlab.kernels import cpu
from attnlab.kernels.cpu import qmatmul

SOURCE = Path(__file__).with_name("ops.cpp")
C_SOURCES = (qmatmul.SOURCE, cpu.SOURCE)  # the C functions ops.cpp calls, linked into its library
TORCH_TARGET = "0x020a000000000000"  # the stable ABI as of torch 2.10: the library loads in any later torch
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-DTORCH_TARGET_VERSION={TORCH_TARGET}")

_LOADED: list = [None]  # None: not tried yet; then whether the operators are loaded


def _cxx() -> list[str] | None:
    return cpu.compiler_command("CXX", ("c++", "g++", "clang++"))


def build(directory: Path | None = None) -> Path:
    """Compiles ops.cpp with the C kernels (once per sources, flags, compilers, torch and CPU) and returns the
    library's path. RuntimeError with the compiler's message when it fails."""
    cc, cxx = cpu._compiler(), _cxx()
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compilers found (install gcc and g++, or set CC and CXX)")
    root = Path(torch.__file__).parent
    c_flags = [f for f in cpu.FLAGS if f != "-shared"]
    include, libs = ["-I", str(root / "include")], ["-L", str(root / "lib"), "-ltorch_cpu", "-lc10"]
    libs += [f"-Wl,-rpath,{root / 'lib'}", "-lm"]

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, check=False)

    def make(target: str, scratch: str) -> None:
        for threads in cpu.THREADS:  # OpenMP where the compilers have it, as the C kernels
            objects = [f"{scratch}/{source.stem}.o" for source in C_SOURCES]
            results = [run([*cc, *c_flags, *threads, "-c", "-o", f"{scratch}/{s.stem}.o", str(s)]) for s in C_SOURCES]
            if all(r.returncode == 0 for r in results):
                results.append(run([*cxx, *CXX_FLAGS, *threads, *include, "-o", target, str(SOURCE), *objects, *libs]))
            failed = [r for r in results if r.returncode]
            if not failed:
                return
        raise RuntimeError(f"{failed[0].args[0]} failed building {SOURCE.name}: {failed[0].stderr.strip()[:2000]}")

    key = [SOURCE, *C_SOURCES, " ".join((*c_flags, *CXX_FLAGS)).encode(), torch.__version__.encode()]
    key += [cpu.compiler_version(cc), cpu.compiler_version(cxx)]
    return cpu.cached_build(directory or cpu.kernel_dir(), SOURCE.stem, key, make)


def _load(path: Path) -> bool:
    torch.ops.load_library(str(path))
    return True


def load() -> bool:
    """Builds and loads the operators (the first call; later calls return the answer): False where they cannot be
    (see `attnlab.kernels.cpu.compiled`; warned once)."""
    if _LOADED[0] is None:
        _LOADED[0] = bool(cpu.compiled(SOURCE, _load, builder=build))
    return _LOADED[0]


def usable() -> bool:
    """Whether the attnlab_cpp operators may run (the kernels not switched off by attnlab.kernels.cpu.disabled()).
    Outside a torch.compile trace this builds and loads the operators on first use; inside one it never builds: it tells
    whether they were loaded before (generate's eager prefill loads them)."""
    if cpu.switched_off():
        return False
    if torch.compiler.is_compiling():
        return _LOADED[0] is True
    return load()
