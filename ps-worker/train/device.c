/* device: the device-neutral half of device.h. It picks the implementation
 * (auto: CUDA when it opens, else the CPU), checks every argument that does
 * not depend on the device, so implementations see only valid batches, and
 * cuts long evaluations into max_batch pieces. What the implementations
 * share with it (the kind names, the common fields, the error message) is in
 * device_base.c, so calls go one way: device.c -> device_cpu.c /
 * device_cuda.c -> device_base.c. */
#include "device.h"

#include <errno.h>
#include <stdio.h>

#include "device_impl.h"
#include "log.h"

int device_model_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                      struct device_model **out, char *err, size_t errlen) {
  struct device_opts cuda = *o;
  int r;

  *out = NULL;
  /* mlp_new's own limits, checked here so every device refuses the same specs. */
  if (num_sizes < 2 || num_sizes > MLP_MAX_SIZES || max_batch < 1 || max_batch > MLP_MAX_BATCH) {
    if (errlen)
      snprintf(err, errlen, "bad model shape (%d sizes, max batch %d)", num_sizes, max_batch);
    return -EINVAL;
  }
  for (int i = 0; i < num_sizes; i++) {
    if (sizes[i] < 1 || sizes[i] > MLP_MAX_LAYER_SIZE) {
      if (errlen)
        snprintf(err, errlen, "layer size %d outside 1..%d", sizes[i], MLP_MAX_LAYER_SIZE);
      return -EINVAL;
    }
  }
  switch (o->kind) {
    case DEVICE_CPU:
      return device_cpu_open(o, sizes, num_sizes, max_batch, out, err, errlen);
    case DEVICE_CUDA:
      return device_cuda_open(o, sizes, num_sizes, max_batch, out, err, errlen);
    case DEVICE_AUTO:
      cuda.kind = DEVICE_CUDA;
      r = device_cuda_open(&cuda, sizes, num_sizes, max_batch, out, err, errlen);
      if (r == 0) return 0;
      if (r == -ENODEV)
        log_info("device auto: using the CPU", "reason=\"%s\"", errlen ? err : "");
      else
        log_warn("device auto: CUDA failed, using the CPU", "error=\"%s\"", errlen ? err : "");
      return device_cpu_open(o, sizes, num_sizes, max_batch, out, err, errlen);
  }
  if (errlen) snprintf(err, errlen, "unknown device kind %d", (int)o->kind);
  return -EINVAL;
}

void device_model_close(struct device_model *dm) {
  if (dm != NULL) dm->ops->close(dm);
}

enum device_kind device_model_kind(const struct device_model *dm) {
  return dm->kind;
}

const char *device_model_name(const struct device_model *dm) {
  return dm->name;
}

struct mlp *device_model_host(struct device_model *dm) {
  return dm->host;
}

int device_model_load_params(struct device_model *dm) {
  return dm->ops->load_params(dm);
}

int device_model_store_params(struct device_model *dm) {
  return dm->ops->store_params(dm);
}

/* The checks every implementation relies on. */
static int check_samples(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                         int n) {
  int classes = dm->sizes[dm->num_sizes - 1];

  if ((size_t)ds->rows * ds->cols != (size_t)dm->sizes[0])
    return device_fail(dm, -EINVAL, "images of %ux%u pixels do not fit the model's %d inputs",
                       ds->rows, ds->cols, dm->sizes[0]);
  for (int k = 0; k < n; k++) {
    if (idx[k] >= ds->n)
      return device_fail(dm, -EINVAL, "sample %u of a dataset of %u", idx[k], ds->n);
    if (ds->labels[idx[k]] >= classes)
      return device_fail(dm, -EINVAL, "label %u of sample %u is not below the %d outputs",
                         ds->labels[idx[k]], idx[k], classes);
  }
  return 0;
}

int device_model_load_batch(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                            int batch) {
  int r;

  dm->loaded = 0;
  if (batch < 1 || batch > dm->max_batch)
    return device_fail(dm, -EINVAL, "batch of %d samples outside 1..%d", batch, dm->max_batch);
  if ((r = check_samples(dm, ds, idx, batch)) < 0) return r;
  if ((r = dm->ops->load_batch(dm, ds, idx, batch)) < 0) return r;
  dm->loaded = batch;
  return 0;
}

int device_model_step(struct device_model *dm, mlp_grad_ready_fn cb, void *arg, float *loss) {
  if (dm->loaded < 1) return device_fail(dm, -EINVAL, "step without a batch loaded");
  return dm->ops->step(dm, cb, arg, loss);
}

int device_model_set_grad_blocks(struct device_model *dm, const size_t *ends, int n) {
  if (!dm->ops->set_grad_blocks) return 0;
  int r = dm->ops->set_grad_blocks(dm, ends, n);
  return r < 0 ? device_fail(dm, r, "gradient blocks refused (%d ends)", n) : 0;
}

int device_model_evaluate(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                          int n, double *loss_sum, int *correct) {
  int r;

  *loss_sum = 0.0;
  *correct = 0;
  dm->loaded = 0; /* the input buffers are reused below */
  if (n < 1) return device_fail(dm, -EINVAL, "evaluation of %d samples", n);
  if ((r = check_samples(dm, ds, idx, n)) < 0) return r;
  for (int start = 0; start < n; start += dm->max_batch) {
    int count = n - start < dm->max_batch ? n - start : dm->max_batch, c = 0;
    double l = 0.0;

    if ((r = dm->ops->evaluate(dm, ds, idx + start, count, &l, &c)) < 0) return r;
    *loss_sum += l;
    *correct += c;
  }
  return 0;
}

int device_model_sgd_step(struct device_model *dm, float lr) {
  return dm->ops->sgd_step(dm, lr);
}

const char *device_model_errmsg(const struct device_model *dm) {
  return dm->err;
}
