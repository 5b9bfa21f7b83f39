/* trainer3d: the 3D training loop (see trainer3d.h). */
#include "trainer3d.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"

/* A stage's buffers of one step, per local chunk c and micro-batch i (n
 * samples each): in (its input: images on virtual stage 0, else received),
 * out (its output, sent on), gin (the input's gradient, sent back) and gout
 * (the output's gradient, received). With one pipeline rank and several
 * chunks the next chunk's input is the previous one's output (aliases). */
struct bufs {
  int chunks, micro, n;
  float *in[16], *out[16], *gin[16], *gout[16];
  size_t in_w[16], out_w[16];
  bool own_in[16], own_gout[16];
  uint8_t *labels; /* batch labels, on the rank of the last virtual stage */
  float *x;        /* batch images: in[0] on the first stage */
};

static void bufs_free(struct bufs *b) {
  for (int c = 0; c < b->chunks; c++) {
    if (b->own_in[c]) free(b->in[c]);
    if (b->own_gout[c]) free(b->gout[c]);
    free(b->out[c]);
    free(b->gin[c]);
  }
  free(b->labels);
}

static int bufs_new(struct bufs *b, struct mp_stage *s, int chunks, int pp, int micro, int n) {
  memset(b, 0, sizeof(*b));
  b->chunks = chunks;
  b->micro = micro;
  b->n = n;
  size_t per = (size_t)micro * (size_t)n;
  for (int c = 0; c < chunks; c++) {
    b->in_w[c] = mp_stage_in_width(s, c);
    b->out_w[c] = mp_stage_out_width(s, c);
    bool first = mp_stage_is_first(s, c), last = mp_stage_is_last(s, c);
    if (!last && !(b->out[c] = calloc(per * b->out_w[c], sizeof(float)))) goto nomem;
    if (!first && !(b->gin[c] = calloc(per * b->in_w[c], sizeof(float)))) goto nomem;
    if (pp == 1 && c > 0) { /* the previous virtual stage is this rank's chunk c - 1 */
      b->in[c] = b->out[c - 1];
      b->gout[c - 1] = b->gin[c];
    } else {
      b->own_in[c] = true;
      if (!(b->in[c] = calloc(per * b->in_w[c], sizeof(float)))) goto nomem;
    }
    if (!last && !(pp == 1 && c + 1 < chunks)) {
      b->own_gout[c] = true;
      if (!(b->gout[c] = calloc(per * b->out_w[c], sizeof(float)))) goto nomem;
    }
  }
  if (!(b->labels = calloc(per, 1))) goto nomem;
  b->x = b->in[0];
  return 0;
nomem:
  bufs_free(b);
  return -ENOMEM;
}

int trainer3d_max_inflight(const struct ps_pipe_action *a, size_t n) {
  int held = 0, peak = 1;
  for (size_t i = 0; i < n; i++) {
    if (a[i].op == PS_PIPE_FORWARD && ++held > peak) peak = held;
    if (a[i].op == PS_PIPE_BACKWARD || a[i].op == PS_PIPE_BACKWARD_WEIGHT) held--;
  }
  return peak;
}

/* mp_tp_comm for a stage that never computes (assembly, declaring). */
static int no_allreduce(void *ctx, float *buf, size_t n) {
  (void)ctx, (void)buf, (void)n;
  return -ENOTSUP;
}
static int no_allgather(void *ctx, const float *send, float *recv, size_t n) {
  (void)ctx, (void)send, (void)recv, (void)n;
  return -ENOTSUP;
}
static const struct mp_tp_comm no_comm = {NULL, no_allreduce, no_allgather};

struct mp_stage *trainer3d_shadow_stage(const struct mp_plan *plan, int pp, int tp) {
  return mp_stage_new(plan, pp, tp, 1, 1, &no_comm);
}

struct run {
  const struct trainer3d_opts *o;
  struct ps_grid_coords at;
  int tp, pp, dp; /* axis lengths */
  ps_coll *pipe;  /* the pipeline group (NULL with P = 1) */
  struct ps_pipe_action *acts;
  size_t nacts;
  struct bufs b;
  uint64_t step;
};

/* A failed libps call on group g: logs its message (a lost rank is named by
 * its job rank) and says which errno the caller returns. */
static int group_failed(ps_coll *g, ps_status st, const char *what, uint64_t step) {
  char msg[512];
  ps_coll_errmsg(g, msg, sizeof(msg));
  log_error("model-parallel communication failed", "what=%s step=%llu status=%s error=\"%s\"", what,
            (unsigned long long)step, ps_strerror(st), msg);
  return -ECONNRESET;
}

static int stage_failed(int r, const char *what, const struct ps_pipe_action *a, uint64_t step) {
  log_error("stage computation failed", "what=%s micro=%d chunk=%d step=%llu error=\"%s\"", what,
            a->micro, a->chunk, (unsigned long long)step, strerror(-r));
  return r;
}

/* One action of the list. */
static int act(struct run *r, const struct ps_pipe_action *a, double *loss_sum) {
  struct mp_stage *s = r->o->stage;
  struct bufs *b = &r->b;
  int c = a->chunk, i = a->micro, n = b->n, m = b->micro;
  size_t off_in = (size_t)i * n * b->in_w[c], off_out = (size_t)i * n * b->out_w[c];
  size_t in_bytes = (size_t)n * b->in_w[c] * sizeof(float);
  size_t out_bytes = (size_t)n * b->out_w[c] * sizeof(float);
  bool first = mp_stage_is_first(s, c), last = mp_stage_is_last(s, c);
  ps_status st = PS_OK;
  int ret = 0;
  float loss;
  switch (a->op) {
    case PS_PIPE_FORWARD:
      ret = mp_stage_forward(s, c, i, n, b->in[c] + off_in, last ? NULL : b->out[c] + off_out,
                             last ? b->labels + (size_t)i * n : NULL, &loss);
      if (ret < 0) return stage_failed(ret, "forward", a, r->step);
      if (last) *loss_sum += loss;
      return 0;
    case PS_PIPE_BACKWARD:
      ret = mp_stage_backward(s, c, i, m, last ? NULL : b->gout[c] + off_out,
                              first ? NULL : b->gin[c] + off_in);
      return ret < 0 ? stage_failed(ret, "backward", a, r->step) : 0;
    case PS_PIPE_BACKWARD_INPUT:
      ret = mp_stage_backward_input(s, c, i, m, last ? NULL : b->gout[c] + off_out,
                                    first ? NULL : b->gin[c] + off_in);
      return ret < 0 ? stage_failed(ret, "backward_input", a, r->step) : 0;
    case PS_PIPE_BACKWARD_WEIGHT:
      ret = mp_stage_backward_weight(s, c, i);
      return ret < 0 ? stage_failed(ret, "backward_weight", a, r->step) : 0;
    case PS_PIPE_SEND_ACT:
      st = ps_coll_send(r->pipe, b->out[c] + off_out, out_bytes, a->peer_stage);
      break;
    case PS_PIPE_RECV_ACT:
      st = ps_coll_recv(r->pipe, b->in[c] + off_in, in_bytes, a->peer_stage);
      break;
    case PS_PIPE_SEND_GRAD:
      st = ps_coll_send(r->pipe, b->gin[c] + off_in, in_bytes, a->peer_stage);
      break;
    case PS_PIPE_RECV_GRAD:
      st = ps_coll_recv(r->pipe, b->gout[c] + off_out, out_bytes, a->peer_stage);
      break;
    case PS_PIPE_REDUCE_GRADS:
      return sync3d_reduce(r->o->sync, r->step);
    case PS_PIPE_OPTIMIZER_STEP:
      return sync3d_update(r->o->sync, r->step);
  }
  if (st != PS_OK) {
    static const char *const names[] = {"",         "",         "",          "",
                                        "send_act", "recv_act", "send_grad", "recv_grad"};
    return group_failed(r->pipe, st, names[a->op], r->step);
  }
  return 0;
}

/* The job rank of grid position (tp, dp, pp). */
static int rank_at(const struct run *r, int tp, int dp, int pp) {
  struct ps_grid_coords c = {.tp = tp, .dp = dp, .pp = pp};
  return r->o->job ? ps_grid_rank_of(r->o->world, r->tp, r->pp, c) : 0;
}

/* Collective over the job: replica 0 of every (stage, tensor rank) sends its
 * slices to job rank 0, which stores them into full (replicated tensors:
 * tensor rank 0's, stored last). */
static int assemble(struct run *r) {
  const struct trainer3d_opts *o = r->o;
  struct mp_stage *s = o->stage;
  if (!o->job) return o->full ? mp_stage_store_full(s, o->full) : 0;
  if (o->job_rank != 0) {
    if (r->at.dp != 0) return 0;
    for (int i = 0; i < mp_stage_num_tensors(s); i++) {
      if (r->at.tp != 0 && mp_stage_tensor_replicated(s, i)) continue;
      ps_status st = ps_coll_send(o->job, mp_stage_param(s, i),
                                  mp_stage_tensor_count(s, i) * sizeof(float), 0);
      if (st != PS_OK) return group_failed(o->job, st, "send slices to rank 0", r->step);
    }
    return 0;
  }
  for (int pp = 0; pp < r->pp; pp++) {
    for (int tp = r->tp - 1; tp >= 0; tp--) {
      int from = rank_at(r, tp, 0, pp);
      if (from == 0) {
        int ret = mp_stage_store_full(s, o->full);
        if (ret < 0) return ret;
        continue;
      }
      struct mp_stage *sh = trainer3d_shadow_stage(o->plan, pp, tp);
      if (!sh) return -errno;
      int ret = 0;
      for (int i = 0; i < mp_stage_num_tensors(sh) && ret == 0; i++) {
        if (tp != 0 && mp_stage_tensor_replicated(sh, i)) continue;
        ps_status st = ps_coll_recv(o->job, mp_stage_param(sh, i),
                                    mp_stage_tensor_count(sh, i) * sizeof(float), from);
        if (st != PS_OK) ret = group_failed(o->job, st, "receive slices", r->step);
      }
      if (ret == 0) ret = mp_stage_store_full(sh, o->full);
      mp_stage_free(sh);
      if (ret < 0) return ret;
    }
  }
  return 0;
}

/* Test loss and accuracy of the assembled model, 1000 samples at a time. */
static int evaluate(const struct trainer3d_opts *o, float *loss, float *accuracy) {
  const struct dataset *t = o->test;
  enum { CHUNK = 1000 };
  size_t in = (size_t)t->rows * t->cols;
  float *x = malloc(CHUNK * in * sizeof(float));
  uint8_t y[CHUNK];
  uint32_t idx[CHUNK];
  if (!x) return -ENOMEM;
  double loss_sum = 0, correct = 0;
  for (uint32_t start = 0; start < t->n; start += CHUNK) {
    uint32_t n = t->n - start < CHUNK ? t->n - start : CHUNK;
    for (uint32_t k = 0; k < n; k++) idx[k] = start + k;
    dataset_gather(t, idx, n, x, y);
    float l, a;
    mlp_evaluate(o->full, x, y, (int)n, &l, &a);
    loss_sum += (double)l * n;
    correct += (double)a * n;
  }
  free(x);
  *loss = (float)(loss_sum / t->n);
  *accuracy = (float)(correct / t->n);
  return 0;
}

/* The rank that knows the training loss: the last virtual stage's, tensor
 * rank 0 of replica 0; it sends it to job rank 0, which logs. */
static int reporter(const struct run *r) {
  return rank_at(r, 0, 0, r->pp - 1);
}

/* One step of this rank: the batch's images (first stage) and labels (last
 * stage), then the action list. *loss: the replica's mean loss (last stage). */
static int step(struct run *r, const uint32_t *idx, float *loss) {
  const struct trainer3d_opts *o = r->o;
  struct mp_stage *s = o->stage;
  struct bufs *b = &r->b;
  if (mp_stage_is_first(s, 0)) /* images and labels */
    dataset_gather(o->train, idx, (uint32_t)o->batch, b->x, b->labels);
  else if (mp_stage_is_last(s, b->chunks - 1))
    for (int k = 0; k < o->batch; k++) b->labels[k] = o->train->labels[idx[k]];
  mp_stage_zero_grads(s);
  double loss_sum = 0;
  for (size_t k = 0; k < r->nacts; k++) {
    int ret = act(r, &r->acts[k], &loss_sum);
    if (ret < 0) return ret;
  }
  *loss = (float)(loss_sum / b->micro); /* the micro-batches' mean losses, averaged */
  return 0;
}

/* The reporter's *loss to job rank 0 (which logs), when they differ. */
static int share_loss(struct run *r, float *loss, const char *what) {
  const struct trainer3d_opts *o = r->o;
  int rep = reporter(r);
  if (rep == 0 || (o->job_rank != rep && o->job_rank != 0)) return 0;
  ps_status st = o->job_rank == rep ? ps_coll_send(o->job, loss, sizeof(float), 0)
                                    : ps_coll_recv(o->job, loss, sizeof(float), rep);
  return st == PS_OK ? 0 : group_failed(o->job, st, what, r->step);
}

/* End of an epoch (or of training): the reporter's epoch loss to rank 0,
 * the model assembled there and evaluated. */
static int epoch_end(struct run *r, int epoch, double loss_epoch, uint32_t steps_done, double start,
                     struct trainer_result *res) {
  const struct trainer3d_opts *o = r->o;
  float train_loss = (float)(loss_epoch / (steps_done ? steps_done : 1));
  int ret = share_loss(r, &train_loss, "epoch loss");
  if (ret == 0) ret = assemble(r);
  if (ret < 0) return ret;
  res->train_loss = train_loss;
  if (o->job_rank != 0 || !o->test) return 0;
  double t0 = clock_now_s();
  if ((ret = evaluate(o, &res->test_loss, &res->accuracy)) < 0) return ret;
  res->eval_s += clock_now_s() - t0;
  log_info("epoch done", "epoch=%d train_loss=%.4f test_loss=%.4f accuracy=%.4f elapsed_s=%.2f",
           epoch + 1, (double)train_loss, (double)res->test_loss, (double)res->accuracy,
           clock_now_s() - start);
  return 0;
}

int trainer3d_run(const struct trainer3d_opts *o, struct trainer_result *res) {
  memset(res, 0, sizeof(*res));
  struct run r = {.o = o, .tp = 1, .pp = 1, .dp = o->world};
  if (o->grid) {
    r.at = ps_grid_coords(o->grid);
    r.tp = ps_grid_size(o->grid, 't');
    r.pp = ps_grid_size(o->grid, 'p');
    r.dp = ps_grid_size(o->grid, 'd');
    r.pipe = r.pp > 1 ? ps_grid_group(o->grid, 'p') : NULL;
  } else {
    r.at.dp = o->job_rank;
  }
  char err[300];
  ps_status pst = ps_pipe_actions(&o->shape, r.at.pp, &r.acts, &r.nacts, err, sizeof(err));
  if (pst != PS_OK) {
    log_error("cannot build the schedule", "error=\"%s\"", err);
    return -EINVAL;
  }
  const struct dataset *ds = o->train;
  int m = o->shape.micro, n = o->batch / m;
  uint32_t steps = dataset_steps_per_epoch(ds->n, (uint32_t)o->batch, (uint32_t)r.dp);
  uint32_t *perm = malloc(ds->n * sizeof(uint32_t));
  int ret = -ENOMEM;
  if (!perm || bufs_new(&r.b, o->stage, o->shape.chunks, r.pp, m, n) < 0) goto out;
  ret = -EINVAL;
  if (steps == 0) {
    log_error("batch too large", "train_samples=%u global_batch=%d", ds->n, o->batch * r.dp);
    goto out;
  }
  uint64_t total = (uint64_t)steps * (uint64_t)o->epochs;
  if (o->max_steps && o->max_steps < total) total = o->max_steps;
  bool reports = o->job_rank == reporter(&r);
  int log_every = o->log_every > 0 ? o->log_every : 50;
  double start = clock_now_s(), loss_epoch = 0, loss_window = 0;
  int window = 0;
  ret = 0;
  /* resumed: the data position follows from the step (the epoch's order
   * from the seed) */
  r.step = o->start_step;
  for (int e = (int)(r.step / steps); e < o->epochs && r.step < total; e++) {
    dataset_epoch_order(o->seed, (uint32_t)e, ds->n, perm);
    loss_epoch = 0;
    uint32_t t, first = (uint32_t)(r.step - (uint64_t)e * steps);
    for (t = first; t < steps && r.step < total; t++, r.step++) {
      const uint32_t *idx = perm + (size_t)t * o->batch * r.dp + (size_t)r.at.dp * o->batch;
      float loss = 0;
      if ((ret = step(&r, idx, &loss)) < 0) {
        if (ret != -ECONNRESET) {
          char msg[512];
          log_error("step failed", "step=%llu error=\"%s\"", (unsigned long long)r.step,
                    sync3d_errmsg(o->sync, msg, sizeof(msg)));
        }
        goto out;
      }
      if (reports && !isfinite(loss)) {
        log_error("loss is not finite", "step=%llu loss=%g (lower --lr?)",
                  (unsigned long long)r.step, (double)loss);
        ret = -EDOM;
        goto out;
      }
      if (o->on_step) o->on_step(o->on_step_arg, o->stage, r.step);
      if (o->after_step && (ret = o->after_step(o->after_step_arg, r.step + 1)) < 0) goto out;
      loss_epoch += loss;
      loss_window += loss;
      window++;
      if ((r.step + 1) % (uint64_t)log_every == 0 || t + 1 == steps) {
        float avg = (float)(loss_window / window);
        if ((ret = share_loss(&r, &avg, "progress loss")) < 0) goto out;
        double el = clock_now_s() - start;
        if (o->job_rank == 0)
          log_info("progress", "epoch=%d/%d step=%u/%u loss=%.4f samples_per_s=%.0f", e + 1,
                   o->epochs, t + 1, steps, (double)avg,
                   el > 0 ? (double)(r.step + 1 - o->start_step) * o->batch * r.dp / el : 0.0);
        loss_window = 0;
        window = 0;
      }
    }
    res->epochs_done = e + 1;
    /* also after a partial last epoch (--max-steps): the model is dumped */
    if ((ret = epoch_end(&r, e, loss_epoch, t - first, start, res)) < 0) goto out;
  }
  /* resumed at the last step: nothing trained, the model still assembled */
  if (o->start_step >= total) {
    res->epochs_done = (int)((total + steps - 1) / steps);
    if ((ret = epoch_end(&r, res->epochs_done - 1, 0, 0, start, res)) < 0) goto out;
  }
  if ((ret = sync3d_finish(o->sync, o->job_rank)) < 0) goto out;
  res->steps = r.step;
  res->wall_s = clock_now_s() - start;
  double train_s = res->wall_s - res->eval_s;
  res->samples_per_s =
      train_s > 0 ? (double)(r.step - o->start_step) * o->batch * r.dp / train_s : 0;
out:
  bufs_free(&r.b);
  free(r.acts);
  free(perm);
  return ret;
}
