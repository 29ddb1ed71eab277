// Two-source decode attention on the CPU: SFI's fast step (cotserve/policies/sfi/attention.py).
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
  t = t < -127.f ? -127.f : t;
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

// Compact logits, keys transposed [D, C]: 16 columns at a time, the G rows' partial sums in
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
    std::vector<float> qs(G * D), logits, acc(G * D);
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
      std::vector<float> total(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* l = &logits[g * N];
        float lane_max[LANES];
        std::fill(lane_max, lane_max + LANES, NEG);
        int64_t i = 0;
        for (; i + LANES <= N; i += LANES) {
          for (int k = 0; k < LANES; ++k) lane_max[k] = l[i + k] > lane_max[k] ? l[i + k] : lane_max[k];
        }
        float mx = NEG;
        for (int k = 0; k < LANES; ++k) mx = std::max(mx, lane_max[k]);
        for (; i < N; ++i) mx = std::max(mx, l[i]);
        if (mx == NEG) continue;  // nothing to read: a zero output
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
      compact_values<T, GB, DB>(logits.data(), N, m, vc, C, D, G, acc.data());
      for (int64_t j = 0; j < W; ++j) {
        const float* row = vw + (w0 + j) * wv_r;
        for (int64_t g = 0; g < G; ++g) axpy(&acc[g * D], logits[g * N + C + j], row, D);
      }
      float* o = op + bh * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
        for (int64_t i = 0; i < D; ++i) o[g * D + i] = acc[g * D + i] * inv;
      }
    }
  });
}

}  // namespace

// q [B, H, G, D] float32; ckt [B, H, D, C] (keys transposed) and cv [B, H, C, D], float32 or
// bfloat16 (contiguous); cmask [B, H, C]
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
  TORCH_CHECK(ck.dim() == 5 && ck.size(4) == 16 && ck.size(3) == q.size(3),
              "ck must be blocked [B, H, C / 16, D, 16]");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("two_source_decode", &two_source_decode, "SFI fast-step attention: compact buffer + recent window");
}
