#include "strategies/hook_offload/hook_offload.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <numeric>
#include <thread>
#include <unordered_map>
#include <utility>

#include "models/check.h"
#include "models/compat.h"
#include "models/threads.h"
#include "strategies/options.h"

namespace strata {

HookOffloadOptions HookOffloadOptions::parse(const std::map<std::string, std::string>& options) {
  OptionReader reader("hook_offload", options);
  HookOffloadOptions o;
  o.prefetch = reader.get_int("prefetch", o.prefetch);
  o.lead = reader.get_int("lead", o.lead);
  const auto opening = reader.get_string("opening", "auto");
  if (opening == "fit") {
    o.opening = HookOffloadOptions::kOpeningFit;
  } else if (opening != "auto") {
    o.opening = reader.get_int("opening", o.opening);  // an Error names a value that is not an integer
    STRATA_CHECK(o.opening >= 0, "hook_offload: option opening='"
                                     << opening << "' is not valid; use auto, fit or a window count, 0 or more");
  }
  const auto early = reader.get_choice("grads_early", {"auto", "1", "0"});
  o.grads_early = early == "auto" ? HookOffloadOptions::kEarlyAuto : early == "1" ? 1 : 0;
  o.recompute = reader.get_choice("activations", {"recompute", "keep"}) == "recompute";
  o.carry_tied = reader.get_bool("carry_tied", o.carry_tied);
  o.tied_rows = reader.get_bool("tied_rows", o.tied_rows);
  o.tied_early = reader.get_bool("tied_early", o.tied_early);
  const auto chunks = reader.get_string("tied_chunks", "auto");
  if (chunks != "auto") {
    o.tied_chunks = reader.get_int("tied_chunks", o.tied_chunks);  // an Error names a value that is not an integer
    STRATA_CHECK(o.tied_chunks >= 1, "hook_offload: option tied_chunks='" << chunks
                                         << "' is not valid; use auto or a copy count, 1 or more");
  }
  o.merge_last = reader.get_bool("merge_last", o.merge_last);
  o.resident = reader.get_ints("resident", o.resident);
  o.recompute_resident = reader.get_choice("resident_activations", {"keep", "recompute"}) == "recompute";
  o.resident_updates_on_device = reader.get_choice("resident_updates", {"host", "device"}) == "device";
  o.overlap_optimizer = reader.get_bool("overlap_optimizer", o.overlap_optimizer);
  o.defer_updates = reader.get_bool("defer_updates", o.defer_updates);
  o.fetch_ready_first = reader.get_choice("fetch_order", {"ready", "in_order"}) == "ready";
  o.debug_poison = reader.get_bool("debug_poison", o.debug_poison);
  o.debug_skip_waits = reader.get_bool("debug_skip_waits", o.debug_skip_waits);
  o.debug_release_late = reader.get_bool("debug_release_late", o.debug_release_late);
  o.debug_step_unwaited = reader.get_bool("debug_step_unwaited", o.debug_step_unwaited);
  reader.finish();
  o.validate();
  return o;
}

void HookOffloadOptions::validate() const {
  STRATA_CHECK(prefetch >= 0, "hook_offload: prefetch=" << prefetch << " must be 0 (synchronous) or more");
  STRATA_CHECK(lead >= 0, "hook_offload: lead=" << lead << " must be 0 (wait for each released window's compute) or more");
  STRATA_CHECK(opening >= kOpeningFit,
               "hook_offload: opening=" << opening << " must be -1 (auto), -2 (fit) or a window count, 0 or more");
  // The overlapped optimizer fetches nothing in optimizer_step (its updates finish under the next
  // forward, whose own fetches wait for them): an opening there would be silently ignored.
  STRATA_CHECK(opening == kOpeningAuto || !overlap_optimizer,
               "hook_offload: opening=" << (opening == kOpeningFit ? std::string("fit") : std::to_string(opening))
                                        << " needs overlap_optimizer=0 (the overlapped optimizer fetches no window in "
                                           "optimizer_step)");
  STRATA_CHECK(tied_chunks >= 1 || tied_chunks == kChunksAuto,
               "hook_offload: tied_chunks=" << tied_chunks << " must be auto, 1 (one copy) or more");
  for (auto b : resident) STRATA_CHECK(b >= 0, "hook_offload: resident block " << b << " is negative");
  STRATA_CHECK(!recompute_resident || !resident.empty(),
               "hook_offload: resident_activations=recompute recomputes resident blocks, and resident names none; "
               "give resident=BLOCKS");
  STRATA_CHECK(!resident_updates_on_device || !resident.empty(),
               "hook_offload: resident_updates=device trains resident blocks on the device, and resident names none; "
               "give resident=BLOCKS");
}

void HookOffloadOptions::validate_for(int64_t num_blocks) const {
  for (auto b : resident)
    STRATA_CHECK(b < num_blocks, "hook_offload: resident block " << b << " does not exist; the model has "
                                                                 << num_blocks << " blocks (0 to " << num_blocks - 1
                                                                 << ")");
  // The merged last block keeps its activations whatever it is: asking it alone to recompute would
  // silently do nothing.
  STRATA_CHECK(!recompute_resident || !merge_last ||
                   std::any_of(resident.begin(), resident.end(), [&](int64_t b) { return b != num_blocks - 1; }),
               "hook_offload: resident_activations=recompute names only the last block ("
                   << num_blocks - 1 << "), which merge_last=1 keeps from its forward through its backward; "
                   "give merge_last=0 or other resident blocks");
}

// A unit is what moves as one: the parameters only one block uses (that block's own), or one
// parameter several blocks share (a tied weight). Each has one flat pinned host copy of its values
// and gradients, and one flat device buffer whose memory exists only while it is held.
struct HookOffload::Unit {
  std::vector<int64_t> params;  ///< indices into model().parameters(), in flat order: trainable ones first
  int64_t numel = 0;
  int64_t bytes = 0;
  int64_t trainable_numel = 0;  ///< the leading elements that train; the rest are frozen
  int users = 0;                ///< blocks whose window holds this unit
  torch::Tensor host_param;     ///< fp32 master
  torch::Tensor host_travel;    ///< the master in the transfer dtype; undefined when that is fp32
  int64_t travel_bytes = 0;     ///< bytes of one fetch to the device
  torch::Tensor host_grad;      ///< trainable_numel elements; undefined for a unit that is all frozen
  torch::Tensor device_flat;    ///< parameters are views of it; its storage is released when unheld
  int references = 0;
  device::Event loaded;
  bool grad_filled = false;     ///< host_grad holds this step's gradient (else it is stale)
  int pending_users = 0;        ///< backward contributions still to come this step
  torch::Tensor device_grad;    ///< a tied unit's gradients of this step's earlier uses, summed on the device
  /// Rows of a tied matrix used twice (an embedding and a head; tied_rows), 0 for other units: the
  /// first use's gradient goes to the host as soon as it exists, and of the last use's only the
  /// rows that are not all zero (an embedding's, the rows its batch looked up), added there.
  int64_t rows = 0;
  /// Overlap mode, a unit with rows: the host takes the step from the first use's gradient as soon
  /// as it lands, from the master into these (and the other optimizer slot), then again for the
  /// last use's touched rows from the same start. Once that is queued they are the master, and the
  /// old master the next step's spare.
  torch::Tensor spare_param, spare_travel;
  /// Written by the host worker: this step's first part ran to its end. A rows part after one that
  /// did not takes the whole step instead of the rows alone. Read on the main thread only once
  /// first_part_ended is open: a backward that failed after a first part leaves it true into the
  /// next step, until that step's own first part writes it again.
  bool first_part_done = false;
  /// Opens once this step's first part has ended, whether it ran or failed (null before one is queued).
  std::shared_ptr<device::Gate> first_part_ended;
  /// tied_early: the host buffer this step's first part writes (in the transfer dtype), and the
  /// device buffer it went to once written; its rows the last use touched (on the device, with the
  /// compute event that made them) and their stepped values (pinned host), sent by the next fetch.
  torch::Tensor early_source, early_flat, early_touched, early_staging;
  device::Event early_touched_made, early_loaded;
  /// Opens once the rows part has gathered its rows into early_staging (never, if it failed).
  std::shared_ptr<device::Gate> early_rows_gathered;
  /// The unit's device buffer is the early one, handed over by acquire(): its fetch sends the rows alone.
  bool early_rows_next = false;
  /// tied_early: a last use of the unit was sparse, so from then on its early copy is wanted as
  /// soon as the first part has ended (early_wanted, set when the first part is queued), not only at
  /// the end of backward.
  bool sparse_seen = false, early_wanted = false;
  /// tied_early: this step's early copy went during backward and its rows part is not queued yet
  /// (the rows part's gather gate is made when it is).
  bool early_sent_in_backward() const { return early_flat.defined() && !early_rows_gathered; }
  /// grads_early: gradient parts of the running backward waiting to go to host_grad, at these
  /// offsets, and their bytes.
  std::vector<torch::Tensor> early_parts;
  std::vector<int64_t> early_offsets;
  int64_t early_part_bytes = 0;
  bool first_use_sent = false;  ///< this step's first use went to the host; the last use's rows follow
  /// tied_chunks: the first use's gradient went as row ranges [bounds[k], bounds[k + 1]), range k
  /// landed once landed_ranges[k] has passed; handed to the first part when it is queued.
  std::vector<device::Event> landed_ranges;
  std::vector<int64_t> range_bounds;
  int64_t first_use = 0;        ///< the first block whose window holds this unit (forward order)
  std::vector<int64_t> uses;    ///< the blocks whose windows hold this unit, in forward order
  /// carry_tied: the block whose window, once held, takes over the reference this unit keeps from
  /// its previous use in this forward; -1 when it keeps none.
  int64_t carried_to = -1;
  bool stale = false;           ///< held on the device across an optimizer step: its copy is old
  /// overlap mode: opens once this step's host update of the unit has run; the unit's next fetch
  /// waits for it. Null when no update is pending.
  std::shared_ptr<device::Gate> updated;
  /// fetch_ready_first: its fetch was asked for before `updated` opened and is not queued yet; its
  /// device buffer is allocated and unwritten (HookOffload::deferred_ lists it).
  bool fetch_deferred = false;
  /// Optimizer state: slot `optimizer_now` goes with host_param, the other with spare_param.
  std::array<OptimizerState, 2> optimizer_slots;
  int optimizer_now = 0;
  OptimizerState& optimizer() { return optimizer_slots[optimizer_now]; }
  /// resident_updates=device and every use resident: trained on the device. Its master is
  /// device_master (device_flat itself when the compute dtype is fp32), its gradient of this step
  /// device_grad_sum, its optimizer state on the device; host_param and host_grad are not used.
  bool on_device() const { return device_master.defined(); }
  torch::Tensor device_master;
  torch::Tensor device_grad_sum;
};

struct HookOffload::ReadyUpdate {
  /// whole: the unit's step in place. first: a tied matrix's step from its first use's gradient,
  /// into the spare buffers. rows: its last use's touched rows added, and their step taken again.
  enum class Part { whole, first, rows };
  Unit* unit = nullptr;
  device::Event landed;                       ///< after the unit's last gradient copy (first: its first use's)
  std::shared_ptr<device::Gate> done;         ///< the unit's `updated`; null for a first part
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
  /// sets the unit's rows to 0 before this part may have run). Empty: the whole gradient at `landed`.
  std::vector<device::Event> landed_ranges;
  std::vector<int64_t> range_bounds;
  int64_t cols = 0;
};

HookOffload::HookOffload(std::string name, const StrategyConfig& config, HookOffloadOptions options)
    : name_(std::move(name)),
      config_(config),
      options_(std::move(options)),
      compute_(device::Stream::compute(config.device)),
      h2d_(device::Stream::side(config.device)),
      d2h_(device::Stream::side(config.device)),
      scaler_(config.precision) {}

bool HookOffload::supports(const PrecisionPolicy& policy) const {
  return policy.reduce == torch::kFloat && !(policy.scales_loss() && options_.overlap_optimizer);
}

const torch::Tensor& HookOffload::travelling(const Unit& unit) const {
  return unit.host_travel.defined() ? unit.host_travel : unit.host_param;
}

HookOffload::~HookOffload() {
  // Queued copies reference host and device buffers: let them finish first.
  // Each on its own: a failed host task (rethrown by drain) must not skip the streams.
  auto quietly = [](auto&& finish) {
    try {
      finish();
    } catch (...) {
    }
  };
  quietly([&] { host_.drain(); });
  quietly([&] { h2d_.synchronize(); });
  quietly([&] { d2h_.synchronize(); });
}

models::BlockModel& HookOffload::model() {
  STRATA_CHECK(model_.has_value(), name_ << ": attach() a model first");
  return *model_;
}

bool HookOffload::merged(int64_t block) const {
  return options_.merge_last && block == static_cast<int64_t>(windows_.size()) - 1;
}

bool HookOffload::recompute_block(int64_t block) const {
  // The merged last block keeps its activations: its backward follows its forward at once. A
  // resident block keeps them unless resident_activations=recompute: its weights are there anyway,
  // so recomputing it saves only the activations' memory.
  if (merged(block)) return false;
  return permanent_[block] ? options_.recompute_resident : options_.recompute;
}

void HookOffload::attach_model(models::BlockModel model) {
  check_buffers_under(config_.precision, model, name_);
  options_.validate_for(model.num_blocks());
  const auto& params = model.parameters();
  auto plan = plan_units(model);
  windows_ = std::move(plan.windows);
  units_.resize(plan.units.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    units_[u].params = std::move(plan.units[u]);
    units_[u].users = plan.users[u];
  }
  for (int64_t b = 0; b < static_cast<int64_t>(windows_.size()); ++b)
    for (auto u : windows_[b]) units_[u].uses.push_back(b);
  for (auto& unit : units_)
    unit.first_use = unit.uses.empty() ? static_cast<int64_t>(windows_.size()) : unit.uses.front();
  by_first_use_.resize(units_.size());
  std::iota(by_first_use_.begin(), by_first_use_.end(), 0);
  std::stable_sort(by_first_use_.begin(), by_first_use_.end(),
                   [&](int64_t a, int64_t b) { return units_[a].first_use < units_[b].first_use; });

  // Host buffers, allocated once; parameters become views of their unit's device buffer.
  param_slot_.assign(params.size(), {-1, 0});
  {
    std::unordered_map<const void*, int64_t> index_of;
    for (size_t p = 0; p < params.size(); ++p) index_of[params[p].tensor.unsafeGetTensorImpl()] = static_cast<int64_t>(p);
    block_params_.assign(model.blocks().size(), {});
    for (size_t b = 0; b < model.blocks().size(); ++b)
      for (const auto& t : model.blocks()[b]->parameters()) block_params_[b].push_back(index_of.at(t.unsafeGetTensorImpl()));
  }
  sent_early_.assign(params.size(), 0);
  const auto& precision = config_.precision;
  const auto dev_options = torch::TensorOptions().dtype(precision.compute).device(config_.device);
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = units_[u];
    for (auto p : unit.params) {
      STRATA_CHECK(params[p].tensor.scalar_type() == torch::kFloat,
                   name_ << ": parameter '" << params[p].name << "' is " << params[p].tensor.scalar_type()
                         << "; hook_offload handles float32 parameters");
      param_slot_[p] = {static_cast<int64_t>(u), unit.numel};
      unit.numel += params[p].tensor.numel();
      if (params[p].tensor.requires_grad()) unit.trainable_numel = unit.numel;
    }
    unit.bytes = unit.numel * static_cast<int64_t>(c10::elementSize(precision.compute));  // on the device
    unit.travel_bytes = unit.numel * static_cast<int64_t>(c10::elementSize(precision.transfer));
    unit.host_param = device::host_buffer({unit.numel}, torch::kFloat, config_.device);
    if (unit.trainable_numel > 0)
      unit.host_grad = device::host_buffer({unit.trainable_numel}, torch::kFloat, config_.device);
    unit.device_flat = torch::empty({unit.numel}, dev_options);
    if (options_.tied_rows && unit.users == 2 && unit.params.size() == 1 && unit.trainable_numel == unit.numel &&
        params[unit.params[0]].tensor.dim() >= 2)
      unit.rows = params[unit.params[0]].tensor.size(0);
    for (auto p : unit.params) {
      auto& t = params[p].tensor;
      const auto offset = param_slot_[p].second;
      unit.host_param.narrow(0, offset, t.numel()).copy_(t.detach().reshape({-1}));
      t.set_data(unit.device_flat.narrow(0, offset, t.numel()).view(t.sizes()));
    }
    if (precision.transfer != torch::kFloat) {
      unit.host_travel = device::host_buffer({unit.numel}, precision.transfer, config_.device);
      unit.host_travel.copy_(unit.host_param);
    }
    if (unit.rows > 0 && options_.overlap_optimizer) {  // written in full by each step's first part
      unit.spare_param = device::host_buffer({unit.numel}, torch::kFloat, config_.device);
      unit.spare_param.copy_(unit.host_param);  // never garbage, even after a first part that failed
      if (unit.host_travel.defined()) {
        unit.spare_travel = device::host_buffer({unit.numel}, precision.transfer, config_.device);
        unit.spare_travel.copy_(unit.host_travel);
      }
    }
    compat::release_storage(unit.device_flat.storage());
  }
  // Buffers move to the device once and stay (Module::to semantics: the same tensor, new data).
  for (const auto& b : model.buffers()) b.tensor.set_data(b.tensor.to(config_.device));
  held_.assign(windows_.size(), false);
  kept_.assign(windows_.size(), {});
  permanent_.assign(windows_.size(), false);
  anchor_ = torch::empty({0}, torch::TensorOptions().dtype(torch::kFloat).device(config_.device)).requires_grad_(true);
  model_.emplace(std::move(model));
  for (auto b : options_.resident) {
    if (permanent_[b]) continue;
    permanent_[b] = true;
    hold_window(b);
  }
  for (const auto& unit : units_)
    if (unit.references > 0) permanent_bytes_ += unit.bytes;
  if (options_.resident_updates_on_device)
    for (auto& unit : units_) {
      if (unit.trainable_numel == 0 || unit.uses.empty() ||
          !std::all_of(unit.uses.begin(), unit.uses.end(), [&](int64_t b) { return permanent_[b]; }))
        continue;
      unit.rows = 0;  // no touched rows go to the host: nothing does
      unit.host_grad = torch::Tensor();
      // The resident window's fetch filled device_flat (compute dtype); the fp32 master is that
      // buffer itself, or a copy of the host master made once.
      unit.loaded.synchronize();  // the fetch has read the host copies dropped below
      unit.device_master = precision.compute == torch::kFloat ? unit.device_flat : unit.host_param.to(config_.device);
      unit.host_param = torch::Tensor();
      unit.host_travel = torch::Tensor();
      unit.spare_param = torch::Tensor();
      unit.spare_travel = torch::Tensor();
    }
}

void HookOffload::fetch(Unit& unit) {
  STRATA_CHECK(!unit.on_device(), name_ << ": a unit trained on the device was fetched from the host (internal error)");
  if (unit.fetch_deferred) {  // refreshed again (a failed step): its copy, queued later, reads the latest
    unit.stale = false;
    return;
  }
  if (!deferred_.empty()) issue_ready_fetches();  // those whose updates have run go first
  if (unit.updated) {
    // Its host update may still be running (overlap mode). Either the copy waits for it unqueued
    // (fetch_ready_first), or it and everything queued behind it on this stream waits for it.
    if (!unit.updated->is_open()) {
      ++fetches_behind_updates_;
      if (options_.fetch_ready_first) {
        unit.fetch_deferred = true;
        unit.stale = false;
        deferred_.push_back(&unit);
        return;
      }
      h2d_.hold(unit.updated);
    }
    unit.updated.reset();
  }
  queue_copy(unit);
}

void HookOffload::queue_copy(Unit& unit) {
  if (unit.early_rows_next && unit.early_rows_gathered->is_open()) {
    // tied_early: the buffer holds the matrix as the first part stepped it; of the rows part's
    // result only the rows it stepped again differ.
    h2d_.wait(unit.early_touched_made);
    h2d_.keep_alive(unit.early_touched);
    h2d_.copy_rows(unit.device_flat.view({unit.rows, -1}), unit.early_touched, unit.early_staging);
    bytes_h2d_ += unit.early_staging.nbytes();
  } else {
    // Also into an early buffer whose rows are not known to be gathered: queued in forward order
    // before the rows part ran (fetch_order=in_order), or after a rows part that failed.
    h2d_.copy(unit.device_flat, travelling(unit));  // transfer=fp32 under bf16: cast on arrival
    bytes_h2d_ += unit.travel_bytes;
  }
  // Used, or superseded by a copy of the latest master whole; but one sent during this backward is
  // for the next forward: backward's own fetch of the unit reads the master its step started from.
  if (!unit.early_sent_in_backward()) drop_early(unit);
  unit.loaded = h2d_.record();
  unit.stale = false;
  if (fetch_observer_) fetch_observer_(unit.first_use);
}

void HookOffload::issue_ready_fetches(Unit* needed) {
  for (;;) {
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      auto& unit = **it;
      if (!unit.updated->is_open()) {
        ++it;
        continue;
      }
      unit.updated.reset();
      unit.fetch_deferred = false;
      it = deferred_.erase(it);
      queue_copy(unit);
    }
    if (!needed || !needed->fetch_deferred) return;
    // Compute needs it now: wait here, on the host, without spinning a core the updates use. An
    // update that fails opens its gate all the same.
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void HookOffload::refresh_if_stale(Unit& unit) {
  if (!unit.stale) return;
  h2d_.wait(compute_.record());  // after the compute still reading the old values
  fetch(unit);
}

void HookOffload::acquire(Unit& unit) {
  if (unit.references > 0) {
    refresh_if_stale(unit);
    ++unit.references;
    return;
  }
  if (unit.early_flat.defined() && unit.early_rows_gathered) {
    // tied_early: the matrix went to a buffer of its own during the last backward; that memory
    // becomes the unit's (allocated on the copy stream, as below), and its fetch sends the rows
    // whose step came after. Its bytes were counted when it was allocated. As in release(), the
    // copy into it must have run before its memory moves (on the CPU a queued copy writes
    // through the tensor when it runs; a CUDA copy was queued with its address). Not before its
    // rows part is queued: a backward that fetches the unit after the early copy went reads the
    // master its step started from, and the early buffer waits for the next forward.
    compute_.wait(unit.early_loaded);
    compat::take_storage(unit.device_flat.storage(), unit.early_flat.storage());
    unit.early_flat = torch::Tensor();
    unit.early_rows_next = true;
    unit.references = 1;  // the memory exists already
    try {
      fetch(unit);
    } catch (...) {  // the memory goes, and with it the early copy
      drop_early(unit);
      release(unit);
      throw;
    }
    return;
  }
  {
    // Allocate on the copy stream, which writes it first; compute marks its use (keep_alive), so
    // the caching allocator does not hand the memory out again before compute is done with it.
    device::Stream::Guard on_h2d(h2d_);
    compat::reallocate_storage(unit.device_flat.storage(), static_cast<size_t>(unit.bytes));
    if (options_.debug_poison) {
      // Queued before the copy on the same stream; only compute that skips its wait can see it.
      torch::NoGradGuard no_grad;
      unit.device_flat.fill_(std::numeric_limits<float>::quiet_NaN());
    }
  }
  fetch(unit);
  unit.references = 1;  // counted only once the memory exists (an allocation may throw)
  resident_bytes_ += unit.bytes;
  peak_bytes_ = std::max(peak_bytes_, resident_bytes_);
}

void HookOffload::release(Unit& unit) {
  STRATA_CHECK(unit.references > 0, name_ << ": a unit was released more often than it was acquired");
  if (--unit.references > 0) return;
  if (unit.fetch_deferred) {  // never queued (a forward that failed first): nothing writes the buffer
    const auto listed = std::find(deferred_.begin(), deferred_.end(), &unit);
    STRATA_CHECK(listed != deferred_.end(), name_ << ": a deferred fetch was not listed (internal error)");
    deferred_.erase(listed);
    unit.fetch_deferred = false;
    drop_early(unit);  // the rows never followed (tied_early): the buffer goes, and with it the early copy
  }
  // A fetch that nobody waited for may still be writing the buffer (CPU: the worker thread).
  compute_.wait(unit.loaded);
  compute_.keep_alive(unit.device_flat);
  compat::release_storage(unit.device_flat.storage());
  resident_bytes_ -= unit.bytes;
}

void HookOffload::hold_window(int64_t block) {
  if (held_[block]) {
    for (auto u : windows_[block]) refresh_if_stale(units_[u]);
    return;
  }
  // Rate limit: the host queues work far ahead of the device. Memory released by a window is only
  // reusable once the compute that read it has run, so before fetching another window wait until
  // at most `lead` released windows are still pending on the device; otherwise the caching
  // allocator sees nothing it may reuse and reserves fresh memory for every fetch. (Releases whose
  // compute has run are forgotten first, so a large lead does not keep every step's events.)
  while (!releases_.empty() && releases_.front().done()) releases_.pop_front();
  while (static_cast<int64_t>(releases_.size()) > options_.lead) {
    wait_for(releases_.front());
    releases_.pop_front();
  }
  const auto& window = windows_[block];
  for (size_t i = 0; i < window.size(); ++i) {
    try {
      acquire(units_[window[i]]);
    } catch (...) {
      for (size_t j = 0; j < i; ++j) release(units_[window[j]]);  // all of the window or none of it
      throw;
    }
  }
  held_[block] = true;
  // The window holds a reference of its own now: a unit carried here from its previous use lets
  // the carried one go (the memory stays, the count falls back to the window's).
  for (auto u : window)
    if (units_[u].carried_to == block) {
      units_[u].carried_to = -1;
      release(units_[u]);
    }
}

void HookOffload::drop_window(int64_t block, bool forward) {
  if (!held_[block] || permanent_[block]) return;
  if (forward && options_.carry_tied) {
    // A shared unit whose next use in this forward is a window not held yet keeps one reference
    // until that window is (hold_window hands it over), so it is not released and fetched again.
    for (auto u : windows_[block]) {
      auto& unit = units_[u];
      const auto next = std::upper_bound(unit.uses.begin(), unit.uses.end(), block);
      if (next == unit.uses.end() || held_[*next] || unit.carried_to >= 0) continue;
      ++unit.references;
      unit.carried_to = *next;
    }
  }
  held_[block] = false;
  for (auto u : windows_[block]) release(units_[u]);
  releases_.push_back(compute_.record());
}

void HookOffload::drop_all_windows() {
  for (auto& unit : units_)
    if (unit.carried_to >= 0) {  // a forward that failed before a carried unit's next use
      unit.carried_to = -1;
      release(unit);
    }
  for (int64_t b = 0; b < static_cast<int64_t>(windows_.size()); ++b) drop_window(b);
}

void HookOffload::check_no_carries() const {
  for (const auto& unit : units_)
    STRATA_CHECK(unit.carried_to < 0, name_ << ": a shared unit was still carried to block " << unit.carried_to
                                            << " after the forward (internal error)");
}

void HookOffload::wait_for_window(int64_t block) {
  for (auto u : windows_[block]) {
    auto& unit = units_[u];
    if (unit.fetch_deferred) issue_ready_fetches(&unit);
    if (!options_.debug_skip_waits) compute_.wait(unit.loaded);
    compute_.keep_alive(unit.device_flat);
  }
}

void HookOffload::prefetch_from(int64_t block, bool backward) {
  const auto n = static_cast<int64_t>(windows_.size());
  for (int64_t k = 1; k <= options_.prefetch; ++k) {
    const int64_t next = backward ? block - k : block + k;
    if (next < 0 || next >= n) break;
    hold_window(next);
  }
}

int64_t HookOffload::fit_opening_windows(const std::vector<int64_t>& new_bytes, int64_t floor, int64_t budget) {
  const auto n = static_cast<int64_t>(new_bytes.size());
  int64_t k = 0, used = 0;
  for (; k < n; ++k) {
    used += new_bytes[k];
    if (k >= floor && used > budget) break;
  }
  return k;
}

int64_t HookOffload::opening_windows() const {
  const auto n = static_cast<int64_t>(windows_.size());
  if (options_.opening >= 0) return std::min(options_.opening, n);
  const int64_t floor = options_.prefetch > 0 ? std::min(options_.prefetch + 1, n) : 0;
  if (options_.opening == HookOffloadOptions::kOpeningAuto) return floor;
  // fit: the device memory backward was seen using, less what is in use now (resident windows, the
  // caller's tensors), less one window of headroom for the first block's own activations. Windows
  // that fit there are held at the forward's start, and none is taken with no backward seen (the
  // CPU, a first step, a step that failed). A heuristic: backward is sampled at its block
  // boundaries only, so it errs low, but a first block whose forward needs more than a window
  // beyond its inputs (kept activations of a large batch) could still go past backward's reading.
  if (backward_seen_bytes_ <= 0) return floor;
  const int64_t now = device_bytes_in_use();
  std::vector<int64_t> new_bytes(n, 0);
  std::vector<bool> counted(units_.size(), false);
  int64_t largest = 0;
  for (int64_t b = 0; b < n; ++b) {
    int64_t window = 0;
    for (auto u : windows_[b]) {
      window += units_[u].bytes;
      if (units_[u].references > 0 || counted[u]) continue;
      counted[u] = true;
      new_bytes[b] += units_[u].bytes;
    }
    largest = std::max(largest, window);
  }
  return fit_opening_windows(new_bytes, floor, backward_seen_bytes_ - now - largest);
}

int64_t HookOffload::device_bytes_in_use() const {
  return memory_probe_ ? memory_probe_() : device::allocator_stats(config_.device).allocated;
}

void HookOffload::sample_backward_memory() {
  if (options_.opening != HookOffloadOptions::kOpeningFit) return;  // only fit reads it
  backward_seen_bytes_ = std::max(backward_seen_bytes_, device_bytes_in_use());
}

void HookOffload::before_compute(int64_t block, bool backward) {
  hold_window(block);
  prefetch_from(block, backward);  // queued behind this block's fetch, overlapping its compute
  if (backward) {
    sample_backward_memory();
    send_early_if_ready();  // behind the fetches this block and the next ones wait for, and once the
                            // last block's window has gone (the head's, which holds the matrix too)
  }
  wait_for_window(block);
  compute_.compute_point();
}

void HookOffload::after_compute(int64_t block, bool backward) {
  // opening=fit: the block's window and gradients are still held.
  if (backward) sample_backward_memory();
  if (!backward && merged(block)) return;  // stays for its backward
  if (options_.debug_release_late) {
    if (released_late_ >= 0) drop_window(released_late_, !backward);
    released_late_ = block;
    return;
  }
  drop_window(block, !backward);
}

namespace {
/// A unit's gradient parts (1-D) as one contiguous tensor: the part itself when there is one.
torch::Tensor as_one_tensor(const std::vector<torch::Tensor>& parts) {
  return parts.size() == 1 ? parts[0].contiguous() : torch::cat(parts);
}
}  // namespace

int64_t HookOffload::tied_chunks() const {
  if (options_.tied_chunks != HookOffloadOptions::kChunksAuto) return options_.tied_chunks;
  return config_.precision.compute == torch::kFloat ? 8 : 1;
}

bool HookOffload::grads_early() const {
  return options_.grads_early == HookOffloadOptions::kEarlyAuto ? config_.precision.compute == torch::kFloat
                                                                 : options_.grads_early == 1;
}

bool HookOffload::sends_early(const Unit& unit) const {
  // One user: the block whose backward runs now is the unit's only and last use this step (so not
  // a tied unit). Not a later micro-batch's gradient (grad_filled), which is added on the host
  // through staging.
  return grads_early() && unit.users == 1 && unit.trainable_numel > 0 && !unit.on_device() && !unit.grad_filled;
}

GradientSink HookOffload::gradient_sink(int64_t block) {
  // None where no unit of the block sends early: its gradients are then captured, the cheaper way.
  const auto& window = windows_[block];
  if (std::none_of(window.begin(), window.end(), [&](int64_t u) { return sends_early(units_[u]); })) return {};
  return [this, block](size_t i, const torch::Tensor& grad) {
    const auto p = block_params_[block][i];
    auto& unit = units_[param_slot_[p].first];
    if (sends_early(unit)) take_early(unit, p, grad);
  };
}

namespace {
/// A parameter's gradient as it goes to the host: flat, in the reduction dtype (fp32), zeros where
/// autograd gave none (a parameter the block left unused).
torch::Tensor travelling_gradient(const torch::Tensor& grad, const torch::Tensor& param) {
  auto g = grad.defined() ? grad.reshape({-1}) : torch::zeros({param.numel()}, param.options().dtype(torch::kFloat));
  return g.scalar_type() == torch::kFloat ? g : g.to(torch::kFloat);
}
}  // namespace

void HookOffload::take_early(Unit& unit, int64_t p, const torch::Tensor& grad) {
  auto part = travelling_gradient(grad, model().parameters()[p].tensor);
  unit.early_parts.push_back(part);
  unit.early_offsets.push_back(param_slot_[p].second);
  unit.early_part_bytes += part.nbytes();
  sent_early_[p] = 1;
  // A quarter at a time: a GPT block's two MLP matrices go as they come and its attention's
  // matrices together; its layer norms' and biases' small gradients ride along, not alone.
  if (4 * unit.early_part_bytes >= unit.trainable_numel * static_cast<int64_t>(sizeof(float))) {
    send_early_parts(unit);
    ++early_transfers_;  // (not those flush_gradients sends at the block's end)
  }
}

void HookOffload::send_early_parts(Unit& unit) {
  if (unit.early_parts.empty()) return;
  d2h_.wait(compute_.record());  // behind the compute that produced them
  for (const auto& part : unit.early_parts) {
    d2h_.keep_alive(part);
    bytes_d2h_ += part.nbytes();
  }
  d2h_.copy_parts(unit.host_grad, unit.early_parts, unit.early_offsets);
  unit.early_parts.clear();
  unit.early_offsets.clear();
  unit.early_part_bytes = 0;
  // last_copy_ is recorded once the unit's last part has gone, in flush_gradients. (A backward
  // that fails before that leaves these copies out of it; every later reader of host_grad
  // synchronises the copy stream first, and the unit's gradient counts as not filled.)
}

void HookOffload::flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) {
  // grads follow the block's parameters() order. A unit's gradients go to the host in its flat
  // order, each copied straight into its slice of the host buffer (no concatenation on the compute
  // stream first). They are concatenated only where the device needs them as one tensor: a unit
  // of several parameters trained on the device.
  const auto& params = model().parameters();
  const auto& index = block_params_[block];
  auto grad_of = [&](int64_t p) {  // the block uses p: its window holds p's unit
    return grads[static_cast<size_t>(std::find(index.begin(), index.end(), p) - index.begin())];
  };
  for (auto u : windows_[block]) {
    auto& unit = units_[u];
    if (unit.trainable_numel == 0) continue;  // all frozen: nothing goes back, nothing to update
    if (std::any_of(unit.params.begin(), unit.params.end(), [&](int64_t p) { return sent_early_[p] != 0; })) {
      // grads_early: parts went while the backward ran. The rest (the last parts, and zeros for a
      // parameter the block left without a gradient) go now, in one transfer with those still
      // waiting; then the unit is whole on its way.
      for (auto p : unit.params) {
        const auto& t = params[p].tensor;
        if (!t.requires_grad()) break;  // the frozen tail
        if (std::exchange(sent_early_[p], 0) != 0) continue;
        unit.early_parts.push_back(travelling_gradient(grad_of(p), t));
        unit.early_offsets.push_back(param_slot_[p].second);
      }
      send_early_parts(unit);
      unit.grad_filled = true;
      --unit.pending_users;
      last_copy_ = d2h_.record();
      if (options_.overlap_optimizer) queue_update(unit, last_copy_);
      continue;
    }
    // Autograd's results (or views of them, or zeros for a parameter the block left without a
    // gradient), read by the device sum (compute stream) or by the copies (marked in use by the
    // copy stream in send_gradient). Gradients return in the reduction dtype (fp32):
    // compute-dtype ones are widened first.
    std::vector<torch::Tensor> parts;
    for (auto p : unit.params) {
      const auto& t = params[p].tensor;
      if (!t.requires_grad()) break;  // the frozen tail
      parts.push_back(travelling_gradient(grad_of(p), t));
    }
    if (--unit.pending_users > 0) {
      if (unit.rows > 0 && !unit.grad_filled) {
        // The first of a tied matrix's two uses (the head's, in the GPT): sent now, behind the rest
        // of backward, rather than held for the last use, which then sends only its touched rows.
        if (options_.overlap_optimizer && tied_chunks() > 1 && parts.size() == 1)
          send_in_row_ranges(unit, parts.front());
        else
          send_gradient(unit, parts);
        unit.first_use_sent = true;
        if (options_.overlap_optimizer) queue_first_part(unit);
        continue;
      }
      // A tied unit with uses still to come in this backward: its gradients add up on the device
      // (as autograd adds a tied parameter's, in the same order) and travel once, at the last use.
      // One copy instead of one per use, and no sum for the host to run; the cost is the unit's
      // gradient held on the device until then.
      unit.device_grad = unit.device_grad.defined() ? unit.device_grad + as_one_tensor(parts) : as_one_tensor(parts);
      continue;
    }
    if (unit.device_grad.defined()) parts = {std::exchange(unit.device_grad, torch::Tensor()) + as_one_tensor(parts)};
    if (unit.first_use_sent) {
      send_rows(unit, as_one_tensor(parts));
      unit.first_use_sent = false;  // after: a send that throws leaves the failed step's reset to drop it
    } else {
      send_gradient(unit, parts);
      if (options_.overlap_optimizer && !unit.on_device()) queue_update(unit, last_copy_);
    }
  }
}

void HookOffload::send_rows(Unit& unit, const torch::Tensor& flat) {
  const int64_t cols = unit.trainable_numel / unit.rows;
  auto matrix = flat.view({unit.rows, cols});
  // Waits for the compute that produced it (the last thing backward does here: the embedding's).
  auto touched = matrix.ne(0).any(1).nonzero().squeeze(1);
  const int64_t n = touched.size(0);
  const bool dense = 2 * n > unit.rows;
  if (dense) {
    // Dense after all (a matrix both of whose uses are dense, say): from the next step on summed on
    // the device and sent once, which costs less. This step's is added on the host in full (in
    // overlap mode as rows, all that are touched, since the first part is queued already).
    unit.rows = 0;
    if (!options_.overlap_optimizer) return send_gradient(unit, {flat});
  }
  auto values = matrix.index_select(0, touched);
  d2h_.wait(compute_.record());
  d2h_.keep_alive(values);
  d2h_.keep_alive(touched);
  auto host_values = device::host_buffer({n, cols}, torch::kFloat, config_.device);
  auto host_touched = device::host_buffer({n}, torch::kLong, config_.device);
  d2h_.copy(host_values, values);
  d2h_.copy(host_touched, touched);
  bytes_d2h_ += values.nbytes() + touched.nbytes();
  last_copy_ = d2h_.record();
  if (options_.overlap_optimizer) {
    unit.early_wanted = false;
    const bool sent = unit.early_sent_in_backward();
    // A copy sent during backward lacks the rows this step takes again; dense, they are all rows:
    // the next fetch sends the whole. The copy may still be reading the buffer the rows part is about
    // to write, unwaited: what it brings is dropped with it (its device buffer is reused only behind it).
    if (dense && sent) drop_early(unit);
    if (!dense) unit.sparse_seen = true;
    if (!dense && (sent || queue_early_copy(unit))) {
      unit.early_touched = touched;
      unit.early_touched_made = compute_.record();
      unit.early_staging = device::host_buffer({n, cols}, config_.precision.transfer, config_.device);
      unit.early_rows_gathered = std::make_shared<device::Gate>();
    }
    return queue_rows_part(unit, last_copy_, host_values, host_touched);
  }
  add_on_host(last_copy_, [host_values, host_touched, grad = unit.host_grad] { add_rows(grad, host_values, host_touched); });
}

void HookOffload::add_rows(const torch::Tensor& grad, const torch::Tensor& values, const torch::Tensor& touched) {
  const int64_t n = touched.numel(), cols = values.size(1);
  float* g = grad.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  const int64_t* row = touched.data_ptr<int64_t>();
  // Distinct rows: the chunks never write the same element.
  parallel_row_spans(n * cols, row, cols, [&](int64_t item, int64_t element, int64_t length) {
    for (int64_t k = 0; k < length; ++k) g[element + k] += v[item + k];
  });
}

void HookOffload::add_on_host(device::Event landed, std::function<void()> add) {
  ++host_sums_pending_;
  host_.submit([this, landed = std::move(landed), add = std::move(add)] {
    struct Uncount {  // also when the wait or the add throws: gradients_in_flight() must not stick
      std::atomic<int64_t>& pending;
      ~Uncount() { --pending; }
    } uncount{host_sums_pending_};
    landed.synchronize();
    device::TimeInto timed(host_update_ns_);  // the sum the update needs, counted as update time
    add();
  });
}

void HookOffload::send_gradient(Unit& unit, const std::vector<torch::Tensor>& parts) {
  if (unit.on_device()) {
    // Nothing travels: the gradient stays where its update runs, summed over micro-batches there.
    STRATA_CHECK(!unit.grad_filled || !options_.overlap_optimizer,
                 name_ << ": a second gradient of one step reached an overlapped update (internal error)");
    auto flat = as_one_tensor(parts);
    unit.device_grad_sum = unit.grad_filled ? unit.device_grad_sum + flat : flat;
    unit.grad_filled = true;
    if (options_.overlap_optimizer) update_on_device(unit);  // behind this block's backward on the stream
    return;
  }
  auto produced = compute_.record();
  d2h_.wait(produced);
  for (const auto& part : parts) {
    d2h_.keep_alive(part);
    bytes_d2h_ += part.nbytes();
  }
  if (!unit.grad_filled) {
    // copy_parts refuses parts that do not fill the buffer: a short gradient would leave an earlier
    // step's values in the rest.
    d2h_.copy_parts(unit.host_grad, parts);
    unit.grad_filled = true;
  } else {
    // Another micro-batch's gradient (accumulation): added on the host once it lands. Not in
    // overlap mode, where every step's gradients are applied before the next step starts.
    STRATA_CHECK(!options_.overlap_optimizer,
                 name_ << ": a second gradient of one step reached an overlapped update (internal error)");
    auto staging = device::host_buffer({unit.trainable_numel}, torch::kFloat, config_.device);
    d2h_.copy_parts(staging, parts);
    add_on_host(d2h_.record(), [staging, grad = unit.host_grad] { grad.add_(staging); });
  }
  last_copy_ = d2h_.record();
}

void HookOffload::send_in_row_ranges(Unit& unit, const torch::Tensor& flat) {
  STRATA_CHECK(!unit.grad_filled && flat.numel() == unit.trainable_numel && unit.rows > 0,
               name_ << ": a tied gradient sent in row ranges must be the whole matrix's first (internal error)");
  d2h_.wait(compute_.record());
  d2h_.keep_alive(flat);
  bytes_d2h_ += flat.nbytes();
  const int64_t cols = unit.trainable_numel / unit.rows;
  const int64_t ranges = std::min(tied_chunks(), unit.rows);
  unit.landed_ranges.clear();
  unit.range_bounds.assign(1, 0);
  for (int64_t k = 1; k <= ranges; ++k) {
    const int64_t begin = unit.range_bounds.back(), end = unit.rows * k / ranges;
    d2h_.copy(unit.host_grad.narrow(0, begin * cols, (end - begin) * cols), flat.narrow(0, begin * cols, (end - begin) * cols));
    unit.landed_ranges.push_back(d2h_.record());
    unit.range_bounds.push_back(end);
  }
  unit.grad_filled = true;
  last_copy_ = unit.landed_ranges.back();
}

void HookOffload::gate_next_fetch(Unit& unit, ReadyUpdate& update) {
  update.done = unit.updated = std::make_shared<device::Gate>();
  // A unit on the device for good computes from its device copy, which is old from now on (also
  // for a forward() before optimizer_step).
  if (unit.references > 0) unit.stale = true;
}

void HookOffload::queue_update(Unit& unit, device::Event landed) {
  ReadyUpdate update;
  update.unit = &unit;
  update.landed = std::move(landed);
  gate_next_fetch(unit, update);
  push_update(std::move(update));
}

HookOffload::ReadyUpdate HookOffload::spare_part(Unit& unit, device::Event landed) {
  ReadyUpdate update;
  update.unit = &unit;
  update.landed = std::move(landed);
  update.from = unit.host_param;
  update.to = unit.spare_param;
  update.to_travel = unit.spare_travel;
  update.from_state = &unit.optimizer_slots[unit.optimizer_now];
  update.to_state = &unit.optimizer_slots[1 - unit.optimizer_now];
  return update;
}

void HookOffload::queue_first_part(Unit& unit) {
  // Nothing waits for it: the unit's next fetch waits for the rows part, queued behind it. A step
  // that fails before that leaves the master as it was (this part wrote only the spare buffers).
  auto update = spare_part(unit, last_copy_);
  update.part = ReadyUpdate::Part::first;
  update.done = unit.first_part_ended = std::make_shared<device::Gate>();  // opened however it ends
  if (!unit.landed_ranges.empty()) {  // tied_chunks: taken up as soon as the first range has landed
    update.landed = unit.landed_ranges.front();
    update.landed_ranges = std::exchange(unit.landed_ranges, {});
    update.range_bounds = std::exchange(unit.range_bounds, {});
    update.cols = unit.trainable_numel / unit.rows;
  }
  unit.early_source = update.to_travel.defined() ? update.to_travel : update.to;
  unit.early_wanted = options_.tied_early && unit.sparse_seen && !held_by_resident(unit);
  push_update(std::move(update));
}

bool HookOffload::held_by_resident(const Unit& unit) const {
  return std::any_of(unit.uses.begin(), unit.uses.end(), [&](int64_t b) { return permanent_[b]; });
}

void HookOffload::send_early_if_ready() {
  for (auto& unit : units_) {
    if (!unit.early_wanted) continue;
    if (first_parts_awaited_) await_first_part(unit);
    if (!unit.first_part_ended->is_open()) continue;  // not yet: looked at again at the next boundary
    unit.early_wanted = false;
    // A first part that failed leaves the buffer unwritten: the rows part takes the whole step.
    if (unit.first_part_done && start_early_copy(unit)) ++early_copies_in_backward_;
  }
}

bool HookOffload::await_first_part(Unit& unit) {
  bool held = step_copies_held_ || step_update_hold_;
  {
    std::lock_guard<std::mutex> lock(ready_mutex_);
    held = held || unit_hold_;
  }
  // A test's hold would keep it from ever ending here: then only one that already has counts. So
  // would an update that failed.
  while (!unit.first_part_ended->is_open()) {
    if (held) return false;
    {
      std::lock_guard<std::mutex> lock(ready_mutex_);
      if (update_error_) return false;
    }
    unit.first_part_ended->wait_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool HookOffload::queue_early_copy(Unit& unit) {
  drop_early(unit);  // (one the last forward never took)
  if (!options_.tied_early || !unit.first_part_ended) return false;
  // A unit some resident block holds keeps its device copy, refreshed whole.
  if (held_by_resident(unit)) return false;
  // The first part is the first update the host takes once the head's gradient has landed, so it
  // has normally ended long before the embedding's backward.
  if (!await_first_part(unit)) return false;
  if (!unit.first_part_done) return false;  // it failed: the rows part takes the whole step
  return start_early_copy(unit);
}

bool HookOffload::start_early_copy(Unit& unit) {
  drop_early(unit);  // one the last forward never took
  try {
    device::Stream::Guard on_h2d(h2d_);  // allocated on the stream that writes it, as acquire() does
    unit.early_flat = torch::empty({unit.numel}, unit.device_flat.options());
  } catch (const c10::OutOfMemoryError&) {  // the matrix's second device copy does not fit: fetched whole
    unit.early_flat = torch::Tensor();
    return false;
  }
  resident_bytes_ += unit.bytes;  // counted as it exists: drop_early takes them off, whatever throws next
  peak_bytes_ = std::max(peak_bytes_, resident_bytes_);
  if (options_.debug_poison) {
    device::Stream::Guard on_h2d(h2d_);
    torch::NoGradGuard no_grad;
    unit.early_flat.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  h2d_.copy(unit.early_flat, unit.early_source);  // transfer=fp32 under bf16: cast on arrival
  unit.early_loaded = h2d_.record();
  bytes_h2d_ += unit.travel_bytes;
  return true;
}

void HookOffload::drop_early(Unit& unit) {
  if (unit.early_flat.defined()) {
    resident_bytes_ -= unit.bytes;
    unit.early_flat = torch::Tensor();  // allocated on the copy stream: reused only behind its copy
  }
  unit.early_touched = torch::Tensor();
  unit.early_staging = torch::Tensor();
  unit.early_rows_gathered.reset();
  unit.early_rows_next = false;
}

void HookOffload::queue_rows_part(Unit& unit, device::Event landed, torch::Tensor values, torch::Tensor touched) {
  auto update = spare_part(unit, std::move(landed));
  update.part = ReadyUpdate::Part::rows;
  update.values = std::move(values);
  update.touched = std::move(touched);
  if (unit.early_staging.defined()) {  // tied_early (the worker gets its own handles to them)
    update.staging = unit.early_staging;
    update.gathered = unit.early_rows_gathered;
    update.source_read = unit.early_loaded;
  }
  gate_next_fetch(unit, update);
  // The step's values are written into the spare buffers: from now on they are the master, read by
  // the unit's next fetch (behind `done`) and by parameters(). The old master is read until then
  // by this part's rows, and next written by the next step's first part, which runs after it.
  std::swap(unit.host_param, unit.spare_param);
  std::swap(unit.host_travel, unit.spare_travel);
  unit.optimizer_now = 1 - unit.optimizer_now;
  push_update(std::move(update));
}

void HookOffload::push_update(ReadyUpdate update) {
  ++updates_pending_;
  {
    std::lock_guard<std::mutex> lock(ready_mutex_);
    ready_.push_back(std::move(update));
  }
  // While a profiler (any thread-local RecordFunction callback) runs on this thread, the host
  // worker runs the update in this thread's state, so its span lands in the same trace as the
  // device's work (strata_compare --profile-steps). Otherwise nothing is carried over.
  std::shared_ptr<at::ThreadLocalState> traced;
  if (at::hasThreadLocalCallbacks()) traced = std::make_shared<at::ThreadLocalState>();
  host_.submit([this, hold = step_update_hold_, traced] {
    std::optional<at::ThreadLocalStateGuard> in_trace;
    if (traced) in_trace.emplace(*traced);
    if (hold) hold->wait();  // hold_updates: before the choice, so it sees every held update
    run_next_update();
  });
}

void HookOffload::run_next_update() {
  // Each queued task runs one update, not necessarily the one queued with it: while backward runs
  // any landed unit will do, but the updates backward leaves undone are needed by the next forward
  // in block order, and its first blocks' gradients land last. Every task finds at least the
  // update queued with it, or another in its place.
  ReadyUpdate next;
  try {
    for (;;) {
      std::unique_lock<std::mutex> lock(ready_mutex_);
      int64_t best = -1;
      int best_rank = 0;  // 0: not landed; 1: a first part with ranges still to land; 2: landed
      bool held = false;
      for (size_t i = 0; i < ready_.size(); ++i) {
        const auto& r = ready_[i];
        // A unit's parts run in the order they were queued (its first part before its rows).
        if (std::any_of(ready_.begin(), ready_.begin() + static_cast<std::ptrdiff_t>(i),
                        [&](const ReadyUpdate& earlier) { return earlier.unit == r.unit; }))
          continue;
        if (unit_hold_ && r.unit->first_use == unit_hold_first_use_ && !unit_hold_->is_open()) {
          held = true;  // hold_update_of
          continue;
        }
        // (tied_early: a rows part waits for the early copy's read of its buffer too; until then it
        // is not taken ahead of updates that can run at once.)
        // A first part in ranges counts as landed with its first range, but one whose last has
        // not landed would hold the worker while it waits: updates that can run whole go first.
        const bool landed = r.landed.done() && r.source_read.done();
        const int rank = !landed ? 0 : (!r.landed_ranges.empty() && !r.landed_ranges.back().done()) ? 1 : 2;
        if (best < 0 || rank > best_rank || (rank == best_rank && rank > 0 && r.unit->first_use < ready_[best].unit->first_use)) {
          best = static_cast<int64_t>(i);
          best_rank = rank;
        }
      }
      if (best < 0 && held) {  // only held ones left: look again once its gate opens or others are queued
        auto gate = unit_hold_;
        lock.unlock();
        gate->wait_for(std::chrono::milliseconds(1));
        continue;
      }
      STRATA_CHECK(best >= 0, name_ << ": an overlapped update ran with no eligible unit queued (internal error)");
      next = std::move(ready_[best]);
      ready_.erase(ready_.begin() + best);
      break;
    }
  } catch (...) {
    note_update_error();
    --updates_pending_;
    throw;
  }
  // Opens whatever happens: a fetch queued behind it must never wait forever.
  struct Finish {
    HookOffload* self;
    std::shared_ptr<device::Gate> done;
    ~Finish() {
      --self->updates_pending_;
      if (done) done->open();
    }
  } finish{this, next.done};
  try {
    next.landed.synchronize();
    device::TimeInto timed(host_update_ns_);  // from the gradients' landing: waiting is not work
    auto& unit = *next.unit;
    using Part = ReadyUpdate::Part;
    // The update's span in a profiler's trace, on this worker's thread (the name is built only
    // while one records).
    RECORD_USER_SCOPE("strata::host_update block " + std::to_string(unit.first_use) +
                      (next.part == Part::first ? " (first part)" : next.part == Part::rows ? " (rows part)" : ""));
    if (next.part == Part::whole) {
      update_on_host(unit);
    } else {
      const bool first = next.part == Part::first;
      if (first && first_part_delay_ms_ > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(first_part_delay_ms_.load()));
      if (!first) add_rows(unit.host_grad, next.values, next.touched);
      // The rows alone after a first part that ran; every row after one that failed.
      const bool rows = !first && unit.first_part_done;
      unit.first_part_done = false;
      // tied_early: the copy to the device reads this buffer whole; its touched rows change only after.
      next.source_read.synchronize();
      if (first && !next.landed_ranges.empty()) {
        // tied_chunks: each range stepped once its copy has landed, as a contiguous stretch of
        // every buffer (a row list would split the pass into one span a row), with the same
        // element steps as the whole, so the result is the same to the bit.
        step_in_ranges(next, unit.host_grad);
        ++ranged_first_parts_;
      } else {
        optimizer_update_into(config_.optimizer, next.from, *next.from_state, unit.host_grad, next.to, *next.to_state,
                              next.to_travel, rows ? next.touched : torch::Tensor(), rows ? next.values.size(1) : 0);
      }
      unit.first_part_done = first;
      if (next.staging.defined()) {  // tied_early (queued only after a first part that ran): the rows for the next fetch
        STRATA_CHECK(!fail_next_gather_.exchange(false), name_ << ": a rows part failed before its gather (injected by a test)");
        const auto& stepped = next.to_travel.defined() ? next.to_travel : next.to;
        at::index_select_out(next.staging, stepped.view({-1, next.staging.size(1)}), 0, next.touched);
        next.gathered->open();
      }
    }
    if (next.part == Part::first) return;  // the unit is not updated yet
    std::lock_guard<std::mutex> lock(ready_mutex_);
    update_order_.push_back(unit.first_use);
  } catch (...) {
    // The gate opens all the same (a fetch waiting on it must not hang): the error is reported by
    // the next train_step or optimizer_step, and that step's results are not to be trusted.
    note_update_error();
    throw;
  }
}

void HookOffload::step_in_ranges(ReadyUpdate& next, const torch::Tensor& grad) {
  for (size_t k = 0; k < next.landed_ranges.size(); ++k) {
    if (!next.landed_ranges[k].done()) {  // waiting for a range is not update time (host_update_ms)
      const auto start = std::chrono::steady_clock::now();
      next.landed_ranges[k].synchronize();
      host_update_ns_ -= std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }
    const int64_t begin = next.range_bounds[k] * next.cols, n = (next.range_bounds[k + 1] - next.range_bounds[k]) * next.cols;
    optimizer_update_span_into(config_.optimizer, next.from, *next.from_state, grad, next.to, *next.to_state,
                               next.to_travel, begin, n);
  }
}

void HookOffload::hold_update_of(int64_t first_use, std::shared_ptr<const device::Gate> gate) {
  std::lock_guard<std::mutex> lock(ready_mutex_);
  unit_hold_first_use_ = first_use;
  unit_hold_ = std::move(gate);
}

std::vector<int64_t> HookOffload::take_update_order() {
  std::lock_guard<std::mutex> lock(ready_mutex_);
  return std::exchange(update_order_, {});
}

void HookOffload::note_update_error() {
  std::lock_guard<std::mutex> lock(ready_mutex_);
  if (!update_error_) update_error_ = std::current_exception();
}

void HookOffload::wait_for(const device::Event& event) const {
  if (!options_.overlap_optimizer) return event.synchronize();
  while (!event.done()) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void HookOffload::rethrow_failed_update() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(ready_mutex_);
    error = update_error_;
  }
  if (!error) return;
  finish_pending();  // rethrows it if the host queue still holds it (and clears it)
  {
    std::lock_guard<std::mutex> lock(ready_mutex_);
    update_error_ = nullptr;
  }
  std::rethrow_exception(error);  // a drain that swallowed it (a failed step's) took the queue's copy
}

void HookOffload::finish_backward() {
  d2h_.synchronize();
  // Without the overlapped optimizer the host queue holds only backward's work (a later
  // micro-batch's gradient, or a tied matrix's touched rows, added on the host); with it, the
  // optimizer updates run there too.
  if (!options_.overlap_optimizer) host_.drain();
}

bool HookOffload::gradients_in_flight() const { return host_sums_pending_ > 0 || !last_copy_.done(); }

void HookOffload::finish_pending() {
  try {
    host_.drain();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(ready_mutex_);
      update_error_ = nullptr;  // reported now
    }
    d2h_.synchronize();
    throw;
  }
  d2h_.synchronize();
}

void HookOffload::finish_step() { finish_pending(); }

double HookOffload::train_step(const models::Batch& batch) {
  auto& m = model();
  STRATA_CHECK(!(options_.overlap_optimizer && step_in_flight_),
               name_ << ": overlap_optimizer=1 applies each step's gradients during backward, so every train_step "
                        "must be followed by optimizer_step (gradient accumulation needs overlap_optimizer=0)");
  if (options_.overlap_optimizer) {
    // The last step's updates may still be running: each block's fetch waits for its own.
    rethrow_failed_update();
    d2h_.synchronize();
    step_update_hold_ = std::move(update_hold_);
    step_in_flight_ = true;
  } else {
    finish_pending();
  }
  step_copies_held_ = static_cast<bool>(copy_hold_);
  if (copy_hold_) d2h_.hold(std::move(copy_hold_));
  for (auto& unit : units_) {
    unit.pending_users = unit.users;
    unit.first_use_sent = false;
  }
  backward_seen_bytes_ = 0;  // this step's backward sets the next opening's budget (opening=fit)
  // Whatever a failed step left held (windows, kept graphs, the overlap bookkeeping) must not stay:
  // the strategy stays usable after an error such as running out of memory.
  auto clean_up = [&](bool failed) {
    drop_all_windows();
    released_late_ = -1;
    for (auto& kept : kept_) kept = {};
    anchor_.mutable_grad() = torch::Tensor();
    if (failed) {
      backward_seen_bytes_ = 0;  // a backward that failed (out of memory, say) sizes no opening
      std::fill(sent_early_.begin(), sent_early_.end(), 0);  // parts of a backward that did not end
      for (auto& unit : units_) {
        unit.early_parts.clear();
        unit.early_offsets.clear();
        unit.early_part_bytes = 0;
        unit.device_grad = torch::Tensor();  // a failed backward's partial sums
        unit.landed_ranges.clear();          // tied_chunks: ranges sent with no first part queued
        unit.range_bounds.clear();
        // A first use already on the host, its last use never came: that host gradient is this
        // step's alone (a first use is sent only when the unit held none), so it is dropped.
        if (std::exchange(unit.first_use_sent, false)) unit.grad_filled = false;
        // A copy sent during this backward may be what left too little memory: from now on it
        // goes at backward's end again, as before any sparse last use was seen.
        if (unit.early_sent_in_backward()) unit.sparse_seen = false;
        drop_early(unit);  // its rows part may not have come; the next fetch sends the master whole
        unit.early_wanted = false;
      }
      try {
        host_.drain();
      } catch (...) {  // the step's own error is the one to report
      }
      // The units this step already updated keep their update (it cannot be taken back); none
      // keeps this step's gradient for the next one, and resident ones are refreshed before they
      // compute again.
      if (options_.overlap_optimizer)
        for (auto& unit : units_) {
          unit.grad_filled = false;
          unit.device_grad_sum = torch::Tensor();
          if (unit.references > 0 && !unit.on_device()) unit.stale = true;
        }
      step_in_flight_ = false;
    }
  };
  try {
    auto x = config_.precision.cast_input(batch.input.to(config_.device));
    auto target = batch.target.to(config_.device);
    bytes_h2d_ += batch.input.nbytes() + batch.target.nbytes();
    for (int64_t b = 0; b < m.num_blocks(); ++b) x = run_windowed(*this, b, x, anchor_);
    check_no_carries();
    auto loss = m.loss(x, target);
    x = torch::Tensor();
    scaler_.scaled(loss).backward();
    // Every block's backward ran (each feeds the next, and the anchor makes every output need a
    // gradient), so every tied unit has sent its sum.
    for (const auto& unit : units_)
      STRATA_CHECK(!unit.device_grad.defined() && !unit.first_use_sent,
                   name_ << ": a tied unit's gradient stayed on the device after backward, or its last use's never came "
                            "(a use without backward; internal error)");
    clean_up(false);
    wait_for(compute_.record());  // before item(), which would spin
    return loss.item<double>();
  } catch (...) {
    clean_up(true);
    throw;
  }
}

torch::Tensor HookOffload::forward(const torch::Tensor& input) {
  auto& m = model();
  finish_pending();
  torch::NoGradGuard no_grad;
  bytes_h2d_ += input.nbytes();
  auto x = config_.precision.cast_input(input.to(config_.device));
  try {
    for (int64_t b = 0; b < m.num_blocks(); ++b) {
      before_compute(b, /*backward=*/false);
      x = m.blocks()[b]->forward(x);
      drop_window(b, /*forward=*/true);
    }
    check_no_carries();
  } catch (...) {
    drop_all_windows();
    throw;
  }
  return x;
}

void HookOffload::optimizer_step() {
  model();
  std::exception_ptr failed_update;
  if (options_.overlap_optimizer) {
    // The updates were queued as gradients landed; those not done yet finish in the background,
    // each ahead of its unit's next fetch (or here, with defer_updates=0). A failed one is
    // reported once the step's bookkeeping is done, so the strategy stays usable.
    try {
      if (options_.defer_updates)
        rethrow_failed_update();
      else
        finish_pending();
    } catch (...) {
      failed_update = std::current_exception();
    }
  } else {
    if (!options_.debug_step_unwaited) finish_pending();
    h2d_.synchronize();  // no fetch may still be reading a host buffer the update writes
    // fp16: the gradients carry the loss scale; a step with an inf or nan in any is skipped.
    std::vector<torch::Tensor> grads;
    for (auto& unit : units_)
      if (unit.grad_filled) grads.push_back(unit.on_device() ? unit.device_grad_sum : unit.host_grad);
    device::TimeInto timed(host_update_ns_);
    const bool finite = scaler_.unscale(grads);
    scaler_.update(finite);
    // Units trained on the device: queued on the compute stream, ahead of the host's pass.
    for (auto& unit : units_)
      if (unit.on_device() && unit.grad_filled && finite) update_on_device(unit);
    // Units on the device for good (resident blocks) first, each refreshed as soon as its update
    // has run: the copy then overlaps the rest of this host pass rather than opening the next
    // forward. (After train_step only resident windows hold references: the windows the last
    // optimizer_step fetched were released by the forward that used them.)
    for (auto& unit : units_)
      if (unit.references > 0 && !unit.on_device() && unit.grad_filled && finite) {
        update_on_host(unit);
        unit.grad_filled = false;  // each as soon as applied: a step that fails midway applies none twice
        unit.stale = true;
        refresh_if_stale(unit);
      }
    // The others in the order the next forward needs them. The windows that forward opens with
    // (`opening`: 0 to prefetch by default) are fetched as soon as their units are updated, so
    // their copies run beside the rest of this pass, while the link is otherwise idle, and not at
    // the forward's start. (Queuing them, allocation included, counts in host_update_ms.)
    const auto opening = opening_windows();
    last_opening_ = opening;  // unless a fetch runs out of memory (below)
    int64_t next_window = 0;
    auto fetch_windows_through = [&](int64_t last) {
      for (; next_window < opening && next_window <= last; ++next_window) {
        try {
          hold_window(next_window);
        } catch (const c10::OutOfMemoryError&) {  // hold_window takes all of a window or none
          // The updates are applied; the forward fetches these windows itself and reports the error
          // if it persists.
          last_opening_ = next_window;
          next_window = opening;
        }
      }
    };
    for (auto u : by_first_use_) {
      auto& unit = units_[u];
      fetch_windows_through(unit.first_use - 1);  // every unit those windows use is updated
      if (unit.references == 0 && unit.grad_filled && finite) {
        update_on_host(unit);
        unit.grad_filled = false;
      }
    }
    fetch_windows_through(opening - 1);
  }
  step_in_flight_ = false;
  step_update_hold_.reset();
  for (auto& unit : units_) {
    unit.grad_filled = false;
    unit.device_grad_sum = torch::Tensor();
    // overlap mode: resident blocks compute from their device copy, brought up to date when their
    // window is next held (hold_window), behind the unit's update and the compute still reading it.
    // (One trained on the device was updated in place, on the stream its compute runs on.)
    if (options_.overlap_optimizer && unit.references > 0 && !unit.on_device()) unit.stale = true;
  }
  if (failed_update) std::rethrow_exception(failed_update);
}

void HookOffload::update_on_host(Unit& unit) {
  auto trainable = unit.host_param.narrow(0, 0, unit.trainable_numel);
  // The travelling copy is written in the update's own pass over memory (the host pass is what
  // bounds this strategy's step).
  optimizer_update(config_.optimizer, trainable, unit.host_grad, unit.optimizer(),
                   unit.host_travel.defined() ? unit.host_travel.narrow(0, 0, unit.trainable_numel) : torch::Tensor());
}

void HookOffload::update_on_device(Unit& unit) {
  torch::NoGradGuard no_grad;
  auto trainable = unit.device_master.narrow(0, 0, unit.trainable_numel);
  const bool narrower = config_.precision.compute != torch::kFloat;
  optimizer_update(config_.optimizer, trainable, unit.device_grad_sum, unit.optimizer(),
                   narrower ? unit.device_flat.narrow(0, 0, unit.trainable_numel) : torch::Tensor());
}

torch::Tensor HookOffload::master_on_host(const Unit& unit) const {
  if (!unit.on_device()) return unit.host_param;
  device::synchronize(config_.device);  // its update ran on the compute stream
  return unit.device_master.to(torch::kCPU);
}

torch::Tensor HookOffload::gradient_on_host(const Unit& unit) const {
  if (!unit.on_device()) return unit.host_grad;
  device::synchronize(config_.device);
  return unit.device_grad_sum.to(torch::kCPU);
}

torch::Tensor HookOffload::host_copy(size_t p, const torch::Tensor& host_flat) const {
  const auto [u, offset] = param_slot_[p];
  const auto& t = model_->parameters()[p].tensor;
  return host_flat.narrow(0, offset, t.numel()).view(t.sizes()).clone();
}

NamedTensors HookOffload::gradients() {
  const auto& params = model().parameters();
  finish_pending();
  NamedTensors out;
  std::vector<torch::Tensor> flats(units_.size());  // each unit's read once, not once per parameter
  for (size_t p = 0; p < params.size(); ++p) {
    const auto u = param_slot_[p].first;
    const auto& unit = units_[u];
    const bool has = unit.grad_filled && params[p].tensor.requires_grad();
    if (has && !flats[u].defined()) flats[u] = gradient_on_host(unit);
    auto g = has ? host_copy(p, flats[u]) : torch::zeros(params[p].tensor.sizes());
    out.emplace_back(params[p].name, scaler_.unscaled(g));  // what the step applies
  }
  return out;
}

NamedTensors HookOffload::buffers() {
  model();
  device::synchronize(config_.device);
  return host_copies(model().buffers());
}

NamedTensors HookOffload::parameters() {
  const auto& params = model().parameters();
  finish_pending();
  NamedTensors out;
  std::vector<torch::Tensor> flats(units_.size());  // each unit's read once, not once per parameter
  for (size_t p = 0; p < params.size(); ++p) {
    const auto u = param_slot_[p].first;
    if (!flats[u].defined()) flats[u] = master_on_host(units_[u]);
    out.emplace_back(params[p].name, host_copy(p, flats[u]));
  }
  return out;
}

int64_t HookOffload::offloaded_bytes_on_device() const { return resident_bytes_ - permanent_bytes_; }

int64_t HookOffload::references_held() const {
  int64_t n = 0;
  for (const auto& unit : units_) n += unit.references;
  for (size_t b = 0; b < windows_.size(); ++b)  // resident blocks hold theirs for good
    if (permanent_[b]) n -= static_cast<int64_t>(windows_[b].size());
  return n;
}

Stats HookOffload::stats() {
  model();  // before attach: an Error, as every strategy's
  Stats s;
  s.bytes_h2d = bytes_h2d_;
  s.bytes_d2h = bytes_d2h_;
  s.loss_scale = scaler_.scale();
  s.skipped_steps = scaler_.skipped_steps();
  s.fetches_behind_host_updates = fetches_behind_updates_;
  s.host_update_ms = static_cast<double>(host_update_ns_) / 1e6;
  for (const auto& unit : units_)
    if (!unit.on_device()) s.host_stepped_parameters += unit.trainable_numel;
  auto& mem = s.devices[config_.device.str()];
  mem.resident_param_bytes = resident_bytes_;
  mem.peak_param_bytes = peak_bytes_;
  const auto alloc = device::allocator_stats(config_.device);
  mem.peak_allocated = alloc.peak_allocated;
  mem.peak_reserved = alloc.peak_reserved;
  return s;
}

void HookOffload::reset_stats() {
  bytes_h2d_ = bytes_d2h_ = 0;
  early_transfers_ = 0;
  fetches_behind_updates_ = 0;
  host_update_ns_ = 0;
  peak_bytes_ = resident_bytes_;
  device::reset_peak_stats(config_.device);
}

namespace {
std::unique_ptr<Strategy> make_hook_offload(const std::string& name, const StrategyConfig& c,
                                            const std::map<std::string, std::string>& defaults) {
  auto options = defaults;
  for (const auto& [k, v] : c.options) options[k] = v;
  return std::make_unique<HookOffload>(name, c, HookOffloadOptions::parse(options));
}
}  // namespace

static const OptionDocumenter hook_offload_docs(
    {"hook_offload", "hook_offload_sync", "hook_offload_overlap"},
    {{"prefetch", "0..", "blocks fetched ahead of the one computing"},
     {"lead", "0..", "released windows whose compute may still be pending when the host fetches another"},
     {"opening", "auto, fit, 0..",
      "windows from block 0 on that optimizer_step fetches for the next forward beside its host pass (auto: prefetch + 1, "
      "none with prefetch 0; fit: that, and more while they fit in the device memory the last backward used; resident "
      "ones count, already there; needs overlap_optimizer=0)"},
     {"carry_tied", "0/1",
      "a unit several blocks share (tied embedding and head) stays on the device between its uses in a forward, not fetched again"},
     {"tied_rows", "0/1",
      "a tied matrix used twice (embedding and head): the first use's gradient goes to the host at once and of the last "
      "use's only the rows it touched (with overlap_optimizer the host steps the matrix from the first at once, into a "
      "second copy, and the touched rows again when they land); 0: the two are summed on the device and travel once"},
     {"tied_early", "0/1",
      "with tied_rows and overlap_optimizer: the matrix as the first use's step left it goes to the device during "
      "backward, once that step has ended (at backward's end until a batch touched at most half its rows), and the next "
      "forward's fetch sends only the rows stepped again (the matrix's device bytes held in between)"},
     {"tied_chunks", "auto, 1..",
      "with tied_rows and overlap_optimizer: the first use's gradient of the tied matrix goes to the host as this many "
      "copies of row ranges, and the host steps each range as soon as it has landed (1: one copy, stepped once whole); "
      "auto: 8 where the compute dtype is fp32, else 1"},
     {"grads_early", "auto, 1, 0",
      "a block's own gradients go to the host in parts while its backward runs, a quarter of the block's gradient bytes "
      "at a time (1), or all at once when the backward has ended (0); auto: 1 where the compute dtype is fp32"},
     {"activations", "recompute, keep",
      "recompute blocks in backward, or keep their activations (resident ones follow resident_activations)"},
     {"merge_last", "0/1", "the last block stays from its forward through its backward"},
     {"resident", "block indices", "blocks kept on the device for good"},
     {"resident_activations", "keep, recompute",
      "resident blocks keep their forward's activations through backward, or are recomputed like the others (less "
      "device memory, one more forward of each)"},
     {"resident_updates", "host, device",
      "where units used only by resident blocks are trained: on the host like the rest, or on the device (masters, "
      "gradients and optimizer state stay there; up to 16 bytes a parameter of device memory)"},
     {"overlap_optimizer", "0/1", "each unit updated on the host as soon as its gradients land"},
     {"defer_updates", "0/1",
      "with overlap_optimizer: updates left when backward ends finish under the next forward (1) or in optimizer_step (0)"},
     {"fetch_order", "ready, in_order",
      "with overlap_optimizer: a fetch whose unit's update is still running is queued once it has run, letting the "
      "fetches of units already updated cross first (ready), or every fetch is queued in forward order, each behind "
      "its update (in_order)"},
     {"debug_poison", "0/1", "every fetched buffer filled with NaN before its copy", true},
     {"debug_skip_waits", "0/1", "compute does not wait for its fetches (a deliberate bug)", true},
     {"debug_release_late", "0/1", "each window dropped one block late (a deliberate bug)", true},
     {"debug_step_unwaited", "0/1", "optimizer_step does not wait for the gradients in flight (a deliberate bug)", true}});

STRATA_REGISTER_STRATEGY("hook_offload",
                         "parameters in pinned host memory, streamed block by block with prefetch; host optimizer",
                         [](const StrategyConfig& c) { return make_hook_offload("hook_offload", c, {}); });
STRATA_REGISTER_STRATEGY("hook_offload_sync",
                         "hook_offload without prefetch: each block fetched when needed, as seed 003 does",
                         [](const StrategyConfig& c) { return make_hook_offload("hook_offload_sync", c, {{"prefetch", "0"}, {"carry_tied", "0"}}); });
STRATA_REGISTER_STRATEGY("hook_offload_overlap",
                         "hook_offload with each unit's host optimizer update overlapped with the rest of backward "
                         "and the updates left then with the next step's forward",
                         [](const StrategyConfig& c) {
                           // tied_rows stays 1 here too since the first part's update streams its results
                           // and fetches go as their units are ready (bench/NOTES.md, "An update into
                           // other buffers, with streaming stores").
                           return make_hook_offload("hook_offload_overlap", c, {{"overlap_optimizer", "1"}});
                         });

}  // namespace strata
