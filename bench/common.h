#pragma once
// Shared by the benchmark binaries: the parity check every cell runs before it times anything.
#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>
#include <string>
#include <type_traits>

#include "correctness/support/parity.h"
#include "models/check.h"
#include "models/model.h"
#include "models/sizes.h"
#include "strategies/device/device.h"
#include "strategies/options.h"
#include "strategies/pipeline/pipeline.h"
#include "strategies/strategy.h"

namespace strata::bench {

/// `s` as a JSON string: quotes and backslashes escaped, control and non-ASCII bytes as spaces.
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\', out += ch;
    else if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x80) out += ' ';
    else out += ch;
  }
  return out + "\"";
}

/// The tiny preset of the same model kind: parity is checked there, where it is cheap.
inline const models::ModelConfig& parity_model_for(const models::ModelConfig& config) {
  switch (config.kind) {
    case models::ModelKind::gpt: return models::preset("gpt-tiny").config;
    case models::ModelKind::bert: return models::preset("bert-tiny").config;
    case models::ModelKind::mlp:
    case models::ModelKind::custom: break;
  }
  return models::preset("mlp-tiny").config;
}

/// Parity of `strategy` (with `options`) on the tiny model of `config`'s kind (check_parity runs
/// it in full fp32 whatever the TF32 setting of the timed run).
inline correctness::ParityResult check_before_timing(const std::string& strategy, const models::ModelConfig& config,
                                                     const std::map<std::string, std::string>& options,
                                                     const torch::Device& device,
                                                     const PrecisionPolicy& precision = {}) {
  correctness::ParityCase small;
  small.model = parity_model_for(config);
  // Options that name blocks (hook_offload's resident=) mean the same blocks in the tiny model: it
  // takes the timed model's depth, so its block indices, the last (a head) included, match.
  if (options.count("resident")) small.model.depth = config.depth;
  small.options = options;
  small.precision = precision;
  // A pipeline's micro-batches need a sample each (a custom schedule's count is in its text).
  if (auto m = options.find("micro_batches"); m != options.end())
    small.batch_size = std::max<int64_t>(small.batch_size, std::stoll(m->second));
  if (options.count("schedule_text") || options.count("schedule_file")) {
    auto custom = options;
    custom["schedule"] = "custom";
    small.batch_size = std::max<int64_t>(small.batch_size,
                                         pipeline::parse(PipelineOptions::parse(custom).schedule_text).micro_batches);
  }
  return correctness::check_parity(strategy, small, device);
}

/// The two warm-up steps every timed run starts with (allocator caches, pinned buffers, cuBLAS
/// handles), then every device drained and the strategy's counters and peaks reset.
inline void warm_up(Strategy& strategy, const models::Batch& batch) {
  for (int i = 0; i < 2; ++i) {
    strategy.train_step(batch);
    strategy.optimizer_step();
  }
  strategy.finish_step();  // host updates left running are warm-up's, not the first repetition's
  device::synchronize_all();
  strategy.reset_stats();
}

/// The median of `v` (the mean of the middle two for an even count); `v` must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// The largest peaks over a strategy's devices.
struct Peaks {
  int64_t allocated = 0, reserved = 0, params = 0;
};
inline Peaks peaks_of(const Stats& stats) {
  Peaks out;
  for (const auto& [name, mem] : stats.devices) {
    out.allocated = std::max(out.allocated, mem.peak_allocated);
    out.reserved = std::max(out.reserved, mem.peak_reserved);
    out.params = std::max(out.params, mem.peak_param_bytes);
  }
  return out;
}

/// Out of memory, as CUDA's caching allocator ("out of memory") and the CPU allocator ("can't
/// allocate memory") word it: a result to record, not a failure of the run.
inline bool is_oom(const std::string& what) {
  return what.find("out of memory") != std::string::npos || what.find("can't allocate memory") != std::string::npos;
}

/// How a cell ended. A cell that did not run to the end records its outcome as the first words of
/// its error message ("parity failed: ...", "out of memory: ...", "error: ..."), where a reader of
/// the JSON finds it: Google Benchmark drops the counters of an errored run. Out of memory is a
/// result; the other two fail the run (exit status 1).
enum class Outcome { ok, out_of_memory, parity_failed, error };
inline const char* prefix_of(Outcome o) {
  switch (o) {
    case Outcome::out_of_memory: return "out of memory: ";
    case Outcome::parity_failed: return "parity failed: ";
    case Outcome::error: return "error: ";
    case Outcome::ok: break;
  }
  return "";
}
inline bool fails_the_run(Outcome o) { return o == Outcome::parity_failed || o == Outcome::error; }

/// Dense matrix throughput of one GPU by its vendor's datasheet, in TFLOP/s, for the precision the
/// timed runs use (bf16 or fp16 tensor cores for those compute dtypes; for fp32, TF32 tensor cores
/// when `tf32`, else plain fp32); 0 where strata has no figure (then MFU is not reported). Figures
/// without sparsity.
inline double datasheet_tflops(const std::string& gpu, bool tf32, torch::ScalarType compute = torch::kFloat) {
  struct Sheet {
    const char* name;  ///< a substring of the driver's device name
    double tf32, fp32, half;
  };
  // NVIDIA H100 / H200 SXM datasheets: TF32 989 TFLOP/s with sparsity (494.7 dense), FP32 66.9,
  // BF16/FP16 1979 with sparsity (989.4 dense). H100 PCIe: 378 / 51.2 / 756. A100: 156 / 19.5 / 312.
  static const Sheet sheets[] = {{"H200", 494.7, 66.9, 989.4},
                                 {"H100 PCIe", 378.0, 51.2, 756.0},
                                 {"H100", 494.7, 66.9, 989.4},
                                 {"A100", 156.0, 19.5, 312.0}};
  for (const auto& s : sheets)
    if (gpu.find(s.name) != std::string::npos) return compute != torch::kFloat ? s.half : tf32 ? s.tf32 : s.fp32;
  return 0.0;
}

/// Strategy options as given on a command line: "key=value;strategy:key=value". An unprefixed key
/// applies to every strategy, a prefixed one to that strategy only.
inline std::map<std::string, std::string> parse_options_arg(const std::string& text) {
  std::map<std::string, std::string> out;
  for (const auto& kv : split(text, ';')) {
    const auto eq = kv.find('=');
    STRATA_CHECK(eq != std::string::npos && eq > 0, "--options: '" << kv << "' is not key=value");
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

/// The options of parse_options_arg() that apply to `strategy`, prefixes removed.
inline std::map<std::string, std::string> options_for(const std::map<std::string, std::string>& options,
                                                      const std::string& strategy) {
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : options) {
    const auto colon = key.find(':');
    if (colon == std::string::npos)
      out[key] = value;
    else if (key.substr(0, colon) == strategy)
      out[key.substr(colon + 1)] = value;
  }
  return out;
}

/// "manual_split" or, with options, "manual_split[devices=cuda:0,cuda:1;classifier_shards=2]": the
/// name a cell or a table row carries, so runs of one strategy with different options stay apart.
inline std::string label_with_options(const std::string& strategy, const std::map<std::string, std::string>& options) {
  if (options.empty()) return strategy;
  std::string out = strategy + "[";
  bool first = true;
  for (const auto& [key, value] : options) {
    out += (first ? "" : ";") + key + "=" + value;
    first = false;
  }
  return out + "]";
}

/// The value of a numeric command-line argument `--key=text` (a whole number for an integral T);
/// anything else is an Error naming the argument.
template <typename T>
T number_arg(const std::string& key, const std::string& text) {
  constexpr bool whole = std::is_integral_v<T>;
  try {
    size_t used = 0;
    const T value = whole ? static_cast<T>(std::stoll(text, &used)) : static_cast<T>(std::stod(text, &used));
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  STRATA_FAIL("--" << key << "=" << text << (whole ? " is not a whole number" : " is not a number"));
}
inline int64_t int_arg(const std::string& key, const std::string& text) { return number_arg<int64_t>(key, text); }
inline double real_arg(const std::string& key, const std::string& text) { return number_arg<double>(key, text); }

/// What the command-line tools print for a rejected argument: the message without the source
/// location (" [file:line]") that a strata::Error carries for developers.
inline std::string for_the_user(const std::string& what) {
  static const std::regex location(R"( \[[^\[\]]+:[0-9]+\]$)");
  return std::regex_replace(what, location, "");
}

/// A tool's main(): `run`'s status, or, for anything it throws (a rejected argument), the message
/// on stderr as "NAME: message" and status 2.
inline int tool_main(const char* name, int (*run)(int, char**), int argc, char** argv) {
  try {
    const auto& onednn = device::guard_onednn_cache();
    if (onednn.affected) std::fprintf(stderr, "%s: %s\n", name, onednn.summary.c_str());
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, for_the_user(e.what()).c_str());
    return 2;
  }
}

/// The exit statuses both tools share, for their --help.
inline constexpr const char* kExitStatuses =
    "exit status: 0 every cell ran (a cell out of memory is a result and counts as run); 1 a cell failed\n"
    "parity or errored; 2 a bad argument (named on stderr)\n";

/// A strategy option's default as `--list` shows it (an example when the option is required).
inline std::string shown_default(const OptionInfo& o) {
  if (o.required) return "required, e.g. " + o.fallback;
  return o.fallback.empty() ? "(none)" : o.fallback;
}

/// The registered strategies with their options, then the model presets with their sizes (counted
/// from the config: nothing is built), for `--list`.
inline void print_list() {
  std::printf("strategies, each with its options (key=default: values; what it does)\n");
  for (const auto& name : Registry::names()) {
    std::printf("  %-22s %s\n", name.c_str(), Registry::description(name).c_str());
    std::string for_tests;
    for (const auto& o : Registry::options(name)) {
      if (o.doc.for_tests) {
        for_tests += (for_tests.empty() ? "" : ", ") + o.key;
        continue;
      }
      const std::string head = o.key + "=" + shown_default(o);
      std::printf("      %-28s %s; %s\n", head.c_str(), o.doc.values.c_str(), o.doc.text.c_str());
    }
    if (!for_tests.empty()) std::printf("      for tests only: %s\n", for_tests.c_str());
  }
  std::printf("\nmodel presets\n");
  for (const auto& p : models::presets()) {
    const double params = static_cast<double>(models::parameter_count(p.config));
    const std::string size = params >= 1e9 ? std::to_string(params / 1e9).substr(0, 4) + "B"
                                           : params >= 1e6 ? std::to_string(params / 1e6).substr(0, 5) + "M"
                                                           : std::to_string(static_cast<long>(params));
    std::printf("  %-14s %8s parameters  batch %-4ld %s\n  %-14s %s\n", p.name.c_str(), size.c_str(),
                static_cast<long>(p.batch_size), p.note.c_str(), "", p.config.to_string().c_str());
  }
}

/// The options of every strategy as docs/options.md's Markdown table (`--list=markdown`): strategies
/// whose parser and documentation are the same share rows, and a default that differs between
/// them names each one's.
inline void print_options_markdown() {
  struct Group {
    std::vector<std::string> names;
    std::vector<std::vector<OptionInfo>> options;  // per name
  };
  std::vector<Group> groups;
  auto signature = [](const std::vector<OptionInfo>& options) {
    std::string s;
    for (const auto& o : options) s += o.key + "|" + o.doc.values + "|" + o.doc.text + "|" + (o.doc.for_tests ? "t" : "") + "\n";
    return s;
  };
  for (const auto& name : Registry::names()) {
    auto options = Registry::options(name);
    if (!groups.empty() && signature(groups.back().options.front()) == signature(options)) {
      groups.back().names.push_back(name);
      groups.back().options.push_back(std::move(options));
    } else {
      groups.push_back({{name}, {std::move(options)}});
    }
  }
  auto code = [](const std::string& t) { return "`" + t + "`"; };
  std::printf("| strategy | option | values | default | what it does |\n| --- | --- | --- | --- | --- |\n");
  std::string for_tests;
  for (const auto& g : groups) {
    std::string names;
    for (const auto& n : g.names) names += (names.empty() ? "" : ", ") + n;
    const auto& first = g.options.front();
    bool shown_names = false;
    std::string tests;
    for (size_t k = 0; k < first.size(); ++k) {
      if (first[k].doc.for_tests) {
        tests += (tests.empty() ? "" : ", ") + code(first[k].key);
        continue;
      }
      // The most common default, then the strategies that differ from it; where no two agree,
      // each strategy's own.
      std::vector<std::string> cells;
      std::map<std::string, int> count;
      for (const auto& o : g.options) {
        cells.push_back(o[k].fallback.empty() && !o[k].required ? "none" : code(shown_default(o[k])));
        ++count[cells.back()];
      }
      std::string common = cells.front();
      for (const auto& c : cells)
        if (count[c] > count[common]) common = c;
      const bool each_its_own = cells.size() > 1 && count[common] == 1;
      std::string others;
      for (size_t n = 0; n < cells.size(); ++n)
        if (each_its_own || cells[n] != common) others += (others.empty() ? "" : ", ") + g.names[n] + ": " + cells[n];
      const std::string shown = each_its_own ? others : common + (others.empty() ? "" : " (" + others + ")");
      std::printf("| %s | %s | %s | %s | %s |\n", shown_names ? "" : names.c_str(), code(first[k].key).c_str(),
                  first[k].doc.values.c_str(), shown.c_str(), first[k].doc.text.c_str());
      shown_names = true;
    }
    if (!tests.empty()) for_tests += "- " + names + ": " + tests + "\n";
  }
  if (!for_tests.empty()) std::printf("\nOptions for tests only (each plants or exposes a specific bug):\n\n%s", for_tests.c_str());
}

}  // namespace strata::bench
