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

namespace {

// A product on packed panels, ReLU'd or not.
torch::Tensor apply(const PanelLinear& layer, const torch::Tensor& x, bool relu = false) {
  return panel_linear(x, layer.panels, layer.bias, relu);
}

// The post-LN join: LayerNorm(x + y), in place in x.
torch::Tensor join(torch::Tensor x, const torch::Tensor& y, const LayerNormWeights& norm, double eps) {
  return add_norm_(x, y, norm.weight, norm.bias, eps);
}

}  // namespace

// One decoder step through every layer of a post-LN decoder whose products all run on packed
// panels: the same calls model/engine/step.py's _fused_layers makes, in one call from Python (at
// one row the Python around them was a sixth of a step). x (R, D); layers: each layer's weights;
// self_k, self_v, positions: each layer's cache buffers and the position its new key and value go
// to (SelfAttentionCache.next_slot); visible as self_attend's; cross_k, cross_v (B, H, S, Dh) each
// layer's projected memory; source (B, S) bool as cross_attend's mask; rows as self_attend's and
// sentences as cross_attend's (each of x's rows' cache row and sentence, or empty tensors: every
// row, in order); reorders: empty, or each layer's self_attend reorder (an empty one: none).
// -> x, written in place (the joins' add_norm_), (R, D)
torch::Tensor decoder_layers(torch::Tensor x, const std::vector<DecoderLayerWeights>& layers,
                             const std::vector<torch::Tensor>& self_k, const std::vector<torch::Tensor>& self_v,
                             const std::vector<int64_t>& positions, const torch::Tensor& visible,
                             const std::vector<torch::Tensor>& cross_k, const std::vector<torch::Tensor>& cross_v,
                             const torch::Tensor& source, double scale, double eps, const torch::Tensor& rows,
                             const torch::Tensor& sentences, const std::vector<std::vector<torch::Tensor>>& reorders) {
  const size_t count = layers.size();
  TORCH_CHECK(self_k.size() == count && self_v.size() == count && positions.size() == count &&
                  cross_k.size() == count && cross_v.size() == count,
              "decoder_layers: one cache of each kind per layer");
  TORCH_CHECK(reorders.empty() || reorders.size() == count, "decoder_layers: one reorder (or none) per layer");
  const std::vector<torch::Tensor> none;
  for (size_t i = 0; i < count; i++) {
    const DecoderLayerWeights& layer = layers[i];
    const auto& reorder = reorders.empty() ? none : reorders[i];
    const auto attended =
        self_attend(apply(layer.self_qkv, x), self_k[i], self_v[i], positions[i], visible, scale, rows, reorder);
    x = join(x, apply(layer.self_out, attended), layer.self_norm, eps);
    const auto cross = cross_attend(apply(layer.cross_q, x), cross_k[i], cross_v[i], source, scale, sentences);
    x = join(x, apply(layer.cross_out, cross), layer.cross_norm, eps);
    x = join(x, apply(layer.fc2, apply(layer.fc1, x, true)), layer.ff_norm, eps);
  }
  return x;
}

// The encoder's layers, post-LN, every product on packed panels: _fused_layers of EncoderPass in
// one call. x (B*S, D); layers: each layer's weights; attend: the self-attention of a layer's qkv.
// -> x, written in place (the joins' add_norm_), (B*S, D)
template <typename Attend>
torch::Tensor encoder_stack(torch::Tensor x, const std::vector<EncoderLayerWeights>& layers, double eps,
                            Attend attend) {
  for (const EncoderLayerWeights& layer : layers) {
    x = join(x, apply(layer.out, attend(apply(layer.qkv, x))), layer.attn_norm, eps);
    x = join(x, apply(layer.fc2, apply(layer.fc1, x, true)), layer.ff_norm, eps);
  }
  return x;
}

// mask (B, S) bool as encoder_attend's
torch::Tensor encoder_layers(torch::Tensor x, const std::vector<EncoderLayerWeights>& layers,
                             const torch::Tensor& mask, int64_t heads, double scale, double eps) {
  return encoder_stack(x, layers, eps, [&](const torch::Tensor& qkv) { return encoder_attend(qkv, mask, heads, scale); });
}

// The same over sentences laid end to end without padding (x (T, D); offsets as
// encoder_attend_ragged's): the layers' products and joins are per row, so only the attention
// needs to know where a sentence ends. -> x, written in place, (T, D)
torch::Tensor encoder_layers_ragged(torch::Tensor x, const std::vector<EncoderLayerWeights>& layers,
                                    const torch::Tensor& offsets, int64_t heads, double scale, double eps) {
  return encoder_stack(x, layers, eps,
                       [&](const torch::Tensor& qkv) { return encoder_attend_ragged(qkv, offsets, heads, scale); });
}
