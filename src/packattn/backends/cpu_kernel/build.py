"""Compile the kernel (``forward.cpp``, ``backward.cpp``, ``module.cpp`` and the headers beside them) on first
use with ``torch.utils.cpp_extension.load`` and cache the result.

The cache holds one build per torch version and installation, Python, compiler, CPU capability (ATen's,
e.g. ``AVX512``, ``AVX2``; the ``ATEN_CPU_CAPABILITY`` variable lowers it) and source: ``$PACKATTN_CACHE_DIR``,
else ``$XDG_CACHE_HOME/packattn`` or ``~/.cache/packattn``; the test builds (:func:`sanitizers`,
:func:`emulated`) have their own. A finished build is marked with its library's hash and then loaded
directly, without a compiler or a writable cache (a read-only image, another user); a library that does not
match its mark (a disk that filled up, a copy cut short) is linked again. Builds of one directory take turns
under a lock that the system releases when its holder dies, so a killed build leaves nothing to wait for.
The vectorized parts are compiled for that capability (ATen's ``Vectorized``); the matrix products call
ATen's own GEMMs, which pick their instructions at run time.
No isolated build and no downloads: the system C++ compiler, ninja and the installed torch headers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterator
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
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # a relative value is to be ignored (XDG base directory specification)
        return Path(xdg) / "packattn"
    try:
        return Path.home() / ".cache" / "packattn"
    except RuntimeError as exc:  # no home directory
        raise RuntimeError(f"{exc}: set PACKATTN_CACHE_DIR to a writable directory for the kernel's build") from None


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
    # The build compiles against this Python's and this torch installation's headers with this compiler:
    # two environments sharing a cache (a cluster's home directory) get a build each.
    sha.update(
        f"{sys.implementation.cache_tag}\0{Path(torch.__file__).parent}\0{os.environ.get('CXX', 'c++')}".encode()
    )
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


READY = "ready"  # a finished build's mark: the SHA-256 of the library that loaded


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_finished(where: Path, name: str) -> ModuleType | None:
    """The module of a finished build, imported directly (no compiler, nothing written); None if there is
    none or its library does not match its mark."""
    library, mark = where / f"{name}.so", where / READY
    try:
        if not library.is_file() or mark.read_text().strip() != _digest(library):
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # e.g. torch replaced under the same version: built again
        return None
    return module


@contextlib.contextmanager
def _turn(where: Path) -> Iterator[None]:
    """This process's turn to build in ``where``: an exclusive ``flock``, which the system releases when its
    holder exits or is killed (torch's own lock file stays behind a killed build, and everyone waits)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(where / "build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"packattn: waiting for another process building the C++ CPU kernel in {where}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build(verbose: bool) -> ModuleType:
    where, name = build_dir(), _module_name()
    module = _load_finished(where, name)
    if module is not None:
        return module
    ninja_dir = _ninja_dir()
    if shutil.which("ninja") is None and ninja_dir:  # cpp_extension runs `ninja` from PATH
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    missing = _missing_tool()
    if missing:
        raise RuntimeError(missing)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"cannot create {where} ({exc}): set PACKATTN_CACHE_DIR to a writable directory") from None
    with _turn(where):
        module = _load_finished(where, name)  # built while this process waited
        if module is not None:
            return module
        # Every builder holds the turn, so torch's lock file here is a killed build's; a library without a
        # matching mark is unfinished or damaged: linked again from the compiled objects.
        (where / "lock").unlink(missing_ok=True)
        (where / f"{name}.so").unlink(missing_ok=True)
        return _compile(where, name, verbose)


def _compile(where: Path, name: str, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    print(f"packattn: building the C++ CPU kernel in {where} (once per torch installation and CPU)", file=sys.stderr)
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
    mark = where / f"{READY}.tmp"
    mark.write_text(_digest(where / f"{name}.so") + "\n")
    mark.replace(where / READY)
    return module
