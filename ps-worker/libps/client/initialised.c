/* initialised: ps_wait_initialised (ps.h), the call between ps_declare (and
 * rank 0's ps_init) and a rank's first push.
 *
 * A shard answers a pull of an uninitialised key only once its first INIT
 * arrives, and a pull of version 0 is answered at once after that in every
 * consistency model (bsp: version >= 0; asp: always; ssp: clock 0 is within
 * any bound). So waiting for initialisation is pulling version 0 of each
 * tensor this rank pushes and throwing the values away: what ps.torch's
 * declare and ps-worker's first pull do, named.
 *
 * The pulls are started in windows whose buffers fit in one scratch block
 * (the largest tensor, or WINDOW_BYTES if the tensors are smaller), so a
 * model of many tensors costs a few round trips, not one per tensor, and a
 * huge one never a second copy of the model. They use the callback form of
 * ps_pull_async, which cannot be abandoned: on a timeout the waiter leaves,
 * and the last callback (at the latest when ps_client_free fails the pulls
 * with PS_ERR_CLOSED) frees the scratch with the shared state. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "client_impl.h"
#include "clock.h"
#include "ps.h"

#define WINDOW_BYTES (16u << 20) /* scratch when every tensor is smaller */
#define DEFAULT_TIMEOUT_MS 60000 /* timeout_ms 0 */

struct waiting;

/* One tensor's pull: its callback's argument. */
struct slot {
  struct waiting *w;
  bool out; /* started and not completed */
};

/* What the waiter and the pulls' callbacks share; freed by the last of them. */
struct waiting {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int holders;  /* pulls not yet completed, + 1 while the waiter is in */
  int pending;  /* pulls of the current window not yet completed */
  ps_status st; /* the first failure */
  float *scratch;
  struct slot *slots; /* one per tensor */
};

/* Releases one holder (under w->mu); the last one frees w. */
static void release(struct waiting *w) {
  bool last = --w->holders == 0;
  pthread_mutex_unlock(&w->mu);
  if (!last) return;
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w->scratch);
  free(w->slots);
  free(w);
}

static void pulled(ps_status st, void *arg) {
  struct slot *sl = arg;
  struct waiting *w = sl->w;
  pthread_mutex_lock(&w->mu);
  sl->out = false;
  if (st != PS_OK && w->st == PS_OK) w->st = st;
  if (--w->pending == 0) pthread_cond_signal(&w->cv);
  release(w);
}

static struct waiting *waiting_new(int num_tensors, size_t scratch_floats) {
  struct waiting *w = calloc(1, sizeof(*w));
  if (!w) return NULL;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  bool ok = (w->scratch = malloc(scratch_floats * sizeof(float))) != NULL &&
            (w->slots = calloc((size_t)num_tensors, sizeof(struct slot))) != NULL &&
            pthread_mutex_init(&w->mu, NULL) == 0;
  if (ok && pthread_cond_init(&w->cv, &ca) != 0) {
    pthread_mutex_destroy(&w->mu);
    ok = false;
  }
  pthread_condattr_destroy(&ca);
  if (!ok) {
    free(w->scratch);
    free(w->slots);
    free(w);
    return NULL;
  }
  for (int t = 0; t < num_tensors; t++) w->slots[t].w = w;
  w->holders = 1;
  return w;
}

/* Waits (under w->mu) until the window's pulls completed or the deadline
 * (UINT64_MAX: none) passed. Returns false on the deadline. */
static bool wait_window(struct waiting *w, uint64_t deadline_ns) {
  while (w->pending > 0) {
    if (deadline_ns == UINT64_MAX) {
      pthread_cond_wait(&w->cv, &w->mu);
      continue;
    }
    if (clock_now_ns() >= deadline_ns) return false;
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000u),
                          .tv_nsec = (long)(deadline_ns % 1000000000u)};
    pthread_cond_timedwait(&w->cv, &w->mu, &ts);
  }
  return true;
}

/* The scratch block: the largest tensor this rank pulls, at least the
 * window (or all of them, when they add up to less). */
static size_t scratch_floats(const ps_client *c) {
  uint64_t largest = 0, total = 0;
  for (int t = 0; t < c->num_tensors; t++) {
    if (!c->mine[t]) continue;
    total += c->counts[t];
    if (c->counts[t] > largest) largest = c->counts[t];
  }
  uint64_t window = WINDOW_BYTES / sizeof(float);
  uint64_t n = total < window ? total : window;
  return (size_t)(largest > n ? largest : n);
}

/* The message of a timeout (under w->mu): the first tensor still waiting,
 * and how many more. */
static void say_timeout(ps_client *c, const struct waiting *w, int ms) {
  int first = -1, more = 0;
  for (int t = 0; t < c->num_tensors; t++) {
    if (!w->slots[t].out) continue;
    if (first < 0)
      first = t;
    else
      more++;
  }
  if (first < 0) return;
  client_set_err(c,
                 "tensor %d (%s)%s is not initialised after %d ms: rank 0 (or, with "
                 "ps_declare_owned, one of its owners) calls ps_init for every tensor before "
                 "any rank pushes",
                 first, c->names[first], more ? " and others" : "", ms);
}

ps_status ps_wait_initialised(ps_client *c, int timeout_ms) {
  if (!c || timeout_ms < -1) return PS_ERR_INVALID;
  if (!c->declared) {
    client_set_err(c, "ps_wait_initialised before ps_declare");
    return PS_ERR_STATE;
  }
  int n = c->num_tensors;
  size_t room = scratch_floats(c);
  if (room == 0) return PS_OK; /* this rank owns no tensor: it pushes nothing */
  struct waiting *w = waiting_new(n, room);
  if (!w) return PS_ERR_NOMEM;
  int ms = timeout_ms == 0 ? DEFAULT_TIMEOUT_MS : timeout_ms;
  uint64_t deadline = ms < 0 ? UINT64_MAX : clock_now_ns() + (uint64_t)ms * 1000000u;
  ps_status st = PS_OK;
  bool timed_out = false;
  pthread_mutex_lock(&w->mu);
  for (int t = 0; st == PS_OK && t < n;) {
    /* a window: the next tensors in order while they fit the scratch block */
    size_t used = 0;
    for (; t < n; t++) {
      if (!c->mine[t]) continue;
      if (used > 0 && used + c->counts[t] > room) break;
      w->pending++;
      w->holders++;
      w->slots[t].out = true;
      pthread_mutex_unlock(&w->mu); /* the callback may run at once */
      ps_status s = ps_pull_async(c, t, 0, w->scratch + used, pulled, &w->slots[t], NULL);
      pthread_mutex_lock(&w->mu);
      if (s != PS_OK) { /* never started: no callback will come */
        w->pending--;
        w->holders--;
        w->slots[t].out = false;
        st = s;
        break;
      }
      used += c->counts[t];
    }
    if (st != PS_OK) break; /* the window's other pulls end on their own */
    if (!wait_window(w, deadline)) {
      timed_out = true;
      break;
    }
    if (st == PS_OK) st = w->st;
  }
  if (timed_out) {
    say_timeout(c, w, ms);
    if (st == PS_OK) st = PS_ERR_STATE;
  }
  release(w); /* unlocks; the pulls still out free it when they end */
  if (st == PS_ERR_STATE_LOST) client_relay_lost(c);
  return st;
}
