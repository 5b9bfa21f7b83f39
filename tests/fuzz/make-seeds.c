/* make-seeds: writes the seed corpus of the fuzz harnesses.
 *
 *   fuzz-make-seeds DIR      (DIR = tests/fuzz/corpus; writes DIR/frame,
 *                             DIR/handshake and DIR/ckpt)
 *
 * Every seed is built with the real encoders (wire_frame_encode,
 * ckpt_write), so the corpus follows the formats as they change: rerun it
 * after a format change and commit the result. The output is deterministic
 * (fixed nonces, the checkpoint's time field zeroed), so a rerun that
 * changes nothing shows no diff. Input formats are described at the top of
 * each harness; in short:
 *   frame/      config byte, count of chunk sizes, frame stream, chunk sizes
 *   handshake/  a frame stream; proofs and tags hold the placeholders of
 *               fuzz_placeholders.h where an honest peer's would go
 *   ckpt/       flags byte, checkpoint file */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_io.h"
#include "crc32c.h"
#include "frame.h"
#include "fuzz_placeholders.h"
#include "placement.h"
#include "store.h"
#include "wire.h"

#define CAP (256u * 1024u)

static const char *out_dir;
static int written;

/* A growing byte buffer. */
struct buf {
  uint8_t b[CAP];
  size_t n;
};

static void put(struct buf *b, const void *p, size_t n) {
  if (b->n + n > CAP) {
    fprintf(stderr, "make-seeds: seed too large\n");
    exit(1);
  }
  memcpy(b->b + b->n, p, n);
  b->n += n;
}

static void save(const char *sub, const char *name, const void *p, size_t n) {
  char path[1024];
  snprintf(path, sizeof(path), "%s/%s", out_dir, sub);
  mkdir(path, 0755);
  snprintf(path, sizeof(path), "%s/%s/%s", out_dir, sub, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
    fprintf(stderr, "make-seeds: cannot write %s\n", path);
    exit(1);
  }
  written++;
}

/* ---- frames ------------------------------------------------------------ */

static uint8_t nonce_i[32], nonce_a[32], wrong[32];
static float floats[64];

/* Appends one frame: preamble, header, payload, and a tag if tag != NULL. */
static void frame(struct buf *b, const Ps__Header *h, const void *payload, size_t plen,
                  const char *tag) {
  uint8_t f[FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER];
  int n = wire_frame_encode(h, plen, f, sizeof(f));
  if (n < 0) {
    fprintf(stderr, "make-seeds: encode: %d\n", n);
    exit(1);
  }
  put(b, f, (size_t)n);
  if (plen) put(b, payload, plen);
  if (tag) put(b, tag, 16);
}

static Ps__Header plain(Ps__MsgType type) {
  Ps__Header h = PS__HEADER__INIT;
  h.type = type;
  h.request_id = 7;
  h.rank = 1;
  h.key = ((uint64_t)1 << 32) | 2;
  return h;
}

/* Every message type once, with the bodies and payloads it carries. */
enum { NTYPES = 14 };
static void one_of_each(struct buf *b, int type, const char *tag) {
  static Ps__Hello hello = PS__HELLO__INIT;
  static Ps__Auth auth = PS__AUTH__INIT;
  static Ps__Tensor t1 = PS__TENSOR__INIT, t2 = PS__TENSOR__INIT;
  static Ps__Tensor *tensors[2] = {&t1, &t2};
  static uint64_t shape1[2] = {16, 4}, shape2[1] = {10};
  static uint64_t clocks[3] = {5, 5, 4};
  static Ps__Layout layout = PS__LAYOUT__INIT;
  static Ps__Stats stats = PS__STATS__INIT;
  static Ps__Error error = PS__ERROR__INIT;
  hello.rank = 1;
  hello.world_size = 2;
  hello.job_id = "job-1";
  hello.client = "ps-worker 0.1.0";
  hello.nonce = (ProtobufCBinaryData){sizeof(nonce_i), nonce_i};
  auth.nonce = (ProtobufCBinaryData){sizeof(nonce_a), nonce_a};
  auth.proof = (ProtobufCBinaryData){32, (uint8_t *)FUZZ_PROOF_PLACEHOLDER};
  t1.name = "fc1.weight";
  t1.n_shape = 2;
  t1.shape = shape1;
  t2.name = "fc1.bias";
  t2.n_shape = 1;
  t2.shape = shape2;
  layout.n_tensors = 2;
  layout.tensors = tensors;
  layout.chunk_bytes = 64;
  layout.num_shards = 2;
  layout.hash = 0x0123456789abcdefull;
  stats.pushes = 100;
  stats.pulls = 90;
  stats.bytes_in = 1 << 20;
  stats.connected_workers = 2;
  stats.n_worker_clocks = 3;
  stats.worker_clocks = clocks;
  stats.consistency = "ssp:2";
  stats.optimizer = "adam";
  error.code = PS__ERROR_CODE__ERR_BAD_KEY;
  error.message = "key 0000000100000002 not held by this shard";

  Ps__Header h = plain((Ps__MsgType)(type + 1));
  size_t plen = 0;
  switch (h.type) {
    case PS__MSG_TYPE__MSG_HELLO:
      h.body_case = PS__HEADER__BODY_HELLO;
      h.hello = &hello;
      break;
    case PS__MSG_TYPE__MSG_AUTH:
      h.body_case = PS__HEADER__BODY_AUTH;
      h.auth = &auth;
      break;
    case PS__MSG_TYPE__MSG_LAYOUT:
      h.body_case = PS__HEADER__BODY_LAYOUT;
      h.layout = &layout;
      break;
    case PS__MSG_TYPE__MSG_INIT:
      plen = 16 * sizeof(float);
      break;
    case PS__MSG_TYPE__MSG_PUSH:
      h.step = 4;
      plen = 8 * sizeof(float);
      break;
    case PS__MSG_TYPE__MSG_PULL:
      h.version = 5;
      break;
    case PS__MSG_TYPE__MSG_PULL_REPLY:
      h.version = 5;
      plen = 16 * sizeof(float);
      break;
    case PS__MSG_TYPE__MSG_STATS:
      h.body_case = PS__HEADER__BODY_STATS;
      h.stats = &stats;
      break;
    case PS__MSG_TYPE__MSG_ERROR:
      h.body_case = PS__HEADER__BODY_ERROR;
      h.error = &error;
      break;
    case PS__MSG_TYPE__MSG_ACK:
      h.flags = 1;
      break;
    case PS__MSG_TYPE__MSG_ROLLBACK:
      h.version = 3;
      break;
    default:
      break;
  }
  frame(b, &h, floats, plen, tag);
}

/* A frame seed: config byte, size count, stream, sizes. */
static void frame_seed(const char *name, uint8_t cfg, const struct buf *stream,
                       const uint8_t *sizes, uint8_t nsizes) {
  static struct buf b;
  b.n = 0;
  put(&b, &cfg, 1);
  put(&b, &nsizes, 1);
  put(&b, stream->b, stream->n);
  if (nsizes) put(&b, sizes, nsizes);
  save("frame", name, b.b, b.n);
}

/* Config bits of fuzz_frame.c. */
#define HDR_1024 0u
#define HDR_65535 1u
#define HDR_24 2u
#define PAY_0 (0u << 2)
#define PAY_64 (1u << 2)
#define PAY_4096 (2u << 2)
#define PAY_1M (3u << 2)
#define WINDOW 0x10u
#define DISCARD 0x20u
#define RAISE 0x40u
#define SMALL_BUDGET 0x80u

static void frame_seeds(void) {
  static const char *const names[NTYPES] = {
      "hello",   "auth",  "layout", "init",     "push", "pull",      "pull_reply",
      "barrier", "stats", "error",  "shutdown", "ack",  "heartbeat", "rollback"};
  static struct buf s;
  char name[64];
  for (int t = 0; t < NTYPES; t++) {
    s.n = 0;
    one_of_each(&s, t, NULL);
    snprintf(name, sizeof(name), "type-%s", names[t]);
    frame_seed(name, HDR_65535 | PAY_1M, &s, NULL, 0);
  }
  s.n = 0;
  for (int t = 0; t < NTYPES; t++) one_of_each(&s, t, NULL);
  static const uint8_t bytewise[1] = {1}, odd[5] = {3, 7, 16, 255, 1};
  frame_seed("all-types", HDR_65535 | PAY_1M, &s, NULL, 0);
  frame_seed("all-types-bytewise", HDR_65535 | PAY_1M, &s, bytewise, 1);
  frame_seed("all-types-split", HDR_65535 | PAY_4096, &s, odd, 5);
  frame_seed("all-types-window", HDR_65535 | PAY_1M | WINDOW, &s, odd, 5);
  frame_seed("all-types-discard", HDR_65535 | PAY_1M | DISCARD | WINDOW, &s, odd, 5);
  frame_seed("all-types-small-budget", HDR_65535 | PAY_1M | SMALL_BUDGET, &s, NULL, 0);
  frame_seed("all-types-header-limit-24", HDR_24 | PAY_1M, &s, NULL, 0);

  s.n = 0; /* with tags, as on an authenticated connection */
  for (int t = 0; t < NTYPES; t++) one_of_each(&s, t, FUZZ_TAG_PLACEHOLDER);
  frame_seed("all-types-tagged", HDR_65535 | PAY_1M, &s, odd, 5);

  s.n = 0; /* the handshake limits, raised after the first frame */
  one_of_each(&s, PS__MSG_TYPE__MSG_HELLO - 1, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_PUSH - 1, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_PULL_REPLY - 1, NULL);
  frame_seed("raise-limits", HDR_1024 | PAY_0 | RAISE, &s, odd, 5);
  frame_seed("handshake-limits-payload", HDR_1024 | PAY_0, &s, NULL, 0);

  /* broken preambles and truncations */
  static struct buf one;
  one.n = 0;
  one_of_each(&one, PS__MSG_TYPE__MSG_PUSH - 1, NULL);
  struct buf *e = &s;
  e->n = 0;
  put(e, one.b, one.n);
  e->b[0] = 'Q';
  frame_seed("bad-magic", HDR_65535 | PAY_1M, e, NULL, 0);
  e->b[0] = 'P';
  e->b[4] = 2;
  frame_seed("bad-version", HDR_65535 | PAY_1M, e, NULL, 0);
  e->b[4] = 1;
  e->b[6] = e->b[7] = 0;
  frame_seed("header-len-zero", HDR_65535 | PAY_1M, e, NULL, 0);
  e->b[6] = 0xff;
  e->b[7] = 0xff;
  frame_seed("header-len-max", HDR_1024 | PAY_1M, e, NULL, 0);
  memcpy(e->b, one.b, one.n);
  frame_seed("payload-over-limit", HDR_65535 | PAY_0, e, NULL, 0);
  e->b[15] = 0x80; /* 2^63 bytes */
  frame_seed("payload-2e63", HDR_65535 | PAY_1M, e, NULL, 0);
  memcpy(e->b, one.b, one.n);
  e->n = 10;
  frame_seed("truncated-preamble", HDR_65535 | PAY_1M, e, NULL, 0);
  e->n = FRAME_PREAMBLE_BYTES + 3;
  frame_seed("truncated-header", HDR_65535 | PAY_1M, e, NULL, 0);
  e->n = one.n - 5;
  frame_seed("truncated-payload", HDR_65535 | PAY_1M, e, bytewise, 1);
  e->n = one.n;
  memset(e->b + FRAME_PREAMBLE_BYTES, 0xff, 4); /* a header that is not protobuf */
  frame_seed("garbage-header", HDR_65535 | PAY_1M, e, NULL, 0);
}

/* ---- handshake --------------------------------------------------------- */

static Ps__Header hello_h(Ps__Hello *hello, size_t nonce_len) {
  *hello = (Ps__Hello)PS__HELLO__INIT;
  hello->rank = 1;
  hello->world_size = 2;
  hello->job_id = "job-1";
  hello->client = "ps-worker 0.1.0";
  hello->nonce = (ProtobufCBinaryData){nonce_len, nonce_i};
  Ps__Header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = hello;
  return h;
}

static Ps__Header auth_h(Ps__Auth *a, size_t nonce_len, const void *proof, size_t proof_len) {
  *a = (Ps__Auth)PS__AUTH__INIT;
  a->nonce = (ProtobufCBinaryData){nonce_len, nonce_a};
  a->proof = (ProtobufCBinaryData){proof_len, (uint8_t *)proof};
  Ps__Header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_AUTH;
  h.body_case = PS__HEADER__BODY_AUTH;
  h.auth = a;
  return h;
}

static void handshake_seeds(void) {
  static struct buf s;
  Ps__Hello hello;
  Ps__Auth auth;
  Ps__Header h;
  const char *P = FUZZ_PROOF_PLACEHOLDER, *T = FUZZ_TAG_PLACEHOLDER;

  /* to an acceptor: HELLO, AUTH (the initiator's proof), then tagged frames */
  s.n = 0;
  h = hello_h(&hello, 32);
  frame(&s, &h, NULL, 0, NULL);
  h = auth_h(&auth, 0, P, 32);
  frame(&s, &h, NULL, 0, NULL);
  size_t after_auth = s.n;
  for (int t = PS__MSG_TYPE__MSG_LAYOUT; t <= PS__MSG_TYPE__MSG_SHUTDOWN; t++)
    if (t != PS__MSG_TYPE__MSG_PULL_REPLY && t != PS__MSG_TYPE__MSG_ERROR)
      one_of_each(&s, t - 1, T);
  save("handshake", "acceptor-full", s.b, s.n);
  size_t full = s.n;
  s.b[after_auth + FRAME_PREAMBLE_BYTES + 2] ^= 1; /* in the LAYOUT header: its tag fails */
  save("handshake", "acceptor-altered-frame", s.b, s.n);
  s.b[after_auth + FRAME_PREAMBLE_BYTES + 2] ^= 1;
  s.n = after_auth;
  save("handshake", "acceptor-done", s.b, s.n);
  s.n = full;
  /* a real tag in place of the placeholder: a replay from another session */
  memset(s.b + full - 16, 0x5a, 16);
  save("handshake", "acceptor-foreign-tag", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 32);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "acceptor-hello", s.b, s.n);
  h = auth_h(&auth, 0, wrong, 32);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "acceptor-wrong-proof", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 32);
  frame(&s, &h, NULL, 0, NULL);
  h = auth_h(&auth, 0, P, 31);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "acceptor-short-proof", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 32);
  frame(&s, &h, NULL, 0, NULL);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "acceptor-hello-twice", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 0);
  frame(&s, &h, NULL, 0, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_LAYOUT - 1, NULL);
  save("handshake", "hello-without-nonce", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 31);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "hello-short-nonce", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 32);
  frame(&s, &h, NULL, 0, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_PUSH - 1, NULL);
  save("handshake", "acceptor-push-instead-of-auth", s.b, s.n);

  s.n = 0;
  one_of_each(&s, PS__MSG_TYPE__MSG_PUSH - 1, NULL);
  save("handshake", "push-before-hello", s.b, s.n);

  s.n = 0;
  h = hello_h(&hello, 32);
  char long_id[1100];
  memset(long_id, 'j', sizeof(long_id) - 1);
  long_id[sizeof(long_id) - 1] = 0;
  hello.job_id = long_id;
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "hello-over-header-limit", s.b, s.n);

  /* to an initiator: AUTH (the acceptor's nonce and proof), ACK + tag, then
   * tagged replies */
  s.n = 0;
  h = auth_h(&auth, 32, P, 32);
  frame(&s, &h, NULL, 0, NULL);
  Ps__Header ack = plain(PS__MSG_TYPE__MSG_ACK);
  frame(&s, &ack, NULL, 0, T);
  size_t after_ack = s.n;
  one_of_each(&s, PS__MSG_TYPE__MSG_PULL_REPLY - 1, T);
  one_of_each(&s, PS__MSG_TYPE__MSG_STATS - 1, T);
  one_of_each(&s, PS__MSG_TYPE__MSG_ERROR - 1, T);
  one_of_each(&s, PS__MSG_TYPE__MSG_HEARTBEAT - 1, T);
  save("handshake", "initiator-full", s.b, s.n);
  s.n = after_ack;
  save("handshake", "initiator-done", s.b, s.n);
  memset(s.b + after_ack - 16, 0, 16);
  save("handshake", "initiator-ack-bad-tag", s.b, s.n);

  s.n = 0;
  h = auth_h(&auth, 32, P, 32);
  frame(&s, &h, NULL, 0, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_ERROR - 1, T);
  save("handshake", "initiator-error-instead-of-ack", s.b, s.n);

  s.n = 0;
  h = auth_h(&auth, 32, wrong, 32);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "initiator-wrong-proof", s.b, s.n);

  s.n = 0;
  h = auth_h(&auth, 16, P, 32);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "initiator-short-nonce", s.b, s.n);

  s.n = 0;
  h = auth_h(&auth, 32, NULL, 0);
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "initiator-no-proof", s.b, s.n);

  s.n = 0;
  Ps__Error err = PS__ERROR__INIT;
  err.code = PS__ERROR_CODE__ERR_AUTH;
  err.message = "authentication failed: wrong token";
  h = plain(PS__MSG_TYPE__MSG_ERROR);
  h.body_case = PS__HEADER__BODY_ERROR;
  h.error = &err;
  frame(&s, &h, NULL, 0, NULL);
  save("handshake", "initiator-error", s.b, s.n);

  s.n = 0;
  frame(&s, &ack, NULL, 0, NULL);
  one_of_each(&s, PS__MSG_TYPE__MSG_PULL_REPLY - 1, NULL);
  save("handshake", "initiator-open-ack", s.b, s.n);

  save("handshake", "empty", "", 0);
}

/* ---- checkpoints --------------------------------------------------------- */

static void serve_none(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  free(w);
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Zeroes the time field and redoes the two checksums it is under. */
static void canonical(uint8_t *f, size_t n) {
  put32(f + 56, 0);
  put32(f + 60, crc32c_update(0, f, 60));
  put32(f + n - 8, crc32c_update(0, f, n - CKPT_FOOTER_BYTES));
}

struct spec {
  const char *name;
  struct store_opts opts;
  uint32_t num_tensors;
  const char *names[3];
  uint64_t counts[3];
  uint64_t chunk_bytes;
  uint64_t steps;   /* BSP steps (or rounds of pushes) played */
  bool partial;     /* and rank 0 pushes one more */
  size_t init_keys; /* keys given initial values (0 = all) */
};

/* Builds the store of spec, plays it, and writes its checkpoint into dir.
 * Returns the file (malloc'd) and its size. */
static uint8_t *checkpoint(const char *dir, const struct spec *sp, size_t *n) {
  struct store s;
  char msg[256] = "";
  if (store_init(&s, &sp->opts, serve_none, NULL) < 0) exit(1);
  struct store_layout l = {.num_tensors = sp->num_tensors,
                           .names = (char **)sp->names,
                           .counts = (uint64_t *)sp->counts,
                           .chunk_bytes = sp->chunk_bytes,
                           .num_shards = sp->opts.num_shards};
  l.hash = placement_layout_hash(sp->names, sp->counts, l.num_tensors, l.chunk_bytes, l.num_shards);
  if (store_set_layout(&s, &l, msg, sizeof(msg)) < 0) {
    fprintf(stderr, "make-seeds: %s: layout: %s\n", sp->name, msg);
    exit(1);
  }
  size_t init = sp->init_keys ? sp->init_keys : s.num_keys;
  for (size_t i = 0; i < s.num_keys && i < init; i++) {
    struct store_key *k = &s.keys[i];
    float *v = malloc(k->count * sizeof(float));
    for (uint64_t j = 0; j < k->count; j++) v[j] = (float)((k->key * 31 + j) % 97) / 97.0f;
    store_init_key(&s, k, v);
    free(v);
  }
  for (size_t i = 0; i < s.num_keys && i < init; i++) {
    struct store_key *k = &s.keys[i];
    float *g = malloc(k->count * sizeof(float));
    for (uint64_t step = 0; step < sp->steps + (sp->partial ? 1 : 0); step++) {
      for (uint32_t r = 0; r < sp->opts.num_workers; r++) {
        if (step == sp->steps && r > 0) break;
        for (uint64_t j = 0; j < k->count; j++)
          g[j] = (float)(((j + 1) * (step + 3) * (r + 1)) % 13) / 13.0f - 0.5f;
        if (store_push(&s, k, r, step, STORE_NO_BASE, g, msg, sizeof(msg)) < 0) {
          fprintf(stderr, "make-seeds: %s: push: %s\n", sp->name, msg);
          exit(1);
        }
      }
    }
    free(g);
  }
  struct ckpt_snapshot *snap = ckpt_snapshot_take(&s);
  struct ckpt_io *io = NULL;
  struct ckpt_write_result res;
  if (!snap || ckpt_io_open(CKPT_IO_SYNC, &io) < 0 ||
      ckpt_write(io, dir, snap, &res, msg, sizeof(msg)) < 0) {
    fprintf(stderr, "make-seeds: %s: write: %s\n", sp->name, msg);
    exit(1);
  }
  ckpt_io_close(io);
  ckpt_snapshot_free(snap);
  store_deinit(&s);
  FILE *f = fopen(res.path, "rb");
  uint8_t *b = malloc(res.bytes + 1);
  if (!f || !b || fread(b + 1, 1, res.bytes, f) != res.bytes) exit(1);
  fclose(f);
  unlink(res.path);
  *n = res.bytes;
  canonical(b + 1, *n);
  return b; /* b[0] is left for the flags byte */
}

static void ckpt_seed(const char *name, uint8_t flags, uint8_t *b, size_t n) {
  b[0] = flags;
  save("ckpt", name, b, n + 1);
}

static void ckpt_seeds(void) {
  char dir[] = "/tmp/fuzz-make-seeds.XXXXXX";
  if (!mkdtemp(dir)) exit(1);
  const struct opt_params momentum = {.kind = OPT_MOMENTUM, .lr = 0.05, .momentum = 0.9};
  const struct opt_params adam = {
      .kind = OPT_ADAM, .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  const struct opt_params sgd = {.kind = OPT_SGD, .lr = 0.1};
  const struct opt_params sum = {.kind = OPT_SUM};
  /* the harness's default store: shard 0 of 1, 2 workers, momentum, BSP */
  const struct store_opts fixture = {
      .shard = 0, .num_shards = 1, .num_workers = 2, .consistency = STORE_BSP, .opt = momentum};
  const struct spec specs[] = {
      {"fixture",
       fixture,
       3,
       {"fc1.weight", "fc1.bias", "fc2.weight"},
       {3000, 10, 1500},
       4096,
       3,
       false,
       0},
      {"small", fixture, 1, {"w"}, {5}, 8, 2, false, 0},
      {"small-unfinished-step", fixture, 2, {"w", "b"}, {6, 2}, 8, 2, true, 0},
      {"small-some-keys", fixture, 2, {"w", "b"}, {6, 2}, 8, 1, false, 2},
      {"small-fresh", fixture, 1, {"w"}, {3}, 4096, 0, false, 0},
      {"adam-asp-shard1of2",
       {.shard = 1, .num_shards = 2, .num_workers = 3, .consistency = STORE_ASP, .opt = adam},
       2,
       {"emb", "out"},
       {12, 4},
       16,
       2,
       false,
       0},
      {"sgd-ssp2",
       {.shard = 0,
        .num_shards = 1,
        .num_workers = 2,
        .consistency = STORE_SSP,
        .staleness = 2,
        .opt = sgd},
       1,
       {"w"},
       {7},
       12,
       2,
       false,
       0},
      {"sum-bsp",
       {.shard = 0, .num_shards = 1, .num_workers = 2, .consistency = STORE_BSP, .opt = sum},
       1,
       {"w"},
       {4},
       8,
       1,
       false,
       0},
  };
  uint8_t *small = NULL;
  size_t small_n = 0;
  for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
    const struct spec *sp = &specs[i];
    size_t n;
    uint8_t *b = checkpoint(dir, sp, &n);
    char name[128];
    bool fixture_opts = sp->opts.opt.kind == OPT_MOMENTUM && sp->opts.num_workers == 2 &&
                        sp->opts.num_shards == 1 && sp->opts.consistency == STORE_BSP;
    /* valid as is; for other options, with the store taken from the header */
    ckpt_seed(sp->name, fixture_opts ? 0 : 2, b, n);
    snprintf(name, sizeof(name), "%s-fixup", sp->name);
    ckpt_seed(name, fixture_opts ? 1 : 3, b, n);
    if (strcmp(sp->name, "small") == 0) {
      small = b;
      small_n = n;
      continue;
    }
    free(b);
  }
  /* edges of the small one: loaded by clock, truncated, flipped, no records */
  ckpt_seed("small-by-clock", 4, small, small_n);
  ckpt_seed("small-header-only", 0, small, CKPT_HEADER_BYTES);
  ckpt_seed("small-truncated", 0, small, small_n / 2);
  ckpt_seed("small-truncated-fixup", 1, small, small_n - 10);
  small[1 + CKPT_HEADER_BYTES + CKPT_RECORD_HEADER_BYTES + 20] ^= 0x10;
  ckpt_seed("small-flipped", 0, small, small_n);
  ckpt_seed("small-flipped-fixup", 1, small, small_n);
  small[1 + CKPT_HEADER_BYTES + CKPT_RECORD_HEADER_BYTES + 20] ^= 0x10;
  uint32_t records = get32(small + 1 + 40);
  put32(small + 1 + 40, records + 1);
  ckpt_seed("small-extra-record-fixup", 1, small, small_n);
  put32(small + 1 + 40, records);
  /* header + footer, no records */
  uint8_t empty[1 + CKPT_HEADER_BYTES + CKPT_FOOTER_BYTES];
  memcpy(empty + 1, small + 1, CKPT_HEADER_BYTES);
  put32(empty + 1 + 40, 0);
  memcpy(empty + 1 + CKPT_HEADER_BYTES, small + 1 + small_n - CKPT_FOOTER_BYTES, CKPT_FOOTER_BYTES);
  ckpt_seed("no-records-fixup", 1, empty, sizeof(empty) - 1);
  ckpt_seed("empty", 0, empty, 0);
  free(small);
  rmdir(dir);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  mkdir(out_dir, 0755);
  for (size_t i = 0; i < sizeof(nonce_i); i++) {
    nonce_i[i] = (uint8_t)(0x11 + i);
    nonce_a[i] = (uint8_t)(0xa0 + i);
    wrong[i] = (uint8_t)(0x5a ^ i);
  }
  for (size_t i = 0; i < sizeof(floats) / sizeof(floats[0]); i++) floats[i] = (float)i * 0.25f;
  frame_seeds();
  handshake_seeds();
  ckpt_seeds();
  printf("%d seeds in %s\n", written, out_dir);
  return 0;
}
