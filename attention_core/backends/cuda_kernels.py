"""The CUDA C++ sources of the ``cuda`` backend, as strings for ``torch.utils.cpp_extension.load_inline``.

Kept as Python strings (not ``.cu`` files) so that they travel with the package wherever it is installed
(``pip install git+...`` in Colab copies Python modules, not arbitrary data files), and so that tests can write
them out and compile them with ``nvcc`` on a machine without a GPU.

- :data:`KERNEL_SOURCE`: plain CUDA (no torch headers): the level-1 and level-2 kernels, their launchers, and
  ``ac_flash_forward``, the one C entry point.
- :data:`BINDING_SOURCE`: C++ against ATen: checks the tensors and calls ``ac_flash_forward``.

:mod:`attention_core.backends.cuda_flash` compiles and launches them.
"""

__all__ = ["BINDING_SOURCE", "KERNEL_SOURCE"]

KERNEL_SOURCE = r"""
// Flash attention forward in CUDA C++, at two levels. Plain CUDA, no torch: the launcher at the bottom takes
// raw pointers, so this source compiles on its own with nvcc (tests do that, for sm_75 and sm_80).
//
//   level 1  flash_fwd_rowwise  one thread per query row; K/V tiles staged in shared memory as fp32;
//                                online softmax one key at a time. Any dtype (fp32, fp16, bf16), fp32 math.
//   level 2  flash_fwd_wmma     tensor cores through WMMA (16x16x16 fragments): S = Q K^T and O += P V on the
//                                matrix units, fp16 or bf16 operands, fp32 accumulation; the online softmax
//                                of each 16-row strip done by the warp that owns it.
//
// Layout: q (B, Hq, L, E), k and v (B, Hkv, S, E), o (B, Hq, L, E), all contiguous; query head h reads key/value
// head h / (Hq / Hkv) (grouped-query attention). Causal masking is upper-left aligned: query i sees keys j <= i.
// A query row that sees no key (only when S == 0 here) is written as zeros.
//
// Scores are kept in base 2: s2 = (q . k) * scale * log2(e), so softmax needs exp2f, and the row's
// normaliser is l = sum 2^(s2 - m) with m the running max.
//
// bf16 WMMA fragments exist from sm_80 on. The bf16 level-2 kernel is compiled only when AC_WITH_BF16 is
// defined (the Python loader defines it for sm_80+ devices); without it the launcher reports "unsupported".

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <math.h>
#include <stdint.h>

namespace ac {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

struct Problem {
  int B, Hq, Hkv, L, S, E;  // E: the real head dim; kernels are compiled for D >= E (zero padding)
  float scale_log2;         // scale * log2(e)
  int causal;
};

// Offsets (in elements) of the first row of this block's query head and of the key/value head it reads.
__device__ __forceinline__ void head_offsets(const Problem& p, int bh, size_t* q_off, size_t* kv_off) {
  const int b = bh / p.Hq, h = bh % p.Hq;
  const int hkv = h / (p.Hq / p.Hkv);
  *q_off = (size_t)bh * p.L * p.E;
  *kv_off = ((size_t)b * p.Hkv + hkv) * p.S * p.E;
}

// ------------------------------------------------------------------------------------------------ level 1

// Grid (cdiv(L, BLOCK_M), B * Hq), BLOCK_M threads. Thread t owns query row blockIdx.x * BLOCK_M + t: its
// (pre-scaled) query and its output accumulator live in registers (D floats each). The block walks over the
// keys BLOCK_N at a time: all threads copy one K tile and one V tile into shared memory (as fp32), then each
// thread folds the tile's keys into its row with the online softmax:
//     m' = max(m, s);  l' = l * 2^(m - m') + 2^(s - m');  acc' = acc * 2^(m - m') + 2^(s - m') * v
// Every thread of a warp reads the same shared-memory word at the same time (a broadcast: no bank conflict).
template <typename T, int D, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(BLOCK_M)
flash_fwd_rowwise(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                  Problem p) {
  __shared__ float k_tile[BLOCK_N][D];
  __shared__ float v_tile[BLOCK_N][D];

  size_t q_off, kv_off;
  head_offsets(p, blockIdx.y, &q_off, &kv_off);
  const int row = blockIdx.x * BLOCK_M + threadIdx.x;
  const bool active = row < p.L;  // inactive threads still help to load tiles, so no early return

  float qr[D], acc[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    qr[d] = (active && d < p.E) ? to_float(q[q_off + (size_t)row * p.E + d]) * p.scale_log2 : 0.f;
    acc[d] = 0.f;
  }
  float m = -INFINITY, l = 0.f;

  // Causal: no row of this block sees a key past the block's last row.
  const int n_end = p.causal ? min(p.S, (int)(blockIdx.x + 1) * BLOCK_M) : p.S;
  for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
    __syncthreads();  // everyone is done with the previous tile
    for (int idx = threadIdx.x; idx < BLOCK_N * D; idx += BLOCK_M) {
      const int j = idx / D, d = idx % D, n = n0 + j;
      const bool ok = n < p.S && d < p.E;
      k_tile[j][d] = ok ? to_float(k[kv_off + (size_t)n * p.E + d]) : 0.f;
      v_tile[j][d] = ok ? to_float(v[kv_off + (size_t)n * p.E + d]) : 0.f;
    }
    __syncthreads();
    if (!active) continue;
    const int j_end = min(BLOCK_N, (p.causal ? min(p.S, row + 1) : p.S) - n0);  // keys this row sees here
    for (int j = 0; j < j_end; ++j) {
      float s = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) s += qr[d] * k_tile[j][d];
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new);  // 0 on the first key (m = -inf)
      const float pj = exp2f(s - m_new);
      l = l * alpha + pj;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * alpha + pj * v_tile[j][d];
      m = m_new;
    }
  }
  if (!active) return;
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int d = 0; d < D; ++d) {  // constant indices keep acc[] in registers
    if (d < p.E) o[q_off + (size_t)row * p.E + d] = from_float<T>(acc[d] * inv_l);
  }
}

// ------------------------------------------------------------------------------------------------ level 2

// Grid (cdiv(L, 16 * WARPS), B * Hq), 32 * WARPS threads. Warp w owns the 16 query rows [16w, 16w + 16) of the
// block's tile. Per key tile of BN = 32 keys:
//   1. all threads stage K and V (BN x D, zero-padded) in shared memory;
//   2. each warp computes its S strip (16 x BN) = Q_w K^T with WMMA, fp32 accumulators, stored to shared;
//   3. lanes 0..15 of the warp each take one row: mask, running max, P = 2^(S - m) rounded to T, row sums,
//      and alpha = 2^(m_old - m_new), the factor that rescales what the row has accumulated so far;
//   4. the warp rescales its O strip (fp32, shared memory) by alpha, then O_w += P_w V with WMMA.
// WMMA's fragment-to-thread layout is unspecified, so the per-row rescaling of step 4 goes through shared
// memory rather than registers. Shared memory (static, < 48 KB): Q, K, V tiles in T; S, O in fp32; P in T.
// WARPS = 4 for D <= 64, 2 for D = 128 (to stay under 48 KB).
template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
flash_fwd_wmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
               Problem p) {
  using namespace nvcuda;
  constexpr int BM = 16 * WARPS, BN = 32, THREADS = 32 * WARPS;
  static_assert(D % 16 == 0 && D <= 128, "D must be 16, 32, 64 or 128");
  // WMMA loads and stores need 256-bit aligned pointers: every sub-tile offset below is a multiple of 32 bytes.
  __shared__ __align__(32) T q_s[BM * D];
  __shared__ __align__(32) T k_s[BN * D];
  __shared__ __align__(32) T v_s[BN * D];
  __shared__ __align__(32) float s_s[BM * BN];
  __shared__ __align__(32) T p_s[BM * BN];
  __shared__ __align__(32) float o_s[BM * D];
  __shared__ float m_s[BM], l_s[BM], alpha_s[BM];

  size_t q_off, kv_off;
  head_offsets(p, blockIdx.y, &q_off, &kv_off);
  const int m0 = blockIdx.x * BM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int idx = threadIdx.x; idx < BM * D; idx += THREADS) {
    const int r = idx / D, d = idx % D;
    const bool ok = m0 + r < p.L && d < p.E;
    q_s[idx] = ok ? q[q_off + (size_t)(m0 + r) * p.E + d] : from_float<T>(0.f);
    o_s[idx] = 0.f;
  }
  for (int r = threadIdx.x; r < BM; r += THREADS) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.f;
  }
  __syncthreads();

  // This warp's Q strip as matrix_a fragments, kept in registers for the whole key loop.
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_frag[D / 16];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) wmma::load_matrix_sync(q_frag[kk], q_s + warp * 16 * D + kk * 16, D);

  float* s_w = s_s + warp * 16 * BN;
  T* p_w = p_s + warp * 16 * BN;
  float* o_w = o_s + warp * 16 * D;
  const int n_end = p.causal ? min(p.S, m0 + BM) : p.S;
  for (int n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    for (int idx = threadIdx.x; idx < BN * D; idx += THREADS) {
      const int j = idx / D, d = idx % D, n = n0 + j;
      const bool ok = n < p.S && d < p.E;
      k_s[idx] = ok ? k[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);
      v_s[idx] = ok ? v[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);
    }
    __syncthreads();

    // 2. S_w = Q_w K^T: K is stored (BN, D) row-major, which is K^T (D, BN) column-major.
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag;
      wmma::fill_fragment(s_frag, 0.f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k_frag;
        wmma::load_matrix_sync(k_frag, k_s + nt * 16 * D + kk * 16, D);
        wmma::mma_sync(s_frag, q_frag[kk], k_frag, s_frag);
      }
      wmma::store_matrix_sync(s_w + nt * 16, s_frag, BN, wmma::mem_row_major);
    }
    __syncwarp();

    // 3. Online softmax, one row per lane.
    if (lane < 16) {
      const int r = warp * 16 + lane, i = m0 + r;
      float* srow = s_w + lane * BN;
      T* prow = p_w + lane * BN;
      const float m_old = m_s[r];
      float m_new = m_old;
      for (int j = 0; j < BN; ++j) {
        const int n = n0 + j;
        const bool seen = n < p.S && (!p.causal || n <= i);
        srow[j] = seen ? srow[j] * p.scale_log2 : -INFINITY;
        m_new = fmaxf(m_new, srow[j]);
      }
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing seen yet: no NaN
      float sum = 0.f;
      for (int j = 0; j < BN; ++j) {
        const T pj = from_float<T>(exp2f(srow[j] - m_safe));
        prow[j] = pj;
        sum += to_float(pj);  // sum what the matrix units will multiply, rounding included
      }
      const float alpha = exp2f(m_old - m_safe);
      alpha_s[r] = alpha;
      l_s[r] = l_s[r] * alpha + sum;
      m_s[r] = m_new;
    }
    __syncwarp();

    // 4. O_w = alpha * O_w + P_w V.
    for (int idx = lane; idx < 16 * D; idx += 32) o_w[idx] *= alpha_s[warp * 16 + idx / D];
    __syncwarp();
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_frag;
      wmma::load_matrix_sync(o_frag, o_w + dt * 16, D, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_frag;
        wmma::load_matrix_sync(p_frag, p_w + kk * 16, BN);
        wmma::load_matrix_sync(v_frag, v_s + kk * 16 * D + dt * 16, D);
        wmma::mma_sync(o_frag, p_frag, v_frag, o_frag);
      }
      wmma::store_matrix_sync(o_w + dt * 16, o_frag, D, wmma::mem_row_major);
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < BM * D; idx += THREADS) {
    const int r = idx / D, d = idx % D;
    if (m0 + r < p.L && d < p.E) {
      const float l = l_s[r];
      o[q_off + (size_t)(m0 + r) * p.E + d] = from_float<T>(l > 0.f ? o_s[idx] / l : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------- launchers

template <typename T, int D>
cudaError_t launch_level1(const void* q, const void* k, const void* v, void* o, const Problem& p,
                          cudaStream_t stream) {
  constexpr int BLOCK_M = 64, BLOCK_N = 32;
  const dim3 grid((p.L + BLOCK_M - 1) / BLOCK_M, p.B * p.Hq);
  flash_fwd_rowwise<T, D, BLOCK_M, BLOCK_N><<<grid, BLOCK_M, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(o), p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_level2(const void* q, const void* k, const void* v, void* o, const Problem& p,
                          cudaStream_t stream) {
  constexpr int WARPS = D >= 128 ? 2 : 4;
  const dim3 grid((p.L + 16 * WARPS - 1) / (16 * WARPS), p.B * p.Hq);
  flash_fwd_wmma<T, D, WARPS><<<grid, 32 * WARPS, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(o), p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_level1(int D, const void* q, const void* k, const void* v, void* o, const Problem& p,
                            cudaStream_t s) {
  switch (D) {
    case 16: return launch_level1<T, 16>(q, k, v, o, p, s);
    case 32: return launch_level1<T, 32>(q, k, v, o, p, s);
    case 64: return launch_level1<T, 64>(q, k, v, o, p, s);
    default: return launch_level1<T, 128>(q, k, v, o, p, s);
  }
}

template <typename T>
cudaError_t dispatch_level2(int D, const void* q, const void* k, const void* v, void* o, const Problem& p,
                            cudaStream_t s) {
  switch (D) {
    case 16: return launch_level2<T, 16>(q, k, v, o, p, s);
    case 32: return launch_level2<T, 32>(q, k, v, o, p, s);
    case 64: return launch_level2<T, 64>(q, k, v, o, p, s);
    default: return launch_level2<T, 128>(q, k, v, o, p, s);
  }
}

}  // namespace ac

// Status codes of ac_flash_forward besides cudaSuccess (0) and CUDA's own error codes.
#define AC_ERR_BAD_ARGS (-1)
#define AC_ERR_UNSUPPORTED (-2)

// dtype: 0 float32, 1 float16, 2 bfloat16. level: 1 or 2 (level 2 takes float16, and bfloat16 when built with
// AC_WITH_BF16). Returns 0, a cudaError_t from the launch, or one of the AC_ERR_* codes above.
int ac_flash_forward(const void* q, const void* k, const void* v, void* o, int dtype, int level, int B, int Hq,
                     int Hkv, int L, int S, int E, float scale, int causal, void* stream) {
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || L <= 0 || S < 0 || E <= 0 || E > 128) return AC_ERR_BAD_ARGS;
  if ((long long)B * Hq > 65535) return AC_ERR_BAD_ARGS;  // grid.y limit
  const int D = E <= 16 ? 16 : E <= 32 ? 32 : E <= 64 ? 64 : 128;
  const ac::Problem p{B, Hq, Hkv, L, S, E, scale * ac::kLog2e, causal};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (level == 1) {
    switch (dtype) {
      case 0: return ac::dispatch_level1<float>(D, q, k, v, o, p, s);
      case 1: return ac::dispatch_level1<__half>(D, q, k, v, o, p, s);
      case 2: return ac::dispatch_level1<__nv_bfloat16>(D, q, k, v, o, p, s);
      default: return AC_ERR_BAD_ARGS;
    }
  }
  if (level == 2) {
    switch (dtype) {
      case 1: return ac::dispatch_level2<__half>(D, q, k, v, o, p, s);
#ifdef AC_WITH_BF16
      case 2: return ac::dispatch_level2<__nv_bfloat16>(D, q, k, v, o, p, s);
#endif
      default: return AC_ERR_UNSUPPORTED;
    }
  }
  return AC_ERR_BAD_ARGS;
}

const char* ac_flash_error_string(int code) {
  if (code == AC_ERR_BAD_ARGS) return "bad arguments (shapes, dtype code, level or head dim > 128)";
  if (code == AC_ERR_UNSUPPORTED) return "this level/dtype pair is not built for this GPU";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
"""

BINDING_SOURCE = r"""
// The torch side of the CUDA kernels: check the tensors, hand raw pointers to the launcher in KERNEL_SOURCE.
// Compiled by the host C++ compiler; no CUDA headers needed (the stream arrives from Python as an integer).
// load_inline puts #include <torch/extension.h> and the pybind11 module around this; the one header below is
// all the code itself needs, so tests can syntax-check it in seconds without a GPU.
#include <ATen/core/Tensor.h>

#include <cstdint>

int ac_flash_forward(const void* q, const void* k, const void* v, void* o, int dtype, int level, int B, int Hq,
                     int Hkv, int L, int S, int E, float scale, int causal, void* stream);
const char* ac_flash_error_string(int code);

// Writes attention(q, k, v) into out. q, out: (B, Hq, L, E); k, v: (B, Hkv, S, E); contiguous, one dtype, one
// CUDA device. stream: the cudaStream_t to launch on, as an integer (torch.cuda.current_stream().cuda_stream).
void flash_forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, bool is_causal,
                   double scale, int64_t level, int64_t stream) {
  const at::Tensor* all[] = {&q, &k, &v, &out};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->is_cuda(), "flash_forward: every tensor must be on a CUDA device, got ", t->device());
    TORCH_CHECK(t->dim() == 4, "flash_forward: tensors must be 4-D (B, H, N, E), got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), "flash_forward: tensors must be contiguous");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "flash_forward: one dtype for all, got ", t->scalar_type(),
                " and ", q.scalar_type());
    TORCH_CHECK(t->device() == q.device(), "flash_forward: one device for all");
  }
  const int64_t B = q.size(0), Hq = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == E && v.sizes() == k.sizes(),
              "flash_forward: expected k, v of shape (B, Hkv, S, E) = ", k.sizes(), " and v ", v.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "flash_forward: out must have q's shape ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(Hq % Hkv == 0, "flash_forward: query heads ", Hq, " not a multiple of key/value heads ", Hkv);
  int dtype = -1;
  switch (q.scalar_type()) {
    case at::kFloat: dtype = 0; break;
    case at::kHalf: dtype = 1; break;
    case at::kBFloat16: dtype = 2; break;
    default: TORCH_CHECK(false, "flash_forward: float32, float16 or bfloat16 only, got ", q.scalar_type());
  }
  const int status = ac_flash_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dtype,
                                      static_cast<int>(level), static_cast<int>(B), static_cast<int>(Hq),
                                      static_cast<int>(Hkv), static_cast<int>(L), static_cast<int>(S),
                                      static_cast<int>(E), static_cast<float>(scale), is_causal ? 1 : 0,
                                      reinterpret_cast<void*>(stream));
  TORCH_CHECK(status == 0, "flash_forward (level ", level, ", ", q.scalar_type(), "): ",
              ac_flash_error_string(status));
}
"""
