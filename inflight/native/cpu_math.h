/* Small float32 math shared by the C kernels of the engine (cpu_kernels.c) and the trainer
   (trainer/kernels/cpu_kernels.c). Header-only: each includes it; the build hashes it with the source. */

#ifndef INFLIGHT_CPU_MATH_H
#define INFLIGHT_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max), branch-free so that its loop vectorizes:
   x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 before
   rounding), then times 2^n built in the exponent bits. Below -87 (where exp is ~1e-38 and about to leave float's
   normal range) it returns 0, so that a -inf logit has probability 0. */
static inline float exp_nonpositive(float x) {
  const int under = x < -87.f;
  x = under ? -87.f : x;
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
  return under ? 0.f : p * two_n;
}

#endif
