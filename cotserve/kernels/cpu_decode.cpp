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

#include <atomic>
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

// log(x) for x > 0 finite (x = 0 gives a large negative number, never used: callers clamp to
// 1e-30 first): x = 2^e m, m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1),
// |s| <= 0.172, by its odd series to s^13 (truncation 4e-12 relative). Plain arithmetic, so the
// loops calling it vectorize (std::log does not).
inline float log_pos(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  uint32_t mb = (bits & 0x007fffffu) | 0x3f800000u;  // m in [1, 2)
  float m;
  std::memcpy(&m, &mb, sizeof(m));
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const float s = (m - 1.f) / (m + 1.f), s2 = s * s;
  const float p = 2.f + s2 * (0.66666667f + s2 * (0.4f + s2 * (0.28571429f + s2 * (0.22222222f +
                  s2 * (0.18181818f + s2 * 0.15384615f)))));
  return static_cast<float>(e) * 0.69314718056f + s * p;
}

constexpr float SEL_TINY = 1e-30f;
constexpr float SEL_NEG = -1e30f;  // "no candidate" in the running maxima (finite, like the fused GPU selector)

struct SelectOpts {
  int64_t now, sinks, tail, nms_window, k;
  float decay, brake, norm_power, lam_fixed, lam_clip, nms_strength, excl_strength, excl_temp;
};

// Sum and max of x [n], lane-parallel (vectorized without reassociation flags); max of nothing: -inf.
inline float lane_sum(const float* x, int64_t n) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += x[i + l];
  float s = 0.f;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s += x[i];
  return s;
}

inline float lane_max(const float* x, int64_t n) {
  const float NEG = -std::numeric_limits<float>::infinity();
  float acc[LANES];
  std::fill(acc, acc + LANES, NEG);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  float m = NEG;
  for (int l = 0; l < LANES; ++l) m = acc[l] > m ? acc[l] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
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

// SFI's slow step fused into the decode call: slots with slow[b] read no compact entries and the
// whole cache as their window (rows 0 .. wend[b] - 1: dense attention), and, from the same logits
// (the current query is the selector's one observation row, obs_window = 1), write the evidence
// f [n] of each KV head (`selector.evidence_and_instability`, alpha > 0): per query row of the
// group the softmax over the candidates (entries from `sinks` on), combined by the power mean
// M_alpha over the rows, normalized; 0 on the sinks.
struct EvidenceArgs {
  const bool* slow;  // [B]
  float* f;  // f[b * f_b + h * f_h + j]
  int64_t f_b, f_h, sinks;
  float alpha;
};

// logits [G, N] rows (window part at offset c0, W entries, -inf nowhere), e [G, W] scratch.
inline void evidence_rows(const float* logits, int64_t G, int64_t N, int64_t c0, int64_t W, const EvidenceArgs& ev,
                          float* e, float* fu, float* f) {
  const int64_t s0 = std::min(ev.sinks, W), c = W - s0;
  const float a = ev.alpha;
  std::fill(fu, fu + W, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    const float* x = logits + g * N + c0;
    float* eg = e + g * W;
    const float m = lane_max(x + s0, c);
    if (!(m > -std::numeric_limits<float>::infinity())) continue;  // no candidate: the row counts zero
    for (int64_t j = s0; j < W; ++j) eg[j] = exp_nonpos((x[j] - m) * a);
    float z;  // sum over the candidates of exp(l - m), from e as the torch form takes it
    if (a == 0.5f) {
      float acc[LANES] = {0.f};
      int64_t j = s0;
      for (; j + LANES <= W; j += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += eg[j + l] * eg[j + l];
      z = 0.f;
      for (int l = 0; l < LANES; ++l) z += acc[l];
      for (; j < W; ++j) z += eg[j] * eg[j];
    } else if (a == 1.f) {
      z = lane_sum(eg + s0, c);
    } else {
      float acc = 0.f;
      for (int64_t j = s0; j < W; ++j) acc += exp_nonpos(x[j] - m);
      z = acc;
    }
    const float w = z > 0.f ? std::pow(std::max(z, SEL_TINY), -a) / static_cast<float>(G) : 0.f;
    for (int64_t j = s0; j < W; ++j) fu[j] += w * eg[j];
  }
  const float inv = 1.f / a;
  for (int64_t j = s0; j < W; ++j) {
    const float v = std::max(fu[j], 0.f);
    fu[j] = a == 0.5f ? v * v : (a == 1.f ? v : (v > 0.f ? exp_nonpos(log_pos(v) * inv) : 0.f));
  }
  const float tot = std::max(lane_sum(fu + s0, c), SEL_TINY);
  for (int64_t j = 0; j < s0; ++j) f[j] = 0.f;
  for (int64_t j = s0; j < W; ++j) f[j] = fu[j] / tot;
}

template <typename T, int GB, int DB>
void run(const torch::Tensor& q, const torch::Tensor& ck, const torch::Tensor& cv, const torch::Tensor& cmask,
         const torch::Tensor& wk, const torch::Tensor& wv, const torch::Tensor& wstart, const torch::Tensor& wend,
         double scale, torch::Tensor& out, const EvidenceArgs* ev = nullptr) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), C0 = ck.size(2) * 16;
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

  struct Scratch {
    std::vector<float> qs, logits, acc, total, e, fu;
  };
  auto one = [&](int64_t bh, Scratch& sc_) {
    std::vector<float>& qs = sc_.qs;
    std::vector<float>& logits = sc_.logits;
    std::vector<float>& acc = sc_.acc;
    std::vector<float>& total = sc_.total;
    std::vector<float>& e = sc_.e;
    std::vector<float>& fu = sc_.fu;
    const int64_t b = bh / H, h = bh % H;
    const bool slow = ev != nullptr && ev->slow[b];  // dense: no compact entries, the whole cache
    const int64_t C = slow ? 0 : C0;
    const int64_t w0 = slow ? 0 : ws[b], w1 = std::max(we[b], w0), W = w1 - w0, N = C + W;
    logits.assign(G * N, NEG);
    for (int64_t i = 0; i < G * D; ++i) qs[i] = qp[bh * G * D + i] * sc;
    const T* kc = ckp + bh * C0 * D;
    const T* vc = cvp + bh * C0 * D;
    const bool* m = mp + bh * C0;
    const float* kw = wkp + b * wk_b + h * wk_h;
    const float* vw = wvp + b * wv_b + h * wv_h;
    if (C > 0) {
      compact_logits<T, GB>(qs.data(), kc, C, D, G, logits.data(), N);
      for (int64_t g = 0; g < G; ++g) {
        float* l = &logits[g * N];
        for (int64_t c = 0; c < C; ++c) l[c] = m[c] ? l[c] : NEG;
      }
    }
    for (int64_t j = 0; j < W; ++j) {
      const float* row = kw + (w0 + j) * wk_r;
      for (int64_t g = 0; g < G; ++g) logits[g * N + C + j] = dot(&qs[g * D], row, D);
    }
    if (slow) {
      e.resize(G * W);
      fu.resize(W);
      evidence_rows(logits.data(), G, N, C, W, *ev, e.data(), fu.data(), ev->f + b * ev->f_b + h * ev->f_h);
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    softmax_rows(logits.data(), G, N, total.data());
    if (C > 0) compact_values<T, GB, DB>(logits.data(), N, m, vc, C, D, G, acc.data());
    for (int64_t j = 0; j < W; ++j) {
      const float* row = vw + (w0 + j) * wv_r;
      for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], logits[g * N + C + j], row, D);
    }
    normalize_rows(acc.data(), total.data(), G, D, op + bh * G * D);
  };
  auto scratch = [&]() { return Scratch{std::vector<float>(G * D), {}, std::vector<float>(G * D), std::vector<float>(G), {}, {}}; };
  if (ev == nullptr) {
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      Scratch s_ = scratch();
      for (int64_t bh = begin; bh < end; ++bh) one(bh, s_);
    });
    return;
  }
  // with slow slots the (slot, head) pairs cost unequal amounts (a slow one reads the whole cache):
  // the slow ones first, each thread taking the next pair when it is free (a static split would
  // leave one thread with the slow pairs)
  std::vector<int64_t> order;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t bh = 0; bh < B * H; ++bh)
      if (ev->slow[bh / H] == (pass == 0)) order.push_back(bh);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch s_ = scratch();
    for (int64_t i = next++; i < B * H; i = next++) one(order[i], s_);
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

// Soft-NMS of one row (`selector.soft_nms`): xp [-w, n + w) the clamped row with its padding, u
// the row -> out = u - penalty, the penalty strength * (1 - d / (w + 1)) by the distance d to the
// nearest entry holding the +-w neighbourhood's maximum (0 for an entry holding it). W = w when
// it is a compile-time constant (else 0, w given).
template <int W>
void soft_nms_row(const float* xp, const float* u, int64_t n, float strength, float* out, int64_t w_rt = 0) {
  const int64_t w = W > 0 ? W : w_rt;
  float pens[65];
  for (int64_t d = 1; d <= w; ++d)
    pens[d] = static_cast<float>(static_cast<double>(strength) * (1.0 - static_cast<double>(d) / static_cast<double>(w + 1)));
  for (int64_t i = 0; i < n; ++i) {
    float mx = xp[i - w];
    for (int64_t j = -w + 1; j <= w; ++j) mx = std::max(mx, xp[i + j]);
    float pen = 0.f;
    for (int64_t d = w; d >= 1; --d) pen = ((xp[i - d] == mx) | (xp[i + d] == mx)) ? pens[d] : pen;
    pen = xp[i] == mx ? 0.f : pen;
    out[i] = u[i] - pen;
  }
}

// Selector steps 2-4 for one layer (H rows of n entries): f [H, n] evidence, pos [H, n] true
// positions, kn [H, n] key norms -> out [H, n] final log scores (-inf outside the candidates,
// entries sinks .. n-1). Same formulas, in the same order, as `selector.selector_scores_from_evidence`
// (position and key-norm priors, their softmax r, lambda*, geometric fusion, its log-softmax,
// soft-NMS, cross-head exclusivity); rows stay in cache across the passes. Scratch r, u [H, n],
// pad [n + 2 nms_window]. f_h, pos_h, kn_h: the row strides of f, pos and kn.
void selector_layer(const float* f, int64_t f_h, const int64_t* pos, int64_t pos_h, const float* kn, int64_t kn_h, int64_t H, int64_t n,
                    const SelectOpts& o, float* r, float* u, float* pad, float* out) {
  const float INF = std::numeric_limits<float>::infinity();
  const float LOWEST = std::numeric_limits<float>::lowest();
  const int64_t s0 = std::min(o.sinks, n);
  const float nowf = static_cast<float>(o.now);
  const float now1 = std::max(nowf, 1.f);
  const bool use_tail = o.tail > 0 && o.brake < 1.f;
  const bool use_norm = o.norm_power != 0.f;
  const float tailf = static_cast<float>(o.tail);
  for (int64_t h = 0; h < H; ++h) {
    const float* fh = f + h * f_h;
    const int64_t* ph = pos + h * pos_h;
    const float* nh = kn + h * kn_h;
    float* rh = r + h * n;
    float* uh = u + h * n;
    float* oh = out + h * n;  // scratch until the soft-NMS writes it
    const int64_t c = n - s0;  // candidates: entries s0 .. n-1
    // key-norm mean over the candidates
    float nmean = 1.f;
    if (use_norm) {
      for (int64_t i = s0; i < n; ++i) oh[i] = std::max(nh[i], SEL_TINY);
      nmean = std::max(lane_sum(oh + s0, c) / std::max(static_cast<float>(c), 1.f), SEL_TINY);
    }
    // prior log-factors t (in rh) and their max; the distances d in uh (one branch-free loop per
    // factor, so each vectorizes)
    for (int64_t i = s0; i < n; ++i) {
      const float d = std::max(nowf - static_cast<float>(ph[i]), 0.f);
      uh[i] = d;
      rh[i] = -o.decay * d / now1;
    }
    if (use_tail) {
      const float b1 = 1.f - o.brake;
      for (int64_t i = s0; i < n; ++i) {
        const float ramp = o.brake + b1 * std::min(uh[i] / tailf, 1.f);
        rh[i] = rh[i] + log_pos(std::max(ramp, SEL_TINY));
      }
    }
    if (use_norm)
      for (int64_t i = s0; i < n; ++i) rh[i] = rh[i] + (-o.norm_power * log_pos(oh[i] / nmean));
    const float tmax = lane_max(rh + s0, c);
    // r = softmax(t) over the candidates
    for (int64_t i = s0; i < n; ++i) rh[i] = exp_nonpos(rh[i] - tmax);
    const float tsum = lane_sum(rh + s0, c);
    const float tinv = tsum > 0.f ? 1.f / tsum : 0.f;
    for (int64_t i = 0; i < s0; ++i) rh[i] = 0.f;
    for (int64_t i = 0; i < n; ++i) rh[i] = rh[i] * tinv;
    // lambda* = <f, f - r> / ||f - r||^2 (over every entry, as the torch form), clipped
    float lam = o.lam_fixed;
    if (lam < 0.f) {
      float an[LANES] = {0.f}, ad[LANES] = {0.f};
      int64_t i = 0;
      for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; ++l) {
          const float diff = fh[i + l] - rh[i + l];
          an[l] += fh[i + l] * diff;
          ad[l] += diff * diff;
        }
      float num = 0.f, den = 0.f;
      for (int l = 0; l < LANES; ++l) {
        num += an[l];
        den += ad[l];
      }
      for (; i < n; ++i) {
        const float diff = fh[i] - rh[i];
        num += fh[i] * diff;
        den += diff * diff;
      }
      lam = den > 0.f ? num / std::max(den, SEL_TINY) : 0.f;
      lam = std::min(std::max(lam, 0.f), o.lam_clip);
    }
    // geometric fusion u = (log f + lam log r) / (1 + lam), then its log-softmax
    const float inv1 = 1.f / (1.f + lam);
    for (int64_t i = s0; i < n; ++i)
      uh[i] = (log_pos(std::max(fh[i], SEL_TINY)) + lam * log_pos(std::max(rh[i], SEL_TINY))) * inv1;
    const float umax = lane_max(uh + s0, c);
    for (int64_t i = s0; i < n; ++i) oh[i] = exp_nonpos(uh[i] - umax);
    const float lse = umax + log_pos(std::max(lane_sum(oh + s0, c), SEL_TINY));
    for (int64_t i = 0; i < s0; ++i) uh[i] = -INF;
    for (int64_t i = s0; i < n; ++i) uh[i] = uh[i] - lse;
    // soft-NMS within the row: penalty by the distance to the nearest holder of the +-w maximum
    const int64_t w = o.nms_strength != 0.f ? o.nms_window : 0;
    if (w == 0) {
      std::memcpy(oh, uh, n * sizeof(float));
    } else {
      float* xp = pad + w;  // the row clamped to the lowest finite float, padded with it on both sides
      for (int64_t j = 0; j < w; ++j) xp[-1 - j] = xp[n + j] = LOWEST;
      for (int64_t i = 0; i < n; ++i) xp[i] = std::max(uh[i], LOWEST);
      if (w == 2)
        soft_nms_row<2>(xp, uh, n, o.nms_strength, oh);
      else if (w == 1)
        soft_nms_row<1>(xp, uh, n, o.nms_strength, oh);
      else if (w == 3)
        soft_nms_row<3>(xp, uh, n, o.nms_strength, oh);
      else
        soft_nms_row<0>(xp, uh, n, o.nms_strength, oh, w);
    }
  }
  // cross-head exclusivity: rel_h = w_h / max_h' w_h' = exp(x_h / T - max_h' x_h' / T)
  if (o.excl_strength != 0.f && H >= 2) {
    const float invt = 1.f / o.excl_temp;
    float* mx = u;  // free again: the per-entry maximum over the heads
    for (int64_t i = 0; i < n; ++i) mx[i] = -INF;
    for (int64_t h = 0; h < H; ++h) {
      const float* oh = out + h * n;
      for (int64_t i = 0; i < n; ++i) mx[i] = std::max(mx[i], std::max(oh[i], SEL_NEG) * invt);
    }
    for (int64_t h = 0; h < H; ++h) {
      float* oh = out + h * n;
      for (int64_t i = 0; i < n; ++i) {
        const float rel = exp_nonpos(std::max(oh[i], SEL_NEG) * invt - mx[i]);
        oh[i] = oh[i] - o.excl_strength * (1.f - rel);
      }
    }
  }
}

// The k best entries of a row of scores [n] (larger first; of equal scores the lower index),
// written ascending into idx [k]: a radix select of the k-th largest score on order-preserving
// integer keys (11 + 11 + 10 bits: three histogram passes), then one scan. key [n] is scratch.
inline uint32_t order_key(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

void topk_ascending(const float* sc, int64_t n, int64_t k, uint32_t* key, int64_t* idx) {
  if (k <= 0) return;
  for (int64_t i = 0; i < n; ++i) key[i] = order_key(sc[i]);
  uint32_t prefix = 0, pmask = 0;  // the bits of the k-th largest key found so far
  int64_t need = k;  // how many of the keys matching the prefix are still to take
  const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
  int32_t hist[2048];
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = shifts[pass], nb = 1 << widths[pass];
    std::fill(hist, hist + nb, 0);
    for (int64_t i = 0; i < n; ++i)
      if ((key[i] & pmask) == prefix) ++hist[(key[i] >> sh) & (nb - 1)];
    int bin = nb - 1;
    for (; bin > 0 && hist[bin] < need; --bin) need -= hist[bin];
    prefix |= static_cast<uint32_t>(bin) << sh;
    pmask |= static_cast<uint32_t>(nb - 1) << sh;
  }
  // keys above the threshold, and the first `need` equal to it
  const uint32_t thr = prefix;
  int64_t j = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (key[i] > thr) {
      idx[j++] = i;
    } else if (key[i] == thr && need > 0) {
      idx[j++] = i;
      --need;
    }
  }
}

}  // namespace

// q [B, H, G, D] float32; ck [B, H, C / 16, D, 16] (keys in blocks of 16 entries) and cv [B, H, C, D],
// float32 or bfloat16 (contiguous); cmask [B, H, C]
// bool; wk, wv [B, H, S, D] float32 with contiguous rows (any outer strides: a cache layer);
// wstart, wend [B] int64. Returns [B, H, G, D] float32.
namespace {
torch::Tensor two_source_impl(torch::Tensor q, torch::Tensor ck, torch::Tensor cv, torch::Tensor cmask,
                              torch::Tensor wk, torch::Tensor wv, torch::Tensor wstart, torch::Tensor wend,
                              double scale, const EvidenceArgs* ev) {
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
  (bf16 ? run<c10::BFloat16, GB, DB>(q, ck, cv, cmask, wk, wv, wstart, wend, scale, out, ev) \
        : run<float, GB, DB>(q, ck, cv, cmask, wk, wv, wstart, wend, scale, out, ev))
  if (g == 3 && d == 64) COTSERVE_RUN(3, 64);
  else if (g == 4 && d == 64) COTSERVE_RUN(4, 64);
  else if (g == 2 && d == 128) COTSERVE_RUN(2, 128);
  else if (g == 4 && d == 128) COTSERVE_RUN(4, 128);
  else if (g == 8 && d == 128) COTSERVE_RUN(8, 128);
  else COTSERVE_RUN(0, 0);
#undef COTSERVE_RUN
  return out;
}
}  // namespace

torch::Tensor two_source_decode(torch::Tensor q, torch::Tensor ck, torch::Tensor cv, torch::Tensor cmask,
                                torch::Tensor wk, torch::Tensor wv, torch::Tensor wstart, torch::Tensor wend,
                                double scale) {
  return two_source_impl(q, ck, cv, cmask, wk, wv, wstart, wend, scale, nullptr);
}

// two_source_decode with SFI's slow step fused in (EvidenceArgs): slots with slow[b] take dense
// attention over rows 0 .. wend[b] - 1 of the window cache (their compact entries and wstart
// unread) and write their evidence into f[b, h, 0 .. wend[b] - 1] (f [B, H, S] float32, rows
// contiguous; other slots' rows untouched). One read of the keys serves both.
torch::Tensor two_source_decode_evidence(torch::Tensor q, torch::Tensor ck, torch::Tensor cv, torch::Tensor cmask,
                                         torch::Tensor wk, torch::Tensor wv, torch::Tensor wstart, torch::Tensor wend,
                                         double scale, torch::Tensor slow, torch::Tensor f, int64_t sinks,
                                         double alpha) {
  TORCH_CHECK(slow.dim() == 1 && slow.size(0) == q.size(0) && slow.scalar_type() == torch::kBool,
              "slow must be bool [B]");
  TORCH_CHECK(f.dim() == 3 && f.size(0) == q.size(0) && f.size(1) == q.size(1) && f.size(2) >= wend.max().item<int64_t>() &&
              f.scalar_type() == torch::kFloat32 && f.stride(2) == 1, "f must be float32 [B, H, >= wend] with contiguous rows");
  TORCH_CHECK(alpha > 0 && sinks >= 0, "the fused evidence needs alpha > 0");
  slow = slow.contiguous();
  const EvidenceArgs ev{slow.data_ptr<bool>(), f.data_ptr<float>(), f.stride(0), f.stride(1), sinks,
                        static_cast<float>(alpha)};
  return two_source_impl(q, ck, cv, cmask, wk, wv, wstart, wend, scale, &ev);
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

// float32 -> T as torch's `.to` converts: bfloat16 by round to nearest even, NaN to 0x7FC0 (c10's
// rule, written branch-free so the row loops vectorize).
template <typename T>
inline T narrow(float x) { return x; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : r), c10::BFloat16::from_bits());
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
        for (int64_t d = 0; d < D; ++d) blk[d * 16] = narrow<T>(kr[d]);
        if (c < m) {
          const float* vr = vrow0 + row * v.stride(3);
          T* out = cvh + c * D;
          for (int64_t d = 0; d < D; ++d) out[d] = narrow<T>(vr[d]);
        }
      }
    }
  });
}

// The argument checks pack_compact and pack_compact_update share.
static void check_pack_args(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& keys,
                            const torch::Tensor& layers, const torch::Tensor& ckt, const torch::Tensor& cv) {
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
}

void pack_compact(torch::Tensor k, torch::Tensor v, int64_t b, torch::Tensor keys, torch::Tensor layers,
                  torch::Tensor ckt, torch::Tensor cv) {
  check_pack_args(k, v, keys, layers, ckt, cv);
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

namespace {
SelectOpts select_opts(int64_t now, int64_t k, int64_t sinks, double decay, int64_t tail, double brake,
                       double norm_power, double lam, double lam_clip, int64_t nms_window, double nms_strength,
                       double excl_strength, double excl_temperature) {
  TORCH_CHECK(excl_temperature > 0 && nms_window >= 0 && nms_window <= 64 && sinks >= 0,
              "selector options out of range");
  return SelectOpts{now, sinks, tail, nms_window, k, static_cast<float>(decay), static_cast<float>(brake),
                    static_cast<float>(norm_power), static_cast<float>(lam), static_cast<float>(lam_clip),
                    static_cast<float>(nms_strength), static_cast<float>(excl_strength),
                    static_cast<float>(excl_temperature)};
}

void check_selector_inputs(const torch::Tensor& f, const torch::Tensor& pos, const torch::Tensor& kn) {
  TORCH_CHECK(f.dim() == 3 && f.scalar_type() == torch::kFloat32 && f.stride(2) == 1 && f.device().is_cpu(),
              "f must be float32 [P, H, n] with contiguous rows, on the CPU");
  TORCH_CHECK(kn.sizes() == f.sizes() && kn.scalar_type() == torch::kFloat32 && kn.stride(2) == 1,
              "key norms must be float32 [P, H, n] with contiguous rows");
  TORCH_CHECK(pos.dim() == 3 && pos.size(0) == f.size(0) && pos.size(1) == f.size(1) && pos.size(2) == f.size(2) &&
              pos.scalar_type() == torch::kInt64 && pos.stride(2) == 1,
              "positions must be int64 [P, H, n] with contiguous rows");
}
}  // namespace

// SFI's selector steps 2-4 (`selector.selector_scores_from_evidence`, geometric fusion): the final
// log scores [P, H, n] float32 of P independent problems (the layers of a refreshing sequence).
torch::Tensor selector_scores(torch::Tensor f, torch::Tensor pos, torch::Tensor kn, int64_t now, int64_t sinks,
                              double decay, int64_t tail, double brake, double norm_power, double lam, double lam_clip,
                              int64_t nms_window, double nms_strength, double excl_strength, double excl_temperature) {
  check_selector_inputs(f, pos, kn);
  const SelectOpts o = select_opts(now, 0, sinks, decay, tail, brake, norm_power, lam, lam_clip, nms_window,
                                   nms_strength, excl_strength, excl_temperature);
  const int64_t P = f.size(0), H = f.size(1), n = f.size(2);
  auto out = torch::empty_like(f);
  const float* fp = f.data_ptr<float>();
  const float* np = kn.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> r(H * n), u(H * n), pad(n + 2 * o.nms_window);
    for (int64_t p = begin; p < end; ++p)
      selector_layer(fp + p * f.stride(0), f.stride(1), pp + p * pos.stride(0), pos.stride(1), np + p * kn.stride(0), kn.stride(1), H, n, o, r.data(),
                     u.data(), pad.data(), op + p * H * n);
  });
  return out;
}

// Top-k per row of scores [..., n] (float32, contiguous), indices ascending [..., k] int64; of
// equal scores the lower index is kept.
torch::Tensor topk_ascending_rows(torch::Tensor scores, int64_t k) {
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32 && scores.is_contiguous() && scores.dim() >= 1,
              "scores must be contiguous float32");
  const int64_t n = scores.size(-1), rows = n > 0 ? scores.numel() / n : 0;
  TORCH_CHECK(k >= 0 && k <= n, "k out of range");
  auto sizes = scores.sizes().vec();
  sizes.back() = k;
  auto idx = torch::empty(sizes, scores.options().dtype(torch::kInt64));
  const float* sp = scores.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> key(n);
    for (int64_t i = begin; i < end; ++i) topk_ascending(sp + i * n, n, k, key.data(), ip + i * k);
  });
  return idx;
}

// Selector steps 2-5 in one call: scores as `selector_scores`, then the top k of each row, ascending:
// [P, H, k] int64. Per layer in parallel; the scores never leave the thread's buffers.
torch::Tensor selector_select(torch::Tensor f, torch::Tensor pos, torch::Tensor kn, int64_t now, int64_t k,
                              int64_t sinks, double decay, int64_t tail, double brake, double norm_power, double lam,
                              double lam_clip, int64_t nms_window, double nms_strength, double excl_strength,
                              double excl_temperature) {
  check_selector_inputs(f, pos, kn);
  const SelectOpts o = select_opts(now, k, sinks, decay, tail, brake, norm_power, lam, lam_clip, nms_window,
                                   nms_strength, excl_strength, excl_temperature);
  const int64_t P = f.size(0), H = f.size(1), n = f.size(2);
  TORCH_CHECK(k >= 0 && k <= n - std::min(sinks, n), "k exceeds the candidates");
  auto idx = torch::empty({P, H, k}, f.options().dtype(torch::kInt64));
  const float* fp = f.data_ptr<float>();
  const float* np = kn.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> r(H * n), u(H * n), sc(H * n), pad(n + 2 * o.nms_window);
    std::vector<uint32_t> key(n);
    for (int64_t p = begin; p < end; ++p) {
      selector_layer(fp + p * f.stride(0), f.stride(1), pp + p * pos.stride(0), pos.stride(1), np + p * kn.stride(0), kn.stride(1), H, n, o, r.data(),
                     u.data(), pad.data(), sc.data());
      for (int64_t h = 0; h < H; ++h)
        topk_ascending(sc.data() + h * n, n, k, key.data(), ip + (p * H + h) * k);
    }
  });
  return idx;
}

// SFI's re-pack, incremental: as pack_compact, but an entry already in the buffers (cidx [L, B, H,
// C], the cache row each compact slot holds, -1 for none) stays where it is; only the newly chosen
// rows are read and written, into the slots of the entries that left. cidx is updated; slots
// holding nothing chosen get -1 (the caller masks them). The buffers then hold the chosen set in
// another order than pack_compact's (attention over them is the same up to float rounding).
template <typename T>
void update_rows(const torch::Tensor& k, const torch::Tensor& v, int64_t b, const torch::Tensor& keys,
                 const torch::Tensor& layers, torch::Tensor& ckt, torch::Tensor& cv, torch::Tensor& cidx) {
  const int64_t nl = keys.size(0), H = keys.size(1), m = keys.size(2), D = k.size(4), S = k.size(3);
  const int64_t C = ckt.size(3) * 16;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* ky = keys.data_ptr<int64_t>();
  const int64_t* ly = layers.data_ptr<int64_t>();
  T* ct = ckt.data_ptr<T>();
  T* vt = cv.data_ptr<T>();
  int64_t* ci = cidx.data_ptr<int64_t>();
  at::parallel_for(0, nl * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slot_of(S, -1);
    std::vector<char> keep(C);
    std::vector<int64_t> fresh;
    for (int64_t ih = begin; ih < end; ++ih) {
      const int64_t i = ih / H, h = ih % H, l = ly[i];
      const float* krow0 = kp + l * k.stride(0) + b * k.stride(1) + h * k.stride(2);
      const float* vrow0 = vp + l * v.stride(0) + b * v.stride(1) + h * v.stride(2);
      const int64_t* kk = ky + ih * m;
      T* cth = ct + l * ckt.stride(0) + b * ckt.stride(1) + h * ckt.stride(2);
      T* cvh = vt + l * cv.stride(0) + b * cv.stride(1) + h * cv.stride(2);
      int64_t* old = ci + l * cidx.stride(0) + b * cidx.stride(1) + h * cidx.stride(2);
      for (int64_t c = 0; c < C; ++c)
        if (old[c] >= 0 && old[c] < S) slot_of[old[c]] = static_cast<int32_t>(c);
      std::fill(keep.begin(), keep.end(), 0);
      fresh.clear();
      for (int64_t t = 0; t < m; ++t) {
        const int32_t c = slot_of[kk[t]];
        if (c >= 0 && !keep[c]) keep[c] = 1; else fresh.push_back(kk[t]);
      }
      for (int64_t c = 0; c < C; ++c)
        if (old[c] >= 0 && old[c] < S) slot_of[old[c]] = -1;
      size_t j = 0;
      for (int64_t c = 0; c < C; ++c) {
        if (keep[c]) continue;
        if (j == fresh.size()) {
          old[c] = -1;
          continue;
        }
        const int64_t row = fresh[j++];
        old[c] = row;
        const float* kr = krow0 + row * k.stride(3);
        T* blk = cth + (c / 16) * D * 16 + (c % 16);
        for (int64_t d = 0; d < D; ++d) blk[d * 16] = narrow<T>(kr[d]);
        const float* vr = vrow0 + row * v.stride(3);
        T* out = cvh + c * D;
        for (int64_t d = 0; d < D; ++d) out[d] = narrow<T>(vr[d]);
      }
    }
  });
}

void pack_compact_update(torch::Tensor k, torch::Tensor v, int64_t b, torch::Tensor keys, torch::Tensor layers,
                         torch::Tensor ckt, torch::Tensor cv, torch::Tensor cidx) {
  check_pack_args(k, v, keys, layers, ckt, cv);
  TORCH_CHECK(cidx.dim() == 4 && cidx.scalar_type() == torch::kInt64 && cidx.size(3) == cv.size(3) &&
              cidx.size(0) == cv.size(0) && cidx.size(1) == cv.size(1) && cidx.size(2) == cv.size(2),
              "cidx must be int64 [L, B, H, C]");
  TORCH_CHECK(b >= 0 && b < k.size(1) && keys.size(2) >= 1 && keys.size(2) <= cv.size(3), "slot or entry count out of range");
  keys = keys.contiguous();
  layers = layers.contiguous();
  TORCH_CHECK(keys.min().item<int64_t>() >= 0 && keys.max().item<int64_t>() < k.size(3), "rows outside the cache");
  TORCH_CHECK(layers.min().item<int64_t>() >= 0 && layers.max().item<int64_t>() < k.size(0), "layer outside the cache");
  if (ckt.scalar_type() == torch::kBFloat16)
    update_rows<c10::BFloat16>(k, v, b, keys, layers, ckt, cv, cidx);
  else {
    TORCH_CHECK(ckt.scalar_type() == torch::kFloat32, "compact buffers must be float32 or bfloat16");
    update_rows<float>(k, v, b, keys, layers, ckt, cv, cidx);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("two_source_decode", &two_source_decode, "SFI fast-step attention: compact buffer + recent window",
        py::call_guard<py::gil_scoped_release>());
  m.def("page_bound_decode", &page_bound_decode, "SFI fallback heads: Quest page-bound reads, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_compact_update", &pack_compact_update,
        "SFI's re-pack, incremental: only the newly chosen rows, into the slots of those that left",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_compact", &pack_compact, "SFI's re-pack: chosen cache rows into the blocked compact buffers",
        py::call_guard<py::gil_scoped_release>());
  m.def("two_source_decode_evidence", &two_source_decode_evidence,
        "SFI decode step with the slow slots' dense attention and evidence fused in",
        py::call_guard<py::gil_scoped_release>());
  m.def("selector_scores", &selector_scores, "SFI selector steps 2-4: final log scores",
        py::call_guard<py::gil_scoped_release>());
  m.def("selector_select", &selector_select, "SFI selector steps 2-5: top-k indices, ascending",
        py::call_guard<py::gil_scoped_release>());
  m.def("topk_ascending", &topk_ascending_rows, "top-k per row, indices ascending",
        py::call_guard<py::gil_scoped_release>());
  m.def("ragged_decode", &ragged_decode, "Dense decode over many one-slot caches: write the new row, attend",
        py::call_guard<py::gil_scoped_release>());
}
