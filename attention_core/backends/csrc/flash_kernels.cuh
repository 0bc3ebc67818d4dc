// Flash attention forward in CUDA C++, at two levels: the device code only.
//
// This file holds no host code and includes no CUDA header: the file that includes it first provides CUDA,
// either the real one (flash_launch.cu: cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, mma.h, compiled by nvcc) or
// the CPU harness (flash_cpu.cpp: cuda_on_cpu.h, compiled by g++, one std::thread per CUDA thread). The very
// same text is compiled both ways; the host side that chooses a kernel and its grid is flash_dispatch.h.
//
//   level 1  flash_fwd_rowwise  one thread per query row (two at D = 128); K/V tiles staged in shared memory as fp32;
//                                online softmax one key at a time. Any dtype (fp32, fp16, bf16), fp32 math.
//   level 2  flash_fwd_wmma     tensor cores through WMMA (16x16x16 fragments): S = Q K^T and O += P V on the
//                                matrix units, fp16 or bf16 operands, fp32 accumulation kept in registers; the
//                                online softmax of each 16-row strip done by the 32 lanes of the warp that owns it.
//
// Layout: q (B, Hq, L, E), k and v (B, Hkv, S, E), o (B, Hq, L, E), all contiguous; query head h reads key/value
// head h / (Hq / Hkv) (grouped-query attention). Causal masking is upper-left aligned: query i sees keys j <= i.
// A query row that sees no key (only when S == 0 here) is written as zeros.
//
// Scores are kept in base 2: s2 = (q . k) * scale * log2(e), so softmax needs exp2f, and the row's
// normaliser is l = sum 2^(s2 - m) with m the running max.
//
// bf16 WMMA fragments exist from sm_80 on: compiled for an older architecture (an arch list with sm_75), the
// bf16 level-2 kernel is an empty body that traps, and the host launcher never starts it there.

#pragma once

#include <math.h>
#include <stdint.h>

#include <type_traits>

#ifndef AC_EXTERN_SHARED  // dynamic shared memory, spelled so that the CPU harness can give it a meaning too
#define AC_EXTERN_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

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

// Launch shapes, read by the host launchers (flash_dispatch.h) so that kernel and grid agree.
constexpr int kLevel1BlockM = 64, kLevel1BlockN = 32;
// Level 1: threads per query row. One up to D = 64; two at D = 128, each holding half of the row (see below).
template <int D> constexpr int level1_lanes_per_row() { return D > 64 ? 2 : 1; }
template <int D> constexpr int level2_warps() { return D >= 128 ? 2 : 4; }

// ------------------------------------------------------------------------------------------------ level 1

// Grid (cdiv(L, BLOCK_M), B * Hq), BLOCK_M * R threads, R = level1_lanes_per_row<D>(). The R adjacent threads
// t = R * r + part own query row blockIdx.x * BLOCK_M + r; thread `part` holds the row's elements
// d = part + R * i, i < D / R, of the (pre-scaled) query and of the output accumulator: two arrays of D / R floats,
// indexed only by constants (the loops over i are unrolled), so the compiler keeps them in registers. One thread
// per row (R = 1) does that up to D = 64 (168-186 registers at -O3). At D = 128 one thread would need 2 x 128
// floats, more than the 255 registers a thread may have, and nvcc spilled 150-185 bytes per thread to local
// memory; so there two threads share a row (R = 2), each with 2 x 64 floats, and add their halves of every dot
// product with one __shfl_xor_sync (benchmarks/results/cuda_resources.md: no kernel spills).
// The block walks over the keys BLOCK_N at a time: all threads copy one K tile and one V tile into shared
// memory (as fp32), then each row folds the tile's keys in with the online softmax:
//     m' = max(m, s);  l' = l * 2^(m - m') + 2^(s - m');  acc' = acc * 2^(m - m') + 2^(s - m') * v
// Shared-memory reads: at each step all the threads of a warp with the same `part` read the same word (a
// broadcast), and with R = 2 the two parts read adjacent words, in two banks: no bank conflict.
template <typename T, int D, int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(BLOCK_M * level1_lanes_per_row<D>())
flash_fwd_rowwise(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                  Problem p) {
  constexpr int R = level1_lanes_per_row<D>(), DR = D / R, THREADS = BLOCK_M * R;
  static_assert(32 % R == 0 && D % R == 0, "the threads of a row must sit in one warp");
  __shared__ float k_tile[BLOCK_N][D];
  __shared__ float v_tile[BLOCK_N][D];

  size_t q_off, kv_off;
  head_offsets(p, blockIdx.y, &q_off, &kv_off);
  const int row = blockIdx.x * BLOCK_M + threadIdx.x / R, part = threadIdx.x % R;
  const bool active = row < p.L;  // inactive threads still help to load tiles, so no early return

  float qr[DR], acc[DR];  // elements d = part + R * i of the row
#pragma unroll
  for (int i = 0; i < DR; ++i) {
    const int d = part + R * i;
    qr[i] = (active && d < p.E) ? to_float(q[q_off + (size_t)row * p.E + d]) * p.scale_log2 : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;

  // Causal: no row of this block sees a key past the block's last row.
  const int n_end = p.causal ? min(p.S, (int)(blockIdx.x + 1) * BLOCK_M) : p.S;
  const int row_end = !active ? 0 : p.causal ? min(p.S, row + 1) : p.S;  // this row sees keys [0, row_end)
  for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
    __syncthreads();  // everyone is done with the previous tile
    for (int idx = threadIdx.x; idx < BLOCK_N * D; idx += THREADS) {
      const int j = idx / D, d = idx % D, n = n0 + j;
      const bool ok = n < p.S && d < p.E;
      k_tile[j][d] = ok ? to_float(k[kv_off + (size_t)n * p.E + d]) : 0.f;
      v_tile[j][d] = ok ? to_float(v[kv_off + (size_t)n * p.E + d]) : 0.f;
    }
    __syncthreads();
    // R = 1: each thread walks the keys its row sees. R > 1: the shuffle needs every lane of the warp, so the
    // whole warp walks the block's keys, and a row folds in only those it sees.
    const int j_end = min(BLOCK_N, (R == 1 ? row_end : n_end) - n0);
    for (int j = 0; j < j_end; ++j) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < DR; ++i) s += qr[i] * k_tile[j][part + R * i];
#pragma unroll
      for (int lane_mask = R / 2; lane_mask > 0; lane_mask /= 2) s += __shfl_xor_sync(0xffffffffu, s, lane_mask);
      if (R > 1 && n0 + j >= row_end) continue;
      const float m_new = fmaxf(m, s);
      const float alpha = exp2f(m - m_new);  // 0 on the first key (m = -inf)
      const float pj = exp2f(s - m_new);
      l = l * alpha + pj;
#pragma unroll
      for (int i = 0; i < DR; ++i) acc[i] = acc[i] * alpha + pj * v_tile[j][part + R * i];
      m = m_new;
    }
  }
  if (!active) return;
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < DR; ++i) {  // constant indices keep acc[] in registers
    const int d = part + R * i;
    if (d < p.E) o[q_off + (size_t)row * p.E + d] = from_float<T>(acc[i] * inv_l);
  }
}

// ------------------------------------------------------------------------------------------------ level 2

// Grid (cdiv(L, 16 * WARPS), B * Hq), 32 * WARPS threads. Warp w owns the 16 query rows [16w, 16w + 16) of the
// block's tile; its Q strip (matrix_a fragments) and its output O (accumulator fragments, fp32) stay in
// registers for the whole key loop. Per key tile of BN = 32 keys:
//   1. all threads stage K and V (BN x D, zero-padded) in shared memory;
//   2. the warp computes its S strip (16 x BN) = Q_w K^T with WMMA, fp32, and stores it to shared memory twice,
//      side by side (a 16 x 2BN strip whose row r holds S[r, 0..BN) twice over, for step 3);
//   3. online softmax, two lanes per row: lane (r, h) = (lane % 16, lane / 16) takes 16 of row r's 32 scores;
//      one __shfl_xor_sync(.., 16) gives the pair its row max, another its row sum. Both lanes keep the row's
//      running max m and normaliser l in registers. P = 2^(S - m) is rounded to T into shared memory;
//   4. O_w = diag(alpha) O_w + P_w V, alpha = 2^(m_old - m_new) per row. WMMA does not say which lane holds
//      which element of a fragment, but fragments of one type share the mapping (CUDA's own WMMA GEMM sample
//      combines a loaded C fragment with an mma result element by element). So alpha is broadcast along its
//      row into a 16 x 16 tile, loaded as an accumulator fragment, and multiplied into O element by element.
// The end divides by l the same way and writes O through a 16 x 16 staging tile per warp.
//
// Shared memory (static, < 48 KB at every D): Q, K, V tiles in T with rows padded to D + 8 elements (16 bytes:
// each row starts 4 banks after the previous one, so WMMA's 8-row loads hit 32 different banks; with rows of
// D = 64 halves, 128 bytes, every row started in bank 0); S (fp32, doubled) and P (T) strips per warp; the
// 16 x 16 fp32 broadcast/staging tile per warp. Bank use of each access is worked out where it happens.
// WARPS = 4 for D <= 64, 2 for D = 128. Registers at -O3 (benchmarks/results/cuda_resources.md): 72-255, no
// spill on sm_75, sm_80 or sm_90 (bf16 at D = 128 on sm_80 uses all 255). Two details keep it so: the softmax
// reads S at a lane's base address plus constant offsets (the doubled strip), and masks with one bound per row
// and tile; with 16 per-lane column addresses instead, ptxas spilled 4-8 bytes per thread in three kernels.
template <typename T, int D, int WARPS>
__device__ __forceinline__ void flash_fwd_wmma_body(const T* __restrict__ q, const T* __restrict__ k,
                                                    const T* __restrict__ v, T* __restrict__ o, const Problem& p) {
  using namespace nvcuda;
  constexpr int BM = 16 * WARPS, BN = 32, THREADS = 32 * WARPS, DT = D / 16;
  constexpr int LDT = D + 8;   // row stride (elements) of the Q, K, V tiles
  constexpr int LDP = BN + 8;  // row stride of the P strips: 80 bytes, rows 4 banks apart
  static_assert(D % 16 == 0 && D <= 128, "D must be 16, 32, 64 or 128");
  // WMMA loads and stores need 256-bit aligned pointers: every sub-tile offset below is a multiple of 32 bytes.
  __shared__ __align__(32) T q_s[BM * LDT];
  __shared__ __align__(32) T k_s[BN * LDT];
  __shared__ __align__(32) T v_s[BN * LDT];
  __shared__ __align__(32) float s_s[WARPS][16 * 2 * BN];
  __shared__ __align__(32) T p_s[WARPS][16 * LDP];
  __shared__ __align__(32) float t_s[WARPS][16 * 16];

  size_t q_off, kv_off;
  head_offsets(p, blockIdx.y, &q_off, &kv_off);
  const int m0 = blockIdx.x * BM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane % 16, half = lane / 16;  // the softmax's view of a lane: row of the strip, half of the keys
  const int i = m0 + warp * 16 + row;           // that row's query index
  float* s_w = s_s[warp];
  T* p_w = p_s[warp];
  float* t_w = t_s[warp];

  for (int idx = threadIdx.x; idx < BM * D; idx += THREADS) {
    const int r = idx / D, d = idx % D;
    const bool ok = m0 + r < p.L && d < p.E;
    q_s[r * LDT + d] = ok ? q[q_off + (size_t)(m0 + r) * p.E + d] : from_float<T>(0.f);
  }
  __syncthreads();

  // This warp's Q strip as matrix_a fragments, and its output, both in registers for the whole key loop.
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_frag[DT];
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o_frag[DT];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    wmma::load_matrix_sync(q_frag[dt], q_s + warp * 16 * LDT + dt * 16, LDT);
    wmma::fill_fragment(o_frag[dt], 0.f);
  }
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> row_frag;  // a per-row factor, broadcast along its row
  float m = -INFINITY, l = 0.f;  // row i's running max (base 2) and normaliser, in both lanes of the row

  const int n_end = p.causal ? min(p.S, m0 + BM) : p.S;
  for (int n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    for (int idx = threadIdx.x; idx < BN * D; idx += THREADS) {
      const int j = idx / D, d = idx % D, n = n0 + j;
      const bool ok = n < p.S && d < p.E;
      k_s[j * LDT + d] = ok ? k[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);
      v_s[j * LDT + d] = ok ? v[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);
    }
    __syncthreads();  // the K, V tiles are complete

    // 2. S_w = Q_w K^T: K is stored (BN, D) row-major, which is K^T (D, BN) column-major.
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag;
      wmma::fill_fragment(s_frag, 0.f);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k_frag;
        wmma::load_matrix_sync(k_frag, k_s + nt * 16 * LDT + dt * 16, LDT);
        wmma::mma_sync(s_frag, q_frag[dt], k_frag, s_frag);
      }
      wmma::store_matrix_sync(s_w + nt * 16, s_frag, 2 * BN, wmma::mem_row_major);
      wmma::store_matrix_sync(s_w + BN + nt * 16, s_frag, 2 * BN, wmma::mem_row_major);
    }
    __syncwarp();  // the S strip is complete

    // 3. Online softmax. Lane (row, half) visits its 16 columns diagonally, c = (row + 16 half + j) % 32: at each
    //    step the 32 lanes read 32 different banks of S (a doubled row is 64 floats, so bank = c). Reading along
    //    the row instead (c = 16 half + j), the 16 rows would all hit one bank. In the doubled row, column c sits
    //    at row + 16 half + j as well as at c, so the lane reads s_row[j]: one base address, constant offsets.
    float sv[16];
    float m_new = m;
    const float* s_row = s_w + row * 2 * BN + row + 16 * half;
    const int seen_end = (p.causal ? min(p.S, i + 1) : p.S) - n0;  // row i sees the tile's columns c < seen_end
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = (row + 16 * half + j) % BN;
      sv[j] = c < seen_end ? s_row[j] * p.scale_log2 : -INFINITY;
      m_new = fmaxf(m_new, sv[j]);
    }
    m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, 16));  // the other half of the row
    const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing seen yet: no NaN
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = (row + 16 * half + j) % BN;
      const T pj = from_float<T>(exp2f(sv[j] - m_safe));
      p_w[row * LDP + c] = pj;
      sum += to_float(pj);  // sum what the matrix units will multiply, rounding included
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    const float alpha = exp2f(m - m_safe);
    l = l * alpha + sum;
    m = m_new;

    // 4. O_w = diag(alpha) O_w + P_w V. The tile t_w is column-major: element (r, c) at t_w[c * 16 + r]. Lane
    //    (row, half) writes alpha into columns half, half + 2, ..., half + 14 of its row: word c * 16 + row,
    //    bank 16 * half + row at every step, 32 lanes on 32 banks.
#pragma unroll
    for (int t = 0; t < 8; ++t) t_w[(2 * t + half) * 16 + row] = alpha;
    __syncwarp();  // P and the alpha tile are complete
    wmma::load_matrix_sync(row_frag, t_w, 16, wmma::mem_col_major);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_frag[BN / 16];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wmma::load_matrix_sync(p_frag[kk], p_w + kk * 16, LDP);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
      for (int e = 0; e < row_frag.num_elements; ++e) o_frag[dt].x[e] *= row_frag.x[e];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_frag;
        wmma::load_matrix_sync(v_frag, v_s + kk * 16 * LDT + dt * 16, LDT);
        wmma::mma_sync(o_frag[dt], p_frag[kk], v_frag, o_frag[dt]);
      }
    }
  }

  // 5. O / l, then out through the staging tile, one 16 x 16 block of columns at a time.
  __syncwarp();  // every lane has loaded the last alpha tile
#pragma unroll
  for (int t = 0; t < 8; ++t) t_w[(2 * t + half) * 16 + row] = l > 0.f ? 1.f / l : 0.f;
  __syncwarp();
  wmma::load_matrix_sync(row_frag, t_w, 16, wmma::mem_col_major);
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
    for (int e = 0; e < row_frag.num_elements; ++e) o_frag[dt].x[e] *= row_frag.x[e];
    __syncwarp();  // the staging tile is free (the 1/l load, or the previous block of columns, is done)
    wmma::store_matrix_sync(t_w, o_frag[dt], 16, wmma::mem_row_major);
    __syncwarp();
#pragma unroll
    for (int t = 0; t < 8; ++t) {  // consecutive lanes, consecutive words: no bank conflict
      const int idx = t * 32 + lane, r = idx / 16, d = dt * 16 + idx % 16, gi = m0 + warp * 16 + r;
      if (gi < p.L && d < p.E) o[q_off + (size_t)gi * p.E + d] = from_float<T>(t_w[idx]);
    }
  }
}

// bf16 WMMA fragments exist from sm_80 on. `if constexpr` keeps the bf16 body from being instantiated when
// nvcc compiles for an older architecture (an arch list such as sm_75;sm_80;sm_90 compiles in one go).
template <typename T>
__device__ constexpr bool wmma_supported() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return !std::is_same<T, __nv_bfloat16>::value;
#else
  return true;
#endif
}

template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
flash_fwd_wmma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
               Problem p) {
  if constexpr (wmma_supported<T>()) {
    flash_fwd_wmma_body<T, D, WARPS>(q, k, v, o, p);
  } else {
    __trap();  // the host launcher never starts this kernel on a GPU older than sm_80
  }
}

}  // namespace ac
