// exo's CPU kernels (x86-64 with AVX2): built on the user's machine by exo.engine.kernels, loaded next to
// mlx.core (same nanobind domain, so mx.array passes straight through).
//
// linear(x, w) = x @ w.T for bfloat16 x [..., K] and w [N, K] (a bias-free linear layer). MLX's CPU
// backend multiplies bfloat16 with simd_gemm, which on x86-64 (no SIMD types there) converts every 16x16
// block element by element and multiplies one scalar at a time: most of a small model's decode step, and
// 8 rows cost 2.6x one row. This kernel computes the same sums in the same order, 8 outputs per AVX
// register, so its results are bit-identical to MLX's (asserted at load and in tests/engine/test_kernels.py).
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <nanobind/nanobind.h>
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/backend/cpu/encoder.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

inline float bf16_to_float(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t float_to_bf16(float x) {  // MLX's _MLX_BFloat16(float): NaN -> 0x7FC0, else round to nearest even
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u; std::memcpy(&u, &x, 4);
  u += (u >> 16 & 1) + uint32_t(0x7FFF);
  return uint16_t(u >> 16);
}

inline __m256 load8_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Every output is the sum over k, in order, of float(x[m,k]) * float(w[n,k]), started at +0 and rounded
// to bfloat16 once: what MLX's simd_gemm<bfloat16_t, float> computes on a build without SIMD types
// (x86-64), so the results are bit-identical; here 8 outputs (8 rows of w) go per AVX register.
constexpr int MB_ROWS = 4;  // rows of x per pass over w (4 accumulators + 8 columns in 16 registers)

template <int MB>
inline void block(const float* xr, const uint16_t* w, uint16_t* out, int mb, int n0, int N, int K) {
  __m256 acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
  int k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 r0 = load8_bf16(w + size_t(n0 + 0) * K + k), r1 = load8_bf16(w + size_t(n0 + 1) * K + k);
    __m256 r2 = load8_bf16(w + size_t(n0 + 2) * K + k), r3 = load8_bf16(w + size_t(n0 + 3) * K + k);
    __m256 r4 = load8_bf16(w + size_t(n0 + 4) * K + k), r5 = load8_bf16(w + size_t(n0 + 5) * K + k);
    __m256 r6 = load8_bf16(w + size_t(n0 + 6) * K + k), r7 = load8_bf16(w + size_t(n0 + 7) * K + k);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    __m256 c[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                   _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                   _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                   _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    for (int r = 0; r < mb; ++r) {
      const float* xk = xr + size_t(r) * K + k;
      __m256 a = acc[r];
      for (int j = 0; j < 8; ++j) a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(xk[j]), c[j]));
      acc[r] = a;
    }
  }
  for (int r = 0; r < mb; ++r) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc[r]);
    for (int i = 0; i < 8; ++i) {
      float s = v[i];
      for (int kk = k; kk < K; ++kk) s = s + xr[size_t(r) * K + kk] * bf16_to_float(w[size_t(n0 + i) * K + kk]);
      out[size_t(r) * N + n0 + i] = float_to_bf16(s);
    }
  }
}

void linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int M, int N, int K) {
  std::vector<float> xf(size_t(M) * K);
  for (size_t i = 0; i < size_t(M) * K; ++i) xf[i] = bf16_to_float(x[i]);
  // The last N % 8 rows of w go as a block of 8 padded with zero rows (each output's sum is its own, so the
  // padding changes no value): a layer with fewer than 8 outputs (GatedDeltaNet's a/b projections) too.
  int whole = N - N % 8, tail = N % 8;
  std::vector<uint16_t> wpad(tail ? size_t(8) * K : 0, 0), opad(tail ? size_t(MB_ROWS) * 8 : 0);
  if (tail) std::memcpy(wpad.data(), w + size_t(whole) * K, size_t(tail) * K * sizeof(uint16_t));
  for (int m0 = 0; m0 < M; m0 += MB_ROWS) {
    int mb = std::min(MB_ROWS, M - m0);
    const float* xr = xf.data() + size_t(m0) * K;
    uint16_t* o = out + size_t(m0) * N;
    for (int n0 = 0; n0 < whole; n0 += 8) block<MB_ROWS>(xr, w, o, mb, n0, N, K);
    if (tail) {
      block<MB_ROWS>(xr, wpad.data(), opad.data(), mb, 0, 8, K);
      for (int r = 0; r < mb; ++r)
        std::memcpy(o + size_t(r) * N + whole, opad.data() + size_t(r) * 8, size_t(tail) * sizeof(uint16_t));
    }
  }
}

class LinearBF16 : public mx::UnaryPrimitive {
 public:
  explicit LinearBF16(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int K = x.shape(-1), N = w.shape(0), M = int(x.size() / K);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<uint16_t>(), wp = w.data<uint16_t>(), op = out.data<uint16_t>(), M, N, K]() {
      linear_bf16(xp, wp, op, M, N, K);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("exo's LinearBF16 runs on the CPU only");
  }
  const char* name() const override { return "ExoLinearBF16"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

mx::array linear(const mx::array& x, const mx::array& w) {
  if (x.dtype() != mx::bfloat16 || w.dtype() != mx::bfloat16 || w.ndim() != 2 || x.ndim() < 1 ||
      x.shape(-1) != w.shape(1))
    throw std::invalid_argument("linear: x [..., K] and w [N, K], both bfloat16");
  auto s = mx::to_stream({});
  if (s.device.type != mx::Device::DeviceType::cpu) throw std::invalid_argument("linear: the CPU only");
  if (x.size() == 0 || w.size() == 0) return mx::matmul(x, mx::transpose(w, s), s);  // empty: MLX's own
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::bfloat16, std::make_shared<LinearBF16>(s),
                   {mx::contiguous(x, false, s), mx::contiguous(w, false, s)});
}

// A plain CPython function rather than nanobind's m.def: mlx.core's own nanobind (whose domain this module
// joins, so mx.array passes through) may lay out its function objects unlike the nanobind release this
// builds with, and reading a foreign one's attributes (__qualname__) crashes. Arguments and results still
// go through nanobind's casts, which both sides agree on.
PyObject* linear_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "linear(x, w) takes 2 arguments");
    return nullptr;
  }
  try {
    mx::array x = nb::cast<mx::array>(nb::handle(args[0]));
    mx::array w = nb::cast<mx::array>(nb::handle(args[1]));
    return nb::cast(linear(x, w)).release().ptr();
  } catch (const nb::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "linear(x, w): x and w must be mlx.core.array");
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef methods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(linear_py)), METH_FASTCALL,
     "linear(x, w): x @ w.T for bfloat16 on the CPU, bit-identical to MLX's"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

NB_MODULE(_exo_cpu_kernels, m) {
  nb::module_::import_("mlx.core");
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw nb::python_error();
}
