// Host side of the flash kernels, shared by the GPU launcher (flash_launch.cu) and the CPU one (flash_cpu.cpp):
// validate the problem, pick the padded head dim D and the kernel, compute its grid and block. How a kernel is
// then started is the Launch object's business: `kernel<<<grid, block, 0, stream>>>(...)` on a GPU,
// ac_cpu::launch(kernel, grid, block, 0, ...) on the CPU. Include after flash_kernels.cuh.

#pragma once

// Status codes besides 0 (success) and the launcher's own error codes.
#define AC_ERR_BAD_ARGS (-1)
#define AC_ERR_UNSUPPORTED (-2)

namespace ac {

// dtype codes: 0 float32, 1 float16, 2 bfloat16.
template <int DTYPE> struct DtypeOf;
template <> struct DtypeOf<0> { using type = float; };
template <> struct DtypeOf<1> { using type = __half; };
template <> struct DtypeOf<2> { using type = __nv_bfloat16; };

template <int LEVEL, int DTYPE, int D, class Launch>
int launch_kernel(Launch& launch, const void* q, const void* k, const void* v, void* o, const Problem& p) {
  using T = typename DtypeOf<DTYPE>::type;
  const T* qt = static_cast<const T*>(q);
  const T* kt = static_cast<const T*>(k);
  const T* vt = static_cast<const T*>(v);
  T* ot = static_cast<T*>(o);
  if constexpr (LEVEL == 1) {
    constexpr int BM = kLevel1BlockM, BN = kLevel1BlockN;
    const dim3 grid((p.L + BM - 1) / BM, p.B * p.Hq);
    return launch(flash_fwd_rowwise<T, D, BM, BN>, grid, dim3(BM * level1_lanes_per_row<D>()), qt, kt, vt, ot, p);
  } else {
    constexpr int WARPS = level2_warps<D>();
    const dim3 grid((p.L + 16 * WARPS - 1) / (16 * WARPS), p.B * p.Hq);
    return launch(flash_fwd_wmma<T, D, WARPS>, grid, dim3(32 * WARPS), qt, kt, vt, ot, p);
  }
}

template <int LEVEL, int DTYPE, class Launch>
int launch_for_dim(Launch& launch, int D, const void* q, const void* k, const void* v, void* o, const Problem& p) {
  switch (D) {
    case 16: return launch_kernel<LEVEL, DTYPE, 16>(launch, q, k, v, o, p);
    case 32: return launch_kernel<LEVEL, DTYPE, 32>(launch, q, k, v, o, p);
    case 64: return launch_kernel<LEVEL, DTYPE, 64>(launch, q, k, v, o, p);
    default: return launch_kernel<LEVEL, DTYPE, 128>(launch, q, k, v, o, p);
  }
}

// dtype: 0 float32, 1 float16, 2 bfloat16. level: 1 (any dtype) or 2 (float16, and bfloat16 when
// bf16_wmma is true: sm_80+). Returns 0, the Launch's error code, or an AC_ERR_* code.
template <class Launch>
int flash_forward_dispatch(Launch& launch, bool bf16_wmma, const void* q, const void* k, const void* v, void* o,
                           int dtype, int level, int B, int Hq, int Hkv, int L, int S, int E, float scale,
                           int causal) {
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || L <= 0 || S < 0 || E <= 0 || E > 128) return AC_ERR_BAD_ARGS;
  if ((long long)B * Hq > 65535) return AC_ERR_BAD_ARGS;  // grid.y limit
  const int D = E <= 16 ? 16 : E <= 32 ? 32 : E <= 64 ? 64 : 128;
  const Problem p{B, Hq, Hkv, L, S, E, scale * kLog2e, causal};
  if (level == 1) {
    switch (dtype) {
      case 0: return launch_for_dim<1, 0>(launch, D, q, k, v, o, p);
      case 1: return launch_for_dim<1, 1>(launch, D, q, k, v, o, p);
      case 2: return launch_for_dim<1, 2>(launch, D, q, k, v, o, p);
      default: return AC_ERR_BAD_ARGS;
    }
  }
  if (level == 2) {
    switch (dtype) {
      case 1: return launch_for_dim<2, 1>(launch, D, q, k, v, o, p);
      case 2: return bf16_wmma ? launch_for_dim<2, 2>(launch, D, q, k, v, o, p) : AC_ERR_UNSUPPORTED;
      default: return AC_ERR_UNSUPPORTED;
    }
  }
  return AC_ERR_BAD_ARGS;
}

inline const char* dispatch_error_string(int code) {
  if (code == AC_ERR_BAD_ARGS) return "bad arguments (shapes, dtype code, level or head dim > 128)";
  if (code == AC_ERR_UNSUPPORTED) return "this level/dtype pair does not run on this device";
  return nullptr;
}

}  // namespace ac
