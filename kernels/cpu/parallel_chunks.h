// Work sharing that tolerates a preempted thread: chunks taken from a shared counter.
//
// at::parallel_for (OpenMP backend) hands each thread one fixed, equal share of the range. On a
// machine whose cores also run other processes (a 2-vCPU host with a decode worker's two
// threads beside the postfilter, the gateway and NATS), the kernel scheduler preempts one of the
// threads for each wake-up of another process, and the parallel region then lasts as long as
// that thread's whole share plus the time it was off its core. Here each thread takes the next
// chunk from an atomic counter until none is left, so the threads that run take over the
// preempted one's remaining chunks and the region is late by at most one chunk. This is
// OpenMP's `schedule(dynamic, chunk)`, written out so that the number of threads follows
// torch's intra-op setting (at::get_num_threads) like at::parallel_for.
//
// Results do not depend on which thread runs a chunk as long as `f` computes every index of
// its range on its own (true of the block matmuls: each output has its own reduction).
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pdq {

// f(begin, end) over [0, n) in chunks of `chunk` indices (the last one shorter), on up to
// at::get_num_threads() OpenMP threads; serial inside another parallel region or for one chunk.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), chunks));
  if (threads <= 1 || omp_in_parallel()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  }
}

// A chunk of weight rows for `threads` threads: about eight chunks per thread (so a thread
// preempted for a while costs at most an eighth of its share), a multiple of four (the block
// loops take weight rows in fours), at least `min_rows`.
inline int64_t row_chunk(int64_t rows, int64_t min_rows = 16) {
  const int64_t per = (rows + 8 * at::get_num_threads() - 1) / (8 * at::get_num_threads());
  return std::max<int64_t>(min_rows, (per + 3) / 4 * 4);
}

}  // namespace pdq
