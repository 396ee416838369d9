// The decoder step's small operations, fused: what a step does between its matrix products.
//
// At the batch sizes of interactive use (one sentence: 1 row greedy, 4 rows beam 4) a step's
// arithmetic is tiny and each ATen operation costs a few microseconds of dispatch, allocation
// and bookkeeping; the ~30 of them per decoder layer between the layer's six matrix products
// (scaling, cache writes, batched matmuls, softmax, head reshapes, residual adds, layer norms)
// cost more than the arithmetic. Here each attention sub-layer is one call and each residual +
// layer norm another (docs/benchmarks.md "The fused step"). Matrix products of a few rows have
// their own kernel here (see "Matrix products of a few rows"); larger ones stay in torch (MKL).
//
// Float32, CPU, contiguous rows (the KV cache float32 or float16); model/fused.py checks what it
// passes. Work is split over torch's own thread pool (``parallel_chunks``, on at::parallel_for) only
// when it is large enough to pay for the split.
#include <torch/extension.h>
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

namespace {

// Multiply-adds a task should have before it is worth a thread of its own.
constexpr int64_t kGrainWork = 32768;

// Chunks a split of the work has for each thread taking part (``parallel_chunks``).
constexpr int64_t kChunksPerThread = 8;

// f(lo, hi) over [begin, end) on torch's threads, as at::parallel_for with the same grain, but
// in chunks (kChunksPerThread a thread) that each thread claims in turn from a shared counter
// instead of one fixed share each. When the OS preempts one of the threads mid-split (a server's
// event loop wakes up on its core), the others take over its unclaimed chunks rather than finish
// their own share and wait at the end for its; with fixed shares both cores lost the time the
// preempted one was off its core (docs/benchmarks.md "Chunks claimed, not shares"). Which thread
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

// One query (Dh) over keys/values k[j * ks], v[j * vs] (j < n, those with visible[j] false left
// out; visible nullptr: none), stored as T (float, or float16 widened into `scratch`, Dh floats),
// softmax weights in `p` (n floats), the weighted sum of values into out (Dh).
template <typename T>
inline void attend_one(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t n, int64_t dh,
                       float scale, const bool* visible, float* p, float* out, float* scratch = nullptr) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    p[j] = visible == nullptr || visible[j] ? dot(q, row_of(k + j * ks, dh, scratch), dh) * scale : -INFINITY;
    top = std::max(top, p[j]);
  }
  const float inv = 1.f / exp_shifted(p, n, top);
  std::fill(out, out + dh, 0.f);
  for (int64_t j = 0; j < n; j++) {
    if (p[j] != 0.f) axpy(p[j] * inv, row_of(v + j * vs, dh, scratch), out, dh);
  }
}


// ---- Matrix products of a few rows ------------------------------------------------------------
// At one sentence a decoder step multiplies 1 (greedy) or 4 (beam 4) rows by every layer's
// weights: ~13 MB of float32 a step, streamed from L3 (the weights of all layers do not fit in
// L2), a few multiply-adds per weight loaded. MKL's sgemm reads them at ~20 GB/s there; this
// kernel keeps a tile of weight rows (the whole reduction of each in registers) per rows group
// and prefetches the next tile's rows while it computes, ~30% faster at 4 rows, ~10% at one
// (docs/benchmarks.md "Small-row matrix products"). Above a few rows MKL's blocking wins, and
// model/step.py hands those calls back to torch.
//
// Each output is the sum over k of x[r][k] * w[n][k] in kVec running lanes (lane l takes
// k = l, l + kVec, ...), the lanes added by one fixed tree: within this kernel a row's result
// depends on neither the other rows nor their number nor alignment (the last N % 16 outputs are
// summed by ``dot``'s order instead). A decoder step hands products of more rows to MKL, so a
// sentence's numbers still change, at float rounding, when others join its batch.
#if defined(__AVX512F__)
constexpr int kVec = 16;
#else
constexpr int kVec = 8;
#endif
typedef float vec __attribute__((vector_size(kVec * sizeof(float))));
// Lane shuffles: clang's and GCC 12's __builtin_shufflevector, GCC's older __builtin_shuffle (the
// same semantics: indices into the two vectors side by side) before that (Debian 11, Ubuntu 22.04;
// TRANSLATOR_OLD_GCC_SHUFFLE forces it, to check it with a newer compiler).
#if defined(__clang__) || (__GNUC__ >= 12 && !defined(TRANSLATOR_OLD_GCC_SHUFFLE))
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t lanes_index __attribute__((vector_size(kVec * sizeof(int32_t))));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, lanes_index{__VA_ARGS__})
#endif

inline vec load_vec(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__AVX512F__)
// kVec accumulators -> one vector holding their totals (lane i: accumulator i), in four folds:
// each takes pairs of vectors holding g groups of partial sums to vectors holding 2g groups.
inline vec totals(const vec* a) {
  vec t[8], u[4], w[2];
  for (int i = 0; i < 8; i++) {
    t[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; i++) {
    u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; i++) {
    w[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return SHUFFLE(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
// (rows, weight rows) a tile computes at once: at most kVec accumulators, 16 weight rows a block
template <int Rows> constexpr int kTileN = Rows >= 3 ? 4 : 8;
#else
inline vec totals(const vec* a) {
  vec t[4], u[2];
  for (int i = 0; i < 4; i++) {
    t[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; i++) {
    u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           SHUFFLE(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return SHUFFLE(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         SHUFFLE(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
template <int Rows> constexpr int kTileN = Rows >= 3 ? 2 : Rows == 2 ? 4 : 8;
#endif

constexpr int64_t kBlockN = 16;  // weight rows a task's unit of work covers (each tile's N divides it)

struct Product {
  const float* x;     // (R, K)
  const float* w;     // (N, K)
  const float* bias;  // (N) or nullptr
  float* out;         // (R, N)
  int64_t k, n;
  bool relu;
};

inline float finish(const Product& p, int64_t n, float total) {
  const float v = p.bias != nullptr ? total + p.bias[n] : total;
  return p.relu && v < 0.f ? 0.f : v;
}

// rows [r0, r0 + Rows) by weight rows [n0, n0 + kTileN<Rows>), prefetching the next tile's rows
template <int Rows>
inline void tile(const Product& p, int64_t r0, int64_t n0) {
  constexpr int tn = kTileN<Rows>;
  vec acc[kVec] = {};
  const float* w = p.w + n0 * p.k;
  const float* x = p.x + r0 * p.k;
  const bool ahead = n0 + 2 * tn <= p.n;
  for (int64_t k = 0; k < p.k; k += kVec) {
    vec wv[tn];
    for (int j = 0; j < tn; j++) wv[j] = load_vec(w + j * p.k + k);
    if (ahead) {
      for (int j = 0; j < tn; j++) __builtin_prefetch(w + (tn + j) * p.k + k, 0, 3);
    }
    for (int r = 0; r < Rows; r++) {
      const vec xv = load_vec(x + r * p.k + k);
      for (int j = 0; j < tn; j++) acc[r * tn + j] += xv * wv[j];
    }
  }
  const vec s = totals(acc);
  float lanes[kVec];
  std::memcpy(lanes, &s, sizeof s);
  for (int r = 0; r < Rows; r++) {
    float* o = p.out + (r0 + r) * p.n;
    for (int j = 0; j < tn; j++) o[n0 + j] = finish(p, n0 + j, lanes[r * tn + j]);
  }
}

template <int Rows>
inline void tiles(const Product& p, int64_t r0, int64_t n0) {
  for (int64_t j = 0; j < kBlockN; j += kTileN<Rows>) tile<Rows>(p, r0, n0 + j);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous (rows, width) matrix");
}

void check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kHalf) &&
                  t.dim() == 4,
              name, " must be a float32 or float16 (rows, heads, positions, head_dim) CPU tensor");
  TORCH_CHECK(t.stride(3) == 1, name, "'s head_dim must be contiguous");
}

// A contiguous 1-d CPU tensor of `type` (ids, counts).
bool is_vector(const torch::Tensor& t, torch::ScalarType type) {
  return t.is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.is_contiguous();
}

// A reorder's first copied position of each of n rows (gather_rows_'s and self_attend's `first`),
// or nullptr for an empty tensor (every position of every row); `per` names the rows.
const int64_t* first_data(const torch::Tensor& first, int64_t n, const char* per) {
  if (first.numel() == 0) return nullptr;
  TORCH_CHECK(is_vector(first, torch::kInt64) && first.numel() == n,
              "first must be a contiguous int64 CPU vector of one entry per ", per);
  return first.data_ptr<int64_t>();
}

// A product's bias (N), or nullptr for an empty tensor (none).
const float* bias_data(const torch::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.device().is_cpu() && bias.scalar_type() == torch::kFloat32 && bias.dim() == 1 &&
                  bias.size(0) == n && bias.is_contiguous(),
              "bias must be a contiguous float32 (N) CPU vector");
  return bias.data_ptr<float>();
}

// An optional index vector (an empty tensor: none): contiguous int64 on the CPU, `n` entries, each
// in [0, limit), each at most once where `distinct` (rows that are written: two threads writing one
// row would race). -> its data, or nullptr when empty.
const int64_t* index_data(const torch::Tensor& index, int64_t n, int64_t limit, const char* name, bool distinct) {
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
const int64_t* span_data(const torch::Tensor& spans, int64_t width, int64_t total, const char* name) {
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

}  // namespace

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

// A reorder's sources for self_attend (``SelfAttentionCache.reorder`` deferred to the step): src_k,
// src_v (R', H, >= pos, Dh) the previous layout, index (N') int64 the source row of each of the
// first N' cache rows (the rest are zeroed), first (N) int64 or empty as gather_rows_'s.
struct Reorder {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k0 = 0, k1 = 0, k2 = 0, v0 = 0, v1 = 0, v2 = 0;
  const int64_t* index = nullptr;
  int64_t rows = 0;
  const int64_t* first = nullptr;
};

// Self-attention of one decoder step. qkv (R, 3D): each row's query, key and value, heads
// side by side. k, v (N, H, slots, Dh): the cache; the new key and value are written at
// position `pos`, and each row attends over positions 0..pos, those with visible[r][j] false
// left out (visible: (R, pos + 1) bool, or an empty tensor: all visible). rows (R,) int64: the
// cache row of each row (a step that computes only some of the cache's rows), or an empty
// tensor: row r is cache row r (N = R). reorder: empty, or {src_k, src_v, index, first}: the
// cache's reorder (gather_rows_'s, into k and v, positions 0..pos - 1), done here head by head
// right before the head's attention reads what it copied, so each row's keys and values come
// through the memory system once a step, not once for the copy and again for the attention
// (every cache row is copied, computed or not). -> (R, D), heads merged.
torch::Tensor self_attend(const torch::Tensor& qkv, torch::Tensor k, torch::Tensor v, int64_t pos,
                          const torch::Tensor& visible, double scale, const torch::Tensor& rows,
                          const std::vector<torch::Tensor>& reorder) {
  check_rows(qkv, "qkv");
  check_cache(k, "k");
  check_cache(v, "v");
  const int64_t r = qkv.size(0), d = qkv.size(1) / 3, h = k.size(1), dh = k.size(3);
  const int64_t* cache_row = index_data(rows, r, std::min(k.size(0), v.size(0)), "rows", true);
  TORCH_CHECK((cache_row != nullptr || (k.size(0) == r && v.size(0) == r)) && h * dh == d && pos < k.size(2) &&
                  pos < v.size(2),
              "self_attend: the cache does not match qkv or has no room at position ", pos);
  const bool masked = visible.numel() > 0;
  if (masked) {
    TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.is_contiguous() && visible.numel() == r * (pos + 1),
                "visible must be a contiguous (R, pos + 1) bool tensor");
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "self_attend: k and v must have one dtype");
  TORCH_CHECK(k.size(0) == v.size(0), "self_attend: k and v must have one row count");
  const int64_t cache_rows = k.size(0);
  Reorder from;
  const bool reordering = !reorder.empty();
  if (reordering) {
    TORCH_CHECK(reorder.size() == 4, "self_attend: reorder is {src_k, src_v, index, first}");
    const torch::Tensor &src_k = reorder[0], &src_v = reorder[1], &index = reorder[2], &first = reorder[3];
    check_cache(src_k, "src_k");
    check_cache(src_v, "src_v");
    TORCH_CHECK(src_k.scalar_type() == k.scalar_type() && src_v.scalar_type() == k.scalar_type() &&
                    src_k.size(1) == h && src_v.size(1) == h && src_k.size(3) == dh && src_v.size(3) == dh &&
                    src_k.size(2) >= pos && src_v.size(2) >= pos,
                "self_attend: the reorder's sources do not match the cache");
    // the copy reads the sources while it writes k and v, head by head: they must not overlap
    for (const torch::Tensor* src : {&src_k, &src_v}) {
      TORCH_CHECK(!src->is_alias_of(k) && !src->is_alias_of(v), "self_attend: a reorder's source is the cache itself");
    }
    from.index = index_data(index, index.numel(), std::min(src_k.size(0), src_v.size(0)), "index", false);
    from.rows = index.numel();
    TORCH_CHECK(from.rows <= cache_rows, "self_attend: more reorder rows than cache rows");
    from.first = first_data(first, cache_rows, "cache row");
    from.k = static_cast<const char*>(src_k.data_ptr());
    from.v = static_cast<const char*>(src_v.data_ptr());
    from.k0 = src_k.stride(0), from.k1 = src_k.stride(1), from.k2 = src_k.stride(2);
    from.v0 = src_v.stride(0), from.v1 = src_v.stride(1), from.v2 = src_v.stride(2);
  }
  auto out = torch::empty({r, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* vis = masked ? visible.data_ptr<bool>() : nullptr;
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t n = pos + 1;
  // computed[i]: the qkv row of cache row i, or -1 (a row that is only copied)
  std::vector<int64_t> computed;
  if (reordering && cache_row != nullptr) {
    computed.assign(cache_rows, -1);
    for (int64_t row = 0; row < r; row++) computed[cache_row[row]] = row;
  }
  const int64_t items = reordering ? cache_rows * h : r * h;  // reordering: every cache row's heads
  const int64_t grain = std::max<int64_t>(1, kGrainWork / ((reordering ? 3 : 2) * n * dh));
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    const int64_t size = sizeof(T);
    T* kp = static_cast<T*>(k.data_ptr());
    T* vp = static_cast<T*>(v.data_ptr());
    parallel_chunks(0, items, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(n + dh);  // the softmax weights, then a float16 row widened
      for (int64_t i = begin; i < end; i++) {
        int64_t row = i / h, at = row;
        const int64_t head = i % h;
        if (reordering) {  // i walks the cache's rows: copy this head's history, then attend if computed
          const int64_t lo = from.first == nullptr ? 0 : std::clamp<int64_t>(from.first[at], 0, pos);
          const bool kept = at < from.rows;
          const char* ks = kept ? from.k + (from.index[at] * from.k0 + head * from.k1) * size : nullptr;
          const char* vs = kept ? from.v + (from.index[at] * from.v0 + head * from.v1) * size : nullptr;
          copy_head(ks, reinterpret_cast<char*>(kp + at * k0 + head * k1), lo, pos, from.k2, k2, dh, size);
          copy_head(vs, reinterpret_cast<char*>(vp + at * v0 + head * v1), lo, pos, from.v2, v2, dh, size);
          row = computed.empty() ? at : computed[at];
          if (row < 0) continue;
        } else if (cache_row != nullptr) {
          at = cache_row[row];
        }
        const float* q = in + row * 3 * d + head * dh;
        T* kb = kp + at * k0 + head * k1;
        T* vb = vp + at * v0 + head * v1;
        store(q + d, kb + pos * k2, dh);
        store(q + 2 * d, vb + pos * v2, dh);
        float* o = op + row * d + head * dh;
        const bool* row_vis = vis == nullptr ? nullptr : vis + row * n;
        attend_one(q, kb, k2, vb, v2, n, dh, (float)scale, row_vis, p.data(), o, p.data() + n);
      }
    });
  });
  return out;
}

// Cross-attention of one decoder step. q (R, D) queries, R = B * W (W consecutive rows per
// sentence); k, v (B, H, S, Dh) the sentences' projected memory; mask (B, S) bool, true where a
// source position may be attended (or an empty tensor: all). sentences (R,) int64: each row's
// sentence (a step that computes only some of the rows), or an empty tensor: row r's is r / W.
// -> (R, D), heads merged.
torch::Tensor cross_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& mask, double scale, const torch::Tensor& sentences) {
  check_rows(q, "q");
  check_cache(k, "k");
  check_cache(v, "v");
  const int64_t r = q.size(0), d = q.size(1), b = k.size(0), h = k.size(1), s = k.size(2), dh = k.size(3);
  const int64_t* sentence_of = index_data(sentences, r, b, "sentences", false);
  TORCH_CHECK(b > 0 && (sentence_of != nullptr || r % b == 0) && h * dh == d && v.size(0) == b && v.size(2) == s,
              "cross_attend: memory of ", b, " sentences for ", r, " rows");
  const bool masked = mask.numel() > 0;
  if (masked) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == b && mask.size(1) >= s &&
                    mask.stride(1) == 1,
                "mask must be a (B, S) bool tensor with contiguous rows");
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "cross_attend: k and v must have one dtype");
  const int64_t w = r / b;
  auto out = torch::empty({r, d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  const int64_t m0 = masked ? mask.stride(0) : 0;
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * s * dh));
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    const T* kp = static_cast<const T*>(k.data_ptr());
    const T* vp = static_cast<const T*>(v.data_ptr());
    parallel_chunks(0, r * h, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(s + dh);  // the softmax weights, then a float16 row widened
      for (int64_t i = begin; i < end; i++) {
        const int64_t row = i / h, head = i % h, sentence = sentence_of == nullptr ? row / w : sentence_of[row];
        const float* qh = qp + row * d + head * dh;
        const T* kb = kp + sentence * k0 + head * k1;
        const T* vb = vp + sentence * v0 + head * v1;
        float* o = op + row * d + head * dh;
        const bool* row_mask = mp == nullptr ? nullptr : mp + sentence * m0;
        attend_one(qh, kb, k2, vb, v2, s, dh, (float)scale, row_mask, p.data(), o, p.data() + s);
      }
    });
  });
  return out;
}

// Self-attention of the encoder over whole sentences. qkv (B*S, 3D): each position's query, key
// and value, heads side by side, sentence by sentence; mask (B, S) bool (false: padding, never
// attended to). -> (B*S, D), heads merged.
torch::Tensor encoder_attend(const torch::Tensor& qkv, const torch::Tensor& mask, int64_t heads, double scale) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), d = qkv.size(1) / 3, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(heads > 0 && qkv.size(1) == 3 * d && dh * heads == d, "qkv must be (rows, 3 x heads x head_dim)");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.is_contiguous() &&
                  mask.size(0) * mask.size(1) == rows,
              "mask must be a contiguous (B, S) bool tensor with B x S = qkv's rows");
  const int64_t s = mask.size(1);
  TORCH_CHECK(s > 0 && dh > 0, "encoder_attend: no positions or no head width");
  auto out = torch::empty({rows, d}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const bool* m = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * s * dh));
  parallel_chunks(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(s);
    for (int64_t i = begin; i < end; i++) {
      const int64_t row = i / heads, head = i % heads, first = row / s * s;  // the sentence's first position
      const float* keys = x + first * 3 * d + d + head * dh;
      attend_one(x + row * 3 * d + head * dh, keys, 3 * d, keys + d, 3 * d, s, dh, (float)scale, m + first, p.data(),
                 op + row * d + head * dh);
    }
  });
  return out;
}

// The encoder's self-attention over sentences laid end to end, without padding. qkv (T, 3D):
// each token's query, key and value, heads side by side; offsets (B + 1) int64: sentence i is
// rows [offsets[i], offsets[i + 1]). -> (T, D), heads merged: encoder_attend's numbers for the
// same sentences padded (a padded key's weight is exactly 0 there).
torch::Tensor encoder_attend_ragged(const torch::Tensor& qkv, const torch::Tensor& offsets, int64_t heads,
                                    double scale) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), d = qkv.size(1) / 3, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(heads > 0 && qkv.size(1) == 3 * d && dh * heads == d && dh > 0,
              "qkv must be (rows, 3 x heads x head_dim)");
  TORCH_CHECK(is_vector(offsets, torch::kInt64) && offsets.numel() >= 1, "offsets must be a contiguous int64 vector");
  const int64_t b = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[b] == rows, "offsets must run from 0 to qkv's ", rows, " rows");
  std::vector<int64_t> first(rows), stop(rows);  // each row's sentence: its first row, the row after its last
  int64_t longest = 0;
  for (int64_t i = 0; i < b; i++) {
    TORCH_CHECK(off[i + 1] >= off[i] && off[i + 1] <= rows, "offsets must not decrease");
    std::fill(first.begin() + off[i], first.begin() + off[i + 1], off[i]);
    std::fill(stop.begin() + off[i], stop.begin() + off[i + 1], off[i + 1]);
    longest = std::max(longest, off[i + 1] - off[i]);
  }
  auto out = torch::empty({rows, d}, qkv.options());
  if (rows == 0) return out;
  const float* x = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * std::max<int64_t>(1, rows / std::max<int64_t>(1, b)) * dh));
  parallel_chunks(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(longest);
    for (int64_t i = begin; i < end; i++) {
      const int64_t row = i / heads, head = i % heads, start = first[row];
      const float* keys = x + start * 3 * d + d + head * dh;
      attend_one(x + row * 3 * d + head * dh, keys, 3 * d, keys + d, 3 * d, stop[row] - start, dh, (float)scale,
                 nullptr, p.data(), op + row * d + head * dh);
    }
  });
  return out;
}

// The KV cache's reorder (``SelfAttentionCache.reorder``): dst_k[i] = src_k[rows[i]] for each
// i < rows.numel(), the rows after those zeroed (sentences joining), then the same for v, in
// that order (dst_v may be the storage src_k was read from). src (R, H, L, Dh) and dst (N, H, L,
// Dh) views with contiguous head_dim; rows (N' <= N) int64 indices of src's rows. first: (N,)
// int64, or empty (0 for every row): row i's positions before first[i] are neither copied nor
// zeroed (hidden from it: from before its sentence joined a running batch, which its attention
// never reads), so a row's reorder costs its own positions, not the oldest row's.
void gather_rows_(const torch::Tensor& src_k, const torch::Tensor& src_v, const torch::Tensor& rows,
                  torch::Tensor dst_k, torch::Tensor dst_v, const torch::Tensor& first) {
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous() && rows.is_cpu(),
              "rows must be a contiguous int64 CPU vector");
  const int64_t n = rows.numel();
  const int64_t* index = rows.data_ptr<int64_t>();
  check_cache(src_k, "src_k");
  check_cache(src_v, "src_v");
  check_cache(dst_k, "dst_k");
  check_cache(dst_v, "dst_v");
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(index[i] >= 0 && index[i] < src_k.size(0) && index[i] < src_v.size(0), "row ", index[i],
                " out of range");
  }
  const int64_t* from_position = first_data(first, dst_k.size(0), "destination row");
  const bool skips = from_position != nullptr;
  const std::pair<const torch::Tensor*, torch::Tensor*> pairs[2] = {{&src_k, &dst_k}, {&src_v, &dst_v}};
  for (const auto& [src, dst] : pairs) {
    TORCH_CHECK(dst->size(0) >= n && dst->size(1) == src->size(1) && dst->size(2) == src->size(2) &&
                    dst->size(3) == src->size(3) && (!skips || dst->size(0) == first.numel()),
                "gather_rows_: (", dst->sizes(), ") from (", src->sizes(), ")");
    TORCH_CHECK(dst->scalar_type() == src->scalar_type(), "gather_rows_: source and destination dtypes differ");
    const int64_t heads = dst->size(1), length = dst->size(2), total = dst->size(0);
    const int64_t size = dst->element_size(), dh = dst->size(3);  // bytes an element, elements a head's position
    const char* from = static_cast<const char*>(src->data_ptr());
    char* to = static_cast<char*>(dst->data_ptr());
    const int64_t s0 = src->stride(0), s1 = src->stride(1), s2 = src->stride(2);
    const int64_t d0 = dst->stride(0), d1 = dst->stride(1), d2 = dst->stride(2);
    const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, heads * length * dh));
    parallel_chunks(0, total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {
        const int64_t lo = skips ? std::clamp<int64_t>(from_position[i], 0, length) : 0;
        for (int64_t h = 0; h < heads; h++) {
          const char* in = i < n ? from + (index[i] * s0 + h * s1) * size : nullptr;
          copy_head(in, to + (i * d0 + h * d1) * size, lo, length, s2, d2, dh, size);
        }
      }
    });
  }
}

// The cross-attention keys and values of joining sentences, heads apart: kv (B*S, 2D), each
// position's key then value projection, heads side by side -> k, v (B, H, S, Dh), contiguous,
// float32, or float16 with `half` (the cache's dtype: ``KernelPlan.kv_dtype``).
std::vector<torch::Tensor> split_kv(const torch::Tensor& kv, int64_t sentences, int64_t heads, bool half) {
  check_rows(kv, "kv");
  const int64_t rows = kv.size(0), d = kv.size(1) / 2, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(sentences > 0 && rows % sentences == 0 && heads > 0 && kv.size(1) == 2 * d && dh * heads == d,
              "kv must be (sentences x positions, 2 x heads x head_dim)");
  const int64_t s = rows / sentences;
  const auto options = kv.options().dtype(half ? torch::kHalf : torch::kFloat32);
  auto k = torch::empty({sentences, heads, s, dh}, options);
  auto v = torch::empty({sentences, heads, s, dh}, options);
  const float* x = kv.data_ptr<float>();
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    T* kp = static_cast<T*>(k.data_ptr());
    T* vp = static_cast<T*>(v.data_ptr());
    for (int64_t b = 0; b < sentences; b++) {
      for (int64_t h = 0; h < heads; h++) {
        for (int64_t t = 0; t < s; t++) {
          const float* row = x + (b * s + t) * 2 * d + h * dh;
          const int64_t at = ((b * heads + h) * s + t) * dh;
          store(row, kp + at, dh);
          store(row + d, vp + at, dh);
        }
      }
    }
  });
  return {k, v};
}

// x = LayerNorm(x + y) in place (the post-LN residual join). x, y (R, D); weight, bias (D). -> x
torch::Tensor add_norm_(torch::Tensor x, const torch::Tensor& y, const torch::Tensor& weight,
                        const torch::Tensor& bias, double eps) {
  check_rows(x, "x");
  check_rows(y, "y");
  const int64_t r = x.size(0), d = x.size(1);
  TORCH_CHECK(y.size(0) == r && y.size(1) == d && weight.numel() == d && bias.numel() == d &&
                  weight.is_contiguous() && bias.is_contiguous() && weight.scalar_type() == torch::kFloat32 &&
                  bias.scalar_type() == torch::kFloat32,
              "add_norm_: shapes do not match");
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* g = weight.data_ptr<float>();
  const float* be = bias.data_ptr<float>();
  parallel_chunks(0, r, std::max<int64_t>(1, kGrainWork / (4 * d)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      float* xr = xp + row * d;
      const float* yr = yp + row * d;
      for (int64_t i = 0; i < d; i++) xr[i] += yr[i];
      const float mean = total<false>(xr, d, 0.f) / d;
      const float var = total<true>(xr, d, mean);
      const float rstd = 1.f / std::sqrt(var / d + (float)eps);
#pragma omp simd
      for (int64_t i = 0; i < d; i++) xr[i] = (xr[i] - mean) * rstd * g[i] + be[i];
    }
  });
  return x;
}

namespace {

// The k largest of n values (ties: the earlier index first), best first, into value/index.
// The first k values fill the list; a later one enters only when strictly larger than its last.
template <typename Value>
inline void top_k(int64_t n, int64_t k, Value value, float* best, int64_t* index) {
  int64_t filled = 0;
  for (int64_t j = 0; j < n; j++) {
    const float x = value(j);
    if (filled == k && !(x > best[k - 1])) continue;
    int64_t at = filled < k ? filled++ : k - 1;
    while (at > 0 && x > best[at - 1]) {
      best[at] = best[at - 1];
      index[at] = index[at - 1];
      at--;
    }
    best[at] = x;
    index[at] = j;
  }
}

}  // namespace

// GNMT's length penalty ((5 + n) / 6) ** alpha, in float32 as model.beams.length_penalty
inline float length_penalty(int64_t n, float alpha) {
  return alpha == 0.f ? 1.f : std::pow((5.f + static_cast<float>(n)) / 6.f, alpha);
}

// One step of beam search's bookkeeping: model.beams.Beams.advance, the same rules.
// logits (A, W, C) float32 next-token logits of each sentence's first W rows (W = 1 at a batch's
// first step, else K), column j token j, or vocab[j] when vocab (C,) int64 is given (not empty).
// With a shortlist (model.shortlist.Vocabulary) the logits are the N columns every sentence shares
// (vocab (N,) their tokens), and own (A, W, E) or (R', E) float32 each row's over its sentence's own
// columns: extra (T,) int64 tokens and spans (A, 2) int64 (first, count), sentence i's own column j
// is token extra[first + j], for j < count (the rest are none of its candidates); own, extra and
// spans empty without. start (A,) int64 the
// step each sentence joined at and `now` the batch's step (a sentence has now - start tokens so
// far); the beams' state (A, K): scores (raw cumulative log P, float32), lengths
// (int64), finished and eos (bool), history (A, K, T) int64 (greedy: written in place).
// rows (A * W,) int64, or an empty tensor: where the step computed only some rows (a sentence that
// joins a running beam batch decodes one row at its first step; its other W - 1 are copies of it at
// -inf), logits is (R', C) and entry i * W + r the logits row of sentence i's row r, -1 for a row at
// -inf that was not computed. Such a row's candidates are all -inf, as they were when it was
// computed, and it is never chosen: its first row's K candidates come before it in the ranking,
// and top_k keeps the earlier of equal values.
// -> ({scores, tokens, back-pointers (A * K) into the A * W rows (empty for greedy), history,
// eos, lengths, finished}: the beams' next state, [the sentences all of whose hypotheses are
// finished now]). Greedy search (K = 1) never sees a finished row.
std::tuple<std::vector<torch::Tensor>, std::vector<int64_t>> advance(const torch::Tensor& logits, const torch::Tensor& own, const torch::Tensor& vocab,
                                   const torch::Tensor& extra, const torch::Tensor& spans,
                                   const torch::Tensor& start, int64_t now, const torch::Tensor& scores, const torch::Tensor& lengths,
                                   const torch::Tensor& finished, const torch::Tensor& eos, torch::Tensor history,
                                   double alpha, int64_t eos_id, int64_t pad_id, const torch::Tensor& rows) {
  const bool some = rows.numel() > 0;
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == (some ? 2 : 3) &&
                  logits.is_contiguous(),
              "logits must be a contiguous float32 (A, W, C) CPU tensor, or (R', C) with rows");
  const int64_t a = scores.size(0), k = scores.size(-1);
  const int64_t w = some ? (a > 0 ? rows.numel() / a : 0) : logits.size(1), c = logits.size(-1);
  TORCH_CHECK(some || logits.size(0) == a, "advance: logits of ", logits.size(0), " sentences for ", a);
  TORCH_CHECK(!some || (rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous() &&
                        rows.is_cpu() && a > 0 && rows.numel() == a * w),
              "rows must be a contiguous int64 CPU vector of A x W entries");
  const int64_t* logits_row = some ? rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; some && i < a * w; i++) {
    TORCH_CHECK(logits_row[i] >= -1 && logits_row[i] < logits.size(0), "rows: ", logits_row[i], " out of range");
  }
  TORCH_CHECK(k >= 1 && c >= 1 && (w == 1 || w == k), "advance: ", w, " rows per sentence for a beam of ", k);
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32 && scores.dim() == 2 && scores.size(0) == a,
              "scores must be float32 (A, K)");
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.dim() == 2 && lengths.size(0) == a &&
                  (lengths.size(1) == k || lengths.size(1) == 1),
              "lengths must be int64 (A, K) or (A, 1)");
  TORCH_CHECK(finished.scalar_type() == torch::kBool && eos.scalar_type() == torch::kBool &&
                  finished.sizes() == scores.sizes() && eos.sizes() == scores.sizes(),
              "finished and eos must be bool (A, K)");
  TORCH_CHECK(start.scalar_type() == torch::kInt64 && start.numel() == a, "start must be int64 (A,)");
  TORCH_CHECK(history.scalar_type() == torch::kInt64 && history.dim() == 3 && history.size(0) == a &&
                  history.size(1) == k && history.is_contiguous(),
              "history must be a contiguous int64 (A, K, T) tensor");
  const bool mapped = vocab.numel() > 0, owned = spans.numel() > 0;
  const int64_t ec = owned ? own.size(-1) : 0;  // each row's own columns, after the c shared ones
  TORCH_CHECK(!mapped || (vocab.scalar_type() == torch::kInt64 && vocab.dim() == 1 && vocab.is_contiguous() &&
                          vocab.numel() == c),
              "vocab must be a contiguous int64 (C,) vector");
  TORCH_CHECK(!owned || (mapped && own.scalar_type() == torch::kFloat32 && own.is_contiguous() &&
                         own.dim() == logits.dim() && own.numel() == (logits.numel() / c) * ec &&
                         is_vector(extra, torch::kInt64) && spans.dim() == 2 && spans.size(0) == a),
              "own must be float32 logits of the same rows, extra an int64 vector and spans (A, 2), with vocab");
  const int64_t* span = owned ? span_data(spans, ec, extra.numel(), "advance") : nullptr;
  const int64_t* extra_ids = owned ? extra.data_ptr<int64_t>() : nullptr;
  const float* own_x = owned ? own.data_ptr<float>() : nullptr;
  const auto sc = scores.contiguous();
  const auto len = lengths.expand({a, k}).contiguous();
  const auto fin = finished.contiguous();
  const auto eo = eos.contiguous();
  const auto st = start.contiguous();
  const int64_t t = history.size(2);
  const int64_t* joined = st.data_ptr<int64_t>();
  std::vector<int64_t> steps(a);
  for (int64_t i = 0; i < a; i++) {
    steps[i] = now - joined[i];
    TORCH_CHECK(steps[i] >= 0 && steps[i] < t, "history has no room at step ", steps[i]);
  }
  const float* x = logits.data_ptr<float>();
  const float* s = sc.data_ptr<float>();
  const int64_t* l = len.data_ptr<int64_t>();
  const bool* f = fin.data_ptr<bool>();
  const bool* e = eo.data_ptr<bool>();
  const int64_t* ids = mapped ? vocab.data_ptr<int64_t>() : nullptr;
  auto out_scores = torch::empty({a, k}, scores.options());
  auto out_tokens = torch::empty({a, k}, start.options());
  auto out_eos = torch::empty({a, k}, eos.options());
  auto out_finished = torch::empty({a, k}, finished.options());
  auto out_length = torch::empty({a, k}, start.options());
  auto out_back = torch::empty({k > 1 ? a * k : 0}, start.options());
  auto out_history = k > 1 ? torch::empty_like(history) : history;
  float* os = out_scores.data_ptr<float>();
  int64_t* ot = out_tokens.data_ptr<int64_t>();
  bool* oe = out_eos.data_ptr<bool>();
  bool* of = out_finished.data_ptr<bool>();
  int64_t* ol = out_length.data_ptr<int64_t>();
  int64_t* ob = out_back.data_ptr<int64_t>();
  const int64_t* h = history.data_ptr<int64_t>();
  int64_t* oh = out_history.data_ptr<int64_t>();
  const float penalty_alpha = static_cast<float>(alpha);
  parallel_chunks(0, a, std::max<int64_t>(1, kGrainWork / (w * c)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c + ec), row_best(w * k), best(k);
    std::vector<int64_t> row_index(w * k), index(k);
    for (int64_t i = begin; i < end; i++) {
      const int64_t candidates = owned ? c + span[2 * i + 1] : c;  // the shared columns, then its own
      const float scale = length_penalty(steps[i] + 1, penalty_alpha);
      for (int64_t r = 0; r < w; r++) {
        float* rb = &row_best[r * k];
        if (f[i * k + r]) {  // a finished hypothesis competes once, its normalized score in the live ones' raw scale
          std::fill(rb, rb + k, -INFINITY);
          rb[0] = s[i * k + r] / length_penalty(l[i * k + r], penalty_alpha) * scale;
          continue;
        }
        const int64_t from_row = logits_row == nullptr ? i * w + r : logits_row[i * w + r];
        if (from_row < 0) {  // not computed: a copy of the sentence's first row at -inf
          TORCH_CHECK(s[i * k + r] == -INFINITY, "advance: row ", r, " of sentence ", i, " has a score but no logits");
          std::fill(rb, rb + k, -INFINITY);
          for (int64_t j = 0; j < k; j++) row_index[r * k + j] = j;
          continue;
        }
        const float* xr = x + from_row * c;  // log-softmax, then the row's k best columns
        std::copy(xr, xr + c, row.data());
        if (owned) std::copy(own_x + from_row * ec, own_x + from_row * ec + (candidates - c), row.data() + c);
        const float top = maximum(row.data(), candidates);
        // fewer candidates than K (a shortlist with a tiny ``always``): the rest -inf, token PAD
        std::fill(rb, rb + k, -INFINITY);
        std::fill(&row_index[r * k], &row_index[r * k] + k, -1);
        top_k(candidates, std::min(k, candidates), [&row](int64_t j) { return row[j]; }, rb, &row_index[r * k]);
        const float log_sum = std::log(exp_shifted(row.data(), candidates, top));
        for (int64_t j = 0; j < k; j++) rb[j] = (rb[j] - top) - log_sum + s[i * k + r];
      }
      top_k(w * k, k, [&](int64_t j) { return row_best[j]; }, best.data(), index.data());
      for (int64_t j = 0; j < k; j++) {
        const int64_t beam = index[j] / k, from = i * k + beam, to = i * k + j;
        const bool was_finished = f[from];
        const int64_t column = row_index[index[j]];
        const int64_t token = was_finished || column < 0 ? pad_id
                              : column >= c  ? extra_ids[span[2 * i] + column - c]
                              : mapped       ? ids[column]
                                             : column;
        os[to] = was_finished ? s[from] : best[j];
        ol[to] = was_finished ? l[from] : steps[i] + 1;
        ot[to] = token;
        oe[to] = was_finished ? e[from] : token == eos_id;
        of[to] = was_finished || oe[to];
        if (k > 1) {
          ob[to] = i * w + beam;
          std::copy(h + from * t, h + (from + 1) * t, oh + to * t);
        }
        oh[to * t + steps[i]] = token;
      }
    }
  });
  std::vector<int64_t> done;  // sentences whose every hypothesis is finished now
  for (int64_t i = 0; i < a; i++) {
    if (std::all_of(of + i * k, of + (i + 1) * k, [](bool x) { return x; })) done.push_back(i);
  }
  return {{out_scores, out_tokens, out_back, out_history, out_eos, out_length, out_finished}, done};
}

// Each sentence's own shortlist candidates (model.shortlist.Shortlist.candidates_of): its
// pieces and the targets associated with them, sorted and unique. sources (B, S) int64 piece ids,
// real (B, S) bool (false: padding), offsets (V + 1,) int64 and targets (N,) integer: piece p's
// targets are targets[offsets[p] : offsets[p + 1]]. -> B int64 tensors.
std::vector<torch::Tensor> candidates(const torch::Tensor& sources, const torch::Tensor& real,
                                      const torch::Tensor& offsets, const torch::Tensor& targets) {
  TORCH_CHECK(sources.scalar_type() == torch::kInt64 && sources.dim() == 2 && real.scalar_type() == torch::kBool &&
                  real.sizes() == sources.sizes() && offsets.scalar_type() == torch::kInt64 && offsets.dim() == 1 &&
                  targets.dim() == 1 && sources.device().is_cpu(),
              "candidates: sources (B, S) int64, real (B, S) bool, offsets (V + 1) int64, targets (N) on the CPU");
  const auto src = sources.contiguous();
  const auto rl = real.contiguous();
  const auto off = offsets.contiguous();
  const auto tg = targets.contiguous();
  const int64_t b = src.size(0), s = src.size(1), v = off.numel() - 1;
  const int64_t* sp = src.data_ptr<int64_t>();
  const bool* rp = rl.data_ptr<bool>();
  const int64_t* op = off.data_ptr<int64_t>();
  std::vector<torch::Tensor> out;
  out.reserve(b);
  std::vector<uint8_t> mark(v);
  AT_DISPATCH_INTEGRAL_TYPES(tg.scalar_type(), "candidates", [&] {
    const scalar_t* tp = tg.data_ptr<scalar_t>();
    for (int64_t i = 0; i < b; i++) {
      std::fill(mark.begin(), mark.end(), 0);
      int64_t found = 0;
      auto add = [&](int64_t id) {
        TORCH_CHECK(id >= 0 && id < v, "candidates: piece ", id, " outside the vocabulary of ", v);
        found += mark[id] == 0;
        mark[id] = 1;
      };
      for (int64_t j = 0; j < s; j++) {
        if (!rp[i * s + j]) continue;
        const int64_t piece = sp[i * s + j];
        add(piece);
        for (int64_t t = op[piece]; t < op[piece + 1]; t++) add(static_cast<int64_t>(tp[t]));
      }
      auto ids = torch::empty({found}, src.options());
      int64_t* ip = ids.data_ptr<int64_t>();
      for (int64_t id = 0, n = 0; id < v; id++) {
        if (mark[id]) ip[n++] = id;
      }
      out.push_back(ids);
    }
  });
  return out;
}

// A decoder step's or the encoder's input: x[r] = positions[r % P] + scale * table[tokens[r]],
// float32. tokens (R,) int64; table (V, D) float32 or float16 (a lookup table kept in float16
// where exact); positions (D,) shared by every row (P = 1), or (P, D) with R a multiple of P: one
// per row (P = R, a decoder step's late joiners) or one per position of sentences of P tokens
// laid end to end (the encoder's padded batch).
torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& table, const torch::Tensor& positions,
                    double scale) {
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.dim() == 1 && table.dim() == 2 && table.is_contiguous() &&
                  positions.scalar_type() == torch::kFloat32 && positions.is_contiguous() && tokens.device().is_cpu(),
              "embed: tokens (R) int64, a contiguous (V, D) table, float32 positions");
  const int64_t r = tokens.size(0), v = table.size(0), d = table.size(1);
  if (r == 0) return torch::empty({0, d}, positions.options());
  const int64_t period = positions.dim() == 1 ? 1 : positions.size(0);
  TORCH_CHECK(positions.dim() <= 2 && positions.size(-1) == d && period > 0 && r % period == 0,
              "embed: positions do not match");
  const auto tk = tokens.contiguous();
  const int64_t* tp = tk.data_ptr<int64_t>();
  const float* pp = positions.data_ptr<float>();
  auto out = torch::empty({r, d}, positions.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(table.scalar_type(), "embed", [&] {
    const scalar_t* table_p = table.data_ptr<scalar_t>();
    for (int64_t i = 0; i < r; i++) {
      TORCH_CHECK(tp[i] >= 0 && tp[i] < v, "embed: token ", tp[i], " outside the table of ", v);
      const scalar_t* row = table_p + tp[i] * d;
      const float* where = pp + (i % period) * d;
      for (int64_t j = 0; j < d; j++) op[i * d + j] = where[j] + sc * static_cast<float>(row[j]);
    }
  });
  return out;
}

// x (R, K) times w (N, K) transposed, plus bias (N; an empty tensor: none), ReLU'd when `relu`
// -> (R, N): a linear layer for a few rows (see "Matrix products of a few rows"). K a multiple of 16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool relu) {
  check_rows(x, "x");
  check_rows(w, "w");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && k % 16 == 0, "x (R, K) and w (N, K) need the same K, a multiple of 16");
  auto out = torch::empty({rows, n}, x.options());
  const Product p{x.data_ptr<float>(), w.data_ptr<float>(), bias_data(bias, n), out.data_ptr<float>(), k, n, relu};
  const int64_t blocks = n / kBlockN;
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, kBlockN * k * rows));
  parallel_chunks(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) tiles<4>(p, r, b * kBlockN);
      switch (rows - r) {
        case 3: tiles<3>(p, r, b * kBlockN); break;
        case 2: tiles<2>(p, r, b * kBlockN); break;
        case 1: tiles<1>(p, r, b * kBlockN); break;
        default: break;
      }
    }
  });
  for (int64_t j = blocks * kBlockN; j < n; j++) {  // the last weight rows, fewer than a block
    for (int64_t r = 0; r < rows; r++) p.out[r * n + j] = finish(p, j, dot(p.x + r * k, p.w + j * k, k));
  }
  return out;
}

// rows [r, r + Rows) of a sentence by its `count` own weight rows (p.w), ``linear``'s tiles, then
// the last count % kTileN<1> (the widest tile) by ``dot``: an output depends on its row, its weight
// row and `count` alone, not on how many of the sentence's rows are computed with it nor on the
// batch around the sentence (a tile sums each output in the same order whatever its shape).
template <int Rows>
void span_rows(const Product& p, int64_t r, int64_t count) {
  constexpr int64_t tn = kTileN<Rows>;
  static_assert(kTileN<1> % tn == 0, "every tile width divides the widest");
  const int64_t whole = count - count % kTileN<1>;
  for (int64_t j = 0; j < whole; j += tn) tile<Rows>(p, r, j);
  for (int64_t i = r; i < r + Rows; i++) {
    for (int64_t j = whole; j < count; j++) p.out[i * p.n + j] = dot(p.x + i * p.k, p.w + j * p.k, p.k);
  }
}

// Each row's logits over its own sentence's shortlist columns, those beyond the ones every sentence
// shares (model.shortlist.Vocabulary). x (R, D) the rows' last hidden states, D a multiple of 16;
// sentences (R,) int64 each row's sentence, never decreasing (an empty tensor: row r's is r / W,
// W = R / A); rows (T, D) float32, or float16 (an output matrix shipped in float16, exact: widened
// here a sentence at a time, half the bytes read), the output matrix's rows of every sentence's own
// columns laid end to end, spans (A, 2) int64 (first, count): sentence i's are rows [first, first +
// count); width E at least every count. -> (R, E): row r's column j is x[r] . rows[first + j] for
// j < its sentence's count, -inf after (no candidate). The rows stream from L3 (every sentence's
// own, ~130 KB of float32 each): this is bound by the bytes it reads.
torch::Tensor span_logits(const torch::Tensor& x, const torch::Tensor& sentences, const torch::Tensor& rows,
                          const torch::Tensor& spans, int64_t width) {
  check_rows(x, "x");
  const bool half = rows.scalar_type() == torch::kHalf;
  TORCH_CHECK(rows.is_cpu() && (half || rows.scalar_type() == torch::kFloat32) && rows.dim() == 2 &&
                  rows.is_contiguous(),
              "rows must be a contiguous float32 or float16 (T, D) CPU matrix");
  const int64_t r = x.size(0), d = x.size(1), t = rows.size(0);
  TORCH_CHECK(rows.size(1) == d && d % 16 == 0, "span_logits: x (R, D) and rows (T, D) need one D, a multiple of 16");
  const int64_t* span = span_data(spans, width, t, "span_logits");
  const int64_t a = spans.size(0);
  const int64_t* sentence_of = index_data(sentences, r, a, "sentences", false);
  TORCH_CHECK(sentence_of != nullptr || (a > 0 ? r % a == 0 : r == 0), "span_logits: ", r, " rows for ", a,
              " sentences");
  const int64_t w = a > 0 ? r / a : 0;
  std::vector<int64_t> runs(a + 1, r);  // sentence i's rows are [runs[i], runs[i + 1]): rows come in sentence order
  int64_t row = 0;
  for (int64_t i = 0; i < a; i++) {
    runs[i] = row;
    if (sentence_of == nullptr) {
      row += w;
    } else {
      while (row < r && sentence_of[row] == i) row++;
    }
  }
  TORCH_CHECK(row == r, "span_logits: each row's sentence must be in order (never decreasing)");
  auto out = torch::empty({r, width}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, std::max<int64_t>(1, w) * width * d));
  parallel_chunks(0, a, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(half ? width * d : 0);  // a sentence's rows widened from float16
    for (int64_t i = begin; i < end; i++) {
      const int64_t first = span[2 * i], count = span[2 * i + 1];
      const float* own = half ? wide.data() : rows.data_ptr<float>() + first * d;
      if (half) widen(rows.data_ptr<at::Half>() + first * d, wide.data(), count * d);
      const Product p{x.data_ptr<float>(), own, nullptr, op, d, width, false};
      int64_t j = runs[i];
      for (; j + 4 <= runs[i + 1]; j += 4) span_rows<4>(p, j, count);
      switch (runs[i + 1] - j) {
        case 3: span_rows<3>(p, j, count); break;
        case 2: span_rows<2>(p, j, count); break;
        case 1: span_rows<1>(p, j, count); break;
        default: break;
      }
      for (j = runs[i]; j < runs[i + 1]; j++) std::fill(op + j * width + count, op + (j + 1) * width, -INFINITY);
    }
  });
  return out;
}

// ---- Matrix products of a few dozen rows, on weights packed into panels ------------------------
// From ~8 rows the dot-product form of ``linear`` runs below MKL, and MKL itself is far from the
// FMA peak below ~64 rows (its per-call packing and blocking): the encoder of a few sentences
// (10-100 rows) and a decoder step of 2-16 sentences at beam 4 run there. This product is the
// broadcast form on a copy of the weight packed once: panels of kPanel weight rows, each stored
// transposed (K, kPanel), so a block of up to kPanelRows rows by one panel keeps its outputs in
// 2 x rows accumulator vectors, and each k loads the panel's two vectors and broadcasts one x value
// per row (docs/benchmarks.md "Packed panels"). Each output is summed over k in an order that
// depends only on how many rows its block holds (blocks of kPanelRows, then one of the rest), so a
// row's result does not depend on the values of the other rows.
constexpr int64_t kPanel = 2 * kVec;
// how many k ahead a block prefetches its panel: with a few rows the panels stream from L3, and
// without it one to four rows ran ~10% behind ``linear`` (with it, level)
constexpr int64_t kPanelAhead = 8;
// rows of a block: 2 accumulators a row, two weight vectors and the broadcast fit the registers
// (32 zmm with AVX-512; 16 ymm with AVX2)
constexpr int kPanelRows = kVec == 16 ? 8 : 6;

// rows [0, Rows) of x by one panel. With one or two rows, 2 x Rows accumulators would wait on each
// other's FMA latency, so k is split into kPhases interleaved sums (added in a fixed order at the end).
template <int Rows>
inline void panel_block(const float* x, int64_t k, const float* panel, const float* bias, bool relu, float* out,
                        int64_t n, int64_t valid) {
  constexpr int kPhases = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
  vec acc[kPhases][Rows][2];
  for (int f = 0; f < kPhases; f++) {
    for (int r = 0; r < Rows; r++) acc[f][r][0] = acc[f][r][1] = vec{};
  }
  const int64_t whole = k - k % kPhases;
  for (int64_t j = 0; j < whole; j += kPhases) {
    for (int f = 0; f < kPhases; f++) {
      __builtin_prefetch(panel + (j + f + kPanelAhead) * kPanel, 0, 3);  // (a hint: past the end is harmless)
      __builtin_prefetch(panel + (j + f + kPanelAhead) * kPanel + kVec, 0, 3);
      const vec w0 = load_vec(panel + (j + f) * kPanel), w1 = load_vec(panel + (j + f) * kPanel + kVec);
      for (int r = 0; r < Rows; r++) {
        const float xr = x[r * k + j + f];
        acc[f][r][0] += xr * w0;
        acc[f][r][1] += xr * w1;
      }
    }
  }
  for (int64_t j = whole; j < k; j++) {  // the last k % kPhases, into the first sum
    const vec w0 = load_vec(panel + j * kPanel), w1 = load_vec(panel + j * kPanel + kVec);
    for (int r = 0; r < Rows; r++) {
      const float xr = x[r * k + j];
      acc[0][r][0] += xr * w0;
      acc[0][r][1] += xr * w1;
    }
  }
  const vec b0 = bias != nullptr ? load_vec(bias) : vec{}, b1 = bias != nullptr ? load_vec(bias + kVec) : vec{};
  for (int r = 0; r < Rows; r++) {
    vec s0 = acc[0][r][0], s1 = acc[0][r][1];
    for (int f = 1; f < kPhases; f++) {
      s0 += acc[f][r][0];
      s1 += acc[f][r][1];
    }
    vec o0 = s0 + b0, o1 = s1 + b1;
    if (relu) {  // (as torch's ReLU: NaN stays NaN)
      o0 = o0 < 0 ? vec{} : o0;
      o1 = o1 < 0 ? vec{} : o1;
    }
    if (valid == kPanel) {
      std::memcpy(out + r * n, &o0, sizeof o0);
      std::memcpy(out + r * n + kVec, &o1, sizeof o1);
    } else {  // the last panel of a product that keeps fewer columns (panel_product)
      float lanes[kPanel];
      std::memcpy(lanes, &o0, sizeof o0);
      std::memcpy(lanes + kVec, &o1, sizeof o1);
      std::memcpy(out + r * n, lanes, valid * sizeof(float));
    }
  }
}

template <int Rows>
inline void panel_rest(const float* x, int64_t k, const float* panel, const float* bias, bool relu, float* out,
                       int64_t n, int64_t valid, int64_t rest) {
  if constexpr (Rows > 0) {
    if (rest == Rows) return panel_block<Rows>(x, k, panel, bias, relu, out, n, valid);
    panel_rest<Rows - 1>(x, k, panel, bias, relu, out, n, valid, rest);
  }
}

int64_t panel_width() { return kPanel; }

// w (N, K), N a multiple of panel_width() -> its panels (N / panel_width(), K, panel_width()):
// panel p holds weight rows [p * width, (p + 1) * width), transposed.
torch::Tensor pack_panels(const torch::Tensor& w) {
  check_rows(w, "w");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n % kPanel == 0, "pack_panels: N (", n, ") must be a multiple of ", kPanel);
  return w.view({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

// x (R, K) times the weight packed by pack_panels (N / width, K, width), plus bias (N; an empty
// tensor: none), ReLU'd when `relu` -> (R, n): the first n = N columns, or fewer (`columns`).
torch::Tensor panel_columns(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                            bool relu, int64_t columns) {
  check_rows(x, "x");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kFloat32 && panels.dim() == 3 &&
                  panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == x.size(1),
              "panels must be pack_panels' (N / ", kPanel, ", K, ", kPanel, ") of a weight with x's K");
  const int64_t rows = x.size(0), k = x.size(1), n = columns;
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "panel_product: ", n, " columns of ", panels.size(0), " panels of ", kPanel);
  const int64_t count = panels.size(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias_data(bias, n);
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, kPanel * k * rows));
  parallel_chunks(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const float* panel = wp + p * k * kPanel;
      const float* b = bp == nullptr ? nullptr : bp + p * kPanel;
      const int64_t valid = std::min(kPanel, n - p * kPanel);
      int64_t r = 0;
      for (; r + kPanelRows <= rows; r += kPanelRows) {
        panel_block<kPanelRows>(xp + r * k, k, panel, b, relu, op + r * n + p * kPanel, n, valid);
      }
      if (r < rows) {
        panel_rest<kPanelRows - 1>(xp + r * k, k, panel, b, relu, op + r * n + p * kPanel, n, valid, rows - r);
      }
    }
  });
  return out;
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                           bool relu) {
  return panel_columns(x, panels, bias, relu, panels.size(0) * kPanel);
}

// x (R, K) times the first `columns` rows of a weight packed by pack_panels (the rest of its last
// panel padding): a shortlist's logits over its columns (model/shortlist.py Vocabulary.panels).
torch::Tensor panel_product(const torch::Tensor& x, const torch::Tensor& panels, int64_t columns) {
  return panel_columns(x, panels, torch::empty({0}, x.options()), false, columns);
}

// ---- int8 products of a few rows --------------------------------------------------------------
// An int8 layer's products of a few rows (a sentence's decoder step: 1 row greedy, 4 at beam 4; its
// encoder pass) with the same quantization as fbgemm's dynamic linear on AVX2: the weight int8 per
// output channel (symmetric: w ~ scale[n] * q[n][k], q in [-127, 127]), the activations quantized
// when the product runs, to 7 bits with a zero point (x ~ s * (u - z), u in [0, 127]; 7 bits so that
// AVX2's vpmaddubsw, which adds two u8 x s8 products in 16 bits, cannot saturate: 2 * 127 * 127 <
// 32767). fbgemm takes one (s, z) for the whole input; here each row has its own, so a row's result
// depends on nothing but the row (at one row the two are the same quantization). torch's
// quantized.linear_dynamic at one row costs ~40 us for a 1024 x 256 weight on a Zen 3, most of it
// around the arithmetic (quantizing, packing the input, dispatch); this does the product in a few.
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
#else  // the same sums, one by one (model/fused.py never picks this build for int8: INT8_ROWS)
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

// q (N, K) int8, N a multiple of 16 and K of 4 -> (its panels (N / 16, K / 4, 16, 4) int8, colsum (N)
// int32: each output's sum of q, which the zero points take away)
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(),
              "pack_int8: q must be a contiguous int8 (N, K) CPU matrix");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n % kInt8Panel == 0 && k % 4 == 0, "pack_int8: N (", n, ") must be a multiple of ",
              kInt8Panel, " and K (", k, ") of 4");
  const auto panels = q.view({n / kInt8Panel, kInt8Panel, k / 4, 4}).transpose(1, 2).contiguous();
  const auto colsum = q.sum(1, false, torch::kInt32);
  return {panels, colsum};
}

// x (R, K) float32 by an int8 weight packed by pack_int8 (panels, colsum) and its per-output scales
// (N) float32, plus bias (N; an empty tensor: none), ReLU'd when `relu` -> (R, N) float32.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& colsum,
                          const torch::Tensor& scales, const torch::Tensor& bias, bool relu) {
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
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;
  std::vector<uint8_t> codes(rows * k);
  std::vector<float> row_scale(rows);
  std::vector<int32_t> zero(rows);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; r++) quantize_row(xp + r * k, k, codes.data() + r * k, row_scale[r], zero[r]);
  const int8_t* wp = panels.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* sc = scales.data_ptr<float>();
  const float* bp = bias_data(bias, n);
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kInt8GrainWork / std::max<int64_t>(1, kInt8Panel * k * rows));
  parallel_chunks(0, count, grain, [&](int64_t begin, int64_t end) {
    int32_t acc[kInt8Rows * kInt8Panel];
    for (int64_t p = begin; p < end; p++) {
      const int8_t* panel = wp + p * k * kInt8Panel;
      const int64_t n0 = p * kInt8Panel;
      for (int64_t r = 0; r < rows; r += kInt8Rows) {
        const int64_t block = std::min<int64_t>(kInt8Rows, rows - r);
        int8_rest<kInt8Rows>(codes.data() + r * k, k, panel, acc, block);
        for (int64_t i = 0; i < block; i++) {
          const float s = row_scale[r + i];
          const int32_t z = zero[r + i];
          float* o = op + (r + i) * n + n0;
#pragma omp simd
          for (int64_t j = 0; j < kInt8Panel; j++) {
            float v = s * sc[n0 + j] * static_cast<float>(acc[i * kInt8Panel + j] - z * cs[n0 + j]);
            if (bp != nullptr) v += bp[n0 + j];
            o[j] = relu && v < 0.f ? 0.f : v;
          }
        }
      }
    }
  });
  return out;
}

// One decoder step through every layer of a post-LN decoder whose products all run on packed
// panels: the same calls model/step.py's _fused_layers makes, in one call from Python (at one
// row the Python around them was a sixth of a step). x (R, D); params: per layer 18 tensors in
// the order of kLayerParams; self_k, self_v, positions: each layer's cache buffers and the
// position its new key and value go to (SelfAttentionCache.next_slot); visible as self_attend's;
// cross_k, cross_v (B, H, S, Dh) each layer's projected memory; source (B, S) bool as
// cross_attend's mask; rows as self_attend's and sentences as cross_attend's (each of x's rows'
// cache row and sentence, or empty tensors: every row, in order); reorders: empty, or each layer's
// self_attend reorder (an empty one: none). -> x, written in place (the joins' add_norm_), (R, D)
constexpr int64_t kLayerParams = 18;  // qkv, self out, cross q, cross out, fc1, fc2 (panels, bias); 3 norms (weight, bias)
torch::Tensor decoder_layers(torch::Tensor x, const std::vector<torch::Tensor>& params,
                             const std::vector<torch::Tensor>& self_k, const std::vector<torch::Tensor>& self_v,
                             const std::vector<int64_t>& positions, const torch::Tensor& visible,
                             const std::vector<torch::Tensor>& cross_k, const std::vector<torch::Tensor>& cross_v,
                             const torch::Tensor& source, double scale, double eps, const torch::Tensor& rows,
                             const torch::Tensor& sentences, const std::vector<std::vector<torch::Tensor>>& reorders) {
  const size_t layers = self_k.size();
  TORCH_CHECK(params.size() == layers * kLayerParams && self_v.size() == layers && positions.size() == layers &&
                  cross_k.size() == layers && cross_v.size() == layers,
              "decoder_layers: ", kLayerParams, " parameters and one cache of each kind per layer");
  TORCH_CHECK(reorders.empty() || reorders.size() == layers, "decoder_layers: one reorder (or none) per layer");
  const std::vector<torch::Tensor> none;
  for (size_t i = 0; i < layers; i++) {
    const torch::Tensor* p = params.data() + i * kLayerParams;
    const auto qkv = panel_linear(x, p[0], p[1], false);
    const auto& reorder = reorders.empty() ? none : reorders[i];
    const auto attended = self_attend(qkv, self_k[i], self_v[i], positions[i], visible, scale, rows, reorder);
    x = add_norm_(x, panel_linear(attended, p[2], p[3], false), p[12], p[13], eps);
    const auto q = panel_linear(x, p[4], p[5], false);
    x = add_norm_(x, panel_linear(cross_attend(q, cross_k[i], cross_v[i], source, scale, sentences), p[6], p[7], false),
                  p[14], p[15], eps);
    x = add_norm_(x, panel_linear(panel_linear(x, p[8], p[9], true), p[10], p[11], false), p[16], p[17], eps);
  }
  return x;
}

// The encoder's layers, post-LN, every product on packed panels: _fused_layers of EncoderPass in
// one call. x (B*S, D); params: per layer 12 tensors in the order of kEncoderLayerParams; mask
// (B, S) bool as encoder_attend's. -> x, written in place (the joins' add_norm_), (B*S, D)
constexpr int64_t kEncoderLayerParams = 12;  // qkv, out, fc1, fc2 (panels, bias); 2 norms (weight, bias)
template <typename Attend>
torch::Tensor encoder_stack(torch::Tensor x, const std::vector<torch::Tensor>& params, double eps, Attend attend) {
  TORCH_CHECK(params.size() % kEncoderLayerParams == 0, "encoder_layers: ", kEncoderLayerParams,
              " parameters per layer");
  for (size_t i = 0; i < params.size(); i += kEncoderLayerParams) {
    const torch::Tensor* p = params.data() + i;
    const auto qkv = panel_linear(x, p[0], p[1], false);
    x = add_norm_(x, panel_linear(attend(qkv), p[2], p[3], false), p[8], p[9], eps);
    x = add_norm_(x, panel_linear(panel_linear(x, p[4], p[5], true), p[6], p[7], false), p[10], p[11], eps);
  }
  return x;
}

torch::Tensor encoder_layers(torch::Tensor x, const std::vector<torch::Tensor>& params, const torch::Tensor& mask,
                             int64_t heads, double scale, double eps) {
  return encoder_stack(x, params, eps, [&](const torch::Tensor& qkv) { return encoder_attend(qkv, mask, heads, scale); });
}

// The same over sentences laid end to end without padding (x (T, D); offsets as
// encoder_attend_ragged's): the layers' products and joins are per row, so only the attention
// needs to know where a sentence ends. -> x, written in place, (T, D)
torch::Tensor encoder_layers_ragged(torch::Tensor x, const std::vector<torch::Tensor>& params,
                                    const torch::Tensor& offsets, int64_t heads, double scale, double eps) {
  return encoder_stack(x, params, eps,
                       [&](const torch::Tensor& qkv) { return encoder_attend_ragged(qkv, offsets, heads, scale); });
}

// The longest calls (a whole pass, or a product of many rows: milliseconds in a batch) let go of
// Python's lock while they run, so the server's event loop goes on reading and answering requests
// meanwhile: at 64 clients +1.5-16% requests/s (4 alternated pairs), one client level
// (docs/benchmarks.md "One call per pass"). They touch only the tensors they are given.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  m.def("self_attend", &self_attend, "self-attention of one decoder step (writes the cache; reorders it first with reorder)",
        py::arg("qkv"), py::arg("k"), py::arg("v"), py::arg("pos"), py::arg("visible"), py::arg("scale"), py::arg("rows"),
        py::arg("reorder") = std::vector<torch::Tensor>());
  m.def("cross_attend", &cross_attend, "cross-attention of one decoder step");
  m.def("encoder_attend", &encoder_attend, "the encoder's self-attention over padded sentences");
  m.def("add_norm_", &add_norm_, "x = LayerNorm(x + y), in place");
  m.def("advance", &advance, "one step of beam search's bookkeeping");
  m.def("candidates", &candidates, "each sentence's own shortlist candidates");
  m.def("gather_rows_", &gather_rows_, "the KV cache's reorder: rows gathered, joiners zeroed, keys then values");
  m.def("split_kv", &split_kv, "joining sentences' cross-attention K and V, heads apart (float16 with half)");
  m.def("span_logits", &span_logits, unlocked, "each row's logits over its own sentence's shortlist columns");
  m.def("linear", &linear, "a linear layer for a few rows: x w^T + bias, optionally ReLU'd");
  m.def("panel_width", &panel_width, "weight rows a panel of pack_panels holds");
  m.def("pack_panels", &pack_panels, "a weight (N, K) as panel_linear reads it");
  m.def("panel_linear", &panel_linear, unlocked, "a linear layer on packed panels: x w^T + bias, optionally ReLU'd");
  m.def("panel_product", &panel_product, unlocked, "x w^T on packed panels, the first `columns` columns only");
  m.def("int8_panel_width", &int8_panel_width, "outputs a panel of pack_int8 holds");
  m.def("pack_int8", &pack_int8, "an int8 weight (N, K) as int8_linear reads it, and its column sums");
  m.def("int8_linear", &int8_linear, unlocked, "an int8 linear layer, activations quantized per row");
  m.def("decoder_layers", &decoder_layers, unlocked, "a post-LN decoder step through every layer on packed panels");
  m.def("encoder_layers", &encoder_layers, unlocked, "a post-LN encoder through every layer on packed panels");
  m.def("encoder_attend_ragged", &encoder_attend_ragged, "the encoder's self-attention over unpadded sentences");
  m.def("encoder_layers_ragged", &encoder_layers_ragged, unlocked,
        "a post-LN encoder over unpadded sentences through every layer on packed panels");
  m.def("embed", &embed, "a decoder step's or the encoder's input: position + scale * token embedding");
}
