#include "correctness/support/parity.h"

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include "models/check.h"
#include "models/text.h"
#include "strategies/checkpoint.h"
#include "strategies/distributed/process_group.h"
#include "strategies/state_files.h"

namespace strata::correctness {

std::string ParityCase::to_string() const {
  std::ostringstream out;
  out << model_text() << " batch=" << batch_size << " seed=" << seed << " steps=" << steps;
  if (ignore_targets) out << " ignore=1";
  if (trainer_order) out << " order=trainer";
  if (!precision.is_fp32()) out << " precision=" << precision.to_string();
  if (resume_at > 0) out << " resume=" << resume_from << "@" << resume_at;
  for (const auto& [k, v] : options) out << " " << k << "=" << v;
  return out.str();
}

ParityCase ParityCase::parse(const std::string& text) {
  const auto begin = text.find_first_not_of(' ');
  STRATA_CHECK(begin != std::string::npos, "an empty parity case");
  const auto end = models::end_of_call(text, begin);
  STRATA_CHECK(end != std::string::npos, "parity case '" << text << "' does not start with a model(...)");
  ParityCase c;
  const auto model = text.substr(begin, end - begin);
  if (model.rfind("chain(", 0) == 0)
    c.chain = ChainSpec::parse(model);
  else
    c.model = models::ModelConfig::parse(model);
  std::istringstream in(text.substr(end));
  std::string item;
  while (in >> item) {
    const auto eq = item.find('=');
    STRATA_CHECK(eq != std::string::npos && eq > 0, "parity case '" << text << "': '" << item << "' is not key=value");
    const auto key = item.substr(0, eq), value = item.substr(eq + 1);
    models::Call field{"parity case", {{key, value}}};
    if (key == "batch")
      c.batch_size = models::int_arg(field, key);
    else if (key == "seed")
      c.seed = static_cast<uint64_t>(models::int_arg(field, key));
    else if (key == "steps")
      c.steps = static_cast<int>(models::int_arg(field, key));
    else if (key == "ignore")
      c.ignore_targets = models::int_arg(field, key) != 0;
    else if (key == "precision")
      c.precision = PrecisionPolicy::parse(value);
    else if (key == "resume") {
      const auto at = value.rfind('@');
      STRATA_CHECK(at != std::string::npos && at > 0, "parity case '" << text << "': resume=" << value
                                                                      << " is not STRATEGY@STEP");
      c.resume_from = value.substr(0, at);
      c.resume_at = static_cast<int>(models::int_arg(models::Call{"parity case", {{key, value.substr(at + 1)}}}, key));
      STRATA_CHECK(c.resume_at >= 1, "parity case '" << text << "': resume=" << value << " must resume at step 1 or later");
    }
    else if (key == "order") {
      STRATA_CHECK(value == "trainer" || value == "checker",
                   "parity case '" << text << "': order=" << value << " is not 'trainer' or 'checker'");
      c.trainer_order = value == "trainer";
    }
    else
      c.options[key] = value;
  }
  return c;
}

models::BlockModel ParityCase::build() const {
  if (own) return own->build(seed);
  return chain ? chain->build(seed) : models::build_model(model, seed);
}

models::Batch ParityCase::batch(int step, int micro) const {
  const uint64_t s = seed + 1000 + static_cast<uint64_t>(step) + 7919 * static_cast<uint64_t>(micro);
  auto b = own ? own->batch(batch_size, s) : chain ? chain->make_batch(batch_size, s) : models::make_batch(model, batch_size, s);
  if (ignore_targets) {
    auto gen = at::detail::createCPUGenerator(s ^ 0x16A0BEULL);
    auto drop = torch::randint(3, {b.target.numel()}, gen, torch::TensorOptions().dtype(torch::kLong)) == 0;
    drop[0] = false;  // never every target: a mean over none is undefined
    b.target = b.target.reshape({-1}).masked_fill(drop, models::kIgnoreIndex).view(b.target.sizes());
  }
  return b;
}

namespace {

double max_abs(const torch::Tensor& t) { return t.numel() == 0 ? 0.0 : t.abs().max().item<double>(); }

std::string compare_one(const std::string& what, const std::string& name, const torch::Tensor& actual,
                        const std::vector<torch::Tensor>& baselines, const torch::Tensor& reference, double scale,
                        double carried, double* bound_out, double unit_roundoff) {
  std::ostringstream out;
  if (actual.sizes() != reference.sizes()) {
    out << what << " '" << name << "': shape " << actual.sizes() << " but the baseline has " << reference.sizes();
    return out.str();
  }
  const auto r = reference.to(torch::kCPU, torch::kDouble);
  const auto a = actual.to(torch::kCPU, torch::kDouble);
  if (a.numel() > 0 && !torch::isfinite(a).all().item<bool>()) {
    out << what << " '" << name << "' has non-finite values";
    return out.str();
  }
  double baseline_error = 0.0;
  for (const auto& b : baselines) baseline_error = std::max(baseline_error, max_abs(b.to(torch::kCPU, torch::kDouble) - r));
  const double error = max_abs(a - r);
  const double bound = kReferenceErrorMultiple * baseline_error + kRoundingFloorUlps * unit_roundoff * scale +
                       kFp32SmallestNormal + carried;
  if (bound_out) *bound_out = bound;
  if (error <= bound) return {};
  out << what << " '" << name << "': max|strategy - fp64|=" << error << " > bound " << bound << " ("
      << (unit_roundoff == kFp32UnitRoundoff ? "fp32" : "same-precision") << " baseline error " << baseline_error
      << ", scale " << scale;
  if (carried > 0) out << ", carried from gradient bounds " << carried;
  out << ")";
  return out.str();
}

// The parity check needs exact fp32: TF32 is off for its duration and restored on any exit.
struct NoTf32 {
  bool saved = at::globalContext().allowTF32CuBLAS();
  NoTf32() { at::globalContext().setAllowTF32CuBLAS(false); }
  ~NoTf32() { at::globalContext().setAllowTF32CuBLAS(saved); }
};

// Every floating-point parameter and buffer moved by about one ulp of the compute dtype (relative
// 2u), each in a random direction.
void move_by_an_ulp(models::BlockModel& model, uint64_t seed, double unit_roundoff) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  auto move = [&](torch::Tensor t) {
    if (!t.is_floating_point() || t.numel() == 0) return;
    auto sign = torch::randint(2, t.sizes(), gen, t.options()) * 2 - 1;
    t.mul_(sign * (2.0 * unit_roundoff) + 1);
  };
  for (const auto& p : model.parameters()) move(p.tensor);
  for (const auto& b : model.buffers()) move(b.tensor);
}

models::BlockModel in_float64(models::BlockModel model) {
  // Module::to swaps data in place: tied parameters and shared buffers stay one tensor each.
  for (const auto& block : model.blocks()) block->to(torch::kDouble);
  return model;
}

models::Batch in_float64(const models::Batch& b) {
  return {b.input.is_floating_point() ? b.input.to(torch::kDouble) : b.input, b.target};
}

NamedTensors as_named(const std::string& name, double value) {
  return {{name, torch::tensor({value}, torch::kDouble)}};
}

Scales own_scales(const NamedTensors& reference) {
  Scales out;
  for (const auto& [name, t] : reference) out.push_back(max_abs(t));
  return out;
}

// A gradient's scale: the largest gradient of any parameter that shares a block with it.
Scales gradient_scales(const models::BlockModel& structure, const NamedTensors& reference) {
  const auto own = own_scales(reference);
  Scales out(own.size(), 0.0);
  for (const auto& uses : structure.block_parameters()) {
    double block_max = 0.0;
    for (auto p : uses) block_max = std::max(block_max, own[p]);
    for (auto p : uses) out[p] = std::max(out[p], block_max);
  }
  return out;
}

bool all_zero(const torch::Tensor& t) { return t.numel() == 0 || !t.ne(0).any().item<bool>(); }

// Which parameters a step moved at all: a difference of kind rather than of size, which a bound
// cannot see where it must allow for a gradient near zero (an AdamW update is about lr whatever the
// gradient's size). Two rules, each holding for any strategy that is right:
// - AdamW's decoupled weight decay moves every element that is not zero (by lr x decay of itself,
//   which fp32 resolves), whatever its gradient; a gradient near zero may round to zero in one run
//   and not in another, so a parameter that is all zeros (a bias as initialised) is left out. So a
//   parameter with a non-zero element that the reference and every baseline moved must have moved
//   (else its update was skipped). The baselines too, as they train under the policy and skip a
//   step with it (fp16's overflow);
// - a parameter the reference left exactly as it was, whose gradient has been exactly zero in it
//   and in the strategy at every step so far, must stay as it was: the reference had no gradient
//   for it (an unused one) and skipped it, as autograd and PyTorch's optimizers do, where stepping
//   it with a zero gradient moves it by weight decay. Every step so far, as a gradient of rounding
//   noise in an earlier step (a bias before a BatchNorm) leaves momentum that moves it later, where
//   the reference's gradient was exactly zero throughout.
struct StepEnds {
  NamedTensors before, after;
};
std::string moved_as_reference(bool adamw_decays, const StepEnds& reference, const std::vector<NamedTensors>& base_before,
                               const std::vector<NamedTensors>& base_after, const StepEnds& strategy,
                               const NamedTensors& ref_grads, const NamedTensors& grads,
                               std::map<std::string, bool>& zero_so_far) {
  std::map<std::string, torch::Tensor> grad;
  for (const auto& [name, t] : grads) grad[name] = t;
  for (const auto& [name, t] : ref_grads) {  // a gradient present in both, zero in both, at every step
    const auto g = grad.find(name);
    const bool zero = g != grad.end() && all_zero(t) && all_zero(g->second);
    zero_so_far.emplace(name, true).first->second &= zero;
  }
  const size_t n = reference.after.size();
  auto sized = [&](const NamedTensors& list) { return list.size() == n; };
  if (!sized(reference.before) || !sized(strategy.before) || !sized(strategy.after) ||
      !std::all_of(base_before.begin(), base_before.end(), sized) || !std::all_of(base_after.begin(), base_after.end(), sized))
    return {};  // the bounds' comparison names it
  // Each run's lists are host copies from that run: same dtype and device before and after.
  auto moved = [](const NamedTensors& before, const NamedTensors& after, size_t i) {
    return !torch::equal(before[i].second, after[i].second);
  };
  for (size_t i = 0; i < n; ++i) {
    const auto& name = reference.after[i].first;
    if (!torch::isfinite(strategy.after[i].second).all().item<bool>()) continue;  // the bounds' check names it
    const bool ref_moved = moved(reference.before, reference.after, i);
    const bool strategy_moved = moved(strategy.before, strategy.after, i);
    auto every_baseline_moved = [&] {
      for (size_t k = 0; k < base_before.size(); ++k)
        if (!moved(base_before[k], base_after[k], i)) return false;
      return true;
    };
    if (adamw_decays && ref_moved && !strategy_moved && !all_zero(strategy.before[i].second) && every_baseline_moved())
      return "parameter '" + name + "': the baselines' AdamW step moved it (its weight decay alone would) and the "
             "strategy's left it exactly as it was (an update skipped)";
    const auto zero = zero_so_far.find(name);
    if (!ref_moved && strategy_moved && zero != zero_so_far.end() && zero->second) {
      std::ostringstream out;
      out << "parameter '" << name << "': no gradient in this step (zero in the baseline and the strategy at every "
          << "step so far), and the baseline's step left it as it was, as autograd's optimizers skip a parameter "
          << "without a gradient; the "
          << "strategy's moved it by up to "
          << max_abs(strategy.after[i].second.to(torch::kCPU, torch::kDouble) -
                     strategy.before[i].second.to(torch::kCPU, torch::kDouble))
          << " (stepped with a zero gradient: weight decay, momentum)";
      return out.str();
    }
  }
  return {};
}

// The slices' share of a gradient's rounding. A strategy that splits the batch (pipeline
// micro-batches, data-parallel ranks) rounds each slice's gradient and their running sum at the
// slices' magnitudes, which can be far above the whole batch's gradient where the slices cancel (a
// head's bias over two classes: each sample's pull is ~1/batch, their sum 100 times smaller). The
// baselines sum the batch in one reduction and cannot sample that, so the floor takes the slices'
// size: `sizes` (one tensor per parameter, in canonical order) gains, for every element, the sum
// of |slice's gradient| over the slices of `batch`. `model` is an fp64 copy of the case's model,
// set first to the reference's parameters and buffers as they were before its step on `batch`, so
// the slices are those of the reference's own point; each slice's gradient is that of its
// loss_sum over the whole batch's target count, as the strategies split it (a slice without a
// counted target has none).
// `model` (the fp64 copy) set to the reference's point: its parameters and buffers.
void set_to(models::BlockModel& model, const NamedTensors& params, const NamedTensors& buffers) {
  const auto& p = model.parameters();
  const auto& b = model.buffers();
  STRATA_CHECK(p.size() == params.size() && b.size() == buffers.size(),
               "check_parity: the reference reports " << params.size() << " parameters and " << buffers.size()
                                                      << " buffers, a fresh build of the model " << p.size() << " and "
                                                      << b.size());
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < p.size(); ++i) p[i].tensor.copy_(params[i].second);
  for (size_t i = 0; i < b.size(); ++i) b[i].tensor.copy_(buffers[i].second);
}

void add_slice_sizes(models::BlockModel& model, const torch::Device& device, const NamedTensors& params,
                     const NamedTensors& buffers, const models::Batch& batch, int64_t slices, NamedTensors& sizes) {
  set_to(model, params, buffers);
  const auto& p = model.parameters();
  if (sizes.empty())
    for (const auto& np : p) sizes.emplace_back(np.name, torch::zeros(np.tensor.sizes(), torch::kDouble));
  std::vector<torch::Tensor> trainable;
  std::vector<size_t> index;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i].tensor.requires_grad()) {
      trainable.push_back(p[i].tensor);
      index.push_back(i);
    }
  if (trainable.empty()) return;
  const int64_t n = batch.size();
  const auto counted = static_cast<double>(models::BlockModel::count_targets(batch.target));
  for (int64_t k = 0; k < slices; ++k) {
    const int64_t lo = n * k / slices, hi = n * (k + 1) / slices;
    const auto target = batch.target.narrow(0, lo, hi - lo);
    if (hi == lo || models::BlockModel::count_targets(target) == 0) continue;
    auto x = batch.input.narrow(0, lo, hi - lo).to(device);
    for (const auto& block : model.blocks()) x = block->forward(x);
    const auto loss = model.loss_sum(x, target.to(device)) / counted;
    const auto grads = torch::autograd::grad({loss}, trainable, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    for (size_t j = 0; j < grads.size(); ++j)
      if (grads[j].defined()) sizes[index[j]].second.add_(grads[j].detach().to(torch::kCPU, torch::kDouble).abs());
  }
}

// The largest output the model gives for `batch` at the reference's point (`params`, `buffers`),
// in float64: what the loss is computed from. A loss that cancels (a log-sum-exp over logits of
// about 2 less the target's logit, leaving 0.024) rounds at the logits' size, not its own.
double output_size(models::BlockModel& model, const torch::Device& device, const NamedTensors& params,
                   const NamedTensors& buffers, const models::Batch& batch) {
  set_to(model, params, buffers);
  torch::NoGradGuard no_grad;
  auto x = batch.input.to(device);
  for (const auto& block : model.blocks()) x = block->forward(x);
  return x.is_floating_point() ? max_abs(x) : 0.0;
}

Scales larger_of(Scales a, const Scales& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
  return a;
}

template <typename F>
std::vector<NamedTensors> of_each(std::vector<std::unique_ptr<Strategy>>& runs, F&& f) {
  std::vector<NamedTensors> out;
  for (auto& r : runs) out.push_back(f(*r));
  return out;
}

}  // namespace

std::string compare_to_reference(const std::string& what, const NamedTensors& actual,
                                 const std::vector<NamedTensors>& baselines, const NamedTensors& reference,
                                 const Scales& scales, const std::vector<double>& carried, std::vector<double>* bounds,
                                 double unit_roundoff) {
  if (bounds) bounds->assign(reference.size(), 0.0);
  auto count_mismatch = [&](const NamedTensors& list, const std::string& whose) {
    std::ostringstream out;
    out << what << ": " << list.size() << " tensors from the " << whose << " but the reference has " << reference.size();
    return out.str();
  };
  if (actual.size() != reference.size()) return count_mismatch(actual, "strategy");
  for (const auto& b : baselines)
    if (b.size() != reference.size()) return count_mismatch(b, "baseline");
  for (size_t i = 0; i < reference.size(); ++i) {
    const auto& name = reference[i].first;
    if (actual[i].first != name)
      return what + " #" + std::to_string(i) + ": name '" + actual[i].first + "' but the baseline has '" + name + "'";
    std::vector<torch::Tensor> fp32;
    for (const auto& b : baselines) fp32.push_back(b[i].second);
    auto msg = compare_one(what, name, actual[i].second, fp32, reference[i].second, scales.at(i),
                           carried.empty() ? 0.0 : carried.at(i), bounds ? &(*bounds)[i] : nullptr, unit_roundoff);
    if (!msg.empty()) return msg;
  }
  return {};
}

// The state of `from` saved to checkpoint files, read back and loaded into `to`, attached to the
// case's model: a resume as a trainer does it, between processes.
static std::unique_ptr<Strategy> resumed(Strategy& from, std::unique_ptr<Strategy> to, const ParityCase& c) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("strata-resume-" + std::to_string(::getpid()) + "-" + std::to_string(c.seed));
  state_files::remove_tree(dir.string());
  state_files::Manifest m;
  m.model = c.model_text();
  m.strategy = from.name();
  m.step = c.resume_at;
  const auto saved = state_files::save(dir.string(), m, {{"state.pt", from.training_state()}});
  const auto state = state_files::load_file(saved, state_files::read_manifest(saved), "state.pt");
  state_files::remove_tree(dir.string());
  to->attach(c.build());
  to->load_training_state(state);
  return to;
}

ParityResult check_parity(const StrategyMaker& make, const ParityCase& c, const torch::Device& device,
                          const ResumeAcross* across) {
  NoTf32 no_tf32;
  const auto structure = c.build();
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    StrategyConfig config;
    config.device = device;
    config.optimizer.kind = kind;
    config.optimizer.lr = kind == OptimizerKind::sgd ? 0.05 : 1e-3;
    config.optimizer.eps = kParityAdamwEps;
    const StrategyConfig fp64_config = config;  // the reference: float64 model, no policy
    config.precision = c.precision;
    const StrategyConfig base_config = config;
    config.options = c.options;
    const double u = unit_roundoff(c.precision.compute);

    // The strategy first: a combination it refuses is named by its own Error, not by a baseline's.
    STRATA_CHECK(c.resume_at == 0 || (c.resume_at < c.steps && !c.resume_from.empty()),
                 "parity case: resume at step " << c.resume_at << " of " << c.steps << " from '" << c.resume_from << "'");
    std::unique_ptr<Strategy> strategy;
    if (c.resume_at > 0) {  // the steps before it in another strategy
      StrategyConfig first = base_config;
      first.options = Registry::required_options(c.resume_from);
      strategy = across ? across->first(first) : Registry::create(c.resume_from, first);
    } else {
      strategy = make(config);
    }
    strategy->attach(c.build());
    auto reference = Registry::create("baseline", fp64_config);
    reference->attach(in_float64(c.build()));
    std::vector<std::unique_ptr<Strategy>> baselines;
    for (int k = 0; k <= kPerturbedReferences; ++k) {
      auto model = c.build();
      if (k > 0) move_by_an_ulp(model, c.seed * 7919 + static_cast<uint64_t>(k), u);
      baselines.push_back(Registry::create("baseline", base_config));
      baselines.back()->attach(std::move(model));
    }

    // An fp64 copy of the model for the slices' and samples' sizes (add_slice_sizes), made where
    // first needed.
    std::optional<models::BlockModel> slicer;
    auto model_for_slices = [&]() -> models::BlockModel& {
      if (!slicer) {
        slicer.emplace(in_float64(c.build()));
        for (const auto& block : slicer->blocks()) block->to(device);
      }
      return *slicer;
    };

    const std::string opt = kind == OptimizerKind::sgd ? "sgd" : "adamw";
    auto fail = [&](int step, const std::string& msg) {
      ParityResult r;
      r.ok = false;
      r.message = opt + " step " + std::to_string(step) + ": " + msg;
      return r;
    };
    auto compare = [&](const std::string& what, auto get, auto scales_of) {
      const auto expected = get(*reference);
      return compare_to_reference(what, get(*strategy), of_each(baselines, get), expected, scales_of(expected), {},
                                  nullptr, u);
    };
    // What a gradient error within its bound may do to the parameters: an optimizer step moves a
    // parameter by lr x gain x (gradient error) at most (gain: 1 / (1 - momentum) for SGD's
    // momentum sum; 1 / eps for AdamW, whose update g / (|g| + eps) changes by at most 1 / eps per unit of g), and steps add up.
    const double gain = kind == OptimizerKind::sgd ? 1.0 / (1.0 - config.optimizer.momentum) : 1.0 / config.optimizer.eps;
    std::vector<double> carried, gradient_bounds;
    // A strategy over several ranks: every rank runs the references itself, and all must take
    // the same branch (a mismatch seen on one ends the check on all, or the others would wait in
    // collectives the first never starts); so too every rank of a resume across processes.
    auto settle = [&](std::string msg) {
      if (strategy->world_size() <= 1 && !across) return msg;
      auto seen = torch::tensor({msg.empty() ? 0.0 : 1.0}, torch::kDouble);
      distributed::group_for(torch::Device(torch::kCPU))->all_reduce(seen, /*max=*/true).wait();
      if (seen.item<double>() > 0 && msg.empty()) msg = "another rank found a mismatch";
      return msg;
    };
    auto parameters = [](Strategy& s) { return s.parameters(); };
    auto gradients = [](Strategy& s) { return s.gradients(); };
    auto buffers = [](Strategy& s) { return s.buffers(); };
    auto by_block = [&](const NamedTensors& r) { return gradient_scales(structure, r); };

    // Each step's parameters before it, for which the step moved (a strategy may update during
    // backward); at first, the initial ones.
    StepEnds ref_ends{reference->parameters(), {}}, ends{strategy->parameters(), {}};
    auto base_before = of_each(baselines, parameters), base_after = base_before;
    std::map<std::string, bool> zero_so_far;  // by parameter: its gradient exactly zero at every step so far
    if (auto msg = settle(compare_to_reference("initial parameter", ends.before, base_before, ref_ends.before,
                                               own_scales(ref_ends.before), {}, nullptr, u));
        !msg.empty())
      return fail(0, msg);
    for (int step = 0; step < c.steps; ++step) {
      if (step == c.resume_at && c.resume_at > 0) {
        if (across) {
          auto to = make(config);
          to->attach(c.build());
          across->hand_over(*strategy, *to);
          strategy = std::move(to);
        } else {
          strategy = resumed(*strategy, make(config), c);
        }
      }
      // The second step accumulates the gradients of two batches before its optimizer step, as the
      // interface promises, wherever the strategy accumulates (the others refuse it; tested apart).
      // Across processes, where ranks run other strategies, accumulated only where all of them do:
      // every rank must take the same steps.
      const bool accumulates =
          across ? distributed::on_every_rank(*distributed::group_for(torch::Device(torch::kCPU)),
                                              strategy->accumulates_gradients(), torch::Device(torch::kCPU))
                 : strategy->accumulates_gradients();
      const int micro_batches = step == 1 && accumulates ? 2 : 1;
      NamedTensors slice_sizes;
      // The step's batches in float64 and the reference's buffers before each (its parameters
      // before the step are ref_ends.before), for the slices' and samples' sizes.
      std::vector<std::pair<models::Batch, NamedTensors>> points;
      const auto skipped_before = strategy->stats().skipped_steps;  // changed by optimizer_step alone
      for (int micro = 0; micro < micro_batches; ++micro) {
        const auto batch = c.batch(step, micro);
        const int64_t slices = std::min<int64_t>(strategy->batch_slices(batch.size()), batch.size());
        points.emplace_back(in_float64(batch), reference->buffers());
        const auto generators = random_states(device);
        const double expected = reference->train_step(points.back().first);
        if (const auto drawn = drawn_since(generators); drawn.cpu.defined() || drawn.device.defined())
          STRATA_FAIL("check_parity: the model draws random numbers in its training step (the "
                      << (drawn.cpu.defined() ? std::string("CPU") : device.str())
                      << " generator moved during the reference's step; dropout?). Each run compared draws "
                         "other numbers, so their losses and gradients differ by more than rounding whether the "
                         "strategy is right or wrong: check the model with those draws off (e.g. dropout "
                         "probability 0); a strategy that recomputes blocks replays their draws in training");
        std::vector<NamedTensors> base_losses;
        for (auto& b : baselines) base_losses.push_back(as_named("loss", b->train_step(batch)));
        const double actual = strategy->train_step(batch);
        // A trainer's order: optimizer_step straight after the step's last train_step, before any
        // of the checker's own work (whose allocations may wait for the whole device, copies the
        // strategy left in flight included), so nothing in between waits for them.
        if (c.trainer_order && micro + 1 == micro_batches) strategy->optimizer_step();
        const auto ref_loss = as_named("loss", expected);
        const Scales loss_scale{std::max(std::abs(expected), output_size(model_for_slices(), device, ref_ends.before,
                                                                         points.back().second, points.back().first))};
        if (auto msg = settle(
                compare_to_reference("loss", as_named("loss", actual), base_losses, ref_loss, loss_scale, {}, nullptr, u));
            !msg.empty())
          return fail(step, (micro ? "second accumulated batch: " : "") + msg);
        // After the strategy's step, so that a batch it cannot slice is named by its own Error.
        if (slices > 1)
          add_slice_sizes(model_for_slices(), device, ref_ends.before, points.back().second, points.back().first, slices,
                          slice_sizes);
      }
      // Kept for the movement rules below: the optimizer step zeroes them. In a trainer's order the
      // strategy's are not read (reading them waits for them): the references' stand in for them
      // in the movement rules, and the bounds come from the references alone (the reference
      // against itself: no error, every bound).
      const auto ref_grads = reference->gradients();
      const auto grads = c.trainer_order ? ref_grads : strategy->gradients();
      const auto grad_scales =
          slice_sizes.empty() ? by_block(ref_grads) : larger_of(by_block(ref_grads), by_block(slice_sizes));
      const auto base_grads = of_each(baselines, gradients);
      auto verdict = compare_to_reference("gradient", grads, base_grads, ref_grads, grad_scales, {}, &gradient_bounds, u);
      // The verdict (and bounds) with the floor at the step's samples' summed sizes; unchanged for a
      // model that cannot run one sample alone (BatchNorm).
      auto at_samples_sizes = [&]() {
        try {
          NamedTensors sample_sizes;
          for (const auto& [batch, ref_buffers] : points)
            add_slice_sizes(model_for_slices(), device, ref_ends.before, ref_buffers, batch, batch.size(),
                            sample_sizes);
          verdict = compare_to_reference("gradient", grads, base_grads, ref_grads,
                                         larger_of(grad_scales, by_block(sample_sizes)), {}, &gradient_bounds, u);
        } catch (const std::exception&) {
        }
      };
      if (c.trainer_order) {
        // The samples' sizes too where the model runs a sample alone: the widest bound the
        // default order could give (the verdict is the reference's own against itself).
        at_samples_sizes();
      } else if (!verdict.empty()) {
        // A second look, at the samples' own sizes: where a gradient cancels over the batch, a
        // strategy that forms each sample's share by another route (a softmax split over class
        // shards, other kernels) rounds at those shares' size, which the whole-batch baselines
        // (that happen to round the cancelled sum far more finely) cannot show. The floor then takes
        // the sum over samples of |sample's gradient|, at the reference's point (add_slice_sizes
        // with a slice a sample). A model that cannot run one sample alone (BatchNorm) keeps the
        // first verdict.
        at_samples_sizes();
      }
      if (auto msg = settle(verdict); !msg.empty())
        return fail(step, (micro_batches > 1 ? "accumulated over two batches: " : "") + msg);
      if (!c.trainer_order)
        if (auto msg = settle(compare("buffer", buffers, own_scales)); !msg.empty()) return fail(step, msg);
      reference->optimizer_step();
      for (auto& b : baselines) b->optimizer_step();
      if (!c.trainer_order) strategy->optimizer_step();  // else done right after its train_step
      // fp16: a step the strategy skipped on overflow moves nothing, rightly, whatever the baselines did.
      const bool strategy_skipped = strategy->stats().skipped_steps > skipped_before;
      carried.resize(gradient_bounds.size(), 0.0);
      for (size_t i = 0; i < carried.size(); ++i) {
        // An AdamW update is about lr at most whatever the gradient: a gradient error cannot move
        // it by more, so neither may the allowance (which would hide a skipped update).
        const double moved = config.optimizer.lr * gain * gradient_bounds[i];
        carried[i] += kind == OptimizerKind::adamw ? std::min(moved, config.optimizer.lr) : moved;
      }
      ref_ends.after = reference->parameters();
      ends.after = strategy->parameters();
      base_after = of_each(baselines, parameters);
      const bool decays = kind == OptimizerKind::adamw && config.optimizer.weight_decay > 0 && !strategy_skipped;
      if (auto msg = settle(moved_as_reference(decays, ref_ends, base_before, base_after, ends, ref_grads, grads,
                                               zero_so_far));
          !msg.empty())
        return fail(step, msg);
      if (auto msg = settle(compare_to_reference("parameter", ends.after, base_after, ref_ends.after,
                                                 own_scales(ref_ends.after), carried, nullptr, u));
          !msg.empty())
        return fail(step, msg);
      if (c.trainer_order)  // read after the step, as a trainer would
        if (auto msg = settle(compare("buffer", buffers, own_scales)); !msg.empty()) return fail(step, msg);
      for (auto* run : {&ref_ends, &ends}) run->before = std::move(run->after);
      base_before = std::move(base_after);
    }
  }
  return {};
}

ParityResult check_parity(const std::string& strategy, const ParityCase& c, const torch::Device& device) {
  // A case without options runs a strategy that needs some with their example values.
  return check_parity(
      [&](const StrategyConfig& config) {
        StrategyConfig with = config;
        if (with.options.empty()) with.options = Registry::required_options(strategy);
        return Registry::create(strategy, with);
      },
      c, device);
}

}  // namespace strata::correctness
