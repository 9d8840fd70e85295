/* float32 CPU kernels of the fast llama forward (llama_runner.py); built and loaded by cpu_kernels.py.

   Each replaces a run of small torch ops whose per-op cost dominated a decode step at our model sizes
   (measured in cpu_kernels.py's header). Plain C: the compiler vectorizes the inner loops for the host
   (-O3 -march=native); nothing here allocates or keeps state. Single-threaded. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../native/cpu_math.h"

/* max of x[0..n), in 16 running maxima: one chain of compares would not vectorize (NaNs are skipped). */
static inline float max_of(const float* x, int64_t n) {
  float m16[16];
  for (int j = 0; j < 16; ++j) m16[j] = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) m16[j] = x[i + j] > m16[j] ? x[i + j] : m16[j];
  float mx = -INFINITY;
  for (int j = 0; j < 16; ++j) mx = m16[j] > mx ? m16[j] : mx;
  for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return mx;
}

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of length n; x rows xs floats apart, out contiguous. */
void rms_norm(const float* x, int64_t xs, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * xs;
    float* oi = out + i * n;
    float ss = 0.f;
    for (int64_t j = 0; j < n; ++j) ss += xi[j] * xi[j];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t j = 0; j < n; ++j) oi[j] = w[j] * (xi[j] * inv);
  }
}

/* The q/k/v projection's output of N tokens, qkv [N, (H + 2 KV) * D] contiguous: rotate the H query heads and
   the KV key heads in place, x * cos + rotate_half(x) * sin, with sin_signed carrying rotate_half's sign
   (tables [positions, D]); then write each token's roped k and its v into the layer's cache at (its slot, its
   position): k_cache / v_cache [slots, KV, T, D] with strides cs0 (slot) and cs1 (head), in floats. */
void rope_and_cache(float* qkv, int64_t N, int64_t H, int64_t KV, int64_t D, const float* cos_t, const float* sin_t,
                    const int64_t* positions, const int64_t* slots, float* k_cache, float* v_cache, int64_t cs0,
                    int64_t cs1) {
  const int64_t half = D / 2, row = (H + 2 * KV) * D;
  float tmp[1024]; /* one head; head_dim <= 1024 is checked by the caller */
  for (int64_t i = 0; i < N; ++i) {
    float* t = qkv + i * row;
    const float* c = cos_t + positions[i] * D;
    const float* s = sin_t + positions[i] * D;
    for (int64_t h = 0; h < H + KV; ++h) {
      float* x = t + h * D;
      for (int64_t d = 0; d < half; ++d) {
        tmp[d] = x[d] * c[d] + x[d + half] * s[d];
        tmp[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
      }
      memcpy(x, tmp, D * sizeof(float));
    }
    const int64_t at = slots[i] * cs0 + positions[i] * D;
    for (int64_t g = 0; g < KV; ++g) {
      memcpy(k_cache + at + g * cs1, t + (H + g) * D, D * sizeof(float));
      memcpy(v_cache + at + g * cs1, t + (H + KV + g) * D, D * sizeof(float));
    }
  }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 vectors -> one whose lane i is the sum of the lanes of p[i]: a transposing tree of unpacks and 128-bit
   shuffles, ~2 shuffles per vector instead of the 4 of a horizontal sum each. */
static inline __m512 sum16(const __m512* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) /* per 128-bit chunk: [x, y, x, y] partial sums of p[2i], p[2i + 1] */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) { /* per chunk: partial sums of p[4i .. 4i + 3] */
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) /* chunks: p[8i..8i+3] over halves of the lanes, p[8i+4..8i+7] likewise */
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* Scores of 16 consecutive keys K [16, D] (D a multiple of 16) for each of the rep query heads:
   s[r * len + t] = scale * q[r] . K[t]. */
static inline __attribute__((always_inline)) void scores16(const float* q, const int64_t rep, const float* K,
                                                           const int64_t D, int64_t len, float scale, float* s) {
  for (int64_t r = 0; r < rep; ++r) {
    __m512 p[16];
    for (int i = 0; i < 16; ++i) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * D), _mm512_loadu_ps(K + i * D));
      for (int64_t d = 16; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), _mm512_loadu_ps(K + i * D + d), acc);
      p[i] = acc;
    }
    _mm512_storeu_ps(s + r * len, _mm512_mul_ps(sum16(p), _mm512_set1_ps(scale)));
  }
}
#endif

/* One sequence's kv head: its rep query heads q [rep, D] over len cached positions of K and V [len, D].
   Each key and value row is read once for all rep heads. Inlined with constant rep and D where they are the
   common ones, so that the loops over D compile to whole vector instructions and each head's output stays in
   registers while the values stream past. */
static inline __attribute__((always_inline)) void attend_one_head(const float* restrict q, const int64_t rep,
                                                                  const float* restrict K, const float* restrict V,
                                                                  int64_t len, const int64_t D, float scale,
                                                                  float* restrict out, float* restrict s) {
  int64_t t = 0;
#ifdef __AVX512F__
  if (D % 16 == 0)
    for (; t + 16 <= len; t += 16) scores16(q, rep, K + t * D, D, len, scale, s + t);
#endif
  for (; t < len; ++t) {
    const float* kt = K + t * D;
    for (int64_t r = 0; r < rep; ++r) {
      const float* qr = q + r * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
      s[r * len + t] = dot * scale;
    }
  }
  for (int64_t r = 0; r < rep; ++r) {
    float* sr = s + r * len;
    const float mx = max_of(sr, len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sr[t] = exp_nonpositive(sr[t] - mx);
      sum += sr[t];
    }
    const float inv = 1.f / sum;
    float acc[4][D]; /* four running sums, so that consecutive multiply-adds do not wait for each other */
    for (int64_t d = 0; d < D; ++d) acc[0][d] = acc[1][d] = acc[2][d] = acc[3][d] = 0.f;
    int64_t t = 0;
    for (; t + 4 <= len; t += 4)
      for (int64_t u = 0; u < 4; ++u) {
        const float a = sr[t + u];
        const float* vt = V + (t + u) * D;
        for (int64_t d = 0; d < D; ++d) acc[u][d] += a * vt[d];
      }
    for (; t < len; ++t) {
      const float a = sr[t];
      const float* vt = V + t * D;
      for (int64_t d = 0; d < D; ++d) acc[0][d] += a * vt[d];
    }
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = ((acc[0][d] + acc[1][d]) + (acc[2][d] + acc[3][d])) * inv;
  }
}

/* Ask for the next head's keys and values while this one is computed: each head is a short stream (a few KB)
   that the hardware prefetcher would only pick up after its first misses, and once the cache outgrows the CPU's
   caches those misses were most of the attention's time. Into L2 (locality 2): into L1 they evicted the head
   being read and did not help. */
static inline void prefetch_head(const float* k_cache, const float* v_cache, int64_t at, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) {
    __builtin_prefetch(k_cache + at + i, 0, 2);
    __builtin_prefetch(v_cache + at + i, 0, 2);
  }
}

/* Attention of nd tokens over their sequences' cached keys and values, grouped-query heads:
   out[b, h] = softmax(scale * q[b, h] . K[slot_b, h / rep, :len_b]) @ V[slot_b, h / rep, :len_b], rep = H / KV.
   A decoding token has len = its sequence's length; a prompt token len = its position + 1, which makes a prefill
   chunk causal (its keys are in the cache already, written by rope_and_cache). q rows qs floats apart ([nd, H, D]
   within a row); caches as in rope_and_cache; out [nd, H, D] contiguous; scratch holds rep * max(len) floats.
   Only the len_b cached positions of each sequence are read. */
void cached_attention(const float* q, int64_t qs, const float* k_cache, const float* v_cache, int64_t cs0,
                      int64_t cs1, const int64_t* slots, const int64_t* lens, int64_t nd, int64_t H, int64_t KV,
                      int64_t D, float scale, float* out, float* scratch) {
  const int64_t rep = H / KV;
  for (int64_t b = 0; b < nd; ++b) {
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t at = slots[b] * cs0 + g * cs1;
      const float* qg = q + b * qs + g * rep * D;
      float* og = out + (b * H + g * rep) * D;
      const float *kg = k_cache + at, *vg = v_cache + at;
      const int64_t len = lens[b];
      if (g + 1 < KV) prefetch_head(k_cache, v_cache, at + cs1, lens[b] * D);
      else if (b + 1 < nd) prefetch_head(k_cache, v_cache, slots[b + 1] * cs0, lens[b + 1] * D);
#define ATTEND(R, DIM) attend_one_head(qg, R, kg, vg, len, DIM, scale, og, scratch)
      if (D == 32 && rep == 2) ATTEND(2, 32);
      else if (D == 32 && rep == 1) ATTEND(1, 32);
      else if (D == 32 && rep == 4) ATTEND(4, 32);
      else if (D == 64 && rep == 1) ATTEND(1, 64);
      else if (D == 64 && rep == 2) ATTEND(2, 64);
      else if (D == 64 && rep == 4) ATTEND(4, 64);
      else if (D == 64 && rep == 7) ATTEND(7, 64);
      else if (D == 128 && rep == 1) ATTEND(1, 128);
      else if (D == 128 && rep == 2) ATTEND(2, 128);
      else if (D == 128 && rep == 4) ATTEND(4, 128);
      else if (D == 128 && rep == 7) ATTEND(7, 128);
      else ATTEND(rep, D);
#undef ATTEND
    }
  }
}

/* The gated MLP's activation: gu [N, 2 I] contiguous (gate then up) -> out [N, I] = silu(gate) * up, with
   silu(g) = g * sigmoid(g) computed from exp(-|g|) so that it never overflows. */
void silu_mul(const float* gu, int64_t N, int64_t I, float* out) {
  for (int64_t i = 0; i < N; ++i) {
    const float* g = gu + i * 2 * I;
    const float* u = g + I;
    float* o = out + i * I;
    for (int64_t j = 0; j < I; ++j) {
      const float e = exp_nonpositive(-fabsf(g[j]));
      const float sig = g[j] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
      o[j] = g[j] * sig * u[j];
    }
  }
}

/* One token per row of logits [B, V] (contiguous), drawn by the inverse CDF at u[b] in [0, 1) of
   softmax(logits[b] / temp[b]); temp[b] <= 0 is greedy (the first argmax). logprob[b] is the token's log
   probability under the distribution it was drawn from (temperature 1 for greedy), as sampling.py defines it.
   scratch holds V floats. */
void sample_rows(const float* logits, int64_t B, int64_t V, const float* temp, const float* u, int64_t* tokens,
                 float* logprobs, float* scratch) {
  for (int64_t b = 0; b < B; ++b) {
    const float* x = logits + b * V;
    const float mx = max_of(x, V);
    const int greedy = !(temp[b] > 0.f);
    const float inv_t = greedy ? 1.f : 1.f / temp[b];
    float sum = 0.f;
    int64_t i;
    for (i = 0; i < V; ++i) {
      scratch[i] = exp_nonpositive((x[i] - mx) * inv_t);
      sum += scratch[i];
    }
    int64_t tok = -1, last = 0;
    if (greedy) {
      for (i = 0; i < V && tok < 0; ++i)
        if (x[i] == mx) tok = i;
    } else {
      const float target = u[b] * sum;
      float c = 0.f;
      for (i = 0; i < V && tok < 0; ++i) {
        c += scratch[i];
        last = scratch[i] > 0.f ? i : last;
        if (c > target) tok = i;
      }
    }
    if (tok < 0) tok = last; /* rounding left the running sum under the target: the last possible token */
    tokens[b] = tok;
    logprobs[b] = (x[tok] - mx) * inv_t - logf(sum);
  }
}

/* dst = src, n float32 values as their bits, and *bad = how many are NaN or +-Inf (every exponent bit set): a staged
   weight update (LlamaRunner.stage) is copied and checked in one pass over memory instead of a copy and a read. */
void copy_count_nonfinite(const uint32_t* restrict src, uint32_t* restrict dst, int64_t n, int64_t* bad) {
  int64_t b = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = src[i];
    dst[i] = x;
    b += (x & 0x7f800000u) == 0x7f800000u;
  }
  *bad = b;
}
