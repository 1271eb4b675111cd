#pragma once
// NCCL behind one function, so only nccl.cpp needs NCCL's headers (from the nvidia-nccl wheel beside
// the CUDA LibTorch); without them it throws an Error that says so.
#include <chrono>

#include <c10/util/intrusive_ptr.h>

#include "models/compat.h"

namespace c10d {
class Store;
}

namespace strata::distributed {

c10::intrusive_ptr<compat::CollectiveBackend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                                int size, std::chrono::milliseconds timeout);

}  // namespace strata::distributed
