// C[M, N] (float32) = A[M, K] @ B[K, N], bfloat16 operands, float32 accumulation, through oneDNN's matmul
// primitive (AMX or AVX512-BF16 kernels, whichever the processor has). An XLA FFI handler; the operands may
// arrive transposed (transpose_a: A is stored [K, M]; transpose_b: B is stored [N, K]), so a custom VJP's
// dx = dy @ W^T and dW = x^T @ dy run without copies. Built at first use by sweet_jax/models/cpu_matmul.py.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Matmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// One primitive per (M, K, N, layout): creating one JIT-compiles its kernels, so it is kept for the process.
const Matmul& GetMatmul(int64_t M, int64_t K, int64_t N, bool ta, bool tb) {
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool>;
  static std::mutex mu;
  static std::map<Key, Matmul> cache;
  std::lock_guard<std::mutex> lock(mu);
  Key key{M, K, N, ta, tb};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  dnnl::memory::desc a({M, K}, dt::bf16, ta ? dims{1, M} : dims{K, 1});
  dnnl::memory::desc b({K, N}, dt::bf16, tb ? dims{1, K} : dims{N, 1});
  dnnl::memory::desc c({M, N}, dt::f32, dims{N, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per calling thread below: concurrent calls are safe
  dnnl::matmul::primitive_desc pd(Engine(), a, b, c, attr);
  return cache.emplace(key, Matmul{pd, dnnl::matmul(pd)}).first->second;
}

ffi::Error Bf16MatmulImpl(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b, ffi::ResultBuffer<ffi::F32> c,
                          bool transpose_a, bool transpose_b) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("sweet_jax bf16 matmul: the operands must be 2-D");
  }
  int64_t M = transpose_a ? ad[1] : ad[0], K = transpose_a ? ad[0] : ad[1];
  int64_t Kb = transpose_b ? bd[1] : bd[0], N = transpose_b ? bd[0] : bd[1];
  if (K != Kb) return ffi::Error::InvalidArgument("sweet_jax bf16 matmul: the contracted sizes differ");
  if (M == 0 || N == 0) return ffi::Error::Success();
  try {
    const Matmul& mm = GetMatmul(M, K, N, transpose_a, transpose_b);
    thread_local dnnl::stream stream(Engine());
    thread_local std::vector<uint8_t> scratch;
    size_t need = mm.pd.scratchpad_desc().get_size();
    if (scratch.size() < need) scratch.resize(need);
    dnnl::memory am(mm.pd.src_desc(), Engine(), a.untyped_data());
    dnnl::memory bm(mm.pd.weights_desc(), Engine(), b.untyped_data());
    dnnl::memory cm(mm.pd.dst_desc(), Engine(), c->untyped_data());
    dnnl::memory sm(mm.pd.scratchpad_desc(), Engine(), scratch.data());
    mm.primitive.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm},
                                  {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("sweet_jax bf16 matmul (oneDNN): ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SweetJaxBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
