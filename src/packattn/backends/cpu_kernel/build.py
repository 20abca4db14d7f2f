"""Compile the kernel (``forward.cpp``, ``backward.cpp``, ``module.cpp`` and the headers beside them) on first
use with ``torch.utils.cpp_extension.load`` and cache the result.

The cache holds one build per torch version, CPU capability (ATen's, e.g. ``AVX512``, ``AVX2``; the
``ATEN_CPU_CAPABILITY`` variable lowers it) and source: ``$PACKATTN_CACHE_DIR``, else
``$XDG_CACHE_HOME/packattn`` or ``~/.cache/packattn``; the test builds (:func:`sanitizers`, :func:`emulated`)
have their own. The vectorized parts are compiled for that capability (ATen's ``Vectorized``); the matrix
products call ATen's own GEMMs, which pick their instructions at run time.
No isolated build and no downloads: the system C++ compiler, ninja and the installed torch headers.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("forward.cpp", "backward.cpp", "module.cpp")]
HEADERS = sorted(HERE.glob("*.h"))  # every header here, so that each is part of the build's key

# Flags per ATen CPU capability: the ones ATen's own kernels of that capability are compiled with.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_state: dict[str, object] = {}  # "module" or "error" once a load was attempted in this process


def capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _ISA_FLAGS else "DEFAULT"


def cache_dir() -> Path:
    root = os.environ.get("PACKATTN_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packattn"


def sanitizers() -> str:
    """``PACKATTN_KERNEL_SANITIZE`` (e.g. ``address,undefined``): build the kernel with those sanitizers, in a
    build of its own, for ``tools/sanitize.sh``; empty for the normal build."""
    return os.environ.get("PACKATTN_KERNEL_SANITIZE", "").strip()


EMULATE_ENV = "PACKATTN_KERNEL_EMULATE"
_EMULATED = {"avx512_bf16": "-DPACKATTN_EMULATE_AVX512_BF16"}


def emulated() -> str:
    """``$PACKATTN_KERNEL_EMULATE``: ``avx512_bf16`` builds the kernel, in a build of its own, with the bf16
    dot-product loop's instruction (vdpbf16ps) done in AVX-512F instructions, the same rounding and flushed
    denormals, and that loop as the bf16 default: how a CPU without AVX512_BF16 runs that path's tests.
    Empty for the normal build."""
    name = os.environ.get(EMULATE_ENV, "").strip()
    if name and name not in _EMULATED:
        raise RuntimeError(f"{EMULATE_ENV}: expected one of {list(_EMULATED)} or nothing, got {name!r}")
    if name and capability() != "AVX512":
        raise RuntimeError(f"{EMULATE_ENV}={name} needs the AVX512 build, but this one is {capability()}")
    return name


def build_dir() -> Path:
    sha = hashlib.sha256()
    for path in SOURCES + HEADERS:  # names and contents: code moved between files is a new build too
        data = path.read_bytes()
        sha.update(f"{path.name}\0{len(data)}\0".encode() + data)
    digest = sha.hexdigest()[:12]
    san = f"-sanitize-{sanitizers().replace(',', '-')}" if sanitizers() else ""
    emu = f"-emulate-{emulated()}" if emulated() else ""
    return cache_dir() / f"cpu_kernel-torch{torch.__version__}-{capability()}-{digest}{san}{emu}"


def _module_name() -> str:
    return f"packattn_cpu_kernel_{capability().lower()}"


def _first_error_line(text: str) -> str:
    """The compiler's first ``error:`` line, else the first line that looks like an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (r"\berror:", r"error|not found|no such file"):
        for line in lines:
            if line.startswith(("[", "FAILED:", "Error building")):  # ninja's progress, its summary
                continue
            if re.search(pattern, line, re.IGNORECASE):
                return line[:300]
    return (lines[-1] if lines else "unknown error")[:300]


def _ninja_dir() -> str | None:
    """Where the ``ninja`` package put its binary, for a virtual environment that is not activated."""
    try:
        import ninja
    except ImportError:
        return None
    return getattr(ninja, "BIN_DIR", None)


def _missing_tool() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} is not on PATH (install g++ or clang++, or set CXX)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja), which torch.utils.cpp_extension needs"
    return None


def load(verbose: bool = False) -> ModuleType:
    """The compiled module, building it first if this torch/capability/source has no cached build.

    Raises ``RuntimeError`` with a one-line reason when the build cannot run or fails; the reason is
    remembered for the process, so a failed build is tried once.
    """
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    if "error" in _state:
        raise RuntimeError(_state["error"])
    try:
        module = _build(verbose)
    except Exception as exc:  # a build can fail in many ways; the reason is kept and reported
        _state["error"] = str(exc)
        raise RuntimeError(str(exc)) from None
    _state["module"] = module
    return module


def loaded() -> ModuleType | None:
    """The compiled module if this process has loaded it, without building it."""
    return _state.get("module")  # type: ignore[return-value]


def _build(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    ninja_dir = _ninja_dir()
    if shutil.which("ninja") is None and ninja_dir:  # cpp_extension runs `ninja` from PATH
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    missing = _missing_tool()
    if missing:
        raise RuntimeError(missing)
    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    name = _module_name()
    fresh = not (where / f"{name}.so").exists()
    if fresh:
        print(f"packattn: compiling the C++ CPU kernel into {where} (once per torch version and CPU)", file=sys.stderr)
    cap = capability()
    flags = ["-O3", "-DNDEBUG", f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}", *_ISA_FLAGS.get(cap, [])]
    ldflags = []
    if sanitizers():
        flags = ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={sanitizers()}", *flags[2:]]
        ldflags = [f"-fsanitize={sanitizers()}"]
    if emulated():
        flags.append(_EMULATED[emulated()])
    if torch.backends.openmp.is_available():
        # at::parallel_for is a header template over `#pragma omp parallel`: without -fopenmp it runs on one
        # thread. The OpenMP calls resolve to the runtime torch already loaded (libtorch_cpu links it).
        flags.append("-fopenmp")
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=flags,
            extra_ldflags=ldflags,
            build_directory=str(where),
            verbose=verbose,
        )
    except Exception as exc:
        raise RuntimeError(
            f"the C++ kernel did not build: {_first_error_line(str(exc))}; see {where} "
            "(rerun `packattn build --verbose` for the full log)"
        ) from None
    return module
