#include "strategies/checkpoint.h"

#include <torch/csrc/autograd/engine.h>

namespace strata {

std::pair<torch::Tensor, KeptGraph> run_keeping_graph(models::Block& block, const torch::Tensor& x) {
  torch::AutoGradMode enable(true);
  auto x_leaf = x.detach().requires_grad_(x.is_floating_point());
  auto y = block.forward(x_leaf);
  KeptGraph graph{torch::autograd::impl::gradient_edge(y), x_leaf, {}};
  for (const auto& p : block.parameters()) graph.params.push_back(torch::autograd::impl::gradient_edge(p));
  return {y.detach(), std::move(graph)};
}

BlockGradients block_gradients(KeptGraph graph, const std::vector<torch::Tensor>& grad_out) {
  // What autograd::grad does, started from an edge instead of the output tensor.
  const bool wants_input = graph.input.requires_grad();
  torch::autograd::edge_list wanted;
  if (wants_input) wanted.push_back(torch::autograd::impl::gradient_edge(graph.input));
  wanted.insert(wanted.end(), graph.params.begin(), graph.params.end());
  BlockGradients out;
  out.params.resize(graph.params.size());
  if (wanted.empty()) return out;
  auto grads = torch::autograd::Engine::get_default_engine().execute(
      {graph.output}, grad_out, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false, wanted);
  size_t next = 0;
  if (wants_input) out.input = grads[next++];
  for (auto& g : out.params) g = grads[next++];
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
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;
    return block->forward(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* block = reinterpret_cast<models::Block*>(ctx->saved_data["block"].toInt());
    auto kept = run_keeping_graph(*block, ctx->get_saved_variables()[0]).second;
    auto grads = block_gradients(std::move(kept), grad_out);
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
