#pragma once
// Test helper: runs f, expects a strata::Error, and returns its message ("no error" if none).
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
    return std::string("not a strata::Error: ") + e.what();
  }
  return "no error";
}

}  // namespace strata::test
