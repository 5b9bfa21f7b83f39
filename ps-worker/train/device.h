/* device: where the trainer's model computes. The CPU (model.h on CBLAS) or a
 * CUDA GPU (cuBLAS for the matrix products, kernels.cu for the rest), behind
 * one interface the trainer drives without knowing which.
 *
 * Host mirror. Every device model owns a struct mlp (model.h) whose parameter
 * and gradient buffers are what the sync backends read and write, exactly as
 * with a plain CPU model; on a GPU those buffers are page-locked so copies run
 * at full speed and overlap computation. The contract:
 *  - Parameters: the host mirror is authoritative between steps. After
 *    writing host parameters (initialisation, a pull) call
 *    device_model_load_params; after changing them on the device
 *    (device_model_sgd_step) call device_model_store_params before reading
 *    them on the host. Host parameters must not change from load_params until
 *    the next step, evaluate or store_params returns.
 *  - Gradients: device_model_step with a callback makes each tensor's gradient
 *    final in the host mirror before it calls back for that tensor, last layer
 *    first (model.h's order), while the earlier layers are still computed;
 *    without a callback the gradients stay on the device (local training,
 *    benchmarks).
 * On the CPU the mirror is the model itself: load_params and store_params do
 * nothing and a step is mlp_forward_backward on the gathered batch, so the
 * CPU trainer computes and performs exactly as before this interface.
 *
 * A step is split in two so input transfer overlaps the wait for parameters:
 * device_model_load_batch gathers the samples (and on a GPU starts their copy
 * to the device from page-locked memory), device_model_step computes on the
 * last batch loaded.
 *
 * Errors are negative errno values: -ENODEV (no such device, or built without
 * CUDA), -ENOMEM, -EINVAL (bad arguments), -EIO (a device error; the model is
 * then unusable). device_model_errmsg says what happened. A model is used by
 * one thread at a time; gradient callbacks run on that thread. */
#ifndef PS_DEVICE_H
#define PS_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "data.h"
#include "model.h"

enum device_kind {
  DEVICE_AUTO = 0, /* CUDA when a usable GPU is present, else the CPU */
  DEVICE_CPU,
  DEVICE_CUDA,
};

struct device_opts {
  enum device_kind kind;
  int gpu;    /* CUDA device: this number modulo the visible devices (ps-worker
                 passes its rank, as the NCCL backend does, so local workers
                 spread over a machine's GPUs) */
  bool eager; /* CUDA: launch a step kernel by kernel instead of replaying a
                 captured CUDA graph (for checking the graph path) */
};

struct device_model;

/* Parses "auto", "cpu" or "cuda"; returns 0 or -EINVAL. */
int device_kind_parse(const char *s, enum device_kind *out);
/* The config_check_fn of --device (config.h): 0, or -EINVAL with the reason
 * in err. */
int device_kind_check(const char *value, char *err, size_t errlen);
const char *device_kind_name(enum device_kind kind);

/* Creates an MLP with layer sizes sizes[0..num_sizes) (as mlp_new) on the
 * device o->kind selects, for batches of up to max_batch samples, parameters
 * zeroed (initialise the host mirror, then device_model_load_params). With
 * DEVICE_AUTO a CUDA failure is logged and the CPU is used. On failure
 * returns a negative errno and a message in err (errlen > 0): -ENODEV says why
 * CUDA cannot be used ("built without CUDA", "no CUDA device", ...). */
int device_model_open(const struct device_opts *o, const int *sizes, int num_sizes, int max_batch,
                      struct device_model **out, char *err, size_t errlen);
/* Waits for the device and releases everything. Accepts NULL. */
void device_model_close(struct device_model *dm);

enum device_kind device_model_kind(const struct device_model *dm);
/* "cpu" or e.g. "cuda:0 NVIDIA H200 (sm_90, 140 GiB)". */
const char *device_model_name(const struct device_model *dm);
/* The host mirror (owned by dm). */
struct mlp *device_model_host(struct device_model *dm);

/* Host parameters -> device (queued; see the contract above). */
int device_model_load_params(struct device_model *dm);
/* Device parameters -> host; returns once they are there. */
int device_model_store_params(struct device_model *dm);

/* Gathers samples idx[0..batch) of ds (data.h) as the input of the next step.
 * batch must be 1..max_batch, every idx < ds->n, the image size must equal the
 * model's input size and every label must be below its output size
 * (-EINVAL otherwise). */
int device_model_load_batch(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                            int batch);
/* Forward, softmax cross-entropy and backward on the last batch loaded; *loss
 * is the batch's mean loss (possibly not finite: that is the caller's call).
 * Gradients and callbacks as in the contract above; cb may be NULL. */
int device_model_step(struct device_model *dm, mlp_grad_ready_fn cb, void *arg, float *loss);
/* Asks for tensor 0's gradient in row blocks (mlp_set_grad_blocks) so its
 * first rows can be sent while the rest is computed. A device that computes
 * the gradient in one piece (CUDA) keeps doing so and calls back once. */
int device_model_set_grad_blocks(struct device_model *dm, const size_t *ends, int n);
/* Forward only over samples idx[0..n) of ds (any n >= 1, processed max_batch
 * at a time): *loss_sum is the summed cross-entropy, *correct the number whose
 * first arg-max logit equals the label. Overwrites the loaded batch. */
int device_model_evaluate(struct device_model *dm, const struct dataset *ds, const uint32_t *idx,
                          int n, double *loss_sum, int *correct);
/* param -= lr * grad on the device (plain SGD, as mlp_sgd_step). */
int device_model_sgd_step(struct device_model *dm, float lr);

/* Text of the last error ("" if none). */
const char *device_model_errmsg(const struct device_model *dm);

#endif
