/* server: the shard daemon, server_run and its options.
 *
 * One libuv loop per process serves every worker; inside, server.c runs the
 * shard's lifecycle, conn.c its connections and handlers.c its messages
 * (server_impl.h: who owns what, who calls whom, the connection state
 * machine). This header says what a caller of server_run can rely on.
 *
 * Limits (docs/SECURITY.md, Resource limits; issue 8). At most max_connections at once (more are
 * closed at accept). Per connection: the handshake must finish within
 * handshake_timeout_ms, a frame once started within frame_timeout_ms, and a
 * connection with nothing received and no request waiting for
 * idle_timeout_ms is closed. Replies queued but not taken by the client
 * count against out_queue_bytes: above a quarter of it the shard stops reading
 * from that client until the queue drains to a sixteenth; above all of it the
 * connection is closed. At most max_waiting pulls may wait per connection.
 * TCP keepalive and TCP_USER_TIMEOUT drop peers that vanished without a FIN.
 * A bad frame gets an error frame naming the problem (when the stream is
 * still in sync) and closes its connection only.
 *
 * Worker liveness. A rank is away from the moment its last connection
 * closed (a rank never seen: from when the layout was registered). A rank
 * away for longer than worker_timeout_ms is acted on. With
 * WORKER_TIMEOUT_CONTINUE it is declared gone (store_worker_gone): BSP
 * steps and the barrier complete with the live workers, SSP stops waiting
 * for its clock; the job now trains without its data, which is never
 * silent: an error-level log line, ps_server_workers_lost_total and
 * Stats.lost_ranks say so. With WORKER_TIMEOUT_FAIL, once the shard
 * actually waits for the rank (store_blocked_on, or the barrier), every
 * waiting request gets ERR_WORKER_LOST naming the rank and the shard stops
 * (server_run returns -ENOTCONN). WORKER_TIMEOUT_AUTO is fail under
 * --optimizer sum (the parameters live on the workers: one restarted from
 * its initial values could not rejoin a job that went on without it) and
 * continue with an optimizer on the shard (a restarted worker pulls the
 * current parameters). A rank that left the steps (ps_leave) is declared
 * gone without either: its steps are all in. A rank that connects again
 * (hello with the same rank) is back at once (store_worker_back).
 *
 * Checkpoints (checkpoint_dir set; ckpt.h, ckpt_writer.h). On start the
 * shard loads its newest valid checkpoint (before it listens). In BSP, every
 * checkpoint_every versions each key is captured as it reaches that version
 * (a step boundary: its pushes all applied, nothing of the next step yet)
 * and the full snapshot goes to the writer thread. SIGTERM/SIGINT then stop
 * accepting and drain: pushes that complete a started step are taken, pushes
 * that would start a new one are held without a reply (the worker resends
 * them to the restarted shard), and once no step is unfinished (or after
 * 10 s) a final checkpoint is written and the shard exits 0. Any other stop
 * (SHUTDOWN, a failed job) also writes a final checkpoint. */
#ifndef PS_SERVER_H
#define PS_SERVER_H

#include <stdbool.h>
#include <stdint.h>

#include "optimizer.h"

struct shard_http;
struct auth_token;
#include "store.h"

enum worker_timeout_action {
  WORKER_TIMEOUT_AUTO = 0,
  WORKER_TIMEOUT_FAIL = 1,
  WORKER_TIMEOUT_CONTINUE = 2
};

/* Parses "auto", "fail" or "continue" (--on-worker-timeout); returns 0 or
 * -EINVAL. */
int server_timeout_action_parse(const char *s, enum worker_timeout_action *out);
/* Its config_check_fn (config.h): 0, or -EINVAL with the reason in err. */
int server_timeout_action_check(const char *value, char *err, size_t errlen);

/* What a shard counts of its clients' traffic, on its loop thread, where
 * frames cross the socket (the store counts what it computes: struct
 * store_stats). Totals since start; MSG_STATS and shard_http_publish read
 * them. */
struct server_traffic {
  uint64_t pulls;              /* pulls answered with values, at once or after waiting */
  uint64_t bytes_in;           /* preamble + header + payload of each frame whose header passed */
  uint64_t bytes_out;          /* every frame queued for sending, tags included */
  uint64_t rejected_frames;    /* clients refused with an error frame, then closed (conn_fail) */
  uint64_t auth_failures;      /* of those: failed handshakes and wrong tags */
  uint64_t rejected_nonfinite; /* pushes and inits refused for NaN/Inf (connection kept) */
  uint64_t dropped;            /* connections closed by a deadline or the output hard limit */
  uint64_t refused;            /* connections closed at accept above --max-connections */
  uint64_t rndv_in;            /* payloads the transport fetched by rendezvous into place */
  uint64_t silent;             /* beating workers' connections closed for silence */
  uint64_t workers_lost;       /* times the shard went on without a worker (continue) */
};

struct server_opts {
  const char *listen;    /* "host:port"; port 0 picks a free one */
  const char *transport; /* --transport: a name conn_transports.h lists (NULL = its default) */
  const char *port_file; /* if set, the bound "host:port" is written here */
  uint32_t shard, num_shards, num_workers;
  enum store_consistency consistency;
  uint32_t staleness;   /* ssp:K */
  bool staleness_aware; /* asp/ssp: updates scaled by their staleness (store.h) */
  enum store_staleness_method staleness_method;
  struct opt_params opt;
  uint64_t worker_timeout_ms; /* 0 = wait for a missing worker forever */
  enum worker_timeout_action on_worker_timeout;
  uint64_t first_worker_timeout_ms; /* no layout by then: stop, -ETIMEDOUT; 0 = wait forever */
  uint64_t max_frame_bytes;
  uint32_t max_header_bytes;
  struct shard_http *http;             /* metrics and probes (shard_http.h); NULL = none */
  const char *checkpoint_dir;          /* NULL or "" = no checkpoints */
  uint64_t checkpoint_every;           /* versions between periodic checkpoints; 0 = final only */
  uint32_t checkpoint_max_failures;    /* writes failing in a row that stop the job; 0 = never */
  const char *job_id;                  /* --job-id: whose checkpoints these are ("" = unnamed) */
  const struct auth_token *auth_token; /* NULL = anyone may connect (logged loudly) */
  bool reject_nonfinite;               /* refuse pushes and inits holding NaN or Inf */
  uint32_t max_connections;            /* 0 = 1024 */
  uint64_t handshake_timeout_ms, frame_timeout_ms, idle_timeout_ms; /* 0 = none */
  uint64_t out_queue_bytes;     /* hard limit of one connection's queued replies; 0 = 256 MiB */
  uint32_t max_waiting;         /* pulls waiting per connection; 0 = 65536 */
  uint32_t tcp_user_timeout_ms; /* 0 = kernel default */
  int *stop_signal; /* if set: the signal (SIGTERM, SIGINT) that stopped the shard before worker 0
                       ended the training, or 0 (main.c's --fail-on-signal) */
};

/* Runs the shard until SIGINT/SIGTERM or a SHUTDOWN from worker 0.
 * Returns 0 on a clean stop, -ENOTCONN if it stopped because a worker was
 * gone (WORKER_TIMEOUT_FAIL), -ETIMEDOUT if no worker sent a layout within
 * first_worker_timeout_ms, or another negative errno if it could not
 * start. */
int server_run(const struct server_opts *opts);

#endif
