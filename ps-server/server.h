/* server: the shard daemon's event loop, connections and message handlers.
 *
 * One libuv loop per process. Each connection is a small state machine:
 *
 *   HELLO --hello ok--> READY --(bad frame | error | peer EOF)--> CLOSING
 *     |                   ^ layout/init/push/pull/barrier/stats/shutdown
 *     +--bad frame / anything but hello--> CLOSING
 *
 * In CLOSING the connection reads nothing more; an error frame naming the
 * problem is written first when the stream is still in sync, then the handle
 * is closed and its memory freed in the close callback. One misbehaving
 * client never affects the others. Messages dispatch through a table of
 * handlers indexed by type. */
#ifndef PS_SERVER_H
#define PS_SERVER_H

#include <stdint.h>

#include "optimizer.h"

struct server_opts {
  const char *listen;    /* "host:port"; port 0 picks a free one */
  const char *port_file; /* if set, the bound "host:port" is written here */
  uint32_t shard, num_shards, num_workers;
  struct opt_params opt;
  uint64_t max_frame_bytes;
  uint32_t max_header_bytes;
};

/* Runs the shard until SIGINT/SIGTERM or a SHUTDOWN from worker 0.
 * Returns 0 on a clean stop, or a negative errno if it could not start. */
int server_run(const struct server_opts *opts);

#endif
