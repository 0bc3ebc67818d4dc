// GPU host launcher of the flash kernels: `ac_flash_forward`, the one C entry point the torch binding calls.
// Plain CUDA, no torch: it takes raw pointers, so this file compiles on its own with nvcc (tests do that, for
// sm_75, sm_80 and sm_90 in one arch list). The device code is flash_kernels.cuh, which the CPU harness runs
// too; the choice of kernel and grid is flash_dispatch.h, shared with the CPU launcher (flash_cpu.cpp).

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

#include "flash_kernels.cuh"
#include "flash_dispatch.h"

namespace {

// Starts a kernel with <<<>>> on one stream; returns the launch's cudaError_t.
struct GpuLaunch {
  cudaStream_t stream;
  template <typename... Params, typename... Args>
  int operator()(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
    kernel<<<grid, block, 0, stream>>>(args...);
    return static_cast<int>(cudaGetLastError());
  }
};

// bf16 WMMA needs sm_80+: asked of the device the kernel would run on (the current one).
bool device_has_bf16_wmma() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 8;
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16. level: 1 or 2 (level 2 takes float16, and bfloat16 on sm_80+).
// Returns 0, a cudaError_t from the launch, or one of the AC_ERR_* codes of flash_dispatch.h.
int ac_flash_forward(const void* q, const void* k, const void* v, void* o, int dtype, int level, int B, int Hq,
                     int Hkv, int L, int S, int E, float scale, int causal, void* stream) {
  GpuLaunch launch{static_cast<cudaStream_t>(stream)};
  const bool bf16 = level == 2 && dtype == 2 && device_has_bf16_wmma();
  return ac::flash_forward_dispatch(launch, bf16, q, k, v, o, dtype, level, B, Hq, Hkv, L, S, E, scale, causal);
}

const char* ac_flash_error_string(int code) {
  const char* ours = ac::dispatch_error_string(code);
  return ours ? ours : cudaGetErrorString(static_cast<cudaError_t>(code));
}
