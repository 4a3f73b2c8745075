// The whole torch surface of the host code: PyTorch's stable ABI (torch/csrc/stable and the C shim it
// wraps) and nothing else. CMakeLists.txt compiles every source with TORCH_TARGET_VERSION (2.10), which
// turns an include of ATen or c10 into a compile error and keeps the stable API to what torch 2.10
// offers, so one build of msa._C loads on every torch from 2.10 on (README "Install").
//
// What the stable API lacks is written here once: error messages that name shapes, dtypes and devices;
// the current CUDA stream; ops reached through the dispatcher by name (their schemas are stable since
// torch 2.0: aten::_version, aten::is_inference, aten::mean).
#pragma once
#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// Declared in the C shim only under USE_CUDA (torch's own build flag); exported by libtorch_cuda.
#ifndef USE_CUDA
extern "C" AOTI_TORCH_EXPORT AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                                               void** ret_stream);
#endif

namespace msa::api {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

inline constexpr ScalarType kFloat = ScalarType::Float;
inline constexpr ScalarType kInt = ScalarType::Int;
inline constexpr ScalarType kLong = ScalarType::Long;
inline constexpr ScalarType kByte = ScalarType::Byte;
inline constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
inline constexpr ScalarType kHalf = ScalarType::Half;

// ---- error messages ------------------------------------------------------------------------------
// A failed check raises RuntimeError in Python with exactly the message (the Python layer raises the
// ValueError / TypeError of SPEC 7 first; these checks are the last line before a launch).
template <typename... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw std::runtime_error(s.str());
}
#define MSA_CHECK(cond, ...)                    \
  do {                                          \
    if (!(cond)) ::msa::api::fail(__VA_ARGS__); \
  } while (0)

inline std::string shape(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}
inline std::string dev(const Tensor& t) {
  return t.is_cuda() ? "cuda:" + std::to_string(int(t.get_device_index())) : t.is_cpu() ? "cpu" : "other";
}
inline const char* dtype(ScalarType st) { return torch::headeronly::toString(st); }
inline const char* dtype(const Tensor& t) { return dtype(t.scalar_type()); }

// ---- tensors ---------------------------------------------------------------------------------------
template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}
inline bool same_device(const Tensor& a, const Tensor& b) { return a.device() == b.device(); }
inline bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t i = 0; i < a.dim(); ++i)
    if (a.size(i) != b.size(i)) return false;
  return true;
}
// Row-major strides of `sizes` (at most 8 dims), as PyTorch gives a new contiguous tensor (size-0/1 dims count 1).
inline std::array<int64_t, 8> contiguous_strides(const int64_t* sizes, size_t ndim) {
  std::array<int64_t, 8> strides{};
  if (ndim > strides.size()) fail("msa: at most 8 dims, got ", ndim);
  int64_t stride = 1;
  for (size_t i = ndim; i-- > 0;) {
    strides[i] = stride;
    stride *= sizes[i] > 1 ? sizes[i] : 1;
  }
  return strides;
}
// cudaMemsetAsync of `bytes` zero bytes at `ptr` on `stream`, failing with CUDA's message.
inline void zero_bytes(void* ptr, size_t bytes, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream);
  if (err != cudaSuccess) fail("msa: cudaMemsetAsync failed: ", cudaGetErrorString(err));
}
// New contiguous tensors on the device of `like`.
// A new uninitialized contiguous tensor of `st` on like's device, through the C shim's empty_strided: one direct
// call (new_empty goes through the boxed dispatcher, aten::new_empty then aten::empty: a few microseconds more
// of host time per allocation, and a step makes ~40).
inline Tensor empty_on(const int64_t* sizes, size_t ndim, ScalarType st, const Tensor& like) {
  const std::array<int64_t, 8> strides = contiguous_strides(sizes, ndim);
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle h = nullptr;
  const int32_t dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(st));
  if (aoti_torch_get_device_type(like.get(), &device_type) != AOTI_TORCH_SUCCESS ||
      aoti_torch_get_device_index(like.get(), &device_index) != AOTI_TORCH_SUCCESS ||
      aoti_torch_empty_strided(int64_t(ndim), sizes, strides.data(), dtype, device_type, device_index, &h) !=
          AOTI_TORCH_SUCCESS) {
    fail("msa: cannot allocate a tensor of ", ndim, " dims on ", dev(like));
  }
  return Tensor(h);
}
inline Tensor empty(std::initializer_list<int64_t> sizes, ScalarType st, const Tensor& like) {
  return empty_on(sizes.begin(), sizes.size(), st, like);
}
inline Tensor empty(const std::vector<int64_t>& sizes, ScalarType st, const Tensor& like) {
  return empty_on(sizes.data(), sizes.size(), st, like);
}
inline Tensor zeros(std::initializer_list<int64_t> sizes, ScalarType st, const Tensor& like) {
  return torch::stable::new_zeros(like, std::vector<int64_t>(sizes), st);
}
inline std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> s(size_t(t.dim()));
  for (int64_t i = 0; i < t.dim(); ++i) s[size_t(i)] = t.size(i);
  return s;
}
inline Tensor empty_as(const Tensor& t) { return empty(sizes_of(t), t.scalar_type(), t); }
inline Tensor zeros_as(const Tensor& t) { return torch::stable::new_zeros(t, sizes_of(t)); }
inline Tensor cast(const Tensor& t, ScalarType st) { return torch::stable::to(t, st); }
inline Tensor contig(const Tensor& t) { return torch::stable::contiguous(t); }
// a + b (both fp32, same shape), a new tensor.
inline Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }

namespace detail {
// Only ops whose results are all of one type come back through torch_call_dispatcher: its shim converts the i-th
// value popped (the last result first) with the schema type of result i, so mixed results (e.g. cuDNN attention's
// Tensor x4, SymInt x2, Tensor x3) fail with "Expected Tensor but got Int" after the op ran (torch 2.11, NOTES s83).
template <size_t N>
void call_op(const char* name, const char* overload, std::array<StableIValue, N>& stack) {
  const AOTITorchError err = torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION);
  if (err != AOTI_TORCH_SUCCESS) fail("msa: the call of ", name, " failed");
}
}  // namespace detail

// The version counter (bumped by every in-place write through PyTorch) and inference-mode-ness.
inline int64_t version(const Tensor& t) {
  std::array<StableIValue, 1> st{torch::stable::detail::from(t)};
  detail::call_op("aten::_version", "", st);
  return torch::stable::detail::to<int64_t>(st[0]);
}
inline bool is_inference(const Tensor& t) {
  std::array<StableIValue, 1> st{torch::stable::detail::from(t)};
  detail::call_op("aten::is_inference", "", st);
  return torch::stable::detail::to<bool>(st[0]);
}
// The mean of all elements, a 0-dim tensor (a fixed-order reduction).
inline Tensor mean(const Tensor& t) {
  std::array<StableIValue, 2> st{torch::stable::detail::from(t),
                                 torch::stable::detail::from(std::optional<ScalarType>())};
  detail::call_op("aten::mean", "", st);
  return torch::stable::detail::to<Tensor>(st[0]);
}

// The current CUDA stream of t's device (PyTorch's, so the kernels order with the surrounding ops).
inline cudaStream_t current_stream(const Tensor& t) {
  void* s = nullptr;
  const AOTITorchError err = aoti_torch_get_current_cuda_stream(int32_t(t.get_device_index()), &s);
  if (err != AOTI_TORCH_SUCCESS) fail("msa: cannot get the current CUDA stream of ", dev(t));
  return static_cast<cudaStream_t>(s);
}

// A zeroed fp32 tensor by one memset on `stream` (no fill kernel; the caller holds a DeviceGuard of like's device).
inline Tensor zeros_f32(const std::vector<int64_t>& shape, const Tensor& like, cudaStream_t stream) {
  Tensor t = empty(shape, kFloat, like);
  if (t.numel() > 0) zero_bytes(t.data_ptr(), size_t(t.numel()) * sizeof(float), stream);
  return t;
}

// A contiguous view of `shape` into `base` (contiguous, storage offset 0) from its element `offset`, through the C
// shim (one direct call; narrow + view take two dispatcher round trips). Shares base's storage: not for op outputs.
inline Tensor part_view(const Tensor& base, int64_t offset, const std::vector<int64_t>& shape) {
  const std::array<int64_t, 8> strides = contiguous_strides(shape.data(), shape.size());
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (offset < 0 || offset + n > base.numel()) fail("msa: part_view: [", offset, ", ", offset + n, ") outside ", base.numel());
  AtenTensorHandle h = nullptr;
  if (aoti_torch__reinterpret_tensor(base.get(), int64_t(shape.size()), shape.data(), strides.data(), offset, &h) !=
      AOTI_TORCH_SUCCESS) {
    fail("msa: part_view failed");
  }
  return Tensor(h);
}

// fp32 tensors of the given shapes as views of one buffer (each part starting 16-byte aligned), the first
// `zeroed` of them (all: -1) zeroed by one memset on `stream` (the caller holds a DeviceGuard of like's device):
// one allocation and one memset in place of one each per tensor. Not for op outputs (outputs must not share
// storage): zeros_f32 above.
inline std::vector<Tensor> zeros_f32_parts(const std::vector<std::vector<int64_t>>& shapes, const Tensor& like,
                                           cudaStream_t stream, int zeroed = -1) {
  std::vector<int64_t> begin;
  int64_t total = 0, zero_end = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : shapes[i]) n *= d;
    begin.push_back(total);
    total += (n + 3) / 4 * 4;
    if (zeroed < 0 || int(i) < zeroed) zero_end = total;
  }
  Tensor buf = empty({total}, kFloat, like);
  if (zero_end > 0) zero_bytes(buf.data_ptr(), size_t(zero_end) * sizeof(float), stream);
  std::vector<Tensor> parts;
  for (size_t i = 0; i < shapes.size(); ++i) parts.push_back(part_view(buf, begin[i], shapes[i]));
  return parts;
}

}  // namespace msa::api
