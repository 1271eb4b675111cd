#include "strategies/sharded/sharded.h"

#include <cmath>
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
  o.debug_poison = reader.get_bool("debug_poison", o.debug_poison);
  o.debug_skip_waits = reader.get_bool("debug_skip_waits", o.debug_skip_waits);
  o.debug_fail_rank = reader.get_int("debug_fail_rank", o.debug_fail_rank);
  reader.finish();
  o.validate();
  return o;
}

void ShardedOptions::validate() const {
  STRATA_CHECK(prefetch >= 0, "sharded: prefetch=" << prefetch << " must be 0 (gather when needed) or more");
  STRATA_CHECK(!overlap_optimizer || offload,
               "sharded: overlap_optimizer=1 applies to the host optimizer of offload=1 (sharded_offload)");
}

std::string ShardedOptions::to_string() const {
  std::ostringstream out;
  out << "prefetch=" << prefetch << " recompute=" << recompute << " reshard_after_forward=" << reshard_after_forward
      << " offload=" << offload << " overlap_optimizer=" << overlap_optimizer;
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
                                ///< while gathered
  int references = 0;
  distributed::Work gathering;
  torch::Tensor grad_full;      ///< [padded] this step's uses summed in the reduction dtype, until
                                ///< reduce-scattered
  torch::Tensor reduced;        ///< [shard] the reduce-scatter's result (shard_grad itself on a fresh
                                ///< device step), until added to shard_grad
  distributed::Work reducing;
  OptimizerState optimizer;
};

namespace {
torch::Device compute_device(const torch::Device& requested) {
  const auto& env = distributed::environment();
  // Launched over several GPUs, each rank computes on its own: cuda:LOCAL_RANK.
  if (requested.is_cuda() && env.launched && env.world_size > 1)
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  return requested;
}
}  // namespace

Sharded::Sharded(std::string name, const StrategyConfig& config, ShardedOptions options)
    : name_(std::move(name)),
      config_(config),
      options_(std::move(options)),
      device_(compute_device(config.device)),
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
      unit.reducing.wait();
    } catch (...) {  // a failed collective was reported where it failed
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
  group_ = distributed::group_for(device_);
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
      if (offload_to_host() && config_.precision.transfer != torch::kFloat)
        unit.travel = device::host_buffer({unit.shard_numel}, config_.precision.transfer, device_).copy_(mine);
    } else {
      unit.shard = mine.to(device_, /*non_blocking=*/false, /*copy=*/true);
      // shard_grad: allocated by the step's first reduction, freed by the optimizer step (as
      // zero_grad(set_to_none) does), so forward and the start of backward run without it.
    }
    shard_bytes_ += unit.shard_numel * static_cast<int64_t>(sizeof(float));
    unit.full = torch::empty({unit.padded}, dev_options.dtype(config_.precision.transfer));
    for (auto p : unit.params) {
      auto& t = params[p].tensor;
      t.set_data(unit.full.narrow(0, param_slot_[p].second, t.numel()).view(t.sizes()));
    }
    compat::release_storage(unit.full.storage());
  }
  // Buffers live on the device, whole on every rank (they are small, and most are fixed).
  for (const auto& b : model.buffers()) b.tensor.set_data(b.tensor.to(device_));
  if (offload_to_host()) {
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
  const int64_t bytes = unit.padded * gathered_element();
  compat::reallocate_storage(unit.full.storage(), static_cast<size_t>(bytes));
  try {
    torch::NoGradGuard no_grad;
    if (options_.debug_poison) unit.full.fill_(std::numeric_limits<float>::quiet_NaN());
    if (offload_to_host()) {
      // The shard goes up on the copy stream and the gather is launched from it, so both overlap the
      // block computing now. The copy stream first waits for the compute queued so far: the gathered
      // buffer was just allocated in the compute stream's order.
      h2d_->wait(device::Stream::compute(device_).record());
      device::Stream::Guard on_copy_stream(*h2d_);
      auto source = travel_source(unit).to(device_, /*non_blocking=*/true);
      bytes_h2d_ += unit.shard_numel * gathered_element();
      unit.gathering = group_->all_gather(unit.full, source);
    } else {
      unit.gathering = group_->all_gather(unit.full, travel_source(unit));
    }
  } catch (...) {
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
  if (--unit.references > 0) return;
  unit.gathering.wait();  // a gather nobody waited for may still be writing the buffer
  compat::release_storage(unit.full.storage());
  gathered_bytes_ -= unit.padded * gathered_element();
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
  for (auto u : windows_[block]) release(units_[u]);
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
  if (!backward && !options_.reshard_after_forward) return;  // kept for its backward
  drop_window(block);
}

void Sharded::flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) {
  const auto& params = model().parameters();
  std::unordered_map<const void*, torch::Tensor> grad_of;
  auto block_params = model().blocks()[block]->parameters();
  for (size_t i = 0; i < block_params.size(); ++i) grad_of[block_params[i].unsafeGetTensorImpl()] = grads[i];
  torch::NoGradGuard no_grad;
  // The reduce-scatters of earlier blocks have had this block's backward to run in: finish them, so
  // their full-size gradient buffers go before this block's arrive.
  finish_reductions();
  for (auto u : windows_[block]) {
    auto& unit = units_[u];
    if (unit.trainable_numel == 0) continue;  // all frozen: nothing to reduce or update
    if (!unit.grad_full.defined()) unit.grad_full = torch::zeros({unit.padded}, unit.full.options().dtype(config_.precision.reduce));
    for (auto p : unit.params) {
      const auto& t = params[p].tensor;
      if (!t.requires_grad()) break;  // the frozen tail
      const auto& g = grad_of.at(t.unsafeGetTensorImpl());
      if (g.defined()) unit.grad_full.narrow(0, param_slot_[p].second, t.numel()).add_(g.reshape({-1}));
    }
    if (--unit.pending_users > 0) continue;  // a shared parameter: its other uses come later in backward
    // Its last use is done: reduce-scatter now, while the next block's backward runs; on a fresh step
    // with the shard on the device and fp32 reduction, straight into its gradient.
    const auto fp32 = unit.full.options().dtype(torch::kFloat);
    const bool into_grad = !unit.has_grad && !options_.offload && config_.precision.reduce == torch::kFloat;
    if (into_grad) unit.shard_grad = torch::empty({unit.shard_numel}, fp32);
    unit.reduced = into_grad ? unit.shard_grad : torch::empty({unit.shard_numel}, unit.grad_full.options());
    unit.reducing = group_->reduce_scatter(unit.reduced, unit.grad_full);
    reducing_.push_back(static_cast<int64_t>(u));
    const auto w = static_cast<double>(world_size());
    // NCCL: a reduce-scatter. Gloo: an all-reduce, or for bf16 (which Gloo lacks) an all-gather
    // of every rank's whole buffer.
    const bool gloo_bf16 = group_->backend() != "nccl" && config_.precision.reduce == torch::kBFloat16;
    count_collective(unit.padded * reduced_element(), group_->backend() == "nccl" ? (w - 1) / w
                                                      : gloo_bf16                 ? w - 1
                                                                                  : 2 * (w - 1) / w);
  }
}

void Sharded::finish_reductions() {
  auto units = std::move(reducing_);
  reducing_.clear();
  for (auto u : units) finish_reduction(units_[u]);
}

void Sharded::finish_reduction(Unit& unit) {
  torch::NoGradGuard no_grad;
  unit.reducing.wait();  // NCCL: the compute stream waits for it; Gloo: done when this returns
  unit.grad_full = torch::Tensor();
  const bool fresh = !unit.has_grad;
  unit.has_grad = true;
  if (offload_to_host()) {
    // Down on the copy stream, straight into the pinned gradient on a fresh step (else into a staging
    // buffer that the host adds); the host applies the update once it has landed.
    // A reduction narrower than fp32 is widened on the device first, in the compute stream's order.
    auto down = unit.reduced.scalar_type() == torch::kFloat ? unit.reduced : unit.reduced.to(torch::kFloat);
    d2h_->wait(device::Stream::compute(device_).record());
    auto staging = fresh ? torch::Tensor() : device::host_buffer({unit.shard_numel}, torch::kFloat, device_);
    d2h_->copy(fresh ? unit.shard_grad : staging, down);
    d2h_->keep_alive(down);
    bytes_d2h_ += unit.shard_numel * static_cast<int64_t>(sizeof(float));
    host_->submit([this, landed = d2h_->record(), staging, &unit] {
      landed.synchronize();
      if (staging.defined()) {
        device::TimeInto timed(host_update_ns_);  // a sum the update needs (Stats::host_update_ms)
        unit.shard_grad.add_(staging);
      }
      if (options_.overlap_optimizer) update_shard(unit);
    });
  } else {
    if (!unit.reduced.is_same(unit.shard_grad)) {
      if (!unit.shard_grad.defined())  // a fresh step with a narrower reduction: widened here
        unit.shard_grad = unit.reduced.to(torch::kFloat);
      else if (fresh)
        unit.shard_grad.copy_(unit.reduced);
      else
        unit.shard_grad.add_(unit.reduced);
    }
    if (options_.overlap_optimizer) update_shard(unit);
  }
  unit.reduced = torch::Tensor();
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
    for (int64_t b = 0; b < m.num_blocks(); ++b) drop_window(b);
    for (auto& kept : kept_) kept = {};
    anchor_.mutable_grad() = torch::Tensor();
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
    local = loss.item<double>();
  } catch (...) {
    clean_up();
    // Reductions already started are waited for (their buffers are in use) and dropped; what has
    // reached the shards' gradients stays (as autograd's .grad would keep it), and a failed step
    // leaves no step in flight.
    reducing_.clear();
    for (auto& unit : units_) {
      try {
        unit.reducing.wait();
      } catch (...) {  // the step's own error is the one to report
      }
      unit.reduced = torch::Tensor();
      unit.grad_full = torch::Tensor();
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
  const auto w = static_cast<double>(world_size());
  count_collective(static_cast<int64_t>(sizeof(double)), 2 * (w - 1) / w);
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
  return x;
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
     {"activations", "recompute, keep", "recompute blocks in backward, or keep their activations"},
     {"reshard_after_forward", "0/1", "free gathered units after forward, gather them again in backward"},
     {"offload", "0/1", "shards, gradients and optimizer state in pinned host memory"},
     {"overlap_optimizer", "0/1 (default: as offload)", "with offload: each unit updated on the host during backward"},
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
