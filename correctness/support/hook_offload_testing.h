#pragma once
// Helpers the hook_offload tests share (correctness/test_hook_offload_*.cpp): the strategy made on
// the suite's device, models and optimizers the tests use, byte counts worked out from the model
// (never from the strategy), gates opened from another thread, and two steps to compare against.
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "correctness/support/chain.h"
#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "correctness/support/hook_offload_peer.h"
#include "correctness/support/parity.h"
#include "correctness/support/test_device.h"
#include "models/check.h"
#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/hook_offload/hook_offload.h"

namespace strata::offload_test {

using namespace std::chrono_literals;

inline std::unique_ptr<HookOffload> make_offload(const std::map<std::string, std::string>& options,
                                          const StrategyConfig& base = {}) {
  StrategyConfig c = base;
  c.device = test::device();
  return std::make_unique<HookOffload>("hook_offload", c, HookOffloadOptions::parse(options));
}

inline models::ModelConfig gpt(int64_t depth, int64_t width, int64_t vocab = 0) {
  auto c = models::preset("gpt-tiny").config;
  c.depth = depth;
  c.width = width;
  if (vocab > 0) c.vocab = vocab;
  return c;
}

// AdamW with a large learning rate: tests that compare steps to the bit want every parameter to
// move visibly, and AdamW's parity allowance (which grows with the rate) is what they go beyond.
inline StrategyConfig adamw(double lr = 1e-2) {
  StrategyConfig c;
  c.optimizer.kind = OptimizerKind::adamw;
  c.optimizer.lr = lr;
  return c;
}

// Opens a gate from another thread once ready() holds or `limit` has passed (forced() then
// says so), or at once when destroyed, and joins that thread then: an exception in the test
// body fails the test rather than ending the process on a joinable thread.
class OpenLater {
 public:
  OpenLater(std::shared_ptr<device::Gate> gate, std::chrono::milliseconds limit,
            std::function<bool()> ready = [] { return false; })
      : gate_(std::move(gate)), thread_([this, limit, ready = std::move(ready)] {
          const auto until = std::chrono::steady_clock::now() + limit;
          while (!gate_->is_open() && !ready()) {
            if (std::chrono::steady_clock::now() >= until) {
              forced_ = true;
              break;
            }
            std::this_thread::sleep_for(1ms);
          }
          gate_->open();
        }) {}
  ~OpenLater() {
    gate_->open();
    join();
  }
  OpenLater(const OpenLater&) = delete;
  OpenLater& operator=(const OpenLater&) = delete;
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  bool forced() const { return forced_; }

 private:
  std::shared_ptr<device::Gate> gate_;
  std::atomic<bool> forced_{false};
  std::thread thread_;
};

// Opens a gate when it goes out of scope, on every path (a strategy whose updates wait on it
// drains them when destroyed).
struct OpenOnExit {
  std::shared_ptr<device::Gate> gate;
  ~OpenOnExit() { gate->open(); }
};

// Bytes of the parameters block `b` uses, counted from the model (not from the strategy).
inline int64_t window_bytes(const models::BlockModel& m, int64_t b) {
  int64_t n = 0;
  for (const auto& p : m.blocks()[b]->parameters()) n += p.numel() * 4;
  return n;
}

// Bytes of the parameters windows 0 to `last` use, each parameter once (a tied one is in several).
inline int64_t opening_bytes(const models::BlockModel& m, int64_t last) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (int64_t b = 0; b <= last; ++b)
    for (const auto& p : m.blocks()[b]->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel() * 4;
  return n;
}

// tied_early (an option of the overlapped optimizer): a tied matrix whose last use touches at
// most half its rows goes to the device whole during each backward (at its end in the first step,
// before any last use was seen), as the step from its first use left it, and the next forward's
// fetch of it sends only the rows the batch's distinct tokens touched. Both counted from the model
// and the batch (zero when nothing is tied, or the last use is dense).
struct EarlyBytes {
  int64_t matrix = 0, rows = 0;
};
inline EarlyBytes tied_early_bytes(const models::BlockModel& m, const models::Batch& batch) {
  std::map<const void*, std::pair<int, torch::Tensor>> uses;
  for (const auto& block : m.blocks())
    for (const auto& p : block->parameters()) {
      auto& [count, tensor] = uses[p.unsafeGetTensorImpl()];
      ++count;
      tensor = p;
    }
  EarlyBytes early;
  const int64_t tokens = std::get<0>(at::_unique(batch.input)).numel();
  for (const auto& [key, use] : uses) {
    const auto& [count, w] = use;
    if (count != 2 || w.dim() < 2 || 2 * tokens > w.size(0)) continue;
    early.matrix += w.numel() * 4;
    early.rows += tokens * (w.numel() / w.size(0)) * 4;
  }
  return early;
}

// opening=auto resolved by the last optimizer_step: prefetch + 1 windows, none with prefetch=0.
// Returns the bytes the opening holds.
inline int64_t expect_auto_opening(const HookOffload& s, const models::BlockModel& model, int64_t prefetch,
                            const std::string& where) {
  EXPECT_EQ(s.last_opening(), prefetch > 0 ? std::min(prefetch + 1, model.num_blocks()) : 0) << where;
  return s.last_opening() > 0 ? opening_bytes(model, s.last_opening() - 1) : 0;
}

// Two steps of hook_offload with its optimizer after backward: the second step's loss and the
// parameters after it, which an overlapped run of the same two steps must reach.
struct TwoSteps {
  double loss = 0;
  NamedTensors parameters;
};
inline TwoSteps two_steps(const std::map<std::string, std::string>& options, const StrategyConfig& base,
                   const models::ModelConfig& config, const models::Batch& first, const models::Batch& second) {
  auto reference = make_offload(options, base);
  reference->attach(models::build_model(config, 0));
  reference->train_step(first);
  reference->optimizer_step();
  TwoSteps out;
  out.loss = reference->train_step(second);
  reference->optimizer_step();
  out.parameters = reference->parameters();
  return out;
}

inline void expect_same_steps(const TwoSteps& expected, double loss, HookOffload& s, const std::string& where) {
  EXPECT_NEAR(loss, expected.loss, 1e-6 * std::abs(expected.loss)) << where << ": the second forward read stale weights";
  const auto actual = s.parameters();
  ASSERT_EQ(actual.size(), expected.parameters.size()) << where;
  for (size_t i = 0; i < actual.size(); ++i)
    EXPECT_TRUE(torch::allclose(actual[i].second, expected.parameters[i].second, 1e-5, 1e-7))
        << where << ": " << actual[i].first;
}

// The chain of `spec` with its block `at` (counting the input layer as 0) replaced by a 4-wide
// FailingBlock, built the same way each time; `failing`, when given, receives it.
/// `model` with block `at` replaced by a FailingBlock of `width` (seeded: the same each call).
inline models::BlockModel with_failing_block(const models::BlockModel& model, size_t at, int64_t width,
                                      std::shared_ptr<test::FailingBlock>* failing) {
  auto blocks = model.blocks();
  torch::manual_seed(7);
  auto f = std::make_shared<test::FailingBlock>(width);
  if (failing) *failing = f;
  blocks[at] = f;
  return models::BlockModel(model.config(), blocks);
}
inline models::BlockModel with_failing_block(const correctness::ChainSpec& spec, size_t at,
                                      std::shared_ptr<test::FailingBlock>* failing) {
  return with_failing_block(spec.build(0), at, 4, failing);
}

}  // namespace strata::offload_test
