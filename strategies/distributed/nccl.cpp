#include "strategies/distributed/nccl.h"

#include "models/check.h"

#if STRATA_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace strata::distributed {

c10::intrusive_ptr<compat::CollectiveBackend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                                int size, std::chrono::milliseconds timeout) {
#if STRATA_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  STRATA_FAIL("distributed: this build of strata has no NCCL (its headers were not found at configure time); "
              "set STRATA_CUDA_BACKEND=gloo to use Gloo for CUDA tensors");
#endif
}

}  // namespace strata::distributed
