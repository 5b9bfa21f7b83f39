/* store: a shard's keys and its sync engine (BSP, ASP, SSP).
 *
 * The store knows nothing about sockets or time. It holds the layout (the
 * first one a worker declares), the keys this shard owns under the
 * deterministic placement, and per key: the parameters, the version, the
 * gradient sum of the current step (BSP) and, per worker rank, its clock
 * next_step = the step it pushes next (last step pushed + 1; 0 = none yet).
 * Parameters live in a reference-counted buffer (struct vbuf) so a pull
 * reply can be written to the socket straight from it; an update that finds
 * the buffer still referenced by a write in flight writes a fresh one instead
 * (copy on write).
 *
 * Versions. After init a key is at version 0; every update the optimizer
 * applies makes it one higher, in every mode. A worker's clock is the step
 * number it pushes: its k-th push of a key carries step k-1.
 *
 * Consistency (store_opts.consistency):
 *  - BSP: a key at version v accepts each live rank's step-v gradient once;
 *    when every live rank has pushed, the shard averages what was pushed
 *    (dividing by the number of pushes, so a step completed without a gone
 *    worker is still a mean), applies the optimizer and the key becomes v+1.
 *    A pull for min_version m waits until version >= m. A push for a step
 *    ahead of the version is refused.
 *  - ASP: each push is applied on arrival, with gradient g / live_workers (so
 *    one round of W pushes moves the parameters as far as one BSP step and the
 *    same --lr works in every mode). Pulls are answered at once with the
 *    current version; min_version is ignored.
 *  - SSP:K: pushes are applied as in ASP. A pull carries the puller's clock c
 *    as min_version (a worker that pushed step c-1 asks for c) and is answered
 *    once the slowest live rank's clock on that key is >= c - K; so a worker
 *    computing step c has seen every update of steps < c - K, and no worker
 *    ever runs more than K clocks ahead of the slowest. K = 0 reads like BSP.
 * In ASP/SSP version = number of pushes applied >= every rank's clock, so a
 * worker that pulls with min_version = its clock always gets version >= it
 * (the check the trainer makes in BSP keeps holding). Updates happen per push
 * in the order pushes arrive.
 *
 * Owners (model parallelism, ps_declare_owned). Each tensor of the layout
 * may name its owners, the ranks that push and pull it (its data-parallel
 * replicas); none named = every rank. The keys of a tensor's chunks share
 * its owner set, and every rule above that counts "ranks" counts the key's
 * owners instead: BSP completes step v of a key when each of its counted
 * owners (not gone, not joined) has pushed it and divides by the pushes;
 * ASP/SSP scale a push by 1 / live owners and the look-ahead's round is
 * the owners'; SSP's bound is the slowest counted owner's clock on that
 * key. A rank pushing or pulling a key it does not own is refused
 * (store_check_owner). A gone rank leaves every owner set it is in, as it
 * leaves the live set; a key whose owners are all gone keeps its version
 * (nobody else may push or pull it) until one of them comes back, its
 * clock fast-forwarded to the key's version as below. store_worker_clock
 * counts only the keys the rank owns.
 *
 * Staleness (ASP/SSP). A push says which version of the key its gradient
 * was computed on (libps sends the version of the key's last pull); its
 * staleness is the number of updates applied since, key version - base.
 * With staleness_aware (the default of ps-server --staleness-aware) the
 * shard accounts for it, by opts.method (--staleness-method):
 *  - lookahead (the default), with momentum (not Nesterov): DANA-Zero
 *    (Hakimi et al., "Taming Momentum in a Distributed Asynchronous
 *    Environment", 2019; opt_lookahead). Each rank has its own velocity and
 *    the key holds, and serves, the point the next round of W pushes will
 *    take the parameters to, so a gradient computed while the others push
 *    is computed about where it lands. A push staler than one round
 *    (staleness + 1 > live workers) also has its scale multiplied by
 *    live / (staleness + 1), as below, beyond what the look-ahead covers.
 *    The state is W + 1 floats per parameter (store_state_floats). A gone
 *    rank's velocity stays in the sum: the served point stays ahead by its
 *    last step, an offset that the schedule shrinks with the learning rate.
 *  - divide (and every other optimizer): the update's gradient scale
 *    1/live_workers is divided by staleness + 1, as in Zhang et al.,
 *    "Staleness-aware Async-SGD for Distributed Deep Learning" (IJCAI 2016:
 *    the learning rate divided by the staleness, counted there from 1 for a
 *    gradient of the current parameters).
 * With momentum 0.9, division alone leaves asp 3-4 points below bsp on
 * Fashion-MNIST; the look-ahead closes the gap (docs/BENCHMARKS.md). BSP
 * never scales (every gradient of a step is computed on its version). A push
 * that names no base (an older client) counts as fresh.
 *
 * Restored (ASP/SSP, accept_gaps: the shard loaded a checkpoint). A rank
 * whose push or pull is beyond its clock in the checkpoint has made pushes
 * since that the kill -9 lost; they are counted (stats.lost), its clock
 * moves to where it is and the key's version by as much, so version stays
 * >= every clock and the schedule on its step; nothing is applied twice,
 * as every push below the clock is still a duplicate (store_rank_at). SSP's
 * bound then counts each rank at the highest clock it has shown on any key
 * (seen_clock): its clocks on the keys it has not touched since are the
 * checkpoint's, and two ranks each waiting on a key the other has not
 * reached again would wait for ever. BSP rolls the job back instead
 * (handlers.c).
 *
 * Resends. A push whose step is below the rank's clock (or, in BSP, below the
 * key's version) is a resend after reconnect: acknowledged as a duplicate and
 * never applied. In ASP/SSP a push must carry exactly the rank's clock; a gap
 * is refused. So an update is applied at most once in every mode.
 *
 * Gone workers (store_worker_gone, decided by the server's --worker-timeout).
 * A gone rank leaves the BSP quorum, the SSP minimum and the ASP divisor;
 * steps that only waited for it complete at once. A rank that comes back
 * (store_worker_back) has its clocks fast-forwarded: in BSP to the key's
 * version, in ASP/SSP to the slowest live rank's clock, so it neither holds
 * the others back nor applies a stale step; its pushes below that are
 * duplicates. store_worker_clock then tells a restarted worker where to
 * resume.
 *
 * Leaving the steps (store_set_left; MSG_LEAVE, ps_leave). A rank that
 * joined (it ran out of data: Horovod's join) pushes no further step: its
 * clocks stay where they are and it leaves the BSP quorum and the SSP
 * minimum as a gone rank does, so later steps complete without it (the
 * mean divides by the pushes); ASP does not change. A rank that finished is
 * still counted: a step that needs it can never complete, which the server
 * reports (leave.c) from store_waits_for. The state lasts until the rank's
 * next hello (a new process; libps says it again after a reconnect), its
 * rollback, or, for a joined rank, store_rejoin (it trains again).
 *
 * Sum mode (optimizer OPT_SUM, BSP only): the key's buffer holds the initial
 * values at version 0 and, at version v >= 1, the mean gradient of step v-1;
 * the workers keep the parameters and run the optimizer themselves.
 *
 * Pulls that cannot be answered yet wait in the key's queue; the store hands
 * them back through the serve callback once they can be. */
#ifndef PS_STORE_H
#define PS_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "optimizer.h"
#include "placement.h"

struct vbuf {
  uint32_t refs;
  uint64_t count;
  float data[];
};
struct vbuf *vbuf_ref(struct vbuf *b);
void vbuf_unref(struct vbuf *b);

struct store_layout {
  uint32_t num_tensors;
  char **names;
  uint64_t *counts;
  uint64_t chunk_bytes;
  uint32_t num_shards;
  uint64_t hash;
  /* Owners (ps_declare_owned): tensor i is pushed and pulled by the ranks
   * owners[i][0..num_owners[i]); num_owners[i] == 0, or num_owners NULL,
   * means every rank. Not in hash (placement ignores them); compared by
   * store_set_layout like the sizes. */
  uint32_t *num_owners;
  uint32_t **owners;
};

/* A deep copy of src into dst (0 or -ENOMEM, dst then empty), and its
 * release (a layout whose arrays the callee allocated). */
int store_layout_copy(struct store_layout *dst, const struct store_layout *src);
void store_layout_free(struct store_layout *l);

/* A pull that waits; owned by the store while queued. */
struct store_waiter {
  struct store_waiter *next;
  void *conn; /* opaque to the store */
  uint64_t request_id;
  uint64_t min_version; /* BSP: version wanted; SSP: the puller's clock */
};

struct store_key {
  uint64_t key;
  uint64_t count;
  struct vbuf *params; /* NULL until initialised */
  float *sum;          /* BSP: gradient sum of the current step */
  size_t sum_bytes;    /* capacity of sum (>= count * 4; see store_push_buffer) */
  float *opt_state;    /* optimizer state, allocated on the first update */
  uint32_t pushed;     /* BSP: pushes in sum */
  uint64_t version;
  uint64_t *next_step; /* per rank: its clock on this key */
  struct store_waiter *waiters;
  const uint8_t *owns; /* per rank: 1 if it owns the key's tensor; NULL = every rank does */
  uint32_t num_owners; /* ranks that own it (num_workers when owns is NULL) */
};

/* What the sync engine itself counts. Traffic (frames, bytes, pulls
 * answered) is the server's: struct server_traffic in server.h. */
#define STORE_STALENESS_SLOTS 65 /* staleness 0..63 counted one by one; the last slot: >= 64 */
struct store_stats {
  uint64_t pushes;     /* pushes accepted into a step or applied (not the duplicates) */
  uint64_t updates;    /* optimizer updates applied (one per key and version) */
  uint64_t duplicates; /* resends recognised and not applied */
  /* ASP/SSP: pushes applied by staleness (store_push), those of the last
   * slot with the sum of their staleness; and pushes that gave no base */
  uint64_t staleness[STORE_STALENESS_SLOTS];
  uint64_t staleness_over_sum;
  uint64_t no_base;
  /* ASP/SSP after a restore: updates the checkpoint did not hold (pushes a
   * rank made after it, learnt from its first push or pull beyond) */
  uint64_t lost;
};

enum store_consistency { STORE_BSP = 0, STORE_ASP = 1, STORE_SSP = 2 };
/* ps-server --staleness-method (see "Staleness" above) */
enum store_staleness_method { STALENESS_LOOKAHEAD = 0, STALENESS_DIVIDE = 1 };

struct store_opts {
  uint32_t shard;
  uint32_t num_shards;
  uint32_t num_workers;
  enum store_consistency consistency;
  uint32_t staleness;                 /* SSP's K */
  bool staleness_aware;               /* ASP/SSP: an update's step divided by its staleness + 1 */
  enum store_staleness_method method; /* how (store_lookahead) */
  struct opt_params opt;
  const char *job_id; /* --job-id, written into checkpoints (ckpt.h); NULL or "" = unnamed */
};

/* Called for each waiter that can be answered; the callee owns w after. */
typedef void (*store_serve_fn)(struct store_key *k, struct store_waiter *w, void *arg);

struct store {
  struct store_opts opts;
  bool has_layout;
  bool accept_gaps; /* ASP/SSP restored from a checkpoint: see "Restored" above */
  struct store_layout layout;
  struct placement placement;
  struct store_key *keys; /* this shard's keys, sorted by key */
  size_t num_keys;
  uint64_t param_bytes;
  struct store_stats stats;
  bool *gone;           /* per rank */
  uint64_t *seen_clock; /* accept_gaps: per rank, the highest clock it showed on any key */
  uint8_t *owner_masks; /* num_tensors x num_workers (keys' owns point here); NULL = no owners */
  uint32_t num_gone;
  uint8_t *left;         /* per rank: enum store_left */
  uint32_t num_joined;   /* ranks at STORE_JOINED */
  uint32_t num_finished; /* ranks at STORE_FINISHED */
  store_serve_fn serve;
  void *serve_arg;
  /* if set: called after every update, with the key at its new version
   * (the shard takes checkpoints at step boundaries from it) */
  void (*on_update)(struct store *s, struct store_key *k, void *arg);
  void *on_update_arg;
};

enum store_push_result { STORE_APPLIED = 0, STORE_DUPLICATE = 1 };

/* How a rank takes part in the steps (the numbers of MSG_LEAVE's flags). */
enum store_left { STORE_IN = 0, STORE_JOINED = 1, STORE_FINISHED = 2 };

/* Parses "bsp", "asp" or "ssp:K" (0 <= K <= 1e6). Returns 0 or -EINVAL. */
int store_consistency_parse(const char *s, enum store_consistency *mode, uint32_t *staleness);
/* The config_check_fn of --consistency (config.h): 0, or -EINVAL with the
 * reason in err. */
int store_consistency_check(const char *value, char *err, size_t errlen);
/* "lookahead" or "divide"; returns 0 or -EINVAL. */
int store_staleness_method_parse(const char *s, enum store_staleness_method *out);
/* The config_check_fn of --staleness-method. */
int store_staleness_method_check(const char *value, char *err, size_t errlen);
/* "lookahead", "divide", or "off" when nothing is scaled (BSP, or
 * staleness_aware false): what the shard does, for its start line. */
const char *store_staleness_name(const struct store_opts *o);

/* Writes "bsp", "asp" or "ssp:K" into buf. */
const char *store_consistency_name(enum store_consistency mode, uint32_t staleness, char *buf,
                                   size_t len);

/* Returns 0 or -ENOMEM. */
int store_init(struct store *s, const struct store_opts *opts, store_serve_fn serve, void *arg);
void store_deinit(struct store *s);

/* Takes the layout (copied). The first call defines it; later calls must be
 * equal. Returns 0, -EINVAL (bad layout; msg says why) or -EEXIST (mismatch). */
int store_set_layout(struct store *s, const struct store_layout *l, char *msg, size_t msglen);

struct store_key *store_find(struct store *s, uint64_t key);

/* Initial values of k (count floats). Returns 1 if k was already initialised
 * (values ignored: a rejoining rank 0 must not overwrite trained values). */
int store_init_key(struct store *s, struct store_key *k, const float *values);

/* A push of rank's step-`step` gradient (count floats, only read), computed
 * on the key's parameters of version `base` (STORE_NO_BASE: not said; see
 * staleness above). Returns STORE_APPLIED, STORE_DUPLICATE, or -EINVAL with
 * msg set (uninitialised key, bad rank, a step the consistency model cannot
 * accept) or -ENOMEM. */
#define STORE_NO_BASE UINT64_MAX
int store_push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, uint64_t base,
               const float *grad, char *msg, size_t msglen);

/* store_push for a gradient in a buffer the caller owns: *buf holds
 * *buf_bytes bytes of capacity. When the push is the first of a BSP step and
 * that capacity exceeds the key's size by at most STORE_SWAP_SLACK bytes, the
 * store keeps *buf as the step's sum and hands its previous sum buffer back
 * through *buf and *buf_bytes, instead of copying the gradient. So the first
 * push of every step costs no pass over memory, and no key's sum grows by
 * more than the slack. */
#define STORE_SWAP_SLACK 4096u
int store_push_buffer(struct store *s, struct store_key *k, uint32_t rank, uint64_t step,
                      uint64_t base, float **buf, size_t *buf_bytes, char *msg, size_t msglen);

/* ASP/SSP with accept_gaps: rank is at clock `clock` (its pull asks for
 * it): a clock the checkpoint did not reach is moved up, the gap counted as
 * lost. Returns the updates counted lost. Otherwise nothing (0). */
uint64_t store_rank_at(struct store *s, struct store_key *k, uint32_t rank, uint64_t clock);

/* Whether ASP/SSP updates go through opt_lookahead: staleness_aware and
 * lookahead, with momentum (not Nesterov). */
bool store_lookahead(const struct store *s);
/* Floats of optimizer state per parameter: W + 1 with the look-ahead. */
size_t store_state_floats(const struct store *s);

/* True if a pull with min_version can be answered now. */
bool store_ready(const struct store *s, const struct store_key *k, uint64_t min_version);

/* Queues a waiting pull (takes ownership of w). */
void store_wait(struct store *s, struct store_key *k, struct store_waiter *w);

/* Removes and frees every waiter of conn (the connection closed). */
void store_drop_waiters(struct store *s, const void *conn);

/* Hands every queued waiter to fn (which owns it after), emptying the queues
 * (the shard is stopping). */
void store_take_waiters(struct store *s, store_serve_fn fn, void *arg);

/* Declares rank gone (see the header comment) and completes what only
 * waited for it. Returns 0, or -ENOMEM if an update could not be applied. */
int store_worker_gone(struct store *s, uint32_t rank);

/* A gone rank is back: it counts again, its clocks fast-forwarded. */
void store_worker_back(struct store *s, uint32_t rank);

static inline bool store_is_gone(const struct store *s, uint32_t rank) {
  return s->gone[rank];
}

/* Whether rank owns k (pushes and pulls it; "Owners" above). */
static inline bool store_owns(const struct store_key *k, uint32_t rank) {
  return !k->owns || k->owns[rank];
}

/* The name of k's tensor (for messages). */
const char *store_key_tensor(const struct store *s, const struct store_key *k);

/* Whether rank may push or pull k: 0, or -EPERM with msg naming the tensor
 * and the rank (it does not own it). */
int store_check_owner(const struct store *s, const struct store_key *k, uint32_t rank, char *msg,
                      size_t msglen);

/* Whether progress on this shard waits for rank: a BSP step it has not
 * pushed while others have, or an SSP pull its clock holds back. */
bool store_blocked_on(const struct store *s, uint32_t rank);

/* Sets how rank takes part in the steps (see "Leaving the steps"; STORE_IN:
 * it takes part again). Joining completes what only waited for it. Returns
 * 0, or -ENOMEM if an update could not be applied. */
int store_set_left(struct store *s, uint32_t rank, enum store_left how);

/* A rank that joined takes part in the steps again (a next epoch after
 * join): its clocks move to where the others are (as a gone rank's that
 * comes back) and it counts again. Nothing for a rank that did not join. */
void store_rejoin(struct store *s, uint32_t rank);

static inline enum store_left store_left(const struct store *s, uint32_t rank) {
  return (enum store_left)s->left[rank];
}

/* Whether a pull of k for min_version (SSP: the puller's clock) cannot be
 * answered before rank pushes a step it has not pushed: rank counts (not
 * gone, not joined) and, in BSP, the pull waits for the key's current step
 * (min_version > version) and rank has not pushed it; in SSP, rank's clock
 * holds the pull back. Never in ASP. With min_version = version + 1 it says
 * whether the current step waits for rank. */
bool store_waits_for(const struct store *s, const struct store_key *k, uint32_t rank,
                     uint64_t min_version);

/* Hands each waiter of k that waits for rank (store_waits_for) to fn, which
 * owns it after. */
void store_take_waiters_on(struct store *s, struct store_key *k, uint32_t rank, store_serve_fn fn,
                           void *arg);

/* BSP: no key has an unfinished step (every started step completed). */
bool store_at_step_boundary(const struct store *s);

/* Restores k from a checkpoint: parameters (count floats), version, the
 * optimizer state (opt_state_floats * count floats, or NULL = none yet) and
 * the per-rank clocks (num_workers entries). Copies everything. Returns 0 or
 * -ENOMEM. */
int store_restore_key(struct store *s, struct store_key *k, uint64_t version, const float *params,
                      const float *opt_state, const uint64_t *next_step);

/* rank's clock on this shard: the lowest next_step over its keys (where a
 * restarted worker resumes); UINT64_MAX if the shard holds no keys. */
uint64_t store_worker_clock(const struct store *s, uint32_t rank);

#endif
