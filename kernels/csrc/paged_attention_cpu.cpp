// Paged decode attention on a CPU: one query token per sequence against its keys and values where
// they lie in the paged KV cache, without gathering them into a padded batch first.
//
// q [B, H, C] (rows may be strided), k_cache and v_cache [S, G, C] contiguous (slot = block *
// block_size + offset), block tables [B, N] int64 (padded), lengths [B] int64 (tokens to attend to,
// the new one included). Returns [B, H, C] in q's dtype.
//
// Work is split over (sequence, kv head) pairs; each pair reads its keys once (scores of the H / G query
// heads that share them), takes an exact softmax, then reads its values once. Accumulation is in
// float32 whatever the cache dtype. Scores for a context of L tokens take (H / G) * L floats per task.

// Narrow includes (not torch/extension.h): the build is mostly header parsing.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace composer {
namespace {

// HEAD_DIM > 0 fixes C at compile time (the common head dims: fully unrolled, vectorized inner loops);
// 0 takes it at run time.
template <typename scalar_t, int64_t HEAD_DIM>
void decode(const scalar_t* q, int64_t q_sb, int64_t q_sh, const scalar_t* k, const scalar_t* v,
            const int64_t* tables, int64_t max_blocks, const int64_t* lens, scalar_t* out, int64_t B,
            int64_t H, int64_t G, int64_t C_, int64_t block_size, float scale) {
  const int64_t C = HEAD_DIM > 0 ? HEAD_DIM : C_;
  const int64_t per_group = H / G, slot_stride = G * C;
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_group * C), acc(per_group * C), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / G, g = task % G, L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t h = 0; h < per_group; ++h) {
        const scalar_t* qr = q + b * q_sb + (g * per_group + h) * q_sh;
        for (int64_t c = 0; c < C; ++c) qf[h * C + c] = static_cast<float>(qr[c]) * scale;
      }
      scores.resize(per_group * L);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // pass 1: q . k for every cached token
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* kr = k + (base + i) * slot_stride + g * C;
          for (int64_t h = 0; h < per_group; ++h) {
            const float* qh = qf.data() + h * C;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t c = 0; c < C; ++c) s += qh[c] * static_cast<float>(kr[c]);
            scores[h * L + t0 + i] = s;
          }
        }
      }
      std::vector<float> inv_sum(per_group);
      for (int64_t h = 0; h < per_group; ++h) {  // exact softmax per query head
        float* sh = scores.data() + h * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // pass 2: weighted sum of the values
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* vr = v + (base + i) * slot_stride + g * C;
          for (int64_t h = 0; h < per_group; ++h) {
            const float p = scores[h * L + t0 + i];
            float* ah = acc.data() + h * C;
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) ah[c] += p * static_cast<float>(vr[c]);
          }
        }
      }
      for (int64_t h = 0; h < per_group; ++h) {
        scalar_t* o = out + (b * H + g * per_group + h) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = static_cast<scalar_t>(acc[h * C + c] * inv_sum[h]);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor tables, at::Tensor lens, int64_t block_size,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, C] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "k_cache and v_cache must be contiguous [S, G, C]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
                  lens.dim() == 1 && lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "tables must be contiguous int64 [B, N] and lens int64 [B]");
  const int64_t B = q.size(0), H = q.size(1), C = q.size(2), G = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == C && H % G == 0, "head dims differ, or H is not a multiple of G");
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "one block table and one length per sequence");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(l[b] >= 1 && l[b] <= tables.size(1) * block_size, "sequence ", b, " has length ", l[b],
                ", outside 1..", tables.size(1) * block_size, " (its block table's capacity)");
  auto out = at::empty({B, H, C}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
             v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), B, H, G, C, block_size, static_cast<float>(scale));
    };
    if (C == 64) run(decode<scalar_t, 64>);
    else if (C == 128) run(decode<scalar_t, 128>);
    else run(decode<scalar_t, 0>);
  });
  return out;
}

}  // namespace composer
