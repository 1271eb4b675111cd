// strata_bench: the benchmark matrix. One Google Benchmark per registered strategy x model preset,
// each of which checks parity on a small batch first and refuses to time a strategy that fails it.
// Formulas of every counter: bench/METRICS.md.
//
// Launched as several ranks (torchrun --no-python, strategies/distributed/launch.py), every rank
// runs every cell on cuda:LOCAL_RANK; a step's time is the slowest rank's, each rank's peak is a
// counter peak_allocated_bytes.rank<R>, and rank 0 alone writes the output.
//
// Exit status: 0 when every cell ran or ran out of memory (a result, recorded as such); 1 when any
// cell failed its parity check or errored; 2 for bad arguments.
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
#include <ATen/record_function.h>
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>
#include <cstdio>
#include <numeric>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include "bench/common.h"
#include "models/check.h"
#include "models/threads.h"
#include "strategies/device/device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/optim.h"
#include "strategies/options.h"
#include "strategies/pipeline/pipeline.h"
#include "strategies/strategy.h"

namespace strata::bench {
namespace {

struct Settings {
  torch::Device device{torch::kCPU};
  double datasheet_tflops = 0;  ///< one GPU's, by its datasheet; 0 where unknown (no MFU then)
  std::vector<std::string> models;
  std::vector<std::string> strategies;
  int steps = 5;
  double peak_tflops = 0;  ///< 0: measured once at start
  double dispatch_us = 0;  ///< the host's time to dispatch one small operator, measured at start
  bool host_probes = false;  ///< measure the host triad and pass on the CPU too (a GPU run always does)
  OptimizerKind optimizer = OptimizerKind::adamw;
  PrecisionPolicy precision;                   ///< every cell's; a cell's name shows it unless fp32
  int64_t classes = 0;                         ///< overrides the presets' class count (bert, mlp)
  int64_t batch = 0;                           ///< overrides the presets' batch size
  std::map<std::string, std::string> options;  ///< as given: key=value or strategy:key=value
  int repetitions = 1;                         ///< Google Benchmark's --benchmark_repetitions
  /// Launched as one of several ranks (torchrun, launch.py): every rank runs every cell, each on
  /// its own device; times are the slowest rank's, peaks are per rank, rank 0 reports.
  std::shared_ptr<distributed::Group> ranks;
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

// Every cell's outcome, for the exit status: a parity failure or an error fails the run.
std::vector<Outcome> g_outcomes;

void end_cell(benchmark::State& state, Outcome outcome, const std::string& message) {
  g_outcomes.push_back(outcome);
  if (outcome == Outcome::ok) return;
  state.SkipWithError((prefix_of(outcome) + message.substr(0, 400)).c_str());
}

// The host's CPU class for the gate: model name and logical cores ("Intel(R) Xeon(R) ... x16").
std::string host_cpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown";
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return model + " x" + std::to_string(std::thread::hardware_concurrency());
}

// Distinct GPUs a cell's options put the strategy on (at least one: its main device).
int64_t gpus_used(const std::map<std::string, std::string>& options) {
  const auto it = options.find("devices");
  if (it == options.end()) return 1;
  const auto list = split(it->second);
  return std::max<int64_t>(1, static_cast<int64_t>(std::set<std::string>(list.begin(), list.end()).size()));
}

// Dense matmul rate in the compute dtype (fp32: TF32 where enabled) on the device, measured: the
// denominator of matmul_fraction (MFU's is the datasheet's).
double measure_peak_tflops(const torch::Device& device, torch::ScalarType dtype) {
  // Sizes at which the matrix units run at their rate (a 1024^3 product on a CPU mostly measures
  // thread start-up): 8192^3 on a GPU, 2048^3 (17 GFLOP, a fraction of a second) on a CPU.
  const int64_t n = device.is_cuda() ? 8192 : 2048;
  auto a = torch::randn({n, n}, torch::TensorOptions().device(device).dtype(dtype));
  auto b = torch::randn({n, n}, torch::TensorOptions().device(device).dtype(dtype));
  for (int i = 0; i < (device.is_cuda() ? 3 : 1); ++i) torch::mm(a, b);
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

// The host's memory bandwidth as STREAM's triad counts it (a[i] = b[i] + s c[i] over three 512 MiB
// arrays, on host_threads() threads, 12 bytes per element): what bounds an optimizer that runs on
// the host. Its AdamW pass reads parameter, gradient and both moments and writes three of them, 28
// bytes per parameter counted the same way, so 28 x parameters / this rate is the host pass's
// floor. Each timed pass starts its threads (well under a millisecond of a ~20 ms pass): a slight
// understatement.
double measure_host_triad_gbps() {
  const int64_t n = int64_t{1} << 27;
  const size_t threads = host_threads();  // as many as the host optimizer's passes use
  // Left uninitialised here, so the threads' first pass below is what places the pages (spread
  // over the cores, though not pinned: a later pass may hand a thread another thread's chunk).
  const std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  const int64_t chunk = (n + static_cast<int64_t>(threads) - 1) / static_cast<int64_t>(threads);
  auto pass = [&](auto&& body) {
    std::atomic<int64_t> next{0};
    run_on_threads(threads, [&] {
      for (int64_t k = next++; k * chunk < n; k = next++) body(k * chunk, std::min(n, (k + 1) * chunk));
    });
  };
  pass([&](int64_t begin, int64_t end) {  // first touch
    for (int64_t i = begin; i < end; ++i) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
  });
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    pass([&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) a[i] = b[i] + 0.5f * c[i];
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 12.0 * static_cast<double>(n) / s / 1e9);
  }
  return best;
}

// The host optimizer's own pass at its best on this host: AdamW in place over 2^25 fp32 parameters
// in one tensor (optimizer_update, the fused host loop the offloaded strategies step with, on its
// threads), the best of five passes after one untimed, at 28 bytes per parameter; and the same
// writing a bf16 copy of each updated value as it goes (a bf16 run's travelling copy), at 30. The
// triad shows the host's memory; this shows the loop itself, arithmetic included: the loop with the
// bf16 copy once ran scalar at a quarter of the fp32 loop's rate, which no triad showed
// (bench/notes/bf16-host-pass.md). A cell's pass, over many tensors, reads below
// this. {fp32, with the bf16 copy}, in GB/s.
std::pair<double, double> measure_host_pass_gbps() {
  const int64_t n = int64_t{1} << 25;
  OptimizerConfig config;
  config.kind = OptimizerKind::adamw;
  config.lr = 1e-4;
  auto param = torch::full({n}, 0.5f);
  const auto grad = torch::full({n}, 1e-3f);
  const auto rounded = torch::empty({n}, torch::kBFloat16);
  OptimizerState state;
  auto best_gbps = [&](const torch::Tensor& copy, double bytes_per_param) {
    optimizer_update(config, param, grad, state, copy);  // the moments made and every page touched
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      optimizer_update(config, param, grad, state, copy);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, bytes_per_param * static_cast<double>(n) / s / 1e9);
    }
    return best;
  };
  const double fp32 = best_gbps({}, 28.0);
  return {fp32, best_gbps(rounded, 30.0)};
}

// The host's speed at dispatching small operators to the device: microseconds per out-of-place add
// of two 256-element tensors (dispatch, an output from the caching allocator, a kernel launch),
// the best of five passes of 2,000, each ending once the device has run them. A step made of many
// small kernels (gpt-medium in bf16 on an H200) runs at this speed rather than the device's; the
// gate scales such cells' bars by it across hosts (ci/gate.py, bench/METRICS.md). Where the device
// were slower per kernel than the host per dispatch, this would read the device's time instead.
double measure_host_dispatch_us(const torch::Device& device) {
  const auto x = torch::ones({256}, torch::TensorOptions().device(device));
  auto y = x.clone();
  for (int i = 0; i < 200; ++i) y = torch::add(y, x);  // the allocator's cache and the kernel warmed
  device::synchronize(device);
  constexpr int kOps = 2000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kOps; ++i) y = torch::add(y, x);
    device::synchronize(device);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / kOps;
    best = rep == 0 ? us : std::min(best, us);
  }
  return best;
}

// How much a step slows when the host dispatches more slowly: one untimed step as it is, then one
// in which every top-level ATen operator (on any thread: the caller's, autograd's, a strategy's
// workers; those an operator calls from inside are not delayed again) first spins for `delay_us`
// on the host, the probe's own time for one operator, as if the host took twice as long to
// dispatch each. A step bound by its device hides the delay behind kernels already queued; a step
// of many small kernels grows by about the delay times its operators. The gate lowers such
// cells' bars on hosts that dispatch slower than the baseline's (ci/gate.py, bench/METRICS.md).
struct DispatchSensitivity {
  int64_t ops = 0;              ///< top-level operators of the delayed step (counter host_ops_per_step)
  double step = 0, fwd_bwd = 0; ///< its relative slowdown, whole step and forward+backward
};
std::atomic<int64_t> g_ops{0};
std::atomic<double> g_delay_us{0};  // read by the callback on every thread
// Operators open on this thread, counted from the innermost autograd node running on it: the
// operators a backward node calls are top-level ones, also where the node runs inside the
// caller's own backward operator (on the CPU, autograd runs on the calling thread). The engine's
// own record around each node it evaluates (a function-scope record, not an operator) is passed
// over, so the gradient sums it runs beside the node count as top-level too.
thread_local int t_depth = 0;
thread_local std::vector<int> t_outer;  // the depths that autograd nodes opened on this thread hid
bool engine_record(const at::RecordFunction& fn) {
  static constexpr char kPrefix[] = "autograd::engine::evaluate_function";
  return std::strncmp(fn.name(), kPrefix, sizeof kPrefix - 1) == 0;
}
std::unique_ptr<at::ObserverContext> delay_op(const at::RecordFunction& fn) {
  if (engine_record(fn)) return nullptr;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    t_outer.push_back(t_depth);
    t_depth = 0;
  } else if (t_depth++ == 0) {
    g_ops.fetch_add(1, std::memory_order_relaxed);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(g_delay_us.load());
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  return nullptr;
}
void end_op(const at::RecordFunction& fn, at::ObserverContext*) {
  if (engine_record(fn)) return;
  if (fn.scope() != at::RecordScope::BACKWARD_FUNCTION) {
    --t_depth;
  } else if (!t_outer.empty()) {
    t_depth = t_outer.back();
    t_outer.pop_back();
  }
}

DispatchSensitivity dispatch_sensitivity(Strategy& strategy, const models::Batch& batch, double delay_us,
                                         const torch::Device& device,
                                         const std::shared_ptr<distributed::Group>& ranks) {
  auto timed_step = [&](double& fwd_bwd_ms) {
    strategy.finish_step();
    device::synchronize_all();
    const auto start = std::chrono::steady_clock::now();
    strategy.train_step(batch);
    strategy.finish_backward();
    device::synchronize_all();
    const auto backward_end = std::chrono::steady_clock::now();
    strategy.optimizer_step();
    strategy.finish_step();
    device::synchronize_all();
    fwd_bwd_ms = std::chrono::duration<double, std::milli>(backward_end - start).count();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  // Pairs of steps, plain then delayed: three where the first pair took under a third of a second
  // (gpt-medium's), else one (gpt-871m's); the median of the pairs' ratios. Launched as several
  // ranks, every rank runs as many pairs as the slowest rank's first pair allows (their steps meet
  // in collectives).
  std::vector<double> step_ratios, fwd_bwd_ratios;
  int64_t ops = 0;
  int pairs = 1;
  const auto begin = std::chrono::steady_clock::now();
  for (int pair = 0; pair < pairs; ++pair) {
    double fb_plain = 0, fb_delayed = 0;
    const double plain = timed_step(fb_plain);
    g_ops = 0;
    g_delay_us = delay_us;
    double delayed = 0;
    {
      struct Delaying {
        at::CallbackHandle handle = at::addGlobalCallback(
            at::RecordFunctionCallback(delay_op, end_op)
                .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
        ~Delaying() { at::removeCallback(handle); }
      } delaying;
      delayed = timed_step(fb_delayed);
    }
    ops = g_ops.load();
    if (plain > 0) step_ratios.push_back(delayed / plain - 1.0);
    if (fb_plain > 0) fwd_bwd_ratios.push_back(fb_delayed / fb_plain - 1.0);
    if (pair == 0) {
      double first_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      if (ranks) {
        auto t = torch::tensor({first_s}, torch::TensorOptions().dtype(torch::kDouble).device(device));
        ranks->all_reduce(t, /*max=*/true).wait();
        first_s = t.cpu()[0].item<double>();
      }
      pairs = first_s * 3 < 1.0 ? 3 : 1;
    }
  }
  strategy.reset_stats();  // as warm_up left them: these steps are no repetition's
  auto slowdown = [](const std::vector<double>& ratios) { return ratios.empty() ? 0.0 : std::max(0.0, median(ratios)); };
  return {ops, slowdown(step_ratios), slowdown(fwd_bwd_ratios)};
}

// One cell: a strategy under its options on one preset.
struct Cell {
  std::string strategy;
  std::map<std::string, std::string> options;
  std::string label;  ///< strategy[options], as in the cell's name
  models::Preset preset;
  int index = 0, total = 0;
};

// What a cell keeps from its first repetition to its last: the parity verdict, and the strategy
// built, attached and warmed up once (building an 871M-parameter model per repetition would cost
// more device time than the repetitions measure). Released after the last repetition.
struct Live {
  correctness::ParityResult parity;
  std::unique_ptr<Strategy> strategy;
  models::Batch batch;
  double items = 0, flops_per_step = 0, parameters = 0;
  int repetitions_done = 0;
  Outcome setup = Outcome::ok;  ///< how building and warming up ended
  std::string setup_error;
  int64_t allocated_at_start = 0;  ///< device bytes allocated before the strategy was built
  DispatchSensitivity dispatch;    ///< the step's slowdown under slower dispatching (above)
  double dispatch_us = 0;          ///< the dispatch probe, measured again as the cell starts
};
std::map<std::string, Live> g_live;

void run_cell(benchmark::State& state, const Settings& settings, const Cell& cell) {
  const auto& strategy_name = cell.strategy;
  const auto& options = cell.options;
  const auto& preset = cell.preset;
  const auto key = cell.label + "/" + preset.name;
  auto& live = g_live[key];
  const bool first = live.repetitions_done++ == 0;
  struct Release {  // after the last repetition, whatever happens
    bool last;
    std::string key;
    ~Release() {
      if (last) g_live.erase(key);
    }
  } release{live.repetitions_done >= settings.repetitions, key};
  auto log = [&](const std::string& what) {
    std::fprintf(stderr, "[%d/%d] %s on %s (repetition %d of %d): %s\n", cell.index, cell.total, cell.label.c_str(),
                 preset.name.c_str(), live.repetitions_done, settings.repetitions, what.c_str());
  };
  const auto& dev = settings.device;
  if (first) {
    log("parity check");
    try {
      live.parity = check_before_timing(strategy_name, preset.config, options, dev, settings.precision);
    } catch (const std::exception& e) {  // a check that cannot run is this cell's result; the matrix goes on
      live.parity = {false, std::string("the check could not run: ") + e.what()};
    }
    if (live.parity.ok) {
      try {
        device::release_cached_memory(dev);  // what the previous cell cached is not this one's
        // What is still allocated now is no cell's: an earlier cell left it, and it counts in this
        // cell's peak. Shown, so a leak is seen where it starts rather than as later cells' growth.
        live.allocated_at_start = device::allocator_stats(dev).allocated;
        if (live.allocated_at_start > (1 << 20))
          log("warning: " + std::to_string(live.allocated_at_start >> 20) + " MiB still allocated on " + dev.str() +
              " before this cell began (left by an earlier cell); it counts in this cell's peak");
        StrategyConfig config;
        config.device = dev;
        config.optimizer.kind = settings.optimizer;
        config.optimizer.lr = 1e-4;
        config.precision = settings.precision;
        config.options = options;
        live.strategy = Registry::create(strategy_name, config);
        auto model = models::build_model(preset.config, 0);
        live.items = static_cast<double>(model.items_per_batch(preset.batch_size));
        live.flops_per_step = 3.0 * model.forward_flops_per_item() * live.items;  // forward + backward
        live.parameters = static_cast<double>(model.parameter_count());
        live.strategy->attach(std::move(model));
        live.batch = models::make_batch(preset.config, preset.batch_size, 1);
        log("warm-up");
        warm_up(*live.strategy, live.batch);
        live.dispatch = dispatch_sensitivity(*live.strategy, live.batch, settings.dispatch_us, dev, settings.ranks);
        // The probe again, once per cell: the gate takes the median of the readings of a run's cells
        // of one precision (one invocation's cells read 5.67-25.8 us on one host).
        live.dispatch_us = measure_host_dispatch_us(dev);
      } catch (const std::exception& e) {
        live.strategy.reset();
        live.setup_error = e.what();
        live.setup = is_oom(live.setup_error) ? Outcome::out_of_memory : Outcome::error;
      }
    }
  }
  if (!live.parity.ok || live.setup != Outcome::ok) {
    if (!live.parity.ok)
      end_cell(state, Outcome::parity_failed, "not timed: " + live.parity.message);
    else
      end_cell(state, live.setup, live.setup_error);
    log(live.parity.ok ? (live.setup == Outcome::out_of_memory ? "out of memory" : "error") : "parity failed");
    for (auto _ : state) {
    }
    return;
  }
  state.counters["parity_ok"] = 1;
  auto& strategy = live.strategy;
  const auto& batch = live.batch;
  const double items = live.items, flops_per_step = live.flops_per_step;
  try {
    if (!first) {
      device::synchronize_all();
      strategy->reset_stats();
    }
    double fb_ms = 0, opt_ms = 0;
    int64_t steps = 0;
    const bool all_devices = spans_devices(options);
    PhaseTimer fb(dev, all_devices), opt(dev, all_devices);
    // Host updates that a step leaves running (hook_offload_overlap) are waited for by the next
    // step; the repetition's last step waits for its own, so a repetition of N steps times N
    // steps' work whatever runs between repetitions.
    strategy->finish_step();
    int64_t iteration = 0;
    for (auto _ : state) {
      fb.start();
      strategy->train_step(batch);
      strategy->finish_backward();  // gradients still on their way belong to backward's time
      fb.stop();
      opt.start();
      strategy->optimizer_step();
      if (++iteration == state.max_iterations) strategy->finish_step();
      opt.stop();
      double f = fb.elapsed_ms(), o = opt.elapsed_ms();
      if (settings.ranks) {  // a step takes as long as its slowest rank
        auto t = torch::tensor({f, o}, torch::TensorOptions().dtype(torch::kDouble).device(dev));
        settings.ranks->all_reduce(t, /*max=*/true).wait();
        t = t.cpu();
        f = t[0].item<double>();
        o = t[1].item<double>();
      }
      fb_ms += f;
      opt_ms += o;
      ++steps;
      state.SetIterationTime((f + o) / 1e3);
    }
    const auto stats = strategy->stats();
    auto peaks = peaks_of(stats);
    // The probe once more, after this repetition's steps: a reading per repetition, taken while the
    // host was in the state those steps saw. The cell's one reading at its start has misled in
    // both directions (bench/notes/gate-dispatch.md); these
    // are recorded for choosing the gate's estimator, which does not read them yet.
    const double dispatch_after_us = measure_host_dispatch_us(dev);
    if (settings.ranks) {  // every rank's peak, named after its device
      const auto w = settings.ranks->size(), r = settings.ranks->rank();
      auto all = torch::zeros({2, w}, torch::TensorOptions().dtype(torch::kDouble).device(dev));
      all[0][r] = static_cast<double>(peaks.allocated);
      all[1][r] = static_cast<double>(peaks.reserved);
      settings.ranks->all_reduce(all).wait();
      all = all.cpu();
      for (int64_t k = 0; k < w; ++k) {
        const auto name = "rank" + std::to_string(k);  // cuda:LOCAL_RANK repeats over nodes
        state.counters["peak_allocated_bytes." + name] = all[0][k].item<double>();
        state.counters["peak_reserved_bytes." + name] = all[1][k].item<double>();
      }
      peaks.allocated = static_cast<int64_t>(all[0].max().item<double>());
      peaks.reserved = static_cast<int64_t>(all[1].max().item<double>());
    } else if (stats.devices.size() > 1) {
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
    state.counters["allocated_at_start_bytes"] = static_cast<double>(live.allocated_at_start);
    state.counters["host_ops_per_step"] = static_cast<double>(live.dispatch.ops);
    state.counters["host_dispatch_us"] = live.dispatch_us;
    state.counters["host_dispatch_us_after"] = dispatch_after_us;
    state.counters["dispatch_slowdown"] = live.dispatch.step;
    state.counters["dispatch_slowdown_fwd_bwd"] = live.dispatch.fwd_bwd;
    // A pipeline timing its actions: its schedule simulated under the last step's measured action
    // costs, beside the measured forward + backward (bench/METRICS.md).
    if (auto* pipe = dynamic_cast<Pipeline*>(strategy.get())) {
      if (options.count("time_actions")) state.counters["simulated_fwd_bwd_ms"] = pipe->simulated_ms();
      // Ranks on their own host threads sharing a device: its allocator peak may follow their
      // timing; what the schedule decides (micro-batches held at once) does not.
      state.counters["ranks_share_a_device"] = pipe->ranks_share_a_device() ? 1 : 0;
      const auto& held = pipe->peak_in_flight();
      state.counters["peak_in_flight"] = static_cast<double>(std::accumulate(held.begin(), held.end(), 0));
    }
    state.counters["peak_reserved_bytes"] = static_cast<double>(peaks.reserved);
    state.counters["peak_param_bytes"] = static_cast<double>(peaks.params);
    state.counters["h2d_bytes_per_step"] = static_cast<double>(stats.bytes_h2d) / steps;
    state.counters["d2h_bytes_per_step"] = static_cast<double>(stats.bytes_d2h) / steps;
    state.counters["interconnect_bytes_per_step"] = static_cast<double>(stats.bytes_interconnect) / steps;
    state.counters["h2d_GBps"] = static_cast<double>(stats.bytes_h2d) / steps / step_s / 1e9;
    // Against the GPUs the cell uses: the datasheet's figure (MFU), and the rate measured at start.
    const double achieved = flops_per_step / step_s / 1e12;
    const double gpus = static_cast<double>(strategy->world_size() > 1 ? strategy->world_size() : gpus_used(options));
    if (settings.datasheet_tflops > 0) state.counters["mfu"] = achieved / (settings.datasheet_tflops * gpus);
    state.counters["matmul_fraction"] = achieved / (settings.peak_tflops * gpus);
    state.counters["gpus"] = gpus;
    // Gradients that travel to the host are stepped there: the host's memory bandwidth sets the
    // optimizer's time (the gate then compares device time only across hosts of another class).
    state.counters["optimizer_on_host"] = stats.bytes_d2h > 0 ? 1 : 0;
    // Updates deferred into the next step: its forward waits for the host, so fwd_bwd_ms is no
    // longer device time alone (the gate then compares no time across host classes).
    state.counters["fetches_behind_host_updates"] = static_cast<double>(stats.fetches_behind_host_updates) / steps;
    // The host optimizer's own time: with the step time, how long the host sat idle.
    if (stats.host_update_ms > 0) state.counters["host_update_ms"] = stats.host_update_ms / steps;
    state.counters["parameters"] = live.parameters;
    // Of them, those the host optimizer steps, where the strategy counts them (fewer than all when
    // some units train on the device): the host pass's bytes are theirs.
    if (stats.host_stepped_parameters > 0)
      state.counters["host_parameters"] = static_cast<double>(stats.host_stepped_parameters);
    state.counters["oom"] = 0;
    end_cell(state, Outcome::ok, "");
    char line[64];
    std::snprintf(line, sizeof line, "%.1f ms/step", step_s * 1e3);
    log(line);
  } catch (const std::exception& e) {
    // Out of memory is a result, not a failure of the run: recorded, and the matrix goes on; the
    // later repetitions of this cell report the same.
    live.strategy.reset();
    live.setup_error = e.what();
    live.setup = is_oom(live.setup_error) ? Outcome::out_of_memory : Outcome::error;
    end_cell(state, live.setup, live.setup_error);
    log(live.setup == Outcome::out_of_memory ? "out of memory" : "error");
  }
}

constexpr const char* kUsage =
    "usage: strata_bench [--device=cpu|cuda:N] [--models=a,b] [--strategies=a,b] [--steps=N] [--batch=N]\n"
    "                    [--classes=N] [--optimizer=sgd|adamw] [--precision=fp32|bf16|fp16[,k=v]]\n"
    "                    [--options='k=v;strategy:k=v'] [--peak-tflops=X] [--host-probes]\n"
    "                    [Google Benchmark's --benchmark_* flags] | --list | --list-strategies | --help\n"
    "The benchmark matrix: every strategy x model preset a cell, each parity-checked before it is timed.\n"
    "  --models        presets (--list shows them; default gpt-cpu,bert-tiny on the CPU,\n"
    "                  gpt-medium,gpt-871m on a GPU)\n"
    "  --strategies    registered strategies (default: every one that needs no options;\n"
    "                  --list-strategies prints that list, one per line)\n"
    "  --options       options for every strategy, or strategy:key=value for one, ';'-separated\n"
    "  --precision     compute dtype over fp32 master weights, with overrides (bf16,transfer=fp32,\n"
    "                  reduce=bf16; fp16 adds loss scaling: scale=N,growth=N); default fp32\n"
    "  --peak-tflops   the matmul rate to report against (default: measured at start, in that dtype)\n"
    "  --host-probes   measure the host's triad and optimizer pass on the CPU too (a GPU run always does)\n"
    "  --benchmark_out=FILE --benchmark_out_format=json --benchmark_repetitions=N: Google Benchmark's\n"
    "Counters and formulas: bench/METRICS.md.\n";

int run(int argc, char** argv) {
  Settings s;
  s.device = device::cuda_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s%s", kUsage, kExitStatuses);
      return 0;
    }
    if (arg == "--list") {
      print_list();
      return 0;
    }
    if (arg == "--list-strategies") {  // for scripts: what a run without --strategies covers, one per line
      for (const auto& name : Registry::default_names()) std::printf("%s\n", name.c_str());
      return 0;
    }
    auto value = [&](const std::string& key) -> std::optional<std::string> {
      const auto prefix = "--" + key + "=";
      if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
      return std::nullopt;
    };
    if (arg == "--host-probes") s.host_probes = true;
    else if (auto v = value("device")) s.device = device::parse(*v);
    else if (auto v = value("models")) s.models = split(*v);
    else if (auto v = value("strategies")) s.strategies = split(*v);
    else if (auto v = value("steps")) s.steps = static_cast<int>(int_arg("steps", *v));
    else if (auto v = value("peak-tflops")) s.peak_tflops = real_arg("peak-tflops", *v);
    else if (auto v = value("optimizer")) s.optimizer = parse_optimizer_kind(*v);
    else if (auto v = value("precision")) s.precision = PrecisionPolicy::parse(*v);
    else if (auto v = value("classes")) s.classes = int_arg("classes", *v);
    else if (auto v = value("batch")) s.batch = int_arg("batch", *v);
    else if (auto v = value("options")) s.options = parse_options_arg(*v);
    else {
      // Google Benchmark's own flags pass through; anything else is a mistake to name now.
      STRATA_CHECK(arg.rfind("--benchmark_", 0) == 0 || arg.rfind("--v=", 0) == 0,
                   "unknown argument '" << arg << "' (strata_bench --help lists the arguments)");
      if (auto v = value("benchmark_repetitions")) s.repetitions = std::max<int>(1, static_cast<int>(int_arg("benchmark_repetitions", *v)));
      rest.push_back(argv[i]);
    }
  }
  STRATA_CHECK(s.steps >= 1, "--steps=" << s.steps << " must be at least 1");
  s.device = distributed::rank_device(s.device);
  if (s.models.empty())
    s.models = s.device.is_cuda() ? std::vector<std::string>{"gpt-medium", "gpt-871m"}
                                  : std::vector<std::string>{"gpt-cpu", "bert-tiny"};
  if (s.strategies.empty()) s.strategies = Registry::default_names();
  for (const auto& m : s.models) models::preset(m);           // unknown names fail before any work
  for (const auto& st : s.strategies) Registry::description(st);
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);
  if (s.peak_tflops <= 0) s.peak_tflops = measure_peak_tflops(s.device, s.precision.compute);
  const auto device_name = device::name(s.device);
  s.datasheet_tflops = datasheet_tflops(device_name, /*tf32=*/true, s.precision.compute);
  const double link = measure_h2d_gbps(s.device);
  // Measured where a host optimizer serves a GPU (hook_offload, sharded_offload); 0 on the CPU.
  // --host-probes: on the CPU too (for checking them). Of several launched ranks only rank 0, whose
  // context is the one reported, probes, while the others wait: theirs would share the host with it.
  const auto& env = distributed::environment();
  const bool host_probes = (s.device.is_cuda() || s.host_probes) && (!env.launched || env.rank == 0);
  const double host_triad = host_probes ? measure_host_triad_gbps() : 0.0;
  const auto host_pass = host_probes ? measure_host_pass_gbps() : std::pair<double, double>{0.0, 0.0};
  s.dispatch_us = measure_host_dispatch_us(s.device);
  const double dispatch_us = s.dispatch_us;
  std::fprintf(stderr,
               "device %s (%s): matmul %.1f TFLOP/s measured or given, %.1f by datasheet; H2D %.1f GB/s pinned; "
               "host triad %.1f GB/s; host pass %.1f GB/s, %.1f writing a bf16 copy; host dispatch %.2f us an "
               "operator\n",
               s.device.str().c_str(), device_name.c_str(), s.peak_tflops, s.datasheet_tflops, link, host_triad,
               host_pass.first, host_pass.second, dispatch_us);
  benchmark::AddCustomContext("strata_device", s.device.str());
  benchmark::AddCustomContext("device_name", device_name);
  benchmark::AddCustomContext("host_cpu", host_cpu());
  benchmark::AddCustomContext("peak_tflops", std::to_string(s.peak_tflops));
  benchmark::AddCustomContext("datasheet_tflops", std::to_string(s.datasheet_tflops));
  benchmark::AddCustomContext("h2d_link_GBps", std::to_string(link));
  benchmark::AddCustomContext("host_triad_GBps", std::to_string(host_triad));
  benchmark::AddCustomContext("host_pass_GBps", std::to_string(host_pass.first));
  benchmark::AddCustomContext("host_pass_bf16_GBps", std::to_string(host_pass.second));
  benchmark::AddCustomContext("host_dispatch_us", std::to_string(dispatch_us));
  benchmark::AddCustomContext("torch_version", TORCH_VERSION);
  benchmark::AddCustomContext("precision", s.precision.to_string());

  if (env.launched && env.world_size > 1) {
    s.ranks = distributed::group_for(s.device);
    benchmark::AddCustomContext("ranks", std::to_string(env.world_size));
    if (env.rank != 0) {  // rank 0 reports; the others run the same cells, silently
      rest.erase(std::remove_if(rest.begin() + 1, rest.end(),
                                [](char* a) { return std::string(a).rfind("--benchmark_out", 0) == 0; }),
                 rest.end());
      if (!std::freopen("/dev/null", "w", stdout)) std::perror("strata_bench: /dev/null");
    }
  }
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
      // Launched over several ranks, the cell's name says how many, as the peers' names do.
      auto shown = cell.options;
      if (!s.precision.is_fp32()) shown["precision"] = s.precision.to_string();
      if (distributed::environment().launched && distributed::environment().world_size > 1)
        shown["ranks"] = std::to_string(distributed::environment().world_size);
      cell.label = label_with_options(st, shown);
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
  const auto failed = std::count_if(g_outcomes.begin(), g_outcomes.end(), fails_the_run);
  const auto oom = std::count(g_outcomes.begin(), g_outcomes.end(), Outcome::out_of_memory);
  std::fprintf(stderr, "strata_bench: %zu cell runs: %zu ran, %ld out of memory (recorded), %ld failed parity or errored\n",
               g_outcomes.size(), static_cast<size_t>(std::count(g_outcomes.begin(), g_outcomes.end(), Outcome::ok)),
               static_cast<long>(oom), static_cast<long>(failed));
  return failed > 0 ? 1 : 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) { return strata::bench::tool_main("strata_bench", strata::bench::run, argc, argv); }
