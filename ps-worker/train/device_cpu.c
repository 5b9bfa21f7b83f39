/* device_cpu: the CPU implementation of device.h, a thin wrapper around
 * model.h. The host mirror is the model: parameters and gradients never move,
 * load_params and store_params do nothing, and a step is dataset_gather into
 * a float buffer of max_batch samples followed by mlp_forward_backward, the
 * same work in the same order as the trainer did before devices existed. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "device_impl.h"

struct cpu_model {
  struct device_model base;
  float *x;   /* max_batch * sizes[0] */
  uint8_t *y; /* max_batch */
};

static struct cpu_model *cpu_of(struct device_model *dm) {
  return container_of(dm, struct cpu_model, base);
}

static void cpu_close(struct device_model *dm) {
  struct cpu_model *c = cpu_of(dm);

  mlp_free(dm->host);
  free(c->x);
  free(c->y);
  free(c);
}

static int cpu_nothing(struct device_model *dm) {
  (void)dm;
  return 0;
}

static int cpu_load_batch(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                          int batch) {
  struct cpu_model *c = cpu_of(dm);

  dataset_gather(ds, idx, (uint32_t)batch, c->x, c->y);
  return 0;
}

static int cpu_step(struct device_model *dm, mlp_grad_ready_fn cb, void *arg, float *loss) {
  struct cpu_model *c = cpu_of(dm);

  *loss = mlp_forward_backward(dm->host, c->x, c->y, dm->loaded, cb, arg);
  return 0;
}

static int cpu_set_grad_blocks(struct device_model *dm, const size_t *ends, int n) {
  return mlp_set_grad_blocks(dm->host, ends, n);
}

static int cpu_evaluate(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                        int n, double *loss_sum, int *correct) {
  struct cpu_model *c = cpu_of(dm);
  float loss, accuracy;

  dataset_gather(ds, idx, (uint32_t)n, c->x, c->y);
  mlp_evaluate(dm->host, c->x, c->y, n, &loss, &accuracy);
  *loss_sum = (double)loss * n;
  *correct = (int)lround((double)accuracy * n);
  return 0;
}

static int cpu_sgd_step(struct device_model *dm, float lr) {
  mlp_sgd_step(dm->host, lr);
  return 0;
}

static const struct device_model_ops cpu_ops = {
    .close = cpu_close,
    .load_params = cpu_nothing,
    .store_params = cpu_nothing,
    .load_batch = cpu_load_batch,
    .step = cpu_step,
    .set_grad_blocks = cpu_set_grad_blocks,
    .evaluate = cpu_evaluate,
    .sgd_step = cpu_sgd_step,
};

int device_cpu_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                    struct device_model **out, char *err, size_t errlen) {
  struct cpu_model *c = calloc(1, sizeof(*c));

  (void)o;
  if (c == NULL) goto nomem;
  device_model_init_base(&c->base, &cpu_ops, DEVICE_CPU, sizes, num_sizes, max_batch);
  c->base.host = mlp_new(sizes, num_sizes, max_batch);
  c->x = malloc((size_t)max_batch * (size_t)sizes[0] * sizeof(float));
  c->y = malloc((size_t)max_batch);
  if (c->base.host == NULL || c->x == NULL || c->y == NULL) {
    cpu_close(&c->base);
    goto nomem;
  }
  *out = &c->base;
  return 0;

nomem:
  if (errlen) snprintf(err, errlen, "out of memory for the model and a batch of %d", max_batch);
  return -ENOMEM;
}
