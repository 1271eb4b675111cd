#pragma once
// Test helper: runs f and returns the message of the strata::Error it throws. Anything else —
// no error, or another exception type, whatever its text — returns a fixed string that no
// expected message contains (the other exception's text goes to stderr for the reader).
#include <iostream>
#include <string>

#include "models/check.h"

namespace strata::test {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    std::cerr << "error_of: expected a strata::Error, got another exception: " << e.what() << "\n";
    return "<not a strata::Error>";
  }
  return "<no error>";
}

}  // namespace strata::test
