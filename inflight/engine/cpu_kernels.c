/* float32 CPU kernels of the fast llama forward (llama_runner.py); built and loaded by cpu_kernels.py.

   Each replaces a run of small torch ops whose per-op cost dominated a decode step at our model sizes
   (measured in cpu_kernels.py's header). Plain C: the compiler vectorizes the inner loops for the host
   (-O3 -march=native); nothing here allocates or keeps state. Single-threaded. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max), branch-free so that its loop vectorizes:
   x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 before
   rounding), then times 2^n built in the exponent bits. Below -87 it returns exp(-87) ~ 1.6e-38. */
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = __builtin_roundf(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f; /* ln2 split in two */
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
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

/* One sequence's kv head: its rep query heads q [rep, D] over len cached positions of K and V [len, D].
   Each key and value row is read once for all rep heads. Inlined with a constant D where it is one, so that
   the loops over D compile to a few whole vector instructions. */
static inline __attribute__((always_inline)) void attend_one_head(const float* q, int64_t rep, const float* K,
                                                                  const float* V, int64_t len, const int64_t D,
                                                                  float scale, float* out, float* s) {
  for (int64_t t = 0; t < len; ++t) {
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
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; ++t) mx = sr[t] > mx ? sr[t] : mx;
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sr[t] = exp_nonpositive(sr[t] - mx);
      sum += sr[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
  }
  for (int64_t i = 0; i < rep * D; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    const float* vt = V + t * D;
    for (int64_t r = 0; r < rep; ++r) {
      const float a = s[r * len + t];
      float* o = out + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += a * vt[d];
    }
  }
}

/* Attention of nd decoding tokens (one query each) over their cached keys and values, grouped-query heads:
   out[b, h] = softmax(scale * q[b, h] . K[slot_b, h / rep, :len_b]) @ V[slot_b, h / rep, :len_b], rep = H / KV.
   q rows qs floats apart ([nd, H, D] within a row); caches as in rope_and_cache; out [nd, H, D] contiguous;
   scratch holds rep * max(len) floats. Only the len_b cached positions of each sequence are read. */
void decode_attention(const float* q, int64_t qs, const float* k_cache, const float* v_cache, int64_t cs0,
                      int64_t cs1, const int64_t* slots, const int64_t* lens, int64_t nd, int64_t H, int64_t KV,
                      int64_t D, float scale, float* out, float* scratch) {
  const int64_t rep = H / KV;
  for (int64_t b = 0; b < nd; ++b) {
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t at = slots[b] * cs0 + g * cs1;
      const float* qg = q + b * qs + g * rep * D;
      float* og = out + (b * H + g * rep) * D;
      switch (D) {
        case 64: attend_one_head(qg, rep, k_cache + at, v_cache + at, lens[b], 64, scale, og, scratch); break;
        case 128: attend_one_head(qg, rep, k_cache + at, v_cache + at, lens[b], 128, scale, og, scratch); break;
        case 32: attend_one_head(qg, rep, k_cache + at, v_cache + at, lens[b], 32, scale, og, scratch); break;
        default: attend_one_head(qg, rep, k_cache + at, v_cache + at, lens[b], D, scale, og, scratch);
      }
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
