#include "strategies/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "models/check.h"

namespace strata {

std::pair<torch::Tensor, KeptGraph> run_keeping_graph(models::Block& block, const torch::Tensor& x) {
  torch::AutoGradMode enable(true);
  auto x_leaf = x.detach().requires_grad_(x.is_floating_point());
  auto y = block.forward(x_leaf);
  KeptGraph graph{torch::autograd::impl::gradient_edge(y), x_leaf, {}};
  for (const auto& p : block.parameters())
    graph.params.push_back(p.requires_grad() ? torch::autograd::impl::gradient_edge(p) : torch::autograd::Edge());
  return {y.detach(), std::move(graph)};
}

KeptGraph recompute_graph(models::Block& block, const torch::Tensor& x) {
  models::GraphOnlyForward graph_only;
  return run_keeping_graph(block, x).second;
}

namespace {

// Takes the gradient arriving at a leaf's accumulator and passes nothing on, so the accumulator
// adds nothing to the leaf's .grad: the gradient is returned, as a captured one would be.
class TakeGradient : public torch::autograd::FunctionPreHook {
 public:
  explicit TakeGradient(std::function<void(const torch::Tensor&)> take) : take_(std::move(take)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) take_(grads[0]);
    return {torch::Tensor()};
  }

 private:
  std::function<void(const torch::Tensor&)> take_;
};

// The TakeGradient hooks added to accumulators for one backward, removed however it ends: an
// accumulator lives as long as some graph holds it, and another graph of the same parameters (a
// kept one, say) may hold it past this backward; a hook left on it would write into a finished
// call's results.
class TakenHooks {
 public:
  ~TakenHooks() {
    for (const auto& [node, hook] : added_) {
      auto& hooks = node->pre_hooks();
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == hook; }),
                  hooks.end());
    }
  }
  void add(const std::shared_ptr<torch::autograd::Node>& node, std::function<void(const torch::Tensor&)> take) {
    auto hook = std::make_unique<TakeGradient>(std::move(take));
    added_.emplace_back(node, hook.get());
    node->add_pre_hook(std::move(hook));
  }

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, const torch::autograd::FunctionPreHook*>> added_;
};

bool is_accumulator(const torch::autograd::Edge& edge) {
  return dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get()) != nullptr;
}

}  // namespace

BlockGradients block_gradients(KeptGraph graph, const std::vector<torch::Tensor>& grad_out, const GradientSink& sink) {
  // What autograd::grad does, started from an edge instead of the output tensor. Only valid edges
  // are asked for: the engine has nothing to return for a frozen parameter.
  BlockGradients out;
  out.params.resize(graph.params.size());
  if (!graph.output.is_valid()) return out;  // the output depends on nothing that trains
  const bool wants_input = graph.input.requires_grad();
  torch::autograd::edge_list wanted;
  if (wants_input) wanted.push_back(torch::autograd::impl::gradient_edge(graph.input));
  std::vector<size_t> param_of;
  for (size_t i = 0; i < graph.params.size(); ++i) {
    if (!graph.params[i].is_valid()) continue;
    wanted.push_back(graph.params[i]);
    param_of.push_back(i);
  }
  if (wanted.empty()) return out;
  auto& engine = torch::autograd::Engine::get_default_engine();
  // With a sink, the gradients are taken at the leaves' accumulators, which the engine runs as soon
  // as each gradient is complete (captured gradients are only handed back once the whole graph has
  // run). Only where every wanted edge is a distinct leaf's accumulator; otherwise they are captured
  // and the sink gets none (its caller has them all at the end).
  bool at_accumulators = static_cast<bool>(sink) && std::all_of(wanted.begin(), wanted.end(), is_accumulator);
  for (size_t a = 0; at_accumulators && a < wanted.size(); ++a)
    for (size_t b = a + 1; b < wanted.size(); ++b)
      if (wanted[a].function == wanted[b].function) at_accumulators = false;
  if (!at_accumulators) {
    auto grads = engine.execute({graph.output}, grad_out, /*keep_graph=*/false, /*create_graph=*/false,
                                /*accumulate_grad=*/false, wanted);
    size_t next = 0;
    if (wants_input) out.input = grads[next++];
    for (auto i : param_of) out.params[i] = grads[next++];
    return out;
  }
  TakenHooks hooks;
  size_t next = 0;
  if (wants_input) hooks.add(wanted[next++].function, [&out](const torch::Tensor& g) { out.input = g; });
  for (auto i : param_of)
    hooks.add(wanted[next++].function, [&out, &sink, i](const torch::Tensor& g) {
      out.params[i] = g;
      sink(i, g);
    });
  // accumulate_grad: the accumulators run (and find nothing to add, their hooks having taken it).
  engine.execute({graph.output}, grad_out, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true,
                 wanted);
  return out;
}

torch::Tensor input_gradient(const KeptGraph& graph, const std::vector<torch::Tensor>& grad_out) {
  if (!graph.output.is_valid() || !graph.input.requires_grad()) return {};
  auto grads = torch::autograd::Engine::get_default_engine().execute(
      {graph.output}, grad_out, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false,
      {torch::autograd::impl::gradient_edge(graph.input)});
  return grads[0];
}

std::vector<torch::Tensor> snapshot_buffers(models::Block& block) {
  std::vector<torch::Tensor> out;
  for (const auto& b : block.buffers()) out.push_back(b.detach().clone());
  return out;
}

BuffersAsBefore::BuffersAsBefore(models::Block& block, const std::vector<torch::Tensor>& before)
    : live_(block.buffers()) {
  STRATA_CHECK(live_.size() == before.size(), "a block's buffers changed in number between forward and its recompute ("
                                                  << before.size() << " then " << live_.size() << ")");
  // Only buffers the forward changed are written: a write bumps the tensor's version, and a fixed
  // table that a graph saved for its backward must keep the version the graph recorded.
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < live_.size(); ++i) {
    if (torch::equal(live_[i], before[i])) {
      after_.emplace_back();
      continue;
    }
    after_.push_back(live_[i].detach().clone());
    live_[i].copy_(before[i]);
  }
}

BuffersAsBefore::~BuffersAsBefore() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < live_.size(); ++i)
    if (after_[i].defined()) live_[i].copy_(after_[i]);
}

namespace {

// Generators exist for the CPU and CUDA devices; a forward elsewhere replays the CPU's only.
std::optional<at::Generator> generator_of(const torch::Device& device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  if (device.is_cuda()) return at::globalContext().defaultGenerator(device);
  return std::nullopt;
}

torch::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state_of(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

RandomStates random_states(const torch::Device& device) {
  RandomStates out;
  out.on = device;
  out.cpu = state_of(*generator_of(torch::kCPU));
  if (!device.is_cpu())
    if (auto gen = generator_of(device)) out.device = state_of(*gen);
  return out;
}

namespace {

// Two generator states (contiguous host byte tensors) equal, compared without dispatching an
// operator: this runs for every recomputed block's forward.
bool same_state(const torch::Tensor& a, const torch::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

}  // namespace

RandomStates drawn_since(RandomStates before) {
  const auto now = random_states(before.on);
  if (before.cpu.defined() && same_state(before.cpu, now.cpu)) before.cpu = torch::Tensor();
  if (before.device.defined() && same_state(before.device, now.device)) before.device = torch::Tensor();
  return before;
}

RandomAsBefore::RandomAsBefore(const RandomStates& before) {
  now_.on = before.on;
  if (before.cpu.defined()) {
    const auto gen = *generator_of(torch::kCPU);
    now_.cpu = state_of(gen);
    set_state_of(gen, before.cpu);
  }
  if (before.device.defined()) {
    try {
      const auto gen = *generator_of(before.on);
      now_.device = state_of(gen);
      set_state_of(gen, before.device);
    } catch (...) {  // no destructor runs for a constructor that throws: put the CPU's back here
      if (now_.cpu.defined()) set_state_of(*generator_of(torch::kCPU), now_.cpu);
      throw;
    }
  }
}

RandomAsBefore::~RandomAsBefore() {
  // Setting a state read from the same generator does not fail; a destructor must not throw.
  try {
    if (now_.cpu.defined()) set_state_of(*generator_of(torch::kCPU), now_.cpu);
    if (now_.device.defined()) set_state_of(*generator_of(now_.on), now_.device);
  } catch (...) {
  }
}

void save_random_states(torch::autograd::AutogradContext* ctx, const RandomStates& states) {
  if (states.cpu.defined()) ctx->saved_data["random_cpu"] = states.cpu;
  if (states.device.defined()) ctx->saved_data["random_device"] = states.device;
}

RandomStates saved_random_states(torch::autograd::AutogradContext* ctx, const torch::Device& device) {
  RandomStates out;
  out.on = device;
  const auto& saved = ctx->saved_data;
  if (auto it = saved.find("random_cpu"); it != saved.end()) out.cpu = it->second.toTensor();
  if (auto it = saved.find("random_device"); it != saved.end()) out.device = it->second.toTensor();
  return out;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The parameters are inputs of the function, so its backward hands their gradients to autograd,
// which accumulates them like any other use (no reentrant backward into .grad).
struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static torch::Tensor forward(AutogradContext* ctx, models::Block* block, torch::Tensor x,
                               torch::TensorList params) {
    ctx->saved_data["block"] = reinterpret_cast<int64_t>(block);
    variable_list saved{x};
    for (auto& b : snapshot_buffers(*block)) saved.push_back(std::move(b));
    ctx->save_for_backward(saved);
    torch::NoGradGuard no_grad;
    auto random = random_states(x.device());
    auto y = block->forward(x);
    save_random_states(ctx, drawn_since(std::move(random)));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* block = reinterpret_cast<models::Block*>(ctx->saved_data["block"].toInt());
    auto saved = ctx->get_saved_variables();
    // Through the gradients too: the recomputed graph saw these values.
    BuffersAsBefore as_before(*block, variable_list(saved.begin() + 1, saved.end()));
    KeptGraph graph;
    {
      RandomAsBefore draws_as_before(saved_random_states(ctx, saved[0].device()));  // the forward's draws again
      graph = recompute_graph(*block, saved[0]);
    }
    auto grads = block_gradients(std::move(graph), grad_out);
    variable_list result{torch::Tensor(), grads.input};  // block pointer, input
    result.insert(result.end(), grads.params.begin(), grads.params.end());
    return result;
  }
};

}  // namespace

torch::Tensor checkpointed_forward(models::Block& block, const torch::Tensor& x) {
  auto params = block.parameters();
  return Checkpoint::apply(&block, x, torch::TensorList(params));
}

}  // namespace strata
