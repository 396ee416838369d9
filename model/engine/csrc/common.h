// The decoder step's small operations, fused: what a step does between its matrix products.
//
// At the batch sizes of interactive use (one sentence: 1 row greedy, 4 rows beam 4) a step's
// arithmetic is tiny and each ATen operation costs a few microseconds of dispatch, allocation
// and bookkeeping; the ~30 of them per decoder layer between the layer's six matrix products
// (scaling, cache writes, batched matmuls, softmax, head reshapes, residual adds, layer norms)
// cost more than the arithmetic. Here each attention sub-layer is one call and each residual +
// layer norm another (docs/benchmarks/README.md#fused-step). Matrix products of a few rows have
// their own kernels here (tiles.h, gemm_*.cpp); larger ones stay in torch (MKL).
//
// This header holds what every file of the kernels shares: the thread split, the fixed-order
// vector sums, the float16 cache rows and the argument checks; kernels.h declares the entry
// points, one file a concern (attention, KV cache, beam search, shortlist, embedding, the three
// matrix-product families, the layer stacks), and bindings.cpp binds them to Python.
//
// Float32, CPU, contiguous rows (the KV cache float32 or float16); model/engine/fused.py's callers
// check what they pass. Work is split over torch's own thread pool (``parallel_chunks``, on
// at::parallel_for) only when it is large enough to pay for the split.
#pragma once

// (torch/types.h, not torch/extension.h: only bindings.cpp needs pybind11, and the lighter
// header keeps each file's compile short)
#include <torch/types.h>
#include <ATen/Parallel.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

// Multiply-adds a task should have before it is worth a thread of its own.
constexpr int64_t kGrainWork = 32768;

// Chunks a split of the work has for each thread taking part (``parallel_chunks``).
constexpr int64_t kChunksPerThread = 8;

// f(lo, hi) over [begin, end) on torch's threads, as at::parallel_for with the same grain, but
// in chunks (kChunksPerThread a thread) that each thread claims in turn from a shared counter
// instead of one fixed share each. When the OS preempts one of the threads mid-split (a server's
// event loop wakes up on its core), the others take over its unclaimed chunks rather than finish
// their own share and wait at the end for its; with fixed shares both cores lost the time the
// preempted one was off its core (docs/benchmarks/README.md#fused-step). Which thread
// does an item never changes its result: every item's arithmetic is its own.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = std::max(grain, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  std::atomic<int64_t> next{begin};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t lo = next.fetch_add(chunk); lo < end; lo = next.fetch_add(chunk)) f(lo, std::min(end, lo + chunk));
  });
}

// Sums in a fixed order, whatever the compiler vectorizes and however the data is aligned: kLanes
// running sums (lane l takes elements l, l + kLanes, ...) added up in order, then the tail. (An
// `omp simd` reduction lets the compiler peel iterations to align the data, so the rounding, and
// a beam search's choices between near-equal scores, would depend on where a buffer happens to lie.)
constexpr int64_t kLanes = 16;

inline float lanes_total(const float* acc) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; l++) s += acc[l];
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; l++) acc[l] += a[d + l] * b[d + l];
  }
  float s = lanes_total(acc);
  for (; d < n; d++) s += a[d] * b[d];
  return s;
}

// sum of (x[i] - shift)^2, or of x[i] with square false, in the same fixed order as ``dot``
template <bool square>
inline float total(const float* x, int64_t n, float shift) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; l++) {
      const float t = x[d + l] - shift;
      acc[l] += square ? t * t : t;
    }
  }
  float s = lanes_total(acc);
  for (; d < n; d++) {
    const float t = x[d] - shift;
    s += square ? t * t : t;
  }
  return s;
}

// the largest of x[0..n) (-inf for none), lane by lane so that it vectorizes
inline float maximum(const float* x, int64_t n) {
  float acc[kLanes];
  std::fill(acc, acc + kLanes, -INFINITY);
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; l++) acc[l] = std::max(acc[l], x[d + l]);
  }
  float top = -INFINITY;
  for (int64_t l = 0; l < kLanes; l++) top = std::max(top, acc[l]);
  for (; d < n; d++) top = std::max(top, x[d]);
  return top;
}

// e^x for x <= 0 (softmax's shifted scores; 0 below -87, and for -inf), to ~1 ulp: Cody-Waite
// reduction and Cephes' polynomial. Plain arithmetic, so the compiler vectorizes the loops that
// call it, and a value comes out the same in a vector lane as in a scalar remainder (libm's expf
// is a call per element; its vector forms may round differently from its scalar one).
inline float exp_nonpositive(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(x < -87.f ? 0.f : n) + 127) << 23;
  return x < -87.f ? 0.f : e * __builtin_bit_cast(float, bits);
}

// p[j] = e^(p[j] - top) for j < n -> their sum (in ``total``'s fixed order)
inline float exp_shifted(float* p, int64_t n, float top) {
#pragma omp simd
  for (int64_t j = 0; j < n; j++) p[j] = exp_nonpositive(p[j] - top);
  return total<false>(p, n, 0.f);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; d++) y[d] += w * x[d];
}

// The KV cache in float16 (int8 plans: ``KernelPlan.kv_dtype``, half the memory of float32): a
// float32 row is rounded to nearest-even when stored (torch's ``.half()``) and widened exactly when
// read, 8 lanes an instruction with F16C (the AVX2 and AVX-512 builds), one by one otherwise.
inline void widen(const at::Half* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  }
#endif
  for (; i < n; i++) out[i] = static_cast<float>(x[i]);
}

inline void store(const float* x, at::Half* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; i++) out[i] = static_cast<at::Half>(x[i]);
}

inline void store(const float* x, float* out, int64_t n) { std::copy(x, x + n, out); }

// a cached row as float32: itself, or widened into `scratch` (Dh floats)
inline const float* row_of(const float* x, int64_t, float*) { return x; }
inline const float* row_of(const at::Half* x, int64_t n, float* scratch) {
  widen(x, scratch, n);
  return scratch;
}

// Runs f(T{}) with T the element type of a KV cache tensor: float, or at::Half for float16.
template <typename F>
void with_cache_type(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kHalf) {
    f(at::Half{});
  } else {
    f(float{});
  }
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous (rows, width) matrix");
}

inline void check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kHalf) &&
                  t.dim() == 4,
              name, " must be a float32 or float16 (rows, heads, positions, head_dim) CPU tensor");
  TORCH_CHECK(t.stride(3) == 1, name, "'s head_dim must be contiguous");
}

// A contiguous 1-d CPU tensor of `type` (ids, counts).
inline bool is_vector(const torch::Tensor& t, torch::ScalarType type) {
  return t.is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.is_contiguous();
}

// A reorder's first copied position of each of n rows (gather_rows_'s and self_attend's `first`),
// or nullptr for an empty tensor (every position of every row); `per` names the rows.
inline const int64_t* first_data(const torch::Tensor& first, int64_t n, const char* per) {
  if (first.numel() == 0) return nullptr;
  TORCH_CHECK(is_vector(first, torch::kInt64) && first.numel() == n,
              "first must be a contiguous int64 CPU vector of one entry per ", per);
  return first.data_ptr<int64_t>();
}

// A product's bias (N), or nullptr for an empty tensor (none).
inline const float* bias_data(const torch::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.device().is_cpu() && bias.scalar_type() == torch::kFloat32 && bias.dim() == 1 &&
                  bias.size(0) == n && bias.is_contiguous(),
              "bias must be a contiguous float32 (N) CPU vector");
  return bias.data_ptr<float>();
}

// An optional index vector (an empty tensor: none): contiguous int64 on the CPU, `n` entries, each
// in [0, limit), each at most once where `distinct` (rows that are written: two threads writing one
// row would race). -> its data, or nullptr when empty.
inline const int64_t* index_data(const torch::Tensor& index, int64_t n, int64_t limit, const char* name, bool distinct) {
  if (index.numel() == 0) return nullptr;
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.dim() == 1 && index.is_contiguous() && index.is_cpu() &&
                  index.numel() == n,
              name, " must be a contiguous int64 CPU vector of ", n, " entries");
  const int64_t* data = index.data_ptr<int64_t>();
  std::vector<bool> seen(distinct ? limit : 0);
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(data[i] >= 0 && data[i] < limit, name, ": ", data[i], " out of range");
    if (distinct) {
      TORCH_CHECK(!seen[data[i]], name, ": ", data[i], " more than once");
      seen[data[i]] = true;
    }
  }
  return data;
}

// Each sentence's (first, count) in a buffer of `total` entries laid end to end (spans (A, 2) int64,
// contiguous, on the CPU), every count at most `width`. -> its data.
inline const int64_t* span_data(const torch::Tensor& spans, int64_t width, int64_t total, const char* name) {
  TORCH_CHECK(spans.is_cpu() && spans.scalar_type() == torch::kInt64 && spans.dim() == 2 && spans.size(1) == 2 &&
                  spans.is_contiguous(),
              name, ": spans must be a contiguous int64 (A, 2) CPU tensor");
  const int64_t* span = spans.data_ptr<int64_t>();
  for (int64_t i = 0; i < spans.size(0); i++) {
    TORCH_CHECK(span[2 * i] >= 0 && span[2 * i + 1] >= 0 && span[2 * i + 1] <= width &&
                    span[2 * i] + span[2 * i + 1] <= total,
                name, ": sentence ", i, "'s own columns are not within the rows or the width (first ", span[2 * i],
                ", count ", span[2 * i + 1], ")");
  }
  return span;
}

// One row's head of the KV cache's reorder: positions lo..length of a head laid out at `out`
// (position stride d2 elements) from the head at `in` (stride s2), or zeroed where in is nullptr
// (a sentence joining); `size` bytes an element, dh elements a position.
inline void copy_head(const char* in, char* out, int64_t lo, int64_t length, int64_t s2, int64_t d2, int64_t dh,
                      int64_t size) {
  if (lo >= length) return;
  if (s2 == dh && d2 == dh) {  // a head's positions are one block
    if (in != nullptr) std::memcpy(out + lo * dh * size, in + lo * dh * size, (length - lo) * dh * size);
    else std::memset(out + lo * dh * size, 0, (length - lo) * dh * size);
    return;
  }
  for (int64_t l = lo; l < length; l++) {
    if (in != nullptr) std::memcpy(out + l * d2 * size, in + l * s2 * size, dh * size);
    else std::memset(out + l * d2 * size, 0, dh * size);
  }
}
