// strata_train: a small trainer that checkpoints, for runs that must survive a dead rank. Launched
// by torchrun (or strategies/distributed/launch.py), or alone for a world of one. At start it
// resumes from the newest complete checkpoint under --checkpoint-dir, if any; every --every steps
// every rank saves its part (state_files::save_ranks); at the end rank 0 writes the parameters to
// --out (one file, the same bytes for the same values), and beside it eval.pt: a batch no step
// trained on and the model's output for it. Batches depend on the step alone, so a run
// resumed anywhere trains on what an uninterrupted one does.
//
//   torchrun --nproc-per-node=2 --max-restarts=1 strata_train --strategy=sharded --model=gpt-tiny
//       --steps=8 --every=2 --checkpoint-dir=ckpt --out=final
//
// Fault injection for the tests, on the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0):
// --die-at=S kills --die-rank (default 1) with SIGKILL before step S; --die-in-save=S kills it in the
// save after step S, once its own file is written and before the manifest.
//
// --async-save=1: each rank's file is written on a thread of its own while the next steps train
// (state_files::write_rank in a BackgroundSave); the step only waits for training_state()'s copy.
// The checkpoint is made whole (manifest, rename: collective) at the next save or at the end, so
// until then resuming starts from the one before.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "models/check.h"
#include "models/model.h"
#include "strategies/distributed/process_group.h"
#include "strategies/state_files.h"
#include "strategies/strategy.h"

namespace {

using namespace strata;

struct Args {
  std::string strategy = "sharded", model = "gpt-tiny", checkpoint_dir, out, device = "cpu";
  int64_t steps = 8, every = 2, batch = 0, die_at = -1, die_in_save = -1, die_rank = 1, async_save = 0;
};

int64_t int_value(const std::string& key, const std::string& v) {
  try {
    size_t used = 0;
    const auto n = std::stoll(v, &used);
    STRATA_CHECK(used == v.size(), "");
    return n;
  } catch (const std::exception&) {
    STRATA_FAIL("--" << key << "=" << v << " is not a whole number");
  }
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    STRATA_CHECK(arg.rfind("--", 0) == 0 && eq != std::string::npos, "unknown argument '" << arg << "'");
    const auto key = arg.substr(2, eq - 2), v = arg.substr(eq + 1);
    if (key == "strategy") a.strategy = v;
    else if (key == "model") a.model = v;
    else if (key == "device") a.device = v;
    else if (key == "checkpoint-dir") a.checkpoint_dir = v;
    else if (key == "out") a.out = v;
    else if (key == "steps") a.steps = int_value(key, v);
    else if (key == "every") a.every = int_value(key, v);
    else if (key == "batch") a.batch = int_value(key, v);
    else if (key == "die-at") a.die_at = int_value(key, v);
    else if (key == "die-in-save") a.die_in_save = int_value(key, v);
    else if (key == "die-rank") a.die_rank = int_value(key, v);
    else if (key == "async-save") a.async_save = int_value(key, v);
    else STRATA_FAIL("unknown argument '" << arg << "'");
  }
  STRATA_CHECK(a.steps >= 1, "--steps=" << a.steps << " must be 1 or more");
  STRATA_CHECK(a.every >= 1, "--every=" << a.every << " must be 1 or more");
  STRATA_CHECK(a.async_save == 0 || a.async_save == 1, "--async-save=" << a.async_save << " must be 0 or 1");
  return a;
}

void barrier() {
  if (distributed::environment().world_size <= 1) return;
  distributed::barrier(*distributed::group_for(torch::Device(torch::kCPU)));
}

[[noreturn]] void die(const char* where, int64_t step) {
  std::fprintf(stderr, "strata_train: rank %d killed %s step %ld (fault injection)\n",
               distributed::environment().rank, where, static_cast<long>(step));
  std::fflush(stderr);
  std::raise(SIGKILL);
  std::abort();
}

int run(const Args& a) {
  const auto& env = distributed::environment();
  const bool first_attempt = env.restart_count == 0;
  const bool doomed = first_attempt && env.rank == a.die_rank;
  const auto preset = models::preset(a.model);
  const int64_t batch = a.batch > 0 ? a.batch : std::max<int64_t>(preset.batch_size, env.world_size);
  StrategyConfig config;
  config.device = torch::Device(a.device);
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-3;
  auto strategy = Registry::create(a.strategy, config);
  strategy->attach(models::build_model(preset.config, 0));
  int64_t start = 0;
  if (!a.checkpoint_dir.empty()) {
    if (const auto latest = state_files::latest(a.checkpoint_dir); !latest.empty()) {
      const auto manifest = state_files::read_manifest(latest);
      STRATA_CHECK(manifest.model == preset.config.to_string(),
                   latest << " is a checkpoint of " << manifest.model << ", not of " << a.model);
      strategy->load_training_state(state_files::load_all(latest));
      start = manifest.step;
      if (env.rank == 0)
        std::printf("strata_train: resumed from %s (step %ld, saved by %s at world %d; attempt %d)\n", latest.c_str(),
                    static_cast<long>(start), manifest.strategy.c_str(), manifest.world, env.restart_count);
    }
  }
  state_files::BackgroundSave background;
  std::optional<state_files::Manifest> pending;  // a save whose file is being written
  auto finish_pending = [&] {
    if (!pending) return;
    background.wait();
    state_files::finish_ranks(a.checkpoint_dir, *pending, env.rank, env.world_size, barrier);
    pending.reset();
  };
  for (int64_t step = start; step < a.steps; ++step) {
    if (doomed && step == a.die_at) die("before", step);
    const double loss = strategy->train_step(models::make_batch(preset.config, batch, 1000 + static_cast<uint64_t>(step)));
    strategy->optimizer_step();
    if (env.rank == 0) std::printf("strata_train: step %ld loss %.6f\n", static_cast<long>(step + 1), loss);
    std::fflush(stdout);
    if (!a.checkpoint_dir.empty() && (step + 1) % a.every == 0) {
      state_files::Manifest m;
      m.model = preset.config.to_string();
      m.strategy = a.strategy;
      m.step = step + 1;
      state_files::SaveHooks hooks;
      if (doomed && step + 1 == a.die_in_save)
        hooks.after_file = [saved = step + 1](const std::string&) { die("in the save after", saved); };
      if (a.async_save) {
        finish_pending();
        state_files::begin_ranks(a.checkpoint_dir, m.step, env.rank, barrier);
        background.start([dir = a.checkpoint_dir, m, rank = env.rank, state = strategy->training_state(), hooks] {
          state_files::write_rank(dir, m.step, rank, state, hooks);
          return std::string();
        });
        pending = m;
      } else {
        state_files::save_ranks(a.checkpoint_dir, m, env.rank, env.world_size, strategy->training_state(), barrier, hooks);
      }
    }
  }
  finish_pending();
  const auto params = strategy->parameters();  // collective for sharded: every rank
  // A batch no step trained on, and the trained model's output for it: what another framework
  // holding these parameters must compute (bench/peers.py --strata-state).
  const auto eval = models::make_batch(preset.config, batch, 999999);
  const auto logits = strategy->forward(eval.input).to(torch::kCPU);
  if (env.rank == 0 && !a.out.empty()) {
    state_files::Manifest m;
    m.model = preset.config.to_string();
    m.strategy = a.strategy;
    m.step = a.steps;
    const auto saved = state_files::save(
        a.out, m,
        {{"parameters.pt", params}, {"eval.pt", {{"input", eval.input}, {"target", eval.target}, {"logits", logits}}}});
    std::printf("strata_train: %ld steps done; parameters in %s/parameters.pt\n", static_cast<long>(a.steps), saved.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata_train: %s\n", e.what());
    return 1;
  }
}
