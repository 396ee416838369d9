// The few-row product's building blocks, shared by ``linear`` (gemm_rows.cpp) and ``span_logits``
// (shortlist.cpp); the vector type is also the packed panels' (gemm_panels.cpp).
#pragma once

#include "common.h"

// ---- Matrix products of a few rows ------------------------------------------------------------
// At one sentence a decoder step multiplies 1 (greedy) or 4 (beam 4) rows by every layer's
// weights, streamed from L3 (the weights of all layers do not fit in L2) with a few multiply-adds
// per weight loaded, so the product is bound by how fast the weights are read. This kernel keeps a
// tile of weight rows (the whole reduction of each in registers) per rows group and prefetches the
// next tile's rows while it computes, so the reads overlap the arithmetic (docs/benchmarks/README.md#linear-kernels). Above a few rows MKL's blocking wins, and model/engine/step.py
// hands those calls back to torch.
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
