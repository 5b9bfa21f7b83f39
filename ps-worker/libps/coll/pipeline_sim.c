/* pipeline_sim: the validator and the simulator of pipeline.h's lists.
 *
 * The simulator runs the lists as the trainer does: each stage executes its
 * actions in order; a computation takes its cost; a send and the receive it
 * meets (the next receive from this stage on the peer: messages between two
 * ranks are received in the order they were sent) both complete at the
 * later of the two posting times plus the transfer time: a send blocks
 * until its receive is posted, the stricter rule of the two a transport may
 * follow (libps's p2p buffers a message that arrives while its rank is in
 * any send or receive), so lists that finish here finish on either. A state
 * where no stage can move before all are done is a deadlock, reported with
 * every stuck stage's action.
 *
 * The validator checks each list alone (fields in range, each micro-batch
 * forwarded and backwarded once per chunk, inputs received before use,
 * sends after what they send was computed, B before W, the list ending with
 * the reduction and the optimizer step), then that the sends from each stage
 * to each peer and the receives there pair up one by one with the same kind,
 * micro-batch and virtual stage, then simulates them to rule out deadlock. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline_impl.h"

#define ERR(...) (errlen > 0 ? (void)snprintf(err, errlen, __VA_ARGS__) : (void)0)

static int is_send(ps_pipe_op op) {
  return op == PS_PIPE_SEND_ACT || op == PS_PIPE_SEND_GRAD;
}

static int is_recv(ps_pipe_op op) {
  return op == PS_PIPE_RECV_ACT || op == PS_PIPE_RECV_GRAD;
}

/* "stage 1 action 4 (recv_act micro 2 chunk 0 from stage 0)" */
static void describe(char *buf, size_t len, int s, size_t i, const struct ps_pipe_action *a) {
  const char *dir = is_send(a->op) ? " to stage" : is_recv(a->op) ? " from stage" : "";
  if (a->micro < 0) {
    snprintf(buf, len, "stage %d action %zu (%s)", s, i, pipe_op_name(a->op));
  } else if (*dir) {
    snprintf(buf, len, "stage %d action %zu (%s micro %d chunk %d%s %d)", s, i, pipe_op_name(a->op),
             a->micro, a->chunk, dir, a->peer_stage);
  } else {
    snprintf(buf, len, "stage %d action %zu (%s micro %d chunk %d)", s, i, pipe_op_name(a->op),
             a->micro, a->chunk);
  }
}

static double cost_of(const struct ps_pipe_costs *c, ps_pipe_op op) {
  switch (op) {
    case PS_PIPE_FORWARD:
      return c->forward;
    case PS_PIPE_BACKWARD:
      return c->backward;
    case PS_PIPE_BACKWARD_INPUT:
      return c->backward_input;
    case PS_PIPE_BACKWARD_WEIGHT:
      return c->weight;
    default:
      return 0;
  }
}

ps_status pipe_simulate_lists(const struct ps_pipe_shape *sh, const struct pipe_lists *l,
                              const struct ps_pipe_costs *c, struct ps_pipe_sim *out, char *err,
                              size_t errlen) {
  int p = l->p;
  size_t *pos = calloc((size_t)p, sizeof(*pos));
  double *t = calloc((size_t)p, sizeof(*t));
  int *held = calloc((size_t)p, sizeof(*held));
  ps_status rc = PS_ERR_NOMEM;
  double busy = 0;
  memset(out, 0, sizeof(*out));
  if (!pos || !t || !held) {
    ERR("out of memory simulating the pipeline");
    goto done;
  }
  for (int progress = 1; progress;) {
    progress = 0;
    for (int s = 0; s < p; s++) {
      while (pos[s] < l->n[s]) {
        const struct ps_pipe_action *a = &l->a[s][pos[s]];
        if (is_send(a->op) || is_recv(a->op)) {
          int q = a->peer_stage;
          if (q < 0 || q >= p || q == s || pos[q] >= l->n[q]) break;
          const struct ps_pipe_action *b = &l->a[q][pos[q]];
          int meets = (is_send(a->op) && is_recv(b->op)) || (is_recv(a->op) && is_send(b->op));
          if (!meets || b->peer_stage != s) break;
          double end = (t[s] > t[q] ? t[s] : t[q]) + c->transfer;
          t[s] = t[q] = end;
          pos[q]++;
        } else {
          double d = cost_of(c, a->op);
          t[s] += d;
          busy += d;
          if (a->op == PS_PIPE_FORWARD) held[s]++;
          if (a->op == PS_PIPE_BACKWARD || a->op == PS_PIPE_BACKWARD_WEIGHT) held[s]--;
          if (s < 256 && held[s] > out->peak_acts[s]) out->peak_acts[s] = held[s];
        }
        pos[s]++;
        progress = 1;
      }
    }
  }
  rc = PS_OK;
  size_t used = 0;
  for (int s = 0; s < p; s++) {
    if (pos[s] >= l->n[s]) continue;
    if (rc == PS_OK) used = (size_t)snprintf(err, errlen, "deadlock:");
    rc = PS_ERR_STATE;
    if (errlen > 0 && used + 1 < errlen) {
      char what[160];
      describe(what, sizeof(what), s, pos[s], &l->a[s][pos[s]]);
      used += (size_t)snprintf(err + used, errlen - used, " %s waits;", what);
    }
  }
  if (rc != PS_OK) goto done;
  for (int s = 0; s < p; s++) {
    if (t[s] > out->step_time) out->step_time = t[s];
  }
  out->ideal_time = (double)sh->micro * sh->chunks * (c->forward + c->backward);
  out->bubble = out->step_time > 0 ? 1.0 - busy / (p * out->step_time) : 0;
done:
  free(pos);
  free(t);
  free(held);
  return rc;
}

/* ---- the validator ---- */

enum { F_DONE = 1, B_DONE = 2, W_DONE = 4, ACT_IN = 8, GRAD_IN = 16, B_SPLIT = 32 };

struct vctx {
  const struct ps_pipe_shape *sh;
  int p, m, v, V;
  unsigned char *flags; /* [micro][virtual stage] */
};

static unsigned char *fl(struct vctx *x, int micro, int vs) {
  return &x->flags[(size_t)micro * x->V + vs];
}

/* The problem with action i of stage s, or NULL. */
static const char *check_action(struct vctx *x, int s, size_t i, const struct ps_pipe_action *a,
                                size_t n) {
  int last = i + 2 == n || i + 1 == n;
  if (a->op == PS_PIPE_REDUCE_GRADS || a->op == PS_PIPE_OPTIMIZER_STEP) {
    if ((a->op == PS_PIPE_REDUCE_GRADS && i + 2 != n) ||
        (a->op == PS_PIPE_OPTIMIZER_STEP && i + 1 != n)) {
      return "the list must end with reduce_grads, optimizer_step";
    }
    for (int k = s; k < x->V; k += x->p) {
      for (int mb = 0; mb < x->m; mb++) {
        unsigned char f = *fl(x, mb, k);
        if (!(f & F_DONE)) return "a micro-batch was never forwarded";
        if (!(f & B_DONE) || ((f & B_SPLIT) && !(f & W_DONE))) {
          return "a micro-batch was never (fully) backwarded";
        }
      }
    }
    return NULL;
  }
  if (last) return "the list must end with reduce_grads, optimizer_step";
  if (a->micro < 0 || a->micro >= x->m) return "micro-batch out of range";
  if (a->chunk < 0 || a->chunk >= x->v) return "chunk out of range";
  if ((unsigned)a->op > PS_PIPE_OPTIMIZER_STEP) return "unknown action";
  int vs = a->chunk * x->p + s;
  unsigned char *f = fl(x, a->micro, vs);
  int zb = x->sh->kind == PS_PIPE_ZBH1;
  switch (a->op) {
    case PS_PIPE_FORWARD:
      if (*f & F_DONE) return "forwarded twice";
      if (vs > 0 && !(*fl(x, a->micro, vs - 1) & F_DONE && (vs - 1) % x->p == s) &&
          !(*f & ACT_IN)) {
        return "forward before its activations were received";
      }
      *f |= F_DONE;
      return NULL;
    case PS_PIPE_BACKWARD:
    case PS_PIPE_BACKWARD_INPUT:
      if (zb != (a->op == PS_PIPE_BACKWARD_INPUT)) {
        return zb ? "zb-h1 splits the backward into backward_input and backward_weight"
                  : "only zb-h1 splits the backward";
      }
      if (*f & B_DONE) return "backwarded twice";
      if (!(*f & F_DONE)) return "backward before its forward";
      if (vs < x->V - 1 && !(*fl(x, a->micro, vs + 1) & B_DONE && (vs + 1) % x->p == s) &&
          !(*f & GRAD_IN)) {
        return "backward before its output gradient was received";
      }
      *f |= B_DONE | (a->op == PS_PIPE_BACKWARD_INPUT ? B_SPLIT : 0);
      return NULL;
    case PS_PIPE_BACKWARD_WEIGHT:
      if (!zb) return "only zb-h1 splits the backward";
      if (!(*f & B_DONE)) return "backward_weight before its backward_input";
      if (*f & W_DONE) return "backward_weight twice";
      *f |= W_DONE;
      return NULL;
    case PS_PIPE_SEND_ACT:
      if (vs + 1 >= x->V) return "the last stage has no activations to send";
      if (a->peer_stage != (vs + 1) % x->p || a->peer_stage == s) return "wrong peer";
      if (!(*f & F_DONE)) return "send of activations not yet computed";
      return NULL;
    case PS_PIPE_RECV_ACT:
      if (vs == 0) return "the first stage receives no activations";
      if (a->peer_stage != (vs - 1) % x->p || a->peer_stage == s) return "wrong peer";
      if (*f & ACT_IN) return "activations received twice";
      *f |= ACT_IN;
      return NULL;
    case PS_PIPE_SEND_GRAD:
      if (vs == 0) return "the first stage has no input gradient to send";
      if (a->peer_stage != (vs - 1) % x->p || a->peer_stage == s) return "wrong peer";
      if (!(*f & B_DONE)) return "send of an input gradient not yet computed";
      return NULL;
    case PS_PIPE_RECV_GRAD:
      if (vs + 1 >= x->V) return "the last stage receives no gradient";
      if (a->peer_stage != (vs + 1) % x->p || a->peer_stage == s) return "wrong peer";
      if (*f & GRAD_IN) return "gradient received twice";
      *f |= GRAD_IN;
      return NULL;
    default:
      return "unknown action";
  }
}

/* The virtual stage the tensor of a send or receive is for (its consumer). */
static int consumer_vs(int p, int s, const struct ps_pipe_action *a) {
  int vs = a->chunk * p + s;
  if (a->op == PS_PIPE_SEND_ACT) return vs + 1;
  if (a->op == PS_PIPE_SEND_GRAD) return vs - 1;
  return vs;
}

static ps_status check_pairs(const struct pipe_lists *l, char *err, size_t errlen) {
  int p = l->p;
  size_t *cur = calloc((size_t)p * p, sizeof(*cur)); /* cur[q * p + s]: q's next from s */
  char a_s[160], b_s[160];
  ps_status rc = PS_ERR_STATE;
  if (!cur) {
    ERR("out of memory validating the pipeline");
    return PS_ERR_NOMEM;
  }
  for (int s = 0; s < p; s++) {
    for (size_t i = 0; i < l->n[s]; i++) {
      const struct ps_pipe_action *a = &l->a[s][i];
      if (!is_send(a->op)) continue;
      int q = a->peer_stage;
      size_t *c = &cur[(size_t)q * p + s];
      while (*c < l->n[q] && !(is_recv(l->a[q][*c].op) && l->a[q][*c].peer_stage == s)) (*c)++;
      describe(a_s, sizeof(a_s), s, i, a);
      if (*c >= l->n[q]) {
        ERR("%s has no matching receive on stage %d", a_s, q);
        goto done;
      }
      const struct ps_pipe_action *b = &l->a[q][*c];
      int kinds = (a->op == PS_PIPE_SEND_ACT) == (b->op == PS_PIPE_RECV_ACT);
      if (!kinds || a->micro != b->micro || consumer_vs(p, s, a) != consumer_vs(p, q, b)) {
        describe(b_s, sizeof(b_s), q, *c, b);
        ERR("%s is received by %s (sends and receives between two stages pair up in order)", a_s,
            b_s);
        goto done;
      }
      (*c)++;
    }
  }
  for (int q = 0; q < p; q++) {
    for (int s = 0; s < p; s++) {
      size_t c = cur[(size_t)q * p + s];
      while (c < l->n[q] && !(is_recv(l->a[q][c].op) && l->a[q][c].peer_stage == s)) c++;
      if (c < l->n[q]) {
        describe(b_s, sizeof(b_s), q, c, &l->a[q][c]);
        ERR("%s has no matching send on stage %d", b_s, s);
        goto done;
      }
    }
  }
  rc = PS_OK;
done:
  free(cur);
  return rc;
}

ps_status pipe_validate_lists(const struct ps_pipe_shape *sh, const struct pipe_lists *l, char *err,
                              size_t errlen) {
  ps_status rc = ps_pipe_check(sh, err, errlen);
  if (rc != PS_OK) return rc;
  if (l->p != sh->stages) {
    ERR("%d lists for %d stages", l->p, sh->stages);
    return PS_ERR_STATE;
  }
  struct vctx x = {sh, sh->stages, sh->micro, sh->chunks, sh->stages * sh->chunks, NULL};
  x.flags = calloc((size_t)x.m * x.V, 1);
  if (!x.flags) {
    ERR("out of memory validating the pipeline");
    return PS_ERR_NOMEM;
  }
  rc = PS_ERR_STATE;
  for (int s = 0; s < x.p; s++) {
    if (l->n[s] < 2) {
      ERR("stage %d: the list must end with reduce_grads, optimizer_step", s);
      goto done;
    }
    for (size_t i = 0; i < l->n[s]; i++) {
      const char *why = check_action(&x, s, i, &l->a[s][i], l->n[s]);
      if (why) {
        char what[160];
        describe(what, sizeof(what), s, i, &l->a[s][i]);
        ERR("%s: %s", what, why);
        goto done;
      }
    }
  }
  rc = check_pairs(l, err, errlen);
  if (rc != PS_OK) goto done;
  struct ps_pipe_costs unit = {1, 2, 1, 1, 0};
  struct ps_pipe_sim sim;
  rc = pipe_simulate_lists(sh, l, &unit, &sim, err, errlen);
done:
  free(x.flags);
  return rc;
}
