#pragma once
// Work shared by a few host threads (parameter initialisation, host optimizer updates).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "models/check.h"

namespace strata {

/// The first exception thrown by any of several threads' calls, kept for the thread that waits for
/// them all to rethrow.
class FirstFailure {
 public:
  /// Calls work(), keeping what it throws if nothing was kept before.
  template <typename F>
  void call(F&& work) {
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_) failure_ = std::current_exception();
    }
  }
  /// Rethrows the kept exception, if any (call once every thread is done).
  void rethrow() const {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr failure_;
};

/// Calls work() on the calling thread and on up to `threads - 1` more, and returns when every call
/// has returned. work() must take its items from a shared counter: a thread the system refuses to
/// start (a capped address space, a thread limit) is then simply not used, and the others do its
/// share. The first exception thrown by any call is rethrown here, after all threads have joined.
template <typename F>
void run_on_threads(size_t threads, F&& work) {
  FirstFailure failure;
  auto guarded = [&] { failure.call(work); };
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
  failure.rethrow();
}

/// Host threads for parallel work: STRATA_HOST_THREADS when set (a positive integer: fewer to
/// leave cores to other work, or more than the cores to test the worker pool on a small machine),
/// else the machine's hardware threads. Read once.
inline size_t host_threads() {
  static const size_t threads = [] {
    const char* text = std::getenv("STRATA_HOST_THREADS");
    if (!text || !*text) return static_cast<size_t>(std::max(1u, std::thread::hardware_concurrency()));
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    STRATA_CHECK(*end == '\0' && value > 0 && value <= 4096,
                 "STRATA_HOST_THREADS='" << text << "' is not a thread count from 1 to 4096");
    return static_cast<size_t>(value);
  }();
  return threads;
}

template <typename F>
void parallel_chunks(int64_t n, F fn);

/// The cores' workers for parallel_chunks: host_threads() - 1 threads started on first use
/// and kept for the life of the process, so a call costs a wake-up rather than starting and
/// joining a thread per core (a host optimizer calls it once per unit, every step). One job at a
/// time: a second caller waits for the first one's job to end, so a job must never wait for
/// another thread that may itself call parallel_chunks. A job started from inside a job (a nested
/// parallel_chunks) would wait for itself, so it runs on its caller alone.
class ChunkWorkers {
 public:
  /// True on a thread running a job's work (the caller's share included).
  static bool& inside_job() {
    thread_local bool inside = false;
    return inside;
  }

 private:
  template <typename F>
  friend void parallel_chunks(int64_t n, F fn);

  /// Never destroyed: its threads wait for work until the process ends, and a static destructor
  /// that joined them could run while another static's destructor still uses the workers.
  static ChunkWorkers& instance() {
    static ChunkWorkers* workers = new ChunkWorkers();
    return *workers;
  }

  /// Calls work() on the calling thread and on up to `helpers` workers, and returns when every
  /// call has returned; the first exception thrown by any call is rethrown here. work() must take
  /// its items from a shared counter (a worker may find none left).
  template <typename F>
  void run(size_t helpers, F&& work) {
    FirstFailure failure;
    std::function<void()> guarded = [&] {
      inside_job() = true;
      failure.call(work);
      inside_job() = false;
    };
    {
      std::lock_guard<std::mutex> one_job(job_mutex_);
      helpers = std::min(helpers, threads_.size());
      {
        std::lock_guard<std::mutex> lock(mutex_);
        job_ = &guarded;
        slots_ = running_ = helpers;
        ++generation_;
      }
      // Every waiting worker wakes and checks for a slot; one still on its way back from the last
      // job checks before it waits. Not one notify_one per slot: a worker that took a slot of this
      // job, found no chunk left and went back to waiting can swallow a later one, and the slot
      // it was meant for then stays open, so the job never ends (seen: a hang with 6 workers).
      if (helpers > 0) wake_.notify_all();
      guarded();
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return running_ == 0; });
      job_ = nullptr;
    }
    failure.rethrow();
  }

  ChunkWorkers() {
    const size_t wanted = host_threads() - 1;
    threads_.reserve(wanted);  // no reallocation once threads hold `this`
    for (size_t t = 0; t < wanted; ++t) {
      try {
        threads_.emplace_back([this] { serve(); });
      } catch (const std::system_error&) {
        break;  // fewer workers; the caller still does its share and the rest
      }
    }
  }

  void serve() {
    uint64_t taken = 0;  // the last job this worker took a slot of
    for (;;) {
      const std::function<void()>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != taken && slots_ > 0; });
        --slots_;
        taken = generation_;
        job = job_;
      }
      (*job)();  // guarded: never throws
      std::lock_guard<std::mutex> lock(mutex_);
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex job_mutex_;  ///< held by the caller of run() for the whole job
  std::mutex mutex_;      ///< guards job_, slots_, running_, generation_
  std::condition_variable wake_, done_;
  const std::function<void()>* job_ = nullptr;
  size_t slots_ = 0;         ///< workers the current job still takes
  size_t running_ = 0;       ///< workers taken by the current job that have not finished it
  uint64_t generation_ = 0;  ///< counts jobs
  std::vector<std::thread> threads_;
};

/// Runs fn(begin, end) over [0, n) split across host_threads() threads (one for every 2^18 items at
/// most), in up to sixteen chunks a thread (of at least 2^16 items), taken in turn: a thread that
/// loses its core for a while (to a thread spinning on the device, say) delays a sixteenth of its
/// share rather than the whole call, and the call's end waits for at most one small chunk on the
/// thread that took the last one. (Fewer, larger chunks left more of each call's end to one thread
/// while the others idled: bench/notes/host-update-chunks.md.)
/// The calling thread takes chunks too; the others are ChunkWorkers'. std::thread rather than
/// at::parallel_for: the latter is an OpenMP pragma in a header, and serial in any translation
/// unit not compiled with -fopenmp (a host optimizer pass then runs on one core).
template <typename F>
void parallel_chunks(int64_t n, F fn) {
  constexpr int64_t kMinShare = 1 << 18, kMinChunk = 1 << 16;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(host_threads()), n / kMinShare));
  if (threads == 1 || ChunkWorkers::inside_job()) {
    fn(0, n);
    return;
  }
  const int64_t chunks = std::min<int64_t>(16 * threads, n / kMinChunk);  // >= threads, as threads <= n / kMinShare
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  ChunkWorkers::instance().run(static_cast<size_t>(threads - 1), [&] {
    for (int64_t c = next++; c * chunk < n; c = next++) fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

/// parallel_chunks over `count` items that are, with `rows` (distinct indices), the elements of those
/// rows of a [*, cols] matrix listed one after another, else elements 0 to count - 1 themselves:
/// fn(item, element, length) for each stretch of items that are consecutive elements too (at most
/// one row's worth with `rows`).
template <typename F>
void parallel_row_spans(int64_t count, const int64_t* rows, int64_t cols, F fn) {
  parallel_chunks(count, [&](int64_t begin, int64_t end) {
    if (!rows) return fn(begin, begin, end - begin);
    for (int64_t e = begin; e < end;) {
      const int64_t stop = std::min(end, (e / cols + 1) * cols);
      fn(e, rows[e / cols] * cols + e % cols, stop - e);
      e = stop;
    }
  });
}

}  // namespace strata
