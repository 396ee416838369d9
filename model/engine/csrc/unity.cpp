// The one translation unit the extension is built from: every file of this folder, included in
// turn. Each file stands on its own (its includes, its declarations in kernels.h), but compiled
// apart every file parses the torch headers again, which about doubles a variant's build time.
#include "embedding.cpp"
#include "attention.cpp"
#include "kv_cache.cpp"
#include "beam_search.cpp"
#include "shortlist.cpp"
#include "gemm_rows.cpp"
#include "gemm_panels.cpp"
#include "gemm_int8.cpp"
#include "layer_stack.cpp"
#include "bindings.cpp"
