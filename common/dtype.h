/* dtype: the element types of the reducing collectives (NCCL's set: float32,
 * float64, float16, bfloat16 and 8-, 32- and 64-bit integers, signed and
 * unsigned) and the arithmetic the ring does on them: combine two buffers
 * element-wise (add, max, min) and the mean's final division. Built at -O3
 * with target_clones, like tensor_math, which float32 goes through.
 *
 * Semantics, chosen to match torch's CPU arithmetic on the same type:
 *  - float16 and bfloat16 are added (compared, divided) in float32 and
 *    rounded back to nearest-even at every step, as torch does for a + b;
 *  - integers add modulo 2^bits (two's complement for the signed ones);
 *  - max and min: a NaN on either side is the result (floating types);
 *  - the mean: floating types multiply the sum by 1/W (in float32 for the
 *    16-bit types), integers divide it by W, truncating toward zero (C's
 *    division, as NCCL's ncclAvg). */
#ifndef PS_DTYPE_H
#define PS_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The numbers are the wire's (ring op header) and libps's ps_dtype. */
enum dtype {
  DTYPE_FLOAT32 = 0,
  DTYPE_FLOAT64 = 1,
  DTYPE_FLOAT16 = 2,
  DTYPE_BFLOAT16 = 3,
  DTYPE_INT8 = 4,
  DTYPE_UINT8 = 5,
  DTYPE_INT32 = 6,
  DTYPE_UINT32 = 7,
  DTYPE_INT64 = 8,
  DTYPE_UINT64 = 9,
  DTYPE_COUNT
};

enum dtype_op { DTYPE_ADD, DTYPE_MAX, DTYPE_MIN };

/* Bytes per element; 0 for a number that is no dtype. */
size_t dtype_size(int t);
/* "float32", "int64", ...; "?" for a number that is no dtype. */
const char *dtype_name(int t);

/* dst[i] = dst[i] (op) src[i] for n elements of type t. */
void dtype_combine(enum dtype t, enum dtype_op op, void *restrict dst, const void *restrict src,
                   size_t n);
/* buf[i] = buf[i] / world, the last step of a mean (see above). */
void dtype_divide(enum dtype t, void *buf, size_t n, int world);

/* One value: IEEE half and bfloat16 to float32 (exact), and back rounded to
 * nearest-even (a NaN stays a quiet NaN, overflow becomes infinity). */
float dtype_half_to_float(uint16_t h);
uint16_t dtype_float_to_half(float f);
float dtype_bf16_to_float(uint16_t b);
uint16_t dtype_float_to_bf16(float f);

#endif
