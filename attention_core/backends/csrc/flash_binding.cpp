// The torch side of the CUDA kernels: check the tensors, hand raw pointers to ac_flash_forward (flash_launch.cu).
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
