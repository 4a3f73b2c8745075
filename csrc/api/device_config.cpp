// msa::device_config on CUDA: which kernels this build runs on the device of `like`, from the same
// functions the ops decide with (python -m msa.info prints it).
#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"

namespace msa::api {
namespace {

Tensor device_config_cuda(const Tensor& like) {
  const DeviceGuard guard(like.get_device_index());
#ifdef MSA_WITH_SM90
  const int64_t sm90_built = 1;
#else
  const int64_t sm90_built = 0;
#endif
  const int64_t values[5] = {sm90_built, use_sm90_kernels() ? 1 : 0, fwd_out_rows(like, 128),
                             small_smem_config(like, 128) ? 1 : 0, smem_per_block(like)};
  Tensor out = torch::stable::empty({5}, kLong, torch::headeronly::Layout::Strided,
                                    Device(torch::headeronly::DeviceType::CPU));
  for (int i = 0; i < 5; ++i) ptr<int64_t>(out)[i] = values[i];
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("device_config", TORCH_BOX(&device_config_cuda)); }

}  // namespace msa::api
