#include "strategies/windowed.h"

#include <optional>

namespace strata {

UnitPlan plan_units(const models::BlockModel& model) {
  const auto& params = model.parameters();
  const auto& uses = model.block_parameters();
  std::vector<int> users(params.size(), 0);
  for (const auto& u : uses)
    for (auto p : u) ++users[p];
  UnitPlan plan;
  std::vector<int64_t> unit_of(params.size(), -1);
  plan.windows.assign(uses.size(), {});
  for (size_t b = 0; b < uses.size(); ++b) {
    std::vector<int64_t> own;
    for (auto p : uses[b])
      if (users[p] == 1) own.push_back(p);
    if (!own.empty()) {
      for (auto p : own) unit_of[p] = static_cast<int64_t>(plan.units.size());
      plan.units.push_back(std::move(own));
    }
    for (auto p : uses[b]) {
      if (unit_of[p] < 0) {  // shared, first seen here
        unit_of[p] = static_cast<int64_t>(plan.units.size());
        plan.units.push_back({p});
      }
      auto& w = plan.windows[b];
      if (std::find(w.begin(), w.end(), unit_of[p]) == w.end()) w.push_back(unit_of[p]);
    }
  }
  plan.users.assign(plan.units.size(), 0);
  for (const auto& w : plan.windows)
    for (auto u : w) ++plan.users[u];
  // Trainable parameters first in each unit, so gradients and the optimizer cover one prefix and
  // frozen ones cost no gradient bytes.
  for (auto& unit : plan.units)
    std::stable_partition(unit.begin(), unit.end(), [&](int64_t p) { return params[p].tensor.requires_grad(); });
  return plan;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Forward: window in, compute (keeping the block's graph, or the input and the buffers as they were
// for a recompute), window out. Backward: window in, recompute or take the kept graph, gradients
// out, window out.
struct WindowedBlock : torch::autograd::Function<WindowedBlock> {
  static torch::Tensor forward(AutogradContext* ctx, WindowedRunner* runner, int64_t block, torch::Tensor x,
                               torch::Tensor anchor) {
    ctx->saved_data["runner"] = reinterpret_cast<int64_t>(runner);
    ctx->saved_data["block"] = block;
    auto& module = *runner->model().blocks()[block];
    runner->before_compute(block, /*backward=*/false);
    torch::Tensor out;
    if (runner->recompute_block(block)) {
      variable_list saved{x};
      for (auto& b : snapshot_buffers(module)) saved.push_back(std::move(b));
      ctx->save_for_backward(saved);
      auto random = random_states(x.device());
      out = module.forward(x);
      save_random_states(ctx, drawn_since(std::move(random)));
    } else {
      // The kept graph's saved views of the parameters share the units' storage, so they see the
      // data again once backward brings the window back.
      std::tie(out, runner->kept_graphs()[block]) = run_keeping_graph(module, x);
    }
    runner->after_compute(block, /*backward=*/false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* runner = reinterpret_cast<WindowedRunner*>(ctx->saved_data["runner"].toInt());
    const auto block = ctx->saved_data["block"].toInt();
    auto& module = *runner->model().blocks()[block];
    runner->before_compute(block, /*backward=*/true);
    KeptGraph graph;
    std::optional<BuffersAsBefore> as_before;  // through the gradients: the recomputed graph saw these values
    if (runner->recompute_block(block)) {
      auto saved = ctx->get_saved_variables();
      as_before.emplace(module, variable_list(saved.begin() + 1, saved.end()));
      RandomAsBefore draws_as_before(saved_random_states(ctx, saved[0].device()));  // the forward's draws again
      graph = recompute_graph(module, saved[0]);
    } else {
      graph = std::move(runner->kept_graphs()[block]);
      runner->kept_graphs()[block] = {};
    }
    auto grads = block_gradients(std::move(graph), grad_out, runner->gradient_sink(block));
    as_before.reset();
    runner->flush_gradients(block, grads.params);
    runner->after_compute(block, /*backward=*/true);
    return {torch::Tensor(), torch::Tensor(), grads.input, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor run_windowed(WindowedRunner& runner, int64_t block, const torch::Tensor& x, const torch::Tensor& anchor) {
  return WindowedBlock::apply(&runner, block, x, anchor);
}

}  // namespace strata
