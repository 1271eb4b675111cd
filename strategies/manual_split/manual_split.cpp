#include "strategies/manual_split/manual_split.h"

#include <limits>
#include <numeric>
#include <sstream>

#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/optimizer_state_io.h"
#include "strategies/options.h"

namespace strata {
namespace {

std::string braced_list(const std::vector<int64_t>& v) {
  std::ostringstream out;
  out << "{";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  out << "}";
  return out.str();
}

void add_grad(torch::Tensor& grad, const torch::Tensor& contribution) {
  if (!contribution.defined()) return;
  if (!grad.defined())
    grad = contribution;
  else
    grad.add_(contribution);
}

}  // namespace

ManualSplitOptions ManualSplitOptions::parse(const std::map<std::string, std::string>& options) {
  OptionReader reader("manual_split", options);
  ManualSplitOptions o;
  const auto balance = reader.get_string("balance", "auto");
  if (balance != "auto") o.balance = reader.get_ints("balance", {});
  o.devices = reader.get_strings("devices", o.devices);
  o.stages = reader.get_int("stages", o.stages);
  o.weigh = reader.get_string("weigh", o.weigh);
  o.activation_batch = reader.get_int("activation_batch", o.activation_batch);
  o.classifier_shards = reader.get_int("classifier_shards", o.classifier_shards);
  o.sync_replicas = reader.get_bool("sync_replicas", o.sync_replicas);
  reader.finish();
  o.validate();
  return o;
}

void ManualSplitOptions::validate() const {
  for (size_t i = 0; i < balance.size(); ++i)
    STRATA_CHECK(balance[i] >= 1, "manual_split: balance " << braced_list(balance) << " has an empty stage (stage " << i
                                                           << " gets " << balance[i] << " blocks)");
  STRATA_CHECK(stages >= 0, "manual_split: stages=" << stages << " must not be negative");
  STRATA_CHECK(weigh == "params" || weigh == "memory",
               "manual_split: weigh='" << weigh << "' is not valid; use params or memory");
  STRATA_CHECK(activation_batch >= 1, "manual_split: activation_batch=" << activation_batch << " must be at least 1");
  STRATA_CHECK(classifier_shards >= 1, "manual_split: classifier_shards=" << classifier_shards << " must be at least 1");
  for (const auto& d : devices) {
    try {
      device::parse(d);
    } catch (const Error& e) {
      STRATA_FAIL("manual_split: " << e.what());
    }
  }
  if (!balance.empty() && !devices.empty())
    STRATA_CHECK(balance.size() == devices.size(), "manual_split: balance " << braced_list(balance) << " has "
                                                                            << balance.size() << " stages but "
                                                                            << devices.size() << " devices were given");
  if (!balance.empty() && stages > 0)
    STRATA_CHECK(static_cast<int64_t>(balance.size()) == stages,
                 "manual_split: balance " << braced_list(balance) << " has " << balance.size() << " stages but stages="
                                          << stages);
}

std::vector<int64_t> ManualSplit::partition(const std::vector<double>& w, int64_t stages) {
  // Linear partition by dynamic programming: best[s][i] = lightest possible heaviest stage when
  // the first i blocks form s stages.
  const auto n = static_cast<int64_t>(w.size());
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + w[i];
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int64_t s = 1; s <= stages; ++s)
    for (int64_t i = s; i <= n; ++i)
      for (int64_t j = s - 1; j < i; ++j) {
        const double cost = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (cost < best[s][i]) {
          best[s][i] = cost;
          cut[s][i] = j;
        }
      }
  std::vector<int64_t> balance(stages);
  for (int64_t s = stages, i = n; s >= 1; --s) {
    balance[s - 1] = i - cut[s][i];
    i = cut[s][i];
  }
  return balance;
}

ManualSplit::ManualSplit(std::string name, const StrategyConfig& config, ManualSplitOptions options)
    : name_(std::move(name)), config_(config), options_(std::move(options)), scaler_(config.precision) {
  device::check_available(config_.device);
}

std::vector<torch::Tensor> ManualSplit::trained_tensors() {
  std::vector<torch::Tensor> out;
  for (const auto& p : model().parameters()) out.push_back(p.tensor);
  for (auto& r : replicas_) out.push_back(r.value);
  for (auto& s : shards_) {
    out.push_back(s.weight);
    if (s.bias.defined()) out.push_back(s.bias);
  }
  return out;
}

models::BlockModel& ManualSplit::model() {
  STRATA_CHECK(model_.has_value(), name_ << ": attach() a model first");
  return *model_;
}

void ManualSplit::attach_model(models::BlockModel model) {
  check_buffers_under(config_.precision, model, name_);
  const auto n = model.num_blocks();
  // Stage devices: the options' list, else the config's, else `stages` copies of the main device.
  if (!options_.devices.empty()) {
    for (const auto& d : options_.devices) devices_.push_back(device::parse(d));
  } else if (!config_.devices.empty()) {
    devices_ = config_.devices;
  } else {
    int64_t stages = options_.stages > 0 ? options_.stages
                     : !options_.balance.empty() ? static_cast<int64_t>(options_.balance.size())
                                                 : std::min<int64_t>(2, n);
    devices_.assign(stages, config_.device);
  }
  for (const auto& d : devices_) device::check_available(d);
  const auto stages = static_cast<int64_t>(devices_.size());
  STRATA_CHECK(!options_.balance.empty() || stages <= n,
               "manual_split: " << stages << " stages for a model of " << n << " blocks; every stage needs a block");
  STRATA_CHECK(options_.balance.empty() || static_cast<int64_t>(options_.balance.size()) == stages,
               "manual_split: balance " << braced_list(options_.balance) << " has " << options_.balance.size()
                                        << " stages but there are " << stages << " devices");

  const auto& params = model.parameters();
  const auto& uses = model.block_parameters();
  if (options_.balance.empty()) {
    // Weigh each block by the bytes it holds: parameters (a tied one in every stage using it),
    // and with weigh=memory also their gradients, optimizer state and the block's activations.
    const bool memory = options_.weigh == "memory";
    const double per_byte = memory ? (config_.optimizer.kind == OptimizerKind::adamw ? 4.0 : 3.0) : 1.0;
    std::vector<double> w(n, 0.0);
    for (int64_t b = 0; b < n; ++b) {
      for (auto p : uses[b]) w[b] += per_byte * params[p].tensor.numel() * params[p].tensor.element_size();
      if (memory) w[b] += static_cast<double>(model.blocks()[b]->activation_bytes(options_.activation_batch));
    }
    balance_ = partition(w, stages);
  } else {
    balance_ = options_.balance;
    const auto total = std::accumulate(balance_.begin(), balance_.end(), int64_t{0});
    STRATA_CHECK(total == n, "manual_split: balance " << braced_list(balance_) << " sums to " << total
                                                      << " but the model has " << n << " blocks");
  }
  stage_of_.clear();
  for (int64_t s = 0; s < stages; ++s)
    for (int64_t i = 0; i < balance_[s]; ++i) stage_of_.push_back(s);

  // Column split of the head.
  const int64_t last = n - 1;
  if (options_.classifier_shards > 1) {
    auto* head = dynamic_cast<models::LinearHead*>(model.blocks()[last].get());
    STRATA_CHECK(head, "manual_split: classifier_shards=" << options_.classifier_shards << " needs the last block (block "
                                                          << last << ") to be a linear head");
    auto find = [&](const torch::Tensor& t) -> int64_t {
      if (!t.defined()) return -1;
      for (size_t p = 0; p < params.size(); ++p)
        if (params[p].tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return static_cast<int64_t>(p);
      return -1;
    };
    head_weight_ = find(head->weight());
    head_bias_ = find(head->bias());
    int users = 0;
    for (const auto& u : uses)
      users += std::count(u.begin(), u.end(), head_weight_);
    STRATA_CHECK(head_weight_ >= 0 && users == 1,
                 "manual_split: classifier_shards=" << options_.classifier_shards
                                                    << " needs a head whose weight is its own; this head's weight is "
                                                       "tied to another block");
    const auto classes = head->weight().size(0);
    STRATA_CHECK(options_.classifier_shards <= classes, "manual_split: classifier_shards=" << options_.classifier_shards
                                                                                           << " exceeds the " << classes
                                                                                           << " classes of the head");
    const auto k = options_.classifier_shards;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t lo = classes * i / k, hi = classes * (i + 1) / k;
      const auto dev = devices_[i % stages];
      Shard shard{lo, hi, dev, {}, {}, {}, {}};
      torch::NoGradGuard no_grad;
      auto shard_of = [&](const torch::Tensor& t) {  // a frozen head stays frozen in its shards
        return t.narrow(0, lo, hi - lo).to(dev).clone().requires_grad_(t.requires_grad());
      };
      shard.weight = shard_of(head->weight());
      if (head_bias_ >= 0) shard.bias = shard_of(head->bias());
      shards_.push_back(std::move(shard));
    }
  }

  // Every parameter moves to its home: the stage of its first user. The split head's own weight
  // and bias are replaced by the shards and keep no memory.
  home_stage_.assign(params.size(), 0);
  for (size_t p = 0; p < params.size(); ++p) {
    home_stage_[p] = stage_of_[params[p].owner_block];
    auto t = params[p].tensor;
    const bool replaced = static_cast<int64_t>(p) == head_weight_ || static_cast<int64_t>(p) == head_bias_;
    const auto& dev = devices_[home_stage_[p]];
    t.set_data(replaced ? torch::empty({0}, t.options().device(dev)) : t.detach().to(dev));
  }
  // Replicas: a parameter used by a block of another stage gets one copy there.
  for (int64_t b = 0; b < n; ++b) {
    for (auto p : uses[b]) {
      const auto s = stage_of_[b];
      if (s == home_stage_[p]) continue;
      const bool have = std::any_of(replicas_.begin(), replicas_.end(),
                                    [&](const Replica& r) { return r.param == p && r.stage == s; });
      if (have) continue;
      torch::NoGradGuard no_grad;
      const auto& home = params[p].tensor;
      replicas_.push_back({p, s, home.detach().to(devices_[s]).clone().requires_grad_(home.requires_grad())});
    }
  }
  // Buffers go with their block; one held by blocks of two devices would need a replica that
  // stays equal to it, which nothing here keeps.
  const auto& buffers = model.buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    std::vector<int64_t> holders;
    for (int64_t b = 0; b < n; ++b) {
      const auto& held = model.block_buffers()[b];
      if (std::find(held.begin(), held.end(), static_cast<int64_t>(i)) != held.end()) holders.push_back(b);
    }
    const auto& dev = devices_[stage_of_[holders.front()]];
    for (auto b : holders)
      STRATA_CHECK(devices_[stage_of_[b]] == dev,
                   "manual_split: buffer '" << buffers[i].name << "' is held by block " << holders.front() << " on "
                                            << dev << " and by block " << b << " on " << devices_[stage_of_[b]]
                                            << "; a buffer shared across devices is not supported (put those "
                                               "blocks in one stage with balance=...)");
    buffers[i].tensor.set_data(buffers[i].tensor.to(dev));
  }
  optimizer_state_.assign(params.size(), {});
  kept_.assign(n, {});
  model_.emplace(std::move(model));
  copies_ = ComputeCopies(config_.precision, trained_tensors());
  STRATA_CHECK(!sharded() || replicas_of_block(last).empty(),
               "manual_split: classifier_shards=" << options_.classifier_shards << " needs a head that shares no "
                                                  << "parameter with another stage");
}

std::vector<ManualSplit::Replica*> ManualSplit::replicas_of_block(int64_t block) {
  std::vector<Replica*> out;
  const auto& uses = model().block_parameters()[block];
  for (auto& r : replicas_)
    if (r.stage == stage_of_[block] && std::find(uses.begin(), uses.end(), r.param) != uses.end()) out.push_back(&r);
  return out;
}

// The block computes with its replicas: the shared parameter's data is swapped for the replica's
// for the duration of its forward (and backward, where autograd reads saved leaves).
ManualSplit::ReplicaSwap::ReplicaSwap(ManualSplit& split, int64_t block) : split_(split), block_(block) {
  for (auto* r : split_.replicas_of_block(block_)) {
    auto t = split_.model().parameters()[r->param].tensor;
    saved_.push_back(t.detach());
    t.set_data(r->value.detach());
  }
}

ManualSplit::ReplicaSwap::~ReplicaSwap() {
  auto replicas = split_.replicas_of_block(block_);
  for (size_t i = 0; i < saved_.size(); ++i) split_.model().parameters()[replicas[i]->param].tensor.set_data(saved_[i]);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A block that uses replicas: its gradients are routed by hand, the replicas' to the replicas and
// the rest to the block's own parameters, so no gradient ever meets a tensor of another device.
struct ReplicaBlock : torch::autograd::Function<ReplicaBlock> {
  static torch::Tensor forward(AutogradContext* ctx, ManualSplit* self, int64_t block, torch::Tensor x,
                               torch::Tensor anchor) {
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["block"] = block;
    ManualSplit::ReplicaSwap swap(*self, block);
    torch::Tensor out;
    std::tie(out, self->kept_graphs()[block]) = run_keeping_graph(*self->model().blocks()[block], x);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* self = reinterpret_cast<ManualSplit*>(ctx->saved_data["self"].toInt());
    const auto block = ctx->saved_data["block"].toInt();
    auto graph = std::move(self->kept_graphs()[block]);
    self->kept_graphs()[block] = {};
    auto params = self->model().blocks()[block]->parameters();
    BlockGradients grads;
    {
      ManualSplit::ReplicaSwap swap(*self, block);  // autograd reads saved leaves: the replica again
      grads = block_gradients(std::move(graph), grad_out);
    }
    const auto replicas = self->replicas_of_block(block);
    const auto& all = self->model().parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& g = grads.params[i];
      ManualSplit::Replica* replica = nullptr;
      for (auto* r : replicas)
        if (all[r->param].tensor.unsafeGetTensorImpl() == params[i].unsafeGetTensorImpl()) replica = r;
      add_grad(replica ? replica->value.mutable_grad() : params[i].mutable_grad(), g);
    }
    return {torch::Tensor(), torch::Tensor(), grads.input, torch::Tensor()};
  }
};

}  // namespace

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A move between devices as an autograd operation, so its bytes count when they move: the
// activation's in forward, its gradient's in backward (when that runs, if it runs).
struct Transfer : torch::autograd::Function<Transfer> {
  static torch::Tensor forward(AutogradContext* ctx, ManualSplit* self, torch::Tensor x, std::string to) {
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["from"] = x.device().str();
    return x.to(torch::Device(to));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* self = reinterpret_cast<ManualSplit*>(ctx->saved_data["self"].toInt());
    const torch::Device from(ctx->saved_data["from"].toStringRef());
    auto g = grad_out[0].to(from);
    self->count_interconnect(g.nbytes());
    return {torch::Tensor(), g, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor ManualSplit::transfer(const torch::Tensor& x, const torch::Device& to) {
  if (x.device() == to) return x;  // stages sharing a device move nothing
  count_interconnect(x.nbytes());
  if (!x.requires_grad() || !torch::GradMode::is_enabled()) return x.to(to);
  return Transfer::apply(this, x, to.str());
}

torch::Tensor ManualSplit::sharded_logits(const torch::Tensor& features) {
  const auto& out_dev = devices_.back();
  std::vector<torch::Tensor> parts;
  for (auto& s : shards_)
    parts.push_back(transfer(torch::nn::functional::linear(transfer(features, s.device), s.weight, s.bias), out_dev));
  return torch::cat(parts, -1);
}

torch::Tensor ManualSplit::sharded_loss(const torch::Tensor& features, const torch::Tensor& target) {
  // Cross-entropy over column shards, never holding [N, classes] on one device:
  //   loss_n = log sum_k sum_c exp(z_k[n,c] - M_n) + M_n - z[n, y_n],  M_n = max over all shards
  // Each shard sends back three [N] vectors (its max, its sum of exponentials, its target logit).
  const auto& out_dev = devices_.back();
  const auto d = features.size(-1);
  auto h = features.reshape({-1, d});
  auto y = target.reshape({-1}).to(out_dev);
  std::vector<torch::Tensor> logits;
  std::vector<torch::Tensor> maxima;
  for (auto& s : shards_) {
    // The loss in fp32, as the model's own: bf16 or fp16 logits are widened first.
    auto z = torch::nn::functional::linear(transfer(h, s.device), s.weight, s.bias);
    if (z.scalar_type() != torch::kFloat && z.scalar_type() != torch::kDouble) z = z.to(torch::kFloat);
    maxima.push_back(transfer(std::get<0>(z.detach().max(1)), out_dev));
    logits.push_back(z);
  }
  // The shift is gradient-neutral, so it is taken out of the graph.
  auto global_max = std::get<0>(torch::stack(maxima).max(0));
  // Rows whose target is kIgnoreIndex leave the sum and the count, as in the model's own loss.
  auto valid = (y != models::kIgnoreIndex);
  torch::Tensor sum_exp, target_logit;
  for (size_t k = 0; k < shards_.size(); ++k) {
    const auto& s = shards_[k];
    auto m = transfer(global_max, s.device);
    auto sk = torch::exp(logits[k] - m.unsqueeze(1)).sum(1);
    auto yk = transfer(y, s.device);
    auto in_shard = (yk >= s.lo).logical_and(yk < s.hi);
    auto local = (yk - s.lo).clamp(0, s.hi - s.lo - 1);
    auto tk = logits[k].gather(1, local.unsqueeze(1)).squeeze(1) * in_shard.to(logits[k].scalar_type());
    sum_exp = k == 0 ? transfer(sk, out_dev) : sum_exp + transfer(sk, out_dev);
    target_logit = k == 0 ? transfer(tk, out_dev) : target_logit + transfer(tk, out_dev);
  }
  auto per_row = (torch::log(sum_exp) + global_max - target_logit) * valid.to(sum_exp.scalar_type());
  return per_row.sum() / valid.sum().to(per_row.scalar_type());
}

torch::Tensor ManualSplit::run_blocks(torch::Tensor x, const torch::Tensor& target, torch::Tensor* loss) {
  auto& m = model();
  const auto n = m.num_blocks();
  for (int64_t b = 0; b < n; ++b) {
    x = transfer(x, devices_[stage_of_[b]]);
    const bool replicated = !replicas_of_block(b).empty();
    if (b == n - 1 && sharded()) {
      auto* head = dynamic_cast<models::LinearHead*>(m.blocks()[b].get());
      auto features = head->features(x);  // attach() refused split heads that use replicas
      if (loss) {
        *loss = sharded_loss(features, target);
        return {};
      }
      return sharded_logits(features);
    }
    if (!replicated) {
      x = m.blocks()[b]->forward(x);
    } else if (loss) {
      x = ReplicaBlock::apply(this, b, x, anchor_);
    } else {
      ReplicaSwap swap(*this, b);
      x = m.blocks()[b]->forward(x);
    }
  }
  if (loss) *loss = m.loss(x, target.to(devices_.back()));
  return x;
}

double ManualSplit::train_step(const models::Batch& batch) {
  model();
  if (!anchor_.defined()) anchor_ = torch::empty({0}, torch::TensorOptions().device(devices_.front())).requires_grad_(true);
  bytes_h2d_ += batch.input.nbytes() + batch.target.nbytes();
  torch::Tensor loss;
  try {
    ComputeCopies::Scope bound(copies_);  // the stages compute in the policy's dtype until backward is done
    run_blocks(config_.precision.cast_input(batch.input.to(devices_.front())), batch.target, &loss);
    scaler_.scaled(loss).backward();
    bound.commit();
  } catch (...) {
    for (auto& kept : kept_) kept = {};  // a failed step keeps no activations
    throw;
  }
  anchor_.mutable_grad() = torch::Tensor();
  for (auto& kept : kept_) kept = {};
  return loss.item<double>();
}

torch::Tensor ManualSplit::forward(const torch::Tensor& input) {
  model();
  torch::NoGradGuard no_grad;
  bytes_h2d_ += input.nbytes();
  ComputeCopies::Scope bound(copies_);
  return run_blocks(config_.precision.cast_input(input.to(devices_.front())), {}, nullptr);
}

void ManualSplit::optimizer_step() {
  auto& params = model().parameters();
  torch::NoGradGuard no_grad;
  // fp16: the gradients carry the loss scale; a step with an inf or nan in any of them is skipped.
  auto trained = trained_tensors();
  std::vector<torch::Tensor> grads;
  for (auto& t : trained) grads.push_back(t.grad());
  const bool finite = scaler_.unscale(grads);
  scaler_.update(finite);
  if (!finite) {
    for (auto& t : trained) t.mutable_grad() = torch::Tensor();
    return;
  }
  if (options_.sync_replicas) {
    for (auto& r : replicas_) {
      const auto& g = r.value.grad();
      if (!g.defined()) continue;
      add_grad(params[r.param].tensor.mutable_grad(), transfer(g, devices_[home_stage_[r.param]]));
    }
  }
  for (size_t p = 0; p < params.size(); ++p) {
    auto t = params[p].tensor;
    step_and_release_grad(config_.optimizer, t, optimizer_state_[p]);
  }
  for (auto& s : shards_) {
    step_and_release_grad(config_.optimizer, s.weight, s.weight_state);
    if (s.bias.defined()) step_and_release_grad(config_.optimizer, s.bias, s.bias_state);
  }
  for (auto& r : replicas_) {
    if (options_.sync_replicas) {
      r.value.copy_(params[r.param].tensor.detach());
      if (r.value.device() != params[r.param].tensor.device()) count_interconnect(r.value.nbytes());
    }
    r.value.mutable_grad() = torch::Tensor();
  }
}

NamedTensors ManualSplit::gradients() {
  const auto& params = model().parameters();
  NamedTensors out;
  for (size_t p = 0; p < params.size(); ++p) {
    const auto& t = params[p].tensor;
    torch::Tensor g;
    if (static_cast<int64_t>(p) == head_weight_ || static_cast<int64_t>(p) == head_bias_) {
      std::vector<torch::Tensor> parts;
      for (auto& s : shards_) {
        const auto& st = static_cast<int64_t>(p) == head_weight_ ? s.weight : s.bias;
        parts.push_back(st.grad().defined() ? st.grad().to(torch::kCPU, false, /*copy=*/true) : torch::zeros(st.sizes()));
      }
      g = torch::cat(parts, 0);
    } else {
      g = t.grad().defined() ? t.grad().detach().to(torch::kCPU, false, /*copy=*/true) : torch::zeros(t.sizes());
      // The full gradient includes the replicas' contributions (summed into the home at the step).
      if (options_.sync_replicas)
        for (auto& r : replicas_)
          if (r.param == static_cast<int64_t>(p) && r.value.grad().defined()) g = g + r.value.grad().cpu();
    }
    out.emplace_back(params[p].name, scaler_.unscaled(g));  // what the step applies
  }
  return out;
}

NamedTensors ManualSplit::parameters() {
  auto out = host_copies(model().parameters());
  for (auto p : {head_weight_, head_bias_}) {  // a split head's are its shards, end to end
    if (p < 0) continue;
    std::vector<torch::Tensor> parts;
    for (auto& s : shards_) parts.push_back((p == head_weight_ ? s.weight : s.bias).detach().cpu());
    out[p].second = torch::cat(parts, 0);
  }
  return out;
}

NamedTensors ManualSplit::buffers() { return host_copies(model().buffers()); }

NamedTensors ManualSplit::training_state() {
  const auto& params = model().parameters();
  for (const auto& d : devices_) device::synchronize(d);
  auto host = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, false, /*copy=*/true); };
  NamedTensors out;
  for (size_t p = 0; p < params.size(); ++p) {
    const auto& name = params[p].name;
    const bool split = static_cast<int64_t>(p) == head_weight_ || static_cast<int64_t>(p) == head_bias_;
    if (!split) {
      STRATA_CHECK(!params[p].tensor.grad().defined(),
                   name_ << ": training_state() after optimizer_step, with no gradient accumulated ('" << name << "' has one)");
      out.emplace_back(name, host(params[p].tensor));
      append_optimizer_state(out, name, optimizer_state_[p]);
      continue;
    }
    // The shards end to end, their moments likewise; one step count (they step together).
    const bool weight = static_cast<int64_t>(p) == head_weight_;
    std::vector<torch::Tensor> values, m, v;
    for (auto& sh : shards_) {
      const auto& t = weight ? sh.weight : sh.bias;
      const auto& st = weight ? sh.weight_state : sh.bias_state;
      STRATA_CHECK(!t.grad().defined(), name_ << ": training_state() after optimizer_step, with no gradient accumulated");
      values.push_back(host(t));
      if (st.exp_avg.defined()) m.push_back(host(st.exp_avg));
      if (st.exp_avg_sq.defined()) v.push_back(host(st.exp_avg_sq));
    }
    OptimizerState whole;
    const auto& first = weight ? shards_.front().weight_state : shards_.front().bias_state;
    whole.step = first.step;
    if (m.size() == shards_.size()) whole.exp_avg = torch::cat(m, 0);
    if (v.size() == shards_.size()) whole.exp_avg_sq = torch::cat(v, 0);
    out.emplace_back(name, torch::cat(values, 0));
    append_optimizer_state(out, name, whole);
  }
  for (auto& b : buffers()) out.push_back(std::move(b));
  out.emplace_back("loss_scaler", scaler_.state());
  return out;
}

void ManualSplit::load_training_state(const NamedTensors& state) {
  const auto& params = model().parameters();
  // A split head's parameters keep no memory here: checked at their full shape (a view of one
  // element, expanded), read from the state by rows.
  std::vector<models::NamedParameter> shaped = params;
  for (auto p : {head_weight_, head_bias_}) {
    if (p < 0) continue;
    const bool weight = p == head_weight_;
    auto sizes = (weight ? shards_.front().weight : shards_.front().bias).sizes().vec();
    sizes[0] = shards_.back().hi;
    shaped[static_cast<size_t>(p)].tensor = torch::zeros({1}).expand(sizes);
  }
  // Everything checked before anything changes: a bad state leaves this strategy as it was.
  const auto index = checked_training_state(name_, shaped, model().buffers(), state);
  for (const auto& d : devices_) device::synchronize(d);
  torch::NoGradGuard no_grad;
  // Rows [lo, lo + rows) of `name` (whole shape `full`) onto `device`, in fp32.
  auto rows_of = [&](const std::string& name, const std::vector<int64_t>& full, int64_t lo, int64_t rows,
                     const torch::Device& device) {
    int64_t row = 1;  // elements of one row
    for (size_t d = 1; d < full.size(); ++d) row *= full[d];
    auto sizes = full;
    sizes[0] = rows;
    return index.range(name, lo * row, (lo + rows) * row).view(sizes).to(device, torch::kFloat).clone();
  };
  auto state_of = [&](const std::string& name, const std::vector<int64_t>& full, int64_t lo, int64_t rows,
                      const torch::Device& device) {
    OptimizerState st;
    if (index.has(name + "/exp_avg")) st.exp_avg = rows_of(name + "/exp_avg", full, lo, rows, device);
    if (index.has(name + "/exp_avg_sq")) st.exp_avg_sq = rows_of(name + "/exp_avg_sq", full, lo, rows, device);
    if (auto n = index.find(name + "/step"); n.defined()) st.step = n.item<int64_t>();
    return st;
  };
  for (size_t p = 0; p < params.size(); ++p) {
    const auto& name = params[p].name;
    const auto full = shaped[p].tensor.sizes().vec();
    if (static_cast<int64_t>(p) == head_weight_ || static_cast<int64_t>(p) == head_bias_) {
      const bool weight = static_cast<int64_t>(p) == head_weight_;
      for (auto& sh : shards_) {
        auto& t = weight ? sh.weight : sh.bias;
        t.detach().copy_(rows_of(name, full, sh.lo, sh.hi - sh.lo, sh.device));
        (weight ? sh.weight_state : sh.bias_state) = state_of(name, full, sh.lo, sh.hi - sh.lo, sh.device);
      }
      continue;
    }
    auto t = params[p].tensor.detach();
    t.copy_(index.whole(name, full));
    optimizer_state_[p] = optimizer_state_from(index, name, full, t.device());
  }
  for (auto& r : replicas_) r.value.detach().copy_(params[r.param].tensor.detach());  // as after a step
  load_buffers(model().buffers(), index);
  if (auto sc = index.find("loss_scaler"); sc.defined()) scaler_.restore(sc);
  for (const auto& d : devices_) device::synchronize(d);
}

double ManualSplit::max_replica_drift() {
  double drift = 0.0;
  for (auto& r : replicas_) {
    auto home = model().parameters()[r.param].tensor.detach().cpu();
    drift = std::max(drift, (r.value.detach().cpu() - home).abs().max().item<double>());
  }
  return drift;
}

std::vector<std::pair<std::string, torch::Device>> ManualSplit::placement() {
  std::vector<std::pair<std::string, torch::Device>> out;
  const auto& params = model().parameters();
  for (int64_t b = 0; b < model().num_blocks(); ++b) {
    for (auto p : model().block_parameters()[b]) {
      torch::Device where = params[p].tensor.device();
      for (auto& r : replicas_)
        if (r.param == p && r.stage == stage_of_[b]) where = r.value.device();
      out.emplace_back(std::to_string(b) + ":" + params[p].name, where);
    }
  }
  return out;
}

Stats ManualSplit::stats() {
  Stats s;
  s.bytes_h2d = bytes_h2d_;
  s.loss_scale = scaler_.scale();
  s.skipped_steps = scaler_.skipped_steps();
  s.bytes_interconnect = bytes_interconnect_;
  const auto& params = model().parameters();
  auto add = [&](const torch::Device& d, int64_t bytes) {
    auto& mem = s.devices[d.str()];
    mem.resident_param_bytes += bytes;
    mem.peak_param_bytes += bytes;
  };
  for (const auto& p : params) add(p.tensor.device(), p.tensor.nbytes());
  for (const auto& r : replicas_) add(r.value.device(), r.value.nbytes());
  for (const auto& sh : shards_) add(sh.device, sh.weight.nbytes() + (sh.bias.defined() ? sh.bias.nbytes() : 0));
  for (auto& [name, mem] : s.devices) {
    const auto alloc = device::allocator_stats(torch::Device(name));
    mem.peak_allocated = alloc.peak_allocated;
    mem.peak_reserved = alloc.peak_reserved;
  }
  return s;
}

void ManualSplit::reset_stats() {
  bytes_h2d_ = bytes_interconnect_ = 0;
  for (const auto& d : devices_) device::reset_peak_stats(d);
}

static const OptionDocumenter manual_split_docs(
    {"manual_split"},
    {{"balance", "blocks per stage, or auto", "how blocks are cut into stages (auto: by `weigh`)"},
     {"devices", "device list", "one device per stage (none given: the config's devices)"},
     {"stages", "0..", "stages on the main device when no devices are given (0: 2, 1 for one block, or balance's count)"},
     {"weigh", "params, memory", "what automatic balance weighs"},
     {"activation_batch", "1..", "with weigh=memory: the batch the activation estimate is for"},
     {"classifier_shards", "1..", "the linear head split by columns into this many shards"},
     {"sync_replicas", "0/1", "0 skips the tied replicas' gradient sum and re-sync (the drift a test must see)",
      true}});

STRATA_REGISTER_STRATEGY("manual_split",
                         "blocks split over stage devices (balance by bytes), tied weights as home + replica",
                         [](const StrategyConfig& c) {
                           return std::make_unique<ManualSplit>("manual_split", c, ManualSplitOptions::parse(c.options));
                         });

}  // namespace strata
