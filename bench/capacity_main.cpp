// strata_capacity: the largest model each strategy trains on this machine, measured by bisection
// and predicted by bench/memory_model.h, or (--fit) which strategies train one given model here.
//
//   strata_capacity [--device=cuda:0] [--model=gpt-871m] [--scale=depth|width|classes]
//                   [--strategies=a,b] [--min=N] [--max=N] [--resolution=N] [--batch=N]
//                   [--precision=fp32] [--optimizer=adamw] [--steps=2] [--options='k=v;strategy:k=v']
//                   [--device-memory=GiB] [--host-memory=GiB] [--timeout=S] [--json=FILE]
//   strata_capacity --fit=PRESET [--size=N --scale=AXIS] [same options]
//
// Each probe (a size of the axis, for one strategy) runs in a process of its own: the strategy
// is parity-checked on the tiny model of the same kind first (once per strategy, here), then the
// probe builds the model at that size, trains one warm-up step and --steps timed ones (forward,
// backward, optimizer), and reports its step time and peaks. A device out-of-memory, or a host
// one (the allocator's error, the --host-memory cap, or the process killed by SIGKILL, which the
// kernel's out-of-memory killer sends), is the answer "does not fit"; anything else is an error
// that ends that strategy's search. --device-memory caps the CUDA caching allocator (its memory
// fraction) to emulate a smaller card; --host-memory caps what a probe's process may add to its
// resident memory after start-up (LibTorch and CUDA loaded), which includes building the model on
// the host (4 bytes a parameter) for every strategy.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench/capacity.h"
#include "bench/common.h"
#include "bench/memory_model.h"
#include "strategies/optim.h"

namespace strata {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr const char* kProbeTag = "strata_capacity probe: ";

struct Args {
  std::string device, model = "gpt-871m", scale = "depth", fit, json, options_text, optimizer = "adamw";
  std::vector<std::string> strategies;
  int64_t min = 0, max = 0, resolution = 0, batch = 0, size = 0, steps = 2, timeout_s = 900;
  double device_memory_gib = 0, host_memory_gib = 0;
  PrecisionPolicy precision;
  std::string precision_text = "fp32";
  std::map<std::string, std::string> options;
  // A probe's own (the parent passes them).
  bool probe = false, predict_only = false;
  std::string strategy, config;
};

const char* kUsage =
    "usage: strata_capacity [--device=cuda:0] [--model=PRESET] [--scale=depth|width|classes]\n"
    "                       [--strategies=a,b] [--min=N] [--max=N] [--resolution=N] [--batch=N]\n"
    "                       [--precision=fp32|bf16|fp16] [--optimizer=adamw|sgd] [--steps=N]\n"
    "                       [--options='k=v;strategy:k=v'] [--device-memory=GiB] [--host-memory=GiB]\n"
    "                       [--timeout=S] [--json=FILE]\n"
    "       strata_capacity --fit=PRESET [--scale=AXIS --size=N] [the same options]\n"
    "       strata_capacity --predict [--size=N] [the same options]\n"
    "  --scale         the axis searched: depth (layers), width (a multiple of heads x 8), classes (bert)\n"
    "  --min, --max    the sizes searched (default: the axis' step, and twice the predicted largest)\n"
    "  --resolution    stop when the largest that trains and the smallest that does not are this close\n"
    "  --steps         timed training steps per probe, after one warm-up step\n"
    "  --device-memory emulate a card of this many GiB (the CUDA caching allocator's cap)\n"
    "  --host-memory   cap what a probe may add to its host memory, in GiB\n"
    "  --timeout       seconds a probe may run before it is stopped (an error)\n"
    "  --fit           which strategies train this preset here, fastest first\n"
    "  --predict       the memory model's answer alone (no probe, no parity check): each strategy's\n"
    "                  predicted largest size, and its bytes at --size (default: the preset's)\n"
    "exit status: 0 every search ran (out of memory is an answer); 1 a strategy failed parity or a\n"
    "probe errored; 2 a bad argument (named on stderr)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* key) -> const char* {
      const std::string prefix = std::string("--") + key + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else if (arg == "--probe") {
      a.probe = true;
    } else if (arg == "--predict") {
      a.predict_only = true;
    } else if (const char* v = value("device")) {
      a.device = v;
    } else if (const char* v = value("model")) {
      a.model = v;
    } else if (const char* v = value("scale")) {
      a.scale = v;
    } else if (const char* v = value("fit")) {
      a.fit = v;
    } else if (const char* v = value("json")) {
      a.json = v;
    } else if (const char* v = value("strategies")) {
      a.strategies = split(v, ',');
    } else if (const char* v = value("options")) {
      a.options_text = v;
      a.options = bench::parse_options_arg(v);
    } else if (const char* v = value("optimizer")) {
      a.optimizer = v;
      parse_optimizer_kind(a.optimizer);
    } else if (const char* v = value("precision")) {
      a.precision_text = v;
      a.precision = PrecisionPolicy::parse(v);
    } else if (const char* v = value("min")) {
      a.min = bench::int_arg("min", v);
      STRATA_CHECK(a.min >= 1, "--min=" << a.min << " must be at least 1");
    } else if (const char* v = value("max")) {
      a.max = bench::int_arg("max", v);
      STRATA_CHECK(a.max >= 1, "--max=" << a.max << " must be at least 1");
    } else if (const char* v = value("resolution")) {
      a.resolution = bench::int_arg("resolution", v);
      STRATA_CHECK(a.resolution >= 1, "--resolution=" << a.resolution << " must be at least 1");
    } else if (const char* v = value("batch")) {
      a.batch = bench::int_arg("batch", v);
      STRATA_CHECK(a.batch >= 1, "--batch=" << a.batch << " must be at least 1");
    } else if (const char* v = value("size")) {
      a.size = bench::int_arg("size", v);
      STRATA_CHECK(a.size >= 1, "--size=" << a.size << " must be at least 1");
    } else if (const char* v = value("steps")) {
      a.steps = bench::int_arg("steps", v);
      STRATA_CHECK(a.steps >= 1 && a.steps <= 100, "--steps=" << a.steps << " must be 1 to 100");
    } else if (const char* v = value("timeout")) {
      a.timeout_s = bench::int_arg("timeout", v);
      STRATA_CHECK(a.timeout_s >= 1, "--timeout=" << a.timeout_s << " must be at least 1 second");
    } else if (const char* v = value("device-memory")) {
      a.device_memory_gib = bench::real_arg("device-memory", v);
      STRATA_CHECK(a.device_memory_gib > 0, "--device-memory=" << v << " must be above 0 GiB");
    } else if (const char* v = value("host-memory")) {
      a.host_memory_gib = bench::real_arg("host-memory", v);
      STRATA_CHECK(a.host_memory_gib > 0, "--host-memory=" << v << " must be above 0 GiB");
    } else if (const char* v = value("strategy")) {
      a.strategy = v;
    } else if (const char* v = value("config")) {
      a.config = v;
    } else {
      STRATA_FAIL("unknown argument '" << arg << "' (strata_capacity --help lists the arguments)");
    }
  }
  if (a.device.empty()) a.device = torch::cuda::is_available() ? "cuda:0" : "cpu";
  STRATA_CHECK(a.size == 0 || !a.fit.empty() || a.predict_only,
               "--size=" << a.size << " is for --fit and --predict (the search picks its own sizes)");
  return a;
}

// Resident and peak resident bytes of this process (Linux /proc).
int64_t status_field(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field))) * 1024;  // kB
  return 0;
}
int64_t rss_bytes() { return status_field("VmRSS:"); }
int64_t peak_rss_bytes() { return status_field("VmHWM:"); }

int64_t meminfo_field(const char* field) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field))) * 1024;
  return 0;
}

std::string probe_line(const bench::Probe& p) {
  std::ostringstream out;
  out << kProbeTag << "outcome=" << static_cast<int>(p.outcome) << " step_ms=" << p.step_ms
      << " parameters=" << p.parameters << " peak_device=" << p.peak_device << " peak_host=" << p.peak_host
      << " message=" << p.message;
  std::string s = out.str();
  for (auto& ch : s)
    if (ch == '\n') ch = ' ';
  return s + "\n";
}

bench::Probe parse_probe_line(const std::string& line) {
  bench::Probe p;
  std::istringstream in(line.substr(std::strlen(kProbeTag)));
  std::string item;
  while (in >> item) {
    const auto eq = item.find('=');
    const auto key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "message") {
      std::string rest;
      std::getline(in, rest);
      p.message = value + rest;
      break;
    }
    if (key == "outcome") p.outcome = static_cast<bench::ProbeOutcome>(std::stoi(value));
    if (key == "step_ms") p.step_ms = std::stod(value);
    if (key == "parameters") p.parameters = std::stoll(value);
    if (key == "peak_device") p.peak_device = std::stoll(value);
    if (key == "peak_host") p.peak_host = std::stoll(value);
  }
  return p;
}

// The probe itself, in its own process: one model size, one strategy.
int run_probe(const Args& a) {
  const int64_t base = rss_bytes();
  if (a.host_memory_gib > 0) {
    const auto cap = static_cast<int64_t>(a.host_memory_gib * kGiB);
    std::thread([base, cap] {
      for (;;) {
        const auto grown = rss_bytes() - base;
        if (grown > cap) {
          bench::Probe p;
          p.outcome = bench::ProbeOutcome::host_oom;
          p.peak_host = grown;
          p.message = "the host memory cap (--host-memory) was passed: " + std::to_string(grown) + " bytes above start";
          const auto line = probe_line(p);
          (void)!write(STDOUT_FILENO, line.data(), line.size());
          _exit(3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }).detach();
  }
  const auto dev = device::parse(a.device);
  if (a.device_memory_gib > 0) device::limit_memory(dev, static_cast<int64_t>(a.device_memory_gib * kGiB));
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);
  bench::Probe p;
  try {
    const auto config = models::ModelConfig::parse(a.config);
    StrategyConfig sc;
    sc.device = dev;
    sc.optimizer.kind = parse_optimizer_kind(a.optimizer);
    sc.optimizer.lr = 1e-4;
    sc.precision = a.precision;
    sc.options = bench::options_for(a.options, a.strategy);
    auto strategy = Registry::create(a.strategy, sc);
    auto model = models::build_model(config, 0);
    p.parameters = model.parameter_count();
    strategy->attach(std::move(model));
    const auto batch = models::make_batch(config, a.batch, 1);
    std::vector<double> ms;
    for (int64_t i = 0; i <= a.steps; ++i) {  // the first is the warm-up
      const auto t0 = std::chrono::steady_clock::now();
      strategy->train_step(batch);
      strategy->optimizer_step();
      strategy->finish_step();
      device::synchronize_all();
      if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    p.step_ms = bench::median(ms);
    p.peak_device = bench::peaks_of(strategy->stats()).allocated;
    p.outcome = bench::ProbeOutcome::trains;
  } catch (const std::exception& e) {
    p.message = bench::for_the_user(e.what());
    if (!bench::is_oom(p.message))
      p.outcome = bench::ProbeOutcome::error;
    else
      p.outcome = dev.is_cuda() && p.message.find("can't allocate memory") == std::string::npos
                      ? bench::ProbeOutcome::device_oom
                      : bench::ProbeOutcome::host_oom;
    if (dev.is_cuda()) p.peak_device = device::allocator_stats(dev).peak_allocated;
    if (p.message.size() > 300) p.message = p.message.substr(0, 300) + "...";
  }
  p.peak_host = peak_rss_bytes() - base;
  const auto line = probe_line(p);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  return 0;
}

// One probe in a child process (this binary with --probe); its last lines on a failure.
bench::Probe spawn_probe(const Args& a, const std::string& strategy, const models::ModelConfig& config,
                         int64_t batch) {
  std::vector<std::string> args = {"/proc/self/exe", "--probe", "--strategy=" + strategy,
                                   "--config=" + config.to_string(), "--device=" + a.device,
                                   "--batch=" + std::to_string(batch), "--precision=" + a.precision_text,
                                   "--optimizer=" + a.optimizer, "--steps=" + std::to_string(a.steps)};
  if (!a.options_text.empty()) args.push_back("--options=" + a.options_text);
  if (a.device_memory_gib > 0) args.push_back("--device-memory=" + std::to_string(a.device_memory_gib));
  if (a.host_memory_gib > 0) args.push_back("--host-memory=" + std::to_string(a.host_memory_gib));
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  int fds[2];
  STRATA_CHECK(pipe(fds) == 0, "strata_capacity: no pipe for a probe");
  std::fflush(stdout);
  const pid_t pid = fork();
  STRATA_CHECK(pid >= 0, "strata_capacity: could not start a probe");
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::string output;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(a.timeout_s);
  bool timed_out = false;
  for (;;) {
    pollfd pfd{fds[0], POLLIN, 0};
    const int ready = poll(&pfd, 1, 200);
    if (ready > 0) {
      char buf[4096];
      const auto n = read(fds[0], buf, sizeof buf);
      if (n <= 0) break;
      output.append(buf, static_cast<size_t>(n));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      timed_out = true;
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  bench::Probe p;
  const auto tag = output.rfind(kProbeTag);
  if (timed_out) {
    p.outcome = bench::ProbeOutcome::error;
    p.message = "timed out after " + std::to_string(a.timeout_s) + " s (--timeout)";
  } else if (tag != std::string::npos) {
    const auto end = output.find('\n', tag);
    p = parse_probe_line(output.substr(tag, end == std::string::npos ? std::string::npos : end - tag));
  } else if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
    p.outcome = bench::ProbeOutcome::host_oom;
    p.message = "killed by SIGKILL (the kernel's out-of-memory killer, most likely)";
  } else {
    p.outcome = bench::ProbeOutcome::error;
    auto tail = output.size() > 400 ? output.substr(output.size() - 400) : output;
    for (auto& ch : tail)
      if (ch == '\n') ch = ' ';
    p.message = "the probe ended without a result (status " + std::to_string(status) + "): " + tail;
  }
  return p;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\', out += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) out += ' ';
    else out += ch;
  }
  return out + "\"";
}

std::string probe_json(const std::string& strategy, const bench::Probe& p, const bench::MemoryPrediction* predicted) {
  std::ostringstream out;
  out << "{\"strategy\": " << json_string(strategy) << ", \"size\": " << p.size << ", \"outcome\": "
      << json_string(bench::to_string(p.outcome)) << ", \"parameters\": " << p.parameters
      << ", \"step_ms\": " << p.step_ms << ", \"peak_device_bytes\": " << p.peak_device
      << ", \"peak_host_bytes\": " << p.peak_host;
  if (predicted)
    out << ", \"predicted_device_bytes\": " << predicted->device_bytes()
        << ", \"predicted_host_bytes\": " << predicted->host_bytes();
  out << ", \"message\": " << json_string(p.message) << "}";
  return out.str();
}

int run(int argc, char** argv) {
  const auto a = parse_args(argc, argv);
  if (a.probe) return run_probe(a);
  const auto dev = device::parse(a.device);
  const auto preset = models::preset(a.fit.empty() ? a.model : a.fit);
  const auto axis = bench::axis_for(a.scale, preset.config);
  const int64_t batch = a.batch > 0 ? a.batch : preset.batch_size;
  const auto strategies = a.strategies.empty()
                              ? std::vector<std::string>{"baseline", "baseline_checkpoint", "hook_offload",
                                                         "hook_offload_overlap", "sharded", "sharded_offload"}
                              : a.strategies;
  for (const auto& s : strategies) Registry::description(s);  // unknown names fail before any work
  STRATA_CHECK(a.device_memory_gib == 0 || dev.is_cuda(),
               "--device-memory emulates a smaller GPU; on " << dev << " the host's memory is the device's (--host-memory)");
  // What a probe may hold: the emulated card, else the whole one; the host's cap, else what is free.
  const int64_t host_limit = a.host_memory_gib > 0 ? static_cast<int64_t>(a.host_memory_gib * kGiB)
                                                   : meminfo_field("MemAvailable:");
  const int64_t device_limit = !dev.is_cuda()                ? host_limit
                               : a.device_memory_gib > 0 ? static_cast<int64_t>(a.device_memory_gib * kGiB)
                                                          : device::total_memory(dev);
  std::printf("strata capacity: %s along %s, batch %ld, precision %s, %s; device %s with %.1f GiB%s, host %.1f GiB%s\n",
              preset.name.c_str(), axis.name.c_str(), static_cast<long>(batch), a.precision.to_string().c_str(),
              a.optimizer.c_str(), dev.str().c_str(), device_limit / kGiB, a.device_memory_gib > 0 ? " (emulated)" : "",
              host_limit / kGiB, a.host_memory_gib > 0 ? " (capped)" : " (available)");
  std::fflush(stdout);

  auto predict = [&](const std::string& strategy, const models::ModelConfig& config) -> std::optional<bench::MemoryPrediction> {
    if (!bench::memory_model_covers(strategy)) return std::nullopt;
    bench::MemoryQuestion q{strategy, bench::options_for(a.options, strategy), config, batch, a.precision, {}};
    q.optimizer.kind = parse_optimizer_kind(a.optimizer);
    return bench::predict_memory(q);
  };
  auto predicted_fits = [&](const bench::MemoryPrediction& m) {
    return dev.is_cuda() ? m.device_bytes() <= device_limit && m.host_bytes() <= host_limit
                         : m.device_bytes() + m.host_bytes() <= host_limit;
  };
  // The memory model's largest size (a multiple of the axis' step) from `lo_k` steps up, or -1.
  auto predicted_largest = [&](const std::string& strategy, int64_t lo_k) -> int64_t {
    if (!predict(strategy, preset.config)) return -1;
    const int64_t hi_k = std::max<int64_t>(lo_k, 64 * axis.of(preset.config) / axis.unit);
    const auto f = bench::bisect(lo_k, hi_k, 1, [&](int64_t k) {
      bench::Probe p;
      p.outcome = predicted_fits(*predict(strategy, axis.at(preset.config, k * axis.unit)))
                      ? bench::ProbeOutcome::trains
                      : bench::ProbeOutcome::device_oom;
      return p;
    });
    return f.largest > 0 ? f.largest * axis.unit : -1;
  };

  std::vector<std::string> rows, probes;
  std::vector<std::pair<std::string, bench::Probe>> fitted;  // --fit: each strategy's one probe
  int failed = 0;
  // The JSON, rewritten after each strategy: a run cut short keeps what it found.
  auto write_json = [&] {
    if (a.json.empty()) return;
    std::ofstream out(a.json);
    STRATA_CHECK(out, "--json=" << a.json << ": cannot write it");
    out << "{\n\"context\": {\"strata_device\": " << json_string(dev.str())
        << ", \"device_name\": " << json_string(dev.is_cuda() ? device::name(dev) : "cpu")
        << ", \"device_memory_bytes\": " << device_limit << ", \"device_memory_emulated\": " << (a.device_memory_gib > 0 ? "true" : "false")
        << ", \"host_memory_bytes\": " << host_limit << ", \"host_memory_capped\": " << (a.host_memory_gib > 0 ? "true" : "false")
        << ", \"model\": " << json_string(preset.name) << ", \"model_config\": " << json_string(preset.config.to_string())
        << ", \"axis\": " << json_string(axis.name) << ", \"mode\": " << json_string(a.fit.empty() ? "search" : "fit")
        << ", \"batch\": " << batch << ", \"precision\": " << json_string(a.precision.to_string())
        << ", \"optimizer\": " << json_string(a.optimizer) << ", \"steps\": " << a.steps << "},\n\"benchmarks\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) out << "  " << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
    out << "],\n\"probes\": [\n";
    for (size_t i = 0; i < probes.size(); ++i) out << "  " << probes[i] << (i + 1 < probes.size() ? ",\n" : "\n");
    out << "]\n}\n";
  };
  if (a.predict_only) {
    const int64_t size = a.size > 0 ? a.size : axis.of(preset.config);
    for (const auto& strategy : strategies) {
      const auto m = predict(strategy, axis.at(preset.config, size));
      if (!m) {
        std::printf("[%s] not modelled\n", strategy.c_str());
        continue;
      }
      std::printf("[%s] %s=%ld: %s; predicted largest %s=%ld\n", strategy.c_str(), axis.name.c_str(),
                  static_cast<long>(size), m->summary().c_str(), axis.name.c_str(),
                  static_cast<long>(predicted_largest(strategy, 1)));
    }
    return 0;
  }
  write_json();  // the context at once
  for (const auto& strategy : strategies) {
    const auto options = bench::options_for(a.options, strategy);
    correctness::ParityResult parity;
    try {
      parity = bench::check_before_timing(strategy, preset.config, options, dev, a.precision);
    } catch (const std::exception& e) {
      parity = {false, std::string("the check could not run: ") + e.what()};
    }
    device::release_cached_memory(dev);  // what the check cached is not the probes' to lose
    if (!parity.ok) {
      std::printf("[%s] parity failed on the tiny model: %s\n", strategy.c_str(), parity.message.c_str());
      rows.push_back("{\"name\": " + json_string("capacity/" + strategy) + ", \"error_message\": " +
                     json_string("parity failed: " + parity.message) + "}");
      ++failed;
      write_json();
      continue;
    }
    auto probe_at = [&](int64_t size) {
      const auto config = axis.at(preset.config, size);
      const auto m = predict(strategy, config);
      std::printf("[%s] %s=%ld (%.3fB parameters%s) ...", strategy.c_str(), axis.name.c_str(), static_cast<long>(size),
                  models::parameter_count(config) / 1e9,
                  m ? (", predicted " + m->summary()).c_str() : "");
      std::fflush(stdout);
      auto p = spawn_probe(a, strategy, config, batch);
      p.size = size;
      if (fits(p.outcome))
        std::printf(" trains: %.1f ms a step, peak %.2f GiB device, %.2f GiB host\n", p.step_ms, p.peak_device / kGiB,
                    p.peak_host / kGiB);
      else
        std::printf(" %s: %s\n", bench::to_string(p.outcome), p.message.c_str());
      std::fflush(stdout);
      probes.push_back(probe_json(strategy, p, m ? &*m : nullptr));
      return p;
    };

    if (!a.fit.empty()) {  // one model: does it train here, and how fast
      const int64_t size = a.size > 0 ? a.size : axis.of(preset.config);
      const auto p = probe_at(size);
      if (p.outcome == bench::ProbeOutcome::error) ++failed;
      fitted.emplace_back(strategy, p);
      std::ostringstream row;
      row << "{\"name\": " << json_string("fit/" + strategy + "/" + preset.name) << ", \"strategy\": "
          << json_string(strategy) << ", \"outcome\": " << json_string(bench::to_string(p.outcome))
          << ", \"parameters\": " << p.parameters << ", \"step_ms\": " << p.step_ms
          << ", \"peak_device_bytes\": " << p.peak_device << ", \"peak_host_bytes\": " << p.peak_host << "}";
      rows.push_back(row.str());
      write_json();
      continue;
    }

    // The predicted frontier first (no process: the memory model alone); it brackets the search.
    const int64_t lo_k = std::max<int64_t>(1, (a.min > 0 ? a.min : axis.unit) / axis.unit);
    const int64_t predicted = predicted_largest(strategy, lo_k);
    const int64_t predicted_k = predicted > 0 ? predicted / axis.unit : -1;
    int64_t hi_k = a.max > 0 ? a.max / axis.unit
                   : predicted_k > 0 ? 2 * predicted_k
                                     : 4 * axis.of(preset.config) / axis.unit;
    hi_k = std::max(hi_k, lo_k);
    const int64_t resolution = a.resolution > 0 ? std::max<int64_t>(1, a.resolution / axis.unit)
                               : axis.name == "classes" ? std::max<int64_t>(1, (hi_k - lo_k) / 128)
                                                        : 1;
    const auto f = bench::bisect(lo_k, hi_k, resolution, [&](int64_t k) { return probe_at(k * axis.unit); });
    if (!f.stopped.empty()) ++failed;
    std::ostringstream row;
    row << "{\"name\": " << json_string("capacity/" + strategy + "/" + preset.name + "/" + axis.name)
        << ", \"strategy\": " << json_string(strategy) << ", \"axis\": " << json_string(axis.name);
    // The search ran over multiples of the axis' step: its sizes are those multiples.
    const auto* best = f.largest > 0 ? f.at(f.largest) : nullptr;
    const auto* next = f.failing > 0 ? f.at(f.failing) : nullptr;
    const int64_t best_size = best ? f.largest * axis.unit : -1, next_size = next ? f.failing * axis.unit : -1;
    row << ", \"largest\": " << best_size;
    if (best)
      row << ", \"parameters\": " << best->parameters << ", \"step_ms\": " << best->step_ms
          << ", \"peak_device_bytes\": " << best->peak_device << ", \"peak_host_bytes\": " << best->peak_host;
    if (best) {
      if (const auto m = predict(strategy, axis.at(preset.config, best_size)))
        row << ", \"predicted_device_bytes\": " << m->device_bytes() << ", \"predicted_host_bytes\": " << m->host_bytes();
    }
    row << ", \"next\": " << next_size << ", \"next_outcome\": "
        << json_string(next ? bench::to_string(next->outcome) : best ? "the upper end trains" : "");
    row << ", \"predicted_largest\": " << (predicted_k > 0 ? predicted_k * axis.unit : -1);
    if (!f.stopped.empty()) row << ", \"error_message\": " << json_string("error: " + f.stopped);
    row << "}";
    rows.push_back(row.str());
    write_json();
    std::printf("[%s] largest that trains: %s=%ld%s (predicted %ld)%s\n", strategy.c_str(), axis.name.c_str(),
                static_cast<long>(best_size),
                next ? (", next " + std::to_string(next_size) + ": " + bench::to_string(next->outcome)).c_str()
                     : best ? " (the upper end: raise --max)" : "",
                static_cast<long>(predicted_k > 0 ? predicted_k * axis.unit : -1),
                f.stopped.empty() ? "" : ("; stopped: " + f.stopped).c_str());
    std::fflush(stdout);
  }

  if (!a.fit.empty()) {
    bench::order_by_fit(fitted);
    std::printf("%s on %s: what trains, fastest first\n", preset.name.c_str(), dev.str().c_str());
    for (const auto& [strategy, p] : fitted) {
      if (fits(p.outcome))
        std::printf("  %-22s %10.1f ms a step, peak %.2f GiB device, %.2f GiB host\n", strategy.c_str(), p.step_ms,
                    p.peak_device / kGiB, p.peak_host / kGiB);
      else
        std::printf("  %-22s %s\n", strategy.c_str(), bench::to_string(p.outcome));
    }
  }
  return failed > 0 ? 1 : 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::bench::tool_main("strata_capacity", strata::run, argc, argv); }
