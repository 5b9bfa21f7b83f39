/* server_argv: builds a ps-server argv into a fixed struct (server_argv.h). */
#include "server_argv.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

static char *text(struct server_argv *a) {
  if (a->num_text >= SERVER_ARGV_TEXTS) {
    a->overflow = true;
    return NULL;
  }
  return a->text[a->num_text++];
}

void server_argv_add(struct server_argv *a, const char *flag, const char *value) {
  if (!value) return;
  if (a->argc + 2 > SERVER_ARGV_MAX) {
    a->overflow = true;
    return;
  }
  a->argv[a->argc++] = flag;
  a->argv[a->argc++] = value;
  a->argv[a->argc] = NULL;
}

static void add_int(struct server_argv *a, const char *flag, long long x) {
  char *t = text(a);
  if (!t) return;
  snprintf(t, sizeof(a->text[0]), "%lld", x);
  server_argv_add(a, flag, t);
}

void server_argv_init(struct server_argv *a, const char *bin, const char *listen,
                      const char *port_file, int shard, int num_shards, int num_workers) {
  a->argc = 0;
  a->num_text = 0;
  a->overflow = false;
  a->argv[a->argc++] = bin;
  a->argv[a->argc] = NULL;
  server_argv_add(a, "--listen", listen);
  server_argv_add(a, "--port-file", port_file);
  add_int(a, "--shard", shard);
  add_int(a, "--num-shards", num_shards);
  add_int(a, "--num-workers", num_workers);
}

void server_argv_format_double(double x, char *buf, size_t len) {
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, len, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) return;
  }
}

void server_argv_add_double(struct server_argv *a, const char *flag, double x) {
  char *t = text(a);
  if (!t) return;
  server_argv_format_double(x, t, sizeof(a->text[0]));
  server_argv_add(a, flag, t);
}

void server_argv_add_u64(struct server_argv *a, const char *flag, uint64_t x) {
  char *t = text(a);
  if (!t) return;
  snprintf(t, sizeof(a->text[0]), "%" PRIu64, x);
  server_argv_add(a, flag, t);
}

const char *const *server_argv_get(const struct server_argv *a) {
  return a->overflow ? NULL : a->argv;
}
