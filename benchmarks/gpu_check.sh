#!/usr/bin/env bash
# packattn's GPU checks, prepared to run in one go on a CUDA machine that has torch with CUDA and triton
# (flash-attn too, if installed): the backend tests on CUDA tensors, then `packattn bench` on CUDA comparing
# packattn's dispatch and Triton kernel with flash-attn, torch.nn.attention.varlen, the per-sequence SDPA
# loop and compiled FlexAttention on W1-W6 in bf16, forward and forward + backward. Nothing is installed:
# the checkout runs from src/.
#
#   benchmarks/gpu_check.sh [tests|forward|backward|all] [RESULTS_DIR]     (default: all bench-results)
#
# Targets: the Triton kernel >= 0.8x the best kernel on W1, >= 1.5x the per-sequence loop on W3.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${2:-bench-results}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
peers="packattn,packattn triton,flash-attn,torch varlen,per-seq SDPA,flex (compiled)"

$py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/device.txt"
$py -m packattn info | tee -a "$out/device.txt"
if [[ $part == tests || $part == all ]]; then
    # The ordinary backend tests, on CUDA tensors: every backend that runs there (triton compiled, not interpreted).
    PACKATTN_TEST_DEVICE=cuda $py -m pytest -q -p no:cacheprovider -rs --durations=10 \
        tests/test_contract.py tests/test_contract_properties.py tests/test_mask.py tests/test_triton.py \
        tests/test_nonfinite.py 2>&1 | tee "$out/tests.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $part == forward || $part == all ]]; then
    $py -m packattn bench --device cuda --dtypes bf16 --impls "$peers" --json "$out/forward.json" 2>&1 \
        | tee "$out/forward.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $part == backward || $part == all ]]; then
    $py -m packattn bench --device cuda --dtypes bf16 --backward --impls "$peers" --json "$out/backward.json" 2>&1 \
        | tee "$out/backward.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
