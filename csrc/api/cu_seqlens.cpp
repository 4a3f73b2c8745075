// check_cu_seqlens (api/checks.h): host-side validation of cu_seqlens with a small cache of the values read.
//
// Reading cu_seqlens is a device-to-host copy, and that copy drains the stream: the host waits for
// every kernel queued before it, then the GPU waits for the host to queue the next one. One training
// step passes the same cu_seqlens to every op of every layer (select_blocks, the sparse forward, the
// backward's reverse index), so the values are remembered, keyed on the tensor's memory and its
// version counter, and the copy happens once per tensor version instead of once per op.
//
// Soundness: an entry holds a reference to its tensor, so its memory cannot be freed and reused by
// another tensor while the entry lives, and every in-place write through PyTorch (including through
// views, which share the counter) bumps the version and misses the cache. Writes that bypass the
// version counter (`.data`, external kernels writing the memory) are not seen; this is PyTorch's own
// rule for tensors saved for backward. Inference tensors have no version counter and are always copied.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/library.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <vector>

#include "api/checks.h"

namespace msa::api {
namespace {

struct Entry {
  at::Tensor tensor;  // keeps the memory alive: the key below cannot be reused by another tensor
  const void* data;
  int64_t numel;
  c10::Device device;
  uint32_t version;
  std::vector<int32_t> values;
};

constexpr size_t kMaxEntries = 16;

std::mutex cache_mutex;
std::deque<Entry>& cache() {
  // Most recently used first. Never destroyed: freeing CUDA tensors from a static destructor at exit
  // could run after the CUDA context is gone.
  static auto* entries = new std::deque<Entry>();
  return *entries;
}

bool same(const Entry& e, const at::Tensor& cu, uint32_t version) {
  return e.data == cu.data_ptr() && e.numel == cu.numel() && e.device == cu.device() && e.version == version;
}

std::vector<int32_t> read_values(const at::Tensor& cu) {
  if (!cu.is_cuda()) {
    auto c = cu.contiguous();
    return {c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel()};
  }
  const bool cacheable = !cu.is_inference();
  const uint32_t version = cacheable ? cu._version() : 0;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto& entries = cache();
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (same(*it, cu, version)) {
        Entry hit = std::move(*it);
        entries.erase(it);
        entries.push_front(std::move(hit));
        return entries.front().values;
      }
    }
  }
  // A copy to the host inside a CUDA graph capture would be an error (or, captured, would never run
  // again on replay): the values must have been read before the capture.
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
              "cu_seqlens: msa checks cu_seqlens on the host, which cannot happen while a CUDA graph is being "
              "captured, and this tensor (or this version of it) has not been checked yet. Check it before the "
              "capture, on the same tensor: msa.validate_cu_seqlens(cu_seqlens, max_seqlen), or run the step "
              "once eagerly (under torch.compile(mode='reduce-overhead'), also mark it static with "
              "torch._dynamo.mark_static_address). Values written into it later are not re-checked on replay.");
  auto host = cu.to(at::kCPU).contiguous();
  std::vector<int32_t> v(host.data_ptr<int32_t>(), host.data_ptr<int32_t>() + host.numel());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto& entries = cache();
    entries.push_front(Entry{cu, cu.data_ptr(), cu.numel(), cu.device(), version, v});
    if (entries.size() > kMaxEntries) entries.pop_back();
  }
  return v;
}

}  // namespace

std::vector<int32_t> check_cu_seqlens(const at::Tensor& cu, int64_t total_tokens, int64_t max_seqlen) {
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt, "cu_seqlens: expected dtype int32, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens: expected shape (S+1,) with S >= 1, got ",
                    cu.sizes());
  const std::vector<int32_t> v = read_values(cu);
  // The checks below run on every call (they are host-only and cheap): a cached map is checked against
  // this call's total_tokens and max_seqlen.
  TORCH_CHECK_VALUE(v.front() == 0, "cu_seqlens: expected cu_seqlens[0] == 0, got ", v.front());
  int64_t longest = 0;
  for (size_t s = 1; s < v.size(); ++s) {
    TORCH_CHECK_VALUE(v[s] >= v[s - 1], "cu_seqlens: expected non-decreasing offsets, got ", v[s - 1],
                      " then ", v[s], " at position ", s);
    longest = std::max<int64_t>(longest, v[s] - v[s - 1]);
  }
  TORCH_CHECK_VALUE(v.back() == total_tokens, "cu_seqlens: expected cu_seqlens[-1] == T = ", total_tokens,
                    ", got ", v.back());
  TORCH_CHECK_VALUE(max_seqlen >= longest, "max_seqlen: expected >= the longest sequence (", longest,
                    "), got ", max_seqlen);
  return v;
}

SeqMap seq_map(const std::optional<at::Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const at::Tensor& like) {
  if (cu_seqlens.has_value()) {
    check_cuda_int32(*cu_seqlens, "cu_seqlens", 1);
    TORCH_CHECK_VALUE(cu_seqlens->device() == like.device(), "cu_seqlens: expected device ", like.device(), ", got ",
                      cu_seqlens->device());
    check_cu_seqlens(*cu_seqlens, total_tokens, max_seqlen);
    return {*cu_seqlens, cu_seqlens->size(0) - 1};
  }
  TORCH_CHECK_VALUE(max_seqlen >= 1 && total_tokens % max_seqlen == 0,
                    "max_seqlen: without cu_seqlens (the batched layout) expected a divisor of T = ", total_tokens,
                    ", got ", max_seqlen);
  return {at::arange(0, total_tokens + 1, max_seqlen, like.options().dtype(at::kInt)), total_tokens / max_seqlen};
}

namespace {

void validate_cu_seqlens_cuda(const at::Tensor& cu_seqlens, int64_t total_tokens, int64_t max_seqlen) {
  seq_map(cu_seqlens, total_tokens, max_seqlen, cu_seqlens);  // the ops' own check (and its cache)
}

}  // namespace

TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("validate_cu_seqlens", &validate_cu_seqlens_cuda); }

}  // namespace msa::api
