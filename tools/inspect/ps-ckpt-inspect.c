/* ps-ckpt-inspect: prints a shard checkpoint's header, layout (tensors) and
 * keys with their versions and record checksums, then says whether the file
 * is valid (every record CRC32C and the whole-file CRC32C checked, see
 * ps-server/ckpt.h). Exit 0 if every file given is valid, 1 if one is not,
 * 2 on bad usage. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"
#include "optimizer.h"

static const char *consistency(uint32_t c) {
  return c == 0 ? "bsp" : c == 1 ? "asp" : c == 2 ? "ssp" : "?";
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    fprintf(argc < 2 ? stderr : stdout,
            "usage: ps-ckpt-inspect FILE.ckpt...\n"
            "prints each checkpoint's header, tensors, keys and checksums and whether it is "
            "valid;\nexit 0 if all are valid, 1 otherwise\n");
    return argc < 2 ? 2 : 0;
  }
  int bad = 0;
  for (int i = 1; i < argc; i++) {
    struct ckpt_info info;
    char err[400] = "";
    printf("file: %s\n", argv[i]);
    int r = ckpt_verify(argv[i], &info, stdout, err, sizeof(err));
    if (info.format_version) {
      time_t t = (time_t)info.unix_s;
      char when[64] = "";
      strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
      printf(
          "header: format %u shard %u of %u workers %u clock %llu records %u\n"
          "        layout_hash %016llx optimizer %s consistency %s",
          info.format_version, info.shard, info.num_shards, info.num_workers,
          (unsigned long long)info.clock, info.records, (unsigned long long)info.layout_hash,
          info.opt_kind <= OPT_SUM ? opt_name((enum opt_kind)info.opt_kind) : "?",
          consistency(info.consistency));
      if (info.consistency == 2) printf(":%u", info.staleness);
      printf(" written %s\n", when);
      if (info.format_version >= 2)
        printf("job: \"%s\"%s\n", info.job, info.job[0] ? "" : " (the unnamed job)");
      else
        printf("job: unknown (format 1: counts as the unnamed job)\n");
    }
    printf("size: %llu bytes  file crc32c: %08x\n", (unsigned long long)info.bytes, info.file_crc);
    if (r == 0) {
      printf("valid\n");
    } else {
      printf("INVALID: %s\n", err);
      bad = 1;
    }
  }
  return bad;
}
