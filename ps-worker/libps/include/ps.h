/* libps: the client API of the parameter server.
 *
 * A ps_client connects to the S shards of a job, declares the model layout
 * (named float32 tensors), and pushes gradients and pulls parameters of whole
 * tensors. Internally each tensor is cut into chunks (keys) of at most
 * chunk_bytes, placed on shards deterministically from the layout and the
 * shard count (every worker computes the same map, with no coordinator),
 * balancing the bytes per shard (ps_shard_bytes reports them); one tensor
 * operation fans out to its chunks and completes when every chunk has.
 * Handles are opaque.
 *
 * The order of the calls (every rank; a shard refuses a push to a key that
 * has no values yet, "push to key ... before it was initialised"):
 *   1. ps_client_new, then ps_declare with the same layout on every rank;
 *   2. rank 0 (or, with ps_declare_owned, any owner) gives every tensor its
 *      initial values with ps_init; a second ps_init of a tensor is ignored;
 *   3. every rank, rank 0 too, calls ps_wait_initialised: it returns once
 *      every tensor the rank pushes has values on its shards (the other
 *      ranks run ahead of rank 0's ps_init otherwise);
 *   4. then the steps: pull version `step`, compute, push `step` (below).
 * A rank that pulls version 0 of a tensor before its first push of it
 * (the BSP loop does) waits for the initialisation the same way; the push
 * is what must not come first.
 *
 * Threads: every function may be called from any thread. Asynchronous
 * operations complete on the client's receiver threads: a completion
 * callback runs there and must not block; or the caller keeps a ps_request
 * and waits on it. Buffers passed to an operation must stay valid and
 * unchanged (pushes) or untouched (pulls) until it completes.
 *
 * Faults: when a shard connection breaks, the client reconnects with capped
 * backoff, says hello and re-declares the layout, then resends every
 * operation still in flight with the same (rank, step, key), which the shard
 * recognises, so a push is never applied twice. Only when reconnection fails
 * for reconnect_timeout_ms do the pending operations fail with PS_ERR_IO.
 *
 * Versions: after init every key is at version 0, and each update the shard
 * applies makes it one higher. A worker's clock is the step it pushes next:
 * it pushes steps 0, 1, 2, ... of each tensor in order. The shard's
 * --consistency decides what a pull's min_version means; the calls are the
 * same in every mode:
 *  - bsp: a worker pulls version v, computes its gradient and pushes it with
 *    step v; once every live worker has pushed step v the key becomes v+1.
 *    A pull waits until the version is >= min_version.
 *  - asp: each push is applied on arrival (version += 1 per push); pulls are
 *    answered at once with the current version.
 *  - ssp:K: pushes as in asp; a pull's min_version is the puller's clock c
 *    (pull with min_version = step after pushing step-1) and is answered once
 *    the slowest worker's clock is >= c - K.
 * In every mode the version a worker gets is >= its own clock, so the BSP
 * loop (pull min_version = step, push step) runs unchanged in asp and ssp.
 *
 * Sum mode (shard --optimizer sum, bsp): the shard only aggregates. Version
 * 0 of a tensor is its initial values; a pull of version v >= 1 returns the
 * mean of the step v-1 gradients of the workers that pushed it; the workers
 * keep the parameters and apply their optimizer to that mean (BytePS).
 *
 * Restarts: a worker restarted from scratch with the same rank calls
 * ps_declare (rank 0 may call ps_init again: initialised keys keep their
 * values), then ps_resume_step to learn the first step it has not pushed,
 * and continues from there, pulling that step's parameters as usual. Pushes
 * for earlier steps are acknowledged as duplicates and never applied. */
#ifndef PS_PS_H
#define PS_PS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  PS_OK = 0,
  PS_ERR_INVALID = 1,         /* bad argument */
  PS_ERR_CONNECT = 2,         /* a shard could not be reached */
  PS_ERR_IO = 3,              /* connection lost and not re-established, or a shard
                                 stopped the job because a worker was lost (retryable) */
  PS_ERR_LAYOUT_MISMATCH = 4, /* the shard holds a different layout */
  PS_ERR_REMOTE = 5,          /* the shard refused the request (see ps_errmsg) */
  PS_ERR_NOMEM = 6,
  PS_ERR_STATE = 7,      /* call out of order (e.g. push before declare, or before the
                            tensor's ps_init reached its shard), or the ranks ran different
                            numbers of steps (see ps_leave) */
  PS_ERR_CLOSED = 8,     /* the client is being freed */
  PS_ERR_ROLLBACK = 9,   /* a shard went back to a checkpoint: roll back (ps_rollback) */
  PS_ERR_STATE_LOST = 10 /* the job's state is gone (a shard restarted without its
                            checkpoint, a rollback a shard cannot follow, this process
                            superseded by a restarted one): the job cannot continue as it
                            is; ps_errmsg says what to restart (ps-worker exits 3) */
} ps_status;

const char *ps_strerror(ps_status s);

/* How a job synchronises its gradients (ps-worker --sync-mode): push and
 * pull through the parameter-server shards with a ps_client (this header),
 * or all-reduce over a ring of the workers (collective.h). */
typedef enum { PS_SYNC_PS = 0, PS_SYNC_ALLREDUCE = 1 } ps_sync_mode;

/* Parses "ps" or "allreduce" into *out. Anything else is PS_ERR_INVALID,
 * with the reason ("expected ps or allreduce") in err when errlen > 0: the
 * text every program that takes the setting refuses a bad value with. */
ps_status ps_sync_mode_parse(const char *s, ps_sync_mode *out, char *err, size_t errlen);

typedef struct ps_client ps_client;
typedef struct ps_request ps_request;

/* The job's shared secret, which every shard and worker of a job holds
 * (ps-server/ps-worker --auth-token-file, a Kubernetes Secret mounted as a
 * file): with it a client and a shard prove to each other that they know it
 * and tag every frame. Opaque; the key material is wiped when freed. */
typedef struct ps_token ps_token;

/* Reads a token from path: a regular file of 16 to 4096 bytes (one trailing
 * newline or CR/LF is not part of it). On failure *out is NULL and err (when
 * errlen > 0) names the file and what is wrong (PS_ERR_INVALID, or
 * PS_ERR_NOMEM). A file readable by every user is accepted, and a warning
 * is logged on stderr. */
ps_status ps_token_load(const char *path, ps_token **out, char *err, size_t errlen);
/* A token from memory (16 to 4096 bytes, copied): PS_ERR_INVALID for
 * another length. */
ps_status ps_token_from_bytes(const void *buf, size_t len, ps_token **out);
/* Wipes and frees t. Accepts NULL. */
void ps_token_free(ps_token *t);

struct ps_client_opts {
  const char *const *servers; /* "host:port" of shard 0..num_servers-1 */
  int num_servers;
  int rank;
  int world_size;
  const char *job_id;       /* free text, logged by shards (may be NULL) */
  uint64_t chunk_bytes;     /* 0 = 4 MiB */
  int connect_timeout_ms;   /* first connection to each shard; 0 = 30000, -1 = forever */
  int reconnect_timeout_ms; /* after a loss; 0 = 60000, -1 = forever */
  /* The job's token: the client authenticates to every shard and tags
   * every frame. NULL = no authentication. Borrowed: it must outlive the
   * client. */
  const ps_token *auth_token;
  /* "tcp" or "ucx" (UCX active messages: RDMA verbs, shared memory or TCP,
   * as UCX finds them; UCX_TLS forces a set); every shard of the job must
   * use the same. NULL = the PS_TRANSPORT environment variable, else tcp. */
  const char *transport;
};

/* Connects to every shard and says hello. On failure *out is NULL and the
 * reason is in errbuf (if given). */
ps_status ps_client_new(const struct ps_client_opts *opts, ps_client **out, char *errbuf,
                        size_t errlen);
/* Closes connections and joins threads; pending operations fail with
 * PS_ERR_CLOSED. Accepts NULL. */
void ps_client_free(ps_client *c);

/* The last error message of this client (thread-safe snapshot into buf). */
const char *ps_errmsg(ps_client *c, char *buf, size_t len);

/* Declares the model: num_tensors float32 tensors with these names and
 * element counts. Every shard checks it against the layout it holds. */
ps_status ps_declare(ps_client *c, int num_tensors, const char *const *names,
                     const uint64_t *counts);

/* ps_declare for a model split over ranks (model parallelism, grid.h): each
 * tensor also lists its owners, the job ranks that push and pull it (its
 * data-parallel replicas), owners[i][0..num_owners[i]); num_owners[i] == 0
 * (or owners NULL) means every rank. Every rank declares the same whole
 * layout, owners included (a layout whose owners differ is refused like one
 * whose sizes differ). A key's BSP step completes when its live owners have
 * pushed (not every worker); ASP/SSP clocks and staleness count per key over
 * its owners the same way. Pushing or pulling a tensor this rank does not own
 * is PS_ERR_INVALID (ps_init is not: any rank may initialise any tensor,
 * the first values win). Ranks must be < world_size, without repeats.
 * Owners travel in the layout (Tensor.owners) and are not part of its hash;
 * the shard semantics are in docs/RELIABILITY.md ("Owners"). */
ps_status ps_declare_owned(ps_client *c, int num_tensors, const char *const *names,
                           const uint64_t *counts, const int *const *owners, const int *num_owners);

/* Bytes of parameters each shard holds under the placement (after declare). */
ps_status ps_shard_bytes(ps_client *c, uint64_t *bytes_per_shard);

typedef void (*ps_done_fn)(ps_status status, void *arg);

/* Asynchronous forms. Either cb is given (it runs once, on a receiver
 * thread) or req is given (then call ps_wait exactly once). Both may be given:
 * then the callback has run when ps_wait returns. */
ps_status ps_init_async(ps_client *c, int tensor, const float *values, ps_done_fn cb, void *arg,
                        ps_request **req);
ps_status ps_push_async(ps_client *c, int tensor, uint64_t step, const float *grad, ps_done_fn cb,
                        void *arg, ps_request **req);
ps_status ps_pull_async(ps_client *c, int tensor, uint64_t min_version, float *out, ps_done_fn cb,
                        void *arg, ps_request **req);

/* Waits for req and frees it. *version (may be NULL) gets the lowest version
 * among a pull's chunks. */
ps_status ps_wait(ps_request *req, uint64_t *version);

/* Write batching, for many small requests issued at once. Between
 * ps_batch_begin and ps_batch_end the frames written to each shard are held
 * back by the kernel (TCP_CORK) and leave together at ps_batch_end, as full
 * segments: the shard reads and acknowledges them in a few wakeups instead of
 * one per request. Requests started inside a batch may not complete before
 * ps_batch_end (the kernel holds their frames up to 200 ms), so never wait
 * for one inside its batch. Batches nest; the outermost end sends. Frames
 * other threads write meanwhile are held back too. ps_batch_end without a
 * begin is PS_ERR_INVALID. */
ps_status ps_batch_begin(ps_client *c);
ps_status ps_batch_end(ps_client *c);

/* Blocking forms.
 *
 * ps_init: the tensor's initial values (version 0); the first INIT a shard
 * gets for a key wins, later ones are acknowledged and ignored.
 *
 * ps_push: the gradient of `step` (see Versions above). The tensor must be
 * initialised on its shards first: a push that arrives before any ps_init
 * of it is refused (PS_ERR_STATE, "push to key ... before it was
 * initialised"; the job goes on). Every rank calls ps_wait_initialised (or pulls version 0)
 * before its first push; for the tensors a rank initialised itself, its
 * ps_init returning is enough. */
ps_status ps_init(ps_client *c, int tensor, const float *values);
ps_status ps_push(ps_client *c, int tensor, uint64_t step, const float *grad);
ps_status ps_pull(ps_client *c, int tensor, uint64_t min_version, float *out, uint64_t *version);

/* After ps_declare: waits until every tensor this rank pushes (all of them,
 * or the ones it owns under ps_declare_owned) has its initial values on its
 * shards, by pulling version 0 of each into a scratch buffer of the library
 * (in windows of up to 16 MiB, or the largest tensor) and discarding it. It
 * returns at once (one round trip) when they have, as after a restart,
 * where the keys are past version 0, and in every consistency model. Call it
 * on every rank between rank 0's ps_init calls and the first push.
 * timeout_ms: 0 = 60000, -1 = forever. PS_ERR_STATE when the time runs out,
 * with ps_errmsg naming the first tensor still without values (rank 0
 * forgot a ps_init, or is still loading them); PS_ERR_STATE before
 * ps_declare; the status of a pull that failed otherwise (PS_ERR_IO, ...).
 * A pull it started that is still waiting when it gives up stays with the
 * shard until the tensor is initialised or the client is freed. */
ps_status ps_wait_initialised(ps_client *c, int timeout_ms);

/* Waits until every worker of the job reached the barrier (via shard 0). A
 * rank in the barrier pushes nothing until it completes: a step that needs
 * its push fails at once, and so does the barrier (PS_ERR_STATE; ps_leave). */
ps_status ps_barrier(ps_client *c);

/* One shard's counters and settings, from its stats reply. */
struct ps_shard_stats {
  uint64_t pushes, pulls, updates, duplicates, rejected_frames, bytes_in, bytes_out, param_bytes;
  uint64_t min_version, max_version;
  uint32_t connected_workers, num_keys;
  uint32_t live_workers; /* ranks the shard has not declared gone */
  char optimizer[16];    /* the shard's --optimizer: "sgd", "momentum", "adam", "adamw", "sum" */
  char consistency[32];  /* its --consistency: "bsp", "asp" or "ssp:K" */
};
ps_status ps_stats(ps_client *c, int shard, struct ps_shard_stats *out);

/* Per-rank clocks on one shard: clocks[r] (r < n, n <= world size) = the step
 * rank r pushes next there (the lowest over the shard's keys that r owns,
 * ps_declare_owned), or UINT64_MAX if the shard holds none of them. */
ps_status ps_worker_clocks(ps_client *c, int shard, uint64_t *clocks, int n);

/* After ps_declare: the first step this rank has not pushed on every key of
 * every shard (0 in a new job). A restarted worker resumes there. */
ps_status ps_resume_step(ps_client *c, uint64_t *step);

/* Recovery after a shard restarted from an older checkpoint (kill -9): a
 * request fails with PS_ERR_ROLLBACK and ps_rollback_clock says the clock c
 * the shard is back at. The caller waits for its other requests (they
 * finish or fail the same way), calls ps_rollback(c), which takes every
 * shard back to its checkpoint of clock c (each shard once per job
 * rollback, however many ranks ask: the refusal's rollback id goes with it),
 * and continues from step c. Until every rank has done so, the shards refuse
 * the requests of the ranks that have not with PS_ERR_ROLLBACK, so every
 * rank rolls back once. UINT64_MAX if no rollback was seen. */
uint64_t ps_rollback_clock(ps_client *c);
ps_status ps_rollback(ps_client *c, uint64_t clock);

/* How a rank stops taking part in the steps (ps_leave). */
typedef enum { PS_LEAVE_JOINED = 1, PS_LEAVE_FINISHED = 2 } ps_leave_kind;

/* Tells every shard that this rank pushes no further step (call it once its
 * pushes have completed) and waits for each to acknowledge; its clock on
 * every key stays where it is (the step it would push next). A later push
 * of a step it has not pushed is refused (PS_ERR_REMOTE).
 *  - PS_LEAVE_JOINED (uneven inputs: Horovod's join): every later step
 *    completes without it, the mean over the workers that pushed (bsp; the
 *    ssp bound no longer waits for its clock; asp does not change). The
 *    barrier still waits for it: a joined rank calls ps_barrier after.
 *  - PS_LEAVE_FINISHED (its training is over): a step that needs its push
 *    can never complete, so it fails at once: the push that starts it, the
 *    pulls waiting for it and this rank's barrier request each get
 *    PS_ERR_STATE, and ps_errmsg names both ranks, both steps, the tensor
 *    and the fix. A rank waiting in ps_barrier counts as finished until the
 *    barrier completes, but only on shard 0, which alone gets the barrier.
 * Idempotent; FINISHED after JOINED keeps JOINED. Remembered and said again
 * to a shard after every reconnect, before anything else (a shard forgets
 * it at each hello: a restarted process is a new participant); ps_rollback
 * forgets it (the rank replays its steps). PS_ERR_STATE before ps_declare,
 * PS_ERR_INVALID for another kind. */
ps_status ps_leave(ps_client *c, ps_leave_kind kind);

/* After ps_leave(PS_LEAVE_JOINED) and a barrier every rank reached (the
 * others stopped or joined too): this rank takes part in the steps again (a
 * next epoch). Every shard moves its clock on each key to where the others
 * are (BSP: the step being gathered) and counts it again; *step is the step
 * it pushes next (ps_resume_step). PS_ERR_STATE when it has not joined. */
ps_status ps_rejoin(ps_client *c, uint64_t *step);

/* The ranks any shard went on without (--on-worker-timeout continue), sorted, each once:
 * up to max of them into ranks (may be NULL when max is 0), their number into *count. */
ps_status ps_lost_workers(ps_client *c, int *ranks, int max, int *count);

/* Rank 0 only: tells every shard that training is over; they exit cleanly. */
ps_status ps_shutdown_servers(ps_client *c);

/* What this client has done so far, for metrics. Lock-free: any thread, any
 * time until ps_client_free. */
struct ps_client_counters {
  uint64_t pushes, pulls;              /* key operations issued (resends not counted) */
  uint64_t bytes_sent, bytes_received; /* frames on the wire, every shard */
  uint64_t reconnects;                 /* shard connections re-established */
  int connected_shards, num_shards;    /* connections up now (a lost one is being retried) */
};
void ps_client_counters(ps_client *c, struct ps_client_counters *out);

#ifdef __cplusplus
}
#endif
#endif
