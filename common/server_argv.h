/* server_argv: the one builder of a ps-server command line. The launcher
 * (tools/local_run.c), ps-bench and the C test harness start shards through
 * it; the Python test harness (tests/torch/harness.py) runs a tiny program
 * over it (tests/torch/server_argv_tool.c), so no caller spells ps-server's
 * fixed part (--listen, --port-file, --shard, --num-shards, --num-workers)
 * on its own, and each adds its settings as (flag, value) pairs in its order.
 *
 * Everything lives in the struct (no allocation): values are pointers the
 * caller keeps alive until the argv is used, or text formatted into the
 * struct (numbers). A full argv sets overflow and server_argv_get returns
 * NULL, so a long command line is never cut silently. */
#ifndef PS_SERVER_ARGV_H
#define PS_SERVER_ARGV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { SERVER_ARGV_MAX = 64, SERVER_ARGV_TEXTS = 16 };

struct server_argv {
  const char *argv[SERVER_ARGV_MAX + 1];
  int argc;
  char text[SERVER_ARGV_TEXTS][48];
  int num_text;
  bool overflow;
};

/* bin --listen LISTEN --port-file PORT_FILE --shard i --num-shards S
 * --num-workers W. */
void server_argv_init(struct server_argv *a, const char *bin, const char *listen,
                      const char *port_file, int shard, int num_shards, int num_workers);
/* Appends flag (e.g. "--lr") and value; a NULL value appends nothing. */
void server_argv_add(struct server_argv *a, const char *flag, const char *value);
/* Appends flag and x in the shortest decimal form that reads back as x ("0.1",
 * not "0.10000000000000001"), so command lines show what the user typed. */
void server_argv_add_double(struct server_argv *a, const char *flag, double x);
/* x in the shortest decimal form that reads back as x, into buf. */
void server_argv_format_double(double x, char *buf, size_t len);
/* Appends flag and x in decimal. */
void server_argv_add_u64(struct server_argv *a, const char *flag, uint64_t x);
/* The NULL-terminated argv, or NULL if it overflowed. */
const char *const *server_argv_get(const struct server_argv *a);

#endif
