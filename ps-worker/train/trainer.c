/* trainer: the training loop (see trainer.h). */
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

struct grad_ctx {
  const struct trainer_sync *sync;
  struct mlp *m;
  uint64_t step;
  int err;
};

static void on_grad(int tensor, size_t done, void *arg) {
  struct grad_ctx *g = arg;
  if (g->err) return;
  int r = g->sync->grad_ready(g->sync->ctx, g->m, tensor, done, g->step);
  if (r < 0) g->err = r;
}

struct progress {
  bool tty;
  int log_every;
  double start, last_t;
  uint64_t last_step;
  double loss_sum;
  int loss_n;
};

static void progress_step(struct progress *p, const struct trainer_opts *o, int epoch,
                          uint32_t step, uint32_t steps, uint64_t global_step, uint64_t total_steps,
                          float loss) {
  p->loss_sum += loss;
  p->loss_n++;
  bool last = step + 1 == steps;
  bool line = (global_step + 1) % (uint64_t)p->log_every == 0 || last;
  double t = clock_now_s();
  if (!(p->tty ? (t - p->last_t > 0.1 || last) : line)) return;
  double elapsed = t - p->start;
  double sps = elapsed > 0
                   ? (double)(global_step + 1 - o->start_step) * o->batch * o->world_size / elapsed
                   : 0;
  double eta = global_step + 1 < total_steps && sps > 0
                   ? (double)(total_steps - global_step - 1) * o->batch * o->world_size / sps
                   : 0;
  float avg = (float)(p->loss_sum / p->loss_n);
  if (p->tty) {
    int width = 30, fill = (int)((double)(step + 1) / steps * width);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\repoch %d/%d [%s] %u/%u loss %.4f %.0f samples/s eta %.0fs   ", epoch + 1,
            o->epochs, bar, step + 1, steps, avg, sps, eta);
    if (last) fputc('\n', stderr);
  } else {
    log_info("progress", "epoch=%d/%d step=%u/%u loss=%.4f samples_per_s=%.0f eta_s=%.1f",
             epoch + 1, o->epochs, step + 1, steps, avg, sps, eta);
  }
  p->last_t = t;
  p->loss_sum = 0;
  p->loss_n = 0;
}

/* Test loss and accuracy, gathered a batch at a time into the model's input
 * buffers: converting the whole test set to floats at once would cost 31 MB. */
static int evaluate(struct device_model *dm, const struct dataset *test, int batch, float *loss,
                    float *accuracy) {
  double loss_sum = 0, correct = 0;
  uint32_t idx[1024];
  uint32_t chunk = (uint32_t)batch < 1024 ? (uint32_t)batch : 1024;
  for (uint32_t start = 0; start < test->n; start += chunk) {
    uint32_t n = test->n - start < chunk ? test->n - start : chunk;
    for (uint32_t i = 0; i < n; i++) idx[i] = start + i;
    double l;
    int c;
    int r = device_model_evaluate(dm, test, idx, (int)n, &l, &c);
    if (r < 0) return r;
    loss_sum += l;
    correct += c;
  }
  *loss = (float)(loss_sum / test->n);
  *accuracy = (float)(correct / test->n);
  return 0;
}

/* After -ERESTART from the sync backend: the step to continue from. */
static bool rewind_to(const struct trainer_sync *sync, uint64_t *step) {
  if (!sync->rollback_step) return false;
  uint64_t back = sync->rollback_step(sync->ctx);
  log_warn("the job rolled back to a checkpoint", "from_step=%llu to_step=%llu",
           (unsigned long long)*step, (unsigned long long)back);
  *step = back;
  return true;
}

int trainer_run(const struct trainer_opts *o, struct device_model *dm,
                const struct trainer_sync *sync, struct trainer_result *res) {
  const struct dataset *ds = o->train;
  struct mlp *m = device_model_host(dm);
  uint32_t steps = dataset_steps_per_epoch(ds->n, (uint32_t)o->batch, (uint32_t)o->world_size);
  memset(res, 0, sizeof(*res));
  if (steps == 0) {
    log_error("batch too large", "train_samples=%u global_batch=%d", ds->n,
              o->batch * o->world_size);
    return -EINVAL;
  }
  uint64_t total = (uint64_t)steps * (uint64_t)o->epochs;
  if (o->max_steps && o->max_steps < total) total = o->max_steps;
  uint32_t *perm = malloc(ds->n * sizeof(uint32_t));
  int ret = -ENOMEM;
  if (!perm) goto out;

  struct progress p = {.tty = o->progress && isatty(2),
                       .log_every = o->log_every > 0 ? o->log_every : 50};
  struct grad_ctx g = {.sync = sync, .m = m};
  char err[512];
  double start = clock_now_s();
  p.start = p.last_t = start;
  uint64_t step = o->start_step;
  if (o->grad_blocks && sync->grad_blocks) {
    size_t ends[MLP_MAX_GRAD_BLOCKS];
    int n = sync->grad_blocks(sync->ctx, m, ends, MLP_MAX_GRAD_BLOCKS);
    if (n > 0 && (ret = device_model_set_grad_blocks(dm, ends, n)) < 0) goto device_failed;
  }
  double loss_epoch = 0;
  ret = 0;
train: /* a rollback comes back here with step set */
  for (int e = (int)(step / steps); e < o->epochs && step < total; e++) {
    dataset_epoch_order(o->seed, (uint32_t)e, ds->n, perm);
    loss_epoch = 0;
    uint32_t t;
    for (t = (uint32_t)(step - (uint64_t)e * steps); t < steps && step < total; t++, step++) {
      const uint32_t *idx =
          perm + (size_t)t * o->batch * o->world_size + (size_t)o->rank * o->batch;
      /* Before fetch: the gather (and a GPU's input copy) overlaps the wait. */
      ret = device_model_load_batch(dm, ds, idx, o->batch);
      if (ret < 0) goto device_failed;
      double t0 = clock_now_s();
      ret = sync->fetch(sync->ctx, m, step);
      res->wait_s += clock_now_s() - t0;
      if (ret == -ERESTART && rewind_to(sync, &step)) goto train;
      if (ret < 0) {
        log_error("cannot fetch parameters", "step=%llu error=\"%s\"", (unsigned long long)step,
                  sync->errmsg(sync->ctx, err, sizeof(err)));
        goto out;
      }
      g.step = step;
      float loss;
      if ((ret = device_model_load_params(dm)) < 0 ||
          (ret = device_model_step(dm, on_grad, &g, &loss)) < 0)
        goto device_failed;
      if (g.err < 0) {
        ret = g.err;
        log_error("cannot send gradients", "step=%llu error=\"%s\"", (unsigned long long)step,
                  sync->errmsg(sync->ctx, err, sizeof(err)));
        goto out;
      }
      if (!isfinite(loss)) {
        log_error("loss is not finite", "step=%llu loss=%g (lower --lr?)", (unsigned long long)step,
                  (double)loss);
        ret = -EDOM;
        goto out;
      }
      loss_epoch += loss;
      if (o->progress) progress_step(&p, o, e, t, steps, step, total, loss);
    }
    res->train_loss = (float)(loss_epoch / (t ? t : 1));
    res->epochs_done = e + 1;
    if (o->test) {
      ret = sync->fetch(sync->ctx, m, step);
      if (ret == -ERESTART && rewind_to(sync, &step)) goto train;
      if (ret < 0) goto out;
      double t0 = clock_now_s(); /* the fetch above is the next step's: training time */
      if ((ret = device_model_load_params(dm)) < 0 ||
          (ret = evaluate(dm, o->test, o->batch, &res->test_loss, &res->accuracy)) < 0)
        goto device_failed;
      res->eval_s += clock_now_s() - t0;
      log_info("epoch done", "epoch=%d train_loss=%.4f test_loss=%.4f accuracy=%.4f elapsed_s=%.2f",
               e + 1, (double)res->train_loss, (double)res->test_loss, (double)res->accuracy,
               clock_now_s() - start);
    }
  }
  ret = sync->finish(sync->ctx, m, step);
  if (ret == -ERESTART && rewind_to(sync, &step)) goto train;
  res->steps = step;
  res->wall_s = clock_now_s() - start;
  double train_s = res->wall_s - res->eval_s;
  /* this run's steps: a resumed one started at start_step (a rollback's
   * redone steps count, they were trained) */
  uint64_t trained = step > o->start_step ? step - o->start_step : 0;
  res->samples_per_s = train_s > 0 ? (double)trained * o->batch * o->world_size / train_s : 0;
  goto out;
device_failed:
  log_error("device failed", "device=\"%s\" step=%llu error=\"%s\"", device_model_name(dm),
            (unsigned long long)step, device_model_errmsg(dm));
out:
  free(perm);
  return ret;
}
