/* pipeline: the schedules of pipeline.h as lists of actions.
 *
 * Two steps. First each stage's order of computations (forwards and
 * backwards) comes from the schedule's rule: GPipe's all-forwards-then-all-
 * backwards, 1F1B's warm-up of p - s - 1 forwards then one forward one
 * backward, Megatron's interleaved order (its get_model_chunk_id and warm-up
 * of 2(p - s - 1) + (v - 1)p), and for ZB-H1 1F1B's order of forwards and
 * input-gradient halves B, the weight halves W queued and run when the stage
 * would otherwise wait (for the next F or B's input), or before a forward
 * that would hold more activations than 1F1B's stage 0 does (p): the
 * paper's H1 memory bound, no stage above 1F1B's peak.
 *
 * Then the sends and receives are placed by running every stage together at
 * nominal costs (F = 1, B = 2, or 1 + 1 split) in one simulation with
 * blocking (rendezvous) semantics: whenever two stages are idle at the same
 * instant and one holds a tensor the other will consume, the send goes into
 * the holder's list and the receive into the other's at that instant. So
 * every send and its receive are one event of a single global order in which
 * each stage's actions appear as in its list: that order is an execution of
 * the lists in which each send meets its receive, which is why no execution
 * can deadlock, with blocking sends or with buffered ones, and why the
 * messages between two ranks are received in the order they are sent.
 * Communication goes first at each instant, so a stage never starts a
 * computation while a peer waits on a tensor it holds.
 *
 * ps_pipe_actions generates every stage's list and keeps one (p lists cost
 * O(p m v) memory; the generation O(p^2 m v) time at worst, which is small
 * for the shapes ps_pipe_check allows in practice). */
#include <stdlib.h>
#include <string.h>

#include "pipeline_impl.h"

#include <stdio.h>

static const char *const sched_names[] = {"gpipe", "1f1b", "interleaved", "zb-h1"};

ps_status ps_pipe_schedule_parse(const char *s, ps_pipe_schedule *out, char *err, size_t errlen) {
  for (int k = 0; k < 4; k++) {
    if (s && strcmp(s, sched_names[k]) == 0) {
      *out = (ps_pipe_schedule)k;
      return PS_OK;
    }
  }
  if (errlen > 0) {
    snprintf(err, errlen,
             "unknown pipeline schedule '%s': expected gpipe, 1f1b, interleaved or zb-h1",
             s ? s : "(null)");
  }
  return PS_ERR_INVALID;
}

const char *ps_pipe_schedule_name(ps_pipe_schedule k) {
  return (unsigned)k < 4 ? sched_names[k] : "unknown";
}

const char *pipe_op_name(ps_pipe_op op) {
  static const char *const names[] = {
      "forward",  "backward",  "backward_input", "backward_weight", "send_act",
      "recv_act", "send_grad", "recv_grad",      "reduce_grads",    "optimizer_step"};
  return (unsigned)op < 10 ? names[op] : "unknown";
}

#define ERR(...) (errlen > 0 ? (void)snprintf(err, errlen, __VA_ARGS__) : (void)0)

ps_status ps_pipe_check(const struct ps_pipe_shape *sh, char *err, size_t errlen) {
  if (!sh) {
    ERR("no pipeline shape");
    return PS_ERR_INVALID;
  }
  if ((unsigned)sh->kind > PS_PIPE_ZBH1) {
    ERR("unknown pipeline schedule %d", (int)sh->kind);
    return PS_ERR_INVALID;
  }
  if (sh->stages < 1 || sh->stages > 256) {
    ERR("pipeline stages %d: expected 1..256", sh->stages);
    return PS_ERR_INVALID;
  }
  if (sh->micro < 1 || sh->micro > 4096) {
    ERR("micro-batches %d: expected 1..4096", sh->micro);
    return PS_ERR_INVALID;
  }
  if (sh->kind == PS_PIPE_INTERLEAVED) {
    if (sh->chunks < 2 || sh->chunks > 16) {
      ERR("interleaved schedule with %d model chunks per rank: expected 2..16", sh->chunks);
      return PS_ERR_INVALID;
    }
    if (sh->micro % sh->stages != 0) {
      ERR("interleaved schedule: %d micro-batches is not a multiple of the %d stages", sh->micro,
          sh->stages);
      return PS_ERR_INVALID;
    }
  } else if (sh->chunks != 1) {
    ERR("%s schedule with %d model chunks per rank: only interleaved has more than 1",
        ps_pipe_schedule_name(sh->kind), sh->chunks);
    return PS_ERR_INVALID;
  }
  return PS_OK;
}

/* ---- each stage's order of computations ---- */

struct comp {
  ps_pipe_op op;
  int micro, chunk;
};

static int push_comp(struct comp *seq, int *n, ps_pipe_op op, int micro, int chunk) {
  seq[*n] = (struct comp){op, micro, chunk};
  return ++*n;
}

/* Megatron's interleaved order: the k-th forward (or backward) of a rank
 * runs micro-batch (k / (p v)) p + k % p on chunk (k % (p v)) / p (backward:
 * counted from the last chunk). */
static struct comp interleaved_at(int p, int v, int k, int forward) {
  int group = k % (p * v);
  int chunk = group / p;
  struct comp c = {forward ? PS_PIPE_FORWARD : PS_PIPE_BACKWARD, (k / (p * v)) * p + k % p,
                   forward ? chunk : v - 1 - chunk};
  return c;
}

/* Stage s's computations (for ZB-H1 without the W's) into seq (room for
 * 2 m v), their number into *n. */
static void stage_order(const struct ps_pipe_shape *sh, int s, struct comp *seq, int *n) {
  int p = sh->stages, m = sh->micro, v = sh->chunks;
  *n = 0;
  if (sh->kind == PS_PIPE_GPIPE) {
    for (int i = 0; i < m; i++) push_comp(seq, n, PS_PIPE_FORWARD, i, 0);
    for (int i = 0; i < m; i++) push_comp(seq, n, PS_PIPE_BACKWARD, i, 0);
  } else if (sh->kind == PS_PIPE_INTERLEAVED) {
    int total = m * v;
    int warm = m == p ? total : (p - s - 1) * 2 + (v - 1) * p;
    if (warm > total) warm = total;
    for (int k = 0; k < warm; k++) seq[(*n)++] = interleaved_at(p, v, k, 1);
    for (int k = 0; k < total - warm; k++) {
      seq[(*n)++] = interleaved_at(p, v, k + warm, 1);
      seq[(*n)++] = interleaved_at(p, v, k, 0);
    }
    for (int k = total - warm; k < total; k++) seq[(*n)++] = interleaved_at(p, v, k, 0);
  } else {
    ps_pipe_op b = sh->kind == PS_PIPE_ZBH1 ? PS_PIPE_BACKWARD_INPUT : PS_PIPE_BACKWARD;
    int warm = p - s - 1 < m ? p - s - 1 : m;
    for (int i = 0; i < warm; i++) push_comp(seq, n, PS_PIPE_FORWARD, i, 0);
    for (int i = 0; i < m - warm; i++) {
      push_comp(seq, n, PS_PIPE_FORWARD, warm + i, 0);
      push_comp(seq, n, b, i, 0);
    }
    for (int i = m - warm; i < m; i++) push_comp(seq, n, b, i, 0);
  }
}

/* ---- placing the sends and receives: the joint run at nominal costs ---- */

enum { TENSOR_NONE = 0, TENSOR_AT_SENDER = 1, TENSOR_AT_CONSUMER = 2 };

struct outgoing {
  int grad, micro, vs, dest, sent; /* a tensor for virtual stage vs on stage dest */
};

struct gen_stage {
  struct comp *seq;
  struct outgoing *outbox; /* what this stage computed for its peers, oldest first */
  int outbox_head, outbox_n;
  int nseq, pos;
  struct comp *wq; /* ZB-H1: the W's whose B is done, oldest first */
  int wq_head, wq_tail;
  int held, cap; /* ZB-H1: activations held (F done, W not), and the most allowed */
  int busy;
  double until;
  struct comp cur;
  struct ps_pipe_action *out;
  size_t nout;
};

struct gen {
  int p, m, v, V, zb;
  unsigned char *tensor; /* [kind 0 act / 1 grad][micro][consumer's virtual stage] */
  struct gen_stage *st;
};

static unsigned char *tensor_at(struct gen *g, int grad, int micro, int vs) {
  return &g->tensor[((size_t)grad * g->m + micro) * g->V + vs];
}

static void emit(struct gen_stage *s, ps_pipe_op op, int micro, int chunk, int peer) {
  s->out[s->nout++] = (struct ps_pipe_action){op, micro, chunk, peer};
}

/* The remote tensor c needs on stage s: 1 with its kind, micro and consumer
 * virtual stage, 0 when it needs none (first/last virtual stage, a W, or a
 * hand-over on the same rank). */
static int needs(const struct gen *g, int s, struct comp c, int *grad, int *vs) {
  int k = c.chunk * g->p + s;
  if (c.op == PS_PIPE_FORWARD && k > 0) {
    *grad = 0, *vs = k;
    return 1;
  }
  if ((c.op == PS_PIPE_BACKWARD || c.op == PS_PIPE_BACKWARD_INPUT) && k < g->V - 1) {
    *grad = 1, *vs = k;
    return 1;
  }
  return 0;
}

static int ready(struct gen *g, int s, struct comp c) {
  int grad, vs;
  return !needs(g, s, c, &grad, &vs) || *tensor_at(g, grad, c.micro, vs) == TENSOR_AT_CONSUMER;
}

static int forced_w(const struct gen *g, const struct gen_stage *st) {
  return g->zb && st->pos < st->nseq && st->seq[st->pos].op == PS_PIPE_FORWARD &&
         st->held >= st->cap;
}

/* Delivers what idle stage q holds for idle stage s, if anything: every
 * tensor as soon as both ends are free, not only the one s needs next, so a
 * stage does not later wait on a peer that has started computing. */
static int try_comm(struct gen *g, int q, int s) {
  struct gen_stage *src = &g->st[q], *dst = &g->st[s];
  int moved = 0;
  if (src->busy || dst->busy) return 0;
  for (int i = src->outbox_head; i < src->outbox_n; i++) {
    struct outgoing *o = &src->outbox[i];
    if (o->dest != s || o->sent) continue;
    int from_vs = o->grad ? o->vs + 1 : o->vs - 1;
    emit(src, o->grad ? PS_PIPE_SEND_GRAD : PS_PIPE_SEND_ACT, o->micro, from_vs / g->p, s);
    emit(dst, o->grad ? PS_PIPE_RECV_GRAD : PS_PIPE_RECV_ACT, o->micro, o->vs / g->p, q);
    *tensor_at(g, o->grad, o->micro, o->vs) = TENSOR_AT_CONSUMER;
    o->sent = 1;
    moved = 1;
  }
  while (src->outbox_head < src->outbox_n && src->outbox[src->outbox_head].sent) {
    src->outbox_head++;
  }
  return moved;
}

static double nominal(ps_pipe_op op) {
  return op == PS_PIPE_BACKWARD ? 2.0 : 1.0;
}

static void start(struct gen_stage *st, struct comp c, double now) {
  emit(st, c.op, c.micro, c.chunk, -1);
  st->busy = 1;
  st->cur = c;
  st->until = now + nominal(c.op);
}

/* Idle stage s starts its next computation if it can (ZB-H1: or a W). */
static void try_start(struct gen *g, int s, double now) {
  struct gen_stage *st = &g->st[s];
  if (st->busy) return;
  int have_w = st->wq_head < st->wq_tail;
  if (st->pos < st->nseq && !forced_w(g, st) && ready(g, s, st->seq[st->pos])) {
    start(st, st->seq[st->pos++], now);
  } else if (have_w) {
    start(st, st->wq[st->wq_head++], now);
  }
}

/* Stage s computed the tensor for virtual stage vs: on the same rank it is
 * there at once, else it waits in s's outbox. */
static void produced(struct gen *g, int s, int grad, int micro, int vs) {
  struct gen_stage *st = &g->st[s];
  int dest = vs % g->p;
  if (dest == s) {
    *tensor_at(g, grad, micro, vs) = TENSOR_AT_CONSUMER;
    return;
  }
  *tensor_at(g, grad, micro, vs) = TENSOR_AT_SENDER;
  st->outbox[st->outbox_n++] = (struct outgoing){grad, micro, vs, dest, 0};
}

static void finish(struct gen *g, int s) {
  struct gen_stage *st = &g->st[s];
  struct comp c = st->cur;
  int k = c.chunk * g->p + s;
  st->busy = 0;
  if (c.op == PS_PIPE_FORWARD) {
    st->held++;
    if (k + 1 < g->V) produced(g, s, 0, c.micro, k + 1);
  } else if (c.op == PS_PIPE_BACKWARD || c.op == PS_PIPE_BACKWARD_INPUT) {
    if (k > 0) produced(g, s, 1, c.micro, k - 1);
    if (c.op == PS_PIPE_BACKWARD_INPUT) {
      st->wq[st->wq_tail++] = (struct comp){PS_PIPE_BACKWARD_WEIGHT, c.micro, c.chunk};
    } else {
      st->held--;
    }
  } else {
    st->held--;
  }
}

static ps_status run_gen(struct gen *g, char *err, size_t errlen) {
  double now = 0;
  for (;;) {
    for (int progress = 1; progress;) {
      progress = 0;
      /* tensors only go to the neighbours (interleaved wraps around) */
      for (int q = 0; q < g->p && g->p > 1; q++) {
        progress |= try_comm(g, q, (q + 1) % g->p);
        if (g->p > 2) progress |= try_comm(g, q, (q + g->p - 1) % g->p);
      }
    }
    for (int s = 0; s < g->p; s++) try_start(g, s, now);
    int any = 0;
    double next = 0;
    for (int s = 0; s < g->p; s++) {
      if (g->st[s].busy && (!any || g->st[s].until < next)) next = g->st[s].until, any = 1;
    }
    if (!any) break;
    now = next;
    for (int s = 0; s < g->p; s++) {
      if (g->st[s].busy && g->st[s].until <= now) finish(g, s);
    }
  }
  for (int s = 0; s < g->p; s++) {
    struct gen_stage *st = &g->st[s];
    if (st->pos < st->nseq || st->wq_head < st->wq_tail) {
      ERR("pipeline schedule generation stuck: stage %d at computation %d of %d", s, st->pos,
          st->nseq);
      return PS_ERR_STATE;
    }
    emit(st, PS_PIPE_REDUCE_GRADS, -1, 0, -1);
    emit(st, PS_PIPE_OPTIMIZER_STEP, -1, 0, -1);
  }
  return PS_OK;
}

void pipe_lists_free(struct pipe_lists *l) {
  if (!l) return;
  if (l->a) {
    for (int s = 0; s < l->p; s++) free(l->a[s]);
  }
  free(l->a);
  free(l->n);
  l->a = NULL;
  l->n = NULL;
}

ps_status pipe_lists_new(const struct ps_pipe_shape *sh, struct pipe_lists *out, char *err,
                         size_t errlen) {
  ps_status rc = ps_pipe_check(sh, err, errlen);
  if (rc != PS_OK) return rc;
  int p = sh->stages, m = sh->micro, v = sh->chunks;
  size_t comps = (size_t)m * v * (sh->kind == PS_PIPE_ZBH1 ? 3 : 2);
  /* at most: every computation, a send and a receive for each, the two ends */
  size_t room = comps * 3 + 2;
  struct gen g = {p, m, v, p * v, sh->kind == PS_PIPE_ZBH1, NULL, NULL};
  memset(out, 0, sizeof(*out));
  out->p = p;
  g.tensor = calloc((size_t)2 * m * g.V, 1);
  g.st = calloc((size_t)p, sizeof(*g.st));
  out->a = calloc((size_t)p, sizeof(*out->a));
  out->n = calloc((size_t)p, sizeof(*out->n));
  rc = PS_ERR_NOMEM;
  if (!g.tensor || !g.st || !out->a || !out->n) goto fail;
  for (int s = 0; s < p; s++) {
    struct gen_stage *st = &g.st[s];
    st->seq = malloc(comps * sizeof(*st->seq));
    st->wq = malloc((size_t)m * v * sizeof(*st->wq));
    st->out = malloc(room * sizeof(*st->out));
    st->outbox = malloc(comps * sizeof(*st->outbox));
    if (!st->seq || !st->wq || !st->out || !st->outbox) goto fail;
    stage_order(sh, s, st->seq, &st->nseq);
    st->cap = p;
  }
  rc = run_gen(&g, err, errlen);
  if (rc != PS_OK) goto fail;
  for (int s = 0; s < p; s++) {
    /* give back the room the list did not need (it was sized for the worst) */
    struct ps_pipe_action *fit = realloc(g.st[s].out, g.st[s].nout * sizeof(*fit));
    out->a[s] = fit ? fit : g.st[s].out;
    out->n[s] = g.st[s].nout;
    g.st[s].out = NULL;
  }
fail:
  for (int s = 0; g.st && s < p; s++) {
    free(g.st[s].seq);
    free(g.st[s].wq);
    free(g.st[s].out);
    free(g.st[s].outbox);
  }
  free(g.st);
  free(g.tensor);
  if (rc == PS_ERR_NOMEM) ERR("out of memory generating the pipeline schedule");
  if (rc != PS_OK) pipe_lists_free(out);
  return rc;
}

ps_status ps_pipe_actions(const struct ps_pipe_shape *sh, int stage, struct ps_pipe_action **out,
                          size_t *n, char *err, size_t errlen) {
  struct pipe_lists l;
  ps_status rc = ps_pipe_check(sh, err, errlen);
  if (rc != PS_OK) return rc;
  if (stage < 0 || stage >= sh->stages || !out || !n) {
    ERR("pipeline stage %d: expected 0..%d", stage, sh->stages - 1);
    return PS_ERR_INVALID;
  }
  rc = pipe_lists_new(sh, &l, err, errlen);
  if (rc != PS_OK) return rc;
  *out = l.a[stage];
  *n = l.n[stage];
  l.a[stage] = NULL;
  pipe_lists_free(&l);
  return PS_OK;
}

ps_status ps_pipe_validate(const struct ps_pipe_shape *sh, char *err, size_t errlen) {
  struct pipe_lists l;
  ps_status rc = pipe_lists_new(sh, &l, err, errlen);
  if (rc != PS_OK) return rc;
  rc = pipe_validate_lists(sh, &l, err, errlen);
  pipe_lists_free(&l);
  return rc;
}

ps_status ps_pipe_simulate(const struct ps_pipe_shape *sh, const struct ps_pipe_costs *c,
                           struct ps_pipe_sim *out, char *err, size_t errlen) {
  struct pipe_lists l;
  if (!c || !out) {
    ERR("ps_pipe_simulate: costs and result are required");
    return PS_ERR_INVALID;
  }
  ps_status rc = pipe_lists_new(sh, &l, err, errlen);
  if (rc != PS_OK) return rc;
  rc = pipe_simulate_lists(sh, &l, c, out, err, errlen);
  pipe_lists_free(&l);
  return rc;
}
