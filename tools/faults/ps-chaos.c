/* ps-chaos: a TCP fault proxy for tests and drills (issue 18). It listens on
 * --listen, forwards every connection to --target, and does to the bytes
 * what it is told, per direction (up = client -> target, down = back):
 *
 *   delay DIR MS [JITTER_MS]  each byte leaves MS (+ up to JITTER_MS) after it
 *                             came, order kept
 *   rate DIR BYTES_PER_S      at most that many bytes a second (0 = no limit)
 *   stall DIR SECONDS         nothing leaves in that direction meanwhile
 *   partition SECONDS         black-holed both ways: nothing leaves, a new
 *                             connection is not passed on, a close is not
 *                             seen; then healed and everything held flows
 *                             (as TCP delivers what it retransmits)
 *   reset                     every connection is cut now, both sides by RST
 *   reset-every MS SECONDS    a reset every MS for SECONDS (a reset storm)
 *   heal                      ends a partition, stalls and a storm
 *   clear                     heal, and no delay and no rate limit
 *   stats                     "conns= accepted= resets= up_bytes= down_bytes=
 *                             delayed_bytes= partitioned=0|1" (bytes given a
 *                             delay; whether a partition holds now), what
 *                             tests wait on instead of timing the fault
 * with DIR up, down or both. Commands come one per line on the control
 * address (--control), each answered by one line, "ok ..." or "error: why";
 * --schedule "SECONDS:COMMAND;..." runs them at those times after start.
 * --port-file gets the two bound addresses, data then control, one a line.
 * The kernel here has no netem: this is what the fault tests use instead. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "config.h"
#include "net.h"

#define MAX_CONNS 256
#define READ_BYTES 65536
#define QUEUE_CAP (8u << 20) /* bytes held per direction before reading stops */
#define MAX_SCHEDULE 64

struct chunk {
  struct chunk *next;
  uint64_t due;
  size_t len, off;
  uint8_t data[];
};

struct dir {
  struct chunk *head, *tail;
  size_t queued;
  bool eof, shut; /* the source closed; its close was passed on */
  uint64_t last_due;
};

struct pconn {
  int cfd, tfd;
  bool connected; /* to the target */
  struct dir up, down;
};

struct shaping {
  uint64_t delay_ns, jitter_ns, rate; /* rate: bytes/s, 0 = none */
  uint64_t stall_until;
  double tokens;
  uint64_t refilled;
};

static struct {
  struct net_addr target;
  struct pconn *c[MAX_CONNS];
  int n;
  struct shaping sh[2]; /* 0 up, 1 down */
  uint64_t partition_until, storm_period, storm_until, next_reset;
  uint64_t accepted, resets, bytes[2], delayed;
  struct {
    uint64_t at;
    char cmd[128];
  } sched[MAX_SCHEDULE];
  int nsched;
} px;

static volatile sig_atomic_t stop;
static void on_signal(int sig) {
  (void)sig;
  stop = 1;
}

static bool partitioned(uint64_t now) {
  return now < px.partition_until;
}

static bool held(int d, uint64_t now) {
  return partitioned(now) || now < px.sh[d].stall_until;
}

static void rst_close(int fd) {
  if (fd < 0) return;
  struct linger l = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

static void dir_free(struct dir *d) {
  for (struct chunk *c = d->head, *n; c; c = n) {
    n = c->next;
    free(c);
  }
  d->head = d->tail = NULL;
  d->queued = 0;
}

static void conn_drop(int i, bool rst) {
  struct pconn *c = px.c[i];
  if (rst) {
    rst_close(c->cfd);
    rst_close(c->tfd);
  } else {
    close(c->cfd);
    if (c->tfd >= 0) close(c->tfd);
  }
  dir_free(&c->up);
  dir_free(&c->down);
  free(c);
  px.c[i] = px.c[--px.n];
}

static void reset_all(void) {
  while (px.n) conn_drop(px.n - 1, true);
  px.resets++;
}

/* Connects c to the target; false if it refused (the client then gets a
 * reset, as from a dead host's port). */
static bool start_connect(struct pconn *c) {
  char err[128];
  struct net_backoff once = {0, 0, 0};
  c->tfd = net_connect(&px.target, &once, err, sizeof(err));
  if (c->tfd < 0) return false;
  net_set_nonblocking(c->tfd, 1);
  c->connected = true;
  return true;
}

static uint64_t rand_below(uint64_t n) {
  return n ? (uint64_t)random() % n : 0;
}

/* Reads what from has into d's queue. Returns false when the connection
 * must go (an error). */
static bool fill(int from, struct dir *d, int which, uint64_t now) {
  static uint8_t buf[READ_BYTES];
  ssize_t r = read(from, buf, sizeof(buf));
  if (r == 0) {
    d->eof = true;
    return true;
  }
  if (r < 0) return errno == EAGAIN || errno == EINTR;
  struct chunk *ch = malloc(sizeof(*ch) + (size_t)r);
  if (!ch) return false;
  const struct shaping *s = &px.sh[which];
  uint64_t due = now + s->delay_ns + rand_below(s->jitter_ns);
  if (due < d->last_due) due = d->last_due; /* order kept */
  if (due > now) px.delayed += (uint64_t)r;
  d->last_due = due;
  *ch = (struct chunk){NULL, due, (size_t)r, 0};
  memcpy(ch->data, buf, (size_t)r);
  if (d->tail)
    d->tail->next = ch;
  else
    d->head = ch;
  d->tail = ch;
  d->queued += (size_t)r;
  return true;
}

/* Writes what is due from d to `to` within the rate. False: drop the conn. */
static bool drain(int to, struct dir *d, int which, uint64_t now) {
  struct shaping *s = &px.sh[which];
  while (d->head && d->head->due <= now && !held(which, now)) {
    struct chunk *ch = d->head;
    size_t n = ch->len - ch->off;
    if (s->rate) {
      double cap = s->rate / 50.0 > 16384 ? s->rate / 50.0 : 16384; /* burst: 20 ms */
      s->tokens += (double)(now - s->refilled) * (double)s->rate / 1e9;
      if (s->tokens > cap) s->tokens = cap;
      s->refilled = now;
      if (s->tokens < 1) return true;
      if ((double)n > s->tokens) n = (size_t)s->tokens;
    }
    ssize_t w = write(to, ch->data + ch->off, n);
    if (w < 0) return errno == EAGAIN || errno == EINTR;
    if (s->rate) s->tokens -= (double)w;
    px.bytes[which] += (uint64_t)w;
    ch->off += (size_t)w;
    d->queued -= (size_t)w;
    if (ch->off < ch->len) return true;
    d->head = ch->next;
    if (!d->head) d->tail = NULL;
    free(ch);
  }
  if (d->eof && !d->head && !d->shut && !held(which, now)) {
    shutdown(to, SHUT_WR);
    d->shut = true;
  }
  return true;
}

static int parse_dir(const char *s) {
  if (!strcmp(s, "up")) return 1;
  if (!strcmp(s, "down")) return 2;
  if (!strcmp(s, "both")) return 3;
  return 0;
}

/* Runs one command; writes the answer line (no newline) into out. */
static void command(const char *line, char *out, size_t len) {
  char verb[32] = "", a[32] = "", b[32] = "", c[32] = "";
  int n = sscanf(line, "%31s %31s %31s %31s", verb, a, b, c);
  uint64_t now = clock_now_ns();
  double x = 0, y = 0;
  int d = n >= 2 ? parse_dir(a) : 0;
  if (n < 1) {
    snprintf(out, len, "error: empty command");
  } else if (!strcmp(verb, "delay") && d && n >= 3 && sscanf(b, "%lf", &x) == 1 && x >= 0 &&
             (n < 4 || (sscanf(c, "%lf", &y) == 1 && y >= 0))) {
    for (int i = 0; i < 2; i++)
      if (d & (1 << i)) {
        px.sh[i].delay_ns = (uint64_t)(x * 1e6);
        px.sh[i].jitter_ns = (uint64_t)(y * 1e6);
      }
    snprintf(out, len, "ok delay %s %g ms jitter %g ms", a, x, y);
  } else if (!strcmp(verb, "rate") && d && n == 3 && sscanf(b, "%lf", &x) == 1 && x >= 0) {
    for (int i = 0; i < 2; i++)
      if (d & (1 << i))
        px.sh[i] = (struct shaping){
            px.sh[i].delay_ns, px.sh[i].jitter_ns, (uint64_t)x, px.sh[i].stall_until, 0, now};
    snprintf(out, len, "ok rate %s %g B/s", a, x);
  } else if (!strcmp(verb, "stall") && d && n == 3 && sscanf(b, "%lf", &x) == 1 && x >= 0) {
    for (int i = 0; i < 2; i++)
      if (d & (1 << i)) px.sh[i].stall_until = now + (uint64_t)(x * 1e9);
    snprintf(out, len, "ok stall %s %g s", a, x);
  } else if (!strcmp(verb, "partition") && n == 2 && sscanf(a, "%lf", &x) == 1 && x >= 0) {
    px.partition_until = now + (uint64_t)(x * 1e9);
    snprintf(out, len, "ok partition %g s", x);
  } else if (!strcmp(verb, "reset") && n == 1) {
    int was = px.n;
    reset_all();
    snprintf(out, len, "ok reset %d connections", was);
  } else if (!strcmp(verb, "reset-every") && n == 3 && sscanf(a, "%lf", &x) == 1 && x >= 1 &&
             sscanf(b, "%lf", &y) == 1 && y >= 0) {
    px.storm_period = (uint64_t)(x * 1e6);
    px.storm_until = now + (uint64_t)(y * 1e9);
    px.next_reset = now + px.storm_period;
    snprintf(out, len, "ok reset every %g ms for %g s", x, y);
  } else if ((!strcmp(verb, "heal") || !strcmp(verb, "clear")) && n == 1) {
    px.partition_until = px.storm_until = 0;
    for (int i = 0; i < 2; i++) {
      px.sh[i].stall_until = 0;
      if (!strcmp(verb, "clear")) px.sh[i] = (struct shaping){0, 0, 0, 0, 0, now};
    }
    snprintf(out, len, "ok %s", verb);
  } else if (!strcmp(verb, "stats") && n == 1) {
    snprintf(out, len,
             "ok conns=%d accepted=%llu resets=%llu up_bytes=%llu down_bytes=%llu "
             "delayed_bytes=%llu partitioned=%d",
             px.n, (unsigned long long)px.accepted, (unsigned long long)px.resets,
             (unsigned long long)px.bytes[0], (unsigned long long)px.bytes[1],
             (unsigned long long)px.delayed, partitioned(now) ? 1 : 0);
  } else {
    snprintf(out, len, "error: cannot run \"%.60s\" (see ps-chaos --help)", line);
  }
}

static int parse_schedule(const char *s) {
  while (s && *s) {
    const char *end = strchr(s, ';');
    size_t len = end ? (size_t)(end - s) : strlen(s);
    char item[160];
    if (len >= sizeof(item) || px.nsched == MAX_SCHEDULE) return -1;
    memcpy(item, s, len);
    item[len] = 0;
    char *colon = strchr(item, ':'), *num_end = NULL;
    if (!colon) return -1;
    *colon = 0;
    double at = strtod(item, &num_end);
    if (*num_end || at < 0 || !colon[1]) return -1;
    px.sched[px.nsched].at = (uint64_t)(at * 1e9);
    snprintf(px.sched[px.nsched].cmd, sizeof(px.sched[0].cmd), "%s", colon + 1);
    px.nsched++;
    s = end ? end + 1 : NULL;
  }
  return 0;
}

struct chaos_config {
  char listen[300], target[300], control[300], port_file[1024], schedule[4096];
};
#define CONFIG_STRUCT struct chaos_config
static const struct config_option chaos_options[] = {
    CONFIG_OPT("listen", CONFIG_STRING, listen, "127.0.0.1:0", 0, 0,
               "address clients connect to (port 0: any)"),
    CONFIG_OPT("target", CONFIG_STRING, target, "", 0, 0,
               "host:port every connection is forwarded to"),
    CONFIG_OPT("control", CONFIG_STRING, control, "127.0.0.1:0", 0, 0,
               "address of the command socket (one line each)"),
    CONFIG_OPT("port-file", CONFIG_STRING, port_file, "", 0, 0,
               "write the bound data and control addresses here"),
    CONFIG_OPT("schedule", CONFIG_STRING, schedule, "", 0, 0,
               "\"SECONDS:COMMAND;...\" commands run at those times"),
};
static const struct config_spec chaos_spec = {
    "ps-chaos", "TCP fault proxy: delay, jitter, rate, stalls, partitions and resets per direction",
    chaos_options, sizeof(chaos_options) / sizeof(chaos_options[0]), NULL};

static int listen_on(const char *what, const char *s, struct net_addr *a) {
  char err[256];
  if (net_parse_addr(s, a, 1, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-chaos: option --%s: %s\n", what, err);
    return -1;
  }
  int fd = net_listen(a, 128, err, sizeof(err));
  if (fd < 0) {
    fprintf(stderr, "ps-chaos: --%s %s: %s\n", what, s, err);
    return -1;
  }
  net_set_nonblocking(fd, 1);
  a->port = (uint16_t)net_bound_port(fd);
  return fd;
}

static void accept_data(int lfd) {
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return;
  if (px.n == MAX_CONNS) {
    rst_close(fd);
    return;
  }
  struct pconn *c = calloc(1, sizeof(*c));
  if (!c) {
    rst_close(fd);
    return;
  }
  net_set_nonblocking(fd, 1);
  c->cfd = fd;
  c->tfd = -1;
  px.c[px.n++] = c;
  px.accepted++;
  if (!partitioned(clock_now_ns()) && !start_connect(c)) conn_drop(px.n - 1, true);
}

static void serve_control(int lfd) {
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return;
  char line[256];
  size_t n = 0;
  uint64_t until = clock_now_ns() + 2000000000u;
  while (n < sizeof(line) - 1 && clock_now_ns() < until) { /* one line, blocking briefly */
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t r = read(fd, line + n, 1);
    if (r <= 0 || line[n] == '\n') break;
    n++;
  }
  line[n] = 0;
  char out[256];
  command(line, out, sizeof(out));
  dprintf(fd, "%s\n", out);
  close(fd);
}

int main(int argc, char **argv) {
  struct chaos_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&chaos_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  char err[256];
  if (!cfg.target[0] || net_parse_addr(cfg.target, &px.target, 0, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-chaos: option --target: %s\n", cfg.target[0] ? err : "required");
    return 2;
  }
  if (parse_schedule(cfg.schedule) < 0) {
    fprintf(stderr, "ps-chaos: option --schedule: want \"SECONDS:COMMAND;...\"\n");
    return 2;
  }
  struct net_addr da, ca;
  int dfd = listen_on("listen", cfg.listen, &da),
      cfd = dfd < 0 ? -1 : listen_on("control", cfg.control, &ca);
  if (dfd < 0 || cfd < 0) return 1;
  signal(SIGPIPE, SIG_IGN);
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  if (cfg.port_file[0]) {
    char tmp[1100];
    snprintf(tmp, sizeof(tmp), "%s.tmp", cfg.port_file);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s:%u\n%s:%u\n", da.host, da.port, ca.host, ca.port) < 0 ||
        fclose(f) != 0 || rename(tmp, cfg.port_file) != 0) {
      fprintf(stderr, "ps-chaos: cannot write --port-file %s\n", cfg.port_file);
      return 1;
    }
  }
  fprintf(stderr, "ps-chaos: %s:%u -> %s:%u, control %s:%u\n", da.host, da.port, px.target.host,
          px.target.port, ca.host, ca.port);
  uint64_t start = clock_now_ns();
  int next_sched = 0;
  struct pollfd pf[2 + 2 * MAX_CONNS];
  while (!stop) {
    uint64_t now = clock_now_ns();
    while (next_sched < px.nsched && now - start >= px.sched[next_sched].at) {
      char out[256];
      command(px.sched[next_sched++].cmd, out, sizeof(out));
      fprintf(stderr, "ps-chaos: %s\n", out);
    }
    if (px.storm_until && now >= px.next_reset) {
      if (now < px.storm_until) {
        reset_all();
        px.next_reset = now + px.storm_period;
      } else {
        px.storm_until = 0;
      }
    }
    for (int i = px.n - 1; i >= 0; i--) /* connections held back by a partition go on */
      if (!px.c[i]->connected && !partitioned(now) && !start_connect(px.c[i])) conn_drop(i, true);
    for (int i = px.n - 1; i >= 0; i--) {
      struct pconn *c = px.c[i];
      if (!c->connected) continue;
      if (c->tfd < 0 || !drain(c->tfd, &c->up, 0, now) || !drain(c->cfd, &c->down, 1, now))
        conn_drop(i, true);
      else if (c->up.shut && c->down.shut)
        conn_drop(i, false);
    }
    int n = 0;
    pf[n++] = (struct pollfd){dfd, POLLIN, 0};
    pf[n++] = (struct pollfd){cfd, POLLIN, 0};
    for (int i = 0; i < px.n; i++) {
      struct pconn *c = px.c[i];
      pf[n++] = (struct pollfd){c->cfd,
                                (short)((c->up.queued < QUEUE_CAP && !c->up.eof ? POLLIN : 0) |
                                        (c->down.head && !held(1, now) ? POLLOUT : 0)),
                                0};
      pf[n++] = (struct pollfd){c->tfd,
                                (short)((c->down.queued < QUEUE_CAP && !c->down.eof ? POLLIN : 0) |
                                        (c->up.head && !held(0, now) ? POLLOUT : 0)),
                                0};
    }
    /* timers (delays, rates, stalls, partitions, storms) are checked often */
    if (poll(pf, (nfds_t)n, 2) < 0 && errno != EINTR) break;
    now = clock_now_ns();
    if (pf[0].revents & POLLIN) accept_data(dfd);
    if (pf[1].revents & POLLIN) serve_control(cfd);
    for (int i = px.n - 1, k = 2 + 2 * (px.n - 1); i >= 0; i--, k -= 2) {
      struct pconn *c = px.c[i];
      if (k + 1 >= n) continue; /* accepted during this round */
      bool ok = true;
      if (pf[k].revents & (POLLIN | POLLHUP | POLLERR)) ok = fill(c->cfd, &c->up, 0, now);
      if (ok && c->tfd >= 0 && (pf[k + 1].revents & (POLLIN | POLLHUP | POLLERR)))
        ok = fill(c->tfd, &c->down, 1, now);
      if (!ok) conn_drop(i, true);
    }
  }
  while (px.n) conn_drop(px.n - 1, false);
  return 0;
}
