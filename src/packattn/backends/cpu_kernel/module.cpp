// Python bindings of packattn's CPU kernel (see kernel.h).
#include <torch/extension.h>

#include <mutex>
#include <set>

#include "kernel.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &packattn_kernel::attention_forward, "packed varlen attention forward -> (out, lse)");
  m.def("backward", &packattn_kernel::attention_backward, "packed varlen attention backward -> (dq, dk, dv), fp32");
  m.def(
      "matrix_units", [] { return packattn_kernel::use_amx(at::kBFloat16); },
      "whether bf16 tiles run on the CPU's matrix units (AMX)");
  m.def(
      "parallel_threads",
      [] {
        std::set<int> seen;
        std::mutex lock;
        at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
          const std::lock_guard<std::mutex> guard(lock);
          seen.insert(at::get_thread_num());
        });
        return seen.size();
      },
      "how many threads the kernel's parallel loops run on (at most torch.get_num_threads())");
}
