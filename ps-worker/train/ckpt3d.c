/* ckpt3d: see ckpt3d.h. */
#include "ckpt3d.h"

#include <errno.h>
#include <stdlib.h>

#include "ckpt_io.h"
#include "log.h"
#include "worker_ckpt_agree.h"

struct ckpt3d {
  struct ckpt3d_opts o;
  struct ckpt_io *io;
  uint32_t failures;
  float **param;
  size_t *count;
  const char **name;
  struct worker_ckpt_tensors t;
};

int ckpt3d_open(const struct ckpt3d_opts *o, struct mp_stage *st, float *const *velocity,
                struct ckpt3d **out) {
  struct ckpt3d *c = calloc(1, sizeof(*c));
  int n = mp_stage_num_tensors(st);
  if (!c) return -ENOMEM;
  c->o = *o;
  c->param = calloc((size_t)n, sizeof(*c->param));
  c->count = calloc((size_t)n, sizeof(*c->count));
  c->name = calloc((size_t)n, sizeof(*c->name));
  if (!c->param || !c->count || !c->name || ckpt_io_open(CKPT_IO_SYNC, &c->io) < 0) {
    ckpt3d_close(c);
    return -ENOMEM;
  }
  for (int i = 0; i < n; i++) {
    c->param[i] = mp_stage_param(st, i);
    c->count[i] = mp_stage_tensor_count(st, i);
    c->name[i] = mp_stage_tensor_name(st, i);
  }
  c->t = (struct worker_ckpt_tensors){n, c->param, velocity, c->count, c->name};
  *out = c;
  return 0;
}

int ckpt3d_resume(struct ckpt3d *c, ps_coll *job, uint64_t *step) {
  ps_status st = PS_OK;
  return worker_ckpt_agree(job, c->o.dir, &c->o.id, &c->t, step, &st);
}

int ckpt3d_after_step(struct ckpt3d *c, uint64_t done) {
  if (!c->o.every || done % c->o.every != 0) return 0;
  char msg[700];
  int r = worker_ckpt_save_counted(c->io, c->o.dir, &c->o.id, done, &c->t, c->o.max_failures,
                                   &c->failures, msg, sizeof(msg));
  if (r < 0) log_error("training stops", "step=%llu error=\"%s\"", (unsigned long long)done, msg);
  return r;
}

void ckpt3d_close(struct ckpt3d *c) {
  if (!c) return;
  ckpt_io_close(c->io);
  free(c->param);
  free(c->count);
  free(c->name);
  free(c);
}
