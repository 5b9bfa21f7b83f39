/* test_server_argv: the one ps-server command-line builder (server_argv.c):
 * the fixed part in order, pairs in the caller's order, a NULL value left
 * out, doubles in their shortest exact form, and a full argv refused rather
 * than cut. Exit 0 = pass, 1 = fail. */
#include "server_argv.h"

#include <stdio.h>
#include <string.h>

#include "check.h"

/* The argv joined with spaces. */
static void join(const char *const *argv, char *buf, size_t len) {
  buf[0] = '\0';
  for (int i = 0; argv && argv[i]; i++) {
    size_t n = strlen(buf);
    snprintf(buf + n, len - n, "%s%s", i ? " " : "", argv[i]);
  }
}

int main(void) {
  struct server_argv a;
  char got[1024];
  server_argv_init(&a, "/b/ps-server", "127.0.0.1:0", "/t/s.port", 3, 4, 2);
  server_argv_add(&a, "--http", "");
  server_argv_add(&a, "--worker-timeout", NULL);
  server_argv_add_double(&a, "--lr", 0.1);
  server_argv_add_double(&a, "--momentum", 1.0 / 3);
  server_argv_add_u64(&a, "--lr-decay-steps", 18446744073709551615u);
  join(server_argv_get(&a), got, sizeof(got));
  CHECK(strcmp(got,
               "/b/ps-server --listen 127.0.0.1:0 --port-file /t/s.port --shard 3 --num-shards 4 "
               "--num-workers 2 --http  --lr 0.1 --momentum 0.3333333333333333 --lr-decay-steps "
               "18446744073709551615") == 0);
  CHECK(a.argc == 19 && server_argv_get(&a)[19] == NULL);

  char d[48];
  server_argv_format_double(0.2, d, sizeof(d));
  CHECK(strcmp(d, "0.2") == 0);
  server_argv_format_double(1e-8, d, sizeof(d));
  CHECK(strcmp(d, "1e-08") == 0);

  /* Full: refused as a whole. */
  server_argv_init(&a, "ps-server", "h:1", "p", 0, 1, 1);
  for (int i = 0; i < SERVER_ARGV_MAX; i++) server_argv_add(&a, "--x", "y");
  CHECK(a.overflow && server_argv_get(&a) == NULL);
  server_argv_init(&a, "ps-server", "h:1", "p", 0, 1, 1);
  for (int i = 0; i < SERVER_ARGV_TEXTS; i++) server_argv_add_u64(&a, "--n", (uint64_t)i);
  CHECK(a.overflow && server_argv_get(&a) == NULL);
  if (failures) {
    fprintf(stderr, "test_server_argv: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_server_argv: ok\n");
  return 0;
}
