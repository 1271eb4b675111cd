#pragma once
// The overlapped optimizer's queue of host updates (hook_offload with overlap_optimizer=1). Each
// unit's update is queued as its gradient is on its way to the host; a task on the host worker
// runs one update each, chosen when it starts: of the updates whose gradients have landed, the one
// whose unit the next forward needs first; if none has landed, the one queued first. While
// backward runs any landed update will do, but the ones backward's end leaves undone are needed by
// the next forward in block order, and the first blocks' gradients land last.
//
// Invariants: a unit's parts run in the order they were queued (a tied matrix's first part before
// its rows part); every update's `done` gate opens however it ends (a fetch waiting on it never
// hangs); the first error an update throws is kept until reported (take_error), and the step's
// results are then not to be trusted.
#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "strategies/device/device.h"
#include "strategies/hook_offload/unit.h"

namespace strata::hook_offload {

/// One queued update.
struct HostUpdate {
  /// whole: the unit's step in place. first: a tied matrix's step from its first use's gradient,
  /// into the spare buffers. rows: its last use's touched rows added, and their step taken again.
  enum class Part { whole, first, rows };
  Unit* unit = nullptr;
  device::Event landed;                       ///< after the unit's last gradient copy (first: its first use's)
  std::shared_ptr<device::Gate> done;         ///< the unit's `updated` (first: its first_part_ended)
  Part part = Part::whole;
  // first and rows: the buffers, chosen when queued (the main thread swaps the unit's own).
  torch::Tensor from, to, to_travel;
  OptimizerState* from_state = nullptr;
  OptimizerState* to_state = nullptr;
  torch::Tensor values, touched;              ///< rows: the touched rows' gradients and indices, on the host
  torch::Tensor staging;                      ///< rows, tied_early: takes the stepped rows (transfer dtype)
  std::shared_ptr<device::Gate> gathered;     ///< rows, tied_early: opened once staging holds them
  device::Event source_read;                  ///< rows, tied_early: the early copy has read the buffer
  /// first, tied_chunks: the gradient's row ranges (bounds, one more than events) and when each
  /// lands (`landed` is the first's); the matrix's row width, taken when queued (a dense last use
  /// turns the unit's rows to 0 before this part may have run). Empty: the whole gradient at `landed`.
  std::vector<device::Event> landed_ranges;
  std::vector<int64_t> range_bounds;
  int64_t cols = 0;

  /// A part of `unit`'s step from its master into its spare buffers (a tied matrix's first or rows
  /// part), once `landed` has passed.
  static HostUpdate into_spare(Unit& unit, device::Event landed);
  /// tied_chunks, on the host worker: a first part's step from `grad`, range by range, each once
  /// its copy has landed; the waits are taken off `host_ns` (they are not update time).
  void step_in_ranges(const OptimizerConfig& optimizer, const torch::Tensor& grad, std::atomic<int64_t>& host_ns);
};

class HostUpdates {
 public:
  /// `apply` runs an update on the host worker (it waits for its gradients itself).
  using Apply = std::function<void(HostUpdate&)>;
  HostUpdates(device::HostQueue& host, Apply apply) : host_(host), apply_(std::move(apply)) {}
  HostUpdates(const HostUpdates&) = delete;  // its tasks on the host queue point at it
  HostUpdates& operator=(const HostUpdates&) = delete;

  /// Queues `update` and a task on the host queue that runs one update (this one or another in its
  /// place). `hold` (tests): the task waits for it before choosing, so it sees every held update.
  /// While a profiler records on this thread, the task runs in this thread's state, so its span
  /// lands in the same trace as the device's work.
  void push(HostUpdate update, std::shared_ptr<const device::Gate> hold = {});
  /// Updates queued and not finished.
  int64_t pending() const { return pending_; }
  /// The first error an update threw and nobody has taken; null if none.
  std::exception_ptr error() const;
  /// Takes it (null after).
  std::exception_ptr take_error();
  /// Every unit's first block, in the order their updates ran since the last call (tests).
  std::vector<int64_t> take_order();
  /// Tests: the updates of the units whose first block is `first_use` wait until `gate` opens; the
  /// others run meanwhile.
  void hold_unit(int64_t first_use, std::shared_ptr<const device::Gate> gate);
  bool unit_held() const;

  /// The choice (for tests): the position in `queued` of the update to run now, or -1 when every
  /// one that may run is held. `held(update)`: held by a test.
  static int64_t choose(const std::vector<HostUpdate>& queued, const std::function<bool(const HostUpdate&)>& held);

 private:
  void run_next();
  void note_error();

  device::HostQueue& host_;
  Apply apply_;
  std::atomic<int64_t> pending_{0};
  mutable std::mutex mutex_;          ///< guards everything below
  std::vector<HostUpdate> ready_;     ///< queued, not yet started
  std::exception_ptr error_;
  std::vector<int64_t> order_;
  int64_t held_first_use_ = -1;
  std::shared_ptr<const device::Gate> held_;
};

}  // namespace strata::hook_offload
