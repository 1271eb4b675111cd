#pragma once
// The one parity checker: given a strategy, a model config, a seed and a batch, run the baseline
// and the strategy side by side and compare loss, every gradient by canonical name, and the
// parameters after each optimizer step (SGD-momentum and AdamW).
#include <functional>
#include <string>

#include "strategies/strategy.h"

namespace strata::correctness {

/// max|actual - expected| <= atol + rtol * max|expected|, per tensor.
struct Tolerance {
  double rtol;
  double atol;
};

// fp32 on the CPU: the same sequence of operations gives identical bits; strategies that change
// the order of a reduction (a tied gradient summed on the host, a matmul split in two) differ by
// a few units in the last place of the accumulated values. 1e-5 is ~80 ulp of fp32 (eps 1.19e-7),
// far below any real bug (a missed or doubled contribution moves values by percent).
inline constexpr Tolerance kCpuTolerance{1e-5, 1e-7};
// fp32 on CUDA with TF32 off: cuBLAS may choose other kernels (split-K, other tilings) for other
// shapes and streams, so reductions run in another order; 1e-4 covers that for the sizes tested.
inline constexpr Tolerance kCudaTolerance{1e-4, 1e-6};
// AdamW divides by sqrt(v) + eps, so an element's update is about lr * g / (|g| + eps): where |g|
// is near the rounding noise of a reordered reduction (~1e-8 absolute at these sizes; a softmax
// computed across column shards is one such reordering), that noise becomes a difference of the
// update of up to lr * noise / eps. Parity runs AdamW with eps = kParityAdamwEps (bound: 1e-3 lr
// per step) and allows kAdamwUpdateSlack * lr per step on top of the gradient tolerance. A real
// bug (a missing or doubled contribution) moves most updates by a large part of lr.
inline constexpr double kParityAdamwEps = 1e-5;
inline constexpr double kAdamwUpdateSlack = 1e-2;
// After an AdamW step the two runs' parameters legitimately differ by up to that slack, and the
// next losses and gradients inherit the difference (~1e-5 absolute on parameters of ~0.02 is a
// relative 5e-4). Steps after the first are therefore compared at this relative tolerance under
// AdamW; the first step, and every SGD step, keep the strict one.
inline constexpr double kAdamwLaterStepRtol = 1e-3;

Tolerance tolerance_for(const torch::Device& device);

struct ParityCase {
  models::ModelConfig model;
  int64_t batch_size = 2;
  uint64_t seed = 0;
  int steps = 3;                                ///< optimizer steps, each after one train_step
  std::map<std::string, std::string> options;   ///< the strategy's own options
  std::vector<std::string> devices;             ///< extra devices ("cpu", "cuda:0", ...) for multi-device strategies
  std::string to_string() const;
};

struct ParityResult {
  bool ok = true;
  std::string message;  ///< the first mismatch, with step, tensor name and sizes of the difference
};

using StrategyMaker = std::function<std::unique_ptr<Strategy>(const StrategyConfig&)>;

/// Runs `steps` steps of each optimizer on the baseline and on `make(config)`; stops at the first
/// mismatch. `device` is the main device of both. TF32 is off during the check (the tolerances
/// are fp32's) and restored after it.
ParityResult check_parity(const StrategyMaker& make, const ParityCase& c, const torch::Device& device);
/// Same, for a registered strategy.
ParityResult check_parity(const std::string& strategy, const ParityCase& c, const torch::Device& device);

/// Compares two named tensor lists (same names, same order, same shapes, values within `tol`).
/// Returns an empty string when they match, else what differs.
std::string compare_named(const std::string& what, const NamedTensors& actual, const NamedTensors& expected,
                          Tolerance tol);

}  // namespace strata::correctness
