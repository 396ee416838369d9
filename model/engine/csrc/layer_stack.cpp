// The post-LN residual join, and whole decoder and encoder passes on packed panels in one call.
#include "kernels.h"

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
