/* Send and receive between two ranks (ps_coll_send / ps_coll_recv /
 * ps_coll_sendrecv, p2p.c) in W = 2..4 real processes on 127.0.0.1, with
 * and without a token, each message checked byte for byte against the
 * pattern its sender wrote:
 *  - every ordered pair in turn (the others go on, so messages also wait in
 *    the receiver's queue), sizes 0, 1, odd ones and ones far larger than a
 *    socket buffer;
 *  - several messages of different lengths from one rank to another,
 *    received in the order sent;
 *  - every rank sending 6 MiB to its successor while receiving from its
 *    predecessor, once with ps_coll_sendrecv and once as a blocking send
 *    then a blocking receive on every rank at once (which deadlocks on full
 *    socket buffers unless the sender takes in what arrives meanwhile);
 *  - everything queued asynchronously between collectives, then waited;
 *  - all-to-all, which goes pairwise over these connections;
 *  - bad calls: this rank or one out of range (PS_ERR_INVALID), a group
 *    opened without p2p (PS_ERR_STATE).
 * Then the failure semantics of the collectives: a receive of another
 * length than was sent fails with PS_ERR_STATE naming both lengths, and a
 * rank that dies while others send to it or wait for it makes every other
 * rank fail in bounded time with PS_ERR_IO naming it. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "coll_child.h"
#include "collective.h"
#include "harness.h"
#include "ring_workers.h"

#define MAX_W 12
enum scenario { GOOD, NO_P2P, MISMATCH, DIES, MANY };

struct scene {
  enum scenario scenario;
  const ps_token *token;
};

struct child_arg {
  struct ring_ports *g;
  int rank, result_fd;
};

/* Byte i of message k from rank s to rank d. */
static unsigned char pat(int s, int d, int k, size_t i) {
  return (unsigned char)(i * 13 + (size_t)s * 37 + (size_t)d * 59 + (size_t)k * 101 + 7);
}
static void fill(unsigned char *b, size_t n, int s, int d, int k) {
  for (size_t i = 0; i < n; i++) b[i] = pat(s, d, k, i);
}
/* The first byte that differs, or -1. */
static long check(const unsigned char *b, size_t n, int s, int d, int k) {
  for (size_t i = 0; i < n; i++)
    if (b[i] != pat(s, d, k, i)) return (long)i;
  return -1;
}

#define EXPECT COLL_EXPECT
#define OK COLL_OK

enum { BIG = 6 << 20 };
static unsigned char sbuf[BIG + 1], rbuf[BIG + 1];

static int script(struct child_arg *a, ps_coll *c) {
  const int W = a->g->world, r = a->rank;
  char msg[512];
  size_t sizes[] = {0, 1, 3, 70001, 3u * 1024 * 1024 + 5};
  int nsizes = (int)(sizeof(sizes) / sizeof(sizes[0]));
  for (int s = 0; s < W; s++)
    for (int d = 0; d < W; d++)
      for (int k = 0; k < nsizes && s != d; k++) {
        size_t n = sizes[k];
        if (r == s) {
          fill(sbuf, n, s, d, k);
          OK(ps_coll_send(c, sbuf, n, d), "send of %zu bytes to %d", n, d);
        } else if (r == d) {
          memset(rbuf, 0xee, n + 1);
          OK(ps_coll_recv(c, rbuf, n, s), "recv of %zu bytes from %d", n, s);
          long bad = check(rbuf, n, s, d, k);
          EXPECT(bad < 0, "message %d (%zu bytes) from %d: byte %ld differs", k, n, s, bad);
          EXPECT(rbuf[n] == 0xee, "recv of %zu bytes wrote past its end", n);
        }
      }

  /* Several messages in a row, received in order. */
  size_t seq[] = {5, 0, 100000, 17, 2000000};
  int to = (r + 1) % W, from = (r + W - 1) % W;
  static unsigned char many[5][2000000];
  ps_coll_request *sent[5];
  for (int k = 0; k < 5; k++) {
    fill(many[k], seq[k], r, to, 20 + k);
    OK(ps_coll_send_async(c, many[k], seq[k], to, &sent[k]), "%s", "queue");
  }
  for (int k = 0; k < 5; k++) { /* behind the sends, on the same thread */
    OK(ps_coll_recv(c, rbuf, seq[k], from), "message %d in order", k);
    EXPECT(check(rbuf, seq[k], from, r, 20 + k) < 0, "message %d from %d", k, from);
  }
  for (int k = 0; k < 5; k++) OK(ps_coll_wait(sent[k]), "send %d", k);

  /* A shift around the ring, all at once: sendrecv, then send before recv. */
  for (int way = 0; way < 2; way++) {
    fill(sbuf, BIG, r, to, 30 + way);
    memset(rbuf, 0, BIG);
    if (way == 0) {
      OK(ps_coll_sendrecv(c, sbuf, BIG, to, rbuf, BIG, from), "%s", "sendrecv shift");
    } else {
      OK(ps_coll_send(c, sbuf, BIG, to), "%s", "send of the shift");
      OK(ps_coll_recv(c, rbuf, BIG, from), "%s", "recv of the shift");
    }
    long bad = check(rbuf, BIG, from, r, 30 + way);
    EXPECT(bad < 0, "shift %d: byte %ld from %d differs", way, bad, from);
  }

  /* Queued between collectives: to everyone, from everyone. */
  static unsigned char out[MAX_W][4099], in[MAX_W][4099];
  float sum = (float)r;
  ps_coll_request *q[2 * MAX_W + 2];
  int nq = 0;
  OK(ps_coll_allreduce_async(c, &sum, 1, PS_REDOP_SUM, &q[nq++]), "%s", "queue");
  for (int d = 0; d < W; d++)
    if (d != r) {
      fill(out[d], sizeof(out[d]), r, d, 40);
      OK(ps_coll_send_async(c, out[d], sizeof(out[d]), d, &q[nq++]), "%s", "queue");
    }
  for (int s = 0; s < W; s++)
    if (s != r) OK(ps_coll_recv_async(c, in[s], sizeof(in[s]), s, &q[nq++]), "%s", "queue");
  OK(ps_coll_barrier(c), "%s", "barrier behind the queue");
  for (int k = 0; k < nq; k++) OK(ps_coll_wait(q[k]), "queued operation %d", k);
  EXPECT(sum == (float)(W * (W - 1) / 2), "queued allreduce: %g", (double)sum);
  for (int s = 0; s < W; s++)
    EXPECT(s == r || check(in[s], sizeof(in[s]), s, r, 40) < 0, "queued message from %d", s);

  /* All-to-all on a group with p2p: pairwise from 128 KiB blocks (or at W =
   * 2), around the ring below; every block where it belongs either way. */
  static unsigned char a2a_in[MAX_W * 131072], a2a_out[MAX_W * 131072];
  size_t asizes[] = {0, 1, 5, 70001, 131071, 131072};
  for (size_t k = 0; k < sizeof(asizes) / sizeof(asizes[0]); k++) {
    size_t n = asizes[k];
    for (int d = 0; d < W; d++) fill(a2a_in + (size_t)d * n, n, r, d, 60);
    memset(a2a_out, 0xee, (size_t)W * n);
    OK(ps_coll_alltoall(c, a2a_in, a2a_out, n), "alltoall of %zu bytes", n);
    for (int s = 0; s < W; s++)
      EXPECT(check(a2a_out + (size_t)s * n, n, s, r, 60) < 0, "alltoall %zu: block from %d", n, s);
  }

  /* Bad calls are refused before anything is sent. */
  EXPECT(ps_coll_send(c, sbuf, 1, r) == PS_ERR_INVALID, "%s", "send to itself");
  EXPECT(ps_coll_recv(c, rbuf, 1, W) == PS_ERR_INVALID, "%s", "recv from rank W");
  EXPECT(ps_coll_send(c, NULL, 1, to) == PS_ERR_INVALID, "%s", "send of NULL");
  EXPECT(ps_coll_sendrecv(c, sbuf, 1, -2, rbuf, 1, from) == PS_ERR_INVALID, "%s", "sendrecv -2");
  OK(ps_coll_barrier(c), "%s", "barrier at the end");
  return 0;
}

/* DIES (W = 3): rank 0 sends rank 2 large messages, rank 1 waits for one
 * from rank 2, which takes a few and dies. "<status> <lost> <message>". */
static int dies(struct child_arg *a, ps_coll *c) {
  ps_status st = PS_OK;
  if (a->rank == 2) {
    for (int k = 0; k < 3; k++) ps_coll_recv(c, rbuf, BIG, 0);
    _exit(3); /* as kill -9: its sockets close */
  }
  for (int k = 0; k < 200 && st == PS_OK; k++)
    st = a->rank == 0 ? ps_coll_send(c, sbuf, BIG, 2) : ps_coll_recv(c, rbuf, 10, 2);
  coll_child_report(c, st, a->result_fd);
  return 0;
}

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {g, rank, fd}, *a = &arg;
  struct ps_coll_opts o = coll_child_opts(g, rank, "p2p", sc->token);
  o.p2p = sc->scenario != NO_P2P;
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  char err[512];
  ps_status st;
  int ret = 0;
  if (sc->scenario == NO_P2P) {
    st = ps_coll_send(c, sbuf, 1, (rank + 1) % g->world);
    dprintf(fd, "%d", (int)st);
  } else if (sc->scenario == MISMATCH) {
    st = rank == 0 ? ps_coll_send(c, sbuf, 100, 1) : ps_coll_recv(c, rbuf, 200, 0);
    if (st == PS_OK) st = ps_coll_barrier(c);
    dprintf(fd, "%d %s", (int)st, ps_coll_errmsg(c, err, sizeof(err)));
  } else if (sc->scenario == DIES) {
    ret = dies(a, c);
  } else if (sc->scenario == MANY) { /* a shift and an exchange with the farthest rank */
    int W = g->world, to = (rank + 1) % W, from = (rank + W - 1) % W, far = (rank + W / 2) % W;
    char msg[512];
    fill(sbuf, 1000, rank, to, 50);
    OK(ps_coll_sendrecv(c, sbuf, 1000, to, rbuf, 1000, from), "%s", "shift");
    EXPECT(check(rbuf, 1000, from, rank, 50) < 0, "shift from %d", from);
    fill(sbuf, 77, rank, far, 51);
    OK(ps_coll_sendrecv(c, sbuf, 77, far, rbuf, 77, far), "%s", "exchange");
    EXPECT(check(rbuf, 77, far, rank, 51) < 0, "exchange with %d", far);
    OK(ps_coll_barrier(c), "%s", "barrier");
  } else {
    ret = script(a, c);
  }
  ps_coll_close(c);
  return ret;
}

int main(void) {
  harness_dir();
  char out[MAX_W][700];
  int status[MAX_W];
  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_p2p's token of the whole job", 33, &token) == PS_OK, "token");
  for (int world = 2; world <= 4; world++)
    for (int v = 0; v < 2; v++) {
      double t0 = clock_now_s();
      struct scene sc = {GOOD, v ? token : NULL};
      ring_children_run(world, child, &sc, 90000, out[0], sizeof(out[0]), status);
      for (int r = 0; r < world; r++)
        REQUIRE(ring_exited(status[r], 0), "W=%d%s: rank %d failed (status %d): %s", world,
                v ? " with a token" : "", r, status[r], out[r]);
      printf("W=%d %-13s every message as sent, in %.2f s\n", world, v ? "with a token" : "",
             clock_now_s() - t0);
    }

  /* A group large enough that rank 0 takes more connections at once than
   * the rendezvous's flood allowance alone (16). */
  double t1 = clock_now_s();
  struct scene sc = {MANY, token};
  ring_children_run(12, child, &sc, 60000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 12; r++)
    REQUIRE(ring_exited(status[r], 0), "W=12: rank %d failed (status %d): %s", r, status[r],
            out[r]);
  printf("W=12 with a token: every pair connected, shift and exchange as sent, in %.2f s\n",
         clock_now_s() - t1);

  sc = (struct scene){NO_P2P, NULL};
  ring_children_run(2, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 2; r++)
    REQUIRE(ring_exited(status[r], 0) && atoi(out[r]) == PS_ERR_STATE,
            "without p2p, send should be PS_ERR_STATE: rank %d: %s", r, out[r]);

  double t0 = clock_now_s();
  sc = (struct scene){MISMATCH, token};
  ring_children_run(2, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 2; r++) {
    int st = -1;
    REQUIRE(ring_exited(status[r], 0) && sscanf(out[r], "%d", &st) == 1 && st != PS_OK,
            "mismatch: rank %d (status %d): %s", r, status[r], out[r]);
  }
  REQUIRE(atoi(out[1]) == PS_ERR_STATE && strstr(out[1], "ranks disagree") &&
              strstr(out[1], "sent 100 bytes") && strstr(out[1], "receive 200"),
          "rank 1 should name both lengths: %s", out[1]);
  REQUIRE(clock_now_s() - t0 < 10, "mismatch took %.1f s", clock_now_s() - t0);
  printf("mismatch: %s\n", out[1]);

  t0 = clock_now_s();
  sc = (struct scene){DIES, token};
  ring_children_run(3, child, &sc, 30000, out[0], sizeof(out[0]), status);
  coll_expect_lost("sending and receiving", 3, 2, out[0], sizeof(out[0]), status, t0);
  ps_token_free(token);
  return harness_status();
}
