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
#include "strategies/optimizer_state_io.h"

namespace strata {

HookOffload::HookOffload(std::string name, const StrategyConfig& config, HookOffloadOptions options)
    : name_(std::move(name)),
      config_(config),
      options_(std::move(options)),
      compute_(device::Stream::compute(config.device)),
      h2d_(device::Stream::side(config.device)),
      d2h_(device::Stream::side(config.device)),
      scaler_(config.precision),
      updates_(host_, [this](HostUpdate& update) { apply_update(update); }) {}

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
  in_parts_.assign(params.size(), 0);
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
      unit.tied.rows = params[unit.params[0]].tensor.size(0);
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
    if (unit.tied.rows > 0 && options_.overlap_optimizer) {  // written in full by each step's first part
      unit.tied.spare_param = device::host_buffer({unit.numel}, torch::kFloat, config_.device);
      unit.tied.spare_param.copy_(unit.host_param);  // never garbage, even after a first part that failed
      if (unit.host_travel.defined()) {
        unit.tied.spare_travel = device::host_buffer({unit.numel}, precision.transfer, config_.device);
        unit.tied.spare_travel.copy_(unit.host_travel);
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
      unit.tied.rows = 0;  // no touched rows go to the host: nothing does
      unit.host_grad = torch::Tensor();
      // The resident window's fetch filled device_flat (compute dtype); the fp32 master is that
      // buffer itself, or a copy of the host master made once.
      unit.loaded.synchronize();  // the fetch has read the host copies dropped below
      unit.device_master = precision.compute == torch::kFloat ? unit.device_flat : unit.host_param.to(config_.device);
      unit.host_param = torch::Tensor();
      unit.host_travel = torch::Tensor();
      unit.tied.spare_param = torch::Tensor();
      unit.tied.spare_travel = torch::Tensor();
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
  if (unit.tied.early.rows_next && unit.tied.early.rows_gathered->is_open()) {
    // tied_early: the buffer holds the matrix as the first part stepped it; of the rows part's
    // result only the rows it stepped again differ.
    h2d_.wait(unit.tied.early.touched_made);
    h2d_.keep_alive(unit.tied.early.touched);
    h2d_.copy_rows(unit.device_flat.view({unit.tied.rows, -1}), unit.tied.early.touched, unit.tied.early.staging);
    bytes_h2d_ += unit.tied.early.staging.nbytes();
  } else {
    // Also into an early buffer whose rows are not known to be gathered: queued in forward order
    // before the rows part ran (fetch_order=in_order), or after a rows part that failed.
    h2d_.copy(unit.device_flat, travelling(unit));  // transfer=fp32 under bf16: cast on arrival
    bytes_h2d_ += unit.travel_bytes;
  }
  // Used, or superseded by a copy of the latest master whole; but one sent during this backward is
  // for the next forward: backward's own fetch of the unit reads the master its step started from.
  if (!unit.tied.early.sent_in_backward()) drop_early(unit);
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
  if (unit.tied.early.flat.defined() && unit.tied.early.rows_gathered) {
    // tied_early: the matrix went to a buffer of its own during the last backward; that memory
    // becomes the unit's (allocated on the copy stream, as below), and its fetch sends the rows
    // whose step came after. Its bytes were counted when it was allocated. As in release(), the
    // copy into it must have run before its memory moves (on the CPU a queued copy writes
    // through the tensor when it runs; a CUDA copy was queued with its address). Not before its
    // rows part is queued: a backward that fetches the unit after the early copy went reads the
    // master its step started from, and the early buffer waits for the next forward.
    compute_.wait(unit.tied.early.loaded);
    compat::take_storage(unit.device_flat.storage(), unit.tied.early.flat.storage());
    unit.tied.early.flat = torch::Tensor();
    unit.tied.early.rows_next = true;
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
  return HookOffloadOptions::fit_opening_windows(new_bytes, floor, backward_seen_bytes_ - now - largest);
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

bool HookOffload::grads_in_parts() const {
  return options_.grads_in_parts == HookOffloadOptions::kPartsAuto ? config_.precision.compute == torch::kFloat
                                                                    : options_.grads_in_parts == 1;
}

bool HookOffload::sends_in_parts(const Unit& unit) const {
  // One user: the block whose backward runs now is the unit's only and last use this step (so not
  // a tied unit). Not a later micro-batch's gradient (grad_filled), which is added on the host
  // through staging.
  return grads_in_parts() && unit.users == 1 && unit.trainable_numel > 0 && !unit.on_device() && !unit.grad_filled;
}

GradientSink HookOffload::gradient_sink(int64_t block) {
  // None where no unit of the block sends in parts: its gradients are then captured, the cheaper way.
  const auto& window = windows_[block];
  if (std::none_of(window.begin(), window.end(), [&](int64_t u) { return sends_in_parts(units_[u]); })) return {};
  return [this, block](size_t i, const torch::Tensor& grad) {
    const auto p = block_params_[block][i];
    auto& unit = units_[param_slot_[p].first];
    if (sends_in_parts(unit)) take_part(unit, p, grad);
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

void HookOffload::take_part(Unit& unit, int64_t p, const torch::Tensor& grad) {
  unit.parts.add(travelling_gradient(grad, model().parameters()[p].tensor), param_slot_[p].second);
  in_parts_[p] = 1;
  // A quarter at a time: a GPT block's two MLP matrices go as they come and its attention's
  // matrices together; its layer norms' and biases' small gradients ride along, not alone.
  if (unit.parts.quarter_of(unit.trainable_numel)) {
    send_parts(unit);
    ++part_transfers_;  // (not those flush_gradients sends at the block's end)
  }
}

void HookOffload::send_parts(Unit& unit) {
  if (unit.parts.waiting.empty()) return;
  d2h_.wait(compute_.record());  // behind the compute that produced them
  for (const auto& part : unit.parts.waiting) {
    d2h_.keep_alive(part);
    bytes_d2h_ += part.nbytes();
  }
  d2h_.copy_parts(unit.host_grad, unit.parts.waiting, unit.parts.offsets);
  unit.parts.clear();
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
    if (std::any_of(unit.params.begin(), unit.params.end(), [&](int64_t p) { return in_parts_[p] != 0; })) {
      // grads_in_parts: parts went while the backward ran. The rest (the last parts, and zeros for
      // a parameter the block left without a gradient) go now, in one transfer with those still
      // waiting; then the unit is whole on its way.
      for (auto p : unit.params) {
        const auto& t = params[p].tensor;
        if (!t.requires_grad()) break;  // the frozen tail
        if (std::exchange(in_parts_[p], 0) != 0) continue;
        unit.parts.add(travelling_gradient(grad_of(p), t), param_slot_[p].second);
      }
      send_parts(unit);
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
      if (unit.tied.rows > 0 && !unit.grad_filled) {
        // The first of a tied matrix's two uses (the head's, in the GPT): sent now, behind the rest
        // of backward, rather than held for the last use, which then sends only its touched rows.
        if (options_.overlap_optimizer && tied_chunks() > 1 && parts.size() == 1)
          send_in_row_ranges(unit, parts.front());
        else
          send_gradient(unit, parts);
        unit.tied.first_use_sent = true;
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
    if (unit.tied.first_use_sent) {
      send_rows(unit, as_one_tensor(parts));
      unit.tied.first_use_sent = false;  // after: a send that throws leaves the failed step's reset to drop it
    } else {
      send_gradient(unit, parts);
      if (options_.overlap_optimizer && !unit.on_device()) queue_update(unit, last_copy_);
    }
  }
}

void HookOffload::send_rows(Unit& unit, const torch::Tensor& flat) {
  const int64_t cols = unit.trainable_numel / unit.tied.rows;
  auto matrix = flat.view({unit.tied.rows, cols});
  // Waits for the compute that produced it (the last thing backward does here: the embedding's).
  auto touched = matrix.ne(0).any(1).nonzero().squeeze(1);
  const int64_t n = touched.size(0);
  const bool dense = 2 * n > unit.tied.rows;
  if (dense) {
    // Dense after all (a matrix both of whose uses are dense, say): from the next step on summed on
    // the device and sent once, which costs less. This step's is added on the host in full (in
    // overlap mode as rows, all that are touched, since the first part is queued already).
    unit.tied.rows = 0;
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
    unit.tied.early.wanted = false;
    const bool sent = unit.tied.early.sent_in_backward();
    // A copy sent during backward lacks the rows this step takes again; dense, they are all rows:
    // the next fetch sends the whole. The copy may still be reading the buffer the rows part is about
    // to write, unwaited: what it brings is dropped with it (its device buffer is reused only behind it).
    if (dense && sent) drop_early(unit);
    if (!dense) unit.tied.early.sparse_seen = true;
    if (!dense && (sent || queue_early_copy(unit))) {
      unit.tied.early.touched = touched;
      unit.tied.early.touched_made = compute_.record();
      unit.tied.early.staging = device::host_buffer({n, cols}, config_.precision.transfer, config_.device);
      unit.tied.early.rows_gathered = std::make_shared<device::Gate>();
    }
    return queue_rows_part(unit, last_copy_, host_values, host_touched);
  }
  add_on_host(last_copy_, [host_values, host_touched, grad = unit.host_grad] { hook_offload::add_rows(grad, host_values, host_touched); });
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
  STRATA_CHECK(!unit.grad_filled && flat.numel() == unit.trainable_numel && unit.tied.rows > 0,
               name_ << ": a tied gradient sent in row ranges must be the whole matrix's first (internal error)");
  d2h_.wait(compute_.record());
  d2h_.keep_alive(flat);
  bytes_d2h_ += flat.nbytes();
  const int64_t cols = unit.trainable_numel / unit.tied.rows;
  const int64_t ranges = std::min(tied_chunks(), unit.tied.rows);
  unit.tied.landed_ranges.clear();
  unit.tied.range_bounds.assign(1, 0);
  for (int64_t k = 1; k <= ranges; ++k) {
    const int64_t begin = unit.tied.range_bounds.back(), end = unit.tied.rows * k / ranges;
    d2h_.copy(unit.host_grad.narrow(0, begin * cols, (end - begin) * cols), flat.narrow(0, begin * cols, (end - begin) * cols));
    unit.tied.landed_ranges.push_back(d2h_.record());
    unit.tied.range_bounds.push_back(end);
  }
  unit.grad_filled = true;
  last_copy_ = unit.tied.landed_ranges.back();
}

void HookOffload::gate_next_fetch(Unit& unit, HostUpdate& update) {
  update.done = unit.updated = std::make_shared<device::Gate>();
  // A unit on the device for good computes from its device copy, which is old from now on (also
  // for a forward() before optimizer_step).
  if (unit.references > 0) unit.stale = true;
}

void HookOffload::queue_update(Unit& unit, device::Event landed) {
  HostUpdate update;
  update.unit = &unit;
  update.landed = std::move(landed);
  gate_next_fetch(unit, update);
  updates_.push(std::move(update), step_update_hold_);
}

void HookOffload::queue_first_part(Unit& unit) {
  // Nothing waits for it: the unit's next fetch waits for the rows part, queued behind it. A step
  // that fails before that leaves the master as it was (this part wrote only the spare buffers).
  auto update = HostUpdate::into_spare(unit, last_copy_);
  update.part = HostUpdate::Part::first;
  update.done = unit.tied.first_part_ended = std::make_shared<device::Gate>();  // opened however it ends
  if (!unit.tied.landed_ranges.empty()) {  // tied_chunks: taken up as soon as the first range has landed
    update.landed = unit.tied.landed_ranges.front();
    update.landed_ranges = std::exchange(unit.tied.landed_ranges, {});
    update.range_bounds = std::exchange(unit.tied.range_bounds, {});
    update.cols = unit.trainable_numel / unit.tied.rows;
  }
  unit.tied.early.source = update.to_travel.defined() ? update.to_travel : update.to;
  unit.tied.early.wanted = options_.tied_early && unit.tied.early.sparse_seen && !held_by_resident(unit);
  updates_.push(std::move(update), step_update_hold_);
}

bool HookOffload::held_by_resident(const Unit& unit) const {
  return std::any_of(unit.uses.begin(), unit.uses.end(), [&](int64_t b) { return permanent_[b]; });
}

void HookOffload::send_early_if_ready() {
  for (auto& unit : units_) {
    if (!unit.tied.early.wanted) continue;
    if (first_parts_awaited_) await_first_part(unit);
    if (!unit.tied.first_part_ended->is_open()) continue;  // not yet: looked at again at the next boundary
    unit.tied.early.wanted = false;
    // A first part that failed leaves the buffer unwritten: the rows part takes the whole step.
    if (unit.tied.first_part_done && start_early_copy(unit)) ++early_copies_in_backward_;
  }
}

bool HookOffload::await_first_part(Unit& unit) {
  const bool held = step_copies_held_ || step_update_hold_ || updates_.unit_held();
  // A test's hold would keep it from ever ending here: then only one that already has counts. So
  // would an update that failed.
  while (!unit.tied.first_part_ended->is_open()) {
    if (held) return false;
    if (updates_.error()) return false;
    unit.tied.first_part_ended->wait_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool HookOffload::queue_early_copy(Unit& unit) {
  drop_early(unit);  // (one the last forward never took)
  if (!options_.tied_early || !unit.tied.first_part_ended) return false;
  // A unit some resident block holds keeps its device copy, refreshed whole.
  if (held_by_resident(unit)) return false;
  // The first part is the first update the host takes once the head's gradient has landed, so it
  // has normally ended long before the embedding's backward.
  if (!await_first_part(unit)) return false;
  if (!unit.tied.first_part_done) return false;  // it failed: the rows part takes the whole step
  return start_early_copy(unit);
}

bool HookOffload::start_early_copy(Unit& unit) {
  drop_early(unit);  // one the last forward never took
  try {
    device::Stream::Guard on_h2d(h2d_);  // allocated on the stream that writes it, as acquire() does
    unit.tied.early.flat = torch::empty({unit.numel}, unit.device_flat.options());
  } catch (const c10::OutOfMemoryError&) {  // the matrix's second device copy does not fit: fetched whole
    unit.tied.early.flat = torch::Tensor();
    return false;
  }
  resident_bytes_ += unit.bytes;  // counted as it exists: drop_early takes them off, whatever throws next
  peak_bytes_ = std::max(peak_bytes_, resident_bytes_);
  if (options_.debug_poison) {
    device::Stream::Guard on_h2d(h2d_);
    torch::NoGradGuard no_grad;
    unit.tied.early.flat.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  h2d_.copy(unit.tied.early.flat, unit.tied.early.source);  // transfer=fp32 under bf16: cast on arrival
  unit.tied.early.loaded = h2d_.record();
  bytes_h2d_ += unit.travel_bytes;
  return true;
}

void HookOffload::drop_early(Unit& unit) {
  if (unit.tied.early.drop()) resident_bytes_ -= unit.bytes;
}

void HookOffload::queue_rows_part(Unit& unit, device::Event landed, torch::Tensor values, torch::Tensor touched) {
  auto update = HostUpdate::into_spare(unit, std::move(landed));
  update.part = HostUpdate::Part::rows;
  update.values = std::move(values);
  update.touched = std::move(touched);
  if (unit.tied.early.staging.defined()) {  // tied_early (the worker gets its own handles to them)
    update.staging = unit.tied.early.staging;
    update.gathered = unit.tied.early.rows_gathered;
    update.source_read = unit.tied.early.loaded;
  }
  gate_next_fetch(unit, update);
  // The step's values are written into the spare buffers: from now on they are the master, read by
  // the unit's next fetch (behind `done`) and by parameters(). The old master is read until then
  // by this part's rows, and next written by the next step's first part, which runs after it.
  unit.tied.promote_spare(unit.host_param, unit.host_travel, unit.optimizer_now);
  updates_.push(std::move(update), step_update_hold_);
}

void HookOffload::apply_update(HostUpdate& next) {
  next.landed.synchronize();
  device::TimeInto timed(host_update_ns_);  // from the gradients' landing: waiting is not work
  auto& unit = *next.unit;
  using Part = HostUpdate::Part;
  // The update's span in a profiler's trace, on this worker's thread (the name is built only
  // while one records).
  RECORD_USER_SCOPE("strata::host_update block " + std::to_string(unit.first_use) +
                    (next.part == Part::first ? " (first part)" : next.part == Part::rows ? " (rows part)" : ""));
  if (next.part == Part::whole) return update_on_host(unit);
  auto& tied = unit.tied;
  const bool first = next.part == Part::first;
  if (first && first_part_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(first_part_delay_ms_.load()));
  if (!first) hook_offload::add_rows(unit.host_grad, next.values, next.touched);
  // The rows alone after a first part that ran; every row after one that failed.
  const bool rows = !first && tied.first_part_done;
  tied.first_part_done = false;
  // tied_early: the copy to the device reads this buffer whole; its touched rows change only after.
  next.source_read.synchronize();
  if (first && !next.landed_ranges.empty()) {
    // tied_chunks: each range stepped once its copy has landed, as a contiguous stretch of every
    // buffer (a row list would split the pass into one span a row), with the same element steps as
    // the whole, so the result is the same to the bit.
    next.step_in_ranges(config_.optimizer, unit.host_grad, host_update_ns_);
    ++ranged_first_parts_;
  } else {
    optimizer_update_into(config_.optimizer, next.from, *next.from_state, unit.host_grad, next.to, *next.to_state,
                          next.to_travel, rows ? next.touched : torch::Tensor(), rows ? next.values.size(1) : 0);
  }
  tied.first_part_done = first;
  if (next.staging.defined()) {  // tied_early (queued only after a first part that ran): the rows for the next fetch
    STRATA_CHECK(!fail_next_gather_.exchange(false), name_ << ": a rows part failed before its gather (injected by a test)");
    const auto& stepped = next.to_travel.defined() ? next.to_travel : next.to;
    at::index_select_out(next.staging, stepped.view({-1, next.staging.size(1)}), 0, next.touched);
    next.gathered->open();
  }
}

void HookOffload::wait_for(const device::Event& event) const {
  if (!options_.overlap_optimizer) return event.synchronize();
  while (!event.done()) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void HookOffload::rethrow_failed_update() {
  const auto error = updates_.error();
  if (!error) return;
  finish_pending();  // rethrows it if the host queue still holds it (and clears it)
  updates_.take_error();
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
    updates_.take_error();  // reported now
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
    unit.tied.first_use_sent = false;
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
      std::fill(in_parts_.begin(), in_parts_.end(), 0);  // parts of a backward that did not end
      for (auto& unit : units_) {
        unit.parts.clear();
        unit.device_grad = torch::Tensor();  // a failed backward's partial sums
        // A first use already on the host, its last use never came: that host gradient is this
        // step's alone, so it is dropped.
        if (unit.tied.reset_after_failed_backward()) unit.grad_filled = false;
        drop_early(unit);  // its rows part may not have come; the next fetch sends the master whole
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
      STRATA_CHECK(!unit.device_grad.defined() && !unit.tied.first_use_sent,
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

NamedTensors HookOffload::training_state() {
  const auto& params = model().parameters();
  NamedTensors out = parameters();  // the masters, once every pending update has run
  for (const auto& unit : units_)
    STRATA_CHECK(!unit.grad_filled, name_ << ": training_state() after optimizer_step, with no gradient accumulated");
  std::vector<OptimizerState> states(units_.size());  // a unit's optimizer state on the host, read once
  std::vector<bool> read(units_.size(), false);
  for (size_t p = 0; p < params.size(); ++p) {
    const auto [u, offset] = param_slot_[p];
    auto& unit = units_[u];
    const auto numel = params[p].tensor.numel();
    if (offset + numel > unit.trainable_numel) continue;  // frozen: no optimizer state
    if (!read[u]) {
      const auto& st = unit.optimizer();
      if (unit.on_device()) device::synchronize(config_.device);  // its update ran on the compute stream
      auto host = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kCPU) : t; };
      states[u] = {host(st.exp_avg), host(st.exp_avg_sq), st.step};
      read[u] = true;
    }
    const auto& st = states[u];
    auto slice = [&](const torch::Tensor& flat) {  // a view: append_optimizer_state copies it
      return flat.defined() ? flat.narrow(0, offset, numel).view(params[p].tensor.sizes()) : flat;
    };
    append_optimizer_state(out, params[p].name, {slice(st.exp_avg), slice(st.exp_avg_sq), st.step});
  }
  for (auto& b : buffers()) out.push_back(std::move(b));
  out.emplace_back("loss_scaler", scaler_.state());
  return out;
}

void HookOffload::load_training_state(const NamedTensors& state) {
  const auto& params = model().parameters();
  // Everything checked before anything changes: a bad state leaves this strategy as it was.
  const auto by_name = checked_training_state(name_, params, model().buffers(), state);
  auto get = [&](const std::string& key) { return by_name.find(key); };
  // A unit's parameters train together: one step count, and its moments whole or not at all.
  std::vector<int64_t> steps(units_.size(), -1);
  std::vector<bool> moments(units_.size(), false);
  for (size_t p = 0; p < params.size(); ++p) {
    const auto [u, offset] = param_slot_[p];
    if (offset + params[p].tensor.numel() > units_[u].trainable_numel) continue;
    const auto n = get(params[p].name + "/step");
    const int64_t step = n.defined() ? n.item<int64_t>() : 0;
    const bool has = get(params[p].name + "/exp_avg").defined();
    const bool first = steps[u] < 0;
    STRATA_CHECK(first || (steps[u] == step && moments[u] == has),
                 name_ << ": '" << params[p].name << "' is at step " << step << (has ? " with" : " without")
                       << " optimizer state, the parameters it trains with at step " << steps[u]
                       << (moments[u] ? " with" : " without") << " (hook_offload steps them as one)");
    steps[u] = step;
    moments[u] = has;
  }
  finish_pending();
  for (const auto& unit : units_)
    STRATA_CHECK(!unit.grad_filled, name_ << ": load_training_state() after optimizer_step, with no gradient accumulated");
  torch::NoGradGuard no_grad;
  const bool narrower = config_.precision.compute != torch::kFloat;
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = units_[u];
    const auto flat_device = unit.on_device() ? config_.device : torch::Device(torch::kCPU);
    // Written in place: the unit's master (pinned on the host, or on the device) and, where they
    // are already there at the right size, its moments. New buffers of a whole model's state would
    // cost their first touch (the page faults), which took most of a load's time.
    const auto master = unit.on_device() ? unit.device_master : unit.host_param;
    OptimizerState st;
    st.step = std::max<int64_t>(steps[u], 0);
    if (moments[u]) {
      const auto& now = unit.optimizer();
      auto moment = [&](const torch::Tensor& kept) {
        return kept.defined() && kept.numel() == unit.trainable_numel && kept.device() == flat_device
                   ? kept
                   : torch::empty({unit.trainable_numel}, torch::TensorOptions().dtype(torch::kFloat).device(flat_device));
      };
      st.exp_avg = moment(now.exp_avg);
      if (config_.optimizer.kind == OptimizerKind::adamw) st.exp_avg_sq = moment(now.exp_avg_sq);
    }
    for (auto p : unit.params) {
      const auto offset = param_slot_[p].second;
      const auto& name = params[p].name;
      const auto numel = params[p].tensor.numel();
      master.narrow(0, offset, numel).copy_(get(name).reshape({-1}));
      if (!moments[u] || offset + numel > unit.trainable_numel) continue;
      st.exp_avg.narrow(0, offset, numel).copy_(get(name + "/exp_avg").reshape({-1}));
      if (st.exp_avg_sq.defined()) st.exp_avg_sq.narrow(0, offset, numel).copy_(get(name + "/exp_avg_sq").reshape({-1}));
    }
    if (unit.on_device()) {
      if (narrower) unit.device_flat.copy_(unit.device_master);
    } else {
      if (unit.host_travel.defined()) unit.host_travel.copy_(unit.host_param);
      if (unit.tied.spare_param.defined()) unit.tied.spare_param.copy_(unit.host_param);
      if (unit.tied.spare_travel.defined()) unit.tied.spare_travel.copy_(unit.host_travel);
      drop_early(unit);  // a device copy of the old values
      if (unit.references > 0) {  // held on the device (a resident block, the next forward's opening)
        unit.stale = true;
        refresh_if_stale(unit);
      }
    }
    unit.optimizer() = std::move(st);
    unit.optimizer_slots[1 - unit.optimizer_now] = {};  // a tied unit's spare: written whole by its next step
  }
  device::synchronize(config_.device);  // no forward still reads the buffers
  load_buffers(model().buffers(), by_name);
  if (auto sc = get("loss_scaler"); sc.defined()) scaler_.restore(sc);
}

int64_t HookOffload::offloaded_bytes_on_device() const { return resident_bytes_ - permanent_bytes_; }

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
  part_transfers_ = 0;
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
                           // tied_rows stays 1 here too: the first part's update streams its results
                           // and fetches go as their units are ready (bench/notes/tied-rows.md).
                           return make_hook_offload("hook_offload_overlap", c, {{"overlap_optimizer", "1"}});
                         });

}  // namespace strata
