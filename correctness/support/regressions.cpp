#include "correctness/support/regressions.h"

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <optional>
#include <sstream>

#include "models/check.h"

namespace strata::correctness {

std::string regressions_file() {
  if (const char* path = std::getenv("STRATA_REGRESSIONS")) return path;
  return STRATA_REGRESSIONS_FILE;
}

std::string failures_file() {
  const char* path = std::getenv("STRATA_FAILURES_FILE");
  return path ? path : "";
}

std::vector<RecordedCase> read_regressions(const std::string& path) {
  std::ifstream in(path);
  STRATA_CHECK(in, "cannot read the regression file '" << path << "'");
  std::vector<RecordedCase> out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t") == std::string::npos || line[line.find_first_not_of(" \t")] == '#') continue;
    std::istringstream fields(line);
    RecordedCase r;
    r.line = number;
    fields >> r.strategy >> r.device;
    STRATA_CHECK(r.device == "cpu" || r.device == "cuda",
                 path << ":" << number << ": device '" << r.device << "' is not cpu or cuda");
    std::string rest;
    std::getline(fields, rest);
    try {
      r.parity = ParityCase::parse(rest);
    } catch (const Error& e) {
      STRATA_FAIL(path << ":" << number << ": " << e.what());
    }
    out.push_back(std::move(r));
  }
  return out;
}

void append_regression(const std::string& path, const std::string& strategy, const torch::Device& device,
                       const ParityCase& c, const std::string& message) {
  std::ofstream out(path, std::ios::app);
  STRATA_CHECK(out, "cannot append to the regression file '" << path << "'");
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  auto one_line = message;
  for (auto& ch : one_line)
    if (ch == '\n') ch = ' ';
  out << "# " << date << ", found by exploration: " << one_line << "\n"
      << strategy << " " << (device.is_cuda() ? "cuda" : "cpu") << " " << c.to_string() << "\n";
}

bool check_property(const std::string& strategy, const std::string& description, const torch::Device& device,
                    const std::function<rc::Gen<ParityCase>()>& gen, bool record,
                    const std::function<void(const ParityCase&)>& drawn) {
  std::optional<std::pair<ParityCase, std::string>> last_failure;
  const bool ok = rc::check(description, [&] {
    const auto c = *gen();
    if (drawn) drawn(c);
    RC_TAG(c.chain ? std::string("chain") : models::to_string(c.model.kind));
    const auto r = check_parity(strategy, c, device);
    if (!r.ok) {
      last_failure = {c, r.message};  // shrinking ends on the smallest failing case
      RC_FAIL(r.message);
    }
  });
  if (!ok && record && last_failure && !failures_file().empty())
    append_regression(failures_file(), strategy, device, last_failure->first, last_failure->second);
  return ok;
}

}  // namespace strata::correctness
