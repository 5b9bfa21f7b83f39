/* mp_model: one rank's part of the MLP under tensor and pipeline parallelism
 * (mp_model.h has the plan; model.c the single-worker model it reproduces).
 *
 * The arithmetic is model.c's: y = x W^T + b by one sgemm onto rows
 * pre-filled with b (a row-parallel layer: sgemm, all-reduce, then b added
 * once), ReLU kept as its output, mlp_softmax_xent for the loss and its
 * gradient. Backward is always the ZB split: backward_input walks the chunk's
 * layers from the last, writing each layer's dLoss/dz into the micro-batch's
 * slot and the input gradient out; backward_weight then turns the held dz and
 * inputs into db (column sums) and dW (d^T a). Neither value depends on when
 * the other is computed, so with tp = 1 (every layer whole, nothing
 * communicated) and one micro-batch the gradients are model.c's bit for bit.
 * The first accumulation after zero_grads writes (beta = 0, as model.c does)
 * instead of adding to zeros, so even the sign of a zero matches.
 *
 * Memory: one 64-byte-aligned block made at mp_stage_new holds the
 * parameters, the gradients, two scratch buffers and, per chunk, max_inflight
 * slots; a slot holds one micro-batch's copy of the chunk input, every
 * layer's output (local width), every layer's dz and the labels. Forward
 * takes a free slot, backward_weight frees it: no allocation after new. The
 * activations counted as held are the input copy and the layer outputs of
 * the micro-batches between their forward and their backward_weight. */
#include "mp_model.h"

#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errbuf.h"
#include "tensor_math.h"

#define ALIGN_FLOATS 16 /* 64 bytes */
#define MP_MAX_LAYERS (MLP_MAX_SIZES - 1)

enum slot_state { SLOT_FREE = 0, SLOT_FORWARD, SLOT_INPUT_DONE };

struct mp_layer {
  int index; /* in the whole model */
  enum mp_kind kind;
  int in, out;   /* whole sizes */
  int lin, lout; /* this rank's: input of the sgemm, columns of W and rows of dz */
  int act_width; /* the output it keeps: whole after a row-parallel all-reduce or a gather */
  bool relu;
  int tensor; /* its weight; the bias is tensor + 1 */
};

struct mp_slot {
  int micro, n;
  enum slot_state state;
  float *x;                    /* n x in_width */
  float *act[MP_MAX_LAYERS];   /* n x act_width */
  float *delta[MP_MAX_LAYERS]; /* n x lout: dLoss/dz */
  uint8_t *labels;             /* the last stage's */
};

struct mp_chunk {
  int vstage, first, num_layers; /* layers s->layers[first .. first + num_layers) */
  bool fresh;                    /* no gradient accumulated since zero_grads */
  struct mp_slot *slots;         /* max_inflight */
};

struct mp_tensor {
  char name[48];
  size_t count;
  bool replicated;
  float *param, *grad;
};

struct mp_stage {
  struct mp_plan plan;
  int pp_rank, tp_rank, micro_batch, max_inflight;
  struct mp_tp_comm comm;
  int num_layers, num_tensors;
  struct mp_layer layers[MP_MAX_LAYERS];
  struct mp_tensor tensors[2 * MP_MAX_LAYERS];
  struct mp_chunk chunks[MP_MAX_VSTAGES];
  struct mp_slot *slots;
  float *scratch_a, *scratch_b; /* micro_batch x the widest layer each */
  float *block;
  uint64_t held, held_bytes;
  struct mp_counters counters;
};

static size_t align_up(size_t n) {
  return (n + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
}

static uint64_t layer_cost(const int *sizes, int l) {
  return (uint64_t)sizes[l] * (uint64_t)sizes[l + 1];
}

/* The contiguous split of layers into v non-empty stages minimising the
 * costliest stage; among those, the one with the least sum of squared stage
 * costs (the most even), then the earliest cuts. L <= 63 and v <= 64: plain
 * O(v L^2) dynamic programming. */
static void plan_split(const int *sizes, int L, int v, int *first_layer) {
  static const uint64_t inf = UINT64_MAX;
  uint64_t best[MP_MAX_VSTAGES + 1][MP_MAX_LAYERS + 1], cum[MP_MAX_LAYERS + 1], limit;
  double sq[MP_MAX_VSTAGES + 1][MP_MAX_LAYERS + 1];
  int cut[MP_MAX_VSTAGES + 1][MP_MAX_LAYERS + 1] = {{0}};

  cum[0] = 0;
  for (int l = 0; l < L; l++) cum[l + 1] = cum[l] + layer_cost(sizes, l);
  for (int k = 0; k <= v; k++)
    for (int i = 0; i <= L; i++) best[k][i] = inf;
  best[0][0] = 0;
  for (int k = 1; k <= v; k++)
    for (int i = k; i <= L; i++)
      for (int j = k - 1; j < i; j++) {
        uint64_t c = cum[i] - cum[j], m;
        if (best[k - 1][j] == inf) continue;
        m = best[k - 1][j] > c ? best[k - 1][j] : c;
        if (m < best[k][i]) best[k][i] = m;
      }
  limit = best[v][L];
  /* Second pass: every stage within limit, least sum of squares. */
  for (int k = 0; k <= v; k++)
    for (int i = 0; i <= L; i++) sq[k][i] = -1.0;
  sq[0][0] = 0.0;
  for (int k = 1; k <= v; k++)
    for (int i = k; i <= L; i++)
      for (int j = k - 1; j < i; j++) {
        uint64_t c = cum[i] - cum[j];
        double t;
        if (sq[k - 1][j] < 0.0 || c > limit) continue;
        t = sq[k - 1][j] + (double)c * (double)c;
        if (sq[k][i] < 0.0 || t < sq[k][i]) {
          sq[k][i] = t;
          cut[k][i] = j;
        }
      }
  first_layer[v] = L;
  for (int k = v, i = L; k > 0; k--) {
    i = cut[k][i];
    first_layer[k - 1] = i;
  }
}

int mp_plan_new(const int *sizes, int num_sizes, int tp, int pp, int chunks, struct mp_plan *out,
                char *err, size_t errlen) {
  int L = num_sizes - 1, v;

  memset(out, 0, sizeof(*out));
  if (num_sizes < 2 || num_sizes > MLP_MAX_SIZES)
    return errbuf_set(-EINVAL, err, errlen, "a model has 2..%d layer sizes, not %d", MLP_MAX_SIZES,
                      num_sizes);
  for (int i = 0; i < num_sizes; i++)
    if (sizes[i] < 1 || sizes[i] > MLP_MAX_LAYER_SIZE)
      return errbuf_set(-EINVAL, err, errlen, "layer size %d outside 1..%d", sizes[i],
                        MLP_MAX_LAYER_SIZE);
  if (tp < 1) return errbuf_set(-EINVAL, err, errlen, "--tensor-parallel %d: must be >= 1", tp);
  if (pp < 1) return errbuf_set(-EINVAL, err, errlen, "--pipeline-parallel %d: must be >= 1", pp);
  if (chunks < 1) return errbuf_set(-EINVAL, err, errlen, "%d chunks: must be >= 1", chunks);
  if (pp > MP_MAX_VSTAGES / chunks)
    return errbuf_set(-EINVAL, err, errlen, "%d pipeline stages x %d chunks: more than %d", pp,
                      chunks, MP_MAX_VSTAGES);
  v = pp * chunks;
  if (L < v)
    return errbuf_set(-EINVAL, err, errlen, "%d layers cannot fill %d pipeline stages", L, v);

  memcpy(out->sizes, sizes, sizeof(int) * (size_t)num_sizes);
  out->num_sizes = num_sizes;
  out->tp = tp;
  out->pp = pp;
  out->chunks = chunks;
  out->vstages = v;
  plan_split(sizes, L, v, out->first_layer);
  for (int k = 0; k < v; k++) {
    int a = out->first_layer[k], b = out->first_layer[k + 1];
    for (int l = a; l < b; l++) {
      if (tp == 1)
        out->kind[l] = MP_WHOLE;
      else if ((l - a) % 2 == 1)
        out->kind[l] = MP_ROW;
      else
        out->kind[l] = l + 1 < b ? MP_COLUMN : MP_COLUMN_GATHER;
      if (out->kind[l] == MP_ROW && sizes[l] % tp != 0)
        return errbuf_set(-EINVAL, err, errlen,
                          "fc%d has %d inputs, not divisible by --tensor-parallel %d", l, sizes[l],
                          tp);
      if ((out->kind[l] == MP_COLUMN || out->kind[l] == MP_COLUMN_GATHER) && sizes[l + 1] % tp != 0)
        return errbuf_set(-EINVAL, err, errlen,
                          "fc%d has %d outputs, not divisible by --tensor-parallel %d", l,
                          sizes[l + 1], tp);
    }
  }
  return 0;
}

static size_t layer_rank_params(const struct mp_plan *p, int l) {
  size_t in = (size_t)p->sizes[l], out = (size_t)p->sizes[l + 1], t = (size_t)p->tp;

  switch (p->kind[l]) {
    case MP_COLUMN:
    case MP_COLUMN_GATHER:
      return in * (out / t) + out / t;
    case MP_ROW:
      return (in / t) * out + out; /* the bias whole on every rank */
    default:
      return in * out + out;
  }
}

size_t mp_plan_rank_params(const struct mp_plan *p, int pp_rank) {
  size_t n = 0;

  if (pp_rank < 0 || pp_rank >= p->pp) return 0;
  for (int k = pp_rank; k < p->vstages; k += p->pp)
    for (int l = p->first_layer[k]; l < p->first_layer[k + 1]; l++) n += layer_rank_params(p, l);
  return n;
}

size_t mp_plan_total_params(const struct mp_plan *p) {
  size_t n = 0;

  for (int l = 0; l + 1 < p->num_sizes; l++)
    n += (size_t)p->sizes[l] * (size_t)p->sizes[l + 1] + (size_t)p->sizes[l + 1];
  return n;
}

/* Fills the layer table and tensor names/counts; returns the widest whole
 * layer width, for the scratch buffers. */
static int stage_describe(struct mp_stage *s) {
  const struct mp_plan *p = &s->plan;
  int L = p->num_sizes - 1, t = p->tp, widest = 1;

  for (int c = 0; c < p->chunks; c++) {
    struct mp_chunk *ch = &s->chunks[c];
    int k = s->pp_rank + c * p->pp;

    ch->vstage = k;
    ch->first = s->num_layers;
    ch->num_layers = p->first_layer[k + 1] - p->first_layer[k];
    ch->fresh = true;
    for (int l = p->first_layer[k]; l < p->first_layer[k + 1]; l++) {
      struct mp_layer *ly = &s->layers[s->num_layers++];
      struct mp_tensor *w = &s->tensors[s->num_tensors], *b = w + 1;
      bool split_in = p->kind[l] == MP_ROW;
      bool split_out = p->kind[l] == MP_COLUMN || p->kind[l] == MP_COLUMN_GATHER;

      ly->index = l;
      ly->kind = p->kind[l];
      ly->in = p->sizes[l];
      ly->out = p->sizes[l + 1];
      ly->lin = split_in ? ly->in / t : ly->in;
      ly->lout = split_out ? ly->out / t : ly->out;
      ly->act_width = ly->kind == MP_COLUMN ? ly->lout : ly->out;
      ly->relu = l + 1 < L;
      ly->tensor = s->num_tensors;
      s->num_tensors += 2;
      if (split_in || split_out)
        snprintf(w->name, sizeof(w->name), "fc%d.weight.tp%dof%d", l, s->tp_rank, t);
      else
        snprintf(w->name, sizeof(w->name), "fc%d.weight", l);
      if (split_out)
        snprintf(b->name, sizeof(b->name), "fc%d.bias.tp%dof%d", l, s->tp_rank, t);
      else
        snprintf(b->name, sizeof(b->name), "fc%d.bias", l);
      w->count = (size_t)ly->lin * (size_t)ly->lout;
      b->count = (size_t)ly->lout;
      w->replicated = !split_in && !split_out;
      b->replicated = !split_out;
      if (ly->in > widest) widest = ly->in;
      if (ly->out > widest) widest = ly->out;
    }
  }
  return widest;
}

/* Floats of one slot (each piece aligned); with carve, points its pieces
 * into mem. */
static size_t slot_floats(struct mp_stage *s, const struct mp_chunk *ch, struct mp_slot *slot,
                          float *mem) {
  size_t mb = (size_t)s->micro_batch, off = 0;
  const struct mp_layer *first = &s->layers[ch->first];

  if (mem) slot->x = mem + off;
  off += align_up(mb * (size_t)first->in);
  for (int i = 0; i < ch->num_layers; i++) {
    const struct mp_layer *ly = &s->layers[ch->first + i];
    if (mem) slot->act[i] = mem + off;
    off += align_up(mb * (size_t)ly->act_width);
    if (mem) slot->delta[i] = mem + off;
    off += align_up(mb * (size_t)ly->lout);
  }
  if (mem) slot->labels = (uint8_t *)(mem + off);
  off += align_up((mb + sizeof(float) - 1) / sizeof(float));
  return off;
}

struct mp_stage *mp_stage_new(const struct mp_plan *p, int pp_rank, int tp_rank, int micro_batch,
                              int max_inflight, const struct mp_tp_comm *comm) {
  struct mp_stage *s;
  size_t total = 0, off = 0, scratch;
  int widest, nslots;

  if (p == NULL || pp_rank < 0 || pp_rank >= p->pp || tp_rank < 0 || tp_rank >= p->tp ||
      micro_batch < 1 || micro_batch > MLP_MAX_BATCH || max_inflight < 1 ||
      max_inflight > MLP_MAX_BATCH || (p->tp > 1 && comm == NULL)) {
    errno = EINVAL;
    return NULL;
  }
  s = calloc(1, sizeof(*s));
  if (s == NULL) return NULL;
  s->plan = *p;
  s->pp_rank = pp_rank;
  s->tp_rank = tp_rank;
  s->micro_batch = micro_batch;
  s->max_inflight = max_inflight;
  if (comm) s->comm = *comm;
  widest = stage_describe(s);
  nslots = p->chunks * max_inflight;
  s->slots = calloc((size_t)nslots, sizeof(*s->slots));
  if (s->slots == NULL) goto nomem;

  for (int i = 0; i < s->num_tensors; i++) total += 2 * align_up(s->tensors[i].count);
  scratch = align_up((size_t)micro_batch * (size_t)widest);
  total += 2 * scratch;
  for (int c = 0; c < p->chunks; c++)
    total += (size_t)max_inflight * slot_floats(s, &s->chunks[c], NULL, NULL);
  s->block = aligned_alloc(ALIGN_FLOATS * sizeof(float), total * sizeof(float));
  if (s->block == NULL) goto nomem;
  memset(s->block, 0, total * sizeof(float));
  for (int i = 0; i < s->num_tensors; i++) {
    s->tensors[i].param = s->block + off;
    off += align_up(s->tensors[i].count);
    s->tensors[i].grad = s->block + off;
    off += align_up(s->tensors[i].count);
  }
  s->scratch_a = s->block + off;
  s->scratch_b = s->block + off + scratch;
  off += 2 * scratch;
  for (int c = 0; c < p->chunks; c++) {
    struct mp_chunk *ch = &s->chunks[c];
    ch->slots = s->slots + (size_t)c * (size_t)max_inflight;
    for (int j = 0; j < max_inflight; j++) {
      ch->slots[j].micro = -1;
      off += slot_floats(s, ch, &ch->slots[j], s->block + off);
    }
  }
  return s;

nomem:
  mp_stage_free(s);
  errno = ENOMEM;
  return NULL;
}

void mp_stage_free(struct mp_stage *s) {
  if (s == NULL) return;
  free(s->block);
  free(s->slots);
  free(s);
}

int mp_stage_num_tensors(const struct mp_stage *s) {
  return s->num_tensors;
}

static const struct mp_tensor *tensor_at(const struct mp_stage *s, int i) {
  return i >= 0 && i < s->num_tensors ? &s->tensors[i] : NULL;
}

const char *mp_stage_tensor_name(const struct mp_stage *s, int i) {
  return tensor_at(s, i) ? s->tensors[i].name : NULL;
}

size_t mp_stage_tensor_count(const struct mp_stage *s, int i) {
  return tensor_at(s, i) ? s->tensors[i].count : 0;
}

bool mp_stage_tensor_replicated(const struct mp_stage *s, int i) {
  return tensor_at(s, i) ? s->tensors[i].replicated : false;
}

float *mp_stage_param(struct mp_stage *s, int i) {
  return tensor_at(s, i) ? s->tensors[i].param : NULL;
}

float *mp_stage_grad(struct mp_stage *s, int i) {
  return tensor_at(s, i) ? s->tensors[i].grad : NULL;
}

/* Checks that full has the plan's sizes. */
static int full_matches(const struct mp_stage *s, const struct mlp *full) {
  if (full == NULL || mlp_num_tensors(full) != 2 * (s->plan.num_sizes - 1)) return 0;
  for (int l = 0; l + 1 < s->plan.num_sizes; l++) {
    uint32_t dims[2];
    if (mlp_tensor_shape(full, 2 * l, dims) != 2 || dims[0] != (uint32_t)s->plan.sizes[l + 1] ||
        dims[1] != (uint32_t)s->plan.sizes[l])
      return 0;
  }
  return 1;
}

/* Copies layer ly's slice between the whole tensors (fw, fb) and this rank's
 * (w, b), in the direction given by to_full. */
static void copy_slice(const struct mp_stage *s, const struct mp_layer *ly, float *fw, float *fb,
                       float *w, float *b, bool to_full) {
  size_t lin = (size_t)ly->lin, lout = (size_t)ly->lout, in = (size_t)ly->in;
  size_t row0 = ly->lout < ly->out ? (size_t)s->tp_rank * lout : 0;
  size_t col0 = ly->lin < ly->in ? (size_t)s->tp_rank * lin : 0;

  for (size_t o = 0; o < lout; o++) {
    float *whole = fw + (row0 + o) * in + col0, *mine = w + o * lin;
    memcpy(to_full ? whole : mine, to_full ? mine : whole, sizeof(float) * lin);
  }
  memcpy(to_full ? fb + row0 : b, to_full ? b : fb + row0, sizeof(float) * lout);
}

static int stage_copy_full(const struct mp_stage *s, struct mlp *full, bool to_full) {
  if (!full_matches(s, full)) return -EINVAL;
  for (int i = 0; i < s->num_layers; i++) {
    const struct mp_layer *ly = &s->layers[i];
    const struct mp_tensor *w = &s->tensors[ly->tensor], *b = w + 1;
    copy_slice(s, ly, mlp_param(full, 2 * ly->index), mlp_param(full, 2 * ly->index + 1), w->param,
               b->param, to_full);
  }
  return 0;
}

int mp_stage_load_full(struct mp_stage *s, const struct mlp *full) {
  /* Reading only: mlp_param takes a non-const model. */
  return stage_copy_full(s, (struct mlp *)full, false);
}

int mp_stage_store_full(const struct mp_stage *s, struct mlp *full) {
  return stage_copy_full(s, full, true);
}

static const struct mp_chunk *chunk_at(const struct mp_stage *s, int chunk) {
  return chunk >= 0 && chunk < s->plan.chunks ? &s->chunks[chunk] : NULL;
}

size_t mp_stage_in_width(const struct mp_stage *s, int chunk) {
  const struct mp_chunk *ch = chunk_at(s, chunk);
  return ch ? (size_t)s->plan.sizes[s->plan.first_layer[ch->vstage]] : 0;
}

size_t mp_stage_out_width(const struct mp_stage *s, int chunk) {
  const struct mp_chunk *ch = chunk_at(s, chunk);
  return ch ? (size_t)s->plan.sizes[s->plan.first_layer[ch->vstage + 1]] : 0;
}

bool mp_stage_is_first(const struct mp_stage *s, int chunk) {
  const struct mp_chunk *ch = chunk_at(s, chunk);
  return ch && ch->vstage == 0;
}

bool mp_stage_is_last(const struct mp_stage *s, int chunk) {
  const struct mp_chunk *ch = chunk_at(s, chunk);
  return ch && ch->vstage == s->plan.vstages - 1;
}

void mp_stage_zero_grads(struct mp_stage *s) {
  for (int i = 0; i < s->num_tensors; i++)
    memset(s->tensors[i].grad, 0, sizeof(float) * s->tensors[i].count);
  for (int c = 0; c < s->plan.chunks; c++) s->chunks[c].fresh = true;
}

static struct mp_slot *slot_find(struct mp_stage *s, struct mp_chunk *ch, int micro) {
  for (int j = 0; j < s->max_inflight; j++)
    if (ch->slots[j].micro == micro && ch->slots[j].state != SLOT_FREE) return &ch->slots[j];
  return NULL;
}

/* The forward activations a slot holds for n samples (see the file comment). */
static uint64_t slot_held_bytes(const struct mp_stage *s, const struct mp_chunk *ch, int n) {
  size_t floats = (size_t)s->layers[ch->first].in;

  for (int i = 0; i < ch->num_layers; i++) floats += (size_t)s->layers[ch->first + i].act_width;
  return (uint64_t)floats * (uint64_t)n * sizeof(float);
}

/* One layer forward: a (n x lin) -> slot->act[i]. */
static int layer_forward(struct mp_stage *s, const struct mp_layer *ly, const float *a, float *act,
                         int n) {
  const float *w = s->tensors[ly->tensor].param, *b = s->tensors[ly->tensor + 1].param;
  size_t rows = (size_t)n, lout = (size_t)ly->lout;
  float *z = ly->kind == MP_COLUMN_GATHER ? s->scratch_a : act;
  int rc;

  if (ly->kind == MP_ROW) {
    /* g: partial products summed over the tp group, then the bias once */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, ly->lout, ly->lin, 1.0f, a, ly->lin, w,
                ly->lin, 0.0f, z, ly->lout);
    rc = s->comm.allreduce(s->comm.ctx, z, rows * lout);
    if (rc < 0) return rc;
    s->counters.tp_allreduce_fwd++;
    for (size_t r = 0; r < rows; r++) tm_add(z + r * lout, b, lout);
  } else {
    for (size_t r = 0; r < rows; r++) memcpy(z + r * lout, b, sizeof(float) * lout);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, ly->lout, ly->lin, 1.0f, a, ly->lin, w,
                ly->lin, 1.0f, z, ly->lout);
  }
  /* tm_relu lets a NaN through, as torch does: divergence must show. */
  if (ly->relu) tm_relu(z, rows * lout);
  if (ly->kind == MP_COLUMN_GATHER) {
    size_t t = (size_t)s->plan.tp, out = (size_t)ly->out;
    rc = s->comm.allgather(s->comm.ctx, z, s->scratch_b, rows * lout);
    if (rc < 0) return rc;
    s->counters.tp_allgather++;
    /* rank r's block is its n x lout slice: columns [r lout, (r+1) lout) */
    for (size_t r = 0; r < t; r++)
      for (size_t i = 0; i < rows; i++)
        memcpy(act + i * out + r * lout, s->scratch_b + (r * rows + i) * lout,
               sizeof(float) * lout);
  }
  return 0;
}

int mp_stage_forward(struct mp_stage *s, int chunk, int micro, int n, const float *in, float *out,
                     const uint8_t *labels, float *loss) {
  struct mp_chunk *ch = (struct mp_chunk *)chunk_at(s, chunk);
  struct mp_slot *slot = NULL;
  const float *a;
  bool last;
  int rc, classes = s->plan.sizes[s->plan.num_sizes - 1];

  if (ch == NULL || micro < 0 || n < 1 || n > s->micro_batch || in == NULL) return -EINVAL;
  last = ch->vstage == s->plan.vstages - 1;
  if (last ? labels == NULL || loss == NULL : out == NULL) return -EINVAL;
  if (last)
    for (int i = 0; i < n; i++)
      if (labels[i] >= classes) return -EINVAL;
  if (slot_find(s, ch, micro) != NULL) return -EEXIST;
  for (int j = 0; j < s->max_inflight && slot == NULL; j++)
    if (ch->slots[j].state == SLOT_FREE) slot = &ch->slots[j];
  if (slot == NULL) return -ENOBUFS;

  memcpy(slot->x, in, sizeof(float) * (size_t)n * (size_t)s->layers[ch->first].in);
  a = slot->x;
  for (int i = 0; i < ch->num_layers; i++) {
    rc = layer_forward(s, &s->layers[ch->first + i], a, slot->act[i], n);
    if (rc < 0) return rc;
    a = slot->act[i];
  }
  if (last) {
    int correct = 0;
    memcpy(slot->labels, labels, (size_t)n);
    *loss = (float)(mlp_softmax_xent(a, labels, n, classes, NULL, 0.0f, &correct) / n);
  } else {
    memcpy(out, a, sizeof(float) * (size_t)n * mp_stage_out_width(s, chunk));
  }
  slot->micro = micro;
  slot->n = n;
  slot->state = SLOT_FORWARD;
  s->held++;
  s->held_bytes += slot_held_bytes(s, ch, n);
  if (s->held > s->counters.peak_acts) s->counters.peak_acts = s->held;
  if (s->held_bytes > s->counters.peak_act_bytes) s->counters.peak_act_bytes = s->held_bytes;
  return 0;
}

/* dz of the chunk's last layer from the whole output gradient g (n x out):
 * its own columns (a gathered layer keeps only its slice), through the ReLU. */
static void last_delta(const struct mp_stage *s, const struct mp_layer *ly, const float *g,
                       const float *act, float *d, int n) {
  size_t out = (size_t)ly->out, lout = (size_t)ly->lout;
  size_t col0 = ly->lout < ly->out ? (size_t)s->tp_rank * lout : 0;

  for (size_t r = 0; r < (size_t)n; r++) {
    memcpy(d + r * lout, g + r * out + col0, sizeof(float) * lout);
    if (ly->relu) tm_relu_backward(d + r * lout, act + r * out + col0, lout);
  }
}

int mp_stage_backward_input(struct mp_stage *s, int chunk, int micro, int num_micro,
                            const float *grad_out, float *grad_in) {
  struct mp_chunk *ch = (struct mp_chunk *)chunk_at(s, chunk);
  struct mp_slot *slot;
  bool first, last;
  int n, li, rc;

  if (ch == NULL || num_micro < 1) return -EINVAL;
  first = ch->vstage == 0;
  last = ch->vstage == s->plan.vstages - 1;
  if ((!last && grad_out == NULL) || (!first && grad_in == NULL)) return -EINVAL;
  slot = slot_find(s, ch, micro);
  if (slot == NULL || slot->state != SLOT_FORWARD) return -ENOENT;
  n = slot->n;
  li = ch->num_layers - 1;

  if (last) {
    /* model.c's scale for one micro-batch (1/n); 1/m after it, exact for m a power of two */
    float scale = 1.0f / (float)n / (float)num_micro;
    const struct mp_layer *ly = &s->layers[ch->first + li];
    bool slice = ly->lout < ly->out;
    int correct = 0;
    mlp_softmax_xent(slot->act[li], slot->labels, n, ly->out,
                     slice ? s->scratch_a : slot->delta[li], scale, &correct);
    if (slice) last_delta(s, ly, s->scratch_a, slot->act[li], slot->delta[li], n);
  } else {
    last_delta(s, &s->layers[ch->first + li], grad_out, slot->act[li], slot->delta[li], n);
  }

  for (int i = li; i >= 0; i--) {
    const struct mp_layer *ly = &s->layers[ch->first + i];
    const float *w = s->tensors[ly->tensor].param;
    size_t count = (size_t)n * (size_t)ly->lin;
    float *dp = i > 0 ? slot->delta[i - 1] : grad_in;

    if (i == 0 && first) break; /* the images need no gradient */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, ly->lin, ly->lout, 1.0f,
                slot->delta[i], ly->lout, w, ly->lin, 0.0f, dp, ly->lin);
    if (ly->kind == MP_COLUMN || ly->kind == MP_COLUMN_GATHER) {
      /* f: each rank holds a partial input gradient */
      rc = s->comm.allreduce(s->comm.ctx, dp, count);
      if (rc < 0) return rc;
      s->counters.tp_allreduce_bwd++;
    }
    if (i > 0) tm_relu_backward(dp, slot->act[i - 1], count);
  }
  slot->state = SLOT_INPUT_DONE;
  return 0;
}

int mp_stage_backward_weight(struct mp_stage *s, int chunk, int micro) {
  struct mp_chunk *ch = (struct mp_chunk *)chunk_at(s, chunk);
  struct mp_slot *slot;
  size_t rows;

  if (ch == NULL) return -EINVAL;
  slot = slot_find(s, ch, micro);
  if (slot == NULL || slot->state != SLOT_INPUT_DONE) return -ENOENT;
  rows = (size_t)slot->n;
  for (int i = 0; i < ch->num_layers; i++) {
    const struct mp_layer *ly = &s->layers[ch->first + i];
    struct mp_tensor *w = &s->tensors[ly->tensor], *b = w + 1;
    const float *d = slot->delta[i], *a = i > 0 ? slot->act[i - 1] : slot->x;
    size_t lout = (size_t)ly->lout;
    float *db = ch->fresh ? b->grad : s->scratch_a;

    /* column sums in model.c's order, then added to what earlier
     * micro-batches left */
    memcpy(db, d, sizeof(float) * lout);
    for (size_t r = 1; r < rows; r++) tm_add(db, d + r * lout, lout);
    if (!ch->fresh) tm_add(b->grad, db, lout);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ly->lout, ly->lin, slot->n, 1.0f, d,
                ly->lout, a, ly->lin, ch->fresh ? 0.0f : 1.0f, w->grad, ly->lin);
  }
  ch->fresh = false;
  slot->state = SLOT_FREE;
  slot->micro = -1;
  s->held--;
  s->held_bytes -= slot_held_bytes(s, ch, slot->n);
  return 0;
}

int mp_stage_backward(struct mp_stage *s, int chunk, int micro, int num_micro,
                      const float *grad_out, float *grad_in) {
  int rc = mp_stage_backward_input(s, chunk, micro, num_micro, grad_out, grad_in);
  return rc < 0 ? rc : mp_stage_backward_weight(s, chunk, micro);
}

void mp_stage_counters(const struct mp_stage *s, struct mp_counters *out) {
  *out = s->counters;
}
