// Attention of one sequence's last few query tokens (a decode at batch 1, or a draft being verified) over
// its keys and values where they lie in the paged KV cache, in float64 with float64 sums: the path of the
// built-in model as served (float64, so that greedy output is the same on every CPU), which the float32
// kernels (paged_attention_cpu.cpp, decode_layers_cpu.cpp) cannot take.
//
// q [Q, H, C] float64 (rows may be strided), k_cache and v_cache [S, G, C] float64 contiguous, C a multiple
// of 8, slots [L] int64: the cache slot of each of the sequence's L tokens in order, the Q new ones last.
// Query i sees keys 0 .. L - Q + i (causal over the draft); query head h reads kv head h / (H / G) (SDPA's
// grouping), scale as given. Returns [Q, H, C].
//
// Why: the torch path (serve/model/layers.py few_query_attention) copies the context's keys and values
// out of the pages per layer and step, then runs two batched matmuls and a softmax on shapes (2-32 rows
// of 16 over 500-3,000 keys) that no library runs near peak: its scores matrix alone (rows x keys) falls
// out of L1 and is written and read three times. Here the keys are walked once, in chunks of CHUNK whose
// scores stay in L1, each slot read as one contiguous run for every kv head and every query row that
// shares it (online softmax across chunks, as flash attention does); scores are vector FMAs over KEYS keys
// at a time (the block's keys transposed; two rows at a time, so that four FMA chains run side by side),
// exp is a vectorised polynomial, and each head's values are summed into a block of rows' accumulators
// held in registers over the chunk (the chunk's value rows stay in L1 across blocks). Per extra row this
// is ~0.7-0.8x the time of summing into accumulators in memory for every slot (5-9 rows), with the same
// sums in the same order. A row's result does not depend on Q: chunk bounds are fixed, and the keys a row
// may not see weigh exactly zero, so a decode and a verify of the same position agree to the bit.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_f64.h"

namespace composer {
namespace {

using f64::loadv;
using f64::storev;
using f64::vd;
using f64::VW;
constexpr int64_t KEYS = VW;    // keys per score vector
constexpr int64_t CHUNK = 64;   // keys per chunk: its scores stay in L1 (online softmax across chunks)

// exp(x) for x <= 0 (a score minus its row's running maximum), vectorisable: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its Taylor series to r^12 / 12! (truncation < 2e-16 relative), 2^n written into the exponent bits.
// Below -708 the result is clamped near 2^-1022, a weight that changes no float64 sum it joins.
inline double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634, kShift = 6755399441055744.0;  // 1.5 * 2^52
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  x = x < -708.0 ? -708.0 : x;
  const double z = x * kLog2e + kShift;  // round(x / ln2) in the low mantissa bits
  const double n = z - kShift;
  const double r = (x - n * kLn2Hi) - n * kLn2Lo;
  double p = 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0; p = p * r + 1.0 / 3628800.0; p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0; p = p * r + 1.0 / 5040.0; p = p * r + 1.0 / 720.0; p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0; p = p * r + 1.0 / 6.0; p = p * r + 0.5; p = p * r + 1.0; p = p * r + 1.0;
  int64_t zb, sb;
  std::memcpy(&zb, &z, 8);
  std::memcpy(&sb, &kShift, 8);
  const int64_t bits = (zb - sb + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, 8);
  return p * scale;
}

// HEAD_DIM > 0 fixes C at compile time (unrolled loops); 0 takes it at run time.
template <int64_t HEAD_DIM>
void attend(const double* q, int64_t q_sq, int64_t q_sh, const double* k, const double* v,
            const int64_t* slots, int64_t L, int64_t Q, int64_t H, int64_t G, int64_t C_, double* out,
            double scale) {
  const int64_t C = HEAD_DIM > 0 ? HEAD_DIM : C_, CV = C / VW;  // C: a multiple of 8
  const int64_t rep = H / G, slot_stride = G * C;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    const int64_t ng = g1 - g0, M = rep * Q, R = ng * M;  // row (g, m), m = r * Q + i
    std::vector<double> qs(R * C), p(R * CHUNK), mx(R, -std::numeric_limits<double>::infinity()), sum(R, 0.0);
    std::vector<vd> kt(C), acc(R * CV);
    std::vector<int64_t> seen(R);
    for (auto& a : acc) a = vd{};
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t m = 0; m < M; ++m) {
        const double* qr = q + (m % Q) * q_sq + ((g0 + g) * rep + m / Q) * q_sh;
        for (int64_t c = 0; c < C; ++c) qs[(g * M + m) * C + c] = qr[c] * scale;
        seen[g * M + m] = L - Q + 1 + m % Q;
      }
    for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
      const int64_t nc = std::min(CHUNK, L - c0);
      // the next chunk's keys and values, a cache line at a time: a step's weights evict the cache from
      // L2 and L3 between layers, and its reads here come too slowly for the hardware prefetcher to run
      // ahead (cold, 4 layers of 1,400 keys: 0.83-0.91x the time with these)
      for (int64_t l = c0 + CHUNK; l < std::min(L, c0 + 2 * CHUNK); ++l) {
        const double* kp = k + slots[l] * slot_stride + g0 * C;
        const double* vp = v + slots[l] * slot_stride + g0 * C;
        for (int64_t o = 0; o < ng * C; o += 8) {
          __builtin_prefetch(kp + o);
          __builtin_prefetch(vp + o);
        }
      }
      for (int64_t l0 = 0; l0 < nc; l0 += KEYS) {  // the chunk's scores, KEYS keys a vector
        const int64_t nb = std::min(KEYS, nc - l0);
        const double* ks[KEYS];
        for (int64_t j = 0; j < KEYS; ++j) ks[j] = k + slots[c0 + l0 + std::min(j, nb - 1)] * slot_stride + g0 * C;
        for (int64_t g = 0; g < ng; ++g) {
          // the keys of head g, transposed: kt[c] = key j's c-th value, j = 0..7 (in registers, VW values of
          // the VW keys at a time: element by element, the vector loads of kt waited on the stores)
          for (int64_t c0 = 0; c0 < C; c0 += VW) {
            vd rows[KEYS];
            for (int64_t j = 0; j < KEYS; ++j) rows[j] = loadv(ks[j] + g * C + c0);
            f64::transpose(rows, kt.data() + c0);
          }
          int64_t m = 0;
          for (; m + 1 < M; m += 2) {  // two rows at a time: four independent chains (FMA latency)
            const double* qa = qs.data() + (g * M + m) * C;
            const double* qb = qa + C;
            vd a0{}, a1{}, b0{}, b1{};
            for (int64_t c = 0; c < C; c += 2) {
              a0 += qa[c] * kt[c];
              a1 += qa[c + 1] * kt[c + 1];
              b0 += qb[c] * kt[c];
              b1 += qb[c + 1] * kt[c + 1];
            }
            storev(p.data() + (g * M + m) * CHUNK + l0, a0 + a1);
            storev(p.data() + (g * M + m + 1) * CHUNK + l0, b0 + b1);
          }
          for (; m < M; ++m) {
            const double* qm = qs.data() + (g * M + m) * C;
            vd s0{}, s1{};  // two chains
            for (int64_t c = 0; c < C; c += 2) {
              s0 += qm[c] * kt[c];
              s1 += qm[c + 1] * kt[c + 1];
            }
            storev(p.data() + (g * M + m) * CHUNK + l0, s0 + s1);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // online softmax: the row's running max and sum, its output rescaled
        double* row = p.data() + r * CHUNK;
        const int64_t n = std::max<int64_t>(0, std::min(nc, seen[r] - c0));
        double cm = mx[r];
#pragma omp simd reduction(max : cm)
        for (int64_t l = 0; l < n; ++l) cm = row[l] > cm ? row[l] : cm;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t l = 0; l < n; ++l) {
          row[l] = exp_nonpositive(row[l] - cm);
          s += row[l];
        }
        for (int64_t l = n; l < nc; ++l) row[l] = 0.0;
        if (cm > mx[r]) {
          const double f = exp_nonpositive(mx[r] - cm);
          sum[r] *= f;
          for (int64_t h = 0; h < CV; ++h) acc[r * CV + h] *= f;
          mx[r] = cm;
        }
        sum[r] += s;
      }
      if constexpr (HEAD_DIM > 0) {
        // the chunk's values, a block of rows of one head at a time with their sums in registers (the same
        // sums in the same order as below: l ascending, one FMA each)
        constexpr int64_t CVc = HEAD_DIM / VW, MB = CVc >= 16 ? 1 : 16 / CVc;
        const double* vrow[CHUNK];
        for (int64_t l = 0; l < nc; ++l) vrow[l] = v + slots[c0 + l] * slot_stride + g0 * C;
        // `full`: a whole block, its row count a constant the compiler unrolls (the sums stay in registers)
        auto block = [&](auto full, int64_t g, int64_t m0, int64_t mb) {
          const int64_t rows = decltype(full)::value ? MB : mb;
          vd a[MB][CVc];
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t h = 0; h < CVc; ++h) a[i][h] = acc[(g * M + m0 + i) * CV + h];
          const double* pr = p.data() + (g * M + m0) * CHUNK;
          for (int64_t l = 0; l < nc; ++l)
            for (int64_t h = 0; h < CVc; ++h) {
              const vd vv = loadv(vrow[l] + g * C + h * VW);
              for (int64_t i = 0; i < rows; ++i) a[i][h] += pr[i * CHUNK + l] * vv;
            }
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t h = 0; h < CVc; ++h) acc[(g * M + m0 + i) * CV + h] = a[i][h];
        };
        for (int64_t g = 0; g < ng; ++g)
          for (int64_t m0 = 0; m0 < M; m0 += MB) {
            if (M - m0 >= MB) block(std::true_type{}, g, m0, MB);
            else block(std::false_type{}, g, m0, M - m0);
          }
      } else {
        for (int64_t l = 0; l < nc; ++l) {  // the chunk's values: each slot once, every row of every head
          const double* vs = v + slots[c0 + l] * slot_stride + g0 * C;
          for (int64_t g = 0; g < ng; ++g) {
            for (int64_t h = 0; h < CV; ++h) {
              const vd vv = loadv(vs + g * C + h * VW);
              for (int64_t m = 0; m < M; ++m) acc[(g * M + m) * CV + h] += p[(g * M + m) * CHUNK + l] * vv;
            }
          }
        }
      }
    }
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t m = 0; m < M; ++m) {
        double* o = out + ((m % Q) * H + (g0 + g) * rep + m / Q) * C;
        const double f = 1.0 / sum[g * M + m];
        for (int64_t h = 0; h < CV; ++h) storev(o + h * VW, acc[(g * M + m) * CV + h] * f);
      }
  });
}

}  // namespace

at::Tensor few_query_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [Q, H, C] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "k_cache and v_cache must be contiguous [S, G, C]");
  TORCH_CHECK(q.scalar_type() == at::kDouble && k_cache.scalar_type() == at::kDouble &&
                  v_cache.scalar_type() == at::kDouble, "float64 only (the float32 kernels sum in float32)");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be contiguous int64 [L]");
  const int64_t Q = q.size(0), H = q.size(1), C = q.size(2), G = k_cache.size(1), L = slots.size(0);
  TORCH_CHECK(k_cache.size(2) == C && H % G == 0, "head dims differ, or H is not a multiple of G");
  TORCH_CHECK(C % 8 == 0, "the head dim must be a multiple of 8, not ", C);
  TORCH_CHECK(Q >= 1 && L >= Q, "need 1 <= Q <= L, got Q = ", Q, ", L = ", L);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(s[l] >= 0 && s[l] < k_cache.size(0), "slot ", s[l], " outside the cache's ", k_cache.size(0));
  auto out = at::empty({Q, H, C}, q.options());
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<double>(), q.stride(0), q.stride(1), k_cache.data_ptr<double>(), v_cache.data_ptr<double>(),
           s, L, Q, H, G, C, out.data_ptr<double>(), scale);
  };
  if (C == 16) run(attend<16>);
  else if (C == 64) run(attend<64>);
  else if (C == 128) run(attend<128>);
  else run(attend<0>);
  return out;
}

}  // namespace composer
