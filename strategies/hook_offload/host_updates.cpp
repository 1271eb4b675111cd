#include "strategies/hook_offload/host_updates.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <optional>

#include "models/check.h"

namespace strata::hook_offload {

HostUpdate HostUpdate::into_spare(Unit& unit, device::Event landed) {
  HostUpdate update;
  update.unit = &unit;
  update.landed = std::move(landed);
  update.from = unit.host_param;
  update.to = unit.tied.spare_param;
  update.to_travel = unit.tied.spare_travel;
  update.from_state = &unit.optimizer_slots[unit.optimizer_now];
  update.to_state = &unit.optimizer_slots[1 - unit.optimizer_now];
  return update;
}

void HostUpdate::step_in_ranges(const OptimizerConfig& optimizer, const torch::Tensor& grad,
                                std::atomic<int64_t>& host_ns) {
  for (size_t k = 0; k < landed_ranges.size(); ++k) {
    if (!landed_ranges[k].done()) {  // waiting for a range is not update time
      const auto start = std::chrono::steady_clock::now();
      landed_ranges[k].synchronize();
      host_ns -= std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }
    const int64_t begin = range_bounds[k] * cols, n = (range_bounds[k + 1] - range_bounds[k]) * cols;
    optimizer_update_span_into(optimizer, from, *from_state, grad, to, *to_state, to_travel, begin, n);
  }
}

int64_t HostUpdates::choose(const std::vector<HostUpdate>& queued,
                            const std::function<bool(const HostUpdate&)>& held) {
  int64_t best = -1;
  int best_rank = 0;  // 0: not landed; 1: a first part with ranges still to land; 2: landed
  for (size_t i = 0; i < queued.size(); ++i) {
    const auto& r = queued[i];
    // A unit's parts run in the order they were queued (its first part before its rows).
    if (std::any_of(queued.begin(), queued.begin() + static_cast<std::ptrdiff_t>(i),
                    [&](const HostUpdate& earlier) { return earlier.unit == r.unit; }))
      continue;
    if (held(r)) continue;
    // (tied_early: a rows part waits for the early copy's read of its buffer too; until then it is
    // not taken ahead of updates that can run at once.) A first part in ranges counts as landed
    // with its first range, but one whose last has not landed would hold the worker while it
    // waits: updates that can run whole go first.
    const bool landed = r.landed.done() && r.source_read.done();
    const int rank = !landed ? 0 : (!r.landed_ranges.empty() && !r.landed_ranges.back().done()) ? 1 : 2;
    if (best < 0 || rank > best_rank ||
        (rank == best_rank && rank > 0 && r.unit->first_use < queued[static_cast<size_t>(best)].unit->first_use)) {
      best = static_cast<int64_t>(i);
      best_rank = rank;
    }
  }
  return best;
}

void HostUpdates::push(HostUpdate update, std::shared_ptr<const device::Gate> hold) {
  ++pending_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_.push_back(std::move(update));
  }
  std::shared_ptr<at::ThreadLocalState> traced;
  if (at::hasThreadLocalCallbacks()) traced = std::make_shared<at::ThreadLocalState>();
  host_.submit([this, hold = std::move(hold), traced] {
    std::optional<at::ThreadLocalStateGuard> in_trace;
    if (traced) in_trace.emplace(*traced);
    if (hold) hold->wait();  // before the choice, so it sees every held update
    run_next();
  });
}

void HostUpdates::run_next() {
  // Each task runs one update, not necessarily the one queued with it; every task finds at least
  // the update queued with it, or another in its place.
  HostUpdate next;
  try {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      bool held = false;
      const auto best = choose(ready_, [&](const HostUpdate& r) {
        const bool h = held_ && r.unit->first_use == held_first_use_ && !held_->is_open();
        held = held || h;
        return h;
      });
      if (best < 0 && held) {  // only held ones left: look again once its gate opens or others are queued
        auto gate = held_;
        lock.unlock();
        gate->wait_for(std::chrono::milliseconds(1));
        continue;
      }
      STRATA_CHECK(best >= 0, "hook_offload: an overlapped update ran with no eligible unit queued (internal error)");
      next = std::move(ready_[static_cast<size_t>(best)]);
      ready_.erase(ready_.begin() + best);
      break;
    }
  } catch (...) {
    note_error();
    --pending_;
    throw;
  }
  // Opens whatever happens: a fetch queued behind it must never wait forever.
  struct Finish {
    HostUpdates* self;
    std::shared_ptr<device::Gate> done;
    ~Finish() {
      --self->pending_;
      if (done) done->open();
    }
  } finish{this, next.done};
  try {
    apply_(next);
    if (next.part == HostUpdate::Part::first) return;  // the unit is not updated yet
    std::lock_guard<std::mutex> lock(mutex_);
    order_.push_back(next.unit->first_use);
  } catch (...) {
    // The gate opens all the same: the error is reported by the next train_step or optimizer_step,
    // and that step's results are not to be trusted.
    note_error();
    throw;
  }
}

void HostUpdates::note_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) error_ = std::current_exception();
}

std::exception_ptr HostUpdates::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

std::exception_ptr HostUpdates::take_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(error_, nullptr);
}

std::vector<int64_t> HostUpdates::take_order() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(order_, {});
}

void HostUpdates::hold_unit(int64_t first_use, std::shared_ptr<const device::Gate> gate) {
  std::lock_guard<std::mutex> lock(mutex_);
  held_first_use_ = first_use;
  held_ = std::move(gate);
}

bool HostUpdates::unit_held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(held_);
}

}  // namespace strata::hook_offload
