#pragma once
// The one checking macro of strata: every rejected value reaches the user as a strata::Error that
// carries the place (file:line) and a message naming the value and what would be valid.
#include <sstream>
#include <stdexcept>
#include <string>

namespace strata {

/// Thrown for invalid configurations and misuse; the message names the bad value.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
[[noreturn]] inline void fail(const char* file, int line, const std::string& message) {
  std::ostringstream out;
  out << message << " [" << file << ":" << line << "]";
  throw Error(out.str());
}
}  // namespace detail

}  // namespace strata

/// STRATA_FAIL("unknown preset '" << name << "'"): always throws (for the end of a lookup).
#define STRATA_FAIL(msg)                                                 \
  do {                                                                   \
    std::ostringstream strata_fail_msg_;                                 \
    strata_fail_msg_ << msg;                                             \
    ::strata::detail::fail(__FILE__, __LINE__, strata_fail_msg_.str()); \
  } while (false)

/// STRATA_CHECK(cond, "balance sums to " << n << " but the model has " << m << " blocks");
#define STRATA_CHECK(cond, msg)                                   \
  do {                                                            \
    if (!(cond)) {                                                \
      std::ostringstream strata_check_msg_;                       \
      strata_check_msg_ << msg;                                   \
      ::strata::detail::fail(__FILE__, __LINE__, strata_check_msg_.str()); \
    }                                                             \
  } while (false)
