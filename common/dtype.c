/* dtype: see dtype.h. One plain loop per (type, operation), written so the
 * compiler vectorises it (the 16-bit conversions are branch-free bit
 * arithmetic, not table lookups or libgcc calls); float32 is tensor_math's.
 * Integers add as their unsigned counterparts, which wrap without undefined
 * behaviour and give the two's complement bits for the signed ones. */
#include "dtype.h"

#include <string.h>

#include "clones.h"
#include "dtype_impl.h"
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

static const dtype_kernel kernels[DTYPE_COUNT][3] = {
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
  if (!n) return;
  dtype_kernel k = dtype_cpu_combine(t, op);
  (k ? k : kernels[t][op])(dst, src, n);
}

/* Integers: C's division (toward zero). Up to 32 bits through double, which
 * vectorises where integer division does not: the quotient of two integers
 * below 2^32 is within 2^-21 of its double, less than the 1/w that
 * separates it from the next integer while w < 2^20, so truncating the
 * double gives C's quotient (and with w >= 2 it fits an int32, whose
 * conversion vectorises too). Else (64 bits, or a huge w) in 64-bit
 * integers. */
#define DIVIDE(name, T, W)                                                       \
  CLONES static void name(void *bufv, size_t n, W w) {                           \
    T *buf = bufv;                                                               \
    if (w == 1) return;                                                          \
    if (sizeof(T) <= 4 && w < (1 << 20)) {                                       \
      const double dw = (double)w;                                               \
      for (size_t i = 0; i < n; i++) buf[i] = (T)(int32_t)((double)buf[i] / dw); \
    } else {                                                                     \
      for (size_t i = 0; i < n; i++) buf[i] = (T)((W)buf[i] / w);                \
    }                                                                            \
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

CLONES static void scale_f16(void *bufv, size_t n, float a) {
  uint16_t *buf = bufv;
  for (size_t i = 0; i < n; i++) buf[i] = float_half(half_float(buf[i]) * a);
}

CLONES static void scale_bf16(void *bufv, size_t n, float a) {
  uint16_t *buf = bufv;
  for (size_t i = 0; i < n; i++) buf[i] = float_bf16(bf16_float(buf[i]) * a);
}

void dtype_divide(enum dtype t, void *buf, size_t n, int world) {
  if (t == DTYPE_FLOAT16 || t == DTYPE_BFLOAT16) {
    dtype_scaler k = dtype_cpu_scale(t);
    (k ? k : t == DTYPE_FLOAT16 ? scale_f16 : scale_bf16)(buf, n, 1.0f / (float)world);
    return;
  }
  switch (t) {
    case DTYPE_FLOAT32:
      tm_scale(buf, 1.0f / (float)world, n);
      break;
    case DTYPE_FLOAT64:
      scale_f64(buf, n, 1.0 / (double)world);
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
