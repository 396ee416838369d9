// The KV cache's reorder and the cross-attention keys and values of joining sentences.
#include "kernels.h"

// The KV cache's reorder (``SelfAttentionCache.reorder``): dst_k[i] = src_k[rows[i]] for each
// i < rows.numel(), the rows after those zeroed (sentences joining), then the same for v, in
// that order (dst_v may be the storage src_k was read from). src (R, H, L, Dh) and dst (N, H, L,
// Dh) views with contiguous head_dim; rows (N' <= N) int64 indices of src's rows. first: (N,)
// int64, or empty (0 for every row): row i's positions before first[i] are neither copied nor
// zeroed (hidden from it: from before its sentence joined a running batch, which its attention
// never reads), so a row's reorder costs its own positions, not the oldest row's.
void gather_rows_(const torch::Tensor& src_k, const torch::Tensor& src_v, const torch::Tensor& rows,
                  torch::Tensor dst_k, torch::Tensor dst_v, const torch::Tensor& first) {
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous() && rows.is_cpu(),
              "rows must be a contiguous int64 CPU vector");
  const int64_t n = rows.numel();
  const int64_t* index = rows.data_ptr<int64_t>();
  check_cache(src_k, "src_k");
  check_cache(src_v, "src_v");
  check_cache(dst_k, "dst_k");
  check_cache(dst_v, "dst_v");
  for (int64_t i = 0; i < n; i++) {
    TORCH_CHECK(index[i] >= 0 && index[i] < src_k.size(0) && index[i] < src_v.size(0), "row ", index[i],
                " out of range");
  }
  const int64_t* from_position = first_data(first, dst_k.size(0), "destination row");
  const bool skips = from_position != nullptr;
  const std::pair<const torch::Tensor*, torch::Tensor*> pairs[2] = {{&src_k, &dst_k}, {&src_v, &dst_v}};
  for (const auto& [src, dst] : pairs) {
    TORCH_CHECK(dst->size(0) >= n && dst->size(1) == src->size(1) && dst->size(2) == src->size(2) &&
                    dst->size(3) == src->size(3) && (!skips || dst->size(0) == first.numel()),
                "gather_rows_: (", dst->sizes(), ") from (", src->sizes(), ")");
    TORCH_CHECK(dst->scalar_type() == src->scalar_type(), "gather_rows_: source and destination dtypes differ");
    const int64_t heads = dst->size(1), length = dst->size(2), total = dst->size(0);
    const int64_t size = dst->element_size(), dh = dst->size(3);  // bytes an element, elements a head's position
    const char* from = static_cast<const char*>(src->data_ptr());
    char* to = static_cast<char*>(dst->data_ptr());
    const int64_t s0 = src->stride(0), s1 = src->stride(1), s2 = src->stride(2);
    const int64_t d0 = dst->stride(0), d1 = dst->stride(1), d2 = dst->stride(2);
    const int64_t grain = std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, heads * length * dh));
    parallel_chunks(0, total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {
        const int64_t lo = skips ? std::clamp<int64_t>(from_position[i], 0, length) : 0;
        for (int64_t h = 0; h < heads; h++) {
          const char* in = i < n ? from + (index[i] * s0 + h * s1) * size : nullptr;
          copy_head(in, to + (i * d0 + h * d1) * size, lo, length, s2, d2, dh, size);
        }
      }
    });
  }
}

// The cross-attention keys and values of joining sentences, heads apart: kv (B*S, 2D), each
// position's key then value projection, heads side by side -> k, v (B, H, S, Dh), contiguous,
// float32, or float16 with `half` (the cache's dtype: ``KernelPlan.kv_dtype``).
std::vector<torch::Tensor> split_kv(const torch::Tensor& kv, int64_t sentences, int64_t heads, bool half) {
  check_rows(kv, "kv");
  const int64_t rows = kv.size(0), d = kv.size(1) / 2, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(sentences > 0 && rows % sentences == 0 && heads > 0 && kv.size(1) == 2 * d && dh * heads == d,
              "kv must be (sentences x positions, 2 x heads x head_dim)");
  const int64_t s = rows / sentences;
  const auto options = kv.options().dtype(half ? torch::kHalf : torch::kFloat32);
  auto k = torch::empty({sentences, heads, s, dh}, options);
  auto v = torch::empty({sentences, heads, s, dh}, options);
  const float* x = kv.data_ptr<float>();
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    T* kp = static_cast<T*>(k.data_ptr());
    T* vp = static_cast<T*>(v.data_ptr());
    for (int64_t b = 0; b < sentences; b++) {
      for (int64_t h = 0; h < heads; h++) {
        for (int64_t t = 0; t < s; t++) {
          const float* row = x + (b * s + t) * 2 * d + h * dh;
          const int64_t at = ((b * heads + h) * s + t) * dh;
          store(row, kp + at, dh);
          store(row + d, vp + at, dh);
        }
      }
    }
  });
  return {k, v};
}
