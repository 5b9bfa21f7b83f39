/* dtype: see dtype.h. One plain loop per (type, operation), written so the
 * compiler vectorises it (the 16-bit conversions are branch-free bit
 * arithmetic, not table lookups or libgcc calls); float32 is tensor_math's.
 * Integers add as their unsigned counterparts, which wrap without undefined
 * behaviour and give the two's complement bits for the signed ones. */
#include "dtype.h"

#include <string.h>

#include "clones.h"
#include "tensor_math.h"

static const struct {
  const char *name;
  size_t size;
} types[DTYPE_COUNT] = {
    [DTYPE_FLOAT32] = {"float32", 4}, [DTYPE_FLOAT64] = {"float64", 8},
    [DTYPE_FLOAT16] = {"float16", 2}, [DTYPE_BFLOAT16] = {"bfloat16", 2},
    [DTYPE_INT8] = {"int8", 1},       [DTYPE_UINT8] = {"uint8", 1},
    [DTYPE_INT32] = {"int32", 4},     [DTYPE_UINT32] = {"uint32", 4},
    [DTYPE_INT64] = {"int64", 8},     [DTYPE_UINT64] = {"uint64", 8},
};

size_t dtype_size(int t) {
  return t >= 0 && t < DTYPE_COUNT ? types[t].size : 0;
}

const char *dtype_name(int t) {
  return t >= 0 && t < DTYPE_COUNT ? types[t].name : "?";
}

/* ---- 16-bit floats ---- */

static inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

static inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

/* c ? a : b without a branch: the vectoriser will not if-convert the
 * nested choices below by itself. */
static inline uint32_t pick(int c, uint32_t a, uint32_t b) {
  uint32_t m = -(uint32_t)c;
  return (a & m) | (b & ~m);
}

/* Exponent and mantissa move up 13 bits; a normal number's exponent is
 * rebiased (+112), infinity and NaN keep an all-ones exponent (+224), and a
 * subnormal is its mantissa times 2^-24, exact in float. */
static inline float half_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
  uint32_t normal = (em << 13) + pick(em >= 0x7c00u, 224u << 23, 112u << 23);
  uint32_t sub = float_bits((float)(int32_t)em * 0x1p-24f);
  return bits_float(pick(em < 0x400u, sub, normal) | sign);
}

/* Round to nearest-even. Normal results: rebias, then add half an ulp of the
 * half (0xfff, plus the kept bit for ties to even) and drop 13 bits; a carry
 * into the exponent is the right rounding, up to infinity. Subnormal
 * results: adding 0.5f puts 2^-24 (the half's smallest step) at float's
 * last bit, so the FPU rounds, and the low bits are the half's. */
static inline uint16_t float_half(float f) {
  uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  uint32_t t = a - (112u << 23);
  uint32_t normal = (t + 0x0fffu + ((t >> 13) & 1u)) >> 13;
  uint32_t sub = float_bits(bits_float(a) + 0.5f) - float_bits(0.5f);
  uint32_t big = pick(a > 0x7f800000u, 0x7e00u, 0x7c00u); /* NaN, or infinity */
  uint32_t r = pick(a >= 0x47800000u, big, pick(a < 0x38800000u, sub, normal));
  return (uint16_t)(r | sign);
}

static inline float bf16_float(uint16_t b) {
  return bits_float((uint32_t)b << 16);
}

/* Round to nearest-even by adding half an ulp (and the kept bit); a NaN
 * keeps its sign and top bits, made quiet. */
static inline uint16_t float_bf16(float f) {
  uint32_t x = float_bits(f);
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (uint16_t)pick((x & 0x7fffffffu) > 0x7f800000u, (x >> 16) | 0x40u, rounded);
}

float dtype_half_to_float(uint16_t h) {
  return half_float(h);
}
uint16_t dtype_float_to_half(float f) {
  return float_half(f);
}
float dtype_bf16_to_float(uint16_t b) {
  return bf16_float(b);
}
uint16_t dtype_float_to_bf16(float f) {
  return float_bf16(f);
}

/* ---- kernels ---- */

/* NaN wins, as tm_max: a NaN anywhere is not hidden */
#define FMAX(a, b) ((b) > (a) || (b) != (b) ? (b) : (a))
#define FMIN(a, b) ((b) < (a) || (b) != (b) ? (b) : (a))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))

/* name(dst, src, n) on T: dst[i] = EXPR(dst[i], src[i]) */
#define KERNEL(name, T, EXPR)                                                         \
  CLONES static void name(void *restrict dstv, const void *restrict srcv, size_t n) { \
    T *restrict dst = dstv;                                                           \
    const T *restrict src = srcv;                                                     \
    for (size_t i = 0; i < n; i++) dst[i] = (T)EXPR(dst[i], src[i]);                  \
  }
#define ADD(a, b) ((a) + (b))
KERNEL(add_u8, uint8_t, ADD)
KERNEL(add_u32, uint32_t, ADD)
KERNEL(add_u64, uint64_t, ADD)
KERNEL(add_f64, double, ADD)
KERNEL(max_f64, double, FMAX)
KERNEL(min_f64, double, FMIN)
KERNEL(max_i8, int8_t, IMAX)
KERNEL(min_i8, int8_t, IMIN)
KERNEL(max_u8, uint8_t, IMAX)
KERNEL(min_u8, uint8_t, IMIN)
KERNEL(max_i32, int32_t, IMAX)
KERNEL(min_i32, int32_t, IMIN)
KERNEL(max_u32, uint32_t, IMAX)
KERNEL(min_u32, uint32_t, IMIN)
KERNEL(max_i64, int64_t, IMAX)
KERNEL(min_i64, int64_t, IMIN)
KERNEL(max_u64, uint64_t, IMAX)
KERNEL(min_u64, uint64_t, IMIN)

/* The 16-bit floats: through float32, rounded back at every element. */
#define KERNEL16(name, TO, FROM, EXPR)                                                \
  CLONES static void name(void *restrict dstv, const void *restrict srcv, size_t n) { \
    uint16_t *restrict dst = dstv;                                                    \
    const uint16_t *restrict src = srcv;                                              \
    for (size_t i = 0; i < n; i++) {                                                  \
      float a = TO(dst[i]), b = TO(src[i]);                                           \
      dst[i] = FROM(EXPR(a, b));                                                      \
    }                                                                                 \
  }
KERNEL16(add_f16, half_float, float_half, ADD)
KERNEL16(max_f16, half_float, float_half, FMAX)
KERNEL16(min_f16, half_float, float_half, FMIN)
KERNEL16(add_bf16, bf16_float, float_bf16, ADD)
KERNEL16(max_bf16, bf16_float, float_bf16, FMAX)
KERNEL16(min_bf16, bf16_float, float_bf16, FMIN)

static void add_f32(void *restrict d, const void *restrict s, size_t n) {
  tm_add(d, s, n);
}
static void max_f32(void *restrict d, const void *restrict s, size_t n) {
  tm_max(d, s, n);
}
static void min_f32(void *restrict d, const void *restrict s, size_t n) {
  tm_min(d, s, n);
}

static void (*const kernels[DTYPE_COUNT][3])(void *restrict, const void *restrict, size_t) = {
    [DTYPE_FLOAT32] = {add_f32, max_f32, min_f32},
    [DTYPE_FLOAT64] = {add_f64, max_f64, min_f64},
    [DTYPE_FLOAT16] = {add_f16, max_f16, min_f16},
    [DTYPE_BFLOAT16] = {add_bf16, max_bf16, min_bf16},
    [DTYPE_INT8] = {add_u8, max_i8, min_i8},
    [DTYPE_UINT8] = {add_u8, max_u8, min_u8},
    [DTYPE_INT32] = {add_u32, max_i32, min_i32},
    [DTYPE_UINT32] = {add_u32, max_u32, min_u32},
    [DTYPE_INT64] = {add_u64, max_i64, min_i64},
    [DTYPE_UINT64] = {add_u64, max_u64, min_u64},
};

void dtype_combine(enum dtype t, enum dtype_op op, void *restrict dst, const void *restrict src,
                   size_t n) {
  if (n) kernels[t][op](dst, src, n);
}

/* Integers: C's division (toward zero), in 64 bits so any world size works */
#define DIVIDE(name, T, W)                                      \
  static void name(void *bufv, size_t n, W w) {                 \
    T *buf = bufv;                                              \
    for (size_t i = 0; i < n; i++) buf[i] = (T)((W)buf[i] / w); \
  }
DIVIDE(div_i8, int8_t, int64_t)
DIVIDE(div_u8, uint8_t, uint64_t)
DIVIDE(div_i32, int32_t, int64_t)
DIVIDE(div_u32, uint32_t, uint64_t)
DIVIDE(div_i64, int64_t, int64_t)
DIVIDE(div_u64, uint64_t, uint64_t)

CLONES static void scale_f64(double *buf, size_t n, double a) {
  for (size_t i = 0; i < n; i++) buf[i] *= a;
}

CLONES static void scale_f16(uint16_t *buf, size_t n, float a) {
  for (size_t i = 0; i < n; i++) buf[i] = float_half(half_float(buf[i]) * a);
}

CLONES static void scale_bf16(uint16_t *buf, size_t n, float a) {
  for (size_t i = 0; i < n; i++) buf[i] = float_bf16(bf16_float(buf[i]) * a);
}

void dtype_divide(enum dtype t, void *buf, size_t n, int world) {
  switch (t) {
    case DTYPE_FLOAT32:
      tm_scale(buf, 1.0f / (float)world, n);
      break;
    case DTYPE_FLOAT64:
      scale_f64(buf, n, 1.0 / (double)world);
      break;
    case DTYPE_FLOAT16:
      scale_f16(buf, n, 1.0f / (float)world);
      break;
    case DTYPE_BFLOAT16:
      scale_bf16(buf, n, 1.0f / (float)world);
      break;
    case DTYPE_INT8:
      div_i8(buf, n, world);
      break;
    case DTYPE_UINT8:
      div_u8(buf, n, (uint64_t)world);
      break;
    case DTYPE_INT32:
      div_i32(buf, n, world);
      break;
    case DTYPE_UINT32:
      div_u32(buf, n, (uint64_t)world);
      break;
    case DTYPE_INT64:
      div_i64(buf, n, world);
      break;
    case DTYPE_UINT64:
      div_u64(buf, n, (uint64_t)world);
      break;
    default:
      break;
  }
}
