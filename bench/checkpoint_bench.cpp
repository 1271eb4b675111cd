// strata_checkpoint bench: how long a checkpoint of a model's whole training state takes to write
// and to read back, per strategy, and how long an asynchronous save holds up training.
//
// For each strategy: one training step (so AdamW's moments exist), then per repetition
//  - save: training_state() (the state copied to the host) and state_files::save() of it;
//  - load, after one more step has moved the parameters on: state_files::load_all() ("read")
//    and load_training_state() ("restore"), to the device's last copy; the parameters after it
//    must equal those saved, bit for bit (else the row is an error);
//  - async: training_state() and the start of a BackgroundSave, which is all the step waits for
//    ("blocked"); then one training step while the file is written, and the wait for it.
// Rows (Google Benchmark's JSON, as strata_bench's): checkpoint_save/S/MODEL, checkpoint_load/S/MODEL
// and checkpoint_async_blocked/S/MODEL, with bytes, GB_per_s and the async one's share of the
// synchronous save. bench/peers.py --checkpoint-dir writes DCP's rows for the same model. A
// strategy that runs out of memory is a result (its row says so); an error or a load that does not
// bring back the saved parameters fails the run.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common.h"
#include "strategies/device/device.h"
#include "strategies/state_files.h"

namespace strata::bench {
namespace {

struct BenchArgs {
  std::string model = "gpt-871m", device = "cuda:0", dir, json;
  std::vector<std::string> strategies = {"baseline", "hook_offload", "sharded"};
  int64_t repetitions = 3, batch = 0;
};

BenchArgs parse_bench(int argc, char** argv) {
  BenchArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    STRATA_CHECK(arg.rfind("--", 0) == 0 && eq != std::string::npos, "bench: unknown argument '" << arg << "'");
    const auto key = arg.substr(2, eq - 2), v = arg.substr(eq + 1);
    auto number = [&] {
      try {
        size_t used = 0;
        const auto n = std::stoll(v, &used);
        if (used == v.size() && n >= 1) return n;
      } catch (const std::exception&) {
      }
      STRATA_FAIL("bench: --" << key << "=" << v << " must be a whole number, 1 or more");
    };
    if (key == "model") a.model = v;
    else if (key == "device") a.device = v;
    else if (key == "dir") a.dir = v;
    else if (key == "json") a.json = v;
    else if (key == "repetitions") a.repetitions = number();
    else if (key == "batch") a.batch = number();
    else if (key == "strategies") {
      a.strategies.clear();
      std::istringstream in(v);
      for (std::string s; std::getline(in, s, ',');)
        if (!s.empty()) a.strategies.push_back(s);
      STRATA_CHECK(!a.strategies.empty(), "bench: --strategies= names none");
    } else {
      STRATA_FAIL("bench: unknown argument '" << arg << "'");
    }
  }
  STRATA_CHECK(!a.dir.empty(), "bench: --dir=DIR (where the checkpoints are written, on the disk to measure) is required");
  return a;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

int64_t bytes_of(const std::string& checkpoint) {
  int64_t n = 0;
  for (const auto& f : state_files::read_manifest(checkpoint).files) n += f.bytes;
  return n;
}

std::string row(const std::string& name, double ms, int64_t reps, const std::string& extra) {
  std::ostringstream out;
  out << "{\"name\": " << json_string(name) << ", \"run_name\": " << json_string(name)
      << ", \"run_type\": \"iteration\", \"iterations\": " << reps << ", \"real_time\": " << ms
      << ", \"cpu_time\": " << ms << ", \"time_unit\": \"ms\"" << extra << "}";
  return out.str();
}

// The rows of one strategy; an Error (out of memory included) becomes its error row.
std::vector<std::string> measure(const BenchArgs& a, const std::string& strategy, const torch::Device& dev) {
  const auto& preset = models::preset(a.model);
  const int64_t batch_size = a.batch > 0 ? a.batch : preset.batch_size;
  StrategyConfig config;
  config.device = dev;
  config.optimizer.kind = OptimizerKind::adamw;
  config.optimizer.lr = 1e-4;
  config.options = Registry::required_options(strategy);
  auto s = Registry::create(strategy, config);
  s->attach(models::build_model(preset.config, 0));
  const auto batch = models::make_batch(preset.config, batch_size, 1);
  auto step = [&] {
    s->train_step(batch);
    s->optimizer_step();
  };
  step();
  device::synchronize(dev);
  state_files::Manifest m;
  m.model = preset.config.to_string();
  m.strategy = strategy;
  std::vector<double> state_ms, save_ms, read_ms, load_ms, blocked_ms, step_ms, written_ms;
  int64_t bytes = 0;
  for (int64_t r = 0; r < a.repetitions; ++r) {
    const auto dir = (std::filesystem::path(a.dir) / ("strata-" + strategy)).string();
    state_files::remove_tree(dir);
    m.step = 2 * r + 1;
    auto t0 = std::chrono::steady_clock::now();
    const auto state = s->training_state();
    state_ms.push_back(ms_since(t0));
    const auto saved = state_files::save(dir, m, {{"state.pt", state}});
    save_ms.push_back(ms_since(t0));
    bytes = bytes_of(saved);
    const auto before = s->parameters();
    step();  // the parameters move on; the load must bring back those saved
    t0 = std::chrono::steady_clock::now();
    auto read = state_files::load_all(saved);
    read_ms.push_back(ms_since(t0));
    s->load_training_state(read);
    read.clear();  // the files' tensors freed inside the time, as a load that reads and restores in one call frees them
    device::synchronize(dev);
    load_ms.push_back(ms_since(t0));
    const auto after = s->parameters();
    STRATA_CHECK(after.size() == before.size(), "the load changed the parameter count");
    for (size_t i = 0; i < after.size(); ++i)
      STRATA_CHECK(torch::equal(after[i].second, before[i].second),
                   "parity failed: '" << after[i].first << "' differs after the load from what was saved");
    // Asynchronous: what the step waits for, then a step while the file is written.
    state_files::BackgroundSave background;
    m.step = 2 * r + 2;
    t0 = std::chrono::steady_clock::now();
    auto copy = s->training_state();
    background.start([dir, m, state = std::move(copy)] { return state_files::save(dir, m, {{"state.pt", state}}); });
    blocked_ms.push_back(ms_since(t0));
    const auto t1 = std::chrono::steady_clock::now();
    step();
    device::synchronize(dev);
    step_ms.push_back(ms_since(t1));
    background.wait();
    written_ms.push_back(ms_since(t0));
    state_files::remove_tree(dir);
    std::fprintf(stderr, "strata_checkpoint bench: %s: save %.0f ms (state %.0f), load %.0f ms (read %.0f), async blocks %.0f ms, %.3f GB\n",
                 strategy.c_str(), save_ms.back(), state_ms.back(), load_ms.back(), read_ms.back(), blocked_ms.back(), bytes / 1e9);
  }
  const auto suffix = strategy + "/" + a.model;
  const double gb = static_cast<double>(bytes) / 1e9;
  std::ostringstream save_extra, load_extra, async_extra;
  save_extra << ", \"bytes\": " << bytes << ", \"GB_per_s\": " << gb / (mean(save_ms) / 1e3)
             << ", \"state_ms\": " << mean(state_ms) << ", \"write_ms\": " << mean(save_ms) - mean(state_ms);
  load_extra << ", \"bytes\": " << bytes << ", \"GB_per_s\": " << gb / (mean(load_ms) / 1e3)
             << ", \"read_ms\": " << mean(read_ms) << ", \"restore_ms\": " << mean(load_ms) - mean(read_ms);
  async_extra << ", \"bytes\": " << bytes << ", \"of_sync_save\": " << mean(blocked_ms) / mean(save_ms)
              << ", \"step_ms_while_writing\": " << mean(step_ms) << ", \"written_ms\": " << mean(written_ms);
  return {row("checkpoint_save/" + suffix, mean(save_ms), a.repetitions, save_extra.str()),
          row("checkpoint_load/" + suffix, mean(load_ms), a.repetitions, load_extra.str()),
          row("checkpoint_async_blocked/" + suffix, mean(blocked_ms), a.repetitions, async_extra.str())};
}

}  // namespace

int checkpoint_bench(int argc, char** argv) {
  const auto a = parse_bench(argc, argv);
  const auto dev = device::parse(a.device);
  std::vector<std::string> rows;
  int failed = 0;
  for (const auto& strategy : a.strategies) {
    try {
      for (auto& r : measure(a, strategy, dev)) rows.push_back(std::move(r));
    } catch (const std::exception& e) {
      std::string message = e.what();
      const auto outcome = message.rfind("parity failed", 0) == 0 ? Outcome::parity_failed
                           : is_oom(message)                     ? Outcome::out_of_memory
                                                                 : Outcome::error;
      if (outcome != Outcome::parity_failed) message = prefix_of(outcome) + message;
      std::fprintf(stderr, "strata_checkpoint bench: %s: %s\n", strategy.c_str(), message.c_str());
      rows.push_back("{\"name\": " + json_string("checkpoint_save/" + strategy + "/" + a.model) +
                     ", \"run_type\": \"iteration\", \"error_occurred\": true, \"error_message\": " +
                     json_string(message.substr(0, 300)) + "}");
      if (fails_the_run(outcome)) ++failed;
    }
    device::release_cached_memory(dev);  // what this strategy cached is not the next one's
  }
  std::ostringstream out;
  out << "{\n\"context\": {\"strata_device\": " << json_string(dev.str())
      << ", \"device_name\": " << json_string(dev.is_cuda() ? device::name(dev) : "cpu")
      << ", \"model\": " << json_string(a.model) << ", \"checkpoint_dir\": " << json_string(a.dir)
      << ", \"repetitions\": " << a.repetitions << "},\n\"benchmarks\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) out << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
  out << "]\n}\n";
  if (a.json.empty()) {
    std::printf("%s", out.str().c_str());
  } else {
    std::ofstream f(a.json);
    f << out.str();
    STRATA_CHECK(f, "bench: cannot write --json=" << a.json);
  }
  return failed ? 1 : 0;
}

}  // namespace strata::bench
