// strata's optimizers against LibTorch's own torch::optim::SGD and AdamW. The parity suite cannot
// see an optimizer bug (the baseline and every strategy share optimizer_update), so the shared
// code is checked here against an independent implementation, over several steps, on both of its
// paths: the fused host loop (contiguous fp32 on the CPU) and the tensor-operation chain (every
// other tensor, e.g. on a GPU).
#include <gtest/gtest.h>

#include "correctness/support/test_device.h"
#include "strategies/optim.h"

namespace strata {
namespace {

enum class Path { fused, chain };

// A parameter whose update takes `path`: the chain for any non-contiguous or non-host tensor.
torch::Tensor parameter_on(Path path, const torch::Tensor& values, const torch::Device& device) {
  if (path == Path::fused) return values.clone();
  // Stored transposed, so the parameter is a non-contiguous view; on a GPU the chain runs anyway.
  return values.t().contiguous().to(device).t();
}

void expect_same_trajectory(OptimizerKind kind, Path path, const torch::Device& device) {
  OptimizerConfig config;
  config.kind = kind;
  config.lr = kind == OptimizerKind::sgd ? 0.1 : 1e-2;
  config.momentum = 0.9;
  config.weight_decay = 0.05;
  config.eps = 1e-8;
  torch::manual_seed(3);
  const auto start = torch::randn({33, 17});
  auto ours = parameter_on(path, start, path == Path::fused ? torch::Device(torch::kCPU) : device);
  ASSERT_EQ(ours.is_contiguous() && ours.is_cpu(), path == Path::fused);
  auto theirs = start.clone().requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> reference;
  if (kind == OptimizerKind::sgd)
    reference = std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{theirs},
                                                    torch::optim::SGDOptions(config.lr).momentum(config.momentum));
  else
    reference = std::make_unique<torch::optim::AdamW>(
        std::vector<torch::Tensor>{theirs},
        torch::optim::AdamWOptions(config.lr).betas({config.beta1, config.beta2}).eps(config.eps).weight_decay(
            config.weight_decay));
  OptimizerState state;
  for (int step = 0; step < 6; ++step) {
    const auto grad = torch::randn({33, 17}) * (step + 1);  // growing, so bias correction matters
    theirs.mutable_grad() = grad.clone();
    reference->step();
    optimizer_update(config, ours, path == Path::fused ? grad : grad.to(ours.device()), state);
    // Both compute the same formulas in fp32 in another order: a few ulp of the largest value
    // (fp32's ulp is 1.2e-7 relative); a wrong formula is off by a good part of an update.
    const auto diff = (ours.cpu() - theirs.detach()).abs().max().item<double>();
    const auto scale = theirs.detach().abs().max().item<double>();
    EXPECT_LT(diff, 1e-6 * scale) << "step " << step;
  }
  // And the trajectory really moved: a no-op optimizer would match a no-op reference only.
  EXPECT_GT((theirs.detach() - start).abs().max().item<double>(), 0.05);
}

TEST(Optimizers, sgd_momentum_matches_libtorch_on_the_fused_path) { expect_same_trajectory(OptimizerKind::sgd, Path::fused, test::device()); }
TEST(Optimizers, sgd_momentum_matches_libtorch_on_the_tensor_path) { expect_same_trajectory(OptimizerKind::sgd, Path::chain, test::device()); }
TEST(Optimizers, adamw_matches_libtorch_on_the_fused_path) { expect_same_trajectory(OptimizerKind::adamw, Path::fused, test::device()); }
TEST(Optimizers, adamw_matches_libtorch_on_the_tensor_path) { expect_same_trajectory(OptimizerKind::adamw, Path::chain, test::device()); }

// The rounded copy an update can write (the bf16 or fp16 weights that travel to a device): after
// each step it equals the updated parameter cast by copy_(), element for element. What this tests
// is the fused host loop's own conversion, over enough elements to be split over threads; the
// chain path (which is copy_() itself) is run for completeness.
TEST(Optimizers, the_rounded_copy_equals_the_updated_parameter_cast) {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw})
    for (auto dtype : {torch::kBFloat16, torch::kHalf})
      for (auto path : {Path::fused, Path::chain}) {
        OptimizerConfig config;
        config.kind = kind;
        config.lr = 1e-2;
        torch::manual_seed(5);
        const int64_t rows = path == Path::fused ? 1024 : 16;
        auto param = parameter_on(path, torch::randn({rows, 1024}), test::device());
        auto rounded = torch::empty({rows, 1024}, torch::TensorOptions().dtype(dtype).device(param.device()));
        OptimizerState state;
        for (int step = 0; step < 3; ++step) {
          const auto grad = parameter_on(path, torch::randn({rows, 1024}), test::device());
          optimizer_update(config, param, grad, state, rounded);
          EXPECT_TRUE(torch::equal(rounded, param.to(dtype)))
              << config.to_string() << " " << dtype << (path == Path::fused ? " fused" : " chain") << " step " << step;
        }
      }
}

}  // namespace
}  // namespace strata
