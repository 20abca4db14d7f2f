#!/usr/bin/env bash
# Rebuilds packattn's C++ CPU kernel with AddressSanitizer and UndefinedBehaviorSanitizer (a build of its own,
# beside the normal one) and runs the kernel's tests and the fuzz's edge cases and examples on it. Any
# out-of-bounds access, use after free or undefined behaviour in the kernel aborts the run with a report.
#
#   tools/sanitize.sh [pytest args...]      (default: the fuzz edges and 200 examples, and the kernel tests)
#
# Python itself is not instrumented: the ASan runtime is preloaded, and leak checking is off (the
# interpreter's own allocations would all count). The kernel is built at -O1 with frame pointers.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
cxx=${CXX:-c++}
asan=$($cxx -print-file-name=libasan.so)
[[ -f $asan ]] || { echo "sanitize.sh: $cxx has no libasan.so ($asan)" >&2; exit 2; }
# libstdc++ preloaded with it, so that ASan finds the real __cxa_throw (the kernel's TORCH_CHECKs throw).
preload="$asan $($cxx -print-file-name=libstdc++.so)"
export PACKATTN_KERNEL_SANITIZE=address,undefined
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PACKATTN_FUZZ_EXAMPLES=${PACKATTN_FUZZ_EXAMPLES:-200}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
if [[ ${#args[@]} == 0 ]]; then
    args=(tests/test_fuzz.py tests/test_cpu_kernel.py tests/test_nonfinite.py -k "cpu_kernel or fuzz or edges")
fi
LD_PRELOAD="$preload" $py -m packattn build
# --capture=sys: a report is written to the process's stderr as it dies, which pytest's own capture would keep
LD_PRELOAD="$preload" $py -m pytest -q -p no:cacheprovider --capture=sys "${args[@]}"
