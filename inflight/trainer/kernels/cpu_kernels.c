/* float32 CPU kernels of the trainer, forward and backward: the packed attention (row_attention.py), RMSNorm and
   SwiGLU (fused.py). Built and loaded by trainer/kernels/cpu_kernels.py. Single-threaded, no allocation.

   Attention. A micro-batch is one list of T tokens. A row is one sample's view of it: the indices idx[off[r] .. off[r+1])
   of the tokens it reads, in position order (a shared prompt appears in the row of every sample of its group).
   Entry i of a row attends to entries 0..i; a row computes the queries of its entries from start[r] on (a
   shared prompt's queries belong to its group's first row only), so every token's output is written once.
   q [T, H, D] is read at q + t * sqt + h * sqh (the last dim contiguous), k and v [T, KV, D] likewise; query head
   h reads kv head h / (H / KV). The caller passes zeroed gradients and a scratch of the longest row. */

#include <math.h>
#include <stdint.h>

#include "../../native/cpu_math.h"

static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

/* out [T, H, D] contiguous, lse [T, H] (log-sum-exp of the scaled scores, for the backward). */
void row_attention_forward(const float* q, int64_t sqt, int64_t sqh, const float* k, int64_t skt, int64_t skh,
                           const float* v, int64_t svt, int64_t svh, const int64_t* off, const int64_t* idx,
                           const int64_t* start, int64_t rows, int64_t H, int64_t KV, int64_t D, float scale,
                           float* out, float* lse, float* scratch) {
  const int64_t rep = H / KV;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* ix = idx + off[r];
    const int64_t n = off[r + 1] - off[r];
    for (int64_t i = start[r]; i < n; ++i) {
      const int64_t t = ix[i];
      for (int64_t h = 0; h < H; ++h) {
        const float* qi = q + t * sqt + h * sqh;
        const int64_t g = h / rep;
        float m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const float s = scale * dot(qi, k + ix[j] * skt + g * skh, D);
          scratch[j] = s;
          m = s > m ? s : m;
        }
        float l = 0.f;
        for (int64_t j = 0; j <= i; ++j) {
          scratch[j] = exp_nonpositive(scratch[j] - m);
          l += scratch[j];
        }
        float* o = out + (t * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        const float inv = 1.f / l;
        for (int64_t j = 0; j <= i; ++j) axpy(scratch[j] * inv, v + ix[j] * svt + g * svh, o, D);
        lse[t * H + h] = m + logf(l);
      }
    }
  }
}

/* Gradients of the forward above from dout [T, H, D] contiguous, added into dq [T, H, D], dk and dv [T, KV, D]
   (contiguous, zeroed by the caller; a key read by several rows gathers all their contributions):
   p_j = exp(scale q.k_j - lse), dv_j += p_j dout, ds_j = p_j (dout.v_j - dout.out), dq += scale ds_j k_j,
   dk_j += scale ds_j q. The probabilities are recomputed from lse, not stored. */
void row_attention_backward(const float* q, int64_t sqt, int64_t sqh, const float* k, int64_t skt, int64_t skh,
                            const float* v, int64_t svt, int64_t svh, const int64_t* off, const int64_t* idx,
                            const int64_t* start, int64_t rows, int64_t H, int64_t KV, int64_t D, float scale,
                            const float* out, const float* dout, const float* lse, float* dq, float* dk, float* dv) {
  const int64_t rep = H / KV;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* ix = idx + off[r];
    const int64_t n = off[r + 1] - off[r];
    for (int64_t i = start[r]; i < n; ++i) {
      const int64_t t = ix[i];
      for (int64_t h = 0; h < H; ++h) {
        const float* qi = q + t * sqt + h * sqh;
        const float* doi = dout + (t * H + h) * D;
        float* dqi = dq + (t * H + h) * D;
        const int64_t g = h / rep;
        const float delta = dot(doi, out + (t * H + h) * D, D);
        const float lse_i = lse[t * H + h];
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t tj = ix[j];
          const float* kj = k + tj * skt + g * skh;
          const float* vj = v + tj * svt + g * svh;
          const float p = exp_nonpositive(scale * dot(qi, kj, D) - lse_i);
          axpy(p, doi, dv + (tj * KV + g) * D, D);
          const float ds = scale * p * (dot(doi, vj, D) - delta);
          axpy(ds, kj, dqi, D);
          axpy(ds, qi, dk + (tj * KV + g) * D, D);
        }
      }
    }
  }
}

/* RMSNorm over rows of length n (x and y contiguous): y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps). */
void rms_norm_forward(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * n;
    float* yi = y + i * n;
    const float r = 1.f / sqrtf(dot(xi, xi, n) / (float)n + eps);
    for (int64_t j = 0; j < n; ++j) yi[j] = w[j] * (xi[j] * r);
  }
}

/* Its gradients from dy: with g = w * dy, dx = r g - (r^3 / n) (g . x) x, and dw += dy * x * r over the rows
   (dw zeroed by the caller). r is recomputed from x. */
void rms_norm_backward(const float* x, const float* w, const float* dy, int64_t rows, int64_t n, float eps,
                       float* dx, float* dw) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * n;
    const float* dyi = dy + i * n;
    float* dxi = dx + i * n;
    const float r = 1.f / sqrtf(dot(xi, xi, n) / (float)n + eps);
    float gx = 0.f;
    for (int64_t j = 0; j < n; ++j) gx += w[j] * dyi[j] * xi[j];
    const float c = r * r * r * gx / (float)n;
    for (int64_t j = 0; j < n; ++j) {
      dxi[j] = r * w[j] * dyi[j] - c * xi[j];
      dw[j] += dyi[j] * xi[j] * r;
    }
  }
}

/* sigmoid(g) from exp(-|g|) <= 1, so that the loops vectorize (libm's expf does not, here) and never overflow. */
static inline float sigmoid(float g) {
  const float e = exp_nonpositive(g < 0.f ? g : -g);
  return g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
}

/* SwiGLU on N values: out = silu(gate) * up, silu(g) = g * sigmoid(g). */
void swiglu_forward(const float* gate, const float* up, int64_t N, float* out) {
  for (int64_t i = 0; i < N; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

/* Its gradients: dup = dout * silu(g), dgate = dout * up * s (1 + g (1 - s)), s = sigmoid(g). */
void swiglu_backward(const float* gate, const float* up, const float* dout, int64_t N, float* dgate, float* dup) {
  for (int64_t i = 0; i < N; ++i) {
    const float g = gate[i];
    const float s = sigmoid(g);
    dup[i] = dout[i] * g * s;
    dgate[i] = dout[i] * up[i] * s * (1.f + g * (1.f - s));
  }
}
