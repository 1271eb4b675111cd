#pragma once
// Work shared by a few host threads (parameter initialisation, host optimizer updates).
#include <algorithm>
#include <atomic>
#include <cstdint>
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

/// Runs fn(begin, end) over [0, n) split across the machine's cores, in up to four chunks a core
/// (of at least 2^18 items), taken in turn, so a thread that loses its core for a while (to a
/// thread spinning on the device, say) delays a quarter of its share rather than the whole call.
/// The calling thread takes chunks too. std::thread rather than at::parallel_for: the
/// latter is an OpenMP pragma in a header, and serial in any translation unit not compiled with
/// -fopenmp (measured: 3.4 s for one AdamW step over 871M parameters).
template <typename F>
void parallel_chunks(int64_t n, F fn) {
  constexpr int64_t kMinChunk = 1 << 18;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), n / kMinChunk));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  const int64_t chunks = std::min<int64_t>(4 * threads, n / kMinChunk);  // >= threads, as threads <= n / kMinChunk
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  run_on_threads(static_cast<size_t>(threads), [&] {
    for (int64_t c = next++; c * chunk < n; c = next++) fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace strata
