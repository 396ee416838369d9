// The kernels' entry points, by the file that defines each: bindings.cpp binds them to Python, and
// layer_stack.cpp calls the attention, join and product kernels layer after layer.
#pragma once

#include "common.h"

// attention.cpp
torch::Tensor self_attend(const torch::Tensor& qkv, torch::Tensor k, torch::Tensor v, int64_t pos,
                          const torch::Tensor& visible, double scale, const torch::Tensor& rows,
                          const std::vector<torch::Tensor>& reorder);
torch::Tensor cross_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& mask, double scale, const torch::Tensor& sentences);
torch::Tensor encoder_attend(const torch::Tensor& qkv, const torch::Tensor& mask, int64_t heads, double scale);
torch::Tensor encoder_attend_ragged(const torch::Tensor& qkv, const torch::Tensor& offsets, int64_t heads,
                                    double scale);

// kv_cache.cpp
void gather_rows_(const torch::Tensor& src_k, const torch::Tensor& src_v, const torch::Tensor& rows,
                  torch::Tensor dst_k, torch::Tensor dst_v, const torch::Tensor& first);
std::vector<torch::Tensor> split_kv(const torch::Tensor& kv, int64_t sentences, int64_t heads, bool half);

// beam_search.cpp
std::tuple<std::vector<torch::Tensor>, std::vector<int64_t>> advance(
    const torch::Tensor& logits, const torch::Tensor& own, const torch::Tensor& vocab, const torch::Tensor& extra,
    const torch::Tensor& spans, const torch::Tensor& start, int64_t now, const torch::Tensor& scores,
    const torch::Tensor& lengths, const torch::Tensor& finished, const torch::Tensor& eos, torch::Tensor history,
    double alpha, int64_t eos_id, int64_t pad_id, const torch::Tensor& rows);

// shortlist.cpp
std::vector<torch::Tensor> candidates(const torch::Tensor& sources, const torch::Tensor& real,
                                      const torch::Tensor& offsets, const torch::Tensor& targets);
torch::Tensor span_logits(const torch::Tensor& x, const torch::Tensor& sentences, const torch::Tensor& rows,
                          const torch::Tensor& spans, int64_t width);

// embedding.cpp
torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& table, const torch::Tensor& scales,
                    const torch::Tensor& positions, double scale);

// gemm_rows.cpp
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, bool relu);

// gemm_panels.cpp
int64_t panel_width();
torch::Tensor pack_panels(const torch::Tensor& w);
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                           bool relu);
torch::Tensor panel_columns(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& bias,
                            bool relu, int64_t columns);
torch::Tensor panel_product(const torch::Tensor& x, const torch::Tensor& panels, int64_t columns);

// gemm_int8.cpp
int64_t int8_panel_width();
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& colsum,
                          const torch::Tensor& scales, const torch::Tensor& bias, bool relu);
torch::Tensor int8_columns(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& colsum,
                           const torch::Tensor& scales, const torch::Tensor& bias, bool relu, int64_t columns);

// layer_stack.cpp
torch::Tensor add_norm_(torch::Tensor x, const torch::Tensor& y, const torch::Tensor& weight,
                        const torch::Tensor& bias, double eps);
// A linear layer whose weight is packed into panels (pack_panels; bias: (N) or an empty tensor).
struct PanelLinear {
  torch::Tensor panels, bias;
};

// A LayerNorm's weight and bias (D).
struct LayerNormWeights {
  torch::Tensor weight, bias;
};

// One post-LN decoder layer's weights, by name (model.network.transformer.DecoderLayer's).
struct DecoderLayerWeights {
  PanelLinear self_qkv, self_out, cross_q, cross_out, fc1, fc2;
  LayerNormWeights self_norm, cross_norm, ff_norm;
};

// One post-LN encoder layer's weights, by name (model.network.transformer.EncoderLayer's).
struct EncoderLayerWeights {
  PanelLinear qkv, out, fc1, fc2;
  LayerNormWeights attn_norm, ff_norm;
};

torch::Tensor decoder_layers(torch::Tensor x, const std::vector<DecoderLayerWeights>& layers,
                             const std::vector<torch::Tensor>& self_k, const std::vector<torch::Tensor>& self_v,
                             const std::vector<int64_t>& positions, const torch::Tensor& visible,
                             const std::vector<torch::Tensor>& cross_k, const std::vector<torch::Tensor>& cross_v,
                             const torch::Tensor& source, double scale, double eps, const torch::Tensor& rows,
                             const torch::Tensor& sentences, const std::vector<std::vector<torch::Tensor>>& reorders);
torch::Tensor encoder_layers(torch::Tensor x, const std::vector<EncoderLayerWeights>& layers,
                             const torch::Tensor& mask, int64_t heads, double scale, double eps);
torch::Tensor encoder_layers_ragged(torch::Tensor x, const std::vector<EncoderLayerWeights>& layers,
                                    const torch::Tensor& offsets, int64_t heads, double scale, double eps);
