/* blas_cpu_x86: what an x86_64 CPU and its OS let a BLAS kernel use
 * (blas_kernel_impl.h), from cpuid and XGETBV. meson builds it on x86_64
 * and blas_cpu_none.c elsewhere (docs/ARCHITECTURE.md, Conventions).
 *
 * A feature counts only if the OS saves its registers on a context switch:
 * the AVX family (AVX, FMA, FMA4, AVX2) needs XCR0's SSE and YMM bits, the
 * AVX-512 family also its opmask, ZMM_Hi256 and Hi16_ZMM bits. A CPU that
 * has AVX-512 under an OS (or hypervisor) that does not enable it reports
 * none of it: a kernel using it would fault. */
#include <cpuid.h>
#include <stdint.h>
#include <string.h>

#include "blas_kernel_impl.h"

/* XCR0 bits: x87, SSE, AVX (YMM upper halves); opmask, ZMM_Hi256, Hi16_ZMM. */
#define XCR0_YMM 0x6u
#define XCR0_ZMM 0xe6u

static uint32_t xcr0(void) {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return eax;
}

void blas_cpu_detect(struct blas_cpu *out) {
  unsigned a, b, c, d;
  memset(out, 0, sizeof(*out));
  out->x86_64 = true;
  out->features = BLAS_SSE2; /* in every x86_64 CPU */
  if (!__get_cpuid(0, &a, &b, &c, &d)) return;
  unsigned max_leaf = a;
  memcpy(out->vendor_id, &b, 4);
  memcpy(out->vendor_id + 4, &d, 4);
  memcpy(out->vendor_id + 8, &c, 4);
  out->vendor_id[12] = '\0';
  if (strcmp(out->vendor_id, "GenuineIntel") == 0)
    out->vendor = BLAS_VENDOR_INTEL;
  else if (strcmp(out->vendor_id, "AuthenticAMD") == 0 ||
           strcmp(out->vendor_id, "HygonGenuine") == 0)
    out->vendor = BLAS_VENDOR_AMD;

  __get_cpuid(1, &a, &b, &c, &d);
  int family = (int)((a >> 8) & 0xf), model = (int)((a >> 4) & 0xf);
  if (family == 0xf) family += (int)((a >> 20) & 0xff);
  if (family == 0x6 || family >= 0xf) model += (int)((a >> 16) & 0xf) << 4;
  out->family = family;
  out->model = model;
  uint32_t f = out->features;
  if (c & bit_SSE3) f |= BLAS_SSE3;
  if (c & bit_SSSE3) f |= BLAS_SSSE3;
  if (c & bit_SSE4_1) f |= BLAS_SSE41;
  if (c & bit_SSE4_2) f |= BLAS_SSE42;
  bool ymm = (c & bit_OSXSAVE) && (xcr0() & XCR0_YMM) == XCR0_YMM;
  bool zmm = ymm && (xcr0() & XCR0_ZMM) == XCR0_ZMM;
  if (ymm && (c & bit_AVX)) f |= BLAS_AVX;
  if (ymm && (c & bit_FMA)) f |= BLAS_FMA3;

  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    unsigned max_sub = a;
    if (ymm && (b & bit_AVX2)) f |= BLAS_AVX2;
    if (zmm) {
      if (b & bit_AVX512F) f |= BLAS_AVX512F;
      if (b & bit_AVX512DQ) f |= BLAS_AVX512DQ;
      if (b & bit_AVX512CD) f |= BLAS_AVX512CD;
      if (b & bit_AVX512BW) f |= BLAS_AVX512BW;
      if (b & bit_AVX512VL) f |= BLAS_AVX512VL;
      if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if (a & bit_AVX512BF16) f |= BLAS_AVX512BF16; /* CPUID.(7,1):EAX */
      }
    }
  }
  if (__get_cpuid(0x80000000, &a, &b, &c, &d) && a >= 0x80000001) {
    __get_cpuid(0x80000001, &a, &b, &c, &d);
    if (c & bit_SSE4a) f |= BLAS_SSE4A;
    if (ymm && (c & bit_FMA4)) f |= BLAS_FMA4;
  }
  out->features = f;
}
