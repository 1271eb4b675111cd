#pragma once
// Hook offload (seed 003, done right): parameters and gradients live in pinned host buffers
// allocated once; each block's parameters are streamed to the device on a side stream just before
// use (prefetching the next blocks) and released right after; backward re-fetches in reverse order
// and recomputes the block (or uses kept activations); gradients stream back to host buffers while
// a block's backward runs, in parts as autograd produces them (grads_in_parts; or once it is
// done); the optimizer runs on the host, and (without overlap_optimizer) fetches the windows the
// next forward opens with (blocks 0 to prefetch, or `opening` of them) as soon as their own units
// are updated, so that forward does not start on an idle link. A tied parameter is one host copy,
// loaded once per use window by reference count (in a forward kept from one use to the next:
// carry_tied), and receives the sum of its uses' gradients, added on the device as each use's
// backward ends and sent to the host once, after the last. A matrix used twice (the GPT's
// embedding and head) is summed on the host instead (hook_offload::TiedRows): the first use's
// gradient goes down as soon as it exists, hidden behind the rest of backward, and of the last
// use's only the rows that are not all zero (the tokens the batch looked up) follow.
//
// The parts, one file each: options.h (what each option trades), unit.h (what moves as one and the
// state it carries), host_updates.h (the overlapped optimizer's queue, and the order it runs in).
// LibTorch modules have no hooks, so each block runs inside the per-block autograd function of
// strategies/windowed.h, which asks this strategy for load, compute, recompute and release.
//
// Frozen parameters (requires_grad=false) travel with their unit but have no host gradient buffer,
// are never sent back and never updated. Buffers (running statistics, fixed tables) live on the
// device for good: they are small next to the weights, and a buffer the forward updates must keep
// one value across forward, recompute and the next step.
#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>

#include "strategies/device/device.h"
#include "strategies/hook_offload/host_updates.h"
#include "strategies/hook_offload/options.h"
#include "strategies/hook_offload/unit.h"
#include "strategies/strategy.h"
#include "strategies/windowed.h"

namespace strata {

class HookOffload : public Strategy, public WindowedRunner {
 public:
  HookOffload(std::string name, const StrategyConfig& config, HookOffloadOptions options);
  ~HookOffload() override;

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  bool accumulates_gradients() const override { return !options_.overlap_optimizer; }
  void finish_backward() override;
  void finish_step() override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  NamedTensors training_state() override;
  void load_training_state(const NamedTensors& state) override;
  NamedTensors buffers() override;
  Stats stats() override;
  /// bf16 or fp16 compute with gradients brought back and summed in fp32 (reduce=fp32): the
  /// device windows hold compute-dtype weights, streamed from a host copy in the transfer dtype
  /// (half the bytes of fp32 when transfer is the compute dtype), refreshed after each host update;
  /// the host keeps fp32 masters and optimizer state. fp16's loss scaling needs every gradient
  /// before any update, so not with overlap_optimizer=1.
  bool supports(const PrecisionPolicy& policy) const override;
  void reset_stats() override;

  /// Offloaded parameter bytes on the device now (resident blocks not counted): after train_step or
  /// forward none; after optimizer_step (overlap_optimizer=0) the `opening` windows. With
  /// overlap_optimizer and tied_early, from the end of backward (or the backward block boundary
  /// that sent it) to the next forward's first use of it, a tied matrix whose last use was sparse.
  int64_t offloaded_bytes_on_device() const;
  /// The windows the last optimizer_step fetched for the next forward (or found resident), fewer
  /// than planned if a fetch ran out of memory; 0 before the first.
  int64_t last_opening() const { return last_opening_; }
  /// True while gradients are still on their way to the host: a copy queued, or a later
  /// micro-batch's gradient not yet added there. False after finish_backward() (so a timer that
  /// stops after it has counted the whole of backward). After a train_step that failed, parts its
  /// backward sent may still be crossing (no later step reads them before they have).
  bool gradients_in_flight() const;
  /// overlap_optimizer: true while host updates of the last step have not all run. optimizer_step
  /// returns without waiting for them; each unit's next fetch to the device waits for its own.
  bool updates_in_flight() const { return updates_.pending() > 0; }

  // WindowedRunner: called by the per-block autograd function.
  void before_compute(int64_t block, bool backward) override;
  void after_compute(int64_t block, bool backward) override;
  GradientSink gradient_sink(int64_t block) override;
  void flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) override;
  models::BlockModel& model() override;
  bool recompute_block(int64_t block) const override;
  std::vector<KeptGraph>& kept_graphs() override { return kept_; }

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  friend class HookOffloadTestPeer;  // the tests' hooks into the schedule (correctness/support/hook_offload_peer.h)
  using Unit = hook_offload::Unit;
  using HostUpdate = hook_offload::HostUpdate;
  void acquire(Unit& unit);
  /// Queues the copy of the unit's host master to its device buffer, behind the unit's pending
  /// host update if there is one (fetch_ready_first: once that update has run, by
  /// issue_ready_fetches).
  void fetch(Unit& unit);
  /// The copy itself, now, on the copy stream.
  void queue_copy(Unit& unit);
  /// fetch_ready_first: queues the deferred fetches whose updates have run, in the order they were
  /// asked for; with `needed`, polls until that unit's is queued.
  void issue_ready_fetches(Unit* needed = nullptr);
  /// A unit held on the device since before its last update (a resident block) fetched again.
  void refresh_if_stale(Unit& unit);
  /// overlap_optimizer: the unit's gradients are complete once `landed` has passed; its update
  /// joins the host's queue.
  void queue_update(Unit& unit, device::Event landed);
  /// The unit's next fetch waits for `update` (its `done`, the unit's `updated`); a unit held on
  /// the device for good is stale from now on.
  void gate_next_fetch(Unit& unit, HostUpdate& update);
  /// overlap_optimizer, a unit with rows: its step from the first use's gradient (landing with the
  /// latest copy) joins the host's queue, into the spare buffers.
  void queue_first_part(Unit& unit);
  /// ... and its last use's touched rows (values [n, cols] and indices, on the host once `landed`
  /// has passed): added to the gradient and their step taken again from the same start. The spare
  /// buffers become the unit's master.
  /// tied_early (an early copy queued this step): the part writes nothing before that copy has read
  /// its buffer, and gathers the stepped rows into the unit's staging buffer for the next fetch.
  void queue_rows_part(Unit& unit, device::Event landed, torch::Tensor values, torch::Tensor touched);
  /// tied_early: once this step's first part has run (waited for, unless a test holds updates or
  /// copies), the buffer it wrote is queued to a device buffer of its own; false if not.
  bool queue_early_copy(Unit& unit);
  /// tied_early: at a backward block boundary, the early copy of each unit that wants one and whose
  /// first part has ended (without waiting for one still running, unless a test asks).
  void send_early_if_ready();
  /// Waits for this step's first part of the unit to end; false if a test's hold or a failed
  /// update keeps it from ending.
  bool await_first_part(Unit& unit);
  /// The early copy itself: the first part's buffer to a device buffer of its own; false if that
  /// does not fit.
  bool start_early_copy(Unit& unit);
  /// A unit some resident block holds (it keeps its device copy, refreshed whole).
  bool held_by_resident(const Unit& unit) const;
  /// Forgets a unit's early copy (a full fetch or a failed step supersedes it).
  void drop_early(Unit& unit);
  /// Runs a queued update on the host worker, once its gradients have landed (updates_' Apply).
  void apply_update(HostUpdate& update);
  /// Sends a unit's gradient of this step (all its uses summed; `parts`, fp32 and 1-D, make up its
  /// flat trainable prefix in order) to its host buffer, or to be added there (another
  /// micro-batch's). In overlap mode the caller queues the unit's update behind it.
  void send_gradient(Unit& unit, const std::vector<torch::Tensor>& parts);
  /// tied_chunks: a tied matrix's first-use gradient (`flat`, fp32, the whole matrix) sent to its
  /// host buffer as copies of consecutive row ranges, each with its own event, for the first part.
  void send_in_row_ranges(Unit& unit, const torch::Tensor& flat);
  /// The tied_chunks option resolved.
  int64_t tied_chunks() const;
  /// The grads_in_parts option resolved.
  bool grads_in_parts() const;
  /// grads_in_parts: whether the unit's gradient of this backward may go to the host in parts.
  bool sends_in_parts(const Unit& unit) const;
  /// grads_in_parts: parameter p's gradient joins the unit's parts waiting to go; they go once
  /// they make up a quarter of the unit's gradient bytes.
  void take_part(Unit& unit, int64_t p, const torch::Tensor& grad);
  /// Queues the copy of the unit's waiting parts into their slices of its host gradient.
  void send_parts(Unit& unit);
  /// The last use of a tied matrix whose first use was sent already: its rows that are not all
  /// zero, with their indices, added on the host (in plain mode all of it when more than half are
  /// touched); in overlap mode queued as the unit's rows part.
  void send_rows(Unit& unit, const torch::Tensor& flat);
  /// Runs `add` on the host queue once `landed` has passed (a gradient summed into its host
  /// buffer), counted in gradients_in_flight() until it has run and timed as host update work.
  void add_on_host(device::Event landed, std::function<void()> add);
  /// Rethrows the error of an overlapped update that failed (after waiting for the others).
  void rethrow_failed_update();
  /// Waits for `event`; with overlap_optimizer by sleeping between polls, so the host optimizer's
  /// threads, which run meanwhile, keep every core (a CUDA synchronize spins one).
  void wait_for(const device::Event& event) const;
  void release(Unit& unit);
  void hold_window(int64_t block);
  /// `forward`: a forward's own release, after which a shared unit with a later use in this
  /// forward stays (carry_tied).
  void drop_window(int64_t block, bool forward = false);
  /// Lets every window go but the resident ones, and the references carry_tied kept (a forward or
  /// step that ended early).
  void drop_all_windows();
  /// Every carry ends in its forward (its next use is a later block of it): an Error if one did not.
  void check_no_carries() const;
  void wait_for_window(int64_t block);
  void prefetch_from(int64_t block, bool backward);
  /// The windows optimizer_step fetches for the next forward (the `opening` option resolved;
  /// fit from the device memory in use now and backward_seen_bytes_).
  int64_t opening_windows() const;
  /// Notes the device memory in use at a point of backward (opening=fit's budget).
  void sample_backward_memory();
  /// The allocator's bytes in use on the device, or memory_probe_'s reading.
  int64_t device_bytes_in_use() const;
  void finish_pending();
  bool merged(int64_t block) const;
  /// What travels to the device for a unit: its host copy in the transfer dtype.
  const torch::Tensor& travelling(const Unit& unit) const;
  /// The unit's optimizer step over its trainable prefix, on the host (and its travelling copy
  /// refreshed).
  void update_on_host(Unit& unit);
  /// resident_updates=device: the unit's optimizer step on the device, from its summed gradient, on
  /// the compute stream (and its compute-dtype copy refreshed).
  void update_on_device(Unit& unit);
  /// A unit's flat master values (host_param, or the device master of a unit trained there) or
  /// gradient of this step, readable on the host.
  torch::Tensor master_on_host(const Unit& unit) const;
  torch::Tensor gradient_on_host(const Unit& unit) const;
  /// A copy of parameter p's slice of its unit's flat host buffer (values or gradients), shaped.
  torch::Tensor host_copy(size_t p, const torch::Tensor& host_flat) const;

  std::string name_;
  StrategyConfig config_;
  HookOffloadOptions options_;
  std::optional<models::BlockModel> model_;
  std::vector<Unit> units_;
  std::vector<int64_t> by_first_use_;          ///< unit indices in the order the forward first needs them
  std::vector<std::vector<int64_t>> windows_;  ///< block -> units it uses
  std::vector<bool> held_;                     ///< block -> its window holds references now
  std::vector<bool> permanent_;                ///< block -> resident for good
  std::vector<std::pair<int64_t, int64_t>> param_slot_;  ///< parameter -> (unit, offset)
  /// block -> its parameters(), position by position, as indices into model().parameters(): the
  /// order of the block's gradients and of a gradient sink's index. (model().block_parameters()
  /// lists each parameter a block uses once, which is not that order where a block registers one
  /// tensor twice.)
  std::vector<std::vector<int64_t>> block_params_;
  std::vector<char> in_parts_;  ///< parameter -> its gradient of the running backward went in a part (grads_in_parts)
  std::vector<KeptGraph> kept_;  ///< block -> its own graph from forward to backward (kept activations)
  std::deque<device::Event> releases_;  ///< compute events after windows were dropped, oldest first
  torch::Tensor anchor_;  ///< requires grad, so every block's output does (even from token ids)
  device::Stream compute_, h2d_, d2h_;
  device::HostQueue host_;
  device::Event last_copy_;  ///< after the latest gradient copy to the host
  std::shared_ptr<const device::Gate> copy_hold_;  ///< tests: the next step's gradient copies wait for it
  LossScaler scaler_;
  std::atomic<int64_t> host_sums_pending_{0};  ///< later micro-batches' host-side sums not yet run
  hook_offload::HostUpdates updates_;          ///< overlap mode: the host updates, queued as gradients land
  /// Tests (HookOffloadTestPeer): a gate the next train_step's updates wait for, and this step's.
  std::shared_ptr<const device::Gate> update_hold_, step_update_hold_;
  std::function<void(int64_t)> fetch_observer_;     ///< tests: each fetch queued, by the unit's first block
  // Tests (HookOffloadTestPeer): failures and delays injected, and counts of what went how.
  std::atomic<bool> fail_next_gather_{false};       ///< the next rows part throws before its gather
  std::atomic<int64_t> first_part_delay_ms_{0};      ///< every first part sleeps this long first
  std::atomic<int64_t> ranged_first_parts_{0};       ///< first parts stepped range by range, since attach
  bool first_parts_awaited_ = false;                 ///< each backward boundary waits for a wanted first part
  int64_t early_copies_in_backward_ = 0;             ///< early copies sent at a backward block boundary
  std::vector<Unit*> deferred_;  ///< fetch_ready_first: fetches waiting for their units' updates, in asked order
  bool step_in_flight_ = false;  ///< overlap mode: gradients of this step are being applied
  bool step_copies_held_ = false;  ///< this step's gradient copies wait for a test's gate
  int64_t released_late_ = -1;   ///< debug_release_late: the block whose window is still held
  int64_t backward_seen_bytes_ = 0;  ///< the most device memory allocated at a backward hook this step
  int64_t last_opening_ = 0;         ///< last_opening()
  std::function<int64_t()> memory_probe_;  ///< tests: the device memory in use, read instead of the allocator
  std::atomic<int64_t> fetches_behind_updates_{0};  ///< Stats::fetches_behind_host_updates
  std::atomic<int64_t> host_update_ns_{0};          ///< Stats::host_update_ms
  int64_t part_transfers_ = 0;  ///< gradient parts sent while their block's backward ran, since reset_stats
  int64_t bytes_h2d_ = 0, bytes_d2h_ = 0, resident_bytes_ = 0, permanent_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace strata
