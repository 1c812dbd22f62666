"""Vectorisable float32 exp, tanh and erf for the C backend.

glibc's expf/tanhf/erff are scalar calls: gcc cannot vectorise a loop that makes them (without
-ffast-math and libmvec), so a GELU or a softmax ran at 30-40 ns per element.  These helpers
are branch-free straight-line float arithmetic (selects, FMAs, bit moves), which gcc inlines
and vectorises to the machine's vector width like any other loop body.

Accuracy against float64, measured over every 97th float32 bit pattern plus the edges (the
CPU tier's tests/test_c_math.py checks the bounds): exp <= 1.01 ulp (subnormal results to
within one subnormal step; overflow to inf, -inf to 0), tanh <= 1.4 ulp, erf <= 2.5 ulp
(glibc's own tanhf is 2.1 ulp).  NaN in gives NaN out; infinities give the limits.

- exp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for an exact reduction), Cephes'
  degree-6 polynomial for e^r, and 2^n applied as two normal powers of two so results from the
  subnormals up to overflow come out right.  The integer n is read from the bits of a float
  that holds x / ln2 + 1.5 * 2^23 (no float-to-int conversion, which NaN would make undefined).
- tanh: Cephes' odd polynomial below |x| = 0.625, else 1 - 2 / (e^(2|x|) + 1) with the sign
  restored (|x| clamped at 10: tanh is 1 in float32 from 9.01 on).
- erf: x * P(x^2) below |x| = 0.95 (least-squares fit of erf(x)/x, relative error 7e-10),
  else 1 - erfc(|x|) with Numerical Recipes' erfcc (t * e^(-x^2 + poly(t)), t = 1 / (1 + |x| / 2),
  fractional error below 1.2e-7), sign restored.
"""

from __future__ import annotations

# float32 (and float16/bfloat16, which compute in float) calls that go to these helpers.
VECTOR_MATH = {"exp": "ts_expf", "tanh": "ts_tanhf", "erf": "ts_erff"}

C_MATH_HELPERS = r"""
static inline float ts_fmaf(float a, float b, float c) {
#ifdef __FMA__
  return fmaf(a, b, c);  /* one instruction */
#else
  return a * b + c;  /* without FMA hardware fmaf is a library call, which no loop vectorises */
#endif
}
static inline float ts_expf(float x) {
  float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);  /* NaN passes through */
  float t = ts_fmaf(xc, 1.44269504088896341f, 12582912.0f);
  float n = t - 12582912.0f;
  int32_t ni; memcpy(&ni, &t, 4); ni -= 0x4B400000;
  float r = ts_fmaf(n, -0.693145751953125f, xc);
  r = ts_fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.9875691500E-4f;
  p = ts_fmaf(p, r, 1.3981999507E-3f);
  p = ts_fmaf(p, r, 8.3334519073E-3f);
  p = ts_fmaf(p, r, 4.1665795894E-2f);
  p = ts_fmaf(p, r, 1.6666665459E-1f);
  p = ts_fmaf(p, r, 5.0000001201E-1f);
  p = ts_fmaf(p, r * r, r) + 1.0f;
  int32_t h = ni / 2;
  uint32_t b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(ni - h + 127) << 23;
  float s1, s2; memcpy(&s1, &b1, 4); memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}
static inline float ts_tanhf(float x) {
  float ax = fabsf(x), z = x * x;
  float p = -5.70498872745E-3f;
  p = ts_fmaf(p, z, 2.06390887954E-2f);
  p = ts_fmaf(p, z, -5.37397155531E-2f);
  p = ts_fmaf(p, z, 1.33314422036E-1f);
  p = ts_fmaf(p, z, -3.33332819422E-1f);
  float small = ts_fmaf(p * z, ax, ax);
  float e = ts_expf(2.0f * (ax > 10.0f ? 10.0f : ax));
  float big = 1.0f - 2.0f / (e + 1.0f);
  return copysignf(ax < 0.625f ? small : big, x);  /* tanh(-0) = -0 */
}
static inline float ts_erff(float x) {
  float ax = fabsf(x), z = x * x;
  float p = 8.227120729432263e-05f;
  p = ts_fmaf(p, z, -0.0008109803446192618f);
  p = ts_fmaf(p, z, 0.005198281366990733f);
  p = ts_fmaf(p, z, -0.02685839659386481f);
  p = ts_fmaf(p, z, 0.11283681036425386f);
  p = ts_fmaf(p, z, -0.3761263330858904f);
  p = ts_fmaf(p, z, 1.128379166802738f);
  float small = p * x;
  float t = 1.0f / ts_fmaf(0.5f, ax, 1.0f);
  float q = 0.17087277f;
  q = ts_fmaf(q, t, -0.82215223f);
  q = ts_fmaf(q, t, 1.48851587f);
  q = ts_fmaf(q, t, -1.13520398f);
  q = ts_fmaf(q, t, 0.27886807f);
  q = ts_fmaf(q, t, -0.18628806f);
  q = ts_fmaf(q, t, 0.09678418f);
  q = ts_fmaf(q, t, 0.37409196f);
  q = ts_fmaf(q, t, 1.00002368f);
  q = ts_fmaf(q, t, -1.26551223f);
  float big = copysignf(1.0f - t * ts_expf(q - z), x);
  return ax < 0.95f ? small : big;
}
"""
