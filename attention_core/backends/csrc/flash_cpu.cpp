// CPU host launcher of the flash kernels: the device code of flash_kernels.cuh, unchanged, run by the CUDA-on-CPU
// harness (cuda_on_cpu.h: one std::thread per CUDA thread, __syncthreads as a barrier, WMMA emulated).
// Built by attention_core.backends.cuda_on_cpu with g++ (optionally -fsanitize=thread) into a shared library
// with one C entry point, ac_flash_forward_cpu; flash_cpu_main.cpp wraps it as a program for ThreadSanitizer.

#include "cuda_on_cpu.h"
#include "flash_kernels.cuh"
#include "flash_dispatch.h"

namespace {

struct CpuLaunch {
  template <typename... Params, typename... Args>
  int operator()(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
    return ac_cpu::launch(kernel, grid, block, 0, args...) ? 0 : AC_ERR_HARNESS;
  }
  static constexpr int AC_ERR_HARNESS = -10;
};

}  // namespace

extern "C" {

// The arguments of ac_flash_forward (flash_launch.cu), without the stream. Returns 0, an AC_ERR_* code, or -10
// when the harness stopped the kernel (ac_flash_cpu_error() says why: a deadlock, a divergent barrier, ...).
int ac_flash_forward_cpu(const void* q, const void* k, const void* v, void* o, int dtype, int level, int B, int Hq,
                         int Hkv, int L, int S, int E, float scale, int causal) {
  CpuLaunch launch;
  return ac::flash_forward_dispatch(launch, true, q, k, v, o, dtype, level, B, Hq, Hkv, L, S, E, scale, causal);
}

const char* ac_flash_cpu_error(int code) {
  if (code == CpuLaunch::AC_ERR_HARNESS) return ac_cpu::last_error();
  const char* ours = ac::dispatch_error_string(code);
  return ours ? ours : "unknown error";
}

}  // extern "C"
