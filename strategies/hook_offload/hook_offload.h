#pragma once
// Hook offload (seed 003, done right): parameters and gradients live in pinned host buffers
// allocated once; each block's parameters are streamed to the device on a side stream just before
// use (prefetching the next blocks) and released right after; backward re-fetches in reverse order
// and recomputes the block (or uses kept activations); gradients stream back to host buffers while
// a block's backward runs, in parts as autograd produces them (grads_early; or once it is done); the
// optimizer runs on the host, and (without overlap_optimizer) fetches the windows the next forward
// opens with (blocks 0 to prefetch, or `opening` of them) as soon as their own units are updated,
// so that forward does not start on an idle link. A tied parameter is one host copy, loaded once
// per use window by reference count (in a forward kept from one use to the next: carry_tied), and
// receives the sum of its uses' gradients, added on the device as each use's backward ends and
// sent to the host once, after the last; that fp32 sum stays on the device from the first use's
// backward to the last's. A matrix used twice (the GPT's embedding and head; plain mode) is summed
// on the host instead: the first
// use's gradient goes down as soon as it exists, hidden behind the rest of backward, and of the
// last use's only the rows that are not all zero (the tokens the batch looked up) follow, added
// there. What backward's end waits for is then those rows, not the whole matrix. (Only in a step's
// first micro-batch, so accumulated ones still add up in autograd's order; and a unit whose last
// use touched more than half its rows goes back to the device sum for good.)
//
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

#include "strategies/windowed.h"
#include "strategies/device/device.h"
#include "strategies/strategy.h"

namespace strata {

struct HookOffloadOptions {
  /// Blocks fetched ahead; 0 fetches each block when it is needed. Two by default: where a block's
  /// window takes longer to cross the link than the block to compute (gpt-871m on an H200: 4.1 ms
  /// against 3.65), one ahead leaves the link idle between windows; two cost one more window of
  /// device memory during the forward (bench/NOTES.md, "prefetch 2 by default").
  int64_t prefetch = 2;
  /// Windows released by the host whose compute may still be queued on the device when it fetches
  /// another: how far the host may run ahead. Memory a released window held is reusable only once
  /// that compute has run, so each one more costs up to a window of reserved device memory; a host
  /// that issues a block's work about as fast as the device runs it (small blocks) needs the lead.
  int64_t lead = 1;
  /// Windows, from block 0 on, that optimizer_step fetches for the next forward (needs
  /// overlap_optimizer=0), each as soon as its units are updated, so their copies run beside the
  /// host pass and not at the forward's start. Resident windows count and are already there. More
  /// than the model has: all. They stay on the device from the step to their block's forward.
  /// kOpeningAuto: prefetch + 1 (what backward holds at every block, so never more than a step
  /// holds anyway), none with prefetch=0. kOpeningFit: that, and more windows while their bytes
  /// fit in the device memory the last backward was seen using beyond what is in use when the
  /// opening starts, less one window of headroom (fit_opening_windows); where a step's peak is set
  /// in backward (a head's), those cost no peak allocated, but they move their copies into the
  /// host pass, which they slow (bench/NOTES.md, "The opening sized by what backward used"). With
  /// no backward seen (the CPU reports no device memory; a first or failed step) fit is auto.
  static constexpr int64_t kOpeningAuto = -1, kOpeningFit = -2;
  int64_t opening = kOpeningAuto;
  /// A unit several blocks share (a tied embedding and head) stays on the device from one of its
  /// uses in a forward to the next, instead of being released and fetched again: one fetch of it
  /// fewer a forward, for its bytes held in between. Where the later use is a head whose backward
  /// sets the step's peak (a GPT's), the peak holds it anyway.
  bool carry_tied = true;
  /// A tied matrix used twice (an embedding and a head): the first use's gradient goes to the host
  /// as soon as it exists and of the last use's only the rows that are not all zero. With
  /// overlap_optimizer the host takes the matrix's step from the first gradient at once, into a
  /// second copy of the matrix and its optimizer state, and takes it again for the touched rows when
  /// they land, from the same start: most of the step runs while backward still has blocks to go
  /// rather than after its end, for one more host copy of the matrix and its state and the touched
  /// rows' step taken twice. false: the uses' gradients are summed on the device and travel once.
  bool tied_rows = true;
  /// tied_early, with tied_rows and overlap_optimizer: the matrix as the first use's step left it
  /// goes to the device, and the next fetch sends only the touched rows once their step has run
  /// (gpt-871m: 59 of 262 MB at the step's boundary), for the matrix's device bytes held from then
  /// to the next forward. The copy goes at the first backward block boundary after the first part
  /// has ended, once a last use of the matrix was seen sparse (so not in the first step, which
  /// sends it at the end of backward; a last use that turns dense after that wastes one copy). Off by
  /// default: sent at the end of backward it held the rows part behind its read of the buffer; so
  /// paired on three H200 hosts it moved gpt-871m's overlapped step by -6.3, -0.8 and +2.7 ms (two
  /// intervals across 0) and cost gpt-medium's +0.8 and +1.5 ms (bench/NOTES.md). Sent during
  /// backward: gpt-871m -3.3 ms, gpt-medium within noise (its forward then waits for the host's
  /// last block updates instead), so still off.
  bool tied_early = false;
  /// With tied_rows and overlap_optimizer: the first use's gradient of a tied matrix (the head's)
  /// goes to the host as this many copies of consecutive row ranges, and the host steps each
  /// range as soon as its copy has landed, rather than waiting for the whole matrix's (131 MB on
  /// gpt-medium, 2.5 ms on an H200's link) before the first part starts. The same element steps,
  /// so the same result to the bit. 1: one copy. kChunksAuto: 8 where the compute dtype is fp32,
  /// else 1. Paired on H200 hosts at 8, gpt-medium's overlapped step moved by -0.51 to -1.02 ms in
  /// fp32 (four readings), by -0.02 and +0.45 in bf16, gpt-871m's by +0.23 and -0.11 (fp32) and
  /// -1.81 (bf16), all but two intervals across 0; the copies' writes into host memory run beside
  /// the first part's pass and slow it, taking back part of what starting earlier gains
  /// (bench/NOTES.md, "tied_chunks=8 in bf16 and on gpt-871m").
  static constexpr int64_t kChunksAuto = -1;
  int64_t tied_chunks = kChunksAuto;
  /// A block's own gradients go to the host in parts while its backward runs, each part once
  /// autograd has produced a quarter of the unit's gradient bytes (its last at the block's end),
  /// rather than all of them once the backward has ended: what is left to cross the link after the
  /// last block's backward is then its last part, not its whole window (bench/NOTES.md, "A block's
  /// gradients sent while its backward runs"). Tied units, units trained on the device and a
  /// step's later micro-batches (summed on the host through staging) still go at the block's end.
  /// 1 or 0; kEarlyAuto: 1 where the compute dtype is fp32. Under bf16 it made gpt-medium's
  /// forward+backward slower on two H200 hosts (+0.8 and +1.2 ms), for a cause not traced.
  static constexpr int kEarlyAuto = -1;
  int grads_early = kEarlyAuto;
  bool recompute = true;               ///< recompute blocks in backward (checkpointing); false keeps activations
  bool merge_last = true;              ///< the last block stays on the device from its forward through its backward
  std::vector<int64_t> resident;       ///< blocks kept on the device for good
  /// Resident blocks recompute in backward too (resident_activations=recompute), instead of keeping
  /// their forward's activations: about as much device memory a transformer block as its training
  /// state (bench/NOTES.md, "Resident blocks recomputed on request"), for one more forward of it.
  bool recompute_resident = false;
  /// Units every use of which is a resident block are also trained on the device: their fp32
  /// masters, gradients and optimizer state stay there and their update runs there (in the overlap
  /// mode as soon as their gradient is complete), so they cost the link and the host nothing, for
  /// up to 16 bytes a parameter of device memory. A unit shared with a block that is not resident
  /// (a tied embedding whose head is offloaded) stays on the host. The host's pass shrinks by their
  /// share, which is what bounds the overlapped step (bench/NOTES.md, "What would move the
  /// overlapped step").
  bool resident_updates_on_device = false;
  /// Update each unit on the host as soon as its gradients land; updates that backward's end
  /// leaves undone finish while the next step's forward runs, in the order it needs them.
  bool overlap_optimizer = false;
  /// With overlap_optimizer: optimizer_step returns before the updates backward left undone have
  /// run (each unit's next fetch waits for its own); false waits for all of them there.
  bool defer_updates = true;
  /// fetch_order=ready, with overlap_optimizer: a fetch whose unit's host update is still running is
  /// not queued on the copy stream until that update has run (the forward's thread waits for it
  /// where it needs the unit), so the fetches asked for after it, of units already updated, cross
  /// the link first. At the step's boundary the first windows' updates end out of forward order.
  /// in_order (false) queues every fetch in forward order, each behind its update, and everything
  /// after a held one waits with it (bench/NOTES.md, "The step boundary's fetches").
  bool fetch_ready_first = true;
  bool debug_poison = false;           ///< fill every fetched buffer with NaN before the copy (tests)
  bool debug_skip_waits = false;       ///< compute does not wait for fetches: a deliberate bug (tests)
  bool debug_release_late = false;     ///< each window is dropped one block late: a deliberate bug (tests)
  bool debug_step_unwaited = false;    ///< optimizer_step does not wait for the gradients in flight: a
                                       ///< deliberate bug (tests)

  static HookOffloadOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
  /// Checks the options against a model of `num_blocks` blocks.
  void validate_for(int64_t num_blocks) const;
};

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
  /// Tests: the device memory in use, in bytes, read from `probe` instead of the allocator
  /// (opening=fit's budget, on a device whose allocator reports nothing).
  void read_device_memory_with(std::function<int64_t()> probe) { memory_probe_ = std::move(probe); }
  /// opening=fit: how many windows, from block 0 on, the opening holds. `new_bytes[k]`: the device
  /// bytes window k adds to windows 0 to k-1 (0 for units held already or in an earlier window).
  /// At least `floor` (capped at the model's windows); beyond it, windows while the sum of their
  /// bytes stays within `budget`.
  static int64_t fit_opening_windows(const std::vector<int64_t>& new_bytes, int64_t floor, int64_t budget);
  /// grads_early: transfers of gradient parts queued while their block's backward was running
  /// (not the last part of each, sent at its end), since the last reset_stats() (tests: parts
  /// did go early).
  int64_t early_gradient_transfers() const { return early_transfers_; }
  /// Total reference count over all units (0 when nothing is held, resident blocks aside).
  int64_t references_held() const;
  /// True while gradients are still on their way to the host: a copy queued, or a later
  /// micro-batch's gradient not yet added there. False after finish_backward() (so a timer that
  /// stops after it has counted the whole of backward). After a train_step that failed, parts its
  /// backward sent early may still be crossing (no later step reads them before they have).
  bool gradients_in_flight() const;
  /// Makes the next train_step's gradient copies to the host wait until `gate` opens (tests: a
  /// copy that is surely still in flight when train_step returns, however loaded the machine).
  void hold_gradient_copies(std::shared_ptr<const device::Gate> gate) { copy_hold_ = std::move(gate); }
  /// overlap_optimizer: true while host updates of the last step have not all run. optimizer_step
  /// returns without waiting for them; each unit's next fetch to the device waits for its own.
  bool updates_in_flight() const { return updates_pending_ > 0; }
  /// Stats::fetches_behind_host_updates, readable from any thread (tests).
  int64_t fetches_behind_host_updates() const { return fetches_behind_updates_; }
  /// overlap_optimizer: makes the host updates that the next train_step queues wait until `gate`
  /// opens (tests: updates that are surely unfinished when the next step's forward starts).
  void hold_updates(std::shared_ptr<const device::Gate> gate) { update_hold_ = std::move(gate); }
  /// overlap_optimizer: the first block (Unit::first_use) of each unit updated since the last
  /// call, in the order the updates ran (tests: the order the next forward needs).
  std::vector<int64_t> take_update_order();
  /// overlap_optimizer: the host updates of the units whose first block is `first_use` are left
  /// until `gate` opens; the others run meanwhile (tests: one update surely unfinished while the
  /// units after it are updated).
  void hold_update_of(int64_t first_use, std::shared_ptr<const device::Gate> gate);
  /// Calls `observer` with a unit's first block each time that unit's copy to the device is queued,
  /// on the thread that queues it (tests: the order fetches reach the link).
  void observe_fetches(std::function<void(int64_t first_use)> observer) { fetch_observer_ = std::move(observer); }
  /// tied_early: the next rows part throws once its step has run, before it gathers the rows for
  /// the next fetch (tests: a host update that fails there; the fetch must not send those rows).
  void fail_next_gather() { fail_next_gather_ = true; }
  /// tied_rows with overlap_optimizer: every first part sleeps `delay` on the host before its step
  /// (tests: a first part still running when backward ends; what copies its buffer must wait).
  void slow_first_parts(std::chrono::milliseconds delay) { first_part_delay_ms_ = delay.count(); }
  /// tied_early: each backward block boundary waits for a first part whose early copy is wanted
  /// (tests: the copy surely goes during backward, however loaded the machine).
  void await_first_parts_in_backward(bool on) { first_parts_awaited_ = on; }
  /// tied_early: early copies sent at a backward block boundary rather than at the end of backward,
  /// since attach (reset_stats does not reset it).
  int64_t early_copies_in_backward() const { return early_copies_in_backward_; }
  /// tied_chunks: first parts stepped range by range, since attach (tests: the ranges did go).
  int64_t ranged_first_parts() const { return ranged_first_parts_; }

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
  struct Unit;
  struct ReadyUpdate;
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
  void gate_next_fetch(Unit& unit, ReadyUpdate& update);
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
  /// A part of the unit's step from its master into its spare buffers.
  ReadyUpdate spare_part(Unit& unit, device::Event landed);
  void push_update(ReadyUpdate update);
  /// Adds touched rows' gradients (values [n, cols], distinct row indices) into a flat host gradient.
  static void add_rows(const torch::Tensor& grad, const torch::Tensor& values, const torch::Tensor& touched);
  /// Sends a unit's gradient of this step (all its uses summed; `parts`, fp32 and 1-D, make up its
  /// flat trainable prefix in order) to its host buffer, or to be added there (another
  /// micro-batch's). In overlap mode the caller queues the unit's update behind it.
  void send_gradient(Unit& unit, const std::vector<torch::Tensor>& parts);
  /// tied_chunks: a tied matrix's first-use gradient (`flat`, fp32, the whole matrix) sent to its
  /// host buffer as copies of consecutive row ranges, each with its own event, for the first part.
  void send_in_row_ranges(Unit& unit, const torch::Tensor& flat);
  /// tied_chunks, on the host worker: a first part's step from `grad`, range by range, each once
  /// its copy has landed.
  void step_in_ranges(ReadyUpdate& next, const torch::Tensor& grad);
  /// The tied_chunks option resolved.
  int64_t tied_chunks() const;
  /// The grads_early option resolved.
  bool grads_early() const;
  /// grads_early: whether the unit's gradient of this backward may go to the host in parts.
  bool sends_early(const Unit& unit) const;
  /// grads_early: parameter p's gradient joins the unit's parts waiting to go; they go once they
  /// make up a quarter of the unit's gradient bytes.
  void take_early(Unit& unit, int64_t p, const torch::Tensor& grad);
  /// Queues the copy of the unit's waiting parts into their slices of its host gradient.
  void send_early_parts(Unit& unit);
  /// The last use of a tied matrix whose first use was sent already: its rows that are not all
  /// zero, with their indices, added on the host (in plain mode all of it when more than half are
  /// touched); in overlap mode queued as the unit's rows part.
  void send_rows(Unit& unit, const torch::Tensor& flat);
  /// Runs `add` on the host queue once `landed` has passed (a gradient summed into its host
  /// buffer), counted in gradients_in_flight() until it has run and timed as host update work.
  void add_on_host(device::Event landed, std::function<void()> add);
  /// Runs one queued update: of those whose gradients have landed, the unit the next forward
  /// needs first; if none has landed yet, the one queued first.
  void run_next_update();
  /// Rethrows the error of an overlapped update that failed (after waiting for the others).
  void rethrow_failed_update();
  /// Keeps the error being thrown by an overlapped update for the next call to report.
  void note_update_error();
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
  std::vector<char> sent_early_;  ///< parameter -> its gradient of the running backward went (grads_early)
  std::vector<KeptGraph> kept_;  ///< block -> its own graph from forward to backward (kept activations)
  std::deque<device::Event> releases_;  ///< compute events after windows were dropped, oldest first
  torch::Tensor anchor_;  ///< requires grad, so every block's output does (even from token ids)
  device::Stream compute_, h2d_, d2h_;
  device::HostQueue host_;
  device::Event last_copy_;  ///< after the latest gradient copy to the host
  std::shared_ptr<const device::Gate> copy_hold_;  ///< hold_gradient_copies, for the next step
  LossScaler scaler_;
  std::atomic<int64_t> host_sums_pending_{0};  ///< later micro-batches' host-side sums not yet run
  std::mutex ready_mutex_;                     ///< guards ready_, update_error_, update_order_
  std::vector<ReadyUpdate> ready_;             ///< overlap mode: updates queued, not yet started
  std::atomic<int64_t> updates_pending_{0};    ///< overlap mode: updates queued, not yet finished
  std::exception_ptr update_error_;            ///< an overlapped update threw (ready_mutex_; reported next)
  std::vector<int64_t> update_order_;          ///< take_update_order
  std::shared_ptr<const device::Gate> update_hold_, step_update_hold_;  ///< hold_updates
  int64_t unit_hold_first_use_ = -1;                ///< hold_update_of (ready_mutex_)
  std::shared_ptr<const device::Gate> unit_hold_;   ///< hold_update_of (ready_mutex_)
  std::function<void(int64_t)> fetch_observer_;     ///< observe_fetches
  std::atomic<bool> fail_next_gather_{false};       ///< fail_next_gather
  std::atomic<int64_t> first_part_delay_ms_{0};      ///< slow_first_parts
  std::atomic<int64_t> ranged_first_parts_{0};       ///< ranged_first_parts
  bool first_parts_awaited_ = false;                 ///< await_first_parts_in_backward
  int64_t early_copies_in_backward_ = 0;             ///< early_copies_in_backward
  std::vector<Unit*> deferred_;  ///< fetch_ready_first: fetches waiting for their units' updates, in asked order
  bool step_in_flight_ = false;  ///< overlap mode: gradients of this step are being applied
  bool step_copies_held_ = false;  ///< this step's gradient copies wait for a test's gate (hold_gradient_copies)
  int64_t released_late_ = -1;   ///< debug_release_late: the block whose window is still held
  int64_t backward_seen_bytes_ = 0;  ///< the most device memory allocated at a backward hook this step
  int64_t last_opening_ = 0;         ///< last_opening()
  std::function<int64_t()> memory_probe_;  ///< read_device_memory_with
  std::atomic<int64_t> fetches_behind_updates_{0};  ///< Stats::fetches_behind_host_updates
  std::atomic<int64_t> host_update_ns_{0};          ///< Stats::host_update_ms
  int64_t early_transfers_ = 0;  ///< early_gradient_transfers()
  int64_t bytes_h2d_ = 0, bytes_d2h_ = 0, resident_bytes_ = 0, permanent_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace strata
