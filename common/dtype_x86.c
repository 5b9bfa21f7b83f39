/* dtype_x86: the 16-bit float kernels with the x86 instructions for them,
 * for CPUs (and OSes) with AVX2 and F16C, every x86 server since 2013:
 * float16 through F16C's conversions (vcvtph2ps, vcvtps2ph rounding to
 * nearest-even: one instruction for 8 elements each way, where the portable
 * bit arithmetic takes dozens), bfloat16 widened, combined and rounded in
 * AVX2 registers. Each gives the portable kernel's bits (dtype.c; a NaN's
 * payload included), which test_dtype checks on the CPU it runs on. A tail
 * shorter than a vector goes through a padded copy, so it gets the same
 * instructions. meson builds this file on x86_64 and dtype_cpu_none.c
 * elsewhere (docs/ARCHITECTURE.md, Conventions). */
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "dtype_impl.h"

#define AVX2_F16C __attribute__((target("avx2,f16c")))

/* AVX2 usable (the CPU has it and the OS saves the YMM registers: the
 * compiler's check) and F16C present (cpuid leaf 1, ECX bit 29). */
static bool usable(void) {
  static atomic_int known = -1; /* any thread may ask first; all find the same */
  int k = atomic_load_explicit(&known, memory_order_relaxed);
  if (k < 0) {
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    __builtin_cpu_init();
    k = f16c && __builtin_cpu_supports("avx2");
    atomic_store_explicit(&known, k, memory_order_relaxed);
  }
  return k;
}

/* a and b as 8 floats; max and min: a NaN in b, or b beyond a, gives b
 * (so a NaN on either side wins, as FMAX/FMIN in dtype.c) */
AVX2_F16C static inline __m256 op8(enum dtype_op op, __m256 a, __m256 b) {
  if (op == DTYPE_ADD) return _mm256_add_ps(a, b);
  __m256 beyond = _mm256_cmp_ps(b, a, op == DTYPE_MAX ? _CMP_GT_OQ : _CMP_LT_OQ);
  return _mm256_blendv_ps(a, b, _mm256_or_ps(beyond, _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
}

/* ---- float16 ---- */

AVX2_F16C static inline __m256 load_h8(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

AVX2_F16C static inline void store_h8(uint16_t *p, __m256 f) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

AVX2_F16C static inline void combine_f16(enum dtype_op op, uint16_t *restrict d,
                                         const uint16_t *restrict s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_h8(d + i, op8(op, load_h8(d + i), load_h8(s + i)));
  if (i < n) {
    uint16_t a[8] = {0}, b[8] = {0};
    memcpy(a, d + i, (n - i) * 2);
    memcpy(b, s + i, (n - i) * 2);
    store_h8(a, op8(op, load_h8(a), load_h8(b)));
    memcpy(d + i, a, (n - i) * 2);
  }
}

AVX2_F16C static void add_f16(void *restrict d, const void *restrict s, size_t n) {
  combine_f16(DTYPE_ADD, d, s, n);
}
AVX2_F16C static void max_f16(void *restrict d, const void *restrict s, size_t n) {
  combine_f16(DTYPE_MAX, d, s, n);
}
AVX2_F16C static void min_f16(void *restrict d, const void *restrict s, size_t n) {
  combine_f16(DTYPE_MIN, d, s, n);
}

AVX2_F16C static void scale_f16(void *bufv, size_t n, float a) {
  uint16_t *buf = bufv;
  const __m256 m = _mm256_set1_ps(a);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_h8(buf + i, _mm256_mul_ps(load_h8(buf + i), m));
  if (i < n) {
    uint16_t x[8] = {0};
    memcpy(x, buf + i, (n - i) * 2);
    store_h8(x, _mm256_mul_ps(load_h8(x), m));
    memcpy(buf + i, x, (n - i) * 2);
  }
}

/* ---- bfloat16 ---- */

/* 16 bfloat16 as two vectors of 8 floats: the low and high four of each
 * 128-bit lane (unpack and pack work within lanes, so the order returns) */
AVX2_F16C static inline __m256 bf_lo(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
}
AVX2_F16C static inline __m256 bf_hi(__m256i v) {
  return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

/* float_bf16 of 8 floats, in the low half of each 32-bit lane */
AVX2_F16C static inline __m256i bf_round(__m256 f) {
  __m256i x = _mm256_castps_si256(f), hi = _mm256_srli_epi32(x, 16);
  __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
  __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), nan,
                            _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

AVX2_F16C static inline __m256i bf_pack(__m256 lo, __m256 hi) {
  return _mm256_packus_epi32(bf_round(lo), bf_round(hi)); /* every value fits in 16 bits */
}

AVX2_F16C static inline void bf16_step(enum dtype_op op, uint16_t *d, const uint16_t *s) {
  __m256i a = _mm256_loadu_si256((const __m256i *)d), b = _mm256_loadu_si256((const __m256i *)s);
  __m256i r = bf_pack(op8(op, bf_lo(a), bf_lo(b)), op8(op, bf_hi(a), bf_hi(b)));
  _mm256_storeu_si256((__m256i *)d, r);
}

AVX2_F16C static inline void combine_bf16(enum dtype_op op, uint16_t *restrict d,
                                          const uint16_t *restrict s, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) bf16_step(op, d + i, s + i);
  if (i < n) {
    uint16_t a[16] = {0}, b[16] = {0};
    memcpy(a, d + i, (n - i) * 2);
    memcpy(b, s + i, (n - i) * 2);
    bf16_step(op, a, b);
    memcpy(d + i, a, (n - i) * 2);
  }
}

AVX2_F16C static void add_bf16(void *restrict d, const void *restrict s, size_t n) {
  combine_bf16(DTYPE_ADD, d, s, n);
}
AVX2_F16C static void max_bf16(void *restrict d, const void *restrict s, size_t n) {
  combine_bf16(DTYPE_MAX, d, s, n);
}
AVX2_F16C static void min_bf16(void *restrict d, const void *restrict s, size_t n) {
  combine_bf16(DTYPE_MIN, d, s, n);
}

AVX2_F16C static inline void bf16_scale_step(uint16_t *p, __m256 m) {
  __m256i a = _mm256_loadu_si256((const __m256i *)p);
  __m256i r = bf_pack(_mm256_mul_ps(bf_lo(a), m), _mm256_mul_ps(bf_hi(a), m));
  _mm256_storeu_si256((__m256i *)p, r);
}

AVX2_F16C static void scale_bf16(void *bufv, size_t n, float a) {
  uint16_t *buf = bufv;
  const __m256 m = _mm256_set1_ps(a);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) bf16_scale_step(buf + i, m);
  if (i < n) {
    uint16_t x[16] = {0};
    memcpy(x, buf + i, (n - i) * 2);
    bf16_scale_step(x, m);
    memcpy(buf + i, x, (n - i) * 2);
  }
}

dtype_kernel dtype_cpu_combine(enum dtype t, enum dtype_op op) {
  static const dtype_kernel f16[3] = {add_f16, max_f16, min_f16};
  static const dtype_kernel bf16[3] = {add_bf16, max_bf16, min_bf16};
  if ((t != DTYPE_FLOAT16 && t != DTYPE_BFLOAT16) || !usable()) return NULL;
  return (t == DTYPE_FLOAT16 ? f16 : bf16)[op];
}

dtype_scaler dtype_cpu_scale(enum dtype t) {
  if ((t != DTYPE_FLOAT16 && t != DTYPE_BFLOAT16) || !usable()) return NULL;
  return t == DTYPE_FLOAT16 ? scale_f16 : scale_bf16;
}
