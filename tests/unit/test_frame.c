/* Frame decoder: every split point, every limit, random garbage, and the
 * header codec under its decode budget. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "wire.h"
#include "check.h"

static const struct frame_limits lim = {FRAME_MAX_HEADER, 1 << 20};

/* Builds two frames back to back: a push with a payload, then a stats. */
static size_t build_stream(uint8_t *buf, size_t cap, const uint8_t *payload, size_t plen) {
  Ps__Header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PUSH;
  h.key = 42;
  h.step = 7;
  h.rank = 3;
  int n = wire_frame_encode(&h, plen, buf, cap);
  memcpy(buf + n, payload, plen);
  size_t off = (size_t)n + plen;
  Ps__Header s = PS__HEADER__INIT;
  s.type = PS__MSG_TYPE__MSG_STATS;
  s.request_id = 99;
  off += (size_t)wire_frame_encode(&s, 0, buf + off, cap - off);
  return off;
}

/* Feeds buf in pieces cut at a and b; checks both frames decode exactly. */
static void decode_split(const uint8_t *buf, size_t len, size_t a, size_t b, const uint8_t *payload,
                         size_t plen) {
  struct frame_decoder d;
  struct wire_arena arena;
  frame_decoder_init(&d, &lim);
  wire_arena_init(&arena, WIRE_DEFAULT_BUDGET);
  uint8_t *dst = malloc(plen + 1);
  size_t cuts[4] = {0, a, b, len};
  int frames = 0;
  for (int piece = 0; piece < 3; piece++) {
    const uint8_t *p = buf + cuts[piece];
    size_t n = cuts[piece + 1] - cuts[piece], off = 0;
    while (off < n || d.state == FD_DONE) {
      if (d.state == FD_DONE) {
        frames++;
        frame_decoder_reset(&d);
        continue;
      }
      size_t used;
      int r = frame_decoder_feed(&d, p + off, n - off, &used);
      off += used;
      CHECK(r >= 0, "feed error %d at split %zu/%zu", r, a, b);
      if (r < 0) goto out;
      if (r == FRAME_HEADER) {
        Ps__Header *h;
        CHECK(wire_header_unpack(&arena, frame_decoder_header(&d), frame_decoder_header_len(&d),
                                 &h) == 0,
              "unpack");
        if (frames == 0) {
          CHECK(h->type == PS__MSG_TYPE__MSG_PUSH && h->key == 42 && h->step == 7 && h->rank == 3,
                "first header fields");
          CHECK(frame_decoder_payload_len(&d) == plen, "payload len");
          frame_decoder_set_payload(&d, dst);
        } else {
          CHECK(h->type == PS__MSG_TYPE__MSG_STATS && h->request_id == 99, "second header");
          CHECK(frame_decoder_set_payload(&d, NULL) == FRAME_DONE, "empty payload completes");
        }
      }
    }
  }
  if (d.state == FD_DONE) frames++;
  CHECK(frames == 2, "split %zu/%zu: %d frames", a, b, frames);
  CHECK(memcmp(dst, payload, plen) == 0, "payload bytes differ at split %zu/%zu", a, b);
out:
  free(dst);
  frame_decoder_deinit(&d);
  wire_arena_deinit(&arena);
}

static int feed_error(const uint8_t *buf, size_t len, const struct frame_limits *l) {
  struct frame_decoder d;
  frame_decoder_init(&d, l);
  size_t used;
  int r = frame_decoder_feed(&d, buf, len, &used);
  frame_decoder_deinit(&d);
  return r;
}

int main(void) {
  uint8_t payload[300], buf[1024];
  for (size_t i = 0; i < sizeof(payload); i++) payload[i] = (uint8_t)(i * 7 + 1);
  size_t len = build_stream(buf, sizeof(buf), payload, 37);
  /* every pair of split points */
  for (size_t a = 0; a <= len; a++)
    for (size_t b = a; b <= len; b++) decode_split(buf, len, a, b, payload, 37);

  /* the payload window: a socket reader writes the payload itself */
  {
    struct frame_decoder d;
    frame_decoder_init(&d, &lim);
    Ps__Header h = PS__HEADER__INIT;
    h.type = PS__MSG_TYPE__MSG_PULL_REPLY;
    int n = wire_frame_encode(&h, 300, buf, sizeof(buf));
    size_t used;
    CHECK(frame_decoder_feed(&d, buf, (size_t)n, &used) == FRAME_HEADER && used == (size_t)n,
          "hdr");
    uint8_t dst[300], *w;
    frame_decoder_set_payload(&d, dst);
    CHECK(frame_decoder_payload_window(&d, &w) == 300 && w == dst, "window");
    memcpy(w, payload, 100);
    CHECK(frame_decoder_advance(&d, 100) == FRAME_NEED_MORE, "advance 100");
    CHECK(frame_decoder_payload_window(&d, &w) == 200 && w == dst + 100, "window 2");
    CHECK(frame_decoder_advance(&d, 201) == FRAME_ESTATE, "overrun refused");
    memcpy(w, payload + 100, 200);
    CHECK(frame_decoder_advance(&d, 200) == FRAME_DONE, "done");
    CHECK(memcmp(dst, payload, 300) == 0, "window bytes");
    frame_decoder_deinit(&d);
  }

  /* limits are checked on the preamble, before any byte of body */
  uint8_t pre[FRAME_PREAMBLE_BYTES];
  frame_preamble_encode(pre, 10, (1 << 20) + 1);
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_EPAYLOAD, "payload limit + 1");
  frame_preamble_encode(pre, 10, 1 << 20);
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_NEED_MORE, "payload at the limit accepted");
  frame_preamble_encode(pre, 10, UINT64_MAX);
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_EPAYLOAD, "payload 2^64-1");
  frame_preamble_encode(pre, 0, 0);
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_EHEADER, "header 0");
  struct frame_limits small = {64, 100};
  frame_preamble_encode(pre, 65, 0);
  CHECK(feed_error(pre, sizeof(pre), &small) == FRAME_EHEADER, "header over a small cap");
  frame_preamble_encode(pre, 64, 0);
  CHECK(feed_error(pre, sizeof(pre), &small) == FRAME_NEED_MORE, "header at the cap");
  frame_preamble_encode(pre, 10, 0);
  pre[4] = 2;
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_EVERSION, "version");
  pre[0] ^= 1;
  CHECK(feed_error(pre, sizeof(pre), &lim) == FRAME_EMAGIC, "magic");
  CHECK(strstr(frame_strerror(FRAME_EPAYLOAD), "max-frame-bytes") != NULL, "strerror");

  /* random garbage: always an error within the first preamble, never a crash */
  srand(7);
  for (int i = 0; i < 10000; i++) {
    uint8_t g[64];
    for (size_t j = 0; j < sizeof(g); j++) g[j] = (uint8_t)rand();
    int r = feed_error(g, sizeof(g), &lim);
    CHECK(r == FRAME_EMAGIC, "garbage gave %d", r);
  }
  /* garbage after a valid preamble: header decode fails or yields some header, never crashes */
  struct wire_arena arena;
  wire_arena_init(&arena, 4096);
  int bad = 0;
  for (int i = 0; i < 10000; i++) {
    uint8_t g[200];
    for (size_t j = 0; j < sizeof(g); j++) g[j] = (uint8_t)rand();
    Ps__Header *h;
    bad += wire_header_unpack(&arena, g, 1 + (size_t)(rand() % 200), &h) < 0;
  }
  CHECK(bad > 9000, "only %d of 10000 random headers rejected", bad);

  /* decode budget: 2000 empty repeated tensors need more arena than 4 KiB */
  {
    static uint8_t big[FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER];
    Ps__Header h = PS__HEADER__INIT;
    Ps__Layout l = PS__LAYOUT__INIT;
    static Ps__Tensor t[2000];
    static Ps__Tensor *tp[2000];
    for (int i = 0; i < 2000; i++) {
      ps__tensor__init(&t[i]);
      tp[i] = &t[i];
    }
    l.n_tensors = 2000;
    l.tensors = tp;
    h.type = PS__MSG_TYPE__MSG_LAYOUT;
    h.body_case = PS__HEADER__BODY_LAYOUT;
    h.layout = &l;
    int n = wire_frame_encode(&h, 0, big, sizeof(big));
    CHECK(n > 0 && n < 10000, "encoded %d bytes", n);
    Ps__Header *out;
    CHECK(wire_header_unpack(&arena, big + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES,
                             &out) == -ENOMEM,
          "a %d-byte header that expands past the 4 KiB budget must fail with -ENOMEM", n);
    struct wire_arena roomy;
    wire_arena_init(&roomy, WIRE_DEFAULT_BUDGET);
    CHECK(wire_header_unpack(&roomy, big + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES,
                             &out) == 0 &&
              out->layout->n_tensors == 2000,
          "the same header fits the default budget");
    wire_arena_deinit(&roomy);
  }
  wire_arena_deinit(&arena);
  if (failures)
    fprintf(stderr, "%d failures\n", failures);
  else
    printf("frame: all split points of a %zu-byte stream, limits, garbage, budget: ok\n", len);
  return failures ? 1 : 0;
}
