#pragma once
// The tests' way into hook_offload's schedule: holds, delays and failures injected where a test
// must make an interleaving certain, and counts of what went how. No user of the strategy needs
// them, so they are not its public interface (a friend test peer, as abseil's CordTestPeer).
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "strategies/hook_offload/hook_offload.h"

namespace strata {

class HookOffloadTestPeer {
 public:
  explicit HookOffloadTestPeer(HookOffload& strategy) : s_(strategy) {}

  /// The device memory in use, in bytes, read from `probe` instead of the allocator (opening=fit's
  /// budget, on a device whose allocator reports nothing).
  void read_device_memory_with(std::function<int64_t()> probe) { s_.memory_probe_ = std::move(probe); }
  /// grads_in_parts: transfers of gradient parts queued while their block's backward was running
  /// (not the last part of each, sent at its end), since the last reset_stats().
  int64_t gradient_part_transfers() const { return s_.part_transfers_; }
  /// Total reference count over all units (0 when nothing is held, resident blocks aside).
  int64_t references_held() const {
    int64_t n = 0;
    for (const auto& unit : s_.units_) n += unit.references;
    for (size_t b = 0; b < s_.windows_.size(); ++b)  // resident blocks hold theirs for good
      if (s_.permanent_[b]) n -= static_cast<int64_t>(s_.windows_[b].size());
    return n;
  }
  /// Makes the next train_step's gradient copies to the host wait until `gate` opens (a copy that
  /// is surely still in flight when train_step returns, however loaded the machine).
  void hold_gradient_copies(std::shared_ptr<const device::Gate> gate) { s_.copy_hold_ = std::move(gate); }
  /// Stats::fetches_behind_host_updates, readable from any thread.
  int64_t fetches_behind_host_updates() const { return s_.fetches_behind_updates_; }
  /// overlap_optimizer: the host updates that the next train_step queues wait until `gate` opens
  /// (updates that are surely unfinished when the next step's forward starts).
  void hold_updates(std::shared_ptr<const device::Gate> gate) { s_.update_hold_ = std::move(gate); }
  /// overlap_optimizer: the first block of each unit updated since the last call, in the order the
  /// updates ran (the order the next forward needs).
  std::vector<int64_t> take_update_order() { return s_.updates_.take_order(); }
  /// overlap_optimizer: the host updates of the units whose first block is `first_use` are left
  /// until `gate` opens; the others run meanwhile.
  void hold_update_of(int64_t first_use, std::shared_ptr<const device::Gate> gate) {
    s_.updates_.hold_unit(first_use, std::move(gate));
  }
  /// Calls `observer` with a unit's first block each time that unit's copy to the device is queued,
  /// on the thread that queues it (the order fetches reach the link).
  void observe_fetches(std::function<void(int64_t first_use)> observer) { s_.fetch_observer_ = std::move(observer); }
  /// tied_early: the next rows part throws once its step has run, before it gathers the rows for
  /// the next fetch (the fetch must not send those rows).
  void fail_next_gather() { s_.fail_next_gather_ = true; }
  /// tied_rows with overlap_optimizer: every first part sleeps `delay` on the host before its step
  /// (a first part still running when backward ends; what copies its buffer must wait).
  void slow_first_parts(std::chrono::milliseconds delay) { s_.first_part_delay_ms_ = delay.count(); }
  /// tied_early: each backward block boundary waits for a first part whose early copy is wanted
  /// (the copy surely goes during backward, however loaded the machine).
  void await_first_parts_in_backward(bool on) { s_.first_parts_awaited_ = on; }
  /// tied_early: early copies sent at a backward block boundary rather than at the end of backward,
  /// since attach (reset_stats does not reset it).
  int64_t early_copies_in_backward() const { return s_.early_copies_in_backward_; }
  /// tied_chunks: first parts stepped range by range, since attach.
  int64_t ranged_first_parts() const { return s_.ranged_first_parts_; }

 private:
  HookOffload& s_;
};

}  // namespace strata
