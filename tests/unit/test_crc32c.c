/* CRC32C against known vectors (RFC 3720 B.4, "123456789"), the SSE4.2 and
 * table kernels against each other on random data, and incremental use (any
 * split of a buffer gives the checksum of the whole). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "check.h"

int main(void) {
  unsigned char buf[4096];
  CHECK(crc32c_update(0, "123456789", 9) == 0xE3069283u, "%08x", crc32c_update(0, "123456789", 9));
  CHECK(crc32c_update_table(0, "123456789", 9) == 0xE3069283u, "table");
  memset(buf, 0, 32);
  CHECK(crc32c_update(0, buf, 32) == 0x8A9136AAu, "32 zeros: %08x", crc32c_update(0, buf, 32));
  memset(buf, 0xff, 32);
  CHECK(crc32c_update(0, buf, 32) == 0x62A8AB43u, "32 ones: %08x", crc32c_update(0, buf, 32));
  for (int i = 0; i < 32; i++) buf[i] = (unsigned char)i;
  CHECK(crc32c_update(0, buf, 32) == 0x46DD794Eu, "0..31: %08x", crc32c_update(0, buf, 32));
  CHECK(crc32c_update(0, buf, 0) == 0, "empty");

  srand(7);
  for (size_t i = 0; i < sizeof(buf); i++) buf[i] = (unsigned char)rand();
  for (size_t n = 0; n < 300; n++) {
    size_t off = (size_t)rand() % 8, len = (size_t)rand() % (sizeof(buf) - 8);
    uint32_t a = crc32c_update(0, buf + off, len), b = crc32c_update_table(0, buf + off, len);
    CHECK(a == b, "kernels differ at off %zu len %zu", off, len);
    size_t cut = len ? (size_t)rand() % len : 0;
    uint32_t c = crc32c_update(crc32c_update(0, buf + off, cut), buf + off + cut, len - cut);
    CHECK(c == a, "split at %zu of %zu", cut, len);
  }
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
