// The kernels' Python module: the only file that includes pybind11 (torch/extension.h).
#include <torch/extension.h>

#include "kernels.h"

namespace {

// A layer's weights are given from Python by name, each a (tensor, tensor) pair: a product's
// (panels, bias), a norm's (weight, bias).
using Pair = std::pair<torch::Tensor, torch::Tensor>;

PanelLinear panels(const Pair& p) { return {p.first, p.second}; }
LayerNormWeights norm(const Pair& p) { return {p.first, p.second}; }

}  // namespace

// The longest calls (a whole pass, or a product of many rows: milliseconds in a batch) let go of
// Python's lock while they run, so the server's event loop goes on reading and answering requests
// meanwhile (docs/benchmarks/README.md#fused-step). They touch only the tensors they are given.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = py::call_guard<py::gil_scoped_release>();
  // module_local: each variant's build registers its own classes, so that several variants load
  // into one process (the tests load every variant this CPU runs)
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights", py::module_local(),
                                  "a post-LN decoder layer's weights for decoder_layers, by name")
      .def(py::init([](const Pair& self_qkv, const Pair& self_out, const Pair& cross_q, const Pair& cross_out,
                       const Pair& fc1, const Pair& fc2, const Pair& self_norm, const Pair& cross_norm,
                       const Pair& ff_norm) {
             return DecoderLayerWeights{panels(self_qkv), panels(self_out), panels(cross_q), panels(cross_out),
                                        panels(fc1),      panels(fc2),      norm(self_norm),   norm(cross_norm),
                                        norm(ff_norm)};
           }),
           py::kw_only(), py::arg("self_qkv"), py::arg("self_out"), py::arg("cross_q"), py::arg("cross_out"),
           py::arg("fc1"), py::arg("fc2"), py::arg("self_norm"), py::arg("cross_norm"), py::arg("ff_norm"));
  py::class_<EncoderLayerWeights>(m, "EncoderLayerWeights", py::module_local(),
                                  "a post-LN encoder layer's weights for encoder_layers, by name")
      .def(py::init([](const Pair& qkv, const Pair& out, const Pair& fc1, const Pair& fc2, const Pair& attn_norm,
                       const Pair& ff_norm) {
             return EncoderLayerWeights{panels(qkv), panels(out), panels(fc1), panels(fc2), norm(attn_norm),
                                        norm(ff_norm)};
           }),
           py::kw_only(), py::arg("qkv"), py::arg("out"), py::arg("fc1"), py::arg("fc2"), py::arg("attn_norm"),
           py::arg("ff_norm"));
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
  m.def("panel_columns", &panel_columns, unlocked,
        "a linear layer on packed panels, the first `columns` outputs only (a vocabulary's padding left out)");
  m.def("panel_product", &panel_product, unlocked, "x w^T on packed panels, the first `columns` columns only");
  m.def("int8_panel_width", &int8_panel_width, "outputs a panel of pack_int8 holds");
  m.def("pack_int8", &pack_int8, "an int8 weight (N, K) as int8_linear reads it, and its column sums");
  m.def("int8_linear", &int8_linear, unlocked, "an int8 linear layer, activations quantized per row");
  m.def("int8_columns", &int8_columns, unlocked, "int8_linear's first `columns` outputs only");
  m.def("decoder_layers", &decoder_layers, unlocked, "a post-LN decoder step through every layer on packed panels");
  m.def("encoder_layers", &encoder_layers, unlocked, "a post-LN encoder through every layer on packed panels");
  m.def("encoder_attend_ragged", &encoder_attend_ragged, "the encoder's self-attention over unpadded sentences");
  m.def("encoder_layers_ragged", &encoder_layers_ragged, unlocked,
        "a post-LN encoder over unpadded sentences through every layer on packed panels");
  m.def("embed", &embed, "a decoder step's or the encoder's input: position + scale * token embedding (rows or panels)");
}
