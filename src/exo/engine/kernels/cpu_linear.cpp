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
#include <optional>
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

// c[j] = column j of the 8 x 8 block whose rows are r0..r7.
inline void transpose8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6, __m256 r7,
                       __m256 c[8]) {
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  c[0] = _mm256_permute2f128_ps(s0, s4, 0x20), c[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  c[2] = _mm256_permute2f128_ps(s2, s6, 0x20), c[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  c[4] = _mm256_permute2f128_ps(s0, s4, 0x31), c[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  c[6] = _mm256_permute2f128_ps(s2, s6, 0x31), c[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
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
    __m256 c[8];
    transpose8(r0, r1, r2, r3, r4, r5, r6, r7, c);
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

// linear_packed(x, wp, n) = linear(x, w) with w packed once (``pack``: kernels.pack_linear): wp [ceil(N/16),
// ceil(K/2), 16] uint32, word j of lane i of block b holding w[16b + i, 2j] in its low half and w[16b + i, 2j + 1]
// in its high half (zero past N and K). One load then gives two k-steps of 16 outputs as floats (a shift and a
// mask: a bfloat16 is a float's high half), so no transposes: the sums are the same, in the same order, from
// +0, a product then a sum each rounded (``block``'s), for 16 outputs per AVX-512 register (two AVX2 ones),
// several rows of x and several blocks of outputs at once (independent sums: no wait on an add's latency).
#ifdef __AVX512F__
template <int MB, int NB>
inline void packed_tile(const float* xr, const uint32_t* wp, uint16_t* out, int mb, int nb, int b0, int N, int K) {
  const int Kh = (K + 1) / 2;
  __m512 acc[MB][NB];
  for (int r = 0; r < MB; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  const uint32_t* base[NB];
  for (int b = 0; b < NB; ++b) base[b] = wp + size_t(b0 + std::min(b, nb - 1)) * Kh * 16;
  const int whole = K / 2;
  for (int j = 0; j < whole; ++j) {
    __m512i v[NB];
    for (int b = 0; b < NB; ++b) v[b] = _mm512_loadu_si512(base[b] + size_t(j) * 16);
    __m512 w[NB];
    for (int b = 0; b < NB; ++b) w[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v[b], 16));
    for (int r = 0; r < MB; ++r) {
      if (r >= mb) break;
      __m512 xa = _mm512_set1_ps(xr[size_t(r) * K + 2 * j]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(xa, w[b]));
    }
    for (int b = 0; b < NB; ++b) w[b] = _mm512_castsi512_ps(_mm512_and_si512(v[b], high));
    for (int r = 0; r < MB; ++r) {
      if (r >= mb) break;
      __m512 xb = _mm512_set1_ps(xr[size_t(r) * K + 2 * j + 1]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(xb, w[b]));
    }
  }
  if (K % 2) {  // the last k alone (the packed high halves there are zero padding, not a k-step)
    __m512 w[NB];
    for (int b = 0; b < NB; ++b)
      w[b] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(base[b] + size_t(whole) * 16), 16));
    for (int r = 0; r < MB; ++r) {
      if (r >= mb) break;
      __m512 xa = _mm512_set1_ps(xr[size_t(r) * K + K - 1]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_mul_ps(xa, w[b]));
    }
  }
  for (int r = 0; r < mb; ++r)
    for (int b = 0; b < nb; ++b) {
      alignas(64) float v[16];
      _mm512_store_ps(v, acc[r][b]);
      int n0 = (b0 + b) * 16, count = std::min(16, N - n0);
      for (int i = 0; i < count; ++i) out[size_t(r) * N + n0 + i] = float_to_bf16(v[i]);
    }
}
#else
template <int MB, int NB>
inline void packed_tile(const float* xr, const uint32_t* wp, uint16_t* out, int mb, int nb, int b0, int N, int K) {
  // AVX2: a block of 16 outputs is two registers of 8.
  const int Kh = (K + 1) / 2;
  __m256 acc[MB][2 * NB];
  for (int r = 0; r < MB; ++r)
    for (int b = 0; b < 2 * NB; ++b) acc[r][b] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  const uint32_t* base[NB];
  for (int b = 0; b < NB; ++b) base[b] = wp + size_t(b0 + std::min(b, nb - 1)) * Kh * 16;
  const int whole = K / 2;
  auto step = [&](int j, bool pair) {
    __m256i v[2 * NB];
    for (int b = 0; b < NB; ++b) {
      v[2 * b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[b] + size_t(j) * 16));
      v[2 * b + 1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[b] + size_t(j) * 16 + 8));
    }
    for (int r = 0; r < MB; ++r) {
      if (r >= mb) break;
      __m256 xa = _mm256_set1_ps(xr[size_t(r) * K + 2 * j]);
      for (int b = 0; b < 2 * NB; ++b)
        acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(xa, _mm256_castsi256_ps(_mm256_slli_epi32(v[b], 16))));
    }
    if (!pair) return;
    for (int r = 0; r < MB; ++r) {
      if (r >= mb) break;
      __m256 xb = _mm256_set1_ps(xr[size_t(r) * K + 2 * j + 1]);
      for (int b = 0; b < 2 * NB; ++b)
        acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(xb, _mm256_castsi256_ps(_mm256_and_si256(v[b], high))));
    }
  };
  for (int j = 0; j < whole; ++j) step(j, true);
  if (K % 2) step(whole, false);
  for (int r = 0; r < mb; ++r)
    for (int b = 0; b < nb; ++b) {
      alignas(32) float v[16];
      _mm256_store_ps(v, acc[r][2 * b]);
      _mm256_store_ps(v + 8, acc[r][2 * b + 1]);
      int n0 = (b0 + b) * 16, count = std::min(16, N - n0);
      for (int i = 0; i < count; ++i) out[size_t(r) * N + n0 + i] = float_to_bf16(v[i]);
    }
}
#endif

#ifdef __AVX512F__
constexpr int PACKED_TILES[4][2] = {{8, 2}, {4, 4}, {2, 6}, {1, 8}};  // (rows, blocks of 16 outputs) per tile
#else
constexpr int PACKED_TILES[4][2] = {{4, 1}, {4, 1}, {2, 2}, {1, 3}};
#endif

template <int T>
void packed_rows(const float* xr, const uint32_t* wp, uint16_t* out, int mb, int N, int K) {
  constexpr int MB = PACKED_TILES[T][0], NB = PACKED_TILES[T][1];
  int blocks = (N + 15) / 16;
  for (int b0 = 0; b0 < blocks; b0 += NB)
    packed_tile<MB, NB>(xr, wp, out, mb, std::min(NB, blocks - b0), b0, N, K);
}

void linear_packed(const uint16_t* x, const uint32_t* wp, uint16_t* out, int M, int N, int K) {
  std::vector<float> xf(size_t(M) * K);
  for (size_t i = 0; i < size_t(M) * K; ++i) xf[i] = bf16_to_float(x[i]);
  for (int m0 = 0; m0 < M;) {
    int left = M - m0;
    const float* xr = xf.data() + size_t(m0) * K;
    uint16_t* o = out + size_t(m0) * N;
    if (left >= PACKED_TILES[0][0]) {
      packed_rows<0>(xr, wp, o, PACKED_TILES[0][0], N, K);
      m0 += PACKED_TILES[0][0];
    } else if (left >= PACKED_TILES[1][0]) {
      packed_rows<1>(xr, wp, o, PACKED_TILES[1][0], N, K);
      m0 += PACKED_TILES[1][0];
    } else if (left >= PACKED_TILES[2][0]) {
      packed_rows<2>(xr, wp, o, PACKED_TILES[2][0], N, K);
      m0 += PACKED_TILES[2][0];
    } else {
      packed_rows<3>(xr, wp, o, 1, N, K);
      m0 += 1;
    }
  }
}

class LinearPacked : public mx::UnaryPrimitive {
 public:
  LinearPacked(mx::Stream stream, int n) : mx::UnaryPrimitive(stream), n_(n) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& wp = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int K = x.shape(-1), N = n_, M = int(x.size() / K);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(wp);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<uint16_t>(), wq = wp.data<uint32_t>(), op = out.data<uint16_t>(), M, N, K]() {
      linear_packed(xp, wq, op, M, N, K);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("exo's LinearPacked runs on the CPU only");
  }
  const char* name() const override { return "ExoLinearPacked"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return n_ == static_cast<const LinearPacked&>(other).n_;
  }

 private:
  int n_;
};

mx::array linear_packed(const mx::array& x, const mx::array& wp, int n) {
  if (x.dtype() != mx::bfloat16 || x.ndim() < 1 || wp.dtype() != mx::uint32 || wp.ndim() != 3 || wp.shape(2) != 16)
    throw std::invalid_argument("linear_packed: x [..., K] bfloat16 and wp [ceil(N/16), ceil(K/2), 16] uint32");
  int K = x.shape(-1);
  if (n < 0 || wp.shape(0) != (n + 15) / 16 || wp.shape(1) != (K + 1) / 2)
    throw std::invalid_argument("linear_packed: wp is not w [N, K] packed for this x (kernels.pack_linear)");
  auto s = mx::to_stream({});
  if (s.device.type != mx::Device::DeviceType::cpu) throw std::invalid_argument("linear_packed: the CPU only");
  auto shape = x.shape();
  shape.back() = n;
  if (x.size() == 0 || n == 0) return mx::zeros(shape, mx::bfloat16, s);  // empty: nothing to sum
  return mx::array(shape, mx::bfloat16, std::make_shared<LinearPacked>(s, n),
                   {mx::contiguous(x, false, s), mx::contiguous(wp, false, s)});
}

// silu(a) = a * sigmoid(a) and silu_mul(a, b) = silu(a) * b (mlx-lm's ``swiglu``) for bfloat16, as MLX's compiled
// CPU kernels compute them (its JIT fuses them into one loop of its scalar functors, each op's result rounded to
// bfloat16; on x86-64 its exp calls libm's fmaf once per coefficient): here 8 values per AVX register, each
// step as MLX's ``simd::exp`` and ``Sigmoid`` take it (asserted on every bfloat16 input in tests/engine/test_kernels.py):
//   e = bf16(exp(|a|)): x = |a| * log2(e); i = floor(x + 0.5) (in double there: exact, so floor(x) + (x - floor(x)
//       >= 0.5)); f = x - i; p = the degree-6 polynomial in f by fused multiply-adds; 2^i * p; NaN stays,
//       |a| > 88 -> inf;
//   s = bf16(a < 0 ? y : 1 - y) for y = 1 / (1 + e) in float;
//   silu = bf16(a * s); silu_mul = bf16(silu * b).
inline __m256 round_bf16(__m256 f) {  // float -> bfloat16 (MLX's: to nearest even, NaN -> 0x7FC0), as a float
  __m256i u = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u)));
  __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

inline __m128i pack_bf16(__m256 f) {  // a float holding a bfloat16 value -> its 16 bits
  __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(f), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08));
}

inline __m256 sigmoid_bf16(__m256 a) {
  const __m256 x_init = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);  // |a|
  __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  __m256 fl = _mm256_floor_ps(x);
  __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(x, fl), _mm256_set1_ps(0.5f), _CMP_GE_OQ), _mm256_set1_ps(1.0f));
  __m256 ipart = _mm256_add_ps(fl, up);
  __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));
  __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  e = _mm256_blendv_ps(e, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  e = round_bf16(e);
  __m256 y = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  __m256 negative = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ);
  return round_bf16(_mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), y), y, negative));
}

inline float bf16_value(float f) {  // float -> bfloat16 -> float
  uint32_t u = uint32_t(float_to_bf16(f)) << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

void silu_rows(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 av = load8_bf16(a + i);
    __m256 r = round_bf16(_mm256_mul_ps(av, sigmoid_bf16(av)));
    if (b != nullptr) r = round_bf16(_mm256_mul_ps(r, load8_bf16(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), pack_bf16(r));
  }
  if (i < n) {  // the tail through the same vector code, padded
    alignas(32) uint16_t ta[8] = {0}, tb[8] = {0}, to[8];
    std::memcpy(ta, a + i, (n - i) * sizeof(uint16_t));
    if (b != nullptr) std::memcpy(tb, b + i, (n - i) * sizeof(uint16_t));
    silu_rows(ta, b != nullptr ? tb : nullptr, to, 8);
    std::memcpy(out + i, to, (n - i) * sizeof(uint16_t));
  }
}

class Silu : public mx::UnaryPrimitive {
 public:
  explicit Silu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& x : inputs) encoder.set_input_array(x);
    encoder.set_output_array(out);
    const uint16_t* bp = inputs.size() > 1 ? inputs[1].data<uint16_t>() : nullptr;
    encoder.dispatch([ap = inputs[0].data<uint16_t>(), bp, op = out.data<uint16_t>(), n = out.size()]() {
      silu_rows(ap, bp, op, n);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("exo's Silu runs on the CPU only");
  }
  const char* name() const override { return "ExoSilu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array silu(const mx::array& a, const mx::array* b) {
  if (a.dtype() != mx::bfloat16 || (b != nullptr && (b->dtype() != mx::bfloat16 || b->shape() != a.shape())))
    throw std::invalid_argument("silu: a (and b) bfloat16, of one shape");
  auto s = mx::to_stream({});
  if (s.device.type != mx::Device::DeviceType::cpu) throw std::invalid_argument("silu: the CPU only");
  std::vector<mx::array> inputs{mx::contiguous(a, false, s)};
  if (b != nullptr) inputs.push_back(mx::contiguous(*b, false, s));
  if (a.size() == 0) return mx::zeros(a.shape(), mx::bfloat16, s);
  return mx::array(a.shape(), mx::bfloat16, std::make_shared<Silu>(s), inputs);
}

// gated_delta(q, k, v, g, beta, state, mask) = mlx-lm's gated_delta_ops (the gated delta rule, one row after
// another) for the GatedDeltaNet layers of Qwen3.5 / Qwen3-Next: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] (bfloat16 or
// float32, one dtype), g [B, T, Hv] float32 (the decay), beta [B, T, Hv] (bfloat16 or float32), state [B, Hv, Dv, Dk]
// float32, mask [B, T] bool or None -> (y [B, T, Hv, Dv] in q's dtype, the new state). On MLX's CPU backend
// mlx-lm runs the rule as ~10 dispatched ops per row and layer (its compiled step: a prompt of T tokens is T
// steps); here one call runs every row, each value computed as that step computes it: products and sums in
// float32, each sum over Dk in order from +0 (MLX's contiguous reduction on x86-64), mul then add (MLX builds its
// compiled CPU kernels without FMA), 8 rows of the state per AVX register through the transposes of ``block``.
template <typename T>
inline float to_float(T x);
template <>
inline float to_float<uint16_t>(uint16_t x) { return bf16_to_float(x); }
template <>
inline float to_float<float>(float x) { return x; }
template <typename T>
inline T from_float(float x);
template <>
inline uint16_t from_float<uint16_t>(float x) { return float_to_bf16(x); }
template <>
inline float from_float<float>(float x) { return x; }

inline void transpose8(const float* rows, int stride, __m256 c[8]) {  // 8 rows of floats, row stride ``stride``
  transpose8(_mm256_loadu_ps(rows), _mm256_loadu_ps(rows + stride), _mm256_loadu_ps(rows + 2 * stride),
             _mm256_loadu_ps(rows + 3 * stride), _mm256_loadu_ps(rows + 4 * stride), _mm256_loadu_ps(rows + 5 * stride),
             _mm256_loadu_ps(rows + 6 * stride), _mm256_loadu_ps(rows + 7 * stride), c);
}

// The in-order sums over j < Dk of rows[r][j] * x[j] for the 8 rows r of a block (row stride Dk).
inline __m256 row_dots8(const float* rows, const float* x, int Dk) {
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= Dk; j += 8) {
    __m256 c[8];
    transpose8(rows + j, Dk, c);
    for (int jj = 0; jj < 8; ++jj) acc = _mm256_add_ps(acc, _mm256_mul_ps(c[jj], _mm256_set1_ps(x[j + jj])));
  }
  if (j < Dk) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc);
    for (int r = 0; r < 8; ++r)
      for (int jj = j; jj < Dk; ++jj) v[r] = v[r] + rows[size_t(r) * Dk + jj] * x[jj];
    acc = _mm256_load_ps(v);
  }
  return acc;
}

inline float row_dot(const float* row, const float* x, int Dk) {
  float acc = 0.0f;
  for (int j = 0; j < Dk; ++j) acc = acc + row[j] * x[j];
  return acc;
}

inline void scale_row(float* row, float a, int Dk) {
  int j = 0;
  __m256 av = _mm256_set1_ps(a);
  for (; j + 8 <= Dk; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), av));
  for (; j < Dk; ++j) row[j] = row[j] * a;
}

inline void update_row(float* row, const float* k, float d, int Dk) {  // row += k * d
  int j = 0;
  __m256 dv = _mm256_set1_ps(d);
  for (; j + 8 <= Dk; j += 8)
    _mm256_storeu_ps(row + j, _mm256_add_ps(_mm256_loadu_ps(row + j), _mm256_mul_ps(_mm256_loadu_ps(k + j), dv)));
  for (; j < Dk; ++j) row[j] = row[j] + k[j] * d;
}

template <typename T, typename TB>
void gated_delta_rows(const T* q, const T* k, const T* v, const float* g, const TB* beta, const float* state_in,
                      const bool* mask, T* y, float* state, int B, int Tn, int Hk, int Hv, int Dk, int Dv) {
  const int rep = Hv / Hk;
  std::vector<float> qf(Dk), kf(Dk), scratch(size_t(Dv) * Dk);
  std::memcpy(state, state_in, sizeof(float) * size_t(B) * Hv * Dv * Dk);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hv; ++h) {
      float* st = state + (size_t(b) * Hv + h) * Dv * Dk;
      for (int t = 0; t < Tn; ++t) {
        size_t bt = size_t(b) * Tn + t;
        const T* qr = q + (bt * Hk + h / rep) * Dk;
        const T* kr = k + (bt * Hk + h / rep) * Dk;
        const T* vr = v + (bt * Hv + h) * Dv;
        for (int j = 0; j < Dk; ++j) qf[j] = to_float(qr[j]), kf[j] = to_float(kr[j]);
        const float decay = g[bt * Hv + h];
        const float be = to_float(beta[bt * Hv + h]);
        float* s = st;
        if (mask != nullptr && !mask[bt]) {  // a masked row: its y from the updated state, the state kept as it was
          std::memcpy(scratch.data(), st, sizeof(float) * size_t(Dv) * Dk);
          s = scratch.data();
        }
        T* yr = y + (bt * Hv + h) * Dv;
        int i = 0;
        for (; i + 8 <= Dv; i += 8) {
          float* rows = s + size_t(i) * Dk;
          for (int r = 0; r < 8; ++r) scale_row(rows + size_t(r) * Dk, decay, Dk);
          alignas(32) float kv[8], delta[8], out[8];
          _mm256_store_ps(kv, row_dots8(rows, kf.data(), Dk));
          for (int r = 0; r < 8; ++r) delta[r] = (to_float(vr[i + r]) - kv[r]) * be;
          for (int r = 0; r < 8; ++r) update_row(rows + size_t(r) * Dk, kf.data(), delta[r], Dk);
          _mm256_store_ps(out, row_dots8(rows, qf.data(), Dk));
          for (int r = 0; r < 8; ++r) yr[i + r] = from_float<T>(out[r]);
        }
        for (; i < Dv; ++i) {
          float* row = s + size_t(i) * Dk;
          scale_row(row, decay, Dk);
          float delta = (to_float(vr[i]) - row_dot(row, kf.data(), Dk)) * be;
          update_row(row, kf.data(), delta, Dk);
          yr[i] = from_float<T>(row_dot(row, qf.data(), Dk));
        }
      }
    }
  }
}

class GatedDelta : public mx::Primitive {
 public:
  explicit GatedDelta(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2], &g = inputs[3], &beta = inputs[4], &st = inputs[5];
    const bool* mask = inputs.size() > 6 ? inputs[6].data<bool>() : nullptr;
    mx::array &y = outputs[0], &state = outputs[1];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    state.set_data(mx::allocator::malloc(state.nbytes()));
    int B = q.shape(0), Tn = q.shape(1), Hk = q.shape(2), Dk = q.shape(3), Hv = v.shape(2), Dv = v.shape(3);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(y);
    encoder.set_output_array(state);
    bool bf16 = q.dtype() == mx::bfloat16, beta_bf16 = beta.dtype() == mx::bfloat16;
    const void *qp = q.data<void>(), *kp = k.data<void>(), *vp = v.data<void>(), *bp = beta.data<void>();
    const float *gp = g.data<float>(), *sp = st.data<float>();
    void* yp = y.data<void>();
    float* op = state.data<float>();
    encoder.dispatch([=]() {
      if (bf16 && beta_bf16)
        gated_delta_rows(static_cast<const uint16_t*>(qp), static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp), gp,
                         static_cast<const uint16_t*>(bp), sp, mask, static_cast<uint16_t*>(yp), op, B, Tn, Hk, Hv, Dk, Dv);
      else if (bf16)
        gated_delta_rows(static_cast<const uint16_t*>(qp), static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp), gp,
                         static_cast<const float*>(bp), sp, mask, static_cast<uint16_t*>(yp), op, B, Tn, Hk, Hv, Dk, Dv);
      else if (beta_bf16)
        gated_delta_rows(static_cast<const float*>(qp), static_cast<const float*>(kp), static_cast<const float*>(vp), gp,
                         static_cast<const uint16_t*>(bp), sp, mask, static_cast<float*>(yp), op, B, Tn, Hk, Hv, Dk, Dv);
      else
        gated_delta_rows(static_cast<const float*>(qp), static_cast<const float*>(kp), static_cast<const float*>(vp), gp,
                         static_cast<const float*>(bp), sp, mask, static_cast<float*>(yp), op, B, Tn, Hk, Hv, Dk, Dv);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("exo's GatedDelta runs on the CPU only");
  }
  const char* name() const override { return "ExoGatedDelta"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                                   const mx::array& beta, const mx::array& state, const mx::array* mask) {
  auto io = [](mx::Dtype d) { return d == mx::bfloat16 || d == mx::float32; };
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4 || v.shape(0) != q.shape(0) || v.shape(1) != q.shape(1))
    throw std::invalid_argument("gated_delta: q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]");
  int B = q.shape(0), Tn = q.shape(1), Hk = q.shape(2), Dk = q.shape(3), Hv = v.shape(2), Dv = v.shape(3);
  if (Hk == 0 || Hv % Hk != 0) throw std::invalid_argument("gated_delta: Hv must be a multiple of Hk");
  if (!io(q.dtype()) || k.dtype() != q.dtype() || v.dtype() != q.dtype() || !io(beta.dtype()))
    throw std::invalid_argument("gated_delta: q, k, v of one dtype (bfloat16 or float32), beta bfloat16 or float32");
  mx::Shape heads{B, Tn, Hv};
  if (g.dtype() != mx::float32 || g.shape() != heads || beta.shape() != heads)
    throw std::invalid_argument("gated_delta: g [B, T, Hv] float32 and beta [B, T, Hv]");
  if (state.dtype() != mx::float32 || state.shape() != mx::Shape{B, Hv, Dv, Dk})
    throw std::invalid_argument("gated_delta: state [B, Hv, Dv, Dk] float32");
  if (mask != nullptr && (mask->dtype() != mx::bool_ || mask->shape() != mx::Shape{B, Tn}))
    throw std::invalid_argument("gated_delta: mask [B, T] bool");
  auto s = mx::to_stream({});
  if (s.device.type != mx::Device::DeviceType::cpu) throw std::invalid_argument("gated_delta: the CPU only");
  std::vector<mx::array> inputs{mx::contiguous(q, false, s), mx::contiguous(k, false, s), mx::contiguous(v, false, s),
                                mx::contiguous(g, false, s), mx::contiguous(beta, false, s), mx::contiguous(state, false, s)};
  if (mask != nullptr) inputs.push_back(mx::contiguous(*mask, false, s));
  return mx::array::make_arrays({v.shape(), state.shape()}, {q.dtype(), mx::float32}, std::make_shared<GatedDelta>(s),
                                inputs);
}

PyObject* gated_delta_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "gated_delta(q, k, v, g, beta, state, mask) takes 7 arguments");
    return nullptr;
  }
  try {
    mx::array a[6] = {mx::array(0), mx::array(0), mx::array(0), mx::array(0), mx::array(0), mx::array(0)};
    for (int i = 0; i < 6; ++i) a[i] = nb::cast<mx::array>(nb::handle(args[i]));
    std::optional<mx::array> mask;
    if (args[6] != Py_None) mask = nb::cast<mx::array>(nb::handle(args[6]));
    auto out = gated_delta(a[0], a[1], a[2], a[3], a[4], a[5], mask ? &*mask : nullptr);
    return nb::make_tuple(out[0], out[1]).release().ptr();
  } catch (const nb::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "gated_delta: the arrays must be mlx.core.array (mask: one, or None)");
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
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

PyObject* linear_packed_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "linear_packed(x, wp, n) takes 3 arguments");
    return nullptr;
  }
  try {
    mx::array x = nb::cast<mx::array>(nb::handle(args[0]));
    mx::array wp = nb::cast<mx::array>(nb::handle(args[1]));
    int n = nb::cast<int>(nb::handle(args[2]));
    return nb::cast(linear_packed(x, wp, n)).release().ptr();
  } catch (const nb::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "linear_packed(x, wp, n): x and wp must be mlx.core.array, n an int");
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyObject* silu_py(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 && nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "silu(a) or silu(a, b) takes 1 or 2 arguments");
    return nullptr;
  }
  try {
    mx::array a = nb::cast<mx::array>(nb::handle(args[0]));
    if (nargs == 1) return nb::cast(silu(a, nullptr)).release().ptr();
    mx::array b = nb::cast<mx::array>(nb::handle(args[1]));
    return nb::cast(silu(a, &b)).release().ptr();
  } catch (const nb::cast_error&) {
    PyErr_SetString(PyExc_TypeError, "silu: the arguments must be mlx.core.array");
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
    {"linear_packed", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(linear_packed_py)), METH_FASTCALL,
     "linear_packed(x, wp, n): linear(x, w) with w packed by kernels.pack_linear (no transposes), bit-identical"},
    {"silu", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(silu_py)), METH_FASTCALL,
     "silu(a) = a * sigmoid(a), silu(a, b) = silu(a) * b (mlx-lm's swiglu) for bfloat16 on the CPU, bit-identical"},
    {"gated_delta", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(gated_delta_py)), METH_FASTCALL,
     "gated_delta(q, k, v, g, beta, state, mask): mlx-lm's gated_delta_ops on the CPU in one call, bit-identical"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

NB_MODULE(_exo_cpu_kernels, m) {
  nb::module_::import_("mlx.core");
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw nb::python_error();
}
