// cuda_on_cpu.h: runs CUDA C++ device code on the CPU, one std::thread per CUDA thread.
//
// Include this header instead of the CUDA headers, then the unchanged device source, and launch kernels with
// ac_cpu::launch(kernel, grid, block, dynamic_smem_bytes, args...) instead of kernel<<<grid, block>>>(args...).
// Header-only, C++17, no dependency beyond the standard library (g++ or clang++, -pthread).
//
// The execution model
//   - A launch runs its blocks one after another (blockIdx in x, then y, then z order). A block runs as
//     blockDim.x * blockDim.y * blockDim.z std::threads; threadIdx, blockIdx, blockDim, gridDim are
//     thread_local. Lane = linear thread index % 32; warp = linear index / 32 (the last warp may be partial).
//   - __syncthreads() is a barrier of the block's threads; __syncwarp() a barrier of the warp's lanes. Both
//     order memory like their CUDA namesakes (mutex + condition variable: ThreadSanitizer understands them).
//   - Static __shared__ variables are `static` locals: one object per kernel instantiation, which the one block
//     that runs at a time owns. Built through cuda_on_cpu.py, each is registered when first reached and filled
//     with 0xFF bytes (NaN) then and before every later block (see register_static_shared), so a read of
//     shared memory the block did not write brings a NaN in, as a GPU's undefined contents would bring garbage. Dynamic shared memory is declared with
//     AC_EXTERN_SHARED(type, name) (see below); it is one arena per launch, 128-byte aligned, filled with 0xFF
//     bytes (NaN as float, half and bfloat16) before each block.
//   - Warp shuffles and votes (__shfl*_sync, __ballot_sync, __any_sync, __all_sync) exchange values through
//     the warp, with the lane arithmetic of the CUDA Programming Guide (width included). Only full masks
//     (every lane of the warp) are emulated; any other mask stops the launch with an error.
//   - __half and __nv_bfloat16 store 16 bits; conversions from float round to nearest, ties to even, as
//     __float2half / __float2bfloat16 do. No arithmetic operators are defined on them (the kernels are built
//     with __CUDA_NO_HALF_OPERATORS__ on the GPU too), so a kernel that relies on them fails to compile here.
//   - nvcuda::wmma: fragments, fill_fragment, load_matrix_sync, mma_sync, store_matrix_sync for m16n16k16
//     (half and bfloat16 operands, float accumulator). The element-to-lane mapping of a fragment is
//     unspecified on a GPU; here every fragment (matrix_a, matrix_b, accumulator) holds 8 of the 256 elements in
//     each lane (lane l: row-major elements l, l + 32, ...; -DAC_CPU_WMMA_LAYOUT=1 scrambles them, differently
//     per use, to check that a kernel does not depend on the mapping), and mma_sync gathers the operands from
//     all 32 lanes. Loads and stores check that every lane of the warp passes the same pointer, ldm and layout.
//     Element-wise code over frag.x[0 .. num_elements) between fragments of the same type is therefore
//     correct here exactly when it is correct on a GPU; code that assumes a particular mapping is not.
//     mma_sync multiplies exactly (every fp16/bf16 product fits a float) and sums in float, in k order.
//     load/store check CUDA's documented preconditions: 256-bit aligned pointer, ldm a multiple of 16 bytes.
//
// What a run checks, beyond the numbers the kernel writes
//   - Barriers: every thread of a block must execute the same number of __syncthreads(), every lane of a warp
//     the same sequence of warp-collective calls (__syncwarp, shuffles, votes, WMMA); a barrier that waits
//     longer than AC_CPU_BARRIER_TIMEOUT seconds (default 60) is reported as a deadlock. Any of these, or a
//     broken WMMA precondition, stops the launch: ac_cpu::launch returns false and ac_cpu::last_error() says
//     which thread and why.
//   - Races: built with -fsanitize=thread, ThreadSanitizer reports every pair of conflicting accesses (global or
//     shared memory) that no barrier orders, i.e. every missing __syncthreads / __syncwarp that a run reaches.
//
// What it cannot show: speed, occupancy, register use, shared-memory bank conflicts, coalescing, the real warp
// scheduler (threads here interleave however the OS schedules them, not in lock-step warps), tensor-core
// rounding (products are exact, sums float), and memory-model subtleties finer than barriers. Shuffles and
// votes wait for the whole warp, so without ThreadSanitizer they order memory here although they do not on a
// GPU; under ThreadSanitizer that ordering is hidden from it, so a __syncwarp that a shuffle seems to replace
// is still reported missing.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <math.h>  // exp2f, fmaxf, INFINITY, ... in the global namespace, as device code has them
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define AC_CUDA_ON_CPU 1

// ----------------------------------------------------------------------------------------- keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__ static const
// Dynamic shared memory. CUDA spells it `extern __shared__ T name[];`, which no macro can give a per-block
// meaning in C++ (`extern` and `static` do not combine); kernels that need it write AC_EXTERN_SHARED(T, name),
// which a CUDA build defines as exactly that declaration (see flash_kernels.cuh).
#define AC_EXTERN_SHARED(T, name) T* const name = ::ac_cpu::dynamic_shared<T>()

constexpr int warpSize = 32;

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

namespace ac_cpu {

// ------------------------------------------------------------------------------- errors and barriers

struct KernelAbort {};  // thrown in every thread of a block once one of them has failed

class Block;
inline thread_local Block* tls_block = nullptr;
inline thread_local int tls_linear = 0;  // linear thread index in the block

inline double barrier_timeout_s() {
  const char* env = std::getenv("AC_CPU_BARRIER_TIMEOUT");
  return env ? std::atof(env) : 60.0;
}

inline std::string& error_slot() {
  static std::string msg;
  return msg;
}

// The reason the last launch failed ("" when it succeeded).
inline const char* last_error() { return error_slot().c_str(); }

// A reusable barrier of `expected` threads (generation counting); threads that finish leave it (drop).
class Barrier {
 public:
  explicit Barrier(int expected = 0) : expected_(expected) {}
  void reset(int expected) {
    expected_ = expected;
    count_ = 0;
  }
  // Returns when all expected threads have arrived; throws KernelAbort when the block failed meanwhile.
  template <class Abort, class OnTimeout>
  void wait(Abort aborted, OnTimeout on_timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t gen = generation_;
    if (++count_ >= expected_) {
      release();
      return;
    }
    const auto limit = std::chrono::duration<double>(barrier_timeout_s());
    const auto start = std::chrono::steady_clock::now();
    while (generation_ == gen) {
      if (aborted()) throw KernelAbort{};
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      if (generation_ == gen && std::chrono::steady_clock::now() - start > limit) {
        const int arrived = count_, expected = expected_;
        lock.unlock();
        on_timeout(arrived, expected);  // records the error and throws
        return;
      }
    }
  }
  void drop() {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    if (count_ > 0 && count_ >= expected_) release();
  }
  void wake_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    cv_.notify_all();
  }

 private:
  void release() {
    count_ = 0;
    ++generation_;
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  int expected_ = 0, count_ = 0;
  uint64_t generation_ = 0;
};

// What one lane did, compared across the warp when the block ends (lanes of a warp must agree).
struct LaneLog {
  uint64_t syncthreads = 0;
  uint64_t warp_collectives = 0;
  uint64_t collective_hash = 0;  // which collectives, in which order
};

struct Warp {
  Barrier barrier;
  int size = 32;
  uint64_t slots[32] = {};  // values exchanged by shuffles and votes
  uint64_t slots2[32] = {};  // a second value per lane (WMMA: the b operand's fragment, the stride)
};

class Block {
 public:
  Block(int threads) : threads_(threads), warps_((threads + 31) / 32), logs_(threads) {
    block_barrier_.reset(threads);
    for (int w = 0; w < (int)warps_.size(); ++w) {
      warps_[w].size = std::min(32, threads - 32 * w);
      warps_[w].barrier.reset(warps_[w].size);
    }
  }
  bool failed() const { return failed_.load(); }
  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!failed_.load()) error_ = why;
      failed_.store(true);
    }
    block_barrier_.wake_all();
    for (Warp& w : warps_) w.barrier.wake_all();
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(error_mutex_);
    return error_;
  }
  Barrier& block_barrier() { return block_barrier_; }
  Warp& warp(int w) { return warps_[w]; }
  int warp_count() const { return (int)warps_.size(); }
  LaneLog& log(int linear) { return logs_[linear]; }
  int threads() const { return threads_; }

 private:
  int threads_;
  Barrier block_barrier_;
  std::vector<Warp> warps_;
  std::vector<LaneLog> logs_;
  std::atomic<bool> failed_{false};
  std::mutex error_mutex_;
  std::string error_;
};

inline std::string where() {
  char buf[160];
  std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z,
                threadIdx.x, threadIdx.y, threadIdx.z);
  return buf;
}

// Stops the launch: the calling thread and every other thread of the block unwind at their next barrier.
[[noreturn]] inline void fail(const std::string& why) {
  tls_block->fail(where() + ": " + why);
  throw KernelAbort{};
}

inline int lane_id() { return tls_linear % 32; }
inline int warp_id() { return tls_linear / 32; }

inline void block_sync() {
  Block* b = tls_block;
  b->log(tls_linear).syncthreads++;
  b->block_barrier().wait([b] { return b->failed(); }, [](int arrived, int expected) {
    fail("__syncthreads waited " + std::to_string(barrier_timeout_s()) + " s: " + std::to_string(arrived) +
         " of " + std::to_string(expected) + " threads arrived (a deadlock: a barrier some threads skip?)");
  });
}

// Records a warp-collective call (kind: a small constant per operation) so lanes can be compared at the end.
inline void log_collective(uint64_t kind) {
  LaneLog& log = tls_block->log(tls_linear);
  log.warp_collectives++;
  log.collective_hash = log.collective_hash * 1099511628211ull + kind + 1;
}

inline unsigned full_mask() {
  const int size = tls_block->warp(warp_id()).size;
  return size == 32 ? 0xffffffffu : ((1u << size) - 1u);
}

inline void check_mask(unsigned mask, const char* op) {
  if ((mask & full_mask()) != full_mask()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s with mask 0x%08x: the harness emulates full-warp masks only (0x%08x)", op,
                  mask, full_mask());
    fail(buf);
  }
}

inline void warp_sync(const char* op) {
  Block* b = tls_block;
  b->warp(warp_id()).barrier.wait([b] { return b->failed(); }, [op](int arrived, int expected) {
    fail(std::string(op) + " waited " + std::to_string(barrier_timeout_s()) + " s: " + std::to_string(arrived) +
         " of " + std::to_string(expected) + " lanes arrived (divergent warp-collective call?)");
  });
}

// On a GPU a shuffle or a vote moves register values between lanes but orders no memory access (only __syncwarp
// and __syncthreads do). The harness implements them with a barrier; under ThreadSanitizer that barrier is hidden
// from it (and the slots it exchanges through), so a kernel that counts on a shuffle to order memory is reported.
#if defined(__SANITIZE_THREAD__)
#define AC_CPU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define AC_CPU_TSAN 1
#endif
#endif
#ifdef AC_CPU_TSAN
}  // namespace ac_cpu
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}
namespace ac_cpu {
struct UnorderedExchange {
  UnorderedExchange() {
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~UnorderedExchange() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  }
};
#else
struct UnorderedExchange {};
#endif

// One exchange through the warp: every lane publishes `value`, then reads lane `src`'s (own value if src < 0).
template <typename T>
T warp_exchange(T value, int src, const char* op, uint64_t kind) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value, "shuffle of a small POD");
  log_collective(kind);
  [[maybe_unused]] UnorderedExchange unordered;
  Warp& w = tls_block->warp(warp_id());
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  w.slots[lane_id()] = bits;
  warp_sync(op);  // every lane has published
  T out = value;
  if (src >= 0 && src < w.size) std::memcpy(&out, &w.slots[src], sizeof(T));
  warp_sync(op);  // every lane has read: the slots can be reused
  return out;
}

// ----------------------------------------------------------------------------------- dynamic shared memory

// The launch's dynamic shared memory: `bytes` usable from a 128-byte aligned base (a GPU aligns it at least so).
struct Arena {
  std::vector<unsigned char> storage;
  unsigned char* base = nullptr;
  size_t bytes = 0;
  void reset(size_t n) {
    storage.assign(n + 128, 0);
    const uintptr_t raw = reinterpret_cast<uintptr_t>(storage.data());
    base = storage.data() + ((128 - raw % 128) % 128);
    bytes = n;
  }
};

inline Arena& dynamic_arena() {
  static Arena arena;
  return arena;
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(dynamic_arena().base);
}

// ---------------------------------------------------------------------------------- static shared memory

// Static __shared__ arrays are `static` locals, zero-initialised once and then kept from block to block, where a
// GPU gives a block undefined contents. cuda_on_cpu.py builds the kernels with every static __shared__
// declaration followed by `static const bool <name>_ac_registered = ac_cpu::register_static_shared(...)`: the
// first thread to get there (C++ runs a static local's initialiser once, other threads wait for it) records the
// array and fills it with 0xFF bytes, and every later block starts with it filled again (NaN as float, half and
// bfloat16), so a read of shared memory that this block did not write shows up as it would on a GPU: garbage.
struct StaticShared {
  void* ptr;
  size_t bytes;
};
inline std::mutex& static_shared_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<StaticShared>& static_shared() {
  static std::vector<StaticShared> regions;
  return regions;
}
inline bool register_static_shared(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(static_shared_mutex());
  static_shared().push_back({ptr, bytes});
  std::memset(ptr, 0xFF, bytes);
  return true;
}
inline void poison_static_shared() {
  std::lock_guard<std::mutex> lock(static_shared_mutex());
  for (const StaticShared& r : static_shared()) std::memset(r.ptr, 0xFF, r.bytes);
}

// --------------------------------------------------------------------------------------------------- launch

// Runs kernel(args...) over the grid, block after block. Returns false (and sets last_error()) when a thread
// broke a harness check or threw; the output is then incomplete.
template <typename... Params, typename... Args>
bool launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, Args&&... args) {
  error_slot().clear();
  const int threads = (int)(block.x * block.y * block.z);
  if (threads <= 0 || threads > 1024 || grid.x * grid.y * grid.z == 0) {
    error_slot() = "bad launch shape: block of " + std::to_string(threads) + " threads (1..1024), grid of " +
                   std::to_string(grid.x * grid.y * grid.z) + " blocks";
    return false;
  }
  Arena& arena = dynamic_arena();
  arena.reset(dynamic_smem);
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::memset(arena.base, 0xFF, arena.bytes);  // undefined on a GPU: NaN here
        poison_static_shared();                       // what the previous block left: NaN too
        Block blk(threads);
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            tls_block = &blk;
            tls_linear = t;
            threadIdx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            blockIdx = uint3{bx, by, bz};
            blockDim = block;
            gridDim = grid;
            try {
              kernel(args...);
            } catch (const KernelAbort&) {
            } catch (const std::exception& e) {
              blk.fail(where() + ": exception " + e.what());
            }
            blk.block_barrier().drop();
            blk.warp(t / 32).barrier.drop();
          });
        }
        for (std::thread& th : pool) th.join();
        if (blk.failed()) {
          error_slot() = blk.error();
          return false;
        }
        // Lanes of a warp must have made the same collective calls, threads of a block the same barriers.
        for (int t = 0; t < threads; ++t) {
          const LaneLog &a = blk.log(t), &first = blk.log(0), &lead = blk.log(t - t % 32);
          char buf[256];
          if (a.syncthreads != first.syncthreads) {
            std::snprintf(buf, sizeof buf, "block (%u,%u,%u): thread %d executed %llu __syncthreads, thread 0 %llu "
                          "(a barrier inside divergent code)", bx, by, bz, t, (unsigned long long)a.syncthreads,
                          (unsigned long long)first.syncthreads);
            error_slot() = buf;
            return false;
          }
          if (a.warp_collectives != lead.warp_collectives || a.collective_hash != lead.collective_hash) {
            std::snprintf(buf, sizeof buf, "block (%u,%u,%u): lane %d of warp %d made %llu warp-collective calls, "
                          "lane 0 %llu, or in another order (a collective inside divergent code)", bx, by, bz,
                          t % 32, t / 32, (unsigned long long)a.warp_collectives,
                          (unsigned long long)lead.warp_collectives);
            error_slot() = buf;
            return false;
          }
        }
      }
    }
  }
  return true;
}

}  // namespace ac_cpu

// ------------------------------------------------------------------------------------ synchronisation

inline void __syncthreads() { ac_cpu::block_sync(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ac_cpu::check_mask(mask, "__syncwarp");
  ac_cpu::log_collective(1);
  ac_cpu::warp_sync("__syncwarp");
}
inline unsigned __activemask() { return ac_cpu::full_mask(); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { ac_cpu::fail("__trap()"); }

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  ac_cpu::check_mask(mask, "__shfl_sync");
  const int lane = ac_cpu::lane_id();
  return ac_cpu::warp_exchange(var, (lane / width) * width + (src_lane % width), "__shfl_sync", 2);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  ac_cpu::check_mask(mask, "__shfl_xor_sync");
  const int lane = ac_cpu::lane_id(), src = lane ^ lane_mask;
  // A lane may read an earlier group of `width` lanes, never a later one (it then keeps its own value).
  return ac_cpu::warp_exchange(var, src >= (lane / width + 1) * width ? -1 : src, "__shfl_xor_sync", 3);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  ac_cpu::check_mask(mask, "__shfl_down_sync");
  const int lane = ac_cpu::lane_id();
  return ac_cpu::warp_exchange(var, lane % width + (int)delta >= width ? -1 : lane + (int)delta,
                               "__shfl_down_sync", 4);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  ac_cpu::check_mask(mask, "__shfl_up_sync");
  const int lane = ac_cpu::lane_id();
  return ac_cpu::warp_exchange(var, lane % width - (int)delta < 0 ? -1 : lane - (int)delta, "__shfl_up_sync", 5);
}

namespace ac_cpu {
inline unsigned vote(unsigned mask, int predicate, const char* op, uint64_t kind) {
  check_mask(mask, op);
  log_collective(kind);
  [[maybe_unused]] UnorderedExchange unordered;
  Warp& w = tls_block->warp(warp_id());
  w.slots[lane_id()] = predicate ? 1 : 0;
  warp_sync(op);
  unsigned bits = 0;
  for (int l = 0; l < w.size; ++l) bits |= (w.slots[l] ? 1u : 0u) << l;
  warp_sync(op);
  return bits;
}
}  // namespace ac_cpu

inline unsigned __ballot_sync(unsigned mask, int predicate) { return ac_cpu::vote(mask, predicate, "__ballot_sync", 6); }
inline int __any_sync(unsigned mask, int predicate) { return ac_cpu::vote(mask, predicate, "__any_sync", 7) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  return ac_cpu::vote(mask, predicate, "__all_sync", 8) == ac_cpu::full_mask();
}

// ------------------------------------------------------------------------------------------ math

// CUDA's device min/max on integers and floats, in the global namespace as in device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
// Fast-math intrinsics: the GPU versions trade accuracy for speed (a few ulp); the exact function is used here.
inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// ------------------------------------------------------------------------------ __half and __nv_bfloat16

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace ac_cpu {
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float -> IEEE binary16, round to nearest, ties to even (subnormals, overflow to inf and NaN included).
inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));  // NaN, inf
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero); |f| * 2^24 rounded to an integer
    const float scaled = bits_float(a) * 16777216.0f;  // exact: a power-of-two scaling
    return (uint16_t)(sign | (uint32_t)std::nearbyint(scaled));  // the default rounding mode is to-nearest-even
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias the exponent (-112 << 23) and round the 13 dropped bits
  return (uint16_t)(sign | (a >> 13));
}
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = (float)mant * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // ties to even
}
inline float bf16_bits_to_float(uint16_t b) { return bits_float((uint32_t)b << 16); }
}  // namespace ac_cpu

inline __half __float2half(float f) { return __half{ac_cpu::float_to_half_bits(f)}; }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return ac_cpu::half_bits_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16{ac_cpu::float_to_bf16_bits(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return ac_cpu::bf16_bits_to_float(b.bits); }

// ------------------------------------------------------------------------------------------------ WMMA

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <typename T>
float to_f(T x);
template <>
inline float to_f<float>(float x) { return x; }
template <>
inline float to_f<__half>(__half x) { return __half2float(x); }
template <>
inline float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// CUDA: "mptr must be a 256-bit aligned pointer"; "ldm ... must be a multiple of 8 for __half element type or
// multiple of 4 for float element type" (16 bytes either way).
template <typename T>
void check_pointer(const T* ptr, unsigned ldm, const char* op) {
  if (reinterpret_cast<uintptr_t>(ptr) % 32 != 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: pointer %p is not 256-bit (32-byte) aligned", op, (const void*)ptr);
    ac_cpu::fail(buf);
  }
  if ((ldm * sizeof(T)) % 16 != 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: ldm = %u elements of %zu bytes is not a multiple of 16 bytes", op, ldm,
                  sizeof(T));
    ac_cpu::fail(buf);
  }
}
}  // namespace detail

// Which element of a 16 x 16 tile (row-major index 0..255) lane `lane` holds in x[i] of a fragment; `use` is 0
// for matrix_a, 1 for matrix_b, 2 for an accumulator. Each lane holds 8 elements of every fragment, as on a GPU
// (where the mapping is unspecified and differs between uses and architectures). AC_CPU_WMMA_LAYOUT picks the
// mapping: 0 (default) lane l holds elements l, l + 32, l + 64, ...; 1 a scrambled bijection per use,
// (m e + c) mod 256 of e = 8 l + i with an odd m, so no lane holds a row, a column or what it would hold under 0.
// A kernel that is right for any mapping gives bit-identical results under both.
#ifndef AC_CPU_WMMA_LAYOUT
#define AC_CPU_WMMA_LAYOUT 0
#endif
inline int element_of(int use, int lane, int i) {
  static constexpr int mul[3] = {53, 149, 37}, add[3] = {101, 7, 11};
  return AC_CPU_WMMA_LAYOUT == 0 ? lane + 32 * i : (mul[use] * (8 * lane + i) + add[use]) % 256;
}

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment;

// matrix_a (M x K) and matrix_b (K x N): 8 of the tile's 256 elements in each lane (element_of); mma_sync
// gathers the whole tile from the 32 lanes of the warp, as the tensor core reads every lane's registers.
template <int M, int N, int K, typename T, typename Layout>
class fragment<matrix_a, M, N, K, T, Layout> {
  static_assert(M == 16 && N == 16 && K == 16, "the harness emulates m16n16k16 only");
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "half or bfloat16");

 public:
  static constexpr int rows = M, cols = K, use = 0;
  static constexpr int num_elements = M * K / 32;
  T x[num_elements];
  static int index(int i) { return element_of(use, ac_cpu::lane_id(), i); }
};
template <int M, int N, int K, typename T, typename Layout>
class fragment<matrix_b, M, N, K, T, Layout> {
  static_assert(M == 16 && N == 16 && K == 16, "the harness emulates m16n16k16 only");
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value, "half or bfloat16");

 public:
  static constexpr int rows = K, cols = N, use = 1;
  static constexpr int num_elements = K * N / 32;
  T x[num_elements];
  static int index(int i) { return element_of(use, ac_cpu::lane_id(), i); }
};
// accumulator (M x N, float): 8 of the 256 elements in each lane.
template <int M, int N, int K, typename T>
class fragment<accumulator, M, N, K, T, void> {
  static_assert(M == 16 && N == 16 && K == 16, "the harness emulates m16n16k16 only");
  static_assert(std::is_same<T, float>::value, "the harness emulates float accumulators only");

 public:
  static constexpr int use = 2;
  static constexpr int num_elements = M * N / 32;
  T x[num_elements];
  static int index(int i) { return element_of(use, ac_cpu::lane_id(), i); }
};

namespace detail {
// WMMA loads and stores are warp-wide: CUDA requires every lane to pass the same pointer, stride and layout
// ("mptr, ldm, layout, and all template parameters for a must be the same for all threads in the warp").
// Checked here by comparing the lanes' arguments (an exchange that orders no memory, as on a GPU).
inline void check_uniform(const char* op, const void* ptr, uint64_t ldm_layout) {
  ac_cpu::Warp& w = ac_cpu::tls_block->warp(ac_cpu::warp_id());
  const int lane = ac_cpu::lane_id();
  int odd = -1;
  {
    [[maybe_unused]] ac_cpu::UnorderedExchange unordered;
    w.slots[lane] = reinterpret_cast<uintptr_t>(ptr);
    w.slots2[lane] = ldm_layout;
    ac_cpu::warp_sync(op);
    for (int l = 0; l < w.size && odd < 0; ++l)
      if (w.slots[l] != w.slots[0] || w.slots2[l] != w.slots2[0]) odd = l;
    ac_cpu::warp_sync(op);
  }
  if (odd >= 0) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s: lane %d of the warp passed another pointer, ldm or layout than lane 0 "
                  "(every lane must pass the same)", op, odd);
    ac_cpu::fail(buf);
  }
}
}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const T& value) {
  ac_cpu::log_collective(16);
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = value;
}

// matrix_a / matrix_b: element (r, c) of the tile at ptr[r * ldm + c] (row_major) or ptr[c * ldm + r]; each lane
// loads only the elements it holds.
template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(!std::is_same<Use, accumulator>::value, "an accumulator load takes a layout_t");
  static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                "matrix_a / matrix_b fragments need a row_major or col_major layout");
  ac_cpu::log_collective(17);
  detail::check_uniform("load_matrix_sync", ptr, ldm);
  detail::check_pointer(ptr, ldm, "load_matrix_sync");
  constexpr int C = fragment<Use, M, N, K, T, Layout>::cols;
  for (int i = 0; i < f.num_elements; ++i) {
    const int e = f.index(i), r = e / C, c = e % C;
    f.x[i] = std::is_same<Layout, row_major>::value ? ptr[(size_t)r * ldm + c] : ptr[(size_t)c * ldm + r];
  }
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* ptr, unsigned ldm, layout_t layout) {
  ac_cpu::log_collective(18);
  detail::check_uniform("load_matrix_sync", ptr, (uint64_t)ldm << 1 | (uint64_t)layout);
  detail::check_pointer(ptr, ldm, "load_matrix_sync");
  for (int i = 0; i < f.num_elements; ++i) {
    const int e = f.index(i), r = e / N, c = e % N;
    f.x[i] = layout == mem_row_major ? ptr[(size_t)r * ldm + c] : ptr[(size_t)c * ldm + r];
  }
}

template <int M, int N, int K>
void store_matrix_sync(float* ptr, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
  ac_cpu::log_collective(19);
  detail::check_uniform("store_matrix_sync", ptr, (uint64_t)ldm << 1 | (uint64_t)layout);
  detail::check_pointer(ptr, ldm, "store_matrix_sync");
  for (int i = 0; i < f.num_elements; ++i) {
    const int e = f.index(i), r = e / N, c = e % N;
    (layout == mem_row_major ? ptr[(size_t)r * ldm + c] : ptr[(size_t)c * ldm + r]) = f.x[i];
  }
}

// d = a b + c (d may be c). The warp's lanes publish their a and b fragments, every lane gathers both whole
// tiles from them (an exchange that orders no memory access, like the tensor core's), then computes the
// accumulator elements it holds.
template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  using FA = fragment<matrix_a, M, N, K, T, LA>;
  using FB = fragment<matrix_b, M, N, K, T, LB>;
  ac_cpu::log_collective(20);
  ac_cpu::Warp& w = ac_cpu::tls_block->warp(ac_cpu::warp_id());
  if (w.size != 32) ac_cpu::fail("mma_sync: a WMMA operation needs a full warp of 32 lanes");
  float A[M * K], B[K * N];
  {
    [[maybe_unused]] ac_cpu::UnorderedExchange unordered;
    const int lane = ac_cpu::lane_id();
    w.slots[lane] = reinterpret_cast<uintptr_t>(&a);
    w.slots2[lane] = reinterpret_cast<uintptr_t>(&b);
    ac_cpu::warp_sync("mma_sync");  // every lane has published its fragments
    for (int l = 0; l < 32; ++l) {
      const FA* fa = reinterpret_cast<const FA*>(w.slots[l]);
      const FB* fb = reinterpret_cast<const FB*>(w.slots2[l]);
      for (int i = 0; i < FA::num_elements; ++i) A[element_of(FA::use, l, i)] = detail::to_f(fa->x[i]);
      for (int i = 0; i < FB::num_elements; ++i) B[element_of(FB::use, l, i)] = detail::to_f(fb->x[i]);
    }
    ac_cpu::warp_sync("mma_sync");  // every lane has read them: they may change again
  }
  for (int i = 0; i < d.num_elements; ++i) {
    const int e = d.index(i), r = e / N, col = e % N;
    float sum = 0.f;
    for (int kk = 0; kk < K; ++kk) sum += A[r * K + kk] * B[kk * N + col];
    d.x[i] = c.x[i] + sum;
  }
}

}  // namespace wmma
}  // namespace nvcuda
