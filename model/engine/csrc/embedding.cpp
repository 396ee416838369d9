// A decoder step's or the encoder's input embedding.
#include "kernels.h"

namespace {

// Where token t's element j of each table layout lies, and its value as float.
template <typename T>
struct RowsLayout {  // (V, D): a lookup table of rows, float32 or float16 (kept in float16 where exact)
  const T* data;
  int64_t d;
  float at(int64_t t, int64_t j) const { return static_cast<float>(data[t * d + j]); }
};

struct PanelsLayout {  // (ceil(V / W), D, W) float32: the output projection's panels (pack_panels)
  const float* data;
  int64_t d, width;
  float at(int64_t t, int64_t j) const { return data[((t / width) * d + j) * width + t % width]; }
};

struct Int8Layout {  // (ceil(V / 16), D / 4, 16, 4) int8 and scales (V'): its int8 panels (pack_int8)
  const int8_t* data;
  const float* scales;
  int64_t d, width;
  float at(int64_t t, int64_t j) const {
    const int8_t q = data[(((t / width) * (d / 4) + j / 4) * width + t % width) * 4 + j % 4];
    return static_cast<float>(q) * scales[t];
  }
};

template <typename Layout>
void embed_rows(const Layout& table, int64_t v, const int64_t* tokens, int64_t r, const float* positions,
                int64_t period, float scale, float* out) {
  const int64_t d = table.d;
  for (int64_t i = 0; i < r; i++) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < v, "embed: token ", tokens[i], " outside the table of ", v);
    const float* where = positions + (i % period) * d;
    for (int64_t j = 0; j < d; j++) out[i * d + j] = where[j] + scale * table.at(tokens[i], j);
  }
}

}  // namespace

// A decoder step's or the encoder's input: x[r] = positions[r % P] + scale * table[tokens[r]],
// float32. tokens (R,) int64. The table in one of three layouts: rows (V, D) float32 or float16 (a
// lookup table kept in float16 where exact); the output projection's float32 panels (ceil(V / W),
// D, W) (pack_panels), where the model keeps the tied table only as those; or its int8 panels
// (ceil(V / 16), D / 4, 16, 4) (pack_int8) with their per-row `scales`, the table then int8 as
// CTranslate2 keeps it (`scales`: empty for the float layouts). positions (D,) shared by every row
// (P = 1), or (P, D) with R a multiple of P: one per row (P = R, a decoder step's late joiners) or
// one per position of sentences of P tokens laid end to end (the encoder's padded batch).
torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& table, const torch::Tensor& scales,
                    const torch::Tensor& positions, double scale) {
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.dim() == 1 && table.is_contiguous() &&
                  table.device().is_cpu() && positions.scalar_type() == torch::kFloat32 &&
                  positions.is_contiguous() && tokens.device().is_cpu(),
              "embed: tokens (R) int64, a contiguous table, float32 positions");
  const int64_t r = tokens.size(0), dim = table.dim();
  const bool rows = dim == 2, panels = dim == 3 && table.scalar_type() == torch::kFloat32,
             int8 = dim == 4 && table.scalar_type() == torch::kInt8 && table.size(3) == 4;
  TORCH_CHECK(rows || panels || int8, "embed: a table of rows (V, D), float32 panels or int8 panels");
  const int64_t d = rows ? table.size(1) : panels ? table.size(1) : table.size(1) * 4;
  const int64_t v = rows ? table.size(0) : table.size(0) * table.size(2);  // (panels: V rounded up)
  TORCH_CHECK(!int8 || (scales.scalar_type() == torch::kFloat32 && scales.dim() == 1 && scales.is_contiguous() &&
                        scales.numel() == v),
              "embed: int8 panels need their float32 scales, one a row");
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
  if (panels) {
    embed_rows(PanelsLayout{table.data_ptr<float>(), d, table.size(2)}, v, tp, r, pp, period, sc, op);
  } else if (int8) {
    embed_rows(Int8Layout{table.data_ptr<int8_t>(), scales.data_ptr<float>(), d, table.size(2)}, v, tp, r, pp,
               period, sc, op);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND_HALF(table.scalar_type(), "embed", [&] {
      embed_rows(RowsLayout<scalar_t>{table.data_ptr<scalar_t>(), d}, v, tp, r, pp, period, sc, op);
    });
  }
  return out;
}
