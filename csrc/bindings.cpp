// Python bindings of megatron_adacc._C: each kernel routed to its CPU or CUDA implementation by the
// device of its first tensor argument. The Python side (megatron_adacc/codecs) wraps these; the
// pure-torch twin of every function is in megatron_adacc/codecs/reference.py.
#include <torch/extension.h>

#include "codecs.h"

namespace adacc {
namespace {

#ifdef ADACC_WITH_CUDA
#define ADACC_ROUTE(first, fn, ...) \
  ((first).is_cuda() ? ::adacc::cuda::fn(__VA_ARGS__) : ::adacc::cpu::fn(__VA_ARGS__))
constexpr bool kWithCuda = true;
#else
void require_cpu(const at::Tensor& first) {
  TORCH_CHECK(!first.is_cuda(), "megatron_adacc._C was built without CUDA kernels; rebuild it with a CUDA "
              "toolkit and a CUDA-enabled torch (pip install --no-build-isolation -e .)");
}
#define ADACC_ROUTE(first, fn, ...) (require_cpu(first), ::adacc::cpu::fn(__VA_ARGS__))
constexpr bool kWithCuda = false;
#endif

Tensors3 sym_int4_compress(const at::Tensor& x, int64_t group) { return ADACC_ROUTE(x, sym_int4_compress, x, group); }
void sym_int4_decompress(const at::Tensor& p, const at::Tensor& s, int64_t group, at::Tensor out) {
  ADACC_ROUTE(out, sym_int4_decompress, p, s, group, out);
}
Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group) { return ADACC_ROUTE(x, asym_int4_compress, x, group); }
void asym_int4_decompress(const at::Tensor& p, const at::Tensor& s, const at::Tensor& o, int64_t group,
                          at::Tensor out) {
  ADACC_ROUTE(out, asym_int4_decompress, p, s, o, group, out);
}
Tensors3 chan_int4_compress(const at::Tensor& x) { return ADACC_ROUTE(x, chan_int4_compress, x); }
void chan_int4_decompress(const at::Tensor& p, const at::Tensor& s, at::Tensor out) {
  ADACC_ROUTE(out, chan_int4_decompress, p, s, out);
}
at::Tensor channel_abs_sum(const at::Tensor& x) { return ADACC_ROUTE(x, channel_abs_sum, x); }
Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx) {
  return ADACC_ROUTE(x, outlier_int4_compress, x, idx);
}
void outlier_int4_decompress(const at::Tensor& p, const at::Tensor& s, const at::Tensor& outliers,
                             const at::Tensor& idx, at::Tensor out) {
  ADACC_ROUTE(out, outlier_int4_decompress, p, s, outliers, idx, out);
}
Tensors2 bitmask_pack(const at::Tensor& x) { return ADACC_ROUTE(x, bitmask_pack, x); }
void bitmask_unpack(const at::Tensor& p, at::Tensor out) { ADACC_ROUTE(out, bitmask_unpack, p, out); }
Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed) {
  return ADACC_ROUTE(x, stochastic_compress, x, group, bits, seed);
}
void stochastic_decompress(const at::Tensor& p, const at::Tensor& mins, const at::Tensor& s, int64_t group,
                           int64_t bits, at::Tensor out) {
  ADACC_ROUTE(out, stochastic_decompress, p, mins, s, group, bits, out);
}

}  // namespace
}  // namespace adacc

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace adacc;
  m.doc() = "Compiled kernels of megatron_adacc.codecs (see megatron_adacc/codecs/reference.py for semantics)";
  m.attr("with_cuda") = kWithCuda;
  m.def("cpu_isa", &cpu::isa, "The CPU kernel variant in use: 'avx2' or 'base'.");
  m.def("set_cpu_isa", &cpu::set_isa, "Select the CPU kernel variant: 'auto', 'avx2' or 'base'.");
  m.def("sym_int4_compress", &sym_int4_compress);
  m.def("sym_int4_decompress", &sym_int4_decompress);
  m.def("asym_int4_compress", &asym_int4_compress);
  m.def("asym_int4_decompress", &asym_int4_decompress);
  m.def("chan_int4_compress", &chan_int4_compress);
  m.def("chan_int4_decompress", &chan_int4_decompress);
  m.def("channel_abs_sum", &channel_abs_sum);
  m.def("outlier_int4_compress", &outlier_int4_compress);
  m.def("outlier_int4_decompress", &outlier_int4_decompress);
  m.def("bitmask_pack", &bitmask_pack);
  m.def("bitmask_unpack", &bitmask_unpack);
  m.def("stochastic_compress", &stochastic_compress);
  m.def("stochastic_decompress", &stochastic_decompress);
}
