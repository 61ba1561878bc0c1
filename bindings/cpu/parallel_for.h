// A minimal fork-join helper over std::thread: no pool, no OpenMP.
//
// run_parallel(n, fn) calls fn(worker_index) on n workers (the caller is
// worker 0) and returns once all are done. Work is shared between workers
// by a TaskCounter they pull task indices from (dynamic scheduling).
#pragma once

#if defined(__linux__)
#include <sched.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace jaxattn::cpu {

// CPUs this thread may run on: its affinity mask (taskset, cpusets, a batch
// scheduler's binding), as XLA's own thread pool counts them; the machine's
// count where the mask cannot be read.
inline int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

// Number of worker threads: $JAXATTN_CPU_THREADS if set to a positive
// integer, else available_cpus() (at least 1). Read at each call.
inline int num_threads() {
  if (const char* env = std::getenv("JAXATTN_CPU_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && v > 0) return v > 1024 ? 1024 : int(v);
  }
  return available_cpus();
}

class TaskCounter {
 public:
  explicit TaskCounter(int64_t num_tasks) : num_tasks_(num_tasks) {}
  // Next task index, or -1 once all are handed out.
  int64_t next() {
    const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    return t < num_tasks_ ? t : -1;
  }
  int64_t num_tasks() const { return num_tasks_; }

 private:
  alignas(64) std::atomic<int64_t> next_{0};
  int64_t num_tasks_;
};

template <class Fn>
void run_parallel(int num_workers, Fn&& fn) {
  if (num_workers <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(num_workers - 1);
  for (int w = 1; w < num_workers; ++w) threads.emplace_back([&fn, w] { fn(w); });
  fn(0);
  for (auto& t : threads) t.join();
}

}  // namespace jaxattn::cpu
