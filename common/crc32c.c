/* crc32c: slicing-by-8 tables built once (pthread_once) and an SSE4.2 kernel
 * built with __attribute__((target("sse4.2"))) so the rest of the binary
 * needs no -msse4.2; __builtin_cpu_supports picks one at the first call.
 * Both operate on the reflected polynomial 0x82F63B78 with the usual ~crc
 * pre- and post-conditioning, so crc32c_update(crc32c_update(0, a), b) equals
 * the checksum of a followed by b. */
#include "crc32c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_build(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (POLY & (0u - (c & 1u)));
    table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

uint32_t crc32c_update_table(uint32_t crc, const void *p, size_t n) {
  pthread_once(&table_once, table_build);
  const unsigned char *b = p;
  uint32_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, b, 8);
    w ^= c; /* little-endian hosts only (x86-64, aarch64) */
    c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
        table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
        table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
    b += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ table[0][(c ^ *b++) & 0xff];
  return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_update_sse42(uint32_t crc, const void *p,
                                                                      size_t n) {
  const unsigned char *b = p;
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, b, 8);
    c = __builtin_ia32_crc32di(c, w);
    b += 8;
    n -= 8;
  }
  uint32_t c32 = (uint32_t)c;
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *b++);
  return ~c32;
}

uint32_t crc32c_update(uint32_t crc, const void *p, size_t n) {
  static _Atomic int have = -1; /* every thread that races here stores the same value */
  int h = atomic_load_explicit(&have, memory_order_relaxed);
  if (h < 0) {
    __builtin_cpu_init();
    h = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    atomic_store_explicit(&have, h, memory_order_relaxed);
  }
  return h ? crc32c_update_sse42(crc, p, n) : crc32c_update_table(crc, p, n);
}
#else
uint32_t crc32c_update(uint32_t crc, const void *p, size_t n) {
  return crc32c_update_table(crc, p, n);
}
#endif
