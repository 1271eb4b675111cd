#pragma once
// Work shared by a few host threads (parameter initialisation, host optimizer updates).
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace strata {

/// Calls work() on the calling thread and on up to `threads - 1` more, and returns when every call
/// has returned. work() must take its items from a shared counter: a thread the system refuses to
/// start (a capped address space, a thread limit) is then simply not used, and the others do its
/// share. The first exception thrown by any call is rethrown here, after all threads have joined.
template <typename F>
void run_on_threads(size_t threads, F&& work) {
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto guarded = [&] {
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(guarded);
    } catch (const std::system_error&) {
      break;  // fewer threads; the calling thread still does the rest
    }
  }
  guarded();
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace strata
