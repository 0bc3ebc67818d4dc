// Small kernels that test the CUDA-on-CPU harness itself (attention_core/backends/csrc/cuda_on_cpu.h), each
// behind a C entry point called by tests/test_cuda_on_cpu.py through ctypes. What each checks is said there.

#include "cuda_on_cpu.h"

using namespace nvcuda;

// ---------------------------------------------------------------------------------------- warp operations

// out[(blockIdx.x * blockDim.x + t) * 10 + i]: the result of operation i for thread t (see the Python side).
__global__ void warp_ops(int* out, int width, int xor_mask, int src_lane, int delta) {
  __shared__ int buf[1024];
  const int t = threadIdx.x, lane = t % 32;
  int* o = out + (blockIdx.x * blockDim.x + t) * 10;
  o[0] = __shfl_xor_sync(0xffffffffu, t, xor_mask, width);
  o[1] = __shfl_sync(0xffffffffu, t, src_lane, width);
  o[2] = __shfl_down_sync(0xffffffffu, t, delta, width);
  o[3] = __shfl_up_sync(0xffffffffu, t, delta, width);
  o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  o[5] = __any_sync(0xffffffffu, lane == 5);
  o[6] = __all_sync(0xffffffffu, lane < 20);
  buf[t] = 10 * t;
  __syncthreads();
  o[7] = buf[(t + 1) % blockDim.x];
  __syncwarp();
  float f = (float)lane;  // a float butterfly sum over the warp: every lane ends with the sum of the lane ids
  for (int m = 16; m > 0; m /= 2) f += __shfl_xor_sync(0xffffffffu, f, m);
  o[8] = (int)f;
  o[9] = (int)(blockIdx.x * 1000 + blockDim.x);
}

// ------------------------------------------------------------------------------------------------- WMMA

// d = 2 (a b + c) for one 16x16x16 tile. a and b are stored with leading dimension 24 (row- or column-major as
// the fragment layouts say), c row-major with ldm 16; d with ldm 24, row- or column-major.
template <typename T, typename LA, typename LB>
__global__ void wmma_tile(const T* a, const T* b, const float* c, float* d, int store_col) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc, two;
  wmma::load_matrix_sync(fa, a, 24);
  wmma::load_matrix_sync(fb, b, 24);
  wmma::load_matrix_sync(fc, c, 16, wmma::mem_row_major);
  wmma::fill_fragment(two, 2.f);
  wmma::mma_sync(fc, fa, fb, fc);
  for (int i = 0; i < fc.num_elements; ++i) fc.x[i] *= two.x[i];  // element-wise between same-type fragments
  wmma::store_matrix_sync(d, fc, 24, store_col ? wmma::mem_col_major : wmma::mem_row_major);
}

template <typename T>
bool run_wmma(int a_col, int b_col, int store_col, const void* a, const void* b, const float* c, float* d) {
  const T* at = static_cast<const T*>(a);
  const T* bt = static_cast<const T*>(b);
  if (!a_col && !b_col) return ac_cpu::launch(wmma_tile<T, wmma::row_major, wmma::row_major>, 1, 32, 0, at, bt, c, d, store_col);
  if (!a_col && b_col) return ac_cpu::launch(wmma_tile<T, wmma::row_major, wmma::col_major>, 1, 32, 0, at, bt, c, d, store_col);
  if (a_col && !b_col) return ac_cpu::launch(wmma_tile<T, wmma::col_major, wmma::row_major>, 1, 32, 0, at, bt, c, d, store_col);
  return ac_cpu::launch(wmma_tile<T, wmma::col_major, wmma::col_major>, 1, 32, 0, at, bt, c, d, store_col);
}

// -------------------------------------------------------------------------------- what the harness refuses

__global__ void broken(int which, const __half* a) {
  const int lane = threadIdx.x % 32;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  switch (which) {
    case 0: wmma::load_matrix_sync(fa, a + 1, 16); break;  // misaligned pointer
    case 1: wmma::load_matrix_sync(fa, a, 12); break;      // ldm of 24 bytes
    case 2: if (threadIdx.x < 16) __syncthreads(); break;  // a barrier only half the block reaches
    case 3: if (lane < 16) __syncwarp(); break;            // a warp collective only half the warp makes
    case 4: __syncwarp(0x0000ffffu); break;                // a partial mask
    case 5: if (lane == 0) __syncthreads(); else __syncwarp(); break;  // a deadlock
    case 6: __trap();
    case 7: wmma::load_matrix_sync(fa, a + 16 * (lane % 2), 16); break;  // lanes pass different pointers
  }
}

// Dynamic shared memory: out[b * n + t] = 1 if the arena held NaN before this block wrote it, and
// out2[b * n + t] = what thread t + 1 wrote.
__global__ void dynamic_smem(int* out, float* out2) {
  AC_EXTERN_SHARED(float, buf);
  const int t = threadIdx.x, n = blockDim.x, b = blockIdx.x;
  out[b * n + t] = buf[t] != buf[t];
  buf[t] = (float)(100 * b + t);
  __syncthreads();
  out2[b * n + t] = buf[(t + 1) % n];
}

extern "C" {

const char* st_error() { return ac_cpu::last_error(); }

void st_to_half(const float* in, int n, uint16_t* out) {
  for (int i = 0; i < n; ++i) out[i] = __float2half(in[i]).bits;
}
void st_to_bf16(const float* in, int n, uint16_t* out) {
  for (int i = 0; i < n; ++i) out[i] = __float2bfloat16(in[i]).bits;
}
void st_from_half(const uint16_t* in, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}
void st_from_bf16(const uint16_t* in, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}

int st_warp_ops(int blocks, int threads, int width, int xor_mask, int src_lane, int delta, int* out) {
  return ac_cpu::launch(warp_ops, blocks, threads, 0, out, width, xor_mask, src_lane, delta);
}

int st_wmma(int dtype, int a_col, int b_col, int store_col, const void* a, const void* b, const float* c, float* d) {
  return dtype == 1 ? run_wmma<__half>(a_col, b_col, store_col, a, b, c, d)
                    : run_wmma<__nv_bfloat16>(a_col, b_col, store_col, a, b, c, d);
}

int st_broken(int which, const void* a) {
  return ac_cpu::launch(broken, 1, 32, 0, which, static_cast<const __half*>(a));
}

int st_dynamic_smem(int blocks, int threads, int* out, float* out2) {
  return ac_cpu::launch(dynamic_smem, blocks, threads, threads * sizeof(float), out, out2);
}

}  // extern "C"
