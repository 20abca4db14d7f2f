// Python bindings of packattn's CPU kernel (see kernel.h).
#include <torch/extension.h>

#include "kernel.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &packattn_kernel::attention_forward, "packed varlen attention forward -> (out, lse)");
  m.def("backward", &packattn_kernel::attention_backward, "packed varlen attention backward -> (dq, dk, dv), fp32");
  m.def(
      "matrix_units", [] { return packattn_kernel::use_amx(at::kBFloat16); },
      "whether bf16 tiles run on the CPU's matrix units (AMX)");
}
