/* server-argv: prints the ps-server command line common/server_argv.c
 * builds, for the Python test harness (tests/torch/harness.py), which cannot
 * link C: server-argv BIN LISTEN PORT_FILE SHARD NUM_SHARDS NUM_WORKERS
 * [FLAG VALUE]... writes each element followed by a NUL byte. Exit 2 on
 * bad usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_argv.h"

int main(int argc, char **argv) {
  if (argc < 7 || (argc - 7) % 2) {
    fprintf(
        stderr,
        "usage: server-argv BIN LISTEN PORT_FILE SHARD NUM_SHARDS NUM_WORKERS [FLAG VALUE]...\n");
    return 2;
  }
  struct server_argv a;
  server_argv_init(&a, argv[1], argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));
  for (int i = 7; i + 1 < argc; i += 2) server_argv_add(&a, argv[i], argv[i + 1]);
  const char *const *out = server_argv_get(&a);
  if (!out) {
    fprintf(stderr, "server-argv: too many arguments\n");
    return 2;
  }
  for (int i = 0; out[i]; i++) fwrite(out[i], 1, strlen(out[i]) + 1, stdout);
  return 0;
}
