// A decoder step's or the encoder's input embedding.
#include "kernels.h"

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
