// Python bindings of packattn's CPU kernel (kernel.h): the forward and backward entry points, how bf16 can be
// multiplied here, the outputs kept for reuse, and one test hook.
#include <torch/extension.h>

#include <cstddef>
#include <mutex>
#include <set>

#include "kernel.h"

namespace {

// Test hook, not used by packattn itself: how many distinct threads one of ATen's parallel loops runs on
// (at most torch.get_num_threads()). ATen's parallel_for is a header template over `#pragma omp parallel`, so
// it is compiled with this module's flags: the test checks that the build gives the kernel's loops torch's
// thread pool (-fopenmp) rather than one thread.
size_t test_parallel_threads() {
  std::set<int> seen;
  std::mutex lock;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> guard(lock);
    seen.insert(at::get_thread_num());
  });
  return seen.size();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &packattn_kernel::attention_forward, "packed varlen attention forward -> (out, lse)");
  m.def("delta", &packattn_kernel::attention_delta, "rowsum(dout * out) in float32, (Hq, Tq)");
  m.def("backward", &packattn_kernel::attention_backward,
        "packed varlen attention backward -> (dq, dk, dv), in the inputs' dtype");
  m.def("bf16_products", &packattn_kernel::bf16_products,
        "how bf16 inputs can be multiplied on this CPU and build (fp32, avx512_bf16, amx), the default first");
  m.def("kept_output_bytes", &packattn_kernel::kept_output_bytes,
        "bytes of freed outputs kept for the next calls (PACKATTN_CPU_OUTPUT_CACHE_MIB)");
  m.def("release_output_cache", &packattn_kernel::release_output_cache, "frees the kept outputs; returns their bytes");
  m.def("_test_parallel_threads", &test_parallel_threads,
        "test hook: how many threads the kernel's parallel loops run on (at most torch.get_num_threads())");
}
