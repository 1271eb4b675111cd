#pragma once
// Every difference between the LibTorch versions strata builds against (Debian's 1.13 on CPU, the
// 2.x inside the PyTorch wheel on GPU machines) lives in this header and nowhere else.
#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <cmath>

namespace c10d {
class ProcessGroup;
class Backend;
}  // namespace c10d

namespace strata::compat {

/// The class a c10d backend (ProcessGroupGloo, ProcessGroupNCCL) derives from and is held as:
/// ProcessGroup in LibTorch 1.13, Backend from 2.0 on (ProcessGroup became a wrapper of backends).
#if TORCH_VERSION_MAJOR >= 2
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

inline constexpr bool kTorch2 = TORCH_VERSION_MAJOR >= 2;

/// Causal (or full) multi-head attention on [B, H, T, D] tensors. LibTorch 2 has a fused kernel
/// (flash / memory-efficient on CUDA); 1.13 has none, so it is spelled out. Both compute
/// softmax(q k^T / sqrt(D) + mask) v.
inline torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               bool causal) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, causal);
#else
  const auto t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    auto mask = torch::ones({t, t}, q.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return torch::matmul(torch::softmax(scores, -1), v);
#endif
}

/// Frees the memory behind a storage while every tensor viewing it keeps its identity (and so its
/// place in autograd graphs); reallocate() gives it fresh memory of the old size. This is how a
/// strategy releases a block's device parameters between uses without touching the module.
inline void release_storage(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(static_cast<size_t>(0));
}

inline void reallocate_storage(const c10::Storage& storage, size_t nbytes) {
  auto* impl = storage.unsafeGetStorageImpl();
  // The caching allocator allocates on the current device: make it the storage's own (a rank on
  // cuda:1 whose current device is still cuda:0 would otherwise get memory of the wrong GPU).
  c10::OptionalDeviceGuard on_its_device;
  if (!impl->device().is_cpu()) on_its_device.reset_device(impl->device());
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

/// Moves the memory behind `from` into `to` (whose own must be released), leaving `from` with
/// none: what was written into a spare buffer becomes a storage's own without a copy.
inline void take_storage(const c10::Storage& to, const c10::Storage& from) {
  auto* src = from.unsafeGetStorageImpl();
  auto* dst = to.unsafeGetStorageImpl();
  const size_t nbytes = src->nbytes();
  dst->set_data_ptr_noswap(src->set_data_ptr(at::DataPtr(nullptr, src->device())));
  dst->set_nbytes(nbytes);
  src->set_nbytes(static_cast<size_t>(0));
}

}  // namespace strata::compat
