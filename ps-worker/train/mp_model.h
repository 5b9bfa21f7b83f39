/* mp_model: one rank's part of the MLP (model.h) under tensor and pipeline
 * parallelism (issue 32; docs/ARCHITECTURE.md).
 *
 * The plan. The L = num_sizes - 1 linear layers are cut into pp * chunks
 * virtual stages of consecutive layers, balanced by cost (in * out per layer:
 * the contiguous split that minimises the most expensive stage); pipeline
 * rank s holds virtual stages s, s + pp, ... (Megatron's interleaving; chunks
 * = 1 for every schedule but interleaved). Within a virtual stage, with tp > 1,
 * layers go in pairs: column-parallel (weight rows and bias split over the tp
 * ranks; its input through f: identity forward, all-reduce of the input
 * gradient backward) then row-parallel (weight columns split, input already
 * split; output through g: all-reduce forward, identity backward; the bias
 * whole, added once after the all-reduce): one all-reduce forward and one
 * backward per pair (none backward for a pair starting at fc0: the images
 * need no gradient). A layer left unpaired at the end of a stage is
 * column-parallel followed by an all-gather of its output (backward: each
 * rank keeps its own slice of the gradient, no communication). So between
 * stages activations are whole: tp rank t of stage s sends to tp rank t of
 * stage s + 1. ReLU after every layer but the last; softmax cross-entropy on
 * the last stage, each micro-batch's mean loss scaled by 1/m, so the
 * accumulated gradient is that of the mean loss over the micro-batches.
 * With tp = 1 every layer is whole and nothing is communicated.
 *
 * Slices are cut from the full model (mp_stage_load_full), so any tp and pp
 * start from the same parameters as one worker with the same seed. */
#ifndef PS_MP_MODEL_H
#define PS_MP_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

#define MP_MAX_VSTAGES 64

enum mp_kind {
  MP_WHOLE = 0,         /* tp = 1 */
  MP_COLUMN = 1,        /* column-parallel, followed by a row-parallel layer */
  MP_ROW = 2,           /* row-parallel */
  MP_COLUMN_GATHER = 3, /* column-parallel, unpaired: output all-gathered */
};

struct mp_plan {
  int sizes[MLP_MAX_SIZES], num_sizes;
  int tp, pp, chunks;
  int vstages; /* pp * chunks */
  int first_layer[MP_MAX_VSTAGES +
                  1]; /* virtual stage k has layers [first_layer[k], first_layer[k+1]) */
  enum mp_kind kind[MLP_MAX_SIZES]; /* per layer */
};

/* Plans sizes over tp x pp (x chunks). Refused (-EINVAL, err names why):
 * tp, pp or chunks < 1; fewer layers than pp * chunks ("4 layers cannot fill
 * 8 pipeline stages"); with tp > 1, a column-parallel layer whose output size
 * is not a multiple of tp ("fc1 has 10 outputs, not divisible by
 * --tensor-parallel 4"), or a row-parallel one whose input size is not. */
int mp_plan_new(const int *sizes, int num_sizes, int tp, int pp, int chunks, struct mp_plan *out,
                char *err, size_t errlen);
/* Parameters (floats) one rank of stage pp_rank holds, replicated biases
 * included, and of the whole model; for the start log line and /metrics. */
size_t mp_plan_rank_params(const struct mp_plan *p, int pp_rank);
size_t mp_plan_total_params(const struct mp_plan *p);

/* Tensor-parallel communication of a stage (the trainer wires it to the tp
 * group, tests to threads). Sums over the tp group in place; all-gather of n
 * floats per rank into recv (tp * n, rank order). Return 0 or negative. */
struct mp_tp_comm {
  void *ctx;
  int (*allreduce)(void *ctx, float *buf, size_t n);
  int (*allgather)(void *ctx, const float *send, float *recv, size_t n);
};

struct mp_counters {
  uint64_t tp_allreduce_fwd, tp_allreduce_bwd, tp_allgather;
  uint64_t peak_acts;      /* most micro-batches whose activations were held at once */
  uint64_t peak_act_bytes; /* the bytes of those activations */
};

struct mp_stage;

/* The part of pipeline rank pp_rank, tensor rank tp_rank: its layers' slices
 * (parameters at zero), gradients, and activation buffers for micro-batches
 * of up to micro_batch samples, at most max_inflight of them held at once
 * (m for GPipe, pp - s for 1F1B; more than that fails forward with -ENOBUFS).
 * comm may be NULL when tp = 1. NULL with errno on failure. */
struct mp_stage *mp_stage_new(const struct mp_plan *p, int pp_rank, int tp_rank, int micro_batch,
                              int max_inflight, const struct mp_tp_comm *comm);
void mp_stage_free(struct mp_stage *s);

/* Tensors of this rank, in model order (chunk 0's layers first): names
 * "fc<k>.weight" / "fc<k>.bias", with ".tp<r>of<t>" appended for a split
 * tensor; replicated = whole and equal on every tp rank (a row-parallel
 * layer's bias, or every tensor with tp = 1). */
int mp_stage_num_tensors(const struct mp_stage *s);
const char *mp_stage_tensor_name(const struct mp_stage *s, int i);
size_t mp_stage_tensor_count(const struct mp_stage *s, int i);
bool mp_stage_tensor_replicated(const struct mp_stage *s, int i);
float *mp_stage_param(struct mp_stage *s, int i);
float *mp_stage_grad(struct mp_stage *s, int i);

/* Copies this rank's slices out of a whole model, or into one (the other
 * entries of full untouched): how rank 0 assembles the model to evaluate and
 * dump it. */
int mp_stage_load_full(struct mp_stage *s, const struct mlp *full);
int mp_stage_store_full(const struct mp_stage *s, struct mlp *full);

/* Floats per sample entering and leaving chunk c (whole widths). */
size_t mp_stage_in_width(const struct mp_stage *s, int chunk);
size_t mp_stage_out_width(const struct mp_stage *s, int chunk);
bool mp_stage_is_first(const struct mp_stage *s, int chunk); /* virtual stage 0 */
bool mp_stage_is_last(const struct mp_stage *s, int chunk);  /* the loss */

/* Gradients to zero (start of a step). */
void mp_stage_zero_grads(struct mp_stage *s);
/* Forward of micro-batch `micro` (n samples) through chunk c: in is n x
 * in_width (the images on the first stage), out n x out_width (not written on
 * the last stage, which computes the loss against labels and returns the
 * micro-batch's mean loss in *loss). The activations backward needs stay held
 * until that micro-batch's backward of chunk c. 0 or negative errno
 * (-EEXIST: micro is held already in chunk c). */
int mp_stage_forward(struct mp_stage *s, int chunk, int micro, int n, const float *in, float *out,
                     const uint8_t *labels, float *loss);
/* Backward of micro-batch `micro` through chunk c: grad_out is the gradient
 * of the output (NULL on the last stage: from the loss, scaled by 1 / m where
 * m = num_micro), grad_in receives the input's gradient (NULL on the first
 * stage: not computed). Weight gradients are accumulated (+=). The split
 * form for ZB-H1: backward_input does the input gradient and keeps what
 * backward_weight needs; backward_weight accumulates the weight gradients and
 * frees the micro-batch's activations. -ENOENT: micro is not held in chunk c
 * at that step (no forward, or backward_weight before backward_input). */
int mp_stage_backward(struct mp_stage *s, int chunk, int micro, int num_micro,
                      const float *grad_out, float *grad_in);
int mp_stage_backward_input(struct mp_stage *s, int chunk, int micro, int num_micro,
                            const float *grad_out, float *grad_in);
int mp_stage_backward_weight(struct mp_stage *s, int chunk, int micro);
/* Counters since mp_stage_new. */
void mp_stage_counters(const struct mp_stage *s, struct mp_counters *out);

#endif
