/* dtype: the element types of the reductions against references written
 * another way. float16: every one of the 65,536 halves to float and back,
 * and float to half (nearest, ties to even, overflow to infinity) for a
 * million floats spread over every exponent and for each midpoint between
 * two halves, against a binary search over the table of halves; bfloat16
 * likewise against the rounding rule on the dropped bits. Then every
 * (type, operation) of dtype_combine and dtype_divide against a plain
 * scalar loop, at lengths around the vector widths: integers wrap, a NaN
 * wins max and min, the mean of integers truncates toward zero. Built twice:
 * test_dtype with the library's kernels (on x86_64 the 16-bit floats' run
 * on F16C/AVX2 where the CPU has them), test_dtype_portable with the
 * portable ones only. */
#include "dtype.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static float f_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
static uint32_t u_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

/* half h's value from its fields, in double (exact) */
static double half_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
  return h & 0x8000 ? -v : v;
}

/* the positive finite halves, and 2^16 standing for infinity (IEEE rounds
 * to infinity from the midpoint between 65504 and 2^16) */
static double pos[0x7c01];

static uint16_t ref_half(float f) {
  if (isnan(f)) return 0x7e00;
  double a = fabs((double)f);
  uint16_t sign = signbit(f) ? 0x8000 : 0;
  size_t lo = 0, hi = 0x7c00; /* pos[lo] <= a < pos[hi], or a >= pos[0x7c00] */
  if (a >= pos[0x7c00]) return sign | 0x7c00;
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (pos[mid] <= a)
      lo = mid;
    else
      hi = mid;
  }
  double dl = a - pos[lo], dh = pos[hi] - a;
  size_t pickd = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
  return (uint16_t)(sign | pickd);
}

static uint16_t ref_bf16(float f) {
  uint32_t x = u_of(f), hi = x >> 16, lo = x & 0xffff;
  if (isnan(f)) return (uint16_t)(hi | 0x40);
  if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) hi++;
  return (uint16_t)hi;
}

static void check_conversions(void) {
  for (uint32_t h = 0; h <= 0x7c00; h++) pos[h] = h == 0x7c00 ? 65536.0 : half_value((uint16_t)h);
  size_t bad = 0;
  for (uint32_t h = 0; h < 0x10000; h++) {
    float f = dtype_half_to_float((uint16_t)h);
    double v = half_value((uint16_t)h);
    bool same = isnan(v) ? isnan(f) : (double)f == v && !signbit(f) == !signbit(v);
    bool back = isnan(v) ? (dtype_float_to_half(f) & 0x7e00) == 0x7e00
                         : dtype_float_to_half(f) == (uint16_t)h;
    if (!same || !back) bad++;
    if ((!same || !back) && bad < 5)
      CHECK(0, "half 0x%04x: %g back 0x%04x", h, (double)f, dtype_float_to_half(f));
  }
  CHECK(bad == 0, "%zu halves do not convert exactly", bad);
  bad = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 4093) { /* every exponent, both signs */
    float f = f_of((uint32_t)u);
    uint16_t got = dtype_float_to_half(f), want = ref_half(f);
    if (got != want && !(isnan(f) && (got & 0x7e00) == 0x7e00)) {
      if (bad++ < 5) CHECK(0, "float %a: half 0x%04x, not 0x%04x", (double)f, got, want);
    }
  }
  for (uint32_t h = 0; h < 0x7c00; h++) { /* each midpoint, and one float either side */
    float mid = (float)((pos[h] + pos[h + 1]) / 2);
    for (int d = -1; d <= 1; d++) {
      float f = f_of(u_of(mid) + (uint32_t)d);
      for (int s = 0; s < 2; s++, f = -f)
        if (dtype_float_to_half(f) != ref_half(f) && bad++ < 5)
          CHECK(0, "float %a: half 0x%04x, not 0x%04x", (double)f, dtype_float_to_half(f),
                ref_half(f));
    }
  }
  CHECK(bad == 0, "%zu floats round to the wrong half", bad);
  bad = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 997) {
    float f = f_of((uint32_t)u);
    uint16_t got = dtype_float_to_bf16(f);
    if (got != ref_bf16(f) && bad++ < 5)
      CHECK(0, "float %a: bfloat16 0x%04x, not 0x%04x", (double)f, got, ref_bf16(f));
    if (!isnan(f) && dtype_bf16_to_float(got) != f_of((uint32_t)got << 16)) bad++;
  }
  CHECK(bad == 0, "%zu floats round to the wrong bfloat16", bad);
  CHECK(dtype_float_to_half(65519.0f) == 0x7bff && dtype_float_to_half(65520.0f) == 0x7c00,
        "overflow at the midpoint above 65504");
  CHECK(dtype_float_to_half(0x1p-25f) == 0 && dtype_float_to_half(0x1.000002p-25f) == 1,
        "the smallest subnormal: a tie rounds to zero, above it to 2^-24");
}

/* ---- the kernels against scalar loops ---- */

static bool is_float(int t) {
  return t <= DTYPE_BFLOAT16;
}
static bool is_signed(int t) {
  return t == DTYPE_INT8 || t == DTYPE_INT32 || t == DTYPE_INT64;
}

/* Element i of a floating type, exactly, in double */
static double getf(int t, const void *p, size_t i) {
  if (t == DTYPE_FLOAT32) return ((const float *)p)[i];
  if (t == DTYPE_FLOAT64) return ((const double *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return t == DTYPE_FLOAT16 ? half_value(h) : f_of((uint32_t)h << 16);
}

/* Stores v rounded to the floating type t (by the references above) */
static void putf(int t, void *p, size_t i, double v) {
  if (t == DTYPE_FLOAT32)
    ((float *)p)[i] = (float)v;
  else if (t == DTYPE_FLOAT64)
    ((double *)p)[i] = v;
  else
    ((uint16_t *)p)[i] = t == DTYPE_FLOAT16 ? ref_half((float)v) : ref_bf16((float)v);
}

/* Element i of an integer type, sign- or zero-extended (little-endian) */
static uint64_t geti(int t, const void *p, size_t i) {
  size_t z = dtype_size(t);
  uint64_t v = 0;
  memcpy(&v, (const char *)p + i * z, z);
  if (is_signed(t) && z < 8 && (v >> (8 * z - 1)) & 1) v |= ~0ull << (8 * z);
  return v;
}
static void puti(int t, void *p, size_t i, uint64_t v) {
  memcpy((char *)p + i * dtype_size(t), &v, dtype_size(t));
}

/* x (op) y as the type's own arithmetic defines it (dtype.h) */
static void ref_combine(int t, int op, void *ref, const void *b, size_t i) {
  if (is_float(t)) {
    double x = getf(t, ref, i), y = getf(t, b, i);
    if (op == DTYPE_ADD)
      putf(t, ref, i, t == DTYPE_FLOAT64 ? x + y : (double)((float)x + (float)y));
    else
      putf(t, ref, i, isnan(y) ? y : (op == DTYPE_MAX) == (y > x) ? y : x);
    return;
  }
  uint64_t x = geti(t, ref, i), y = geti(t, b, i);
  bool y_more = is_signed(t) ? (int64_t)y > (int64_t)x : y > x;
  if (op == DTYPE_ADD)
    puti(t, ref, i, x + y); /* the low bytes: modulo 2^bits */
  else if ((op == DTYPE_MAX) == y_more && x != y)
    puti(t, ref, i, y);
}

static void fill(int t, void *p, size_t n, uint64_t *seed, int which) {
  for (size_t i = 0; i < n; i++) {
    *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
    if (!is_float(t)) { /* any bits: the wrap-around and both signs */
      puti(t, p, i, *seed >> 11);
      continue;
    }
    /* values whose sums round in the narrow types, and a NaN at i == 5 */
    double v = which ? (double)(i % 17) * -3.0625 + 7 : (double)i * 1.375 - 40.25;
    v += (double)(*seed >> 40) * 0x1p-30;
    putf(t, p, i, which && i == 5 ? NAN : v);
  }
}

static void check_kernels(void) {
  enum { N = 131 };
  uint64_t seed = 42;
  for (int t = 0; t < DTYPE_COUNT; t++) {
    size_t z = dtype_size(t);
    for (size_t n = 0; n <= N; n += n < 40 ? 1 : 13)
      for (int op = DTYPE_ADD; op <= DTYPE_MIN; op++) {
        unsigned char a[N * 8], b[N * 8], ref[N * 8];
        fill(t, a, n, &seed, 0);
        fill(t, b, n, &seed, 1);
        memcpy(ref, a, n * z);
        for (size_t i = 0; i < n; i++) ref_combine(t, op, ref, b, i);
        dtype_combine((enum dtype)t, (enum dtype_op)op, a, b, n);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
          bool ok = memcmp(a + i * z, ref + i * z, z) == 0 ||
                    (is_float(t) && isnan(getf(t, a, i)) && isnan(getf(t, ref, i)));
          if (!ok && bad++ == 0)
            CHECK(0, "%s op %d n=%zu [%zu]: element differs from the reference", dtype_name(t), op,
                  n, i);
        }
        if (n > 5 && is_float(t))
          CHECK(isnan(getf(t, a, 5)), "%s op %d: a NaN must win", dtype_name(t), op);
      }
    /* the mean's division: negative integers truncate toward zero; W = 1
     * changes nothing; a W past 2^20 takes the integers' other path */
    const int ws[] = {1, 3, 7, (1 << 21) + 1};
    for (size_t wi = 0; wi < sizeof(ws) / sizeof(ws[0]); wi++) {
      const int w = ws[wi];
      unsigned char a[N * 8], ref[N * 8];
      fill(t, a, N, &seed, 0);
      memcpy(ref, a, N * z);
      for (size_t i = 0; i < N; i++) {
        if (!is_float(t)) {
          uint64_t x = geti(t, ref, i);
          puti(t, ref, i, is_signed(t) ? (uint64_t)((int64_t)x / w) : x / (uint64_t)w);
        } else {
          double x = getf(t, ref, i);
          putf(t, ref, i, t == DTYPE_FLOAT64 ? x * (1.0 / w) : (double)((float)x * (1.0f / w)));
        }
      }
      dtype_divide((enum dtype)t, a, N, w);
      CHECK(memcmp(a, ref, N * z) == 0, "%s: the mean's division by %d", dtype_name(t), w);
    }
  }
}

int main(void) {
  CHECK(dtype_size(DTYPE_FLOAT16) == 2 && dtype_size(DTYPE_UINT64) == 8 && dtype_size(-1) == 0 &&
            dtype_size(DTYPE_COUNT) == 0,
        "sizes");
  CHECK(strcmp(dtype_name(DTYPE_BFLOAT16), "bfloat16") == 0 && strcmp(dtype_name(99), "?") == 0,
        "names");
  check_conversions();
  check_kernels();
  if (failures == 0) printf("dtype: conversions and every kernel as the references\n");
  return failures != 0;
}
