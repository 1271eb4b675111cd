#include "strategies/sharded/sharded.h"

#include <cmath>
#include <deque>
#include <functional>
#include <sstream>
#include <unordered_map>

#include "models/check.h"
#include "models/compat.h"
#include "strategies/options.h"

namespace strata {

ShardedOptions ShardedOptions::parse(const std::map<std::string, std::string>& options) {
  OptionReader reader("sharded", options);
  ShardedOptions o;
  o.prefetch = reader.get_int("prefetch", o.prefetch);
  o.recompute = reader.get_choice("activations", {"recompute", "keep"}) == "recompute";
  o.reshard_after_forward = reader.get_bool("reshard_after_forward", o.reshard_after_forward);
  o.offload = reader.get_bool("offload", o.offload);
  o.overlap_optimizer = reader.get_bool("overlap_optimizer", o.offload);
  o.piece_kib = reader.get_int("piece_kib", o.piece_kib);
  o.debug_poison = reader.get_bool("debug_poison", o.debug_poison);
  o.debug_skip_waits = reader.get_bool("debug_skip_waits", o.debug_skip_waits);
  o.debug_fail_rank = reader.get_int("debug_fail_rank", o.debug_fail_rank);
  reader.finish();
  o.validate();
  return o;
}

void ShardedOptions::validate() const {
  STRATA_CHECK(prefetch >= 0, "sharded: prefetch=" << prefetch << " must be 0 (gather when needed) or more");
  STRATA_CHECK(piece_kib >= 1, "sharded: piece_kib=" << piece_kib << " must be 1 or more (KiB of a shard per piece)");
  STRATA_CHECK(!overlap_optimizer || offload,
               "sharded: overlap_optimizer=1 applies to the host optimizer of offload=1 (sharded_offload)");
}

std::string ShardedOptions::to_string() const {
  std::ostringstream out;
  out << "prefetch=" << prefetch << " recompute=" << recompute << " reshard_after_forward=" << reshard_after_forward
      << " offload=" << offload << " overlap_optimizer=" << overlap_optimizer << " piece_kib=" << piece_kib;
  return out.str();
}

struct Sharded::Unit {
  std::vector<int64_t> params;  ///< indices into model().parameters(): trainable first
  int64_t numel = 0, trainable_numel = 0;
  int64_t padded = 0;           ///< numel rounded up to a multiple of the world size
  int64_t shard_numel = 0;      ///< padded / world size
  int64_t trainable_in_shard = 0;  ///< leading elements of this rank's shard that train
  int users = 0, pending_users = 0;
  torch::Tensor shard;          ///< this rank's slice: on the device, or pinned host memory (offload)
  torch::Tensor travel;         ///< offload on CUDA under a narrower transfer dtype: the shard in it
                                ///< (pinned), refreshed by each host update
  torch::Tensor shard_grad;     ///< its gradient since the last optimizer step, beside it
  bool has_grad = false;
  torch::Tensor full;           ///< [padded] on the device in the transfer dtype; storage exists only
                                ///< while gathered (or is the shard's: `aliased`)
  bool aliased = false;         ///< world 1, fp32, on the device: the shard is the whole unit, and the
                                ///< parameters are views of it for good (nothing to gather or free)
  int references = 0;
  distributed::Work gathering;
  torch::Tensor grad_full;      ///< [padded] a shared unit's uses summed in the reduction dtype, until
                                ///< its last use reduces it
  OptimizerState optimizer;
};


Sharded::Sharded(std::string name, const StrategyConfig& config, ShardedOptions options)
    : name_(std::move(name)),
      config_(config),
      options_(std::move(options)),
      device_(distributed::rank_device(config.device)),
      scaler_(config.precision) {
  device::check_available(device_);
  // Registry::create asks too; a Sharded made directly must not take what it cannot honour.
  STRATA_CHECK(supports(config_.precision), name_ << ": does not train in precision " << config_.precision.to_string()
                                                  << " with these options (" << options_.to_string() << ")");
}

bool Sharded::supports(const PrecisionPolicy& policy) const {
  // Units are gathered straight into the buffers the blocks compute with; fp16's skipped steps
  // cannot be undone by an optimizer that applies each unit's update during backward.
  return policy.transfer == policy.compute && !(policy.scales_loss() && options_.overlap_optimizer);
}

int64_t Sharded::gathered_element() const {
  return static_cast<int64_t>(c10::elementSize(config_.precision.transfer));
}
int64_t Sharded::reduced_element() const { return static_cast<int64_t>(c10::elementSize(config_.precision.reduce)); }

torch::Tensor Sharded::travel_source(const Unit& unit) const {
  if (unit.travel.defined()) return unit.travel;
  return unit.shard.scalar_type() == config_.precision.transfer ? unit.shard : unit.shard.to(config_.precision.transfer);
}

Sharded::~Sharded() {
  try {
    if (host_) host_->drain();
  } catch (...) {  // reported by the step that failed
  }
  for (auto& unit : units_) {
    try {
      unit.gathering.wait();
    } catch (...) {  // a failed collective was reported where it failed
    }
  }
  for (auto& r : reducing_) {
    try {
      r.work.wait();
    } catch (...) {
    }
  }
}

models::BlockModel& Sharded::model() {
  STRATA_CHECK(model_.has_value(), name_ << ": attach() a model first");
  return *model_;
}

int Sharded::rank() const { return group_ ? group_->rank() : 0; }
int Sharded::world_size() const { return group_ ? group_->size() : 1; }

std::pair<int64_t, int64_t> Sharded::slice_of(int64_t batch) const {
  const int64_t w = world_size(), r = rank();
  STRATA_CHECK(batch >= w, name_ << ": a global batch of " << batch << " samples cannot be split over " << w
                                 << " ranks; give at least one sample per rank");
  return {batch * r / w, batch * (r + 1) / w};
}

void Sharded::count_collective(int64_t bytes, double factor) {
  bytes_interconnect_ += static_cast<int64_t>(std::llround(static_cast<double>(bytes) * factor));
}

void Sharded::attach_model(models::BlockModel model) {
  check_buffers_under(config_.precision, model, name_);
  group_ = config_.group ? config_.group : distributed::group_for(device_);
  const int64_t w = group_->size(), r = group_->rank();
  const auto& params = model.parameters();

  // Every rank must hold the same model under the same options, or the collectives below would
  // pair different tensors: agree first, with an Error on every rank if not.
  std::ostringstream layout;
  for (const auto& p : params) layout << p.name << p.tensor.sizes() << p.tensor.requires_grad() << ";";
  for (const auto& b : model.buffers()) layout << b.name << b.tensor.sizes() << ";";
  std::ostringstream description;
  description << name_ << "(" << options_.to_string() << ", precision " << config_.precision.to_string() << ") world " << w << ", model of " << params.size()
              << " parameters / " << model.parameter_count() << " elements, layout #" << std::hex
              << std::hash<std::string>{}(layout.str());
  group_->agree(name_ + " attach", description.str());

  auto plan = plan_units(model);
  windows_ = std::move(plan.windows);
  units_.resize(plan.units.size());
  param_slot_.assign(params.size(), {-1, 0});
  const auto dev_options = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = units_[u];
    unit.params = std::move(plan.units[u]);
    unit.users = plan.users[u];
    for (auto p : unit.params) {
      STRATA_CHECK(params[p].tensor.scalar_type() == torch::kFloat,
                   name_ << ": parameter '" << params[p].name << "' is " << params[p].tensor.scalar_type()
                         << "; sharded handles float32 parameters");
      param_slot_[p] = {static_cast<int64_t>(u), unit.numel};
      unit.numel += params[p].tensor.numel();
      if (params[p].tensor.requires_grad()) unit.trainable_numel = unit.numel;
    }
    unit.padded = (unit.numel + w - 1) / w * w;
    unit.shard_numel = unit.padded / w;
    unit.trainable_in_shard = std::clamp<int64_t>(unit.trainable_numel - r * unit.shard_numel, 0, unit.shard_numel);
    // The padding is zeros, never updated (it lies past trainable_numel) and never returned.
    auto flat = torch::zeros({unit.padded});
    for (auto p : unit.params)
      flat.narrow(0, param_slot_[p].second, params[p].tensor.numel()).copy_(params[p].tensor.detach().reshape({-1}));
    auto mine = flat.narrow(0, r * unit.shard_numel, unit.shard_numel);
    if (options_.offload) {
      unit.shard = device::host_buffer({unit.shard_numel}, torch::kFloat, device_).copy_(mine);
      if (unit.trainable_numel > 0) unit.shard_grad = device::host_buffer({unit.shard_numel}, torch::kFloat, device_).zero_();
      if (options_.offload && config_.precision.transfer != torch::kFloat)
        unit.travel = device::host_buffer({unit.shard_numel}, config_.precision.transfer, device_).copy_(mine);
    } else {
      unit.shard = mine.to(device_, /*non_blocking=*/false, /*copy=*/true);
      // shard_grad: allocated by the step's first reduction, freed by the optimizer step (as
      // zero_grad(set_to_none) does), so forward and the start of backward run without it.
    }
    shard_bytes_ += unit.shard_numel * static_cast<int64_t>(sizeof(float));
    // In a world of one the shard is the whole unit: in fp32 on the device it is what the blocks
    // compute with, and a gather would only copy it (debug_poison wants a buffer of its own).
    unit.aliased = w == 1 && !options_.offload && config_.precision.transfer == torch::kFloat && !options_.debug_poison;
    unit.full = unit.aliased ? unit.shard : torch::empty({unit.padded}, dev_options.dtype(config_.precision.transfer));
    for (auto p : unit.params) {
      auto& t = params[p].tensor;
      t.set_data(unit.full.narrow(0, param_slot_[p].second, t.numel()).view(t.sizes()));
    }
    if (!unit.aliased) compat::release_storage(unit.full.storage());
  }
  // Buffers live on the device, whole on every rank (they are small, and most are fixed).
  for (const auto& b : model.buffers()) b.tensor.set_data(b.tensor.to(device_));
  if (options_.offload) {
    h2d_.emplace(device::Stream::side(device_));
    d2h_.emplace(device::Stream::side(device_));
    host_.emplace();
  }
  held_.assign(windows_.size(), false);
  kept_.assign(windows_.size(), {});
  anchor_ = torch::empty({0}, dev_options).requires_grad_(true);
  model_.emplace(std::move(model));
}

void Sharded::gather(Unit& unit) {
  if (unit.references > 0) {
    ++unit.references;
    return;
  }
  if (unit.aliased) {  // the parameters are the shard's views: nothing to bring
    unit.references = 1;
    return;
  }
  const int64_t bytes = unit.padded * gathered_element();
  compat::reallocate_storage(unit.full.storage(), static_cast<size_t>(bytes));
  try {
    torch::NoGradGuard no_grad;
    if (options_.debug_poison) unit.full.fill_(std::numeric_limits<float>::quiet_NaN());
    // This rank's own slot of the gathered buffer is the gather's source (an in-place all-gather):
    // no second copy of the shard on the device, which for a unit as large as a 6,000,000-class
    // head would be one more copy of it in a world of one.
    auto mine = unit.full.narrow(0, rank() * unit.shard_numel, unit.shard_numel);
    if (options_.offload) {
      // The shard goes up on the copy stream and the gather is launched from it, so both overlap the
      // block computing now. The copy stream first waits for the compute queued so far: the gathered
      // buffer was just allocated in the compute stream's order. On the CPU the copy stream is a
      // worker thread and Gloo reads the source from a thread of its own, in no stream's order:
      // the gather starts once the copy has landed.
      h2d_->wait(device::Stream::compute(device_).record());
      device::Stream::Guard on_copy_stream(*h2d_);
      h2d_->copy(mine, travel_source(unit));
      bytes_h2d_ += unit.shard_numel * gathered_element();
      if (world_size() == 1) {  // the copy is the gather: compute waits for it
        unit.gathering = distributed::Work([this, landed = h2d_->record()] { device::Stream::compute(device_).wait(landed); });
      } else {
        if (device_.is_cpu()) h2d_->synchronize();
        unit.gathering = group_->all_gather(unit.full, mine);
      }
    } else if (world_size() == 1) {
      mine.copy_(unit.shard);  // the compute dtype's copy, in the compute stream's order
      unit.gathering = distributed::Work();
    } else {
      unit.gathering = group_->all_gather(unit.full, travel_source(unit));
    }
  } catch (...) {
    try {
      if (h2d_) h2d_->synchronize();  // a copy queued into the buffer lands before it goes
    } catch (...) {
    }
    compat::release_storage(unit.full.storage());
    throw;
  }
  unit.references = 1;  // counted only once the gather is under way
  const auto w = static_cast<double>(world_size());
  count_collective(bytes, (w - 1) / w);
  gathered_bytes_ += bytes;
  peak_gathered_ = std::max(peak_gathered_, gathered_bytes_);
}

void Sharded::release(Unit& unit) {
  STRATA_CHECK(unit.references > 0, name_ << ": a unit was released more often than it was gathered");
  if (--unit.references > 0 || unit.aliased) return;
  auto free_it = [&] {
    compat::release_storage(unit.full.storage());
    gathered_bytes_ -= unit.padded * gathered_element();
  };
  try {
    unit.gathering.wait();  // a gather nobody waited for may still be writing the buffer
  } catch (...) {  // it failed (its group is done for): the buffer goes all the same
    free_it();
    throw;
  }
  free_it();
}

void Sharded::hold_window(int64_t block) {
  if (held_[block]) return;
  const auto& window = windows_[block];
  for (size_t i = 0; i < window.size(); ++i) {
    try {
      gather(units_[window[i]]);
    } catch (...) {
      for (size_t j = 0; j < i; ++j) release(units_[window[j]]);  // all of the window or none of it
      throw;
    }
  }
  held_[block] = true;
}

void Sharded::drop_window(int64_t block) {
  if (!held_[block]) return;
  held_[block] = false;
  // Every unit of the window released, even past one whose gather failed (it is counted off too):
  // a unit left referenced would be taken for gathered by the next step.
  std::exception_ptr failed;
  for (auto u : windows_[block]) {
    try {
      release(units_[u]);
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

void Sharded::prefetch_from(int64_t block, bool backward) {
  const auto n = static_cast<int64_t>(windows_.size());
  for (int64_t k = 1; k <= options_.prefetch; ++k) {
    const int64_t next = backward ? block - k : block + k;
    if (next < 0 || next >= n) break;
    hold_window(next);
  }
}

void Sharded::before_compute(int64_t block, bool backward) {
  if (!backward && options_.debug_fail_rank == rank() && step_blocks_++ == 1)
    STRATA_FAIL(name_ << ": failure injected on rank " << rank() << " (debug_fail_rank)");
  hold_window(block);
  prefetch_from(block, backward);  // launched behind this block's gather, overlapping its compute
  if (!options_.debug_skip_waits)
    for (auto u : windows_[block]) units_[u].gathering.wait();
  device::Stream::compute(device_).compute_point();
}

void Sharded::after_compute(int64_t block, bool backward) {
  // Kept for its backward; the last block's always: its backward comes next.
  if (!backward && (!options_.reshard_after_forward || last_block(block))) return;
  drop_window(block);
}

namespace {
// A unit's parameters' gradients where they sit in its flat buffer (trainable ones; undefined where
// a parameter got none).
struct FlatPart {
  int64_t offset = 0, numel = 0;
  torch::Tensor grad;  ///< flat, or undefined
};

// Elements [lo, lo + n) of the unit's flat gradient, written into `dst` (zeros where no gradient
// is: frozen parameters, the padding, a parameter without one), or added to it.
void fill_flat(const std::vector<FlatPart>& parts, int64_t lo, int64_t n, const torch::Tensor& dst, bool add) {
  int64_t at = lo;  // the first element not written yet (writing)
  for (const auto& part : parts) {
    const int64_t a = std::max(lo, part.offset), b = std::min(lo + n, part.offset + part.numel);
    if (a >= b || !part.grad.defined()) continue;
    if (!add && a > at) dst.narrow(0, at - lo, a - at).zero_();
    auto into = dst.narrow(0, a - lo, b - a);
    const auto from = part.grad.narrow(0, a - part.offset, b - a);
    if (add)
      into.add_(from);
    else
      into.copy_(from);
    at = b;
  }
  if (!add && lo + n > at) dst.narrow(0, at - lo, lo + n - at).zero_();
}
}  // namespace

void Sharded::flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) {
  const auto& params = model().parameters();
  std::unordered_map<const void*, torch::Tensor> grad_of;
  auto block_params = model().blocks()[block]->parameters();
  for (size_t i = 0; i < block_params.size(); ++i) grad_of[block_params[i].unsafeGetTensorImpl()] = grads[i];
  torch::NoGradGuard no_grad;
  // The reduce-scatters of earlier blocks have had this block's backward to run in: finish them, so
  // their buffers go before this block's arrive.
  finish_reductions();
  const int64_t w = world_size();
  const auto reduce_options = torch::TensorOptions().dtype(config_.precision.reduce).device(device_);
  for (auto u : windows_[block]) {
    auto& unit = units_[u];
    if (unit.trainable_numel == 0) continue;  // all frozen: nothing to reduce or update
    std::vector<FlatPart> parts;
    for (auto p : unit.params) {
      const auto& t = params[p].tensor;
      if (!t.requires_grad()) break;  // the frozen tail
      const auto& g = grad_of.at(t.unsafeGetTensorImpl());
      parts.push_back({param_slot_[p].second, t.numel(), g.defined() ? g.reshape({-1}) : torch::Tensor()});
    }
    const bool fresh = !unit.has_grad;
    const int64_t shard = unit.shard_numel;
    // On a fresh step with the shard on the device and an fp32 reduction, straight into its gradient.
    const bool into_grad = fresh && !options_.offload && config_.precision.reduce == torch::kFloat;
    if (unit.users > 1) {
      // A shared parameter: its uses summed over the step (in the reduction dtype), reduced once
      // its last use is done, while the next block's backward runs.
      const bool first_use = !unit.grad_full.defined();
      if (first_use) unit.grad_full = torch::empty({unit.padded}, reduce_options);
      fill_flat(parts, 0, unit.padded, unit.grad_full, /*add=*/!first_use);
      if (--unit.pending_users > 0) continue;  // its other uses come later in backward
      if (fresh && !options_.offload) unit.shard_grad = torch::empty({shard}, reduce_options.dtype(torch::kFloat));
      Reduction r;
      r.unit = static_cast<int64_t>(u);
      r.length = shard;
      r.fresh = fresh;
      r.last = true;
      if (w == 1) {
        r.out = std::move(unit.grad_full);
      } else {
        r.in = std::move(unit.grad_full);
        r.out = into_grad ? unit.shard_grad : torch::empty({shard}, reduce_options);
        r.work = group_->reduce_scatter(r.out, r.in);
        count_reduction(unit.padded);
      }
      unit.grad_full = torch::Tensor();
      reducing_.push_back(std::move(r));
      unit.has_grad = true;  // once its reduction is under way (a failed step undoes it: train_step)
      continue;
    }
    --unit.pending_users;
    if (fresh && !options_.offload) unit.shard_grad = torch::empty({shard}, reduce_options.dtype(torch::kFloat));
    if (w == 1 && !options_.offload) {  // a world of one on the device: straight into the shard's gradient
      fill_flat(parts, 0, shard, unit.shard_grad, /*add=*/!fresh);
      unit.has_grad = true;
      continue;
    }
    // In pieces: each piece's buffers live while it is reduced and (offload) copied down, and a
    // piece waits for the one two before it to be done, so a unit as large as a 6,000,000-class
    // head takes a few pieces' memory beside its gradient, not several copies of it.
    const int64_t piece = std::clamp<int64_t>(options_.piece_kib * 1024 / reduced_element(), 1, shard);
    std::deque<device::Event> pieces_done;
    for (int64_t lo = 0; lo < shard; lo += piece) {
      Reduction r;
      r.unit = static_cast<int64_t>(u);
      r.offset = lo;
      r.length = std::min(piece, shard - lo);
      r.fresh = fresh;
      r.last = lo + r.length == shard;
      if (w == 1) {
        r.out = torch::empty({r.length}, reduce_options);  // copied down from here
        fill_flat(parts, lo, r.length, r.out, /*add=*/false);
      } else {
        r.in = torch::empty({w * r.length}, reduce_options);
        for (int64_t k = 0; k < w; ++k) fill_flat(parts, k * shard + lo, r.length, r.in.narrow(0, k * r.length, r.length), false);
        r.out = into_grad ? unit.shard_grad.narrow(0, lo, r.length) : torch::empty({r.length}, reduce_options);
        r.work = group_->reduce_scatter(r.out, r.in);
        count_reduction(w * r.length);
      }
      const bool whole = r.last && lo == 0;
      reducing_.push_back(std::move(r));
      unit.has_grad = true;  // once its first piece is under way (a failed step undoes it: train_step)
      if (whole) break;  // one piece: waited for one block later, as any unit's
      // Everything launched before this piece goes on its way now (another unit's reduction ahead
      // of this one's pieces too); the piece before the last must be done before the next piece's
      // buffers are allocated.
      while (reducing_.size() > 1) {
        finish_reduction(reducing_.front());
        if (reducing_.front().unit == static_cast<int64_t>(u)) pieces_done.push_back(reducing_.front().done);
        reducing_.pop_front();
      }
      while (pieces_done.size() > 1) {
        pieces_done.front().synchronize();
        pieces_done.pop_front();
      }
    }
  }
}

void Sharded::count_reduction(int64_t elements) {
  const auto w = static_cast<double>(world_size());
  // NCCL: a reduce-scatter. Gloo: an all-reduce, or for bf16 (which Gloo lacks) an all-gather of
  // every rank's whole buffer.
  const bool gloo_bf16 = group_->backend() != "nccl" && config_.precision.reduce == torch::kBFloat16;
  count_collective(elements * reduced_element(), group_->backend() == "nccl" ? (w - 1) / w
                                                 : gloo_bf16                 ? w - 1
                                                                             : 2 * (w - 1) / w);
}

void Sharded::finish_reductions() {
  while (!reducing_.empty()) {
    finish_reduction(reducing_.front());
    reducing_.pop_front();
  }
}

void Sharded::finish_reduction(Reduction& r) {
  torch::NoGradGuard no_grad;
  r.work.wait();  // NCCL: the compute stream waits for it; Gloo: done when this returns
  r.in = torch::Tensor();
  auto& unit = units_[static_cast<size_t>(r.unit)];
  auto target = unit.shard_grad.narrow(0, r.offset, r.length);
  if (options_.offload) {
    // Down on the copy stream, straight into the pinned gradient on a fresh step (else into a staging
    // buffer that the host adds); the host applies the update once the unit's last piece has landed.
    // A reduction narrower than fp32 is widened on the device first, in the compute stream's order.
    auto down = r.out.scalar_type() == torch::kFloat ? r.out : r.out.to(torch::kFloat);
    d2h_->wait(device::Stream::compute(device_).record());
    auto staging = r.fresh ? torch::Tensor() : device::host_buffer({r.length}, torch::kFloat, device_);
    d2h_->copy(r.fresh ? target : staging, down);
    d2h_->keep_alive(down);
    bytes_d2h_ += r.length * static_cast<int64_t>(sizeof(float));
    r.done = d2h_->record();
    host_->submit([this, landed = r.done, staging, target, last = r.last, &unit] {
      landed.synchronize();
      if (staging.defined()) {
        device::TimeInto timed(host_update_ns_);  // a sum the update needs (Stats::host_update_ms)
        target.add_(staging);
      }
      if (last && options_.overlap_optimizer) update_shard(unit);
    });
  } else {
    if (r.out.data_ptr() != target.data_ptr()) {
      if (r.fresh)
        target.copy_(r.out);
      else
        target.add_(r.out);
    }
    r.done = device::Stream::compute(device_).record();
  }
  r.out = torch::Tensor();
}

void Sharded::finish_pending() {
  if (host_) host_->drain();
  if (d2h_) d2h_->synchronize();
}

void Sharded::finish_backward() {
  if (d2h_) d2h_->synchronize();  // every gradient has landed on the host
  // Without the overlapped optimizer the host queue holds only backward's work (accumulation).
  if (host_ && !options_.overlap_optimizer) host_->drain();
}

void Sharded::update_shard(Unit& unit) {
  if (unit.trainable_in_shard == 0) return;
  std::optional<device::TimeInto> timed;  // Stats::host_update_ms: a shard stepped on the host
  if (options_.offload) timed.emplace(host_update_ns_);
  auto p = unit.shard.narrow(0, 0, unit.trainable_in_shard);
  auto g = unit.shard_grad.narrow(0, 0, unit.trainable_in_shard);
  optimizer_update(config_.optimizer, p, g, unit.optimizer,
                   unit.travel.defined() ? unit.travel.narrow(0, 0, unit.trainable_in_shard) : torch::Tensor());
}

double Sharded::train_step(const models::Batch& batch) {
  auto& m = model();
  STRATA_CHECK(!(options_.overlap_optimizer && step_in_flight_),
               name_ << ": overlap_optimizer=1 applies each step's gradients during backward, so every train_step "
                        "must be followed by optimizer_step (gradient accumulation needs overlap_optimizer=0)");
  const auto [lo, hi] = slice_of(batch.size());
  finish_pending();  // the last step's host updates, before any shard goes up again
  for (auto& unit : units_) unit.pending_users = unit.users;
  step_blocks_ = 0;
  if (options_.overlap_optimizer) step_in_flight_ = true;
  auto clean_up = [&] {
    for (auto& kept : kept_) kept = {};
    anchor_.mutable_grad() = torch::Tensor();
    std::exception_ptr failed;  // every window dropped, whatever one of them throws
    for (int64_t b = 0; b < m.num_blocks(); ++b) {
      try {
        drop_window(b);
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
  };
  double local = 0.0;
  try {
    // The rank's slice, weighted by its share of the whole batch's targets.
    auto x = config_.precision.cast_input(batch.input.narrow(0, lo, hi - lo).to(device_));
    auto target = batch.target.narrow(0, lo, hi - lo).to(device_);
    bytes_h2d_ += (batch.input.nbytes() + batch.target.nbytes()) * (hi - lo) / batch.size();
    const auto counted = static_cast<double>(models::BlockModel::count_targets(batch.target));
    for (int64_t b = 0; b < m.num_blocks(); ++b) x = run_windowed(*this, b, x, anchor_);
    auto loss = m.loss_sum(x, target) / counted;
    x = torch::Tensor();
    scaler_.scaled(loss).backward();  // fp16: the scale rides the gradients
    finish_reductions();
    clean_up();
    agree_on_buffers();
    local = loss.item<double>();
  } catch (...) {
    // Reductions already started are waited for (their buffers are in use) and dropped; what has
    // reached the shards' gradients stays (as autograd's .grad would keep it), and a failed step
    // leaves no step in flight. Every part of this runs whatever the others throw: the step's own
    // error is the one to report.
    for (auto& r : reducing_) {
      try {
        r.work.wait();
      } catch (...) {  // the step's own error is the one to report
      }
      // A unit whose first gradient of the step did not arrive whole has none.
      if (r.fresh) units_[static_cast<size_t>(r.unit)].has_grad = false;
    }
    reducing_.clear();
    for (auto& unit : units_) unit.grad_full = torch::Tensor();
    try {
      clean_up();
    } catch (...) {
    }
    try {
      finish_pending();
    } catch (...) {
    }
    step_in_flight_ = false;
    throw;
  }
  // The whole batch's mean: every rank's weighted share, summed.
  auto total = torch::tensor({local}, torch::TensorOptions().dtype(torch::kDouble).device(device_));
  group_->all_reduce(total).wait();
  bytes_interconnect_ += distributed::ring_all_reduce_bytes(static_cast<int64_t>(sizeof(double)), world_size());
  return total.item<double>();
}

torch::Tensor Sharded::forward(const torch::Tensor& input) {
  auto& m = model();
  finish_pending();
  torch::NoGradGuard no_grad;
  bytes_h2d_ += input.nbytes();
  auto x = config_.precision.cast_input(input.to(device_));
  for (int64_t b = 0; b < m.num_blocks(); ++b) {
    hold_window(b);
    prefetch_from(b, /*backward=*/false);
    for (auto u : windows_[b]) units_[u].gathering.wait();
    x = m.blocks()[b]->forward(x);
    drop_window(b);
  }
  agree_on_buffers();
  return x;
}

void Sharded::agree_on_buffers() {
  if (world_size() <= 1) return;
  const auto w = static_cast<double>(world_size());
  for (const auto& b : model().buffers()) {
    if (b.tensor.numel() == 0) continue;
    group_->broadcast(b.tensor, 0).wait();
    count_collective(static_cast<int64_t>(b.tensor.nbytes()), (w - 1) / w);
  }
}

void Sharded::optimizer_step() {
  model();
  finish_reductions();
  finish_pending();
  // Shards go up to the device without blocking the host: none may still be reading a shard that
  // the host is about to write.
  if (h2d_) h2d_->synchronize();
  torch::NoGradGuard no_grad;
  // fp16: the gradients carry the loss scale. A step with an inf or nan on any rank is skipped on
  // every rank (each rank sees only its shards), and the scale lowered everywhere alike.
  bool finite = true;
  if (scaler_.enabled()) {
    std::optional<device::TimeInto> timed;  // fp16's unscaling pass, on the host with offload
    if (options_.offload) timed.emplace(host_update_ns_);
    std::vector<torch::Tensor> grads;
    for (auto& unit : units_)
      if (unit.has_grad && unit.trainable_in_shard > 0) grads.push_back(unit.shard_grad.narrow(0, 0, unit.trainable_in_shard));
    finite = distributed::on_every_rank(*group_, scaler_.unscale(grads), device_);
    scaler_.update(finite);
  }
  for (auto& unit : units_) {
    if (!unit.has_grad) continue;
    if (!options_.overlap_optimizer && finite) update_shard(unit);  // else applied as the gradient landed
    unit.has_grad = false;  // the next gradient overwrites shard_grad rather than adding to it
    if (!options_.offload) unit.shard_grad = torch::Tensor();  // its device memory is free until then
  }
  step_in_flight_ = false;
}

torch::Tensor Sharded::gather_full(const Unit& unit, const torch::Tensor& part) {
  auto out = torch::empty({unit.padded}, unit.full.options().dtype(part.scalar_type()));  // fp32, as the masters
  group_->all_gather(out, part.to(device_)).wait();
  return out.to(torch::kCPU);
}

NamedTensors Sharded::full_tensors(bool grads) {
  const auto& params = model().parameters();
  finish_reductions();
  finish_pending();
  std::vector<torch::Tensor> flats(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& unit = units_[u];
    if (grads && !unit.has_grad) continue;  // the same on every rank: no collective, zeros below
    flats[u] = gather_full(unit, grads ? unit.shard_grad : unit.shard);
  }
  NamedTensors out;
  for (size_t p = 0; p < params.size(); ++p) {
    const auto [u, offset] = param_slot_[p];
    const auto& t = params[p].tensor;
    const bool zero = !flats[u].defined() || (grads && !t.requires_grad());
    out.emplace_back(params[p].name,
                     zero ? torch::zeros(t.sizes()) : flats[u].narrow(0, offset, t.numel()).view(t.sizes()).clone());
  }
  return out;
}

NamedTensors Sharded::gradients() {
  auto out = full_tensors(/*grads=*/true);
  for (auto& [name, g] : out) g = scaler_.unscaled(g);  // as the optimizer will see them
  return out;
}
NamedTensors Sharded::parameters() { return full_tensors(/*grads=*/false); }
NamedTensors Sharded::buffers() { return host_copies(model().buffers()); }

NamedTensors Sharded::training_state() {
  const auto& params = model().parameters();
  finish_reductions();
  finish_pending();
  device::synchronize(device_);
  for (const auto& unit : units_)
    STRATA_CHECK(!unit.has_grad, name_ << ": training_state() after optimizer_step, with no gradient accumulated");
  const int64_t r = rank();
  NamedTensors out;
  auto host = [](const torch::Tensor& t) { return t.to(torch::kCPU, false, /*copy=*/true); };
  for (size_t p = 0; p < params.size(); ++p) {
    const auto [u, offset] = param_slot_[p];
    const auto& unit = units_[u];
    const auto& name = params[p].name;
    const int64_t numel = params[p].tensor.numel(), mine = r * unit.shard_numel;
    // This rank's elements of the parameter: [a, b) in the unit's flat.
    const int64_t a = std::max(offset, mine), b = std::min(offset + numel, mine + unit.shard_numel);
    if (a >= b) continue;
    out.emplace_back(piece_key(name, a - offset), host(unit.shard.narrow(0, a - mine, b - a)));
    if (offset + numel > unit.trainable_numel) continue;  // frozen: no optimizer state
    const auto& st = unit.optimizer;
    if (st.exp_avg.defined()) out.emplace_back(piece_key(name + "/exp_avg", a - offset), host(st.exp_avg.narrow(0, a - mine, b - a)));
    if (st.exp_avg_sq.defined())
      out.emplace_back(piece_key(name + "/exp_avg_sq", a - offset), host(st.exp_avg_sq.narrow(0, a - mine, b - a)));
    if (st.step > 0 && a == offset) out.emplace_back(name + "/step", torch::tensor({st.step}, torch::kLong));
  }
  if (r == 0) {
    for (auto& b : buffers()) out.push_back(std::move(b));
    out.emplace_back("loss_scaler", scaler_.state());
  }
  return out;
}

void Sharded::load_training_state(const NamedTensors& state) {
  const auto& params = model().parameters();
  // Everything checked before anything changes: a bad state leaves this strategy as it was.
  const auto index = checked_training_state(name_, params, model().buffers(), state);
  const int64_t r = rank();
  // Read first, written after: a range that is missing fails before any shard changes.
  struct Loaded {
    torch::Tensor shard, exp_avg, exp_avg_sq;
    int64_t step = 0;
  };
  std::vector<Loaded> loaded(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& unit = units_[u];
    auto& l = loaded[u];
    const int64_t mine = r * unit.shard_numel;
    l.shard = torch::zeros({unit.shard_numel});  // the padding stays zeros
    bool moments = false, first = true;
    for (auto p : unit.params) {
      const auto offset = param_slot_[p].second;
      const auto& name = params[p].name;
      const int64_t numel = params[p].tensor.numel();
      const bool trains = offset + numel <= unit.trainable_numel;
      if (trains) {  // one step count and the moments whole or not at all, for every parameter of a unit
        const auto n = index.find(name + "/step");
        const int64_t step = n.defined() ? n.item<int64_t>() : 0;
        const bool has = index.has(name + "/exp_avg");
        STRATA_CHECK(first || (step == l.step && has == moments),
                     name_ << ": '" << name << "' is at step " << step << (has ? " with" : " without")
                           << " optimizer state, the parameters it is sharded with at step " << l.step
                           << (moments ? " with" : " without"));
        l.step = step;
        moments = has;
        first = false;
      }
      const int64_t a = std::max(offset, mine), b = std::min(offset + numel, mine + unit.shard_numel);
      if (a >= b) continue;
      l.shard.narrow(0, a - mine, b - a).copy_(index.range(name, a - offset, b - offset));
      if (!trains || !moments || unit.trainable_in_shard == 0) continue;
      if (!l.exp_avg.defined()) {
        l.exp_avg = torch::zeros({unit.trainable_in_shard});
        if (config_.optimizer.kind == OptimizerKind::adamw) l.exp_avg_sq = torch::zeros({unit.trainable_in_shard});
      }
      l.exp_avg.narrow(0, a - mine, b - a).copy_(index.range(name + "/exp_avg", a - offset, b - offset));
      if (l.exp_avg_sq.defined())
        l.exp_avg_sq.narrow(0, a - mine, b - a).copy_(index.range(name + "/exp_avg_sq", a - offset, b - offset));
    }
  }
  finish_reductions();
  finish_pending();
  for (int64_t b = 0; b < static_cast<int64_t>(windows_.size()); ++b) drop_window(b);  // gathered: old values
  device::synchronize(device_);
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = units_[u];
    auto& l = loaded[u];
    STRATA_CHECK(!unit.has_grad, name_ << ": load_training_state() after optimizer_step, with no gradient accumulated");
    unit.shard.copy_(l.shard);
    if (unit.travel.defined()) unit.travel.copy_(unit.shard);
    const auto where = unit.shard.device();
    unit.optimizer = {};
    if (l.exp_avg.defined()) unit.optimizer.exp_avg = l.exp_avg.to(where);
    if (l.exp_avg_sq.defined()) unit.optimizer.exp_avg_sq = l.exp_avg_sq.to(where);
    unit.optimizer.step = unit.trainable_in_shard > 0 ? l.step : 0;
  }
  load_buffers(model().buffers(), index);
  if (auto sc = index.find("loss_scaler"); sc.defined()) scaler_.restore(sc);
}

Stats Sharded::stats() {
  model();  // before attach: an Error, as every strategy's
  Stats s;
  s.bytes_h2d = bytes_h2d_;
  s.bytes_d2h = bytes_d2h_;
  s.bytes_interconnect = bytes_interconnect_;
  s.loss_scale = scaler_.scale();
  s.skipped_steps = scaler_.skipped_steps();
  s.host_update_ms = static_cast<double>(host_update_ns_) / 1e6;
  auto& mem = s.devices[device_.str()];
  const int64_t shards_here = options_.offload ? 0 : shard_bytes_;
  mem.resident_param_bytes = shards_here + gathered_bytes_;
  mem.peak_param_bytes = shards_here + peak_gathered_;
  const auto alloc = device::allocator_stats(device_);
  mem.peak_allocated = alloc.peak_allocated;
  mem.peak_reserved = alloc.peak_reserved;
  return s;
}

void Sharded::reset_stats() {
  bytes_interconnect_ = bytes_h2d_ = bytes_d2h_ = 0;
  host_update_ns_ = 0;
  peak_gathered_ = gathered_bytes_;
  device::reset_peak_stats(device_);
}

namespace {
std::unique_ptr<Strategy> make_sharded(const std::string& name, const StrategyConfig& c,
                                       const std::map<std::string, std::string>& defaults) {
  auto options = defaults;
  for (const auto& [k, v] : c.options) options[k] = v;
  return std::make_unique<Sharded>(name, c, ShardedOptions::parse(options));
}
}  // namespace

static const OptionDocumenter sharded_docs(
    {"sharded", "sharded_offload"},
    {{"prefetch", "0..", "units whose all-gathers run ahead"},
     {"activations", "recompute, keep", "recompute blocks (all but the last) in backward, or keep their activations"},
     {"reshard_after_forward", "0/1", "free gathered units after forward (all but the last block's), gather them again in backward"},
     {"offload", "0/1", "shards, gradients and optimizer state in pinned host memory"},
     {"overlap_optimizer", "0/1 (default: as offload)", "with offload: each unit updated on the host during backward"},
     {"piece_kib", "1..", "a unit one block uses is reduced (with offload: copied down) in pieces of at most this many KiB of each rank's shard"},
     {"debug_poison", "0/1", "every gathered buffer filled with NaN before its collective", true},
     {"debug_skip_waits", "0/1", "compute does not wait for its collectives (a deliberate bug)", true},
     {"debug_fail_rank", "a rank, or -1", "this rank throws in its forward (the fault tests)", true}});

STRATA_REGISTER_STRATEGY("sharded",
                         "ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded over the ranks of a c10d group",
                         [](const StrategyConfig& c) { return make_sharded("sharded", c, {}); });
STRATA_REGISTER_STRATEGY("sharded_offload",
                         "sharded with shards, gradients and optimizer state in pinned host memory, stepped on the host",
                         [](const StrategyConfig& c) { return make_sharded("sharded_offload", c, {{"offload", "1"}}); });

}  // namespace strata
