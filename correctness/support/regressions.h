#pragma once
// The committed file of past parity failures (correctness/regressions.txt): CI replays every case
// in it; the explorer (ci/explore.sh) appends what it finds. One case per line:
//
//   <strategy> <cpu|cuda> <ParityCase::to_string()>
//
// Lines starting with '#' are comments (where a case came from, what it showed).
#include <string>
#include <vector>

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

}  // namespace strata::correctness
