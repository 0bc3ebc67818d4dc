// A program around ac_flash_forward_cpu, for runs under ThreadSanitizer (whose runtime must start with the
// process, so it cannot be loaded into Python). Reads q, k, v as raw little-endian arrays, writes o.
//   flash_cpu_main DTYPE LEVEL B HQ HKV L S E SCALE CAUSAL Q_FILE K_FILE V_FILE O_FILE
// Exit status: 0, 2 (bad command line or files), 3 (the kernel or the harness reported an error, on stderr).

#include <cstdio>
#include <cstdlib>
#include <vector>

extern "C" int ac_flash_forward_cpu(const void* q, const void* k, const void* v, void* o, int dtype, int level,
                                    int B, int Hq, int Hkv, int L, int S, int E, float scale, int causal);
extern "C" const char* ac_flash_cpu_error(int code);

static bool read_file(const char* path, std::vector<char>& buf, size_t bytes) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  buf.resize(bytes + 1);
  const size_t got = std::fread(buf.data(), 1, bytes, f);
  std::fclose(f);
  return got == bytes;
}

int main(int argc, char** argv) {
  if (argc != 15) {
    std::fprintf(stderr, "usage: %s DTYPE LEVEL B HQ HKV L S E SCALE CAUSAL Q K V O\n", argv[0]);
    return 2;
  }
  int a[8];
  for (int i = 0; i < 8; ++i) a[i] = std::atoi(argv[1 + i]);
  const int dtype = a[0], level = a[1], B = a[2], Hq = a[3], Hkv = a[4], L = a[5], S = a[6], E = a[7];
  const float scale = (float)std::atof(argv[9]);
  const int causal = std::atoi(argv[10]);
  const size_t item = dtype == 0 ? 4 : 2;
  const size_t q_bytes = item * B * Hq * L * E, kv_bytes = item * B * Hkv * S * E;
  std::vector<char> q, k, v, o(q_bytes + 1);
  if (!read_file(argv[11], q, q_bytes) || !read_file(argv[12], k, kv_bytes) || !read_file(argv[13], v, kv_bytes)) {
    std::fprintf(stderr, "cannot read the input files (sizes %zu, %zu)\n", q_bytes, kv_bytes);
    return 2;
  }
  const int status = ac_flash_forward_cpu(q.data(), k.data(), v.data(), o.data(), dtype, level, B, Hq, Hkv, L, S, E,
                                          scale, causal);
  if (status != 0) {
    std::fprintf(stderr, "ac_flash_forward_cpu: %s\n", ac_flash_cpu_error(status));
    return 3;
  }
  FILE* f = std::fopen(argv[14], "wb");
  if (!f || std::fwrite(o.data(), 1, q_bytes, f) != q_bytes) return 2;
  std::fclose(f);
  return 0;
}
