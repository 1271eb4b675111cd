#include "strategies/distributed/nccl.h"

#include "models/check.h"

#if STRATA_WITH_NCCL
#include <cstdlib>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace strata::distributed {

#if STRATA_WITH_NCCL
namespace {

template <typename G, typename = void>
struct has_shutdown : std::false_type {};
template <typename G>
struct has_shutdown<G, std::void_t<decltype(std::declval<G&>().shutdown())>> : std::true_type {};

// Stops a group's watchdog thread and releases its communicators, where this LibTorch can.
template <typename G>
void shut_down(G& group) {
  if constexpr (has_shutdown<G>::value) group.shutdown();
}

std::mutex live_mutex;
// strata's groups are never destroyed (process_group.cpp): these are the NCCL ones, shut down at exit.
std::vector<c10::intrusive_ptr<c10d::ProcessGroupNCCL>>& live() {
  static auto& groups = *new std::vector<c10::intrusive_ptr<c10d::ProcessGroupNCCL>>();
  return groups;
}

// Runs at exit, before CUDA's own teardown: the CUDA runtime was started before any group was made
// (group_for sets the device first), and exit handlers run in the reverse order of their
// registration. Left running, a group's watchdog thread can ask CUDA for the current device after
// CUDA has shut down, and the error it gets ends the process with an abort (seen under
// compute-sanitizer on an H200, after every test had passed).
void shut_down_live_groups() {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroupNCCL>> groups;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    groups.swap(live());
  }
  for (auto& g : groups) {
    try {
      shut_down(*g);
    } catch (...) {
      // At exit nothing can be reported to; the group is left to the system, as before.
    }
  }
}

}  // namespace
#endif

c10::intrusive_ptr<compat::CollectiveBackend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                                int size, std::chrono::milliseconds timeout) {
#if STRATA_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    static const bool registered = std::atexit(shut_down_live_groups) == 0;
    STRATA_CHECK(registered, "distributed: could not register the NCCL groups' shutdown at exit");
    live().push_back(group);
  }
  return group;
#else
  STRATA_FAIL("distributed: this build of strata has no NCCL (its headers were not found at configure time); "
              "set STRATA_CUDA_BACKEND=gloo to use Gloo for CUDA tensors");
#endif
}

}  // namespace strata::distributed
