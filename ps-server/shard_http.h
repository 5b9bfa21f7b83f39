/* shard_http: a shard's /metrics, /healthz and /readyz (common/http.h runs
 * them on their own thread).
 *
 * The shard's state (store, connections) belongs to the server's loop thread
 * and is never read from the HTTP thread. Instead a scrape or probe asks the
 * loop for a snapshot through uv_async_send and waits (at most
 * SHARD_HTTP_SNAPSHOT_MS) for the loop to publish one into the atomic
 * metrics (shard_http_publish, called by the server from its snapshot
 * callback). So /metrics is always current, and /healthz doubles as a
 * liveness check of the event loop itself: a loop that does not answer within
 * the deadline makes it fail.
 *
 * Life cycle (main.c owns the object; server.c attaches its loop):
 *
 *   start --attach--> STARTING --set_ready--> READY --stopping(done)--> DONE
 *                                               |
 *                                               +--stopping(!done)--> STOPPING
 *   (detach, when the loop has ended, keeps the state)
 *
 * /readyz is 200 only in READY ("ready": listening, state loaded); in DONE it
 * is 503 "done" (not listening any more, so it cannot do its job; being
 * NotReady also lets a PodDisruptionBudget with unhealthyPodEvictionPolicy
 * AlwaysAllow evict a finished job's pods). /healthz is 200
 * while the loop answers, and after it detached. A detached shard serves the
 * last snapshot, so final counters stay scrapeable while the process lingers
 * (ps-server --exit-when-done=false). With an empty listen address there is
 * no HTTP thread, but the object still tracks the state for main.c. */
#ifndef PS_SHARD_HTTP_H
#define PS_SHARD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define SHARD_HTTP_SNAPSHOT_MS 1000

struct store;
struct server_traffic;
struct shard_http;

struct shard_http_opts {
  const char *listen; /* "host:port", or "" = no HTTP endpoint */
  uint32_t shard, num_shards, num_workers;
  const char *transport; /* --transport (ps_server_transport's label; NULL = the default) */
};

/* Builds the metrics and, with an address, binds and starts the HTTP thread
 * (errors in err: a bad address, a port in use). Returns 0 or a negative errno. */
int shard_http_start(const struct shard_http_opts *o, struct shard_http **out, char *err,
                     size_t errlen);
/* The bound HTTP address ("" when off). */
const char *shard_http_address(const struct shard_http *h);
/* Stops the HTTP thread and frees; accepts NULL. Call after detach. */
void shard_http_stop(struct shard_http *h);

/* ---- called on the server loop's thread; every function accepts h == NULL */

typedef void (*shard_http_snapshot_fn)(void *arg);
/* Snapshots now run on loop: fn(arg) must call shard_http_publish. */
int shard_http_attach(struct shard_http *h, uv_loop_t *loop, shard_http_snapshot_fn fn, void *arg);
void shard_http_set_ready(struct shard_http *h);
/* The shard stops serving workers; done: worker 0 ended the training
 * (readiness says "done", else "stopping"). Scrapes keep reaching the loop
 * until it ends: the async handle is unref'd, so it never keeps it alive. */
void shard_http_stopping(struct shard_http *h, bool done);
/* The loop has ended: a last snapshot, then no more calls into it (the
 * async handle is closed; run the loop once more to finish closing it). */
void shard_http_detach(struct shard_http *h);
/* Copies the store's counters, key versions and worker clocks, and the
 * server's traffic counters (server.h). */
void shard_http_publish(struct shard_http *h, const struct store *st,
                        const struct server_traffic *t, uint32_t connections);
/* Checkpoints as ckpt_writer counts them (loop thread). */
struct shard_http_ckpt {
  uint64_t written, failed, skipped; /* snapshots written, failed, dropped (writer busy) */
  uint32_t failed_in_a_row;          /* failures since the last success */
  uint64_t last_clock, last_bytes;   /* of the newest checkpoint written */
  double last_seconds;               /* how long writing it took */
  double last_done_s;                /* clock_now_s() when it was committed */
  double last_unix_s;                /* the same in seconds since the epoch */
};
/* c == NULL: this shard writes no checkpoints (no --checkpoint-dir). */
void shard_http_publish_checkpoints(struct shard_http *h, const struct shard_http_ckpt *c);

/* A client was refused with this Ps__ErrorCode (errors by kind). */
void shard_http_count_error(struct shard_http *h, int code);

/* True once stopping with done (main.c then lingers if asked to). */
bool shard_http_done(const struct shard_http *h);

#endif
