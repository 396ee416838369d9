#include "kernels.h"
#include "tiles.h"

// ---- Matrix products of a few dozen rows, on weights packed into panels ------------------------
// Past a few rows the dot-product form of ``linear`` falls behind MKL, and MKL itself runs far
// below the FMA peak on a few dozen rows (its per-call packing and blocking): the encoder of a few sentences
// (10-100 rows) and a decoder step of 2-16 sentences at beam 4 run there. This product is the
// broadcast form on a copy of the weight packed once: panels of kPanel weight rows, each stored
// transposed (K, kPanel), so a block of up to kPanelRows rows by one panel keeps its outputs in
// 2 x rows accumulator vectors, and each k loads the panel's two vectors and broadcasts one x value
// per row (docs/benchmarks/README.md#linear-kernels). Each output is summed over k in an order that
// depends only on how many rows its block holds (blocks of kPanelRows, then one of the rest), so a
// row's result does not depend on the values of the other rows.
constexpr int64_t kPanel = 2 * kVec;
// how many k ahead a block prefetches its panel: with a few rows the panels stream from L3, and
// the prefetch hides their latency behind the block's arithmetic
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

// w (N, K) -> its panels (ceil(N / panel_width()), K, panel_width()): panel p holds weight rows
// [p * width, (p + 1) * width), transposed; where N is not a multiple of the width (a vocabulary),
// the last panel's missing rows are zeros, and panel_columns reads the first N columns only.
torch::Tensor pack_panels(const torch::Tensor& w) {
  check_rows(w, "w");
  const int64_t n = w.size(0), k = w.size(1), full = n / kPanel, rest = n - full * kPanel;
  TORCH_CHECK(n > 0 && k > 0, "pack_panels: an empty weight");
  if (rest == 0) return w.view({full, kPanel, k}).transpose(1, 2).contiguous();
  auto out = torch::zeros({full + 1, k, kPanel}, w.options());
  if (full > 0) out.narrow(0, 0, full).copy_(w.narrow(0, 0, full * kPanel).view({full, kPanel, k}).transpose(1, 2));
  out.select(0, full).narrow(1, 0, rest).copy_(w.narrow(0, full * kPanel, rest).t());
  return out;
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
// panel padding): a shortlist's logits over its columns (model/engine/shortlist.py Vocabulary.panels).
torch::Tensor panel_product(const torch::Tensor& x, const torch::Tensor& panels, int64_t columns) {
  return panel_columns(x, panels, torch::empty({0}, x.options()), false, columns);
}
