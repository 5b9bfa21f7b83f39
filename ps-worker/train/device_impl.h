/* device_impl: what a device implementation (device_cpu.c, device_cuda.c,
 * device_cuda_none.c) provides to device.c, and what device_base.c provides
 * to all of them. Only those files include this header; everyone else sees
 * the opaque struct device_model.
 *
 * An implementation embeds struct device_model as its first member, fills it
 * in its open function and recovers its own struct with container_of. The
 * ops are called by device.c only after it has checked the arguments that do
 * not depend on the device (batch range, dataset shape, labels). */
#ifndef PS_DEVICE_IMPL_H
#define PS_DEVICE_IMPL_H

#include <stddef.h>

#include "container_of.h"
#include "device.h"

struct device_model_ops {
  void (*close)(struct device_model *dm);
  int (*load_params)(struct device_model *dm);
  int (*store_params)(struct device_model *dm);
  int (*load_batch)(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                    int batch);
  int (*step)(struct device_model *dm, mlp_grad_ready_fn cb, void *arg, float *loss);
  /* NULL: the device computes tensor 0's gradient in one piece */
  int (*set_grad_blocks)(struct device_model *dm, const size_t *ends, int n);
  /* n <= max_batch: device.c cuts longer evaluations into pieces. */
  int (*evaluate)(struct device_model *dm, const struct dataset *ds, const uint32_t *idx, int n,
                  double *loss_sum, int *correct);
  int (*sgd_step)(struct device_model *dm, float lr);
};

struct device_model {
  const struct device_model_ops *ops;
  enum device_kind kind;
  struct mlp *host;
  int num_sizes;
  int sizes[MLP_MAX_SIZES];
  int max_batch;
  int loaded; /* samples of the batch loaded; 0 = none */
  char name[160];
  char err[512];
};

/* device_base.c: fills the fields common to every implementation. */
void device_model_init_base(struct device_model *dm, const struct device_model_ops *ops,
                            enum device_kind kind, const int *sizes, int num_sizes, int max_batch);
/* printf into dm->err; returns code (a negative errno) for `return device_fail(...)`. */
int device_fail(struct device_model *dm, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Each returns 0 and *out, or a negative errno with a message in err. */
int device_cpu_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                    struct device_model **out, char *err, size_t errlen);
/* -ENODEV when this build has no CUDA or the machine no usable GPU. */
int device_cuda_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                     struct device_model **out, char *err, size_t errlen);

#endif
