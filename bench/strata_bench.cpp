// strata_bench: the benchmark matrix. One Google Benchmark per registered strategy x model preset,
// each of which checks parity on a small batch first and refuses to time a strategy that fails it.
// Formulas of every counter: bench/METRICS.md.
//
//   strata_bench [--device=cpu|cuda:N] [--models=a,b] [--strategies=a,b] [--steps=N]
//                [--peak-tflops=X] [--optimizer=adamw|sgd] [--classes=N] [--batch=N]
//                [--options='key=value;strategy:key=value'] [Google Benchmark flags, e.g.
//                --benchmark_out=out.json --benchmark_out_format=json]
//
// A cell is named strategy/model; with options, strategy[k=v;k=v]/model, and with --classes,
// model[classes=N], so cells of one strategy under different options can share a report and a
// gate baseline. Cells whose options spread a strategy over several devices are timed on the host
// clock with every device synchronised (events on one device would not see the others' work);
// per-device peaks are added as counters peak_allocated_bytes.<device>.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>

#include "bench/common.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/options.h"
#include "strategies/strategy.h"

namespace strata::bench {
namespace {

struct Settings {
  torch::Device device{torch::kCPU};
  std::vector<std::string> models;
  std::vector<std::string> strategies;
  int steps = 5;
  double peak_tflops = 0;  ///< 0: measured once at start
  OptimizerKind optimizer = OptimizerKind::adamw;
  int64_t classes = 0;                         ///< overrides the presets' class count (bert, mlp)
  int64_t batch = 0;                           ///< overrides the presets' batch size
  std::map<std::string, std::string> options;  ///< as given: key=value or strategy:key=value
};

// True when the options place the strategy on more than one distinct device.
bool spans_devices(const std::map<std::string, std::string>& options) {
  const auto it = options.find("devices");
  if (it == options.end()) return false;
  const auto list = split(it->second);
  return std::set<std::string>(list.begin(), list.end()).size() > 1;
}

// Times one phase: CUDA events on the cell's device, or the host clock after synchronising every
// device when the work is spread over several.
class PhaseTimer {
 public:
  PhaseTimer(const torch::Device& device, bool all_devices)
      : watch_(all_devices ? torch::Device(torch::kCPU) : device), all_(all_devices) {}
  void start() {
    if (all_) device::synchronize_all();
    watch_.start();
  }
  void stop() {
    if (all_) device::synchronize_all();
    watch_.stop();
  }
  double elapsed_ms() { return watch_.elapsed_ms(); }

 private:
  device::Stopwatch watch_;
  bool all_;
};

// Dense fp32 matmul rate (TF32 where enabled) on the device: the denominator of MFU.
double measure_peak_tflops(const torch::Device& device) {
  const int64_t n = device.is_cuda() ? 8192 : 1024;
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device));
  for (int i = 0; i < 3; ++i) torch::mm(a, b);
  device::Stopwatch watch(device);
  const int reps = device.is_cuda() ? 20 : 3;
  device::synchronize(device);
  watch.start();
  for (int i = 0; i < reps; ++i) torch::mm(a, b);
  watch.stop();
  const double seconds = watch.elapsed_ms() / 1e3;
  return 2.0 * n * n * n * reps / seconds / 1e12;
}

// Host-to-device bandwidth from pinned memory (1 GiB copies): the link the report compares with.
double measure_h2d_gbps(const torch::Device& device) {
  if (!device.is_cuda()) return 0.0;
  const int64_t bytes = int64_t{1} << 30;
  auto host = device::host_buffer({bytes}, torch::kByte, device);
  auto dev = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kByte).device(device));
  dev.copy_(host, true);
  device::Stopwatch watch(device);
  watch.start();
  for (int i = 0; i < 5; ++i) dev.copy_(host, true);
  watch.stop();
  return 5.0 * bytes / (watch.elapsed_ms() / 1e3) / 1e9;
}

// One cell: a strategy under its options on one preset.
struct Cell {
  std::string strategy;
  std::map<std::string, std::string> options;
  std::string label;  ///< strategy[options], as in the cell's name
  models::Preset preset;
  int index = 0, total = 0;
};

void run_cell(benchmark::State& state, const Settings& settings, const Cell& cell) {
  const auto& strategy_name = cell.strategy;
  const auto& options = cell.options;
  const auto& preset = cell.preset;
  auto log = [&](const std::string& what) {
    std::fprintf(stderr, "[%d/%d] %s on %s: %s\n", cell.index, cell.total, cell.label.c_str(), preset.name.c_str(),
                 what.c_str());
  };
  log("parity check");
  correctness::ParityResult parity;
  try {
    parity = check_before_timing(strategy_name, preset.config, options, settings.device);
  } catch (const std::exception& e) {  // a check that cannot run is this cell's result; the matrix goes on
    parity.ok = false;
    parity.message = std::string("the check could not run: ") + e.what();
  }
  if (!parity.ok) {
    state.SkipWithError(("parity failed, not timed: " + parity.message).c_str());
    state.counters["parity_ok"] = 0;
    for (auto _ : state) {
    }
    return;
  }
  state.counters["parity_ok"] = 1;
  const auto& dev = settings.device;
  try {
    device::release_cached_memory(dev);  // what the previous cell cached is not this one's
    StrategyConfig config;
    config.device = dev;
    config.optimizer.kind = settings.optimizer;
    config.optimizer.lr = 1e-4;
    config.options = options;
    auto strategy = Registry::create(strategy_name, config);
    auto model = models::build_model(preset.config, 0);
    const double items = static_cast<double>(model.items_per_batch(preset.batch_size));
    const double flops_per_step = 3.0 * model.forward_flops_per_item() * items;  // forward + backward
    strategy->attach(std::move(model));
    const auto batch = models::make_batch(preset.config, preset.batch_size, 1);
    log("warm-up");
    warm_up(*strategy, batch);
    double fb_ms = 0, opt_ms = 0;
    int64_t steps = 0;
    const bool all_devices = spans_devices(options);
    PhaseTimer fb(dev, all_devices), opt(dev, all_devices);
    for (auto _ : state) {
      fb.start();
      strategy->train_step(batch);
      fb.stop();
      opt.start();
      strategy->optimizer_step();
      opt.stop();
      const double f = fb.elapsed_ms(), o = opt.elapsed_ms();
      fb_ms += f;
      opt_ms += o;
      ++steps;
      state.SetIterationTime((f + o) / 1e3);
    }
    const auto stats = strategy->stats();
    const auto peaks = peaks_of(stats);
    if (stats.devices.size() > 1) {
      for (const auto& [name, mem] : stats.devices) {
        state.counters["peak_allocated_bytes." + name] = static_cast<double>(mem.peak_allocated);
        state.counters["peak_reserved_bytes." + name] = static_cast<double>(mem.peak_reserved);
      }
    }
    const double step_s = (fb_ms + opt_ms) / 1e3 / steps;
    using benchmark::Counter;
    state.counters["items_per_second"] = Counter(items * steps, Counter::kIsRate);
    state.counters["fwd_bwd_ms"] = fb_ms / steps;
    state.counters["optimizer_ms"] = opt_ms / steps;
    state.counters["peak_allocated_bytes"] = static_cast<double>(peaks.allocated);
    state.counters["peak_reserved_bytes"] = static_cast<double>(peaks.reserved);
    state.counters["peak_param_bytes"] = static_cast<double>(peaks.params);
    state.counters["h2d_bytes_per_step"] = static_cast<double>(stats.bytes_h2d) / steps;
    state.counters["d2h_bytes_per_step"] = static_cast<double>(stats.bytes_d2h) / steps;
    state.counters["interconnect_bytes_per_step"] = static_cast<double>(stats.bytes_interconnect) / steps;
    state.counters["h2d_GBps"] = static_cast<double>(stats.bytes_h2d) / steps / step_s / 1e9;
    state.counters["mfu"] = flops_per_step / step_s / (settings.peak_tflops * 1e12);
    state.counters["oom"] = 0;
    char line[64];
    std::snprintf(line, sizeof line, "%.1f ms/step", step_s * 1e3);
    log(line);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    // Out of memory is a result, not a failure of the run: recorded, and the matrix goes on.
    const bool oom = is_oom(what);
    state.counters["oom"] = oom ? 1 : 0;
    state.SkipWithError(oom ? "out of memory" : what.substr(0, 300).c_str());
    log(oom ? "out of memory" : "error");
  }
}

int run(int argc, char** argv) {
  Settings s;
  s.device = device::cuda_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const std::string& key) -> std::optional<std::string> {
      const auto prefix = "--" + key + "=";
      if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
      return std::nullopt;
    };
    if (auto v = value("device")) s.device = device::parse(*v);
    else if (auto v = value("models")) s.models = split(*v);
    else if (auto v = value("strategies")) s.strategies = split(*v);
    else if (auto v = value("steps")) s.steps = std::stoi(*v);
    else if (auto v = value("peak-tflops")) s.peak_tflops = std::stod(*v);
    else if (auto v = value("optimizer")) s.optimizer = parse_optimizer_kind(*v);
    else if (auto v = value("classes")) s.classes = std::stoll(*v);
    else if (auto v = value("batch")) s.batch = std::stoll(*v);
    else if (auto v = value("options")) s.options = parse_options_arg(*v);
    else rest.push_back(argv[i]);
  }
  STRATA_CHECK(s.steps >= 1, "--steps=" << s.steps << " must be at least 1");
  if (s.models.empty())
    s.models = s.device.is_cuda() ? std::vector<std::string>{"gpt-medium", "gpt-871m"}
                                  : std::vector<std::string>{"mlp-tiny", "gpt-tiny", "bert-tiny"};
  if (s.strategies.empty()) s.strategies = Registry::names();
  for (const auto& m : s.models) models::preset(m);           // unknown names fail before any work
  for (const auto& st : s.strategies) Registry::description(st);
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);
  if (s.peak_tflops <= 0) s.peak_tflops = measure_peak_tflops(s.device);
  const double link = measure_h2d_gbps(s.device);
  std::fprintf(stderr, "device %s: peak %.1f TFLOP/s (matmul, measured or given), H2D %.1f GB/s pinned\n",
               s.device.str().c_str(), s.peak_tflops, link);
  benchmark::AddCustomContext("strata_device", s.device.str());
  benchmark::AddCustomContext("peak_tflops", std::to_string(s.peak_tflops));
  benchmark::AddCustomContext("h2d_link_GBps", std::to_string(link));
  benchmark::AddCustomContext("torch_version", TORCH_VERSION);

  int argc2 = static_cast<int>(rest.size());
  benchmark::Initialize(&argc2, rest.data());
  const int total = static_cast<int>(s.models.size() * s.strategies.size());
  int index = 0;
  for (const auto& m : s.models) {
    auto preset = models::preset(m);
    std::map<std::string, std::string> overrides;  // shown in the cell's name
    if (s.classes > 0) {
      STRATA_CHECK(preset.config.kind != models::ModelKind::gpt,
                   "--classes=" << s.classes << " applies to bert and mlp presets, not to '" << m << "'");
      preset.config.classes = s.classes;
      preset.config.validate();
      overrides["classes"] = std::to_string(s.classes);
    }
    if (s.batch > 0) {
      preset.batch_size = s.batch;
      overrides["batch"] = std::to_string(s.batch);
    }
    preset.name = label_with_options(m, overrides);
    for (const auto& st : s.strategies) {
      Cell cell{st, options_for(s.options, st), "", preset, ++index, total};
      cell.label = label_with_options(st, cell.options);
      // `s` outlives the run of every registered benchmark (RunSpecifiedBenchmarks below).
      benchmark::RegisterBenchmark((cell.label + "/" + preset.name).c_str(),
                                   [&s, cell](benchmark::State& state) { run_cell(state, s, cell); })
          ->UseManualTime()
          ->Iterations(s.steps)
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  try {
    return strata::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "strata_bench: " << e.what() << std::endl;
    return 2;
  }
}
