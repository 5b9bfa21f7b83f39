/* dtype_impl: what dtype.c shares with the CPU-specific kernels of the
 * 16-bit floats (dtype_x86.c, dtype_cpu_none.c): the portable conversions,
 * one element at a time (inline, so loops of them vectorise), and the hook
 * that offers faster kernels where the CPU has them. Internal to common. */
#ifndef PS_DTYPE_IMPL_H
#define PS_DTYPE_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"

typedef void (*dtype_kernel)(void *restrict dst, const void *restrict src, size_t n);
typedef void (*dtype_scaler)(void *buf, size_t n, float a);

/* A kernel of this CPU's for (t, op) or NULL (use the portable one); the
 * same bits as the portable kernel, NaN payloads included. */
dtype_kernel dtype_cpu_combine(enum dtype t, enum dtype_op op);
/* buf[i] *= a for a 16-bit float type, rounded back; or NULL. */
dtype_scaler dtype_cpu_scale(enum dtype t);

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
  /* a NaN keeps its top payload bits, made quiet (as F16C's vcvtps2ph) */
  uint32_t big = pick(a > 0x7f800000u, 0x7e00u | ((a >> 13) & 0x3ffu), 0x7c00u);
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

#endif
