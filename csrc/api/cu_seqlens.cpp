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
#include <algorithm>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "api/checks.h"
#include "api/dispatch.h"
#include "smxx/fill/fill.h"

namespace msa::api {
namespace {

struct Entry {
  Tensor tensor;  // keeps the memory alive: the key below cannot be reused by another tensor
  const void* data;
  int64_t numel;
  Device device;
  int64_t version;
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

bool same(const Entry& e, const Tensor& cu, int64_t version) {
  return e.data == cu.data_ptr() && e.numel == cu.numel() && e.device == cu.device() && e.version == version;
}

std::vector<int32_t> read_values(const Tensor& cu) {
  if (!cu.is_cuda()) {
    const Tensor c = contig(cu);
    return {ptr<int32_t>(c), ptr<int32_t>(c) + c.numel()};
  }
  const bool cacheable = !is_inference(cu);
  const int64_t version = cacheable ? api::version(cu) : 0;
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
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MSA_CHECK(cudaStreamIsCapturing(current_stream(cu), &capture) == cudaSuccess, "cu_seqlens: cannot query the stream");
  MSA_CHECK(capture == cudaStreamCaptureStatusNone,
              "cu_seqlens: msa checks cu_seqlens on the host, which cannot happen while a CUDA graph is being "
              "captured, and this tensor (or this version of it) has not been checked yet. Check it before the "
              "capture, on the same tensor: msa.validate_cu_seqlens(cu_seqlens, max_seqlen), or run the step "
              "once eagerly (under torch.compile(mode='reduce-overhead'), also mark it static with "
              "torch._dynamo.mark_static_address). Values written into it later are not re-checked on replay.");
  const Tensor host = contig(torch::stable::to(cu, Device(torch::headeronly::DeviceType::CPU)));
  std::vector<int32_t> v(ptr<int32_t>(host), ptr<int32_t>(host) + host.numel());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto& entries = cache();
    entries.push_front(Entry{cu, cu.data_ptr(), cu.numel(), cu.device(), version, v});
    if (entries.size() > kMaxEntries) entries.pop_back();
  }
  return v;
}

}  // namespace

std::vector<int32_t> check_cu_seqlens(const Tensor& cu, int64_t total_tokens, int64_t max_seqlen,
                                      const char* side) {
  const char* tk = *side ? "T_k" : "T";
  MSA_CHECK(cu.scalar_type() == kInt, "cu_seqlens", side, ": expected dtype int32, got ", dtype(cu));
  MSA_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens", side, ": expected shape (S+1,) with S >= 1, got ",
            shape(cu));
  const std::vector<int32_t> v = read_values(cu);
  // The checks below run on every call (they are host-only and cheap): a cached map is checked against
  // this call's total_tokens and max_seqlen.
  MSA_CHECK(v.front() == 0, "cu_seqlens", side, ": expected cu_seqlens", side, "[0] == 0, got ", v.front());
  int64_t longest = 0;
  for (size_t s = 1; s < v.size(); ++s) {
    MSA_CHECK(v[s] >= v[s - 1], "cu_seqlens", side, ": expected non-decreasing offsets, got ", v[s - 1], " then ",
              v[s], " at position ", s);
    longest = std::max<int64_t>(longest, v[s] - v[s - 1]);
  }
  MSA_CHECK(v.back() == total_tokens, "cu_seqlens", side, ": expected cu_seqlens", side, "[-1] == ", tk, " = ",
            total_tokens, ", got ", v.back());
  MSA_CHECK(max_seqlen >= longest, "max_seqlen", side, ": expected >= the longest sequence (", longest, "), got ",
            max_seqlen);
  // The kernels take it as an int (sequences are int32 offsets, so no valid bound needs more).
  MSA_CHECK(max_seqlen < (int64_t(1) << 31), "max_seqlen", side, ": expected < 2^31, got ", max_seqlen);
  return v;
}

namespace {

// The batched layout's offsets [0, L, 2 L, ..., S L] (int32, on like's device), one tensor per (device, S, L)
// kept for the process: built on the calling stream, waited for once, and never written again, so any stream
// may read it and a batched call's host path has no allocation or launch before its first kernel (s31: building
// it per call took ~50 us of host time, part of the bench's lead at 8K). While the stream is being captured into
// a CUDA graph a new shape gets its own per-call tensor, as before (a captured iota has not run yet).
struct BatchedEntry {
  int32_t device;
  int64_t S, L;
  Tensor cu;
};
constexpr size_t kMaxBatched = 16;
std::mutex batched_mutex;
std::deque<BatchedEntry>& batched_cache() {
  static auto* entries = new std::deque<BatchedEntry>();  // never destroyed: see cache()
  return *entries;
}

Tensor batched_offsets(int64_t S, int64_t L, const Tensor& like) {
  const int32_t device = int32_t(like.get_device_index());
  {
    std::lock_guard<std::mutex> lock(batched_mutex);
    for (const BatchedEntry& e : batched_cache()) {
      if (e.device == device && e.S == S && e.L == L) return e.cu;
    }
  }
  const DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(like);
  Tensor cu = empty({S + 1}, kInt, like);
  MSA_LAUNCH_CHECK(smxx::launch_iota_int32(ptr<int32_t>(cu), S + 1, int32_t(L), stream), "cu_seqlens (batched offsets)");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return cu;
  MSA_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "cu_seqlens (batched offsets): ",
            cudaGetErrorString(cudaGetLastError()));
  std::lock_guard<std::mutex> lock(batched_mutex);
  auto& entries = batched_cache();
  entries.push_front(BatchedEntry{device, S, L, cu});
  if (entries.size() > kMaxBatched) entries.pop_back();
  return cu;
}

// One side's sequences (SeqMap's cu, num_seqs, uniform) and their lengths on the host: read from
// cu_seqlens, or for the batched layout S times max_seqlen (nothing read back).
SeqMap side_map(const std::optional<Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
                const Tensor& like, const char* side, std::vector<int64_t>* lengths) {
  if (cu_seqlens.has_value()) {
    const std::string name = std::string("cu_seqlens") + side;
    check_cuda_int32(*cu_seqlens, name.c_str(), 1);
    MSA_CHECK(same_device(*cu_seqlens, like), name, ": expected device ", dev(like), ", got ", dev(*cu_seqlens));
    const std::vector<int32_t> v = check_cu_seqlens(*cu_seqlens, total_tokens, max_seqlen, side);
    if (lengths) {
      for (size_t s = 1; s < v.size(); ++s) lengths->push_back(v[s] - v[s - 1]);
    }
    return {*cu_seqlens, cu_seqlens->size(0) - 1, cu_seqlens->size(0) == 2};
  }
  MSA_CHECK(max_seqlen >= 1 && total_tokens % max_seqlen == 0, "max_seqlen", side, ": without cu_seqlens", side,
            " (the batched layout) expected a divisor of ", *side ? "T_k" : "T", " = ", total_tokens, ", got ",
            max_seqlen);
  const int64_t S = total_tokens / max_seqlen;
  MSA_CHECK(total_tokens < (int64_t(1) << 31), *side ? "k" : "q", ": expected fewer than 2^31 tokens, got ",
            total_tokens);
  if (lengths) lengths->assign(size_t(S), max_seqlen);
  return {batched_offsets(S, max_seqlen, like), S, true};
}

}  // namespace

SeqMap seq_map(const std::optional<Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const Tensor& like) {
  SeqMap m = side_map(cu_seqlens, total_tokens, max_seqlen, like, "", nullptr);
  m.cu_k = m.cu;
  m.total_k = total_tokens;
  m.max_k = max_seqlen;
  return m;
}

SeqMap seq_map(const std::optional<Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const std::optional<Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_k, int64_t total_k,
               const Tensor& like) {
  if (!cu_seqlens_k.has_value() && !max_seqlen_k.has_value()) {
    MSA_CHECK(total_k == total_tokens, "k: expected T = ", total_tokens,
              " rows (those of q; cu_seqlens_k gives keys of another layout), got ", total_k);
    return seq_map(cu_seqlens, total_tokens, max_seqlen, like);
  }
  MSA_CHECK(max_seqlen_k.has_value(), "max_seqlen_k: expected an int with cu_seqlens_k, got None");
  std::vector<int64_t> lq, lk;
  SeqMap m = side_map(cu_seqlens, total_tokens, max_seqlen, like, "", &lq);
  const SeqMap k = side_map(cu_seqlens_k, total_k, *max_seqlen_k, like, "_k", &lk);
  MSA_CHECK(k.num_seqs == m.num_seqs, "cu_seqlens_k: expected ", m.num_seqs, " sequences (those of the queries), got ",
            k.num_seqs);
  for (size_t s = 0; s < lq.size(); ++s) {
    MSA_CHECK(lq[s] <= lk[s], "cu_seqlens_k: expected len_k >= len_q in every sequence (the queries are the last "
              "len_q of its positions), got len_q = ", lq[s], " > len_k = ", lk[s], " in sequence ", s);
  }
  m.total_k = total_k;
  // Keys of the queries' layout after all: the square path (its offsets, so the kernels see one pointer, and
  // its max_seqlen, so the dense slot count and the work split are the square call's).
  m.suffix = lq != lk;
  m.max_k = m.suffix ? *max_seqlen_k : max_seqlen;
  m.cu_k = m.suffix ? k.cu : m.cu;
  m.uniform = m.uniform && !m.suffix;
  return m;
}

namespace {

void validate_cu_seqlens_cuda(Tensor cu_seqlens, int64_t total_tokens, int64_t max_seqlen) {
  seq_map(cu_seqlens, total_tokens, max_seqlen, cu_seqlens);  // the ops' own check (and its cache)
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("validate_cu_seqlens", TORCH_BOX(&validate_cu_seqlens_cuda)); }

}  // namespace msa::api
