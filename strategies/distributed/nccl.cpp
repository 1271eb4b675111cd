#include "strategies/distributed/nccl.h"

#include "models/check.h"

#if STRATA_WITH_NCCL
#include <cstdlib>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>
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
template <typename G, typename = void>
struct has_abort : std::false_type {};
template <typename G>
struct has_abort<G, std::void_t<decltype(std::declval<G&>().abort())>> : std::true_type {};

template <typename G>
void call_shutdown(G& group) {
  if constexpr (has_shutdown<G>::value) group.shutdown();
}
template <typename G>
void call_abort(G& group) {
  if constexpr (has_abort<G>::value) group.abort();
}

// How long an exit waits for a group's orderly shutdown before aborting it instead.
constexpr std::chrono::seconds kShutdownLimit{10};

// Shuts a group down as a normal exit does: in the LibTorch of the GPU machine (2.11) shutdown()
// flushes the group's collectives, destroys its communicators and stops its watchdog. A collective
// that can never finish (a peer that died: the fault tests) would hold that forever, so it runs on
// a thread of its own and, past kShutdownLimit, the group is aborted instead (NCCL's kernels ended,
// nothing awaited) and the exit goes on. Where this LibTorch lacks either call, it is skipped.
void shut_down(const c10::intrusive_ptr<c10d::ProcessGroupNCCL>& group) {
  auto finished = std::make_shared<std::promise<void>>();
  auto done = finished->get_future();
  std::thread([group, finished] {
    try {
      call_shutdown(*group);
    } catch (...) {
      // An error while shutting down at exit changes nothing for the process; it ends anyway.
    }
    finished->set_value();
  }).detach();
  if (done.wait_for(kShutdownLimit) == std::future_status::ready) return;
  std::cerr << "strata: an NCCL group did not shut down within " << kShutdownLimit.count()
            << " s at exit (a collective still waiting for a peer?); aborting it\n";
  try {
    call_abort(*group);
  } catch (...) {
  }
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
// compute-sanitizer, after every test had passed; bench/notes/nccl-shutdown-at-exit.md).
void shut_down_live_groups() {
  std::vector<c10::intrusive_ptr<c10d::ProcessGroupNCCL>> groups;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    groups.swap(live());
  }
  for (auto& g : groups) shut_down(g);
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
