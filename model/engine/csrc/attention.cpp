// The attention kernels: a decoder step's self- and cross-attention, the encoder's self-attention.
#include "kernels.h"

namespace {

// One query (Dh) over keys/values k[j * ks], v[j * vs] (j < n, those with visible[j] false left
// out; visible nullptr: none), stored as T (float, or float16 widened into `scratch`, Dh floats),
// softmax weights in `p` (n floats), the weighted sum of values into out (Dh).
template <typename T>
inline void attend_one(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t n, int64_t dh,
                       float scale, const bool* visible, float* p, float* out, float* scratch = nullptr) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; j++) {
    p[j] = visible == nullptr || visible[j] ? dot(q, row_of(k + j * ks, dh, scratch), dh) * scale : -INFINITY;
    top = std::max(top, p[j]);
  }
  const float inv = 1.f / exp_shifted(p, n, top);
  std::fill(out, out + dh, 0.f);
  for (int64_t j = 0; j < n; j++) {
    if (p[j] != 0.f) axpy(p[j] * inv, row_of(v + j * vs, dh, scratch), out, dh);
  }
}

// A reorder's sources for self_attend (``SelfAttentionCache.reorder`` deferred to the step): src_k,
// src_v (R', H, >= pos, Dh) the previous layout, index (N') int64 the source row of each of the
// first N' cache rows (the rest are zeroed), first (N) int64 or empty as gather_rows_'s.
struct Reorder {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k0 = 0, k1 = 0, k2 = 0, v0 = 0, v1 = 0, v2 = 0;
  const int64_t* index = nullptr;
  int64_t rows = 0;
  const int64_t* first = nullptr;
};

}  // namespace

// Self-attention of one decoder step. qkv (R, 3D): each row's query, key and value, heads
// side by side. k, v (N, H, slots, Dh): the cache; the new key and value are written at
// position `pos`, and each row attends over positions 0..pos, those with visible[r][j] false
// left out (visible: (R, pos + 1) bool, or an empty tensor: all visible). rows (R,) int64: the
// cache row of each row (a step that computes only some of the cache's rows), or an empty
// tensor: row r is cache row r (N = R). reorder: empty, or {src_k, src_v, index, first}: the
// cache's reorder (gather_rows_'s, into k and v, positions 0..pos - 1), done here head by head
// right before the head's attention reads what it copied, so each row's keys and values come
// through the memory system once a step, not once for the copy and again for the attention
// (every cache row is copied, computed or not). -> (R, D), heads merged.
torch::Tensor self_attend(const torch::Tensor& qkv, torch::Tensor k, torch::Tensor v, int64_t pos,
                          const torch::Tensor& visible, double scale, const torch::Tensor& rows,
                          const std::vector<torch::Tensor>& reorder) {
  check_rows(qkv, "qkv");
  check_cache(k, "k");
  check_cache(v, "v");
  const int64_t r = qkv.size(0), d = qkv.size(1) / 3, h = k.size(1), dh = k.size(3);
  const int64_t* cache_row = index_data(rows, r, std::min(k.size(0), v.size(0)), "rows", true);
  TORCH_CHECK((cache_row != nullptr || (k.size(0) == r && v.size(0) == r)) && h * dh == d && pos < k.size(2) &&
                  pos < v.size(2),
              "self_attend: the cache does not match qkv or has no room at position ", pos);
  const bool masked = visible.numel() > 0;
  if (masked) {
    TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.is_contiguous() && visible.numel() == r * (pos + 1),
                "visible must be a contiguous (R, pos + 1) bool tensor");
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "self_attend: k and v must have one dtype");
  TORCH_CHECK(k.size(0) == v.size(0), "self_attend: k and v must have one row count");
  const int64_t cache_rows = k.size(0);
  Reorder from;
  const bool reordering = !reorder.empty();
  if (reordering) {
    TORCH_CHECK(reorder.size() == 4, "self_attend: reorder is {src_k, src_v, index, first}");
    const torch::Tensor &src_k = reorder[0], &src_v = reorder[1], &index = reorder[2], &first = reorder[3];
    check_cache(src_k, "src_k");
    check_cache(src_v, "src_v");
    TORCH_CHECK(src_k.scalar_type() == k.scalar_type() && src_v.scalar_type() == k.scalar_type() &&
                    src_k.size(1) == h && src_v.size(1) == h && src_k.size(3) == dh && src_v.size(3) == dh &&
                    src_k.size(2) >= pos && src_v.size(2) >= pos,
                "self_attend: the reorder's sources do not match the cache");
    // the copy reads the sources while it writes k and v, head by head: they must not overlap
    for (const torch::Tensor* src : {&src_k, &src_v}) {
      TORCH_CHECK(!src->is_alias_of(k) && !src->is_alias_of(v), "self_attend: a reorder's source is the cache itself");
    }
    from.index = index_data(index, index.numel(), std::min(src_k.size(0), src_v.size(0)), "index", false);
    from.rows = index.numel();
    TORCH_CHECK(from.rows <= cache_rows, "self_attend: more reorder rows than cache rows");
    from.first = first_data(first, cache_rows, "cache row");
    from.k = static_cast<const char*>(src_k.data_ptr());
    from.v = static_cast<const char*>(src_v.data_ptr());
    from.k0 = src_k.stride(0), from.k1 = src_k.stride(1), from.k2 = src_k.stride(2);
    from.v0 = src_v.stride(0), from.v1 = src_v.stride(1), from.v2 = src_v.stride(2);
  }
  auto out = torch::empty({r, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* vis = masked ? visible.data_ptr<bool>() : nullptr;
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t n = pos + 1;
  // computed[i]: the qkv row of cache row i, or -1 (a row that is only copied)
  std::vector<int64_t> computed;
  if (reordering && cache_row != nullptr) {
    computed.assign(cache_rows, -1);
    for (int64_t row = 0; row < r; row++) computed[cache_row[row]] = row;
  }
  const int64_t items = reordering ? cache_rows * h : r * h;  // reordering: every cache row's heads
  const int64_t grain = std::max<int64_t>(1, kGrainWork / ((reordering ? 3 : 2) * n * dh));
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    const int64_t size = sizeof(T);
    T* kp = static_cast<T*>(k.data_ptr());
    T* vp = static_cast<T*>(v.data_ptr());
    parallel_chunks(0, items, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(n + dh);  // the softmax weights, then a float16 row widened
      for (int64_t i = begin; i < end; i++) {
        int64_t row = i / h, at = row;
        const int64_t head = i % h;
        if (reordering) {  // i walks the cache's rows: copy this head's history, then attend if computed
          const int64_t lo = from.first == nullptr ? 0 : std::clamp<int64_t>(from.first[at], 0, pos);
          const bool kept = at < from.rows;
          const char* ks = kept ? from.k + (from.index[at] * from.k0 + head * from.k1) * size : nullptr;
          const char* vs = kept ? from.v + (from.index[at] * from.v0 + head * from.v1) * size : nullptr;
          copy_head(ks, reinterpret_cast<char*>(kp + at * k0 + head * k1), lo, pos, from.k2, k2, dh, size);
          copy_head(vs, reinterpret_cast<char*>(vp + at * v0 + head * v1), lo, pos, from.v2, v2, dh, size);
          row = computed.empty() ? at : computed[at];
          if (row < 0) continue;
        } else if (cache_row != nullptr) {
          at = cache_row[row];
        }
        const float* q = in + row * 3 * d + head * dh;
        T* kb = kp + at * k0 + head * k1;
        T* vb = vp + at * v0 + head * v1;
        store(q + d, kb + pos * k2, dh);
        store(q + 2 * d, vb + pos * v2, dh);
        float* o = op + row * d + head * dh;
        const bool* row_vis = vis == nullptr ? nullptr : vis + row * n;
        attend_one(q, kb, k2, vb, v2, n, dh, (float)scale, row_vis, p.data(), o, p.data() + n);
      }
    });
  });
  return out;
}

// Cross-attention of one decoder step. q (R, D) queries, R = B * W (W consecutive rows per
// sentence); k, v (B, H, S, Dh) the sentences' projected memory; mask (B, S) bool, true where a
// source position may be attended (or an empty tensor: all). sentences (R,) int64: each row's
// sentence (a step that computes only some of the rows), or an empty tensor: row r's is r / W.
// -> (R, D), heads merged.
torch::Tensor cross_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& mask, double scale, const torch::Tensor& sentences) {
  check_rows(q, "q");
  check_cache(k, "k");
  check_cache(v, "v");
  const int64_t r = q.size(0), d = q.size(1), b = k.size(0), h = k.size(1), s = k.size(2), dh = k.size(3);
  const int64_t* sentence_of = index_data(sentences, r, b, "sentences", false);
  TORCH_CHECK(b > 0 && (sentence_of != nullptr || r % b == 0) && h * dh == d && v.size(0) == b && v.size(2) == s,
              "cross_attend: memory of ", b, " sentences for ", r, " rows");
  const bool masked = mask.numel() > 0;
  if (masked) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == b && mask.size(1) >= s &&
                    mask.stride(1) == 1,
                "mask must be a (B, S) bool tensor with contiguous rows");
  }
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "cross_attend: k and v must have one dtype");
  const int64_t w = r / b;
  auto out = torch::empty({r, d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
  const int64_t m0 = masked ? mask.stride(0) : 0;
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * s * dh));
  with_cache_type(k, [&](auto type) {
    using T = decltype(type);
    const T* kp = static_cast<const T*>(k.data_ptr());
    const T* vp = static_cast<const T*>(v.data_ptr());
    parallel_chunks(0, r * h, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(s + dh);  // the softmax weights, then a float16 row widened
      for (int64_t i = begin; i < end; i++) {
        const int64_t row = i / h, head = i % h, sentence = sentence_of == nullptr ? row / w : sentence_of[row];
        const float* qh = qp + row * d + head * dh;
        const T* kb = kp + sentence * k0 + head * k1;
        const T* vb = vp + sentence * v0 + head * v1;
        float* o = op + row * d + head * dh;
        const bool* row_mask = mp == nullptr ? nullptr : mp + sentence * m0;
        attend_one(qh, kb, k2, vb, v2, s, dh, (float)scale, row_mask, p.data(), o, p.data() + s);
      }
    });
  });
  return out;
}

// Self-attention of the encoder over whole sentences. qkv (B*S, 3D): each position's query, key
// and value, heads side by side, sentence by sentence; mask (B, S) bool (false: padding, never
// attended to). -> (B*S, D), heads merged.
torch::Tensor encoder_attend(const torch::Tensor& qkv, const torch::Tensor& mask, int64_t heads, double scale) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), d = qkv.size(1) / 3, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(heads > 0 && qkv.size(1) == 3 * d && dh * heads == d, "qkv must be (rows, 3 x heads x head_dim)");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.is_contiguous() &&
                  mask.size(0) * mask.size(1) == rows,
              "mask must be a contiguous (B, S) bool tensor with B x S = qkv's rows");
  const int64_t s = mask.size(1);
  TORCH_CHECK(s > 0 && dh > 0, "encoder_attend: no positions or no head width");
  auto out = torch::empty({rows, d}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const bool* m = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * s * dh));
  parallel_chunks(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(s);
    for (int64_t i = begin; i < end; i++) {
      const int64_t row = i / heads, head = i % heads, first = row / s * s;  // the sentence's first position
      const float* keys = x + first * 3 * d + d + head * dh;
      attend_one(x + row * 3 * d + head * dh, keys, 3 * d, keys + d, 3 * d, s, dh, (float)scale, m + first, p.data(),
                 op + row * d + head * dh);
    }
  });
  return out;
}

// The encoder's self-attention over sentences laid end to end, without padding. qkv (T, 3D):
// each token's query, key and value, heads side by side; offsets (B + 1) int64: sentence i is
// rows [offsets[i], offsets[i + 1]). -> (T, D), heads merged: encoder_attend's numbers for the
// same sentences padded (a padded key's weight is exactly 0 there).
torch::Tensor encoder_attend_ragged(const torch::Tensor& qkv, const torch::Tensor& offsets, int64_t heads,
                                    double scale) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), d = qkv.size(1) / 3, dh = heads > 0 ? d / heads : 0;
  TORCH_CHECK(heads > 0 && qkv.size(1) == 3 * d && dh * heads == d && dh > 0,
              "qkv must be (rows, 3 x heads x head_dim)");
  TORCH_CHECK(is_vector(offsets, torch::kInt64) && offsets.numel() >= 1, "offsets must be a contiguous int64 vector");
  const int64_t b = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[b] == rows, "offsets must run from 0 to qkv's ", rows, " rows");
  std::vector<int64_t> first(rows), stop(rows);  // each row's sentence: its first row, the row after its last
  int64_t longest = 0;
  for (int64_t i = 0; i < b; i++) {
    TORCH_CHECK(off[i + 1] >= off[i] && off[i + 1] <= rows, "offsets must not decrease");
    std::fill(first.begin() + off[i], first.begin() + off[i + 1], off[i]);
    std::fill(stop.begin() + off[i], stop.begin() + off[i + 1], off[i + 1]);
    longest = std::max(longest, off[i + 1] - off[i]);
  }
  auto out = torch::empty({rows, d}, qkv.options());
  if (rows == 0) return out;
  const float* x = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainWork / (2 * std::max<int64_t>(1, rows / std::max<int64_t>(1, b)) * dh));
  parallel_chunks(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(longest);
    for (int64_t i = begin; i < end; i++) {
      const int64_t row = i / heads, head = i % heads, start = first[row];
      const float* keys = x + start * 3 * d + d + head * dh;
      attend_one(x + row * 3 * d + head * dh, keys, 3 * d, keys + d, 3 * d, stop[row] - start, dh, (float)scale,
                 nullptr, p.data(), op + row * d + head * dh);
    }
  });
  return out;
}
