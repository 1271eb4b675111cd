#include "strategies/checkpoint.h"

namespace strata {
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
    auto x = ctx->get_saved_variables()[0];
    const bool x_needs_grad = x.is_floating_point();
    auto params = block->parameters();
    variable_list inputs;
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      auto x_leaf = x.detach().requires_grad_(x_needs_grad);
      out = block->forward(x_leaf);
      if (x_needs_grad) inputs.push_back(x_leaf);
    }
    for (const auto& p : params) inputs.push_back(p);
    auto grads = torch::autograd::grad({out}, inputs, grad_out, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    variable_list result;
    result.emplace_back();  // block pointer
    size_t next = 0;
    result.push_back(x_needs_grad ? grads[next++] : torch::Tensor());
    for (size_t i = 0; i < params.size(); ++i) result.push_back(grads[next++]);
    return result;
  }
};

}  // namespace

torch::Tensor checkpointed_forward(models::Block& block, const torch::Tensor& x) {
  auto params = block.parameters();
  return Checkpoint::apply(&block, x, torch::TensorList(params));
}

}  // namespace strata
