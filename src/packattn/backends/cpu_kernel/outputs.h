// Memory for the kernel's outputs (out; dq, dk, dv), which it fills whole.
//
// glibc serves a block above 32 MiB (its largest mmap threshold) with fresh pages at every call, which the
// system clears as the kernel first writes them: that cost W3 (512 short sequences, 70 MB of fp32 output) a
// sixth of its forward time and a fifth of its backward's, unless the heap happened to hold a free block
// that large, so runs differed by as much. Below 32 MiB glibc mostly reuses its heap itself.
//
// So a block of 32 MiB or more is kept when its tensor is freed, for the next output that fills four fifths
// of it or more. The kept blocks total at most $PACKATTN_CPU_OUTPUT_CACHE_MIB (default 512; 0 keeps none),
// the oldest let go first, and release_output_cache() frees them all (as torch.cuda.empty_cache() does for
// CUDA's allocator). Every new block's 2 MiB-aligned interior is offered to transparent huge pages (as
// PyTorch does for its own allocations with THP_MEM_ALLOC_ENABLE=1), which made W3 1.5x faster with fresh
// pages; only a hint.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define PACKATTN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PACKATTN_ASAN 1
#endif
#endif
#ifdef PACKATTN_ASAN
#include <sanitizer/asan_interface.h>
#define PACKATTN_ASAN_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define PACKATTN_ASAN_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define PACKATTN_ASAN_POISON(p, n) ((void)(p), (void)(n))
#define PACKATTN_ASAN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace packattn_kernel::detail {

inline constexpr char kOutputCacheEnv[] = "PACKATTN_CPU_OUTPUT_CACHE_MIB";

inline size_t output_cache_limit() {  // bytes, from the environment at each call
  const char* text = std::getenv(kOutputCacheEnv);
  if (text == nullptr || *text == '\0') return size_t(512) << 20;
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(text, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && mib >= 0 && mib < (1LL << 40), kOutputCacheEnv,
                    ": expected a whole number of MiB >= 0 (0 keeps no freed output), got '", text, "'");
  return size_t(mib) << 20;
}

class OutputMemory final : public c10::Allocator {
 public:
  static constexpr size_t kKeptFrom = size_t(32) << 20;

  static OutputMemory& get() {  // never destroyed: tensors can be freed after static destructors ran
    static auto* memory = new OutputMemory();
    return *memory;
  }

  c10::DataPtr allocate(size_t n) override {
    const size_t limit = output_cache_limit();
    if (n < kKeptFrom) {
      c10::DataPtr ptr = c10::GetCPUAllocator()->allocate(n);
      offer_huge_pages(ptr.get(), n);
      return ptr;
    }
    void* data = nullptr;
    {
      const std::lock_guard<std::mutex> guard(lock_);
      limit_ = limit;
      auto best = kept_.end();  // the smallest kept block that n fills to four fifths or more
      for (auto it = kept_.begin(); it != kept_.end(); ++it) {
        if (it->bytes >= n && 5 * n >= 4 * it->bytes && (best == kept_.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != kept_.end()) {
        data = best->data;
        PACKATTN_ASAN_UNPOISON(data, n);  // the rest of the block stays poisoned for AddressSanitizer
        n = best->bytes;
        kept_bytes_ -= n;
        kept_.erase(best);
      }
    }
    if (data == nullptr) {
      data = c10::alloc_cpu(n);
      offer_huge_pages(data, n);
    }
    c10::reportMemoryUsageToProfiler(data, int64_t(n), 0, 0, c10::Device(c10::kCPU));
    return {data, new Block{data, n}, &keep, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  size_t kept_bytes() {
    const std::lock_guard<std::mutex> guard(lock_);
    return kept_bytes_;
  }

  size_t release() {  // frees every kept block; returns their bytes
    std::deque<Block> freed;
    {
      const std::lock_guard<std::mutex> guard(lock_);
      freed.swap(kept_);
      kept_bytes_ = 0;
    }
    size_t bytes = 0;
    for (const Block& b : freed) {
      bytes += b.bytes;
      free_block(b);
    }
    return bytes;
  }

 private:
  struct Block {
    void* data;
    size_t bytes;
  };

  static void offer_huge_pages(void* data, size_t n) {
#ifdef MADV_HUGEPAGE
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    const auto begin = reinterpret_cast<uintptr_t>(data), end = begin + n;
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
    if (last >= first + 2 * kHuge) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  }

  static void free_block(const Block& block) {
    PACKATTN_ASAN_UNPOISON(block.data, block.bytes);
    c10::free_cpu(block.data);
  }

  static void keep(void* context) {  // the DataPtr's deleter: the tensor is gone, its block kept or freed
    const Block block = *static_cast<Block*>(context);
    delete static_cast<Block*>(context);
    c10::reportMemoryUsageToProfiler(block.data, -int64_t(block.bytes), 0, 0, c10::Device(c10::kCPU));
    PACKATTN_ASAN_POISON(block.data, block.bytes);  // a read of a kept block is a use after free
    std::vector<Block> freed;
    {
      OutputMemory& self = get();
      const std::lock_guard<std::mutex> guard(self.lock_);
      if (block.bytes <= self.limit_) {
        self.kept_.push_back(block);
        self.kept_bytes_ += block.bytes;
      } else {
        freed.push_back(block);
      }
      while (self.kept_bytes_ > self.limit_) {
        freed.push_back(self.kept_.front());
        self.kept_bytes_ -= self.kept_.front().bytes;
        self.kept_.pop_front();
      }
    }
    for (const Block& b : freed) free_block(b);
  }

  std::mutex lock_;
  std::deque<Block> kept_;  // freed blocks, oldest first
  size_t kept_bytes_ = 0;
  size_t limit_ = 0;  // as read at the last allocation
};

// An uninitialised tensor for the kernel to fill, in memory as described above.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_generic(sizes, &OutputMemory::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   options.dtype().toScalarType(), std::nullopt);
}

}  // namespace packattn_kernel::detail
