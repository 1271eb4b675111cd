#pragma once
// The committed file of past parity failures (correctness/regressions.txt): CI replays every case
// in it; the explorer (ci/explore.sh) appends what it finds. One case per line:
//
//   <strategy> <cpu|cuda> <ParityCase::to_string()>
//
// Lines starting with '#' are comments (where a case came from, what it showed).
#include <functional>
#include <string>
#include <vector>

#include <rapidcheck.h>

#include "correctness/support/parity.h"

namespace strata::correctness {

struct RecordedCase {
  std::string strategy;
  std::string device;  ///< "cpu" or "cuda": the kind of device the case ran on
  ParityCase parity;
  int line = 0;
};

/// The file to replay: $STRATA_REGRESSIONS if set, else the committed one.
std::string regressions_file();
/// Every case of `path`; an Error names the line that does not parse.
std::vector<RecordedCase> read_regressions(const std::string& path);
/// Appends a failing case (and its message as a comment) to `path`.
void append_regression(const std::string& path, const std::string& strategy, const torch::Device& device,
                       const ParityCase& c, const std::string& message);
/// Where a property records its shrunk failure: $STRATA_FAILURES_FILE, or empty (not recorded).
std::string failures_file();

/// rc::check of `description`: every case `gen` draws checked with check_parity(strategy, case,
/// device). Where it fails and `record` holds, the shrunk case and its message are appended to
/// failures_file() (when set), for CI to replay once committed. `record`: false where a case
/// cannot be replayed in one process (a property run over several ranks).
/// `drawn`, when given, sees every case the property checks (a coverage count, say).
bool check_property(const std::string& strategy, const std::string& description, const torch::Device& device,
                    const std::function<rc::Gen<ParityCase>()>& gen, bool record = true,
                    const std::function<void(const ParityCase&)>& drawn = {});

}  // namespace strata::correctness
