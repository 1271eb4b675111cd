// hook_offload invariants beyond parity: residency after forward, backward and the step; bytes
// moved against the analytic count; peak device memory under an analytic bound; the seed's
// double-load scenario; asynchrony under injected delays, including a deliberately missing wait
// that these tests must catch.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "correctness/support/parity.h"
#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "models/check.h"
#include "correctness/support/test_device.h"
#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/hook_offload/hook_offload.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<HookOffload> make_offload(const std::map<std::string, std::string>& options,
                                          const StrategyConfig& base = {}) {
  StrategyConfig c = base;
  c.device = test::device();
  return std::make_unique<HookOffload>("hook_offload", c, HookOffloadOptions::parse(options));
}

models::ModelConfig gpt(int64_t depth, int64_t width, int64_t vocab = 0) {
  auto c = models::preset("gpt-tiny").config;
  c.depth = depth;
  c.width = width;
  if (vocab > 0) c.vocab = vocab;
  return c;
}

// AdamW with a large learning rate: tests that compare steps to the bit want every parameter to
// move visibly, and AdamW's parity allowance (which grows with the rate) is what they go beyond.
StrategyConfig adamw(double lr = 1e-2) {
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
int64_t window_bytes(const models::BlockModel& m, int64_t b) {
  int64_t n = 0;
  for (const auto& p : m.blocks()[b]->parameters()) n += p.numel() * 4;
  return n;
}

// Bytes of the parameters windows 0 to `last` use, each parameter once (a tied one is in several).
int64_t opening_bytes(const models::BlockModel& m, int64_t last) {
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
EarlyBytes tied_early_bytes(const models::BlockModel& m, const models::Batch& batch) {
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
int64_t expect_auto_opening(const HookOffload& s, const models::BlockModel& model, int64_t prefetch,
                            const std::string& where) {
  EXPECT_EQ(s.last_opening(), prefetch > 0 ? std::min(prefetch + 1, model.num_blocks()) : 0) << where;
  return s.last_opening() > 0 ? opening_bytes(model, s.last_opening() - 1) : 0;
}

// A block of two layers, y = second(tanh(first(x))): backward reaches the second layer's
// parameters first. With a sink, block_gradients hands each gradient over as autograd produces it,
// so the second layer's arrive before backward has reached the hidden layer (`hidden_reached`, set
// by a hook on it) and the first layer's after; the gradients returned are autograd's, nothing is
// left in any parameter's .grad, and no hook stays on an accumulator another graph still holds.
class TwoLayers : public models::Block {
 public:
  TwoLayers() {
    first = register_module("first", torch::nn::Linear(8, 16));
    second = register_module("second", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto hidden = torch::tanh(first->forward(x));
    if (hidden.requires_grad()) hidden.register_hook([this](const torch::Tensor&) { hidden_reached = true; });
    return second->forward(hidden);
  }
  torch::nn::Linear first{nullptr}, second{nullptr};
  bool hidden_reached = false;
};

TEST(BlockGradients, a_sink_gets_each_gradient_as_backward_reaches_it) {
  torch::manual_seed(0);
  auto block = std::make_shared<TwoLayers>();
  block->to(test::device());
  const auto x = torch::randn({5, 8}, torch::TensorOptions().device(test::device()));
  const auto grad_out = torch::randn({5, 4}, x.options());
  const auto params = block->parameters();  // first.weight, first.bias, second.weight, second.bias
  ASSERT_EQ(params.size(), 4u);

  // Autograd's own answer, from a graph of its own.
  std::vector<torch::Tensor> expected;
  {
    auto leaf = x.detach().requires_grad_(true);
    std::vector<torch::Tensor> inputs{leaf};
    for (const auto& p : params) inputs.push_back(p);
    expected = torch::autograd::grad({block->forward(leaf)}, inputs, {grad_out});
  }

  // A second graph of the same block, alive throughout: it holds the parameters' accumulators,
  // so they outlive the first backward with whatever hooks it left on them.
  auto other = run_keeping_graph(*block, x).second;
  std::vector<size_t> order;
  std::vector<bool> hidden_reached_at(params.size(), false);  // backward had reached the hidden layer when each came
  block->hidden_reached = false;
  auto grads = block_gradients(run_keeping_graph(*block, x).second, {grad_out}, [&](size_t i, const torch::Tensor& g) {
    EXPECT_TRUE(g.defined());
    hidden_reached_at[i] = block->hidden_reached;
    order.push_back(i);
  });
  EXPECT_TRUE(block->hidden_reached);
  std::set<size_t> seen(order.begin(), order.end());
  EXPECT_EQ(seen, (std::set<size_t>{0, 1, 2, 3})) << "every parameter's gradient reaches the sink once";
  EXPECT_EQ(order.size(), 4u);
  EXPECT_FALSE(hidden_reached_at[2]) << "the second layer's weight came once backward was past it: not as produced";
  EXPECT_FALSE(hidden_reached_at[3]) << "the second layer's bias came once backward was past it";
  EXPECT_TRUE(hidden_reached_at[0] && hidden_reached_at[1]) << "the first layer's came before backward reached it";
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(other.params[i].function->pre_hooks().empty()) << "a hook stayed on parameter " << i << "'s accumulator";
  ASSERT_TRUE(grads.input.defined());
  EXPECT_TRUE(torch::equal(grads.input, expected[0]));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(grads.params[i].defined()) << i;
    EXPECT_TRUE(torch::equal(grads.params[i], expected[i + 1])) << "parameter " << i;
    EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i << " kept a .grad";
  }
  // A sink that throws: the error comes out of block_gradients, and the hooks go all the same.
  EXPECT_THROW(block_gradients(run_keeping_graph(*block, x).second, {grad_out},
                               [](size_t, const torch::Tensor&) { throw std::runtime_error("sink failed"); }),
               std::exception);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(other.params[i].function->pre_hooks().empty()) << "after a failed sink, parameter " << i;
  // The kept graph still gives autograd's gradients, through a sink of its own.
  size_t calls = 0;
  auto again = block_gradients(std::move(other), {grad_out}, [&](size_t, const torch::Tensor&) { ++calls; });
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(again.params[i], expected[i + 1])) << i;
  EXPECT_EQ(calls, 4u);
  EXPECT_EQ(order.size(), 4u) << "the first sink was called again";
}

// grads_early (auto, which is 1 in fp32): the blocks' own gradients go to the host in parts queued
// during their backward (block_gradients' sink), in gpt-tiny and an MLP; with grads_early=0, none does.
// Parity of both is the parity suite's (the generators draw grads_early=0 too).
TEST(HookOffload, a_blocks_gradients_go_in_parts_while_its_backward_runs) {
  for (const auto* preset : {"gpt-tiny", "mlp-tiny"}) {
    const auto config = models::preset(preset).config;
    const auto batch = models::make_batch(config, 2, 1);
    for (const char* early : {"1", "0"}) {
      auto s = make_offload({{"grads_early", early}});
      s->attach(models::build_model(config, 0));
      s->reset_stats();
      s->train_step(batch);
      s->finish_backward();
      const auto moved = s->stats().bytes_d2h;
      if (std::string(early) == "1")
        EXPECT_GE(s->early_gradient_transfers(), config.depth) << preset << ": parts that went during backward";
      else
        EXPECT_EQ(s->early_gradient_transfers(), 0) << preset;
      s->optimizer_step();
      // The same bytes either way: parts, not more.
      auto other = make_offload({{"grads_early", std::string(early) == "1" ? "0" : "1"}});
      other->attach(models::build_model(config, 0));
      other->reset_stats();
      other->train_step(batch);
      other->finish_backward();
      EXPECT_EQ(other->stats().bytes_d2h, moved) << preset;
    }
  }
  // auto: early where the blocks compute in fp32 (above), not under bf16 unless asked for.
  StrategyConfig bf16;
  bf16.precision = PrecisionPolicy::parse("bf16");
  const auto config = models::preset("gpt-tiny").config;
  for (const char* early : {"auto", "1"}) {
    auto s = make_offload({{"grads_early", early}}, bf16);
    s->attach(models::build_model(config, 0));
    s->reset_stats();
    s->train_step(models::make_batch(config, 2, 1));
    s->finish_backward();
    if (std::string(early) == "auto")
      EXPECT_EQ(s->early_gradient_transfers(), 0) << "bf16, grads_early=auto";
    else
      EXPECT_GE(s->early_gradient_transfers(), config.depth) << "bf16, grads_early=1";
  }
}

// The arithmetic of opening=fit: the floor always, then windows while their bytes, summed from
// window 0, fit in the budget; a window that adds nothing (its units held already) is free.
TEST(HookOffload, a_fitted_opening_takes_its_floor_then_the_windows_that_fit) {
  const std::vector<int64_t> ten{10, 10, 10, 10};
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 2, 0), 2);
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 2, -50), 2) << "a budget below zero keeps the floor";
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 2, 29), 2);
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 2, 30), 3);
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 0, 25), 2);
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 2, 1000), 4) << "no more than the model has";
  EXPECT_EQ(HookOffload::fit_opening_windows(ten, 9, 0), 4) << "a floor above the model's windows";
  EXPECT_EQ(HookOffload::fit_opening_windows({40, 0, 10, 10}, 1, 50), 3) << "window 1 adds nothing";
  EXPECT_EQ(HookOffload::fit_opening_windows({40, 0, 10, 10}, 1, 39), 1)
      << "over budget from the floor on: nothing more, not even a window that adds nothing";
  EXPECT_EQ(HookOffload::fit_opening_windows({}, 3, 100), 0);
}

// opening=fit's budget, with the device memory read from a probe the test sets: backward's reading
// less what is in use when the step opens, less the largest window (a transformer block's). The
// expected counts come from the model's parameter bytes: windows 0 to k need opening_bytes(k),
// the tied matrix counted once, a resident window's bytes not at all.
TEST(HookOffload, a_fitted_opening_is_sized_by_backwards_reading_less_what_is_in_use_and_a_window) {
  const auto config = gpt(3, 16);
  const auto model = models::build_model(config, 0);
  const auto batch = models::make_batch(config, 2, 1);
  const int64_t n = model.num_blocks(), backward = int64_t{1} << 30;
  int64_t largest = 0;
  for (int64_t b = 0; b < n; ++b) largest = std::max(largest, window_bytes(model, b));
  ASSERT_EQ(n, 5);
  // The windows the step opens with when the budget left for them is `budget`.
  auto opened = [&](const std::map<std::string, std::string>& extra, int64_t budget) {
    auto options = extra;
    options["prefetch"] = "1";  // floor: 2 windows
    options["opening"] = "fit";
    auto s = make_offload(options);
    s->attach(models::build_model(config, 0));
    int64_t in_use = backward;
    s->read_device_memory_with([&] { return in_use; });
    s->train_step(batch);
    in_use = backward - largest - budget;  // read once the step opens
    s->optimizer_step();
    return s->last_opening();
  };
  for (int64_t k : {2, 3}) {  // windows 0 to k
    EXPECT_EQ(opened({}, opening_bytes(model, k)), k + 1) << "budget of windows 0 to " << k;
    EXPECT_EQ(opened({}, opening_bytes(model, k) - 1), k) << "a byte short of windows 0 to " << k;
  }
  // The head's window shares the tied matrix with window 0: it adds only its own parameters.
  EXPECT_EQ(opened({}, opening_bytes(model, 4)), 5);
  EXPECT_EQ(opened({}, opening_bytes(model, 4) - 1), 4);
  // A resident window is on the device already: it costs the opening nothing.
  const int64_t resident = window_bytes(model, 1);
  EXPECT_EQ(opened({{"resident", "1"}}, opening_bytes(model, 3) - resident), 4);
  EXPECT_EQ(opened({{"resident", "1"}}, opening_bytes(model, 3) - resident - 1), 3);
  // Below the floor, the floor.
  EXPECT_EQ(opened({}, 0), 2);
}

TEST(HookOffload, nothing_offloaded_stays_on_the_device_after_forward_backward_and_step) {
  for (const char* activations : {"recompute", "keep"}) {
    for (int prefetch : {0, 1, 3}) {
      auto s = make_offload({{"prefetch", std::to_string(prefetch)}, {"activations", activations}});
      const auto config = gpt(3, 16);
      const auto model = models::build_model(config, 0);
      s->attach(models::build_model(config, 0));
      const auto dev = test::device();
      const auto batch = models::make_batch(config, 2, 1);
      // One step first: the math libraries keep workspaces (cuBLAS: tens of MiB) for good. Its
      // optimizer_step leaves the next forward's first windows on the device; a forward uses them.
      s->train_step(batch);
      s->optimizer_step();
      s->forward(batch.input);
      device::synchronize(dev);
      const auto allocated_at_rest = device::allocator_stats(dev).allocated;
      const std::string where = std::string(activations) + " prefetch=" + std::to_string(prefetch);

      s->forward(batch.input);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after forward, " << where;
      EXPECT_EQ(s->references_held(), 0) << "after forward, " << where;
      s->train_step(batch);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after backward, " << where;
      EXPECT_EQ(s->references_held(), 0) << "after backward, " << where;
      if (dev.is_cuda()) {
        // Not only by the strategy's own count: the allocator holds nothing more than at rest once
        // the gradients are on their way (the gradient tensors are freed when their copies finish).
        s->finish_backward();
        device::synchronize(dev);
        EXPECT_EQ(device::allocator_stats(dev).allocated, allocated_at_rest) << "after backward, " << where;
      }
      s->optimizer_step();
      // Only the windows the next forward opens with, fetched ahead (none without prefetch).
      const int64_t opening = expect_auto_opening(*s, model, prefetch, where);
      EXPECT_EQ(s->offloaded_bytes_on_device(), opening) << "after the step, " << where;
      s->forward(batch.input);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after the step and a forward, " << where;
      device::synchronize(dev);
      if (dev.is_cuda()) {
        // The allocator agrees: nothing the step allocated is still held.
        EXPECT_EQ(device::allocator_stats(dev).allocated, allocated_at_rest) << where;
      }
    }
  }
}

// In plain mode optimizer_step fetches the windows the next forward opens with (0 to prefetch, or
// as many as `opening` says), each once its units are updated: it moves their bytes, and the next
// train_step moves that much less than a first step. Whether they hold the updated values is the
// parity properties' (they compare every step's loss and gradients). The overlapped optimizer, and
// prefetch=0 without an `opening`, fetch nothing there.
TEST(HookOffload, the_next_forwards_first_windows_are_fetched_in_the_optimizer_step) {
  const auto config = gpt(3, 16);
  const auto batch = models::make_batch(config, 2, 1);
  const auto model = models::build_model(config, 0);
  for (int prefetch : {0, 1, 2}) {
    for (const std::string mode : {"plain", "overlap", "overlap, tied_early=1"}) {
      const std::string where = "prefetch=" + std::to_string(prefetch) + " " + mode;
      const bool plain = mode == "plain", sent_early = mode == "overlap, tied_early=1";
      auto options = std::map<std::string, std::string>{{"prefetch", std::to_string(prefetch)},
                                                        {"overlap_optimizer", plain ? "0" : "1"}};
      if (sent_early) options["tied_early"] = "1";
      auto s = make_offload(options);
      s->attach(models::build_model(config, 0));
      s->reset_stats();
      s->train_step(batch);
      const auto first_step = s->stats().bytes_h2d;
      s->reset_stats();
      s->optimizer_step();
      s->finish_step();
      const int64_t expected = plain ? expect_auto_opening(*s, model, prefetch, where) : 0;
      // With tied_early the tied matrix went to the device during train_step.
      const auto early = sent_early ? tied_early_bytes(model, batch) : EarlyBytes{};
      if (!plain) {
        EXPECT_EQ(s->last_opening(), 0) << where;
      }
      if (sent_early) {
        EXPECT_GT(early.matrix, 0) << where << ": the GPT's tied matrix is not sparse in its last use";
      }
      EXPECT_EQ(s->stats().bytes_h2d, expected) << where;
      EXPECT_EQ(s->offloaded_bytes_on_device(), expected + early.matrix) << where;
      s->reset_stats();
      s->train_step(batch);
      EXPECT_EQ(s->stats().bytes_h2d, first_step - expected - early.matrix + early.rows) << where;
      s->optimizer_step();
    }
  }
  // `opening` sets how many, whatever prefetch is: none, two, or more than the model has (all).
  const int64_t windows = model.num_blocks();
  for (int64_t opening : {0, 2, 99}) {
    const std::string where = "prefetch=1 opening=" + std::to_string(opening);
    const int64_t expected = opening > 0 ? opening_bytes(model, std::min(opening, windows) - 1) : 0;
    auto s = make_offload({{"prefetch", "1"}, {"opening", std::to_string(opening)}});
    s->attach(models::build_model(config, 0));
    s->train_step(batch);
    s->reset_stats();
    s->optimizer_step();
    EXPECT_EQ(s->stats().bytes_h2d, expected) << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), expected) << where;
    s->forward(batch.input);  // uses them and lets them go
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << where;
  }
}

// A resident block's copy is refreshed inside optimizer_step, as soon as its own update has run
// (beside the rest of the host pass), so the next forward does not open with that fetch: the step
// fetches block 0's window once (its bytes, counted in optimizer_step) and the next train_step
// none of it. Parity with resident blocks is the properties' (they draw resident=...).
TEST(HookOffload, a_resident_block_is_refreshed_in_the_optimizer_step) {
  // prefetch=0: no other window is fetched ahead by optimizer_step (the test above has those).
  auto s = make_offload({{"resident", "0"}, {"prefetch", "0"}});
  const auto config = gpt(3, 16);
  auto model = models::build_model(config, 0);
  const int64_t window0 = window_bytes(model, 0);
  s->attach(std::move(model));
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);
  s->reset_stats();
  s->optimizer_step();
  EXPECT_EQ(s->stats().bytes_h2d, window0) << "the resident window was not refreshed by optimizer_step";
  s->reset_stats();
  s->train_step(batch);
  const auto with_resident = s->stats().bytes_h2d;
  s->optimizer_step();
  // The same bytes as a first step, when nothing was stale yet.
  auto fresh = make_offload({{"resident", "0"}, {"prefetch", "0"}});
  fresh->attach(models::build_model(config, 0));
  fresh->reset_stats();
  fresh->train_step(batch);
  EXPECT_EQ(with_resident, fresh->stats().bytes_h2d) << "the next train_step fetched the resident window again";
}

TEST(HookOffload, resident_blocks_stay_and_only_they_stay) {
  // prefetch=0: optimizer_step then fetches no window for the next forward, so after the step too
  // only the resident block is on the device.
  auto s = make_offload({{"resident", "1"}, {"prefetch", "0"}});
  const auto config = gpt(3, 16);
  auto model = models::build_model(config, 0);
  const int64_t resident = window_bytes(model, 1);
  s->attach(std::move(model));
  s->train_step(models::make_batch(config, 2, 1));
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  EXPECT_EQ(s->stats().devices.at(test::device().str()).resident_param_bytes, resident);
  s->optimizer_step();
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  EXPECT_EQ(s->stats().devices.at(test::device().str()).resident_param_bytes, resident);
}

TEST(HookOffload, bytes_moved_per_step_equal_the_analytic_count) {
  // With windows that never overlap between the embedding and the head (prefetch < blocks - 2):
  // forward fetches every block's window once (with carry_tied, the tied matrix only once: it stays
  // from the embedding to the head), backward every window but the merged last block's,
  // and every trainable parameter's gradient goes back once. The tied embedding/head goes back in
  // full after the head's backward, and then the embedding's gradient: only the rows of the
  // batch's distinct tokens, with their int64 indices, when those are at most half the
  // vocabulary (vocab 64), else in full again (vocab 8, where 16 tokens touch more than half).
  // The same with the overlapped optimizer, which steps the matrix from the head's gradient first
  // (and with tied_early=1 sends it early, its rows at the next fetch); with tied_rows=0 the two
  // uses' gradients are summed on the device and go back once.
  for (const std::string mode : {"plain", "overlap", "overlap, tied_early=1", "tied_rows=0"}) {
  const bool overlap = mode.rfind("overlap", 0) == 0, sent_early = mode == "overlap, tied_early=1";
  for (int64_t vocab : {64, 8}) {
    for (int prefetch : {0, 1}) {
     for (int carry : {0, 1}) {
      auto config = gpt(3, 8);
      config.vocab = vocab;
      auto model = models::build_model(config, 0);
      const auto n = model.num_blocks();
      int64_t forward = 0, backward = 0, grads = 0;
      for (int64_t b = 0; b < n; ++b) {
        forward += window_bytes(model, b);
        if (b != n - 1) backward += window_bytes(model, b);
      }
      for (const auto& p : model.parameters()) grads += p.tensor.numel() * 4;  // each once, tied ones too
      const int64_t once = grads;
      std::map<int64_t, int> uses;
      for (const auto& block : model.block_parameters())
        for (auto p : block) ++uses[p];
      const auto batch = models::make_batch(config, 2, 1);
      const int64_t tokens = std::get<0>(at::_unique(batch.input)).numel();
      int tied = 0;
      for (const auto& [p, count] : uses) {
        if (count != 2) continue;
        ++tied;
        const auto& w = model.parameters()[p].tensor;
        const int64_t rows = w.size(0), cols = w.numel() / rows;
        ASSERT_EQ(rows, vocab);
        // (The overlapped optimizer, whose first part is queued before the rows are counted, sends
        // the rows of a dense last use all the same.)
        if (mode != "tied_rows=0")
          grads += 2 * tokens <= rows || overlap ? tokens * (cols * 4 + 8) : rows * cols * 4;
        if (carry) forward -= w.numel() * 4;  // fetched for the embedding, kept for the head
      }
      ASSERT_EQ(tied, 1) << "the GPT ties its embedding and head";
      std::map<std::string, std::string> options{{"prefetch", std::to_string(prefetch)}, {"carry_tied", std::to_string(carry)}};
      if (overlap) options["overlap_optimizer"] = "1";
      if (sent_early) options["tied_early"] = "1";
      if (mode == "tied_rows=0") options["tied_rows"] = "0";
      auto s = make_offload(options);
      s->attach(std::move(model));
      s->reset_stats();
      s->train_step(batch);
      const auto stats = s->stats();
      const int64_t inputs = batch.input.nbytes() + batch.target.nbytes();
      const std::string where =
          mode + " vocab=" + std::to_string(vocab) + " prefetch=" + std::to_string(prefetch) + " carry_tied=" + std::to_string(carry);
      // With tied_early the tied matrix also goes to the device (at backward's end in this first
      // step) when its last use is sparse, and the next forward's fetch of it then sends only the rows.
      const auto early = sent_early ? tied_early_bytes(s->model(), batch) : EarlyBytes{};
      if (sent_early && vocab == 64) {
        EXPECT_GT(early.matrix, 0) << where;
      }
      EXPECT_EQ(stats.bytes_h2d, forward + backward + inputs + early.matrix) << where;
      EXPECT_EQ(stats.bytes_d2h, grads) << where;
      s->optimizer_step();
      // After a dense last use the tied matrix is summed on the device and sent once; after a
      // sparse one it keeps sending rows.
      s->reset_stats();
      s->train_step(batch);
      EXPECT_EQ(s->stats().bytes_d2h, vocab == 8 ? once : grads) << where << ", second step";
      if (overlap) {  // (plain mode's optimizer_step fetched the opening windows, counted there)
        EXPECT_EQ(s->stats().bytes_h2d, forward + backward + inputs + early.rows) << where << ", second step";
      }
      s->optimizer_step();
      if (overlap) continue;  // it fetches nothing in optimizer_step
      // forward() alone moves what train_step's forward does, less the windows the step fetched.
      s->reset_stats();
      s->forward(batch.input);
      const int64_t opened = expect_auto_opening(*s, s->model(), prefetch, where);
      EXPECT_EQ(s->stats().bytes_h2d, forward + batch.input.nbytes() - opened)
          << where << ", forward()";
     }
    }
  }
  }
}

TEST(HookOffload, a_block_fetched_for_backward_and_again_for_its_recompute_is_released) {
  // Seed 003 loads a block in its backward pre-hook and again in the recompute's forward pre-hook,
  // then releases it once: the block stays on the device. Here the same two requests happen —
  // the backward prefetch of the previous block takes a reference, then that block's own backward
  // takes it again to recompute — and the tied embedding is held by two windows at once (prefetch
  // 4 reaches from the head back to the embedding). Every reference must be returned.
  auto s = make_offload({{"prefetch", "4"}, {"activations", "recompute"}});
  const auto config = gpt(2, 8);  // 4 blocks: the prefetch window covers the whole model
  s->attach(models::build_model(config, 0));
  const auto dev = test::device();
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);
  EXPECT_EQ(s->references_held(), 0);
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  // Peak residency shows the overlap really happened: more than one window at once.
  const auto peak = s->stats().devices.at(dev.str()).peak_param_bytes;
  EXPECT_GT(peak, window_bytes(models::build_model(config, 0), 1));
}

// Peak memory during a step, against a bound derived from the schedule. For a chain of equal
// windows W (an MLP of 256 x 256 blocks) with prefetch p: in forward, block b's window and the p
// ahead of it are held, b's is dropped before b+1 computes; the merged last block stays through
// its own backward, which already prefetches p behind it. So at most (p + 1) W of parameters are
// resident at any moment: a window held one block too long makes it (p + 2) W.
struct PeakCase {
  models::ModelConfig config;
  int64_t window = 0;  ///< W: bytes of every block's window
  models::Batch batch;
};

PeakCase equal_windows() {
  models::ModelConfig c;
  c.kind = models::ModelKind::mlp;
  c.depth = 8;
  c.width = 256;
  c.in_features = 256;
  c.classes = 256;
  c.tied = false;
  auto model = models::build_model(c, 0);
  for (int64_t b = 1; b < model.num_blocks(); ++b) EXPECT_EQ(window_bytes(model, b), window_bytes(model, 0));
  return {c, window_bytes(model, 0), models::make_batch(c, 2, 1)};
}

struct Peak {
  int64_t params = 0;     ///< the strategy's own accounting
  int64_t allocated = 0;  ///< the allocator's, above what is allocated at rest (CUDA only)
};

Peak peak_of_a_step(const PeakCase& pc, const std::map<std::string, std::string>& options) {
  const auto dev = test::device();
  auto s = make_offload(options);
  s->attach(models::build_model(pc.config, 0));
  s->train_step(pc.batch);  // warm-up: library workspaces are allocated once and kept
  s->optimizer_step();
  device::synchronize(dev);
  const auto at_rest = device::allocator_stats(dev).allocated;
  s->reset_stats();
  s->train_step(pc.batch);
  s->finish_backward();
  device::synchronize(dev);
  const auto mem = s->stats().devices.at(dev.str());
  s->optimizer_step();
  return {mem.peak_param_bytes, mem.peak_allocated - at_rest};
}

TEST(HookOffload, peak_memory_stays_under_the_analytic_bound_and_a_late_release_breaks_it) {
  const auto pc = equal_windows();
  const int64_t W = pc.window;
  for (int64_t p : {0, 1, 2}) {
    const std::map<std::string, std::string> options{{"prefetch", std::to_string(p)}};
    const auto right = peak_of_a_step(pc, options);
    EXPECT_LE(right.params, (p + 1) * W) << "prefetch=" << p;
    auto late_options = options;
    late_options["debug_release_late"] = "1";
    const auto late = peak_of_a_step(pc, late_options);
    EXPECT_GT(late.params, (p + 1) * W) << "prefetch=" << p << ": a window held one block too long went unnoticed";
    if (test::device().is_cuda()) {
      // The allocator sees the parameters above, plus gradients in flight: a block's gradients
      // (W), their flat copy for the host (W) and the previous block's flat still copying (W);
      // plus one dropped window whose memory waits for the compute that read it (W); plus
      // activations of a batch of 2 (a few KiB, allowed W / 8).
      const int64_t bound = (p + 1) * W + 4 * W + W / 8;
      EXPECT_LE(right.allocated, bound) << "prefetch=" << p;
      EXPECT_GE(late.allocated, right.allocated + W / 2) << "prefetch=" << p << ": the allocator did not see the late window";
    }
  }
}

// `lead` lets the host run further ahead of the device: a released window whose compute is still
// queued keeps its memory from reuse until that compute has run, so the allocator must reserve
// fresh memory for the next fetch. A compute delay at every block makes sure the host is ahead;
// windows of 16 MiB each take a segment of their own. The windows held do not change with it.
// CUDA only (CudaOnly.* is not listed for the CPU): there compute runs on the calling thread, so
// the host is never ahead.
TEST(CudaOnly, hook_offload_lead_keeps_more_released_windows_pending_on_the_device) {
  const auto dev = test::device();
  ASSERT_TRUE(dev.is_cuda()) << "CudaOnly tests need --device=cuda";
  models::ModelConfig c;
  c.kind = models::ModelKind::mlp;
  c.depth = 8;
  c.width = c.in_features = c.classes = 2048;
  c.tied = false;
  const int64_t W = window_bytes(models::build_model(c, 0), 1);
  const auto batch = models::make_batch(c, 2, 1);
  device::ScopedDelays delays({0ms, 20ms});
  struct Seen {
    int64_t params = 0, reserved = 0;
  };
  auto with_lead = [&](int64_t lead) {
    auto s = make_offload({{"prefetch", "1"}, {"lead", std::to_string(lead)}});
    s->attach(models::build_model(c, 0));
    s->train_step(batch);  // warm-up: optimizer state, library workspaces
    s->optimizer_step();
    device::release_cached_memory(dev);
    const auto at_rest = device::allocator_stats(dev).reserved;
    s->reset_stats();
    s->train_step(batch);
    s->finish_backward();
    device::synchronize(dev);
    const auto mem = s->stats().devices.at(dev.str());
    s->optimizer_step();
    return Seen{mem.peak_param_bytes, mem.peak_reserved - at_rest};
  };
  const auto one = with_lead(1), three = with_lead(3);
  EXPECT_LE(one.params, 2 * W);
  EXPECT_EQ(three.params, one.params) << "lead changed the windows held";
  EXPECT_GE(three.reserved, one.reserved + W)
      << "lead=3 reserved no more than lead=1 (window " << W << " bytes): the host did not run further ahead";
}

// opening=fit on an asynchronous device. A GPT whose wide head sets backward's peak (its logits):
// windows beyond prefetch + 1 fit in that memory, are fetched in the step, and the next step's
// peak allocated is no higher than with the opening at prefetch + 1. An MLP whose activations are
// tiny next to its windows: what it holds at the forward's start must not go past backward's peak
// either (an opening of every window would, by five windows).
TEST(CudaOnly, hook_offload_fitted_opening_fills_what_backward_used_and_no_more) {
  const auto dev = test::device();
  ASSERT_TRUE(dev.is_cuda()) << "CudaOnly tests need --device=cuda";
  struct Seen {
    int64_t opening = 0, peak = 0;
  };
  auto run = [&](const models::ModelConfig& c, int64_t batch_size, const std::string& opening) {
    const auto batch = models::make_batch(c, batch_size, 1);
    auto s = make_offload({{"prefetch", "1"}, {"opening", opening}});
    s->attach(models::build_model(c, 0));
    for (int step = 0; step < 2; ++step) {  // the second step's opening comes from a backward seen
      s->train_step(batch);
      s->optimizer_step();
    }
    device::synchronize(dev);
    s->reset_stats();
    s->train_step(batch);
    s->finish_backward();
    device::synchronize(dev);
    Seen seen{s->last_opening(), s->stats().devices.at(dev.str()).peak_allocated};
    s->optimizer_step();
    return seen;
  };
  const int64_t slack = 1 << 20;  // allocation rounding; a window here is 3 MiB or more
  auto g = models::preset("gpt-tiny").config;
  g.depth = 6;
  g.width = 256;
  g.vocab = 16384;
  g.seq_len = 128;
  const auto gpt_fixed = run(g, 8, "auto"), gpt_fit = run(g, 8, "fit");
  EXPECT_GT(gpt_fit.opening, 2) << "the GPT's head left room for more windows at the forward's start";
  EXPECT_LE(gpt_fit.peak, gpt_fixed.peak + slack)
      << "opening=" << gpt_fit.opening << " raised the GPT's peak from " << gpt_fixed.peak;
  models::ModelConfig m;
  m.kind = models::ModelKind::mlp;
  m.depth = 8;
  m.width = m.in_features = m.classes = 1024;
  m.tied = false;
  const auto mlp_fixed = run(m, 2, "auto"), mlp_fit = run(m, 2, "fit"), mlp_all = run(m, 2, "99");
  EXPECT_LT(mlp_fit.opening, mlp_all.opening) << "fit opened every window of the MLP";
  EXPECT_LE(mlp_fit.peak, mlp_fixed.peak + slack)
      << "opening=" << mlp_fit.opening << " raised the MLP's peak from " << mlp_fixed.peak;
  EXPECT_GT(mlp_all.peak, mlp_fixed.peak + slack) << "an opening of every window should show in the MLP's peak";
}

TEST(HookOffload, forward_only_streams_and_matches_the_baseline) {
  const auto config = gpt(3, 16);
  const auto batch = models::make_batch(config, 2, 1);
  StrategyConfig c;
  c.device = test::device();
  auto base = Registry::create("baseline", c);
  base->attach(models::build_model(config, 0));
  auto expected = base->forward(batch.input).cpu();
  for (int prefetch : {0, 2}) {
    auto s = make_offload({{"prefetch", std::to_string(prefetch)}});
    s->attach(models::build_model(config, 0));
    s->reset_stats();
    auto actual = s->forward(batch.input).cpu();
    EXPECT_TRUE(torch::allclose(actual, expected, 1e-5, 1e-6)) << "prefetch=" << prefetch;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
    EXPECT_GT(s->stats().bytes_h2d, 0);
  }
}

// Delays in every copy and at every compute point: a missing wait would let compute read a buffer
// the copy has not filled yet (poisoned with NaN here), so parity would fail.
TEST(HookOffload, parity_holds_with_injected_delays) {
  device::ScopedDelays delays({2ms, 1ms});
  for (const auto* preset : {"gpt-tiny", "mlp-tied-tiny"}) {
    for (const auto& options : std::vector<std::map<std::string, std::string>>{
             {{"prefetch", "0"}, {"debug_poison", "1"}},
             {{"prefetch", "2"}, {"debug_poison", "1"}},
             {{"prefetch", "2"}, {"lead", "3"}, {"debug_poison", "1"}},
             {{"prefetch", "1"}, {"opening", "99"}, {"debug_poison", "1"}},
             {{"prefetch", "1"}, {"activations", "keep"}, {"debug_poison", "1"}},
             {{"prefetch", "1"}, {"overlap_optimizer", "1"}, {"debug_poison", "1"}},
             // the tied matrix sent early and its rows after (gpt-tiny's last use of it is sparse)
             {{"prefetch", "1"}, {"overlap_optimizer", "1"}, {"tied_early", "1"}, {"debug_poison", "1"}}}) {
      correctness::ParityCase pc;
      pc.model = models::preset(preset).config;
      pc.options = options;
      pc.steps = 2;
      const auto r = correctness::check_parity("hook_offload", pc, test::device());
      EXPECT_TRUE(r.ok) << pc.to_string() << ": " << r.message;
    }
  }
}

TEST(HookOffload, injected_delays_expose_a_missing_wait) {
  // The same check must fail when compute does not wait for its fetches, or it proves nothing.
  device::ScopedDelays delays({5ms, 0ms});
  correctness::ParityCase pc;
  pc.model = models::preset("gpt-tiny").config;
  pc.options = {{"prefetch", "0"}, {"debug_poison", "1"}, {"debug_skip_waits", "1"}};
  pc.steps = 1;
  const auto r = correctness::check_parity("hook_offload", pc, test::device());
  EXPECT_FALSE(r.ok) << "a missing wait went unnoticed";
}

// strata_bench stops backward's timer after finish_backward(): the gradient copies still running
// when train_step returns belong to backward, not to the optimizer step that follows. The step's
// copies to the host are held behind a gate until train_step has returned, so one is in flight then
// for certain (a delay alone was outrun by a GPU shared with a dozen other processes); once the
// gate opens each copy still takes 100 ms, so a finish_backward that does not wait is seen. A
// first step runs ungated: its one-time set-up (pinned host memory, library handles) may wait for
// the whole device, and so for a held copy. mlp-tiny is untied; in the tied presets the tied
// matrix's first use goes down at once and its last use's touched rows (or all of it) follow, added
// on the host. Accumulating (no optimizer_step between the two steps), the second step's gradients
// land in staging buffers and are added on the host.
TEST(HookOffload, finish_backward_leaves_no_gradient_on_its_way) {
  device::ScopedDelays delays({20ms, 0ms});  // copies slow beside the host (checks below), not so slow the test drags
  for (const auto* preset : {"mlp-tiny", "gpt-tiny", "mlp-tied-tiny"}) {
    for (int prefetch : {0, 2}) {
      for (bool accumulate : {false, true}) {
        auto s = make_offload({{"prefetch", std::to_string(prefetch)}});
        const auto config = models::preset(preset).config;
        s->attach(models::build_model(config, 0));
        const auto batch = models::make_batch(config, 2, 1);
        const std::string where = std::string(preset) + " prefetch=" + std::to_string(prefetch) +
                                  (accumulate ? " accumulating" : "");
        s->train_step(batch);
        s->finish_backward();
        if (!accumulate) s->optimizer_step();
        auto gate = std::make_shared<device::Gate>();
        s->hold_gradient_copies(gate);
        // Should train_step itself wait for a held copy, the gate opens after a while and the test
        // fails below instead of hanging.
        OpenLater guard(gate, 30s);
        s->train_step(batch);
        const bool in_flight = s->gradients_in_flight();
        gate->open();
        guard.join();
        EXPECT_FALSE(guard.forced()) << where << ": train_step waited for its own gradient copies to the host";
        EXPECT_TRUE(in_flight) << where << ": no copy was running when train_step returned";
        s->finish_backward();
        EXPECT_FALSE(s->gradients_in_flight()) << where << ": gradients still on their way after finish_backward";
        s->optimizer_step();
      }
    }
  }
}

TEST(HookOffload, bad_options_name_the_value) {
  auto error_of = [](const std::map<std::string, std::string>& o, int64_t blocks = 0) {
    return test::error_of([&] {
      auto opts = HookOffloadOptions::parse(o);
      if (blocks) opts.validate_for(blocks);
    });
  };
  using ::testing::HasSubstr;
  EXPECT_THAT(error_of({{"prefetch", "-1"}}), HasSubstr("prefetch=-1"));
  EXPECT_THAT(error_of({{"lead", "-2"}}), HasSubstr("lead=-2"));
  EXPECT_THAT(error_of({{"opening", "-1"}}), HasSubstr("opening='-1'"));
  EXPECT_THAT(error_of({{"opening", "3x"}}), HasSubstr("opening='3x'"));
  EXPECT_THAT(error_of({{"opening", "99999999999999999999"}}), HasSubstr("opening='99999999999999999999'"));
  EXPECT_THAT(error_of({{"opening", "2"}, {"overlap_optimizer", "1"}}), HasSubstr("opening=2 needs overlap_optimizer=0"));
  EXPECT_THAT(error_of({{"opening", "fit"}, {"overlap_optimizer", "1"}}), HasSubstr("opening=fit needs overlap_optimizer=0"));
  EXPECT_THAT(error_of({{"opening", "fits"}}), HasSubstr("opening='fits'"));
  EXPECT_THAT(error_of({{"activations", "some"}}), HasSubstr("activations='some'"));
  EXPECT_THAT(error_of({{"tied_chunks", "0"}}), HasSubstr("tied_chunks='0' is not valid; use auto or a copy count"));
  EXPECT_THAT(error_of({{"tied_chunks", "-1"}}), HasSubstr("tied_chunks='-1' is not valid"));
  EXPECT_THAT(error_of({{"tied_chunks", "4x"}}), HasSubstr("tied_chunks='4x'"));
  EXPECT_THAT(error_of({{"resident", "9"}}, 4), HasSubstr("resident block 9 does not exist; the model has 4 blocks"));
  EXPECT_THAT(error_of({{"resident", "1,x"}}), HasSubstr("resident='1,x'"));
  EXPECT_THAT(error_of({{"resident_updates", "gpu"}}), HasSubstr("resident_updates='gpu'"));
  EXPECT_THAT(error_of({{"resident_updates", "device"}}), HasSubstr("resident_updates=device trains resident blocks"));
  EXPECT_THAT(error_of({{"resident", "1"}, {"resident_activations", "drop"}}), HasSubstr("resident_activations='drop'"));
  EXPECT_THAT(error_of({{"resident_activations", "recompute"}}),
              HasSubstr("resident_activations=recompute recomputes resident blocks, and resident names none"));
  EXPECT_THAT(error_of({{"resident", "3"}, {"resident_activations", "recompute"}}, 4),
              HasSubstr("resident_activations=recompute names only the last block (3)"));
  EXPECT_THAT(error_of({{"resident", "3"}, {"resident_activations", "recompute"}, {"merge_last", "0"}}, 4), "<no error>");
}

// Which blocks run their forward twice (once more in backward): the non-resident ones with
// activations=recompute, a resident one only with resident_activations=recompute. Counted on blocks
// that count their forward calls.
TEST(HookOffload, resident_blocks_recompute_only_when_asked) {
  models::ModelConfig config;
  config.kind = models::ModelKind::mlp;
  config.in_features = 4;
  config.classes = 3;
  const auto batch = models::Batch{torch::randn({6, 4}, torch::Generator(at::detail::createCPUGenerator(3))),
                                   torch::arange(6, torch::kLong) % 3};
  for (const char* resident_activations : {"keep", "recompute"}) {
    for (const char* activations : {"recompute", "keep"}) {
      std::vector<std::shared_ptr<test::FailingBlock>> counted;
      std::vector<std::shared_ptr<models::Block>> blocks;
      for (int b = 0; b < 3; ++b) {
        counted.push_back(std::make_shared<test::FailingBlock>(4));
        counted.back()->fail_after = 1 << 20;  // never fails; a block counts its calls only when armed
        blocks.push_back(counted.back());
      }
      blocks.push_back(std::make_shared<test::LinearHead>(4, 3));
      auto s = make_offload({{"resident", "1"}, {"resident_activations", resident_activations}, {"activations", activations}});
      s->attach(models::BlockModel(config, blocks));
      s->train_step(batch);
      s->optimizer_step();
      const std::string where = std::string("resident_activations=") + resident_activations + " activations=" + activations;
      const int offloaded = std::string(activations) == "recompute" ? 2 : 1;
      const int resident = std::string(resident_activations) == "recompute" ? 2 : 1;
      EXPECT_EQ(counted[0]->calls.load(), offloaded) << where << ": block 0 (offloaded)";
      EXPECT_EQ(counted[1]->calls.load(), resident) << where << ": block 1 (resident)";
      EXPECT_EQ(counted[2]->calls.load(), offloaded) << where << ": block 2 (offloaded)";
    }
  }
}

// resident_updates=device: the units only resident blocks use (here the GPT's tied embedding and
// head, blocks 0 and 4, and block 1's own) train on the device. In plain and overlapped mode, with
// a step that accumulates two batches (the parity check's second): parity with the baseline, and
// none of their gradients or values cross the link, which the same resident blocks trained on the
// host do every step.
TEST(HookOffload, units_trained_on_the_device_match_the_baseline_and_never_cross_the_link) {
  const auto config = gpt(3, 16);
  ASSERT_TRUE(config.tied);
  auto model = models::build_model(config, 0);
  ASSERT_EQ(model.num_blocks(), 5);
  int64_t on_device_bytes = 0, all_parameters = 0;
  for (const auto& p : model.parameters()) all_parameters += p.tensor.numel();
  {
    std::map<int64_t, std::set<int64_t>> users;  // parameter -> blocks
    const auto blocks = model.block_parameters();
    for (size_t b = 0; b < blocks.size(); ++b)
      for (auto p : blocks[b]) users[p].insert(static_cast<int64_t>(b));
    for (const auto& [p, bs] : users)
      if (std::all_of(bs.begin(), bs.end(), [](int64_t b) { return b == 0 || b == 1 || b == 4; }))
        on_device_bytes += model.parameters()[p].tensor.numel() * 4;
  }
  ASSERT_GT(on_device_bytes, 0);
  for (const auto* strategy : {"hook_offload", "hook_offload_overlap"}) {
    // Recomputed resident blocks too: block 0's recompute, last in backward, must read the tied
    // matrix before the overlapped mode's in-place device update of it (which its own gradient starts).
    for (const auto* resident_activations : {"keep", "recompute"}) {
      correctness::ParityCase c;
      c.model = config;
      c.steps = 3;
      c.options = {{"resident", "0,1,4"}, {"resident_updates", "device"}, {"resident_activations", resident_activations},
                   {"merge_last", "0"}};
      const auto r = correctness::check_parity(strategy, c, test::device());
      EXPECT_TRUE(r.ok) << strategy << " resident_activations=" << resident_activations << ": " << r.message;
    }

    const bool overlap = std::string(strategy) == "hook_offload_overlap";
    auto bytes = [&](const char* where) {
      auto s = make_offload({{"resident", "0,1,4"}, {"resident_updates", where}, {"overlap_optimizer", overlap ? "1" : "0"},
                             {"prefetch", "0"}});
      s->attach(models::build_model(config, 0));
      const auto batch = models::make_batch(config, 2, 1);
      s->train_step(batch);
      s->optimizer_step();
      s->reset_stats();
      s->train_step(batch);
      s->optimizer_step();
      const auto stats = s->stats();
      return std::make_tuple(stats.bytes_h2d, stats.bytes_d2h, stats.host_stepped_parameters);
    };
    const auto [h2d_host, d2h_host, stepped_host] = bytes("host");
    const auto [h2d_device, d2h_device, stepped_device] = bytes("device");
    // What the host optimizer steps (the report's host pass bytes): every parameter, or all but
    // those units'.
    EXPECT_EQ(stepped_host, all_parameters) << strategy;
    EXPECT_EQ(stepped_device, all_parameters - on_device_bytes / 4) << strategy;
    // On the host those units' gradients go down every step, and the tied matrix's touched rows
    // too (tied_rows: 14 of vocab 64, with their int64 indices), and, refreshed after their
    // update, their values come back up.
    const auto batch = models::make_batch(config, 2, 1);
    const int64_t tokens = std::get<0>(at::_unique(batch.input)).numel();
    ASSERT_LE(2 * tokens, config.vocab) << "the embedding's rows must be sparse here";
    EXPECT_EQ(d2h_host - d2h_device, on_device_bytes + tokens * (config.width * 4 + 8)) << strategy;
    EXPECT_EQ(h2d_host - h2d_device, on_device_bytes) << strategy;
    EXPECT_GT(d2h_device, 0) << strategy << ": the offloaded blocks' gradients still go to the host";
  }
}

TEST(HookOffload, overlapped_optimizer_refuses_gradient_accumulation) {
  auto s = make_offload({{"overlap_optimizer", "1"}});
  const auto config = gpt(1, 8);
  s->attach(models::build_model(config, 0));
  const auto batch = models::make_batch(config, 1, 1);
  s->train_step(batch);
  try {
    s->train_step(batch);
    ADD_FAILURE() << "a second train_step without optimizer_step was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr("overlap_optimizer=1"));
  }
}

// Two steps of hook_offload with its optimizer after backward: the second step's loss and the
// parameters after it, which an overlapped run of the same two steps must reach.
struct TwoSteps {
  double loss = 0;
  NamedTensors parameters;
};
TwoSteps two_steps(const std::map<std::string, std::string>& options, const StrategyConfig& base,
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

void expect_same_steps(const TwoSteps& expected, double loss, HookOffload& s, const std::string& where) {
  EXPECT_NEAR(loss, expected.loss, 1e-6 * std::abs(expected.loss)) << where << ": the second forward read stale weights";
  const auto actual = s.parameters();
  ASSERT_EQ(actual.size(), expected.parameters.size()) << where;
  for (size_t i = 0; i < actual.size(); ++i)
    EXPECT_TRUE(torch::allclose(actual[i].second, expected.parameters[i].second, 1e-5, 1e-7))
        << where << ": " << actual[i].first;
}

// overlap_optimizer=1 returns from optimizer_step with host updates still to run: they finish
// while the next step's forward runs, and each block's fetch must wait for its own units. The
// first step's updates are held behind a gate until the second step has asked for a fetch behind
// one of them (queued behind it, or with fetch_order=ready, the default, left unqueued until it
// has run), so its forward surely reaches blocks whose updates have not run; its loss and the
// parameters after it must equal those of hook_offload with its optimizer after backward. A fetch
// that does not wait reads the weights from before the update (seen failing that way). gpt-tiny
// and mlp-tied-tiny are tied (the embedding's update is the last to become ready and the first
// needed); resident=0 keeps block 0 on the device, whose copy is refreshed behind its update
// instead of fetched (with a tied first block, the case where a GPU host ran into the next
// backward before the update that its gradients wait for). Both fetch orders: in_order holds the
// copy stream itself.
TEST(HookOffload, the_next_forward_waits_for_every_overlapped_update) {
  for (const auto* preset : {"gpt-tiny", "mlp-tiny", "mlp-tied-tiny"}) {
    for (const auto& extra : std::vector<std::map<std::string, std::string>>{
             {{"prefetch", "0"}}, {{"prefetch", "2"}}, {{"prefetch", "1"}, {"resident", "0"}},
             {{"prefetch", "2"}, {"fetch_order", "in_order"}},
             {{"prefetch", "1"}, {"resident", "0"}, {"fetch_order", "in_order"}}}) {
      auto options = extra;
      StrategyConfig base;
      base.optimizer.lr = 0.05;  // a step moves the loss well above rounding
      const auto config = models::preset(preset).config;
      const auto first = models::make_batch(config, 2, 1), second = models::make_batch(config, 2, 2);
      std::string where = preset;
      for (const auto& [k, v] : extra) where += " " + k + "=" + v;

      const auto expected = two_steps(options, base, config, first, second);  // the optimizer after backward
      options["overlap_optimizer"] = "1";

      auto s = make_offload(options, base);
      s->attach(models::build_model(config, 0));
      auto gate = std::make_shared<device::Gate>();
      OpenOnExit open_on_exit{gate};  // before s drains its updates on destruction
      s->hold_updates(gate);
      s->train_step(first);
      s->optimizer_step();
      EXPECT_TRUE(s->updates_in_flight()) << where << ": optimizer_step waited for the held updates";
      double loss = 0;
      bool forced = false;
      {
        // Opened 50 ms after the first fetch queued behind a held update: time for a fetch that
        // does not wait to have read the old weights.
        std::optional<std::chrono::steady_clock::time_point> queued;
        OpenLater opener(gate, 30s, [&s, queued]() mutable {
          const auto now = std::chrono::steady_clock::now();
          if (!queued && s->fetches_behind_host_updates() > 0) queued = now;
          return queued && now - *queued > 50ms;
        });
        loss = s->train_step(second);
        opener.join();
        forced = opener.forced();
      }
      EXPECT_FALSE(forced) << where << ": no fetch of the second step was queued behind a held update";
      s->optimizer_step();
      expect_same_steps(expected, loss, *s, where);
      EXPECT_FALSE(s->updates_in_flight()) << where << ": parameters() returned before the updates ran";
      EXPECT_GT(s->stats().fetches_behind_host_updates, 0) << where;  // what the benchmark reports
    }
  }
}

// fetch_order=ready: a fetch whose unit's host update is still running waits for it unqueued, so
// the fetches behind it, of units already updated, reach the link first (at a GPT's step boundary
// the tied embedding's update ends after block 1's). Block 0's update of the first step is held
// until block 1's copy has been queued for the second forward; in forward order (in_order) that
// copy is queued behind block 0's. Either way the second step reads only updated weights: its loss
// and the parameters after it equal those of hook_offload with its optimizer after backward. (Seen
// failing with the deferred copy queued before its update had run: the losses differed.)
TEST(HookOffload, a_fetch_waiting_for_its_update_lets_fetches_of_updated_units_go_first) {
  for (const auto* preset : {"mlp-tiny", "gpt-tiny"}) {
    for (const std::string order : {"ready", "in_order"}) {
      const std::string where = std::string(preset) + " fetch_order=" + order;
      StrategyConfig base;
      base.optimizer.lr = 0.05;
      const auto config = models::preset(preset).config;
      const auto first = models::make_batch(config, 2, 1), second = models::make_batch(config, 2, 2);
      const auto expected = two_steps({{"prefetch", "2"}}, base, config, first, second);

      auto s = make_offload({{"overlap_optimizer", "1"}, {"prefetch", "2"}, {"fetch_order", order}}, base);
      s->attach(models::build_model(config, 0));
      auto gate = std::make_shared<device::Gate>();
      OpenOnExit open_on_exit{gate};
      s->hold_update_of(0, gate);
      s->train_step(first);
      s->optimizer_step();
      EXPECT_TRUE(s->updates_in_flight()) << where << ": block 0's update was not held";
      std::mutex mutex;
      std::vector<int64_t> queued;  // first blocks, in the order their copies were queued
      std::atomic<bool> block1_queued{false};
      s->observe_fetches([&](int64_t first_use) {
        std::lock_guard<std::mutex> lock(mutex);
        queued.push_back(first_use);
        if (first_use == 1) block1_queued = true;
      });
      double loss = 0;
      bool forced = false;
      {
        OpenLater opener(gate, 30s, [&] { return block1_queued.load(); });
        loss = s->train_step(second);
        opener.join();
        forced = opener.forced();
      }
      s->observe_fetches(nullptr);
      EXPECT_FALSE(forced) << where << ": block 1's copy was never queued while block 0's update was held";
      ASSERT_FALSE(queued.empty()) << where;
      const auto at = [&](int64_t b) { return std::find(queued.begin(), queued.end(), b) - queued.begin(); };
      if (order == "ready")
        EXPECT_LT(at(1), at(0)) << where << ": block 1's copy waited behind block 0's, whose update was held; queued "
                                << ::testing::PrintToString(queued);
      else
        EXPECT_LT(at(0), at(1)) << where << ": fetches left forward order; queued " << ::testing::PrintToString(queued);
      s->optimizer_step();
      expect_same_steps(expected, loss, *s, where);
    }
  }
}

// The updates still to run when backward ends are the ones the next forward needs first (the
// first blocks' gradients land last): they must run in block order, or the next forward waits
// for all of them. All of one step's updates are held until backward is over, so the host chooses
// among all of them at once. A first-queued-first-run host (the last block first) fails this.
TEST(HookOffload, updates_left_after_backward_run_in_the_order_the_next_forward_needs) {
  for (const auto* preset : {"gpt-tiny", "mlp-tied-tiny", "mlp-tiny"}) {
    auto s = make_offload({{"overlap_optimizer", "1"}});
    const auto config = models::preset(preset).config;
    s->attach(models::build_model(config, 0));
    auto gate = std::make_shared<device::Gate>();
    OpenOnExit open_on_exit{gate};
    s->hold_updates(gate);
    s->train_step(models::make_batch(config, 2, 1));
    s->finish_backward();  // every gradient on the host
    s->optimizer_step();
    EXPECT_TRUE(s->take_update_order().empty()) << preset << ": an update ran while held";
    gate->open();
    s->finish_step();
    const auto order = s->take_update_order();
    EXPECT_GE(static_cast<int64_t>(order.size()), config.depth) << preset;  // a unit at least per hidden block
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end())) << preset << ": " << ::testing::PrintToString(order);
  }
}

TEST(HookOffload, host_update_time_counts_the_updates_not_the_wait_for_their_gradients) {
  // Gradients held on their way to the host for 300 ms: an overlapped update waits for them, and
  // that wait is not the host optimizer's work. gpt-tiny's updates take far less than the hold.
  // (Without overlap, finish_backward has waited for the copies before any update starts: that
  // pass checks the counter is kept and reset; the overlapped pass is the one a misplaced clock fails.)
  const auto config = models::preset("gpt-tiny").config;
  for (const auto* overlap : {"0", "1"}) {
    SCOPED_TRACE(std::string("overlap_optimizer=") + overlap);
    auto s = make_offload({{"overlap_optimizer", overlap}});
    s->attach(models::build_model(config, 0));
    const auto batch = models::make_batch(config, 2, 1);
    s->train_step(batch);
    s->optimizer_step();
    s->finish_step();
    EXPECT_GT(s->stats().host_update_ms, 0.0) << "a step's host updates were not timed";
    s->reset_stats();
    EXPECT_EQ(s->stats().host_update_ms, 0.0) << "reset_stats kept the host time";
    auto gate = std::make_shared<device::Gate>();
    OpenOnExit open_on_exit{gate};
    s->hold_gradient_copies(gate);
    const auto start = std::chrono::steady_clock::now();
    {
      OpenLater opener(gate, 300ms);
      s->train_step(batch);
      s->finish_backward();
    }
    s->optimizer_step();
    s->finish_step();
    const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const double host_ms = s->stats().host_update_ms;
    EXPECT_GT(host_ms, 0.0);
    EXPECT_LT(host_ms, 150.0) << "the wait for held gradients was counted as host work: " << host_ms << " of a " << wall_ms << " ms step";
  }
}

// tied_chunks: the tied matrix's first part starts once its first range has landed and waits for
// each later one; those waits are not host work either. Every copy is delayed 40 ms here, so the
// three later ranges keep the first part waiting ~120 ms a step; the host's work on this model is
// a few ms.
TEST(HookOffload, host_update_time_leaves_out_the_wait_for_a_tied_gradients_later_ranges) {
  device::ScopedDelays delays({40ms, 0ms});
  const auto config = gpt(2, 8, 64);
  auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_chunks", "4"}});
  s->attach(models::build_model(config, 0));
  s->train_step(models::make_batch(config, 2, 1));
  s->optimizer_step();
  s->finish_step();
  s->reset_stats();
  s->train_step(models::make_batch(config, 2, 2));
  s->optimizer_step();
  s->finish_step();
  EXPECT_EQ(s->ranged_first_parts(), 2);
  const double host_ms = s->stats().host_update_ms;
  EXPECT_GT(host_ms, 0.0);
  EXPECT_LT(host_ms, 60.0) << "the wait for the later ranges was counted as host work";
}

// tied_chunks=auto (the default, and named): the head's gradient of the tied matrix goes in ranges
// where the compute dtype is fp32 and as one copy under bf16; an explicit count holds in either.
TEST(HookOffload, tied_chunks_auto_sends_ranges_in_fp32_and_one_copy_in_bf16) {
  const auto config = gpt(2, 8, 64);
  struct Case {
    std::string precision;
    std::map<std::string, std::string> options;
    int64_t ranged;
  };
  const Case cases[] = {{"fp32", {}, 2},
                        {"fp32", {{"tied_chunks", "auto"}}, 2},
                        {"bf16", {}, 0},
                        {"bf16", {{"tied_chunks", "auto"}}, 0},
                        {"fp32", {{"tied_chunks", "1"}}, 0},
                        {"bf16", {{"tied_chunks", "4"}}, 2}};
  for (const auto& c : cases) {
    auto options = c.options;
    options["overlap_optimizer"] = "1";
    const std::string where = c.precision + ", tied_chunks=" + (c.options.empty() ? "(default)" : c.options.at("tied_chunks"));
    auto base = adamw();
    base.precision = PrecisionPolicy::parse(c.precision);
    auto s = make_offload(options, base);
    s->attach(models::build_model(config, 0));
    for (int step = 0; step < 2; ++step) {
      s->train_step(models::make_batch(config, 2, step + 1));
      s->optimizer_step();
    }
    s->finish_step();
    EXPECT_EQ(s->ranged_first_parts(), c.ranged) << where;
  }
}

// defer_updates=0: optimizer_step itself waits for every update (held here until a thread opens
// the gate; an optimizer_step that returned at once would find them still held).
TEST(HookOffload, without_deferral_optimizer_step_waits_for_every_update) {
  auto s = make_offload({{"overlap_optimizer", "1"}, {"defer_updates", "0"}});
  const auto config = models::preset("gpt-tiny").config;
  s->attach(models::build_model(config, 0));
  auto gate = std::make_shared<device::Gate>();
  OpenOnExit open_on_exit{gate};
  s->hold_updates(gate);
  s->train_step(models::make_batch(config, 2, 1));
  EXPECT_TRUE(s->updates_in_flight()) << "the updates were not held";
  bool in_flight = true;
  {
    OpenLater opener(gate, 100ms);
    s->optimizer_step();
    in_flight = s->updates_in_flight();
  }
  EXPECT_FALSE(in_flight) << "optimizer_step returned with updates still to run";
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {
TEST(HookOffload, a_failed_step_leaves_nothing_held_and_the_next_step_works) {
  // A target of the wrong size makes the loss throw (a host-side check, so also safe on CUDA)
  // after every block's forward ran.
  for (const char* overlap : {"0", "1"}) {
    auto s = make_offload({{"overlap_optimizer", overlap}, {"activations", "keep"}});
    const auto config = gpt(2, 8);
    s->attach(models::build_model(config, 0));
    auto bad = models::make_batch(config, 2, 1);
    bad.target = torch::zeros({3}, torch::kLong);
    EXPECT_THROW(s->train_step(bad), std::exception);
    EXPECT_EQ(s->references_held(), 0) << "overlap=" << overlap;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "overlap=" << overlap;
    const double loss = s->train_step(models::make_batch(config, 2, 1));
    EXPECT_TRUE(std::isfinite(loss));
    s->optimizer_step();
  }
}

// tied_early: a step that fails after its forward took the tied matrix's early copy (its buffer
// handed over, only the rows sent) leaves nothing held, and the steps after it see the same
// weights as without the early copy: their losses are equal to the bit. Vocab 64, so the
// embedding's last use is sparse and the early copy is taken.
TEST(HookOffload, a_failed_step_after_an_early_tied_copy_leaves_nothing_stale) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  for (int early : {0, 1}) {
    const std::string where = "tied_early=" + std::to_string(early);
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    auto bad = models::make_batch(config, 2, 5);
    bad.target = torch::zeros({3}, torch::kLong);
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {  // after two good steps: the early copy of the second is on the device
        const auto matrix = tied_early_bytes(s->model(), bad).matrix;
        EXPECT_EQ(s->offloaded_bytes_on_device(), early ? matrix : 0) << where;
        EXPECT_THROW(s->train_step(bad), std::exception) << where;
        EXPECT_EQ(s->references_held(), 0) << where;
        EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << where << ": the early copy outlived the failed step";
      }
      losses[early].push_back(s->train_step(models::make_batch(config, 2, step + 1)));
      s->optimizer_step();
    }
  }
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i)
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}
}  // namespace
}  // namespace strata

#include "correctness/support/chain.h"
#include "correctness/support/failing_block.h"

namespace strata {
namespace {

// The chain of `spec` with its block `at` (counting the input layer as 0) replaced by a 4-wide
// FailingBlock, built the same way each time; `failing`, when given, receives it.
/// `model` with block `at` replaced by a FailingBlock of `width` (seeded: the same each call).
models::BlockModel with_failing_block(const models::BlockModel& model, size_t at, int64_t width,
                                      std::shared_ptr<test::FailingBlock>* failing) {
  auto blocks = model.blocks();
  torch::manual_seed(7);
  auto f = std::make_shared<test::FailingBlock>(width);
  if (failing) *failing = f;
  blocks[at] = f;
  return models::BlockModel(model.config(), blocks);
}
models::BlockModel with_failing_block(const correctness::ChainSpec& spec, size_t at,
                                      std::shared_ptr<test::FailingBlock>* failing) {
  return with_failing_block(spec.build(0), at, 4, failing);
}

// fetch_order=ready: a forward that fails while a fetch waits, unqueued, for its unit's update lets
// it go with its window (release), so nothing stays held or listed, and the next step, once the
// update has run, computes what hook_offload with its optimizer after backward does. Block 3's
// update of the first step is held; the second forward asks for window 3 (prefetch 2) at block 1,
// which throws. (Seen failing, the process crashing, with release() leaving the fetch listed.)
TEST(HookOffload, a_forward_that_fails_drops_a_fetch_still_waiting_for_its_update) {
  // Blocks: the input layer, the failing one, two linear ones, the head.
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=lin,lin,lin)");
  const auto batch = spec.make_batch(3, 1);
  StrategyConfig base;
  base.optimizer.lr = 0.05;
  auto reference = make_offload({{"prefetch", "2"}}, base);
  reference->attach(with_failing_block(spec, 1, nullptr));
  reference->train_step(batch);
  reference->optimizer_step();
  const double expected = reference->train_step(batch);

  std::shared_ptr<test::FailingBlock> failing;
  auto s = make_offload({{"overlap_optimizer", "1"}, {"prefetch", "2"}}, base);
  s->attach(with_failing_block(spec, 1, &failing));
  auto gate = std::make_shared<device::Gate>();
  OpenOnExit open_on_exit{gate};
  s->hold_update_of(3, gate);
  s->train_step(batch);
  s->optimizer_step();
  failing->fail_after = failing->calls;  // its next forward throws
  {
    // The failed step drains the host's updates: the held one may run once block 1 has thrown.
    const int before = failing->calls;
    OpenLater opener(gate, 30s, [&] { return failing->calls > before; });
    EXPECT_THROW(s->train_step(batch), std::exception);
  }
  EXPECT_EQ(s->references_held(), 0);
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  failing->fail_after = -1;
  const double loss = s->train_step(batch);
  s->optimizer_step();
  EXPECT_NEAR(loss, expected, 1e-6 * std::abs(expected)) << "the step after the failure read stale or missing weights";
}

// A backward that fails after a tied unit's first use was summed on the device (here the block
// between its two uses throws in its recompute) must not leave that partial sum to the next step:
// the next step's gradients of the blocks up to the failure, the shared weight's among them, equal
// the baseline's for the same batch. (The blocks whose gradients already went to the host in the
// failed step are not compared: plain mode keeps them, as an accumulated micro-batch.)
TEST(HookOffload, a_backward_that_fails_between_a_tied_units_uses_leaves_no_partial_sum) {
  // Blocks: the input layer, shared0, the failing one, shared0, the head.
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  auto build = [&](std::shared_ptr<test::FailingBlock>* failing) { return with_failing_block(spec, 2, failing); };
  const auto batch = spec.make_batch(3, 1);
  StrategyConfig c;
  c.device = test::device();
  auto base = Registry::create("baseline", c);
  base->attach(build(nullptr));
  base->train_step(batch);
  const auto expected = base->gradients();
  std::shared_ptr<test::FailingBlock> failing;
  auto s = make_offload({});
  s->attach(build(&failing));
  failing->calls = 0;
  failing->fail_after = 1;  // its forward runs; its recompute in backward throws
  EXPECT_THROW(s->train_step(batch), std::exception);
  EXPECT_EQ(s->references_held(), 0);
  failing->fail_after = -1;
  s->train_step(batch);
  const auto actual = s->gradients();
  ASSERT_EQ(actual.size(), expected.size());
  int compared = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const auto& name = actual[i].first;
    if (name.rfind("3.", 0) == 0 || name.rfind("4.", 0) == 0) continue;
    ++compared;
    EXPECT_TRUE(torch::allclose(actual[i].second.cpu(), expected[i].second.cpu(), 1e-5, 1e-6))
        << name << ": " << actual[i].second << " against the baseline's " << expected[i].second;
  }
  EXPECT_GE(compared, 4);  // the input layer's two, the shared weight and bias of block 1, the failing block's
}

// A backward that fails (here in a block's recompute) sizes no opening: what it was seen using may
// be what ran out. The same probe after a step that completes opens every window.
TEST(HookOffload, a_failed_backward_sizes_no_fitted_opening) {
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  auto model = spec.build(0);
  auto blocks = model.blocks();  // input layer, shared0, lin, shared0, head
  auto failing = std::make_shared<test::FailingBlock>(4);
  blocks[2] = failing;
  auto s = make_offload({{"prefetch", "1"}, {"opening", "fit"}});
  s->attach(models::BlockModel(model.config(), blocks));
  int64_t in_use = int64_t{1} << 30;
  s->read_device_memory_with([&] { return in_use; });
  const auto batch = spec.make_batch(3, 1);
  failing->calls = 0;
  failing->fail_after = 1;  // its forward runs; its recompute in backward throws
  EXPECT_THROW(s->train_step(batch), std::exception);
  in_use = 0;
  s->optimizer_step();
  EXPECT_EQ(s->last_opening(), 2) << "the failed backward's reading sized the opening";
  failing->fail_after = -1;
  s->forward(batch.input);  // lets the opening go
  in_use = int64_t{1} << 30;
  s->train_step(batch);
  in_use = 0;
  s->optimizer_step();
  EXPECT_EQ(s->last_opening(), 5) << "after a backward that completed";
}

// A forward that fails between a shared unit's two uses, while carry_tied keeps it on the device
// for the second (prefetch 0: the later window is not held yet), must return that reference too:
// in train_step and in forward(), nothing stays held and the next step runs. Without carry_tied
// nothing is carried, and the same holds.
TEST(HookOffload, a_forward_that_fails_between_a_shared_units_uses_keeps_nothing_held) {
  const auto spec = correctness::ChainSpec::parse("chain(in=4 width=4 classes=3 blocks=shared0,lin,shared0)");
  for (const char* carry : {"1", "0"}) {
    auto model = spec.build(0);
    auto blocks = model.blocks();  // input layer, shared0, lin, shared0, head
    auto failing = std::make_shared<test::FailingBlock>(4);
    blocks[2] = failing;
    auto s = make_offload({{"prefetch", "0"}, {"carry_tied", carry}});
    s->attach(models::BlockModel(model.config(), blocks));
    const auto batch = spec.make_batch(3, 1);
    const std::string where = std::string("carry_tied=") + carry;
    failing->calls = 0;
    failing->fail_after = 0;  // the first forward call throws
    EXPECT_THROW(s->train_step(batch), std::exception) << where;
    EXPECT_EQ(s->references_held(), 0) << "train_step, " << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "train_step, " << where;
    failing->calls = 0;
    EXPECT_THROW(s->forward(batch.input), std::exception) << where;
    EXPECT_EQ(s->references_held(), 0) << "forward, " << where;
    EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "forward, " << where;
    failing->fail_after = -1;
    EXPECT_TRUE(std::isfinite(s->train_step(batch))) << where;
    s->optimizer_step();
    EXPECT_EQ(s->references_held(), 0) << "after a good step, " << where;
  }
}

// tied_rows changes how a tied matrix's gradient reaches the host and, in the overlapped mode, when
// its step is taken and into which buffer; never the step. With AdamW (whose parity allowance grows
// with the learning rate, so a row stepped twice, or from the wrong start, could pass the parity
// suite) the parameters after each of three steps from no optimizer state must be the same to the
// bit with tied_rows on and off: in plain mode, in the overlapped mode, and there with the updates
// held until backward has ended (every part then runs after every gradient has landed), and there
// with tied_early=1 (the matrix sent early, its rows after; the overlapped mode's default fetches
// it whole, and the held mode cannot send it early). Vocab 64 and 14 distinct tokens: the
// embedding's last use is sparse, so the rows are what travels.
TEST(HookOffload, tied_rows_never_changes_the_step) {
  const auto config = gpt(3, 8, 64);
  const auto base = adamw();
  for (const std::string mode : {"plain", "overlap", "overlap, held", "overlap, tied_early=1"}) {
    std::vector<NamedTensors> trajectory[2];
    int64_t d2h[2] = {0, 0};
    for (int rows : {0, 1}) {
      std::map<std::string, std::string> options{{"tied_rows", std::to_string(rows)}};
      if (mode != "plain") options["overlap_optimizer"] = "1";
      if (mode == "overlap, tied_early=1") options["tied_early"] = "1";
      auto s = make_offload(options, base);
      s->attach(models::build_model(config, 0));
      for (int step = 0; step < 3; ++step) {
        auto gate = std::make_shared<device::Gate>();
        OpenOnExit open_on_exit{gate};
        if (mode == "overlap, held") s->hold_updates(gate);
        s->train_step(models::make_batch(config, 2, step + 1));
        gate->open();
        s->optimizer_step();
        trajectory[rows].push_back(s->parameters());
      }
      d2h[rows] = s->stats().bytes_d2h;
    }
    EXPECT_GT(d2h[1], d2h[0]) << mode << ": with tied_rows=1 the rows did not travel";
    for (int step = 0; step < 3; ++step) {
      const auto& off = trajectory[0][step];
      const auto& on = trajectory[1][step];
      ASSERT_EQ(off.size(), on.size());
      for (size_t i = 0; i < off.size(); ++i)
        EXPECT_TRUE(torch::equal(off[i].second, on[i].second))
            << mode << ", step " << step << ": " << off[i].first << " differs by "
            << (off[i].second - on[i].second).abs().max().item<double>();
    }
    // The steps moved every parameter (a test that compares two frozen models proves nothing).
    for (size_t i = 0; i < trajectory[1][0].size(); ++i)
      EXPECT_FALSE(torch::equal(trajectory[1][0][i].second, trajectory[1][2][i].second)) << mode << ": " << trajectory[1][0][i].first;
  }
}

// tied_early: a rows part that fails after its step but before it gathers the rows leaves the next
// fetch nothing to send but the whole matrix. Every step that succeeds, before and after the error
// is reported (by optimizer_step or the next train_step, whichever comes after it), computes what
// the same steps compute with tied_early=0: their losses are equal to the bit, and the error is
// reported once. (Seen failing with the fetch sending the rows it was never given.)
TEST(HookOffload, a_rows_part_that_fails_before_its_gather_leaves_the_whole_matrix_to_fetch) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  int errors[2] = {0, 0};
  for (int early : {0, 1}) {
    const std::string where = "tied_early=" + std::to_string(early);
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    for (int step = 0; step < 4; ++step) {
      if (step == 1) s->fail_next_gather();  // tied_early=0 gathers nothing: it never fires there
      const auto batch = models::make_batch(config, 2, step + 1);
      bool ran = false;
      for (int attempt = 0; attempt < 2 && !ran; ++attempt) {
        try {
          losses[early].push_back(s->train_step(batch));
          ran = true;
        } catch (const std::exception&) {  // the error reported at the start of the next step
          ++errors[early];
        }
      }
      ASSERT_TRUE(ran) << where << ": step " << step << " failed twice";
      try {
        s->optimizer_step();
      } catch (const std::exception&) {  // or here, once the step's bookkeeping is done
        ++errors[early];
      }
    }
    s->parameters();  // every update has run
  }
  EXPECT_EQ(errors[0], 0);
  EXPECT_EQ(errors[1], 1) << "the injected failure was not reported, or not once";
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}

// Two runs of the same steps, tied_early=0 then 1: the same loss and parameters after every step, to
// the bit, and steps that moved something.
static void expect_same_steps(const std::vector<double> (&losses)[2], const std::vector<NamedTensors> (&params)[2]) {
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) {
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
    ASSERT_EQ(params[0][i].size(), params[1][i].size());
    for (size_t k = 0; k < params[0][i].size(); ++k)
      EXPECT_TRUE(torch::equal(params[0][i][k].second, params[1][i][k].second))
          << "step " << i << ": " << params[0][i][k].first;
  }
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}

// Four complete steps on the batches seeded first_seed, first_seed + 1, ...: each one's loss and the
// parameters after its optimizer step appended, for expect_same_steps.
static void take_steps(HookOffload& s, const models::ModelConfig& config, int first_seed, std::vector<double>& losses,
                       std::vector<NamedTensors>& params) {
  for (int step = 0; step < 4; ++step) {
    losses.push_back(s.train_step(models::make_batch(config, 2, first_seed + step)));
    s.optimizer_step();
    params.push_back(s.parameters());
  }
}

// tied_early: the early copy reads the buffer the tied matrix's first part writes, so it must wait
// for that part. Here every first part sleeps 50 ms on the host before its step, long past the end
// of backward on these small models: steps with tied_early must still compute what tied_early=0's
// do, to the bit (loss and parameters after each of four steps).
TEST(HookOffload, an_early_tied_copy_waits_for_a_slow_first_part) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  std::vector<NamedTensors> params[2];
  for (int early : {0, 1}) {
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    s->slow_first_parts(50ms);
    take_steps(*s, config, 1, losses[early], params[early]);
  }
  expect_same_steps(losses, params);
}

// tied_early: once a last use of the tied matrix was seen sparse, its early copy goes at the first
// backward block boundary after the first part has ended (here each boundary waits for that part,
// so it surely has), not at the end of backward, where the rows part had to wait for the copy's
// read of its buffer. None in the first step (nothing seen yet), one in each step after; the same
// bytes cross the link as when it goes at the end; and the steps compute what tied_early=0's do, to
// the bit, with every fetched buffer poisoned first.
TEST(HookOffload, an_early_tied_copy_goes_during_backward_once_the_last_use_was_sparse) {
  auto config = gpt(3, 8);
  config.vocab = 64;  // 16 tokens touch at most a quarter of the rows
  const auto base = adamw();
  std::vector<double> losses[2];
  std::vector<NamedTensors> params[2];
  for (int early : {0, 1}) {
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}, {"debug_poison", "1"}}, base);
    s->attach(models::build_model(config, 0));
    s->await_first_parts_in_backward(true);
    int64_t h2d_first = 0;
    for (int step = 0; step < 4; ++step) {
      const auto batch = models::make_batch(config, 2, 1);  // the same tokens: the same bytes each step
      s->reset_stats();
      losses[early].push_back(s->train_step(batch));
      const auto h2d = s->stats().bytes_h2d;
      s->optimizer_step();
      params[early].push_back(s->parameters());
      const std::string where = "tied_early=" + std::to_string(early) + ", step " + std::to_string(step);
      EXPECT_EQ(s->early_copies_in_backward(), early ? step : 0) << where;
      if (early) {
        const auto bytes = tied_early_bytes(s->model(), batch);
        ASSERT_GT(bytes.matrix, 0) << where;
        if (step == 0) h2d_first = h2d;  // the whole matrix fetched, and sent early at backward's end
        else EXPECT_EQ(h2d, h2d_first - bytes.matrix + bytes.rows) << where << ": its rows fetched, the matrix sent early";
      }
    }
  }
  expect_same_steps(losses, params);
}

// tied_early: a backward that fails between the head and the embedding, after the tied matrix's
// first part ran, leaves that part's "done" behind (no rows part comes to reset it). The next step's
// early copy must still wait for its own first part, here slow (50 ms, from the failing step on:
// so the failing step sent none during its backward, and the matrix stays seen as sparse). Both
// runs, tied_early 0 and 1, go through the same complete step, the failure and four steps after
// it: the same losses and parameters, to the bit. Once with the head's gradient sent whole, once
// in four row ranges (tied_chunks=4, whose first part the failed backward leaves behind too).
TEST(HookOffload, an_early_tied_copy_after_a_failed_backward_waits_for_its_own_first_part) {
  auto config = gpt(3, 8);
  config.vocab = 64;
  for (const std::string chunks : {"1", "4"}) {
    SCOPED_TRACE("tied_chunks=" + chunks);
    std::vector<double> losses[2];
    std::vector<NamedTensors> params[2];
    for (int early : {0, 1}) {
      std::shared_ptr<test::FailingBlock> failing;  // in place of the second of three blocks
      auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}, {"debug_poison", "1"},
                             {"tied_chunks", chunks}},
                            adamw());
      s->attach(with_failing_block(models::build_model(config, 0), 2, config.width, &failing));
      const auto batch = models::make_batch(config, 2, 1);
      s->train_step(batch);  // the last use seen sparse
      s->optimizer_step();
      s->slow_first_parts(50ms);
      failing->calls = 0;
      failing->fail_after = 1;  // its forward runs; its recompute in backward throws, after the head's
      EXPECT_THROW(s->train_step(batch), std::exception);
      failing->fail_after = -1;
      take_steps(*s, config, 2, losses[early], params[early]);
    }
    expect_same_steps(losses, params);
  }
}

// tied_chunks: the tied matrix's first-use gradient goes to the host in row ranges and the first
// part steps each range once its copy has landed. Every copy is delayed 5 ms here, so the later
// ranges land well after the first part has started: a part that stepped a range before its copy
// landed would read the previous step's gradient there. The steps equal tied_chunks=1's to the
// bit (loss and parameters after each of four steps): with fp32 and with bf16 compute (whose
// first part also writes the bf16 copy that travels), with and without tied_early, for AdamW and
// for SGD with momentum (whose first step starts from no momentum at all), in 4 ranges of the 64
// rows, in 3 uneven ones, and asked for 100 (one a row); and the ranges did go (one ranged first
// part a step).
TEST(HookOffload, a_tied_first_part_in_row_ranges_steps_each_range_once_it_has_landed) {
  device::ScopedDelays delays({5ms, 0ms});
  const auto config = gpt(2, 8, 64);
  struct Case {
    std::string precision, early, optimizer, chunks;
  };
  const Case cases[] = {{"fp32", "0", "adamw", "4"}, {"fp32", "1", "adamw", "4"}, {"bf16", "0", "adamw", "4"},
                        {"bf16", "1", "adamw", "4"}, {"fp32", "0", "adamw", "3"}, {"fp32", "0", "adamw", "100"},
                        {"fp32", "0", "sgd", "4"}};
  for (const auto& c : cases) {
    const std::string where = c.precision + ", tied_early=" + c.early + ", " + c.optimizer + ", tied_chunks=" + c.chunks;
    SCOPED_TRACE(where);
    std::vector<double> losses[2];
    std::vector<NamedTensors> params[2];
    for (int ranged : {0, 1}) {
      auto base = adamw();
      if (c.optimizer == "sgd") {
        base.optimizer.kind = OptimizerKind::sgd;
        base.optimizer.momentum = 0.9;
      }
      base.precision = PrecisionPolicy::parse(c.precision);
      auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", c.early}, {"tied_chunks", ranged ? c.chunks : "1"}}, base);
      s->attach(models::build_model(config, 0));
      take_steps(*s, config, 1, losses[ranged], params[ranged]);
      EXPECT_EQ(s->ranged_first_parts(), ranged ? 4 : 0);
    }
    expect_same_steps(losses, params);
  }
}

// A profiler records through thread-local RecordFunction callbacks: the overlapped updates run on
// the host worker's thread, so their spans reach a trace only if the worker runs them in the
// state of the thread that queued them (strata_compare --profile-steps relies on it). A callback
// registered on this thread alone must see one span per unit update, each named by the unit's
// first block, none on this thread; once removed, the next step's updates record nothing.
namespace {
std::mutex spans_mutex;
std::vector<std::pair<std::string, std::thread::id>> spans;
std::unique_ptr<at::ObserverContext> note_span(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (name.rfind("strata::host_update", 0) == 0) {
    std::lock_guard<std::mutex> lock(spans_mutex);
    spans.emplace_back(name, std::this_thread::get_id());
  }
  return nullptr;
}
}  // namespace

TEST(HookOffload, overlapped_updates_show_in_a_profile_of_the_thread_that_queued_them) {
  const auto config = models::preset("mlp-tiny").config;
  auto s = make_offload({{"overlap_optimizer", "1"}});
  s->attach(models::build_model(config, 0));
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);  // a first step outside the recording: set-up
  s->optimizer_step();
  s->parameters();  // every update of it has run
  {
    std::lock_guard<std::mutex> lock(spans_mutex);
    spans.clear();
  }
  {
    struct Removed {  // also when the step throws: later tests on this thread must not record
      at::CallbackHandle handle;
      ~Removed() { at::removeCallback(handle); }
    } callback{at::addThreadLocalCallback(at::RecordFunctionCallback(note_span).scopes({at::RecordScope::USER_SCOPE}))};
    s->train_step(batch);
    s->optimizer_step();
    s->parameters();
  }
  std::vector<std::pair<std::string, std::thread::id>> seen;
  {
    std::lock_guard<std::mutex> lock(spans_mutex);
    seen = std::exchange(spans, {});
  }
  std::set<std::string> names;
  for (const auto& [name, thread] : seen) {
    names.insert(name);
    EXPECT_NE(thread, std::this_thread::get_id()) << name << " ran on the thread that queued it";
  }
  const int64_t blocks = models::build_model(config, 0).num_blocks();
  EXPECT_EQ(static_cast<int64_t>(seen.size()), blocks) << "one span per unit update (mlp-tiny: one unit a block)";
  for (int64_t b = 0; b < blocks; ++b)
    EXPECT_EQ(names.count("strata::host_update block " + std::to_string(b)), 1u) << "block " << b;
  s->train_step(batch);  // the callback is gone: nothing is recorded, nothing carried over
  s->optimizer_step();
  s->parameters();
  std::lock_guard<std::mutex> lock(spans_mutex);
  EXPECT_TRUE(spans.empty()) << spans.size() << " spans after the callback was removed";
}

TEST(HookOffload, frozen_parameters_are_never_sent_back) {
  // Every block's own unit; blocks 1 and 2 are (partly) frozen: only trainable bytes travel back.
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=4 classes=3 blocks=frozen,frozen_block,lin)");
  auto model = spec.build(0);
  int64_t trainable = 0;
  for (const auto& p : model.parameters())
    if (p.tensor.requires_grad()) trainable += p.tensor.numel() * 4;
  auto s = make_offload({});
  s->attach(std::move(model));
  s->reset_stats();
  s->train_step(spec.make_batch(3, 1));
  EXPECT_EQ(s->stats().bytes_d2h, trainable);
  s->optimizer_step();
  const auto after = s->parameters();
  const auto before = spec.build(0).parameters();
  for (size_t i = 0; i < before.size(); ++i) {
    if (before[i].tensor.requires_grad()) continue;
    EXPECT_TRUE(torch::equal(after[i].second, before[i].tensor)) << before[i].name << " moved";
  }
}

TEST(HookOffload, buffers_live_on_the_device_and_a_recompute_updates_them_once) {
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=4 classes=3 blocks=lin,bn,table)");
  for (const char* activations : {"recompute", "keep"}) {
    auto s = make_offload({{"activations", activations}, {"merge_last", "0"}});
    s->attach(spec.build(0));
    for (const auto& b : s->model().buffers()) EXPECT_EQ(b.tensor.device(), test::device()) << b.name;
    s->train_step(spec.make_batch(4, 1));
    const auto buffers = s->buffers();
    const auto counter = std::find_if(buffers.begin(), buffers.end(),
                                      [](const auto& b) { return b.first == "2.norm.num_batches_tracked"; });
    ASSERT_NE(counter, buffers.end());
    EXPECT_EQ(counter->second.item<int64_t>(), 1) << activations;
    s->optimizer_step();
  }
}

}  // namespace
}  // namespace strata
