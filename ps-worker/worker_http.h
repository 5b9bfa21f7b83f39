/* worker_http: a worker's /metrics, /healthz and /readyz (common/http.h runs
 * them on their own thread).
 *
 * What it measures. The training loop's sync backend is wrapped
 * (worker_http_wrap_sync): each fetch of a new step ends the previous one, so
 * the time between two fetches is one step (data, forward, backward,
 * gradient hand-off and the wait for parameters); the fetch itself is the
 * wait for parameters, i.e. communication the step could not hide. A repeated
 * fetch of the same step (the trainer's per-epoch evaluation) restarts the
 * clock, so evaluation never counts as a step. In PS mode the libps client's
 * counters (pushes, pulls, bytes, reconnects, connected shards) are read at
 * scrape time. All values are atomics; the client pointer is guarded by a
 * mutex that main.c takes (worker_http_watch_client(w, NULL)) before it
 * frees the client.
 *
 * Readiness. Phases: STARTING (loading data, building the model, reaching
 * the shards or the ring) -> TRAINING (set by wrap_sync) -> DONE
 * (worker_http_done). /readyz is 200 in TRAINING when every shard connection
 * is up (PS mode; a lost one is being retried and makes it 503 until it is
 * back) or, in all-reduce mode, as soon as the ring is formed: a ring that
 * loses a peer fails the job, so "formed" and "connected to every peer" are
 * the same. In DONE it is 503 "done": the worker has nothing left to do, and
 * being NotReady lets a PodDisruptionBudget with unhealthyPodEvictionPolicy
 * AlwaysAllow evict a finished job's pods. /healthz is 200 while the
 * process runs: the
 * training thread's own waits are bounded (libps reconnect timeout, the
 * ring's peer timeout) and end the process with 129, so a liveness check
 * that restarted slow workers would only add restarts. */
#ifndef PS_WORKER_HTTP_H
#define PS_WORKER_HTTP_H

#include <stddef.h>

#include "ps.h"
#include "trainer.h"

struct worker_http;

struct worker_http_opts {
  const char *listen;    /* "host:port", or "" = no HTTP endpoint */
  const char *sync_mode; /* "ps" or "allreduce", shown in ps_worker_info */
  const char *transport; /* "tcp" or "ucx" (ps mode), shown in ps_worker_transport */
  int rank, world_size, batch;
};

/* Builds the metrics and, with an address, starts the HTTP thread (errors in
 * err). Returns 0 or a negative errno (-EINVAL: a malformed address). Every
 * other function accepts w == NULL. */
int worker_http_start(const struct worker_http_opts *o, struct worker_http **out, char *err,
                      size_t errlen);
const char *worker_http_address(const struct worker_http *w);
/* Stops the HTTP thread and frees. */
void worker_http_stop(struct worker_http *w);

/* PS mode: readiness and traffic come from c (NULL: stop reading it; call
 * that before ps_client_free). */
void worker_http_watch_client(struct worker_http *w, ps_client *c);
/* The 3D trainer (main3d.c): its model-parallel figures, after each step
 * (step: the one just done; UINT64_MAX before the first), which also counts
 * the step and marks the worker training. */
struct worker_http_mp {
  uint64_t params_rank, tp_allreduce_fwd, tp_allreduce_bwd, tp_allgather, peak_acts, peak_act_bytes;
};
void worker_http_set_mp(struct worker_http *w, const struct worker_http_mp *mp, uint64_t step);
/* Allreduce mode: the bytes of optimizer state this rank holds
 * (ps_worker_optimizer_state_bytes). */
void worker_http_set_state_bytes(struct worker_http *w, size_t bytes);
/* Replaces sync's callbacks with timing wrappers around them and enters
 * TRAINING. sync must stay where it is while training. */
void worker_http_wrap_sync(struct worker_http *w, struct trainer_sync *sync);
/* Training finished successfully. */
void worker_http_done(struct worker_http *w);

#endif
