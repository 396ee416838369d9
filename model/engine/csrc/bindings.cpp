// The kernels' Python module: the only file that includes pybind11 (torch/extension.h).
#include <torch/extension.h>

#include "kernels.h"

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
