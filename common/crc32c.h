/* crc32c: the Castagnoli CRC (iSCSI, ext4, RocksDB) that guards checkpoint
 * records and files. Incremental: crc32c_update(0, ...) starts a checksum and
 * each call continues it, so a file's checksum can be computed as it streams.
 * The kernel uses SSE4.2's crc32 instruction where the CPU has it (a
 * function built with a target attribute, chosen once at run time) and a
 * slicing-by-8 table otherwise; both give the same value. Known vector:
 * crc32c("123456789") = 0xE3069283. */
#ifndef PS_CRC32C_H
#define PS_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continues crc (0 to start) over n bytes of p. */
uint32_t crc32c_update(uint32_t crc, const void *p, size_t n);

/* The portable table kernel, exported so tests can compare both. */
uint32_t crc32c_update_table(uint32_t crc, const void *p, size_t n);

#endif
