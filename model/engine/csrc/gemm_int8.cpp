#include "kernels.h"

// ---- int8 products of a few rows --------------------------------------------------------------
// An int8 layer's products of a few rows (a sentence's decoder step: 1 row greedy, 4 at beam 4; its
// encoder pass) with the same quantization as fbgemm's dynamic linear on AVX2: the weight int8 per
// output channel (symmetric: w ~ scale[n] * q[n][k], q in [-127, 127]), the activations quantized
// when the product runs, to 7 bits with a zero point (x ~ s * (u - z), u in [0, 127]; 7 bits so that
// AVX2's vpmaddubsw, which adds two u8 x s8 products in 16 bits, cannot saturate: 2 * 127 * 127 <
// 32767). fbgemm takes one (s, z) for the whole input; here each row has its own, so a row's result
// depends on nothing but the row (at one row the two are the same quantization). torch's
// quantized.linear_dynamic spends most of a few-row call around the arithmetic (quantizing,
// packing the input, dispatch); this does little but the product (docs/benchmarks/README.md#linear-kernels).
//
// Layout: the weight in panels of kInt8Panel outputs, each in groups of 4 k: (N / 16, K / 4, 16, 4),
// so one 32-byte load holds 8 outputs' 4 weights of a group, a row's 4 activations of the group are
// broadcast to every lane (vpmaddubsw: pairs summed to int16; vpmaddwd by ones: the two pairs to
// int32), and each output's int32 sum is exact: the order of the sum never changes a result.
// out[r][n] = s_r * scale[n] * (sum_k u[r][k] q[n][k] - z_r * colsum[n]) + bias[n].
constexpr int64_t kInt8Panel = 16;
// rows of a block. AVX2: 2 accumulators a row, two weight vectors, the broadcast and the ones fit
// its 16 registers. AVX-512 VNNI (the avx512vnni build): one 16-lane accumulator a row, so more
// independent sums to keep vpdpbusd's pipelines busy, within 32 registers.
#if defined(__AVX512VNNI__)
constexpr int kInt8Rows = 8;
#else
constexpr int kInt8Rows = 4;
#endif
// int8 multiply-adds a task should have before it is worth a thread: an int8 multiply-add costs
// about a quarter of a float one here (32 a vpmaddubsw / vpmaddwd / vpaddd, against 8 an FMA)
constexpr int64_t kInt8GrainWork = 4 * kGrainWork;

// A row's activations -> 7-bit codes u (K), and its scale s and zero point z: the range
// [min(0, min x), max(0, max x)] in 127 steps, z the code of 0 (fbgemm's choice for one tensor,
// without its nudging of s). An all-zero row: s = 1, z = 0.
inline void quantize_row(const float* x, int64_t k, uint8_t* u, float& s, int32_t& z) {
  float lo = 0.f, hi = 0.f;
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
  for (; j + 8 <= k; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vlo);
  for (float v : lanes) lo = std::min(lo, v);
  _mm256_storeu_ps(lanes, vhi);
  for (float v : lanes) hi = std::max(hi, v);
#endif
  for (; j < k; j++) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  s = (hi - lo) / 127.f;
  if (!(s > 0.f) || !std::isfinite(s)) s = 1.f;
  z = static_cast<int32_t>(std::clamp(std::nearbyint(-lo / s), 0.f, 127.f));
  const float inv = 1.f / s;
  j = 0;
#if defined(__AVX2__)
  // 32 at a time: rounded to nearest even as nearbyint (the default rounding mode), the zero point
  // added, clamped to [0, 127], narrowed to bytes (the packs interleave 128-bit lanes; the permute
  // puts them back in order)
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i vz = _mm256_set1_epi32(z), top = _mm256_set1_epi32(127), zero = _mm256_setzero_si256();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto code = [&](const float* p) {
    const __m256i c = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p), vinv)), vz);
    return _mm256_min_epi32(_mm256_max_epi32(c, zero), top);
  };
  for (; j + 32 <= k; j += 32) {
    const __m256i ab = _mm256_packs_epi32(code(x + j), code(x + j + 8));
    const __m256i cd = _mm256_packs_epi32(code(x + j + 16), code(x + j + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + j), bytes);
  }
#endif
  for (; j < k; j++) {
    u[j] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[j] * inv) + static_cast<float>(z), 0.f, 127.f));
  }
}

// rows [0, Rows) of codes u (R, K) by one panel: each row's 16 int32 sums into acc (Rows, 16)
template <int Rows>
inline void int8_block(const uint8_t* u, int64_t k, const int8_t* panel, int32_t* acc) {
#if defined(__AVX512VNNI__)
  // a group's 64 bytes are one register: 16 outputs' 4 weights; vpdpbusd adds each lane's four
  // u8 x s8 products to its int32 sum in one instruction (the same exact sums as AVX2's below)
  __m512i sum[Rows];
  for (int r = 0; r < Rows; r++) sum[r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < k; j += 4) {
    const int8_t* w = panel + j * kInt8Panel;
    __builtin_prefetch(w + 8 * 4 * kInt8Panel, 0, 3);
    const __m512i w0 = _mm512_loadu_si512(w);
    for (int r = 0; r < Rows; r++) {
      int32_t four;
      std::memcpy(&four, u + r * k + j, sizeof four);
      sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(four), w0);
    }
  }
  for (int r = 0; r < Rows; r++) _mm512_storeu_si512(acc + r * kInt8Panel, sum[r]);
#elif defined(__AVX2__)
  __m256i sum[Rows][2];
  for (int r = 0; r < Rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < k; j += 4) {
    const int8_t* w = panel + j * kInt8Panel;  // 16 outputs x 4 k: 64 bytes
    __builtin_prefetch(w + 8 * 4 * kInt8Panel, 0, 3);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    for (int r = 0; r < Rows; r++) {
      int32_t four;
      std::memcpy(&four, u + r * k + j, sizeof four);
      const __m256i x = _mm256_set1_epi32(four);
      sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w0), ones));
      sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w1), ones));
    }
  }
  for (int r = 0; r < Rows; r++) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kInt8Panel), sum[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kInt8Panel + 8), sum[r][1]);
  }
#else  // the same sums, one by one (model/engine/fused.py never picks this build for int8: INT8_ROWS)
  for (int r = 0; r < Rows; r++) {
    for (int64_t o = 0; o < kInt8Panel; o++) {
      int32_t total = 0;
      for (int64_t j = 0; j < k; j++) total += int32_t(u[r * k + j]) * panel[(j / 4) * 4 * kInt8Panel + o * 4 + j % 4];
      acc[r * kInt8Panel + o] = total;
    }
  }
#endif
}

template <int Rows>
inline void int8_rest(const uint8_t* u, int64_t k, const int8_t* panel, int32_t* acc, int64_t rest) {
  if constexpr (Rows > 0) {
    if (rest == Rows) return int8_block<Rows>(u, k, panel, acc);
    int8_rest<Rows - 1>(u, k, panel, acc, rest);
  }
}

int64_t int8_panel_width() { return kInt8Panel; }

// q (N, K) int8, K a multiple of 4 -> (its panels (ceil(N / 16), K / 4, 16, 4) int8, colsum (N
// rounded up to 16) int32: each output's sum of q, which the zero points take away). Where N is not
// a multiple of 16 (a vocabulary), the last panel's missing outputs are zeros, and int8_columns
// computes the first N only.
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "pack_int8: q must be a contiguous int8 (N, K) CPU matrix");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n > 0 && k > 0 && k % 4 == 0, "pack_int8: K (", k, ") must be a multiple of 4");
  const int64_t count = (n + kInt8Panel - 1) / kInt8Panel, padded = count * kInt8Panel;
  const auto rows = padded == n ? q : torch::cat({q, torch::zeros({padded - n, k}, q.options())});
  const auto panels = rows.view({count, kInt8Panel, k / 4, 4}).transpose(1, 2).contiguous();
  const auto colsum = rows.sum(1, false, torch::kInt32);
  return {panels, colsum};
}

// x (R, K) float32 by an int8 weight packed by pack_int8 (panels, colsum) and its per-output scales
// (N, a multiple of 16) float32, plus bias (`columns`; an empty tensor: none), ReLU'd when `relu`
// -> (R, columns) float32: the first `columns` of the N outputs (the rest are a vocabulary's padding).
torch::Tensor int8_columns(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& colsum,
                           const torch::Tensor& scales, const torch::Tensor& bias, bool relu, int64_t columns) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kInt8 && panels.dim() == 4 &&
                  panels.is_contiguous() && panels.size(2) == kInt8Panel && panels.size(3) == 4 &&
                  panels.size(1) * 4 == k,
              "int8_linear: panels must be pack_int8's (N / ", kInt8Panel, ", K / 4, ", kInt8Panel,
              ", 4) of a weight with x's K");
  const int64_t count = panels.size(0), n = count * kInt8Panel;
  TORCH_CHECK(is_vector(colsum, torch::kInt32) && colsum.numel() == n, "int8_linear: colsum must be int32 (N)");
  TORCH_CHECK(is_vector(scales, torch::kFloat32) && scales.numel() == n, "int8_linear: scales must be float32 (N)");
  TORCH_CHECK(columns > n - kInt8Panel && columns <= n, "int8_columns: ", columns, " columns of ", count,
              " panels of ", kInt8Panel);
  auto out = torch::empty({rows, columns}, x.options());
  if (rows == 0) return out;
  std::vector<uint8_t> codes(rows * k);
  std::vector<float> row_scale(rows);
  std::vector<int32_t> zero(rows);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++) quantize_row(xp + r * k, k, codes.data() + r * k, row_scale[r], zero[r]);
  const int8_t* wp = panels.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* sc = scales.data_ptr<float>();
  const float* bp = bias_data(bias, columns);
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kInt8GrainWork / std::max<int64_t>(1, kInt8Panel * k * rows));
  parallel_chunks(0, count, grain, [&](int64_t begin, int64_t end) {
    int32_t acc[kInt8Rows * kInt8Panel];
    for (int64_t p = begin; p < end; p++) {
      const int8_t* panel = wp + p * k * kInt8Panel;
      const int64_t n0 = p * kInt8Panel, valid = std::min(kInt8Panel, columns - n0);
      for (int64_t r = 0; r < rows; r += kInt8Rows) {
        const int64_t block = std::min<int64_t>(kInt8Rows, rows - r);
        int8_rest<kInt8Rows>(codes.data() + r * k, k, panel, acc, block);
        for (int64_t i = 0; i < block; i++) {
          const float s = row_scale[r + i];
          const int32_t z = zero[r + i];
          float* o = op + (r + i) * columns + n0;
          const auto value = [&](int64_t j) {
            float v = s * sc[n0 + j] * static_cast<float>(acc[i * kInt8Panel + j] - z * cs[n0 + j]);
            if (bp != nullptr) v += bp[n0 + j];
            return relu && v < 0.f ? 0.f : v;
          };
          if (valid == kInt8Panel) {
#pragma omp simd
            for (int64_t j = 0; j < kInt8Panel; j++) o[j] = value(j);
          } else {  // a vocabulary's last panel: its padding is not an output
            for (int64_t j = 0; j < valid; j++) o[j] = value(j);
          }
        }
      }
    }
  });
  return out;
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& colsum,
                          const torch::Tensor& scales, const torch::Tensor& bias, bool relu) {
  return int8_columns(x, panels, colsum, scales, bias, relu, panels.size(0) * kInt8Panel);
}
