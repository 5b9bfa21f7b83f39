/* sync3d: the data-parallel axis of the 3D trainer (see trainer3d.h).
 *
 * allreduce mode: each gradient's mean over the data-parallel group, queued
 * at REDUCE_GRADS (all of them, on the job's worker thread) and waited for
 * at OPTIMIZER_STEP, then sync_ring's update (tm_sgd_momentum with
 * sync_ring_lr's schedule): the arithmetic of one worker's ring.
 *
 * ps mode: the shards hold every (stage, tensor slice) as its own tensor,
 * declared with its owners by ps_declare_owned; a split slice is owned by
 * the data-parallel replicas of its (stage, tensor rank); a replicated
 * tensor (a row-parallel layer's bias: one name on every tensor rank of the
 * stage) by the replicas of every tensor rank of its stage, all of which
 * push it (their gradients are equal) and pull it, so no rank waits on
 * another's copy. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "tensor_math.h"
#include "trainer3d.h"

struct sync3d {
  struct mp_stage *st;
  int nt;
  /* allreduce mode */
  ps_coll *dp; /* NULL: one replica */
  struct sync_ring_opts o;
  float **vel; /* per tensor, NULL without momentum */
  ps_coll_request **req;
  size_t state_floats;
  struct sync3d_zero *zero; /* shard_state with D > 1: the data-parallel axis */
  /* ps mode */
  ps_client *c;
  uint64_t resume;     /* ps_resume_step at open: the first step this rank has not pushed */
  uint64_t newest_ver; /* the newest version pulled at open */
  uint64_t *ver;       /* per tensor: the version pulled at open */
  bool redo;           /* redo_step was pushed in part before a restart */
  uint64_t redo_step;
  int *key; /* this rank's tensor i is declared tensor key[i] */
  ps_request **push, **pull;
  ps_status status;
  char msg[512];
};

static struct sync3d *alloc_common(struct mp_stage *st) {
  struct sync3d *s = calloc(1, sizeof(*s));
  if (!s) return NULL;
  s->st = st;
  s->nt = mp_stage_num_tensors(st);
  s->req = calloc((size_t)s->nt, sizeof(*s->req));
  s->vel = calloc((size_t)s->nt, sizeof(*s->vel));
  s->key = calloc((size_t)s->nt, sizeof(*s->key));
  s->push = calloc((size_t)s->nt, sizeof(*s->push));
  s->pull = calloc((size_t)s->nt, sizeof(*s->pull));
  s->ver = calloc((size_t)s->nt, sizeof(*s->ver));
  if (!s->req || !s->vel || !s->key || !s->push || !s->pull || !s->ver) {
    sync3d_close(s);
    return NULL;
  }
  return s;
}

int sync3d_open_ring(ps_coll *dp, const struct sync_ring_opts *o, struct mp_stage *st,
                     struct sync3d **out) {
  struct sync3d *s = alloc_common(st);
  if (!s) return -ENOMEM;
  s->dp = dp && ps_coll_world_size(dp) > 1 ? dp : NULL;
  s->o = *o;
  if (s->dp && o->shard_state) {
    int r = sync3d_zero_open(s->dp, o, st, &s->zero);
    if (r < 0) sync3d_close(s);
    if (r == 0) *out = s;
    return r;
  }
  for (int i = 0; i < s->nt && o->momentum != 0.0f; i++) {
    size_t n = mp_stage_tensor_count(st, i);
    if (!(s->vel[i] = calloc(n, sizeof(float)))) {
      sync3d_close(s);
      return -ENOMEM;
    }
    s->state_floats += n;
  }
  *out = s;
  return 0;
}

static int roll_back(struct sync3d *s);

/* Records the first failure with its message; -ECONNRESET for a lost peer
 * or shard (retryable), else -EPROTO. */
static int fail(struct sync3d *s, ps_status st) {
  if (st == PS_ERR_ROLLBACK && s->c && s->status == PS_OK) return roll_back(s);
  if (s->status == PS_OK) {
    s->status = st;
    if (s->c)
      ps_errmsg(s->c, s->msg, sizeof(s->msg));
    else if (s->dp)
      ps_coll_errmsg(s->dp, s->msg, sizeof(s->msg));
    log_error("data-parallel reduction failed", "status=%s error=\"%s\"", ps_strerror(st), s->msg);
  }
  return st == PS_ERR_IO || st == PS_ERR_CONNECT ? -ECONNRESET : -EPROTO;
}

/* A shard came back from an older checkpoint (PS_ERR_ROLLBACK). The
 * pipeline cannot go back in place: its stages are mid-step, some on the
 * next step's activations already. So this rank waits for its requests,
 * takes every shard back to the checkpoint's clock (ps_rollback: all or
 * nothing, once per job however many ranks ask) and stops retryably; the
 * restarted job resumes at that clock (sync3d_resume_ps). */
static int roll_back(struct sync3d *s) {
  for (int i = 0; i < s->nt; i++) {
    if (s->push[i]) ps_wait(s->push[i], NULL);
    if (s->pull[i]) ps_wait(s->pull[i], NULL);
    s->push[i] = s->pull[i] = NULL;
  }
  uint64_t back = ps_rollback_clock(s->c);
  ps_status st = back == UINT64_MAX ? PS_ERR_ROLLBACK : ps_rollback(s->c, back);
  s->status = st == PS_OK ? PS_ERR_ROLLBACK : st;
  if (st != PS_OK) {
    ps_errmsg(s->c, s->msg, sizeof(s->msg));
    log_error("a shard came back from an older checkpoint and the shards cannot be rolled back",
              "status=%s error=\"%s\"", ps_strerror(st), s->msg);
    return -EPROTO;
  }
  snprintf(s->msg, sizeof(s->msg),
           "a shard came back from its checkpoint of step %llu: rolled the shards back to it",
           (unsigned long long)back);
  log_error(
      "a shard came back from an older checkpoint: rolled the shards back to it; the 3D "
      "job stops (exit 129) and, restarted, resumes at that step",
      "clock=%llu", (unsigned long long)back);
  return -ECONNRESET;
}

/* The declared layout: every (stage, tensor rank)'s tensors, a replicated
 * one once (from tensor rank 0), with its owners. */
struct layout {
  int n, cap;
  char **names;
  uint64_t *counts;
  int **owners;
  int *num_owners;
};

static void layout_free(struct layout *l) {
  for (int j = 0; j < l->n; j++) {
    free(l->names[j]);
    free(l->owners[j]);
  }
  free(l->names);
  free(l->counts);
  free(l->owners);
  free(l->num_owners);
}

static int layout_add(struct layout *l, const struct mp_plan *p, int world, int pp, int tp,
                      const char *name, size_t count, bool replicated) {
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 64;
    char **nn = realloc(l->names, (size_t)cap * sizeof(*nn));
    if (nn) l->names = nn;
    uint64_t *nc = realloc(l->counts, (size_t)cap * sizeof(*nc));
    if (nc) l->counts = nc;
    int **no = realloc(l->owners, (size_t)cap * sizeof(*no));
    if (no) l->owners = no;
    int *nno = realloc(l->num_owners, (size_t)cap * sizeof(*nno));
    if (nno) l->num_owners = nno;
    if (!nn || !nc || !no || !nno) return -ENOMEM;
    l->cap = cap;
  }
  int d = world / (p->tp * p->pp), k = 0;
  int *own = calloc((size_t)(d * p->tp), sizeof(int));
  char *copy = strdup(name);
  if (!own || !copy) {
    free(own);
    free(copy);
    return -ENOMEM;
  }
  for (int t = replicated ? 0 : tp; t < (replicated ? p->tp : tp + 1); t++)
    for (int r = 0; r < d; r++) {
      struct ps_grid_coords c = {.tp = t, .dp = r, .pp = pp};
      own[k++] = ps_grid_rank_of(world, p->tp, p->pp, c);
    }
  l->names[l->n] = copy;
  l->counts[l->n] = count;
  l->owners[l->n] = own;
  l->num_owners[l->n] = k;
  l->n++;
  return 0;
}

static int layout_build(struct layout *l, const struct mp_plan *p, int world) {
  memset(l, 0, sizeof(*l));
  for (int pp = 0; pp < p->pp; pp++)
    for (int tp = 0; tp < p->tp; tp++) {
      struct mp_stage *sh = trainer3d_shadow_stage(p, pp, tp);
      if (!sh) return -errno;
      int ret = 0;
      for (int i = 0; i < mp_stage_num_tensors(sh) && ret == 0; i++) {
        bool rep = mp_stage_tensor_replicated(sh, i);
        if (rep && tp != 0) continue;
        ret = layout_add(l, p, world, pp, tp, mp_stage_tensor_name(sh, i),
                         mp_stage_tensor_count(sh, i), rep && p->tp > 1);
      }
      mp_stage_free(sh);
      if (ret < 0) return ret;
    }
  return 0;
}

static int layout_find(const struct layout *l, const char *name) {
  for (int j = 0; j < l->n; j++)
    if (!strcmp(l->names[j], name)) return j;
  return -1;
}

/* Job rank 0: every declared tensor's initial values, cut from full. */
static ps_status init_keys(struct sync3d *s, const struct mp_plan *p, const struct layout *l,
                           const struct mlp *full) {
  for (int pp = 0; pp < p->pp; pp++)
    for (int tp = 0; tp < p->tp; tp++) {
      struct mp_stage *sh = trainer3d_shadow_stage(p, pp, tp);
      if (!sh || mp_stage_load_full(sh, full) < 0) {
        mp_stage_free(sh);
        snprintf(s->msg, sizeof(s->msg), "cannot cut stage %d, tensor rank %d's slices", pp, tp);
        return PS_ERR_NOMEM;
      }
      ps_status st = PS_OK;
      for (int i = 0; i < mp_stage_num_tensors(sh) && st == PS_OK; i++) {
        if (tp != 0 && mp_stage_tensor_replicated(sh, i)) continue;
        st = ps_init(s->c, layout_find(l, mp_stage_tensor_name(sh, i)), mp_stage_param(sh, i));
      }
      mp_stage_free(sh);
      if (st != PS_OK) return st;
    }
  return PS_OK;
}

int sync3d_open_ps(ps_client *c, const struct mp_plan *plan, int world, int job_rank,
                   struct mp_stage *st, const struct mlp *full, struct sync3d **out) {
  struct sync3d *s = alloc_common(st);
  if (!s) return -ENOMEM;
  s->c = c;
  struct layout l;
  int ret = layout_build(&l, plan, world);
  if (ret < 0) goto fail;
  for (int i = 0; i < s->nt; i++) {
    if ((s->key[i] = layout_find(&l, mp_stage_tensor_name(st, i))) < 0) {
      log_error("internal error: a tensor of this rank is not in the layout", "tensor=%s",
                mp_stage_tensor_name(st, i));
      ret = -EPROTO;
      goto fail;
    }
  }
  ps_status pst = ps_declare_owned(c, l.n, (const char *const *)l.names, l.counts,
                                   (const int *const *)l.owners, l.num_owners);
  /* a restarted job (the shards hold it): no re-init, the current version;
   * a rank that stopped before it rolled back with the others (roll_back)
   * is asked to now, by its first request */
  for (int tries = 0; pst == PS_OK || (pst == PS_ERR_ROLLBACK && tries < 3); tries++) {
    if (pst == PS_ERR_ROLLBACK) {
      uint64_t back = ps_rollback_clock(c);
      pst = back == UINT64_MAX ? PS_ERR_ROLLBACK : ps_rollback(c, back);
      if (pst != PS_OK) break;
      log_warn(
          "the shards were rolled back to a checkpoint while this rank was away: it rolls "
          "back too",
          "clock=%llu job_rank=%d", (unsigned long long)back, job_rank);
    }
    s->newest_ver = 0;
    pst = ps_resume_step(c, &s->resume);
    if (pst == PS_OK && job_rank == 0 && s->resume == 0) pst = init_keys(s, plan, &l, full);
    for (int i = 0; i < s->nt && pst == PS_OK; i++) {
      uint64_t v = 0;
      pst = ps_pull(c, s->key[i], 0, mp_stage_param(st, i), &v);
      if (v > s->newest_ver) s->newest_ver = v;
      s->ver[i] = v;
    }
    if (pst == PS_OK) break;
  }
  if (pst != PS_OK) {
    ret = fail(s, pst);
    log_error("cannot set up the model's slices on the shards", "tensors=%d", l.n);
    goto fail;
  }
  log_info("model slices declared", "tensors=%d own=%d", l.n, s->nt);
  layout_free(&l);
  *out = s;
  return 0;
fail:
  layout_free(&l);
  sync3d_close(s);
  return ret;
}

/* Ranks that pushed `step` (resume > step), into buf. */
static void ranks_ahead(const uint64_t *all, int world, uint64_t step, char *buf, size_t len) {
  size_t at = 0;
  buf[0] = '\0';
  for (int r = 0; r < world && at < len; r++) {
    if (all[2 * r] <= step && all[2 * r + 1] <= step) continue;
    int k = snprintf(buf + at, len - at, "%s%d (next step to push %llu, holds version %llu)",
                     at ? ", " : "", r, (unsigned long long)all[2 * r],
                     (unsigned long long)all[2 * r + 1]);
    at += k > 0 ? (size_t)k : 0;
  }
}

int sync3d_resume_ps(struct sync3d *s, ps_coll *job, int world, int job_rank, uint64_t *step) {
  uint64_t me[2] = {s->resume, s->newest_ver}, *all = me;
  *step = 0;
  if (job) {
    if (!(all = calloc(2 * (size_t)world, sizeof(uint64_t)))) return -ENOMEM;
    ps_status st = ps_coll_allgather(job, me, all, sizeof(me));
    if (st != PS_OK) {
      free(all);
      ps_coll_errmsg(job, s->msg, sizeof(s->msg));
      log_error("cannot agree on the step to resume at", "error=\"%s\"", s->msg);
      return st == PS_ERR_IO || st == PS_ERR_CONNECT ? -ECONNRESET : -EPROTO;
    }
  } else {
    world = 1;
  }
  uint64_t at = UINT64_MAX, newest = 0;
  for (int r = 0; r < world; r++) {
    if (all[2 * r] < at) at = all[2 * r];
    if (all[2 * r + 1] > newest) newest = all[2 * r + 1];
  }
  /* versions count steps under bsp only (asp/ssp: pushes applied on arrival) */
  struct ps_shard_stats ss;
  if (newest > at && ps_stats(s->c, 0, &ss) == PS_OK && !strcmp(ss.consistency, "bsp")) {
    /* Step `at` was pushed in part (a rank lost amid its pushes, or before
     * its partners'). A new process's push of a step the shard holds from
     * the earlier one is refused as lost state, so the step is redone with
     * only what is missing pushed: a key whose version is past it is
     * complete, and a rank whose clock is past it pushed all of its keys.
     * Its gradients are computed on slices some of which hold it already:
     * not the uninterrupted run's (one step). */
    char who[1024];
    ranks_ahead(all, world, at, who, sizeof(who));
    log_warn(
        "the shards hold a step pushed in part: the job redoes it, each rank pushing only "
        "what the shards still wait for; the redone step is computed on slices some of "
        "which hold it already, so it is not the uninterrupted run's",
        "step=%llu newest_version=%llu ranks_ahead=\"%s\" job_rank=%d", (unsigned long long)at,
        (unsigned long long)newest, who, job_rank);
    s->redo = true;
    s->redo_step = at;
  }
  if (all != me) free(all);
  *step = at;
  if (at > 0)
    log_info("resumed at the shards' step", "step=%llu newest_version=%llu job_rank=%d",
             (unsigned long long)at, (unsigned long long)newest, job_rank);
  return 0;
}

/* Whether the shards still wait for this rank's push of tensor i at step
 * (all but in a redone step, sync3d_resume_ps). */
static bool wanted(const struct sync3d *s, int i, uint64_t step) {
  if (!s->redo || step != s->redo_step) return true;
  return s->resume <= step && s->ver[i] <= step;
}

int sync3d_reduce(struct sync3d *s, uint64_t step) {
  if (s->status != PS_OK) return fail(s, s->status);
  if (s->zero) {
    ps_status st = sync3d_zero_reduce(s->zero);
    return st == PS_OK ? 0 : fail(s, st);
  }
  for (int i = s->nt - 1; i >= 0; i--) { /* the last layer's first, as backward ends */
    ps_status st = PS_OK;
    if (s->c && !wanted(s, i, step))
      continue;
    else if (s->c)
      st = ps_push_async(s->c, s->key[i], step, mp_stage_grad(s->st, i), NULL, NULL, &s->push[i]);
    else if (s->dp)
      st = ps_coll_allreduce_async(s->dp, mp_stage_grad(s->st, i), mp_stage_tensor_count(s->st, i),
                                   PS_REDOP_AVG, &s->req[i]);
    if (st != PS_OK) return fail(s, st);
  }
  return 0;
}

static int update_ps(struct sync3d *s, uint64_t step) {
  ps_status first = PS_OK;
  for (int i = s->nt - 1; i >= 0; i--) {
    ps_status st = s->push[i] ? ps_wait(s->push[i], NULL) : PS_OK;
    s->push[i] = NULL;
    if (st != PS_OK && first == PS_OK) first = st;
  }
  for (int i = s->nt - 1; i >= 0 && first == PS_OK; i--)
    first =
        ps_pull_async(s->c, s->key[i], step + 1, mp_stage_param(s->st, i), NULL, NULL, &s->pull[i]);
  for (int i = s->nt - 1; i >= 0; i--) {
    uint64_t v = step + 1;
    ps_status st = s->pull[i] ? ps_wait(s->pull[i], &v) : PS_OK;
    s->pull[i] = NULL;
    if (st == PS_OK && v < step + 1) st = PS_ERR_REMOTE;
    if (st != PS_OK && first == PS_OK) first = st;
  }
  return first == PS_OK ? 0 : fail(s, first);
}

int sync3d_update(struct sync3d *s, uint64_t step) {
  if (s->c) return update_ps(s, step);
  if (s->zero) {
    ps_status st = sync3d_zero_update(s->zero, step);
    return st == PS_OK ? 0 : fail(s, st);
  }
  ps_status first = PS_OK;
  for (int i = s->nt - 1; i >= 0; i--) {
    ps_status st = s->req[i] ? ps_coll_wait(s->req[i]) : PS_OK;
    s->req[i] = NULL;
    if (st != PS_OK && first == PS_OK) first = st;
  }
  if (first != PS_OK) return fail(s, first);
  float lr = sync_ring_lr(&s->o, step);
  for (int i = 0; i < s->nt; i++)
    tm_sgd_momentum(mp_stage_param(s->st, i), s->vel[i], mp_stage_grad(s->st, i), lr, s->o.momentum,
                    mp_stage_tensor_count(s->st, i));
  return 0;
}

int sync3d_finish(struct sync3d *s, int job_rank) {
  if (!s->c) return 0;
  ps_status st = ps_leave(s->c, PS_LEAVE_FINISHED);
  if (st == PS_OK) st = ps_barrier(s->c);
  int lost[16], n = 0;
  if (st == PS_OK && ps_lost_workers(s->c, lost, 16, &n) == PS_OK && n > 0 && job_rank == 0)
    log_error("the job went on without workers: their slices were not all trained on",
              "workers_lost=%d first=%d", n, lost[0]);
  if (st == PS_OK && job_rank == 0) st = ps_shutdown_servers(s->c);
  return st == PS_OK ? 0 : fail(s, st);
}

const char *sync3d_errmsg(struct sync3d *s, char *buf, size_t len) {
  snprintf(buf, len, "%s", s ? s->msg : "");
  return buf;
}

float *const *sync3d_velocity(const struct sync3d *s) {
  return s->vel;
}

size_t sync3d_state_floats(const struct sync3d *s) {
  return !s ? 0 : s->zero ? sync3d_zero_state_floats(s->zero) : s->state_floats;
}

void sync3d_close(struct sync3d *s) {
  if (!s) return;
  sync3d_zero_close(s->zero);
  for (int i = 0; i < s->nt; i++) {
    if (s->req && s->req[i]) ps_coll_wait(s->req[i]);
    if (s->push && s->push[i]) ps_wait(s->push[i], NULL);
    if (s->pull && s->pull[i]) ps_wait(s->pull[i], NULL);
    if (s->vel) free(s->vel[i]);
  }
  free(s->req);
  free(s->vel);
  free(s->key);
  free(s->push);
  free(s->pull);
  free(s->ver);
  free(s);
}
