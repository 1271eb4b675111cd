// strata's optimizers against LibTorch's own torch::optim::SGD and AdamW. The parity suite cannot
// see an optimizer bug (the baseline and every strategy share optimizer_update), so the shared
// code is checked here against an independent implementation, over several steps, on both of its
// paths: the fused host loop (contiguous fp32 on the CPU) and the tensor-operation chain (every
// other tensor, e.g. on a GPU).
#include <array>

#include <gtest/gtest.h>

#include "correctness/support/test_device.h"
#include "models/threads.h"
#include "strategies/optim.h"

#include <chrono>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

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

// The fused loop's bf16 conversion on the values where rounding is easiest to get wrong: ties (to
// even, both ways), the largest float (rounds up to infinity), infinities, zeros of both signs,
// subnormals, and NaN (a NaN, whatever its bits). An SGD step from a zero gradient leaves every
// parameter as it was (p - lr x 0), so the copy must be each value cast by LibTorch. The values sit
// at every offset of a vector register and of a thread's chunk, across enough elements to be
// split over the threads.
TEST(Optimizers, the_rounded_bf16_copy_of_special_values_equals_the_cast) {
  const std::array<uint32_t, 15> bits = {
      0x3F808000u,  // 1 + 2^-8: a tie, rounds down to the even 1.0
      0x3F818000u,  // a tie that rounds up to the even neighbour
      0x3F808001u,  // just above a tie: up
      0x3F807FFFu,  // just below a tie: down
      0x7F7FFFFFu,  // the largest float: rounds to infinity
      0xFF7FFFFFu,  // its negative: to -infinity
      0x7F800000u, 0xFF800000u,  // infinities
      0x00000000u, 0x80000000u,  // zeros
      0x00000001u, 0x807FFFFFu,  // subnormals
      0x7FC00000u, 0xFFA00001u,  // a quiet NaN, a signalling one with the sign set
      0x00800000u,               // the smallest normal (15 values: an odd period, so every lane sees each)
  };
  const int64_t n = 1 << 16;
  auto values = torch::randn({n});
  auto* v = reinterpret_cast<uint32_t*>(values.data_ptr<float>());
  for (int64_t i = 0; i < n; i += 7) v[i] = bits[static_cast<size_t>(i / 7) % bits.size()];
  OptimizerConfig config;
  config.kind = OptimizerKind::sgd;
  auto param = values.clone();
  auto rounded = torch::empty({n}, torch::kBFloat16);
  OptimizerState state;
  optimizer_update(config, param, torch::zeros({n}), state, rounded);
  const auto nan = values.isnan();
  ASSERT_TRUE(nan.any().item<bool>());
  EXPECT_TRUE(torch::equal(rounded.isnan(), nan));
  EXPECT_TRUE(torch::equal(rounded.masked_fill(nan, 0), values.to(torch::kBFloat16).masked_fill(nan, 0)));
  const auto got = rounded.view(torch::kShort), want = values.to(torch::kBFloat16).view(torch::kShort);
  for (int64_t i = 0; i < 15 * 7; i += 7) {
    if (!nan[i].item<bool>()) {
      EXPECT_EQ(got[i].item<int16_t>(), want[i].item<int16_t>()) << "float bits 0x" << std::hex << v[i];
    }
  }
}

// optimizer_update_into takes the same step as optimizer_update, from one buffer into another: the
// overlapped hook_offload takes a tied matrix's step from its first use's gradient at once, into a
// second buffer, then again from the same start for the rows its last use touched. Checked here
// element for element against the in-place update (whose trajectory the tests above check against
// LibTorch's): the whole tensor, the rows alone (the others keep what the first pass wrote), the
// rounded copy, a first step from no state, and `from` left as it was.
TEST(Optimizers, an_update_into_another_buffer_equals_the_in_place_one_whole_and_by_rows) {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw})
    for (bool round : {false, true})
      for (int warm : {0, 2}) {  // steps already taken: 0 starts from no state
        const std::string where = std::string(kind == OptimizerKind::sgd ? "sgd" : "adamw") +
                                  (round ? " rounded" : "") + " after " + std::to_string(warm) + " steps";
        OptimizerConfig config;
        config.kind = kind;
        config.lr = 1e-2;
        torch::manual_seed(11);
        const int64_t rows = 512, cols = 1024;  // enough elements to be split over threads
        auto param = torch::randn({rows, cols});
        OptimizerState state;
        for (int s = 0; s < warm; ++s) optimizer_update(config, param, torch::randn({rows, cols}), state);
        const auto grad = torch::randn({rows, cols}), early = torch::randn({rows, cols});
        const auto start = param.clone();
        // The reference: in place, from a copy of the start.
        auto expected = param.clone();
        OptimizerState expected_state{state.exp_avg.defined() ? state.exp_avg.clone() : torch::Tensor(),
                                      state.exp_avg_sq.defined() ? state.exp_avg_sq.clone() : torch::Tensor(), state.step};
        auto expected_rounded = torch::empty({rows, cols}, torch::kBFloat16);
        optimizer_update(config, expected, grad, expected_state, round ? expected_rounded : torch::Tensor());
        // Whole, into another buffer.
        auto to = torch::full({rows, cols}, 7.0f);
        OptimizerState to_state;
        auto rounded = torch::zeros({rows, cols}, torch::kBFloat16);
        optimizer_update_into(config, param, state, grad, to, to_state, round ? rounded : torch::Tensor());
        EXPECT_TRUE(torch::equal(to, expected)) << where << ": whole";
        EXPECT_TRUE(torch::equal(to_state.exp_avg, expected_state.exp_avg)) << where << ": whole, first moment";
        if (kind == OptimizerKind::adamw) {
          EXPECT_TRUE(torch::equal(to_state.exp_avg_sq, expected_state.exp_avg_sq)) << where << ": whole, second moment";
        }
        EXPECT_EQ(to_state.step, warm + 1) << where;
        if (round) {
          EXPECT_TRUE(torch::equal(rounded, expected_rounded)) << where << ": whole, rounded";
        }
        EXPECT_TRUE(torch::equal(param, start)) << where << ": `from` was written";
        // By rows: a first pass from another gradient, then the chosen rows again from the start.
        auto speculative = torch::empty({rows, cols});
        OptimizerState speculative_state;
        optimizer_update_into(config, param, state, early, speculative, speculative_state);
        auto again = torch::empty({rows, cols});
        OptimizerState again_state;
        auto again_rounded = torch::zeros({rows, cols}, torch::kBFloat16);
        optimizer_update_into(config, param, state, early, again, again_state, round ? again_rounded : torch::Tensor());
        const auto chosen = torch::randperm(rows, torch::kLong).narrow(0, 0, 100).contiguous();  // distinct, unsorted
        optimizer_update_into(config, param, state, grad, again, again_state, round ? again_rounded : torch::Tensor(),
                              chosen, cols);
        auto is_chosen = torch::zeros({rows}, torch::kBool);
        is_chosen.index_put_({chosen}, true);
        const auto others = is_chosen.logical_not().nonzero().squeeze(1);
        EXPECT_TRUE(torch::equal(again.index_select(0, chosen), expected.index_select(0, chosen))) << where << ": rows";
        EXPECT_TRUE(torch::equal(again.index_select(0, others), speculative.index_select(0, others)))
            << where << ": rows not chosen changed";
        EXPECT_TRUE(torch::equal(again_state.exp_avg.index_select(0, chosen), expected_state.exp_avg.index_select(0, chosen)))
            << where << ": rows, first moment";
        EXPECT_TRUE(torch::equal(again_state.exp_avg.index_select(0, others), speculative_state.exp_avg.index_select(0, others)))
            << where << ": rows not chosen, first moment changed";
        if (kind == OptimizerKind::adamw) {
          EXPECT_TRUE(
              torch::equal(again_state.exp_avg_sq.index_select(0, chosen), expected_state.exp_avg_sq.index_select(0, chosen)))
              << where << ": rows, second moment";
          EXPECT_TRUE(
              torch::equal(again_state.exp_avg_sq.index_select(0, others), speculative_state.exp_avg_sq.index_select(0, others)))
              << where << ": rows not chosen, second moment changed";
        }
        if (round) {
          EXPECT_TRUE(torch::equal(again_rounded.index_select(0, chosen), expected_rounded.index_select(0, chosen)))
              << where << ": rows, rounded";
          EXPECT_TRUE(torch::equal(again_rounded.index_select(0, others), speculative.index_select(0, others).to(torch::kBFloat16)))
              << where << ": rows not chosen, rounded changed";
        }
        // The rows alone from no state at all (a first step whose rows pass runs first).
        if (warm == 0) {
          OptimizerState fresh, fresh_to;
          auto only = torch::zeros({rows, cols});
          optimizer_update_into(config, param, fresh, grad, only, fresh_to, {}, chosen, cols);
          EXPECT_TRUE(torch::equal(only.index_select(0, chosen), expected.index_select(0, chosen))) << where << ": rows from no state";
          EXPECT_EQ(fresh_to.step, 1) << where;
        }
        EXPECT_EQ(again_state.step, warm + 1) << where;
        EXPECT_TRUE(torch::equal(param, start)) << where << ": `from` was written by the rows";
        // The step really moved the chosen rows.
        EXPECT_GT((again.index_select(0, chosen) - start.index_select(0, chosen)).abs().max().item<double>(), 1e-3) << where;
      }
}

// AdamW into other buffers streams blocks of its results past the cache when the three outputs sit
// at the same offset within 16 bytes, element by element after the plain loop otherwise and for
// a span's head and tail. Every alignment, whole and by rows (of a width that is not a multiple of
// the blocks, and of an odd width, so rows start at every offset), spans shorter than a head, and
// a rounded bf16 copy, must give the in-place step to the bit. (Seen failing with a span's tail
// left unwritten.)
TEST(Optimizers, an_update_into_another_buffer_is_exact_at_every_alignment) {
  OptimizerConfig config;
  config.kind = OptimizerKind::adamw;
  config.lr = 1e-2;
  const auto chosen = torch::tensor({4, 0, 3}, torch::kLong);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{6, 1300}, {6, 1301}, {1, 1}, {1, 2}, {1, 3}, {1, 7}}) {
    torch::manual_seed(5);
    const int64_t n = rows * cols;
    auto param = torch::randn({n});
    OptimizerState state;
    optimizer_update(config, param, torch::randn({n}), state);
    const auto grad = torch::randn({n});
    auto expected = param.clone();
    OptimizerState expected_state{state.exp_avg.clone(), state.exp_avg_sq.clone(), state.step};
    auto expected_rounded = torch::empty({n}, torch::kBFloat16);
    optimizer_update(config, expected, grad, expected_state, expected_rounded);
    // Outputs placed at element offsets within larger buffers: the same offset for all three, and
    // mixed; the rounded copy at an offset of its own.
    for (const auto& at : std::vector<std::array<int64_t, 4>>{
             {0, 0, 0, 0}, {1, 1, 1, 3}, {2, 2, 2, 1}, {3, 3, 3, 0}, {1, 0, 3, 2}, {0, 2, 2, 5}}) {
      const std::string where = std::to_string(rows) + " x " + std::to_string(cols) + ", offsets " + std::to_string(at[0]) +
                                "," + std::to_string(at[1]) + "," + std::to_string(at[2]) + "," + std::to_string(at[3]);
      auto placed = [&](int64_t offset, torch::ScalarType dtype) {
        return torch::full({n + 8}, 7.0f, torch::TensorOptions().dtype(dtype)).narrow(0, offset, n);
      };
      for (bool by_rows : {false, true}) {
        if (by_rows && rows < 5) continue;  // the chosen rows need six
        auto to = placed(at[0], torch::kFloat);
        OptimizerState to_state{placed(at[1], torch::kFloat), placed(at[2], torch::kFloat), 0};
        auto rounded = placed(at[3], torch::kBFloat16);
        if (by_rows)
          optimizer_update_into(config, param, state, grad, to, to_state, rounded, chosen, cols);
        else
          optimizer_update_into(config, param, state, grad, to, to_state, rounded);
        const auto check = [&, rows = rows, cols = cols](const torch::Tensor& actual, const torch::Tensor& reference,
                                                         const char* what) {
          if (!by_rows) {
            EXPECT_TRUE(torch::equal(actual, reference)) << where << ": whole, " << what;
            return;
          }
          const auto r = actual.view({rows, cols}), e = reference.view({rows, cols});
          EXPECT_TRUE(torch::equal(r.index_select(0, chosen), e.index_select(0, chosen))) << where << ": rows, " << what;
          EXPECT_TRUE(torch::equal(r.index_select(0, torch::tensor({1, 2, 5}, torch::kLong)),
                                   torch::full({3, cols}, 7.0f, torch::TensorOptions().dtype(actual.scalar_type()))))
              << where << ": rows not chosen were written, " << what;
        };
        check(to, expected, "parameter");
        check(to_state.exp_avg, expected_state.exp_avg, "first moment");
        check(to_state.exp_avg_sq, expected_state.exp_avg_sq, "second moment");
        check(rounded, expected_rounded, "rounded copy");
      }
    }
  }
}

// optimizer_update_span_into: spans taken one after another, out of order and of odd lengths (so
// they start at every offset within the streamed blocks and 16-byte lines), end bit-equal to one
// call over the whole, from no state (each span's first call makes the states whole) and from a
// warm one, with and without a rounded copy, for both optimizers; a span alone writes nothing
// outside itself and leaves `from` as it was.
TEST(Optimizers, spans_taken_one_after_another_end_as_one_update_into_the_whole) {
  const int64_t n = 6 * 1301;
  const std::vector<int64_t> bounds{0, 1, 8, 1301, 2605, 2606, 5000, n};
  const std::vector<size_t> order{3, 0, 6, 2, 5, 1, 4};
  for (auto kind : {OptimizerKind::adamw, OptimizerKind::sgd})
    for (int warm : {0, 2})
      for (bool round : {false, true}) {
        const std::string where = std::string(kind == OptimizerKind::adamw ? "adamw" : "sgd") + ", warm " +
                                  std::to_string(warm) + (round ? ", rounded" : "");
        OptimizerConfig config;
        config.kind = kind;
        config.lr = 1e-2;
        torch::manual_seed(11);
        auto param = torch::randn({n});
        OptimizerState state;
        for (int i = 0; i < warm; ++i) optimizer_update(config, param, torch::randn({n}), state);
        const auto start = param.clone();
        const auto grad = torch::randn({n});
        OptimizerState whole_from{state.exp_avg.defined() ? state.exp_avg.clone() : torch::Tensor(),
                                  state.exp_avg_sq.defined() ? state.exp_avg_sq.clone() : torch::Tensor(), state.step};
        OptimizerState whole_to;
        auto whole = torch::zeros({n});
        auto whole_rounded = torch::zeros({n}, torch::kBFloat16);
        optimizer_update_into(config, param, whole_from, grad, whole, whole_to, round ? whole_rounded : torch::Tensor());
        OptimizerState to_state;
        auto to = torch::full({n}, 7.0f);
        auto rounded = torch::full({n}, 7.0f, torch::kBFloat16);
        for (size_t step = 0; step < order.size(); ++step) {
          const size_t k = order[step];
          optimizer_update_span_into(config, param, state, grad, to, to_state, round ? rounded : torch::Tensor(), bounds[k],
                                     bounds[k + 1] - bounds[k]);
          if (step == 0) {  // the first span alone: nothing outside it written, `from`'s state untouched
            const auto rest = [&](const torch::Tensor& t) {
              return torch::cat({t.narrow(0, 0, bounds[k]), t.narrow(0, bounds[k + 1], n - bounds[k + 1])});
            };
            EXPECT_TRUE(torch::equal(rest(to), torch::full({n - (bounds[k + 1] - bounds[k])}, 7.0f)))
                << where << ": a span wrote the parameter outside itself";
            EXPECT_TRUE(torch::equal(rest(rounded), torch::full({n - (bounds[k + 1] - bounds[k])}, 7.0f, torch::kBFloat16)))
                << where << ": a span wrote the rounded copy outside itself";
            EXPECT_EQ(rest(to_state.exp_avg).count_nonzero().item<int64_t>(), 0) << where << ": first moment outside the span";
            if (kind == OptimizerKind::adamw) {
              EXPECT_EQ(rest(to_state.exp_avg_sq).count_nonzero().item<int64_t>(), 0) << where << ": second moment outside the span";
            }
            if (warm > 0) {
              EXPECT_TRUE(torch::equal(state.exp_avg, whole_from.exp_avg)) << where << ": `from`'s first moment was written";
              if (kind == OptimizerKind::adamw) {
                EXPECT_TRUE(torch::equal(state.exp_avg_sq, whole_from.exp_avg_sq)) << where << ": `from`'s second moment was written";
              }
            }
          }
        }
        EXPECT_TRUE(torch::equal(to, whole)) << where << ": parameter";
        EXPECT_TRUE(torch::equal(to_state.exp_avg, whole_to.exp_avg)) << where << ": first moment";
        if (kind == OptimizerKind::adamw) {
          EXPECT_TRUE(torch::equal(to_state.exp_avg_sq, whole_to.exp_avg_sq)) << where << ": second moment";
        }
        if (round) {
          EXPECT_TRUE(torch::equal(rounded, whole_rounded)) << where << ": rounded copy";
        }
        EXPECT_EQ(to_state.step, warm + 1) << where;
        EXPECT_TRUE(torch::equal(param, start)) << where << ": `from` was written";
        EXPECT_GT((to - start).abs().max().item<double>(), 1e-3) << where << ": the step did not move the parameter";
      }
  OptimizerConfig config;
  auto a = torch::zeros({12}), b = torch::zeros({12}), g = torch::ones({12});
  OptimizerState sa, sb;
  EXPECT_THROW(optimizer_update_span_into(config, a, sa, g, b, sb, {}, 10, 3), std::exception);  // past the end
  EXPECT_THROW(optimizer_update_span_into(config, a, sa, g, b, sb, {}, -1, 3), std::exception);
  EXPECT_THROW(optimizer_update_span_into(config, a, sa, g, b, sb, {}, 0, -1), std::exception);
  EXPECT_THROW(optimizer_update_span_into(config, a, sa, g, b, sb, {}, std::numeric_limits<int64_t>::max(), 1),
               std::exception);  // first + count would overflow
  EXPECT_NO_THROW(optimizer_update_span_into(config, a, sa, g, b, sb, {}, 9, 3));
}

TEST(Optimizers, an_update_into_refuses_what_it_cannot_do) {
  OptimizerConfig config;
  config.kind = OptimizerKind::adamw;
  auto a = torch::zeros({4, 3}), b = torch::zeros({4, 3}), g = torch::ones({4, 3});
  OptimizerState sa, sb;
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, a, sb), std::exception);  // same buffer
  auto wrong = torch::zeros({4, 2});
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, wrong, sb), std::exception);
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, b, sb, {}, torch::tensor({4}, torch::kLong), 3), std::exception);
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, b, sb, {}, torch::tensor({1}, torch::kLong), 5), std::exception);
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, b, sa), std::exception);  // one state for both
  EXPECT_THROW(optimizer_update_into(config, a, sa, b, b, sb), std::exception);  // the gradient is written
  EXPECT_THROW(optimizer_update_into(config, a, sa, g, b, sb, {}, torch::tensor({1, 1}, torch::kLong), 3), std::exception);
  EXPECT_NO_THROW(optimizer_update_into(config, a, sa, g, b, sb, {}, torch::tensor({3, 0}, torch::kLong), 3));
}

// The in-place update's host loop is compiled on its buffers being distinct: one passed twice is
// refused, naming the rule, and the state is left as it was.
TEST(Optimizers, an_update_in_place_refuses_a_buffer_passed_twice) {
  OptimizerConfig config;
  config.kind = OptimizerKind::adamw;
  auto p = torch::zeros({64}), g = torch::ones({64});
  auto bf = torch::empty({64}, torch::kBFloat16);
  OptimizerState state;
  for (auto [param, grad, rounded] : {std::tuple{p, p, torch::Tensor()}, std::tuple{p, g, p.view(torch::kBFloat16).narrow(0, 0, 64)},
                                       std::tuple{p, g, g.view(torch::kBFloat16).narrow(0, 0, 64)}}) {
    try {
      optimizer_update(config, param, grad, state, rounded);
      ADD_FAILURE() << "an update with a buffer passed twice was taken";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("must be distinct buffers"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(state.step, 0);
  EXPECT_NO_THROW(optimizer_update(config, p, g, state, bf));
  EXPECT_EQ(state.step, 1);
}

// parallel_chunks hands its chunks to workers kept for the life of the process (ChunkWorkers);
// host threads only, so the cuda run repeats the cpu one. Several threads calling it at once (a
// host optimizer's queue beside a precision pass, ranks as threads) must each get every item of
// their own range exactly once, and their call must not return before every chunk of it has run.
// Each chunk sleeps a little before it counts its items, so a call that returned while a worker's
// chunk still ran sees that chunk uncounted; each caller checks its counts as soon as its call
// returns. With more than one core, some chunks must have run on another thread than the caller.
TEST(ChunkWorkers, every_item_runs_once_and_before_its_call_returns_with_callers_at_once) {
  constexpr int64_t n = (int64_t{1} << 18) * 12 + 77;  // many chunks, and a short last one
  constexpr int callers = 4, calls = 10;
  std::vector<std::string> failures(callers);
  std::mutex ids_mutex;
  std::set<std::thread::id> ids;
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c)
    threads.emplace_back([&, c] {
      std::vector<uint8_t> seen(n);
      for (int call = 0; call < calls && failures[c].empty(); ++call) {
        parallel_chunks(n, [&](int64_t begin, int64_t end) {
          {
            std::lock_guard<std::mutex> lock(ids_mutex);
            ids.insert(std::this_thread::get_id());
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          for (int64_t i = begin; i < end; ++i) ++seen[i];
        });
        for (int64_t i = n - 1; i >= 0; --i)  // the last chunks first: the ones most likely still running
          if (seen[i] != call + 1) {
            failures[c] = "caller " + std::to_string(c) + " call " + std::to_string(call) + ": item " +
                          std::to_string(i) + " ran " + std::to_string(seen[i]) + " times in all";
            break;
          }
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& f : failures) EXPECT_EQ(f, "");
  const auto callers_and_workers = ids.size();
  if (std::thread::hardware_concurrency() > 1) {
    EXPECT_GT(callers_and_workers, static_cast<size_t>(callers)) << "no chunk ran on a worker";
  }
}

// An error in one chunk reaches the caller only once every other chunk that started has finished
// (they use the caller's stack), and the workers take the next call as usual. A parallel_chunks
// inside a chunk runs on that chunk's thread alone rather than waiting for the job it is part of
// (which would never end: the test would time out). Neither leaves the caller marked as inside a
// job.
TEST(ChunkWorkers, an_error_reaches_the_caller_after_the_other_chunks_and_a_nested_call_runs_in_place) {
  constexpr int64_t n = (int64_t{1} << 18) * 8;
  std::atomic<int64_t> started{0}, finished{0};
  EXPECT_THROW(parallel_chunks(n, [&](int64_t begin, int64_t) {
                 ++started;
                 if (begin == 0) throw std::runtime_error("chunk 0 failed");
                 std::this_thread::sleep_for(std::chrono::milliseconds(2));
                 ++finished;
               }),
               std::runtime_error);
  EXPECT_EQ(finished.load(), started.load() - 1) << "the error came back while other chunks still ran";
  EXPECT_FALSE(ChunkWorkers::inside_job());
  std::atomic<int64_t> items{0}, outer_chunks{0};
  parallel_chunks(n, [&](int64_t begin, int64_t end) {
    ++outer_chunks;
    parallel_chunks(n, [&](int64_t b, int64_t e) { items += e - b; });
    items += end - begin;
  });
  EXPECT_EQ(items.load(), n + outer_chunks.load() * n);
  EXPECT_FALSE(ChunkWorkers::inside_job());
}

}  // namespace
}  // namespace strata
