// hook_offload, gradients to the host and what crosses the link: parts sent during a block's backward, bytes
// moved against the analytic count, waits exposed by injected delays, and the options' errors.
// Shared helpers: correctness/support/hook_offload_testing.h.
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
#include "correctness/support/hook_offload_peer.h"
#include "correctness/support/hook_offload_testing.h"

namespace strata {
namespace {

using namespace std::chrono_literals;
using offload_test::make_offload;
using offload_test::gpt;
using offload_test::OpenLater;
using offload_test::window_bytes;
using offload_test::EarlyBytes;
using offload_test::tied_early_bytes;
using offload_test::expect_auto_opening;

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

// grads_in_parts (auto, which is 1 in fp32): the blocks' own gradients go to the host in parts queued
// during their backward (block_gradients' sink), in gpt-tiny and an MLP; with grads_in_parts=0, none does.
// Parity of both is the parity suite's (the generators draw grads_in_parts=0 too).
TEST(HookOffload, a_blocks_gradients_go_in_parts_while_its_backward_runs) {
  for (const auto* preset : {"gpt-tiny", "mlp-tiny"}) {
    const auto config = models::preset(preset).config;
    const auto batch = models::make_batch(config, 2, 1);
    for (const char* early : {"1", "0"}) {
      auto s = make_offload({{"grads_in_parts", early}});
      s->attach(models::build_model(config, 0));
      s->reset_stats();
      s->train_step(batch);
      s->finish_backward();
      const auto moved = s->stats().bytes_d2h;
      if (std::string(early) == "1")
        EXPECT_GE(HookOffloadTestPeer(*s).gradient_part_transfers(), config.depth) << preset << ": parts that went during backward";
      else
        EXPECT_EQ(HookOffloadTestPeer(*s).gradient_part_transfers(), 0) << preset;
      s->optimizer_step();
      // The same bytes either way: parts, not more.
      auto other = make_offload({{"grads_in_parts", std::string(early) == "1" ? "0" : "1"}});
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
    auto s = make_offload({{"grads_in_parts", early}}, bf16);
    s->attach(models::build_model(config, 0));
    s->reset_stats();
    s->train_step(models::make_batch(config, 2, 1));
    s->finish_backward();
    if (std::string(early) == "auto")
      EXPECT_EQ(HookOffloadTestPeer(*s).gradient_part_transfers(), 0) << "bf16, grads_in_parts=auto";
    else
      EXPECT_GE(HookOffloadTestPeer(*s).gradient_part_transfers(), config.depth) << "bf16, grads_in_parts=1";
  }
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
        HookOffloadTestPeer(*s).hold_gradient_copies(gate);
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
  EXPECT_THAT(error_of({{"grads_early", "1"}}), HasSubstr("grads_early is called grads_in_parts now"));
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

}  // namespace
}  // namespace strata
