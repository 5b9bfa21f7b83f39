/* pipeline: pipeline-parallel schedules as data.
 *
 * A model cut into p stages (stage s on pipeline rank s), the batch into m
 * micro-batches. A schedule is, per stage, the ordered list of actions that
 * stage runs in one training step; the trainer (and anyone else) executes
 * the list, so the schedule itself is testable without sockets (as
 * DeepSpeed's instruction lists and torch.distributed.pipelining's
 * `_validate_pipeline_order`). Schedules:
 *
 *   GPipe        all forwards, then all backwards;
 *   1F1B         PipeDream-Flush: stage s warms up with p - s - 1 forwards,
 *                then alternates one forward and one backward, then drains;
 *   interleaved  Megatron's interleaved 1F1B: v model chunks per rank (rank s
 *                holds virtual stages s, s + p, ..., s + (v-1)p), m a
 *                multiple of p;
 *   ZB-H1        zero-bubble H1 (Qi et al.): the backward split into its
 *                input-gradient half (B, on the critical path) and its
 *                weight-gradient half (W, deferred into the bubbles), at
 *                1F1B's activation memory.
 *
 * The gradient is that of the mean loss over the micro-batches: the last
 * stage scales each micro-batch's loss by 1/m.
 *
 * Send and receive actions name the peer stage; a send of micro-batch i's
 * activations from stage s is matched by the receive of the same on stage
 * s + 1 (for chunks: virtual stage k + 1), gradients the other way; an
 * action's `chunk` is its own rank's (a send names the chunk that produced
 * the tensor, a receive the chunk that consumes it). Between two ranks the
 * receives are posted in the order the sends are, and the lists run with
 * blocking sends (a send waits for its receive) cannot deadlock. Each
 * list ends with PS_PIPE_REDUCE_GRADS (the data-parallel reduction) and
 * PS_PIPE_OPTIMIZER_STEP. */
#ifndef PS_PIPELINE_H
#define PS_PIPELINE_H

#include <stddef.h>

#include "ps.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  PS_PIPE_GPIPE = 0,
  PS_PIPE_1F1B = 1,
  PS_PIPE_INTERLEAVED = 2,
  PS_PIPE_ZBH1 = 3,
} ps_pipe_schedule;

/* "gpipe", "1f1b", "interleaved", "zb-h1" <-> the enum; anything else is
 * PS_ERR_INVALID with "expected gpipe, 1f1b, interleaved or zb-h1" in err. */
ps_status ps_pipe_schedule_parse(const char *s, ps_pipe_schedule *out, char *err, size_t errlen);
const char *ps_pipe_schedule_name(ps_pipe_schedule k);

typedef enum {
  PS_PIPE_FORWARD = 0,         /* forward of micro-batch `micro` on chunk `chunk` */
  PS_PIPE_BACKWARD = 1,        /* full backward (input and weight gradients) */
  PS_PIPE_BACKWARD_INPUT = 2,  /* ZB-H1: the input-gradient half (B) */
  PS_PIPE_BACKWARD_WEIGHT = 3, /* ZB-H1: the weight-gradient half (W) */
  PS_PIPE_SEND_ACT = 4,        /* send micro's activations to peer_stage */
  PS_PIPE_RECV_ACT = 5,        /* receive micro's activations from peer_stage */
  PS_PIPE_SEND_GRAD = 6,       /* send micro's input gradient to peer_stage */
  PS_PIPE_RECV_GRAD = 7,       /* receive micro's output gradient from peer_stage */
  PS_PIPE_REDUCE_GRADS = 8,    /* the data-parallel reduction of the gradients */
  PS_PIPE_OPTIMIZER_STEP = 9,
} ps_pipe_op;

struct ps_pipe_action {
  ps_pipe_op op;
  int micro;      /* micro-batch 0..m-1; -1 for REDUCE_GRADS / OPTIMIZER_STEP */
  int chunk;      /* model chunk on this rank, 0..v-1 (0 unless interleaved) */
  int peer_stage; /* send/receive: the other pipeline rank; else -1 */
};

struct ps_pipe_shape {
  ps_pipe_schedule kind;
  int stages; /* p >= 1 */
  int micro;  /* m >= 1 */
  int chunks; /* v >= 1; must be 1 unless interleaved (>= 2 there) */
};

/* Checks the shape (interleaved: m a multiple of p; all: p, m, v in range,
 * p <= 256, m <= 4096, v <= 16); PS_ERR_INVALID with the reason in err. */
ps_status ps_pipe_check(const struct ps_pipe_shape *sh, char *err, size_t errlen);

/* Stage `stage`'s actions for one step into *out (malloc'd, the caller
 * frees), *n of them. */
ps_status ps_pipe_actions(const struct ps_pipe_shape *sh, int stage, struct ps_pipe_action **out,
                          size_t *n, char *err, size_t errlen);

/* Runs the validator on every stage's list: every send matched by one
 * receive on its peer (same kind, micro and virtual stage, in order), every
 * receive by a send,
 * each micro-batch's forward before its backward and after its input
 * arrived, B before W, every micro-batch forwarded and backwarded exactly
 * once per chunk, and the lists executed with blocking sends (a send waits
 * until its receive is posted) finish without deadlock. PS_OK or
 * PS_ERR_STATE with the first violation (stage, action index) in err. */
ps_status ps_pipe_validate(const struct ps_pipe_shape *sh, char *err, size_t errlen);

/* Times, in any unit: one chunk's forward, backward (whole; ZB-H1 splits it
 * into backward_input + weight), and one transfer between stages. */
struct ps_pipe_costs {
  double forward, backward, backward_input, weight, transfer;
};

struct ps_pipe_sim {
  double step_time;   /* first action start to last action end */
  double ideal_time;  /* m * v * (forward + backward): no bubble, no transfer */
  double bubble;      /* idle share of the step: 1 - busy / (p * step_time) */
  int peak_acts[256]; /* per stage: the most micro-batches' activations held */
};

/* Simulates the actions of every stage as events (an action starts when its
 * stage is free and its dependencies are done; a send completes when its
 * receive is posted plus the transfer time). */
ps_status ps_pipe_simulate(const struct ps_pipe_shape *sh, const struct ps_pipe_costs *c,
                           struct ps_pipe_sim *out, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
