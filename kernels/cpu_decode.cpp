// SFI's decode-step attention on the CPU: the fast step (two_source_decode) and the fallback heads'
// page-bound reads (page_bound_decode); dense decode over many sequences' own caches in one call
// (ragged_decode: the continuous engine's batched dense step).
//
// Two-source decode attention: SFI's fast step (cotserve/policies/sfi/attention.py).
//
// For each (slot b, KV head h), the G query heads of its GQA group attend, through ONE softmax,
// over (1) a compact buffer of C entries (sink + selected K/V, float32 or bfloat16, a bool mask
// per entry) and (2) the recent window, rows [wstart[b], wend[b]) of the float32 cache. Logits,
// softmax and the value sums are float32 whatever the compact dtype (bf16 entries are widened on
// load), so a bf16 compact buffer halves the bytes read without rounding any product.
// Plain loops written lane-parallel (16 partial sums) so the compiler vectorizes them without
// reassociation flags; one pass over the keys, one over the values; (b, h) pairs in parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// q [D] . row [D] with the row widened to float32
template <typename T>
inline float dot(const float* q, const T* row, int64_t d) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    for (int l = 0; l < LANES; ++l) acc[l] += q[i + l] * widen(row[i + l]);
  }
  for (int w = LANES / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  float s = acc[0];
  for (; i < d; ++i) s += q[i] * widen(row[i]);
  return s;
}

// exp(x) for x <= 0 (a softmax after its max is taken): 2^n * 2^f, n = floor(x log2 e), 2^f by a
// degree-6 polynomial on [0, 1); x = -inf gives exactly 0. Plain
// arithmetic, so the loops calling it vectorize (std::exp does not).
inline float exp_nonpos(float x) {
  float t = x * 1.4426950409f;
  t = t >= -127.f ? t : -127.f;  // also maps NaN to -127 (then 0), so the int conversion below is defined
  const int32_t whole = static_cast<int32_t>(t);
  const int32_t n = whole - (t < static_cast<float>(whole) ? 1 : 0);
  const float f = t - static_cast<float>(n);
  // least-squares fit of 2^f - 1 on [0, 1] (relative error 4e-9 in exact arithmetic; float
  // rounding dominates)
  const float p = 1.f + f * (0.69314698546f + f * (0.24022998880f + f * (0.05548260480f + f * (0.00968009536f +
                  f * (0.00124311316f + f * 0.00021720510f)))));
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale * p;
}

// acc [D] += p * row [D]
template <typename T>
inline void axpy(float* acc, float p, const T* row, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += p * widen(row[i]);
}

// In place, per row g of logits [G, N]: exp(l - max), its sum in total[g] (0 for a row with
// nothing to read, which then gives a zero output). Lane-parallel max and sum.
inline void softmax_rows(float* logits, int64_t G, int64_t N, float* total) {
  const float NEG = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    float* l = logits + g * N;
    total[g] = 0.f;
    float lane_max[LANES];
    std::fill(lane_max, lane_max + LANES, NEG);
    int64_t i = 0;
    for (; i + LANES <= N; i += LANES) {
      for (int k = 0; k < LANES; ++k) lane_max[k] = l[i + k] > lane_max[k] ? l[i + k] : lane_max[k];
    }
    float mx = NEG;
    for (int k = 0; k < LANES; ++k) mx = std::max(mx, lane_max[k]);
    for (; i < N; ++i) mx = std::max(mx, l[i]);
    if (mx == NEG) continue;
    float lane_sum[LANES] = {0.f};
    i = 0;
    for (; i + LANES <= N; i += LANES) {
      for (int k = 0; k < LANES; ++k) {
        l[i + k] = exp_nonpos(l[i + k] - mx);
        lane_sum[k] += l[i + k];
      }
    }
    float s = 0.f;
    for (int k = 0; k < LANES; ++k) s += lane_sum[k];
    for (; i < N; ++i) {
      l[i] = exp_nonpos(l[i] - mx);
      s += l[i];
    }
    total[g] = s;
  }
}

// out [G, D] = acc [G, D] / total [G] (zero where total is 0)
inline void normalize_rows(const float* acc, const float* total, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = acc[g * D + i] * inv;
  }
}

// Compact logits, keys in blocks of 16 entries [C / 16, D, 16]: one block at a time, the G rows' partial sums in
// registers over d (GB = G when it is a compile-time constant, else 0 for any G).
template <typename T, int GB>
void compact_logits(const float* qs, const T* kt, int64_t C, int64_t D, int64_t G, float* logits, int64_t N) {
  const int64_t g_n = GB > 0 ? GB : G;
  int64_t c0 = 0;
  for (; c0 + LANES <= C; c0 += LANES) {
    float acc[GB > 0 ? GB : 1][LANES];
    if (GB > 0) {
      for (int g = 0; g < GB; ++g)
        for (int k = 0; k < LANES; ++k) acc[g][k] = 0.f;
      for (int64_t dd = 0; dd < D; ++dd) {
        const T* kr = kt + c0 * D + dd * LANES;  // blocked layout [C / 16, D, 16]
        for (int k = 0; k < LANES; ++k) {
          const float kv = widen(kr[k]);
          for (int g = 0; g < GB; ++g) acc[g][k] += qs[g * D + dd] * kv;
        }
      }
      for (int g = 0; g < GB; ++g)
        for (int k = 0; k < LANES; ++k) logits[g * N + c0 + k] = acc[g][k];
    } else {
      for (int64_t g = 0; g < g_n; ++g) {
        for (int k = 0; k < LANES; ++k) acc[0][k] = 0.f;
        for (int64_t dd = 0; dd < D; ++dd) {
          const T* kr = kt + c0 * D + dd * LANES;
          for (int k = 0; k < LANES; ++k) acc[0][k] += qs[g * D + dd] * widen(kr[k]);
        }
        for (int k = 0; k < LANES; ++k) logits[g * N + c0 + k] = acc[0][k];
      }
    }
  }
}

// acc [G, D] += softmax weights x compact values [C, D] (masked rows skipped); with GB and DB
// compile-time (else 0), the G x D sums stay in registers across the rows.
template <typename T, int GB, int DB>
void compact_values(const float* w, int64_t N, const bool* m, const T* v, int64_t C, int64_t D, int64_t G,
                    float* acc) {
  if (GB > 0 && DB > 0) {
    float a[GB > 0 ? GB : 1][DB > 0 ? DB : 1];
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < DB; ++i) a[g][i] = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      if (!m[c]) continue;
      const T* row = v + c * DB;
      for (int i = 0; i < DB; ++i) {
        const float x = widen(row[i]);
        for (int g = 0; g < GB; ++g) a[g][i] += w[g * N + c] * x;
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < DB; ++i) acc[g * DB + i] += a[g][i];
    return;
  }
  for (int64_t c = 0; c < C; ++c) {
    if (!m[c]) continue;
    for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], w[g * N + c], v + c * D, D);
  }
}

template <typename T, int GB, int DB>
void run(const torch::Tensor& q, const torch::Tensor& ck, const torch::Tensor& cv, const torch::Tensor& cmask,
         const torch::Tensor& wk, const torch::Tensor& wv, const torch::Tensor& wstart, const torch::Tensor& wend,
         double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), C = ck.size(2) * 16;
  const float* qp = q.data_ptr<float>();
  const T* ckp = ck.data_ptr<T>();
  const T* cvp = cv.data_ptr<T>();
  const bool* mp = cmask.data_ptr<bool>();
  const float* wkp = wk.data_ptr<float>();
  const float* wvp = wv.data_ptr<float>();
  const int64_t* ws = wstart.data_ptr<int64_t>();
  const int64_t* we = wend.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t wk_b = wk.stride(0), wk_h = wk.stride(1), wk_r = wk.stride(2);
  const int64_t wv_b = wv.stride(0), wv_h = wv.stride(1), wv_r = wv.stride(2);
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), logits, acc(G * D), total(G);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t w0 = ws[b], w1 = std::max(we[b], w0), W = w1 - w0, N = C + W;
      logits.assign(G * N, NEG);
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qp[bh * G * D + i] * sc;
      const T* kc = ckp + bh * C * D;
      const T* vc = cvp + bh * C * D;
      const bool* m = mp + bh * C;
      const float* kw = wkp + b * wk_b + h * wk_h;
      const float* vw = wvp + b * wv_b + h * wv_h;
      compact_logits<T, GB>(qs.data(), kc, C, D, G, logits.data(), N);
      for (int64_t g = 0; g < G; ++g) {
        float* l = &logits[g * N];
        for (int64_t c = 0; c < C; ++c) l[c] = m[c] ? l[c] : NEG;
      }
      for (int64_t j = 0; j < W; ++j) {
        const float* row = kw + (w0 + j) * wk_r;
        for (int64_t g = 0; g < G; ++g) logits[g * N + C + j] = dot(&qs[g * D], row, D);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax_rows(logits.data(), G, N, total.data());
      compact_values<T, GB, DB>(logits.data(), N, m, vc, C, D, G, acc.data());
      for (int64_t j = 0; j < W; ++j) {
        const float* row = vw + (w0 + j) * wv_r;
        for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], logits[g * N + C + j], row, D);
      }
      normalize_rows(acc.data(), total.data(), G, D, op + bh * G * D);
    }
  });
}

// SFI's fallback heads (policies/sfi/fallback.py): per head, Quest page bounds pick the pages to
// read (upper bound of q.k over a page: sum_d max(q_d m_d, q_d M_d), max over the GQA group), then
// attention over the pages holding the sinks, the `budget / page` best other pages and every entry
// after the bounded pages, read straight from the cache rows (no gathered copy). Heads in parallel.
template <int GB, int DB>
void run_pages(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const int64_t* slots,
               const int64_t* heads, const int64_t* lens, const std::vector<torch::Tensor>& bounds, int64_t budget,
               int64_t page, int64_t sinks, double scale, torch::Tensor& out) {
  const int64_t N = q.size(0), G = GB > 0 ? GB : q.size(1), D = DB > 0 ? DB : q.size(2);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t k_b = k.stride(0), k_h = k.stride(1), k_r = k.stride(2);
  const int64_t v_b = v.stride(0), v_h = v.stride(1), v_r = v.stride(2);
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score, part, logits, acc(G * D), qs(G * D), total(G);
    std::vector<int64_t> order, rows;
    for (int64_t i = begin; i < end; ++i) {
      const float* bp = bounds[i].data_ptr<float>();  // [2D, P]: rows 0..D-1 max, D..2D-1 min
      const int64_t P = bounds[i].size(1), n = lens[i];
      const int64_t first = (std::max<int64_t>(sinks, 1) + page - 1) / page;
      const int64_t take = std::min(std::max(budget / page, first), P);
      for (int64_t x = 0; x < G * D; ++x) qs[x] = qp[i * G * D + x];
      rows.clear();
      if (take >= P) {
        for (int64_t r = 0; r < n; ++r) rows.push_back(r);
      } else {
        score.assign(P, NEG);
        part.resize(P);
        for (int64_t g = 0; g < G; ++g) {
          std::fill(part.begin(), part.end(), 0.f);
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qs[g * D + d];
            axpy(part.data(), qd, bp + (qd >= 0.f ? d : D + d) * P, P);
          }
          for (int64_t p = 0; p < P; ++p) score[p] = part[p] > score[p] ? part[p] : score[p];  // NaN never wins
        }
        for (int64_t p = 0; p < first && p < P; ++p) score[p] = std::numeric_limits<float>::infinity();
        order.resize(P);
        for (int64_t p = 0; p < P; ++p) order[p] = p;
        std::nth_element(order.begin(), order.begin() + take, order.end(),
                         [&](int64_t a, int64_t b) { return score[a] > score[b]; });
        for (int64_t t = 0; t < take; ++t)
          for (int64_t r = 0; r < page; ++r)
            if (order[t] * page + r < n) rows.push_back(order[t] * page + r);
        for (int64_t r = P * page; r < n; ++r) rows.push_back(r);
      }
      const int64_t R = static_cast<int64_t>(rows.size());
      const float* kr = kp + slots[i] * k_b + heads[i] * k_h;
      const float* vr = vp + slots[i] * v_b + heads[i] * v_h;
      logits.assign(G * R, 0.f);
      for (int64_t x = 0; x < G * D; ++x) qs[x] *= sc;
      for (int64_t j = 0; j < R; ++j) {
        const float* row = kr + rows[j] * k_r;
        for (int64_t g = 0; g < G; ++g) logits[g * R + j] = dot(&qs[g * D], row, D);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax_rows(logits.data(), G, R, total.data());
      for (int64_t j = 0; j < R; ++j) {
        const float* row = vr + rows[j] * v_r;
        for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], logits[g * R + j], row, D);
      }
      normalize_rows(acc.data(), total.data(), G, D, op + i * G * D);
    }
  });
}

}  // namespace

// q [B, H, G, D] float32; ck [B, H, C / 16, D, 16] (keys in blocks of 16 entries) and cv [B, H, C, D],
// float32 or bfloat16 (contiguous); cmask [B, H, C]
// bool; wk, wv [B, H, S, D] float32 with contiguous rows (any outer strides: a cache layer);
// wstart, wend [B] int64. Returns [B, H, G, D] float32.
torch::Tensor two_source_decode(torch::Tensor q, torch::Tensor ck, torch::Tensor cv, torch::Tensor cmask,
                                torch::Tensor wk, torch::Tensor wv, torch::Tensor wstart, torch::Tensor wend,
                                double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32, "q must be float32 [B, H, G, D]");
  TORCH_CHECK(ck.scalar_type() == cv.scalar_type(), "ck and cv must share a dtype");
  TORCH_CHECK(wk.scalar_type() == torch::kFloat32 && wv.scalar_type() == torch::kFloat32, "window must be float32");
  TORCH_CHECK(wk.stride(3) == 1 && wv.stride(3) == 1, "window rows must be contiguous");
  TORCH_CHECK(cmask.scalar_type() == torch::kBool, "cmask must be bool");
  TORCH_CHECK(q.device().is_cpu() && ck.device().is_cpu() && wk.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(ck.dim() == 5 && ck.size(4) == 16 && ck.size(3) == q.size(3),
              "ck must be blocked [B, H, C / 16, D, 16]");
  const int64_t B = q.size(0), H = q.size(1), C = ck.size(2) * 16, D = q.size(3);
  TORCH_CHECK(ck.size(0) == B && ck.size(1) == H, "ck must match q's [B, H]");
  TORCH_CHECK(cv.dim() == 4 && cv.size(0) == B && cv.size(1) == H && cv.size(2) == C && cv.size(3) == D,
              "cv must be [B, H, C, D]");
  TORCH_CHECK(cmask.dim() == 3 && cmask.size(0) == B && cmask.size(1) == H && cmask.size(2) == C,
              "cmask must be [B, H, C]");
  TORCH_CHECK(wk.dim() == 4 && wv.dim() == 4 && wk.size(0) == B && wk.size(1) == H && wk.size(3) == D &&
              wv.sizes() == wk.sizes(), "wk, wv must be [B, H, S, D]");
  TORCH_CHECK(wstart.numel() == B && wend.numel() == B, "wstart, wend must have B entries");
  TORCH_CHECK(wstart.min().item<int64_t>() >= 0 && wend.max().item<int64_t>() <= wk.size(2),
              "window rows outside the cache");
  q = q.contiguous();
  ck = ck.contiguous();
  cv = cv.contiguous();
  cmask = cmask.contiguous();
  wstart = wstart.to(torch::kInt64).contiguous();
  wend = wend.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  TORCH_CHECK(ck.scalar_type() == torch::kFloat32 || ck.scalar_type() == torch::kBFloat16,
              "compact buffers must be float32 or bfloat16");
  const bool bf16 = ck.scalar_type() == torch::kBFloat16;
  const int64_t g = q.size(2), d = q.size(3);
  // compile-time group sizes and head dims for common shapes; any other shape takes the generic
  // loops (same results)
#define COTSERVE_RUN(GB, DB)                                                               \
  (bf16 ? run<c10::BFloat16, GB, DB>(q, ck, cv, cmask, wk, wv, wstart, wend, scale, out) \
        : run<float, GB, DB>(q, ck, cv, cmask, wk, wv, wstart, wend, scale, out))
  if (g == 3 && d == 64) COTSERVE_RUN(3, 64);
  else if (g == 4 && d == 64) COTSERVE_RUN(4, 64);
  else if (g == 2 && d == 128) COTSERVE_RUN(2, 128);
  else if (g == 4 && d == 128) COTSERVE_RUN(4, 128);
  else if (g == 8 && d == 128) COTSERVE_RUN(8, 128);
  else COTSERVE_RUN(0, 0);
#undef COTSERVE_RUN
  return out;
}

// q [N, G, D] float32 (the query groups of N fallback heads); k, v [B, H, S, D] float32 (one cache
// layer, contiguous rows); slots, heads, lens [N] int64; bounds: N tensors [2D, P_i] float32
// (`fallback.page_bounds`). Returns [N, G, D] float32.
torch::Tensor page_bound_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                                torch::Tensor heads, torch::Tensor lens, std::vector<torch::Tensor> bounds,
                                int64_t budget, int64_t page, int64_t sinks, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be float32 [N, G, D]");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32, "k, v must be float32");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(static_cast<int64_t>(bounds.size()) == q.size(0), "one bounds tensor per head");
  TORCH_CHECK(page >= 1, "page must be >= 1");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(3) == q.size(2), "k, v must be [B, H, S, D]");
  TORCH_CHECK(slots.numel() == q.size(0) && heads.numel() == q.size(0) && lens.numel() == q.size(0),
              "slots, heads, lens must have N entries");
  if (q.size(0) > 0) {
    TORCH_CHECK(slots.min().item<int64_t>() >= 0 && slots.max().item<int64_t>() < k.size(0) &&
                heads.min().item<int64_t>() >= 0 && heads.max().item<int64_t>() < k.size(1) &&
                lens.min().item<int64_t>() >= 0 && lens.max().item<int64_t>() <= k.size(2),
                "slots, heads or lens outside the cache");
  }
  for (auto& b : bounds) {
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.dim() == 2 && b.size(0) == 2 * q.size(2),
                "bounds must be float32 [2D, P]");
    TORCH_CHECK(b.size(1) * page <= k.size(2), "bounded pages beyond the cache");
    b = b.contiguous();
  }
  q = q.contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  heads = heads.to(torch::kInt64).contiguous();
  lens = lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* hp = heads.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  if (q.size(1) == 3 && q.size(2) == 64)
    run_pages<3, 64>(q, k, v, sp, hp, lp, bounds, budget, page, sinks, scale, out);
  else
    run_pages<0, 0>(q, k, v, sp, hp, lp, bounds, budget, page, sinks, scale, out);
  return out;
}

// Dense decode for B sequences that each own a cache: kc[b], vc[b] [L, 1, H, S_b, D] float32 (a
// `KVCache` of one slot; any capacity S_b, contiguous rows). For every (b, h): write knew[b, h] /
// vnew[b, h] [D] at row lens[b] of layer `layer`, then attend the G query heads q[b, h] over rows
// 0 .. lens[b] (the new one included). The window arithmetic of two_source_decode with no compact
// entries, in the same order, so the results equal it bit for bit. Returns [B, H, G, D] float32.
torch::Tensor ragged_decode(torch::Tensor q, torch::Tensor knew, torch::Tensor vnew, std::vector<torch::Tensor> kc,
                            std::vector<torch::Tensor> vc, int64_t layer, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu(),
              "q must be float32 [B, H, G, D] on the CPU");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(knew.dim() == 3 && knew.size(0) == B && knew.size(1) == H && knew.size(2) == D &&
              knew.sizes() == vnew.sizes() && knew.scalar_type() == torch::kFloat32 &&
              vnew.scalar_type() == torch::kFloat32, "knew, vnew must be float32 [B, H, D]");
  TORCH_CHECK(static_cast<int64_t>(kc.size()) == B && static_cast<int64_t>(vc.size()) == B,
              "one key and one value cache per sequence");
  TORCH_CHECK(lens.numel() == B, "lens must have B entries");
  lens = lens.to(torch::kInt64).contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<float*> kp(B), vp(B);
  std::vector<int64_t> kh(B), kr(B), vh(B), vr(B);
  for (int64_t b = 0; b < B; ++b) {
    const auto& k = kc[b];
    const auto& v = vc[b];
    TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.size(1) == 1 && k.size(2) == H && k.size(4) == D,
                "caches must be [L, 1, H, S, D] with q's H and D");
    TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && k.device().is_cpu() &&
                v.device().is_cpu(), "caches must be float32 on the CPU");
    TORCH_CHECK(k.stride(4) == 1 && v.stride(4) == 1, "cache rows must be contiguous");
    TORCH_CHECK(layer >= 0 && layer < k.size(0), "layer outside the cache");
    TORCH_CHECK(lp[b] >= 0 && lp[b] < k.size(3), "KV cache full: capacity planning is wrong");
    kp[b] = k.data_ptr<float>() + layer * k.stride(0);
    vp[b] = v.data_ptr<float>() + layer * v.stride(0);
    kh[b] = k.stride(2);
    kr[b] = k.stride(3);
    vh[b] = v.stride(2);
    vr[b] = v.stride(3);
  }
  q = q.contiguous();
  knew = knew.contiguous();
  vnew = vnew.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* knp = knew.data_ptr<float>();
  const float* vnp = vnew.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), logits, acc(G * D), total(G);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, N = lp[b] + 1;
      float* kw = kp[b] + h * kh[b];
      float* vw = vp[b] + h * vh[b];
      std::memcpy(kw + lp[b] * kr[b], knp + bh * D, D * sizeof(float));
      std::memcpy(vw + lp[b] * vr[b], vnp + bh * D, D * sizeof(float));
      logits.assign(G * N, NEG);
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qp[bh * G * D + i] * sc;
      for (int64_t j = 0; j < N; ++j) {
        const float* row = kw + j * kr[b];
        for (int64_t g = 0; g < G; ++g) logits[g * N + j] = dot(&qs[g * D], row, D);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax_rows(logits.data(), G, N, total.data());
      for (int64_t j = 0; j < N; ++j) {
        const float* row = vw + j * vr[b];
        for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], logits[g * N + j], row, D);
      }
      normalize_rows(acc.data(), total.data(), G, D, op + bh * G * D);
    }
  });
  return out;
}

// SFI's re-pack for one slot: for each of the nl layers `layers[i]` and each KV head h, the cache
// rows keys[i, h, 0 .. m-1] of k / v [L, B, H, S, D] (float32, slot b) into the compact buffers:
// keys in blocks of 16 entries ckt [L, B, H, C / 16, D, 16], values cv [L, B, H, C, D] (float32 or
// bfloat16, converted like torch's `.to`, round to nearest even). Key entries m .. C-1 repeat row
// keys[i, h, 0] (the caller masks them); value entries past m are left as they are. (layer, head)
// pairs in parallel; one read of each chosen row.
template <typename T>
void pack_rows(const torch::Tensor& k, const torch::Tensor& v, int64_t b, const torch::Tensor& keys,
               const torch::Tensor& layers, torch::Tensor& ckt, torch::Tensor& cv) {
  const int64_t nl = keys.size(0), H = keys.size(1), m = keys.size(2), D = k.size(4);
  const int64_t C = ckt.size(3) * 16;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* ky = keys.data_ptr<int64_t>();
  const int64_t* ly = layers.data_ptr<int64_t>();
  T* ct = ckt.data_ptr<T>();
  T* vt = cv.data_ptr<T>();
  at::parallel_for(0, nl * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ih = begin; ih < end; ++ih) {
      const int64_t i = ih / H, h = ih % H, l = ly[i];
      const float* krow0 = kp + l * k.stride(0) + b * k.stride(1) + h * k.stride(2);
      const float* vrow0 = vp + l * v.stride(0) + b * v.stride(1) + h * v.stride(2);
      const int64_t* kk = ky + ih * m;
      T* cth = ct + l * ckt.stride(0) + b * ckt.stride(1) + h * ckt.stride(2);
      T* cvh = vt + l * cv.stride(0) + b * cv.stride(1) + h * cv.stride(2);
      for (int64_t c = 0; c < C; ++c) {
        const int64_t row = kk[c < m ? c : 0];
        const float* kr = krow0 + row * k.stride(3);
        T* blk = cth + (c / 16) * D * 16 + (c % 16);
        for (int64_t d = 0; d < D; ++d) blk[d * 16] = static_cast<T>(kr[d]);
        if (c < m) {
          const float* vr = vrow0 + row * v.stride(3);
          T* out = cvh + c * D;
          for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(vr[d]);
        }
      }
    }
  });
}

void pack_compact(torch::Tensor k, torch::Tensor v, int64_t b, torch::Tensor keys, torch::Tensor layers,
                  torch::Tensor ckt, torch::Tensor cv) {
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32 && k.stride(4) == 1 && v.stride(4) == 1,
              "k, v must be float32 [L, B, H, S, D] with contiguous rows");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == torch::kInt64 && keys.size(1) == k.size(2),
              "keys must be int64 [nl, H, m]");
  TORCH_CHECK(layers.dim() == 1 && layers.size(0) == keys.size(0) && layers.scalar_type() == torch::kInt64,
              "layers must be int64 [nl]");
  TORCH_CHECK(ckt.dim() == 6 && ckt.size(5) == 16 && ckt.size(4) == k.size(4) && ckt.is_contiguous() &&
              cv.is_contiguous() && cv.dim() == 5 && cv.size(3) == ckt.size(3) * 16 && cv.size(4) == k.size(4) &&
              ckt.scalar_type() == cv.scalar_type(), "ckt [L, B, H, C / 16, D, 16] and cv [L, B, H, C, D], contiguous");
  TORCH_CHECK(b >= 0 && b < k.size(1) && keys.size(2) >= 1 && keys.size(2) <= cv.size(3), "slot or entry count out of range");
  keys = keys.contiguous();
  layers = layers.contiguous();
  if (keys.numel() > 0) {
    TORCH_CHECK(keys.min().item<int64_t>() >= 0 && keys.max().item<int64_t>() < k.size(3), "rows outside the cache");
    TORCH_CHECK(layers.min().item<int64_t>() >= 0 && layers.max().item<int64_t>() < k.size(0), "layer outside the cache");
  }
  if (ckt.scalar_type() == torch::kBFloat16)
    pack_rows<c10::BFloat16>(k, v, b, keys, layers, ckt, cv);
  else {
    TORCH_CHECK(ckt.scalar_type() == torch::kFloat32, "compact buffers must be float32 or bfloat16");
    pack_rows<float>(k, v, b, keys, layers, ckt, cv);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("two_source_decode", &two_source_decode, "SFI fast-step attention: compact buffer + recent window",
        py::call_guard<py::gil_scoped_release>());
  m.def("page_bound_decode", &page_bound_decode, "SFI fallback heads: Quest page-bound reads, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_compact", &pack_compact, "SFI's re-pack: chosen cache rows into the blocked compact buffers",
        py::call_guard<py::gil_scoped_release>());
  m.def("ragged_decode", &ragged_decode, "Dense decode over many one-slot caches: write the new row, attend",
        py::call_guard<py::gil_scoped_release>());
}
