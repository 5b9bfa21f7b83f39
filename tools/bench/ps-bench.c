/* ps-bench: push and pull throughput (GB/s, chunk messages/s) and latency
 * (p50/p99) of the parameter server, for a list of value sizes, with W
 * client processes against S shards.
 *
 * Processes. The parent parses the options, then either starts S ps-server
 * processes on 127.0.0.1 (--local-shards: port 0, the bound address read back
 * from a --port-file in a private mkdtemp directory) or takes running shards
 * (--servers), and forks W clients. Each client is its own process with its
 * own ps_client, rank r of world W. Parent and client talk over one
 * socketpair per client: the client reports its warm-up time and, per
 * measurement, its timed window and latency samples; the parent picks the
 * iteration count (the same for every client, as BSP requires) and prints
 * one line per (size, op). Local shards are told to exit by rank 0
 * (ps_shutdown_servers) and reaped; on any failure, SIGINT or SIGTERM every
 * child is killed and the directory removed: a shard or client that dies,
 * or a client that drops its channel, ends the run at once (the others would
 * wait for it in a barrier forever). The parent is single-threaded; it
 * reads SIGINT/SIGTERM/SIGHUP/SIGCHLD from a signalfd in the same poll as
 * the channels, so no signal is lost between a check and a blocking wait
 * (procs.c, shared with ps-local, starts, reaps and kills the children).
 *
 * Layout. One float32 tensor "bench.<bytes>" per size (with --depth D > 1:
 * D tensors "bench.<bytes>.<j>"), declared identically by every client;
 * rank 0 initialises each with a deterministic nonzero pattern. Local shards
 * run BSP (or --consistency asp) with --num-workers W and --lr 0, so the
 * parameters never change and every pulled value must equal the pattern
 * bit for bit (running shards given with --servers need the same settings).
 *
 * Depth. One iteration issues one request per tensor of the size, all at
 * once through the asynchronous API (ps_push_async / ps_pull_async), and
 * then waits for all of them: D requests in flight per client, the way
 * ps-lite's benchmark issues every key at once. GB/s counts D * size per
 * iteration; latencies are per request (issue to completion).
 *
 * One measurement, per (size, op): a barrier, --warmup iterations, the
 * iteration count from the parent, a barrier, the timed iterations. The
 * window runs from the barrier-synchronised start (CLOCK_MONOTONIC is shared
 * by the processes of one host) to the last client's end; GB/s = W * iters *
 * size / window (1 GB = 1e9 bytes) and msgs/s counts chunk messages the same
 * way. Latencies are per tensor operation: call to the last chunk's reply.
 *  push: push step v, then a barrier. BSP advances a key only once all W
 *        workers pushed, and a push for a step ahead of the key's version is
 *        refused, so no client may run ahead; the barrier (a header-only
 *        round trip to shard 0) is in the window, not in the push latency.
 *  push-nb: the pushes alone, no barrier: each client pushes its next step
 *        as soon as the last iteration's pushes are acknowledged. Under BSP
 *        only one client can do that (--clients 1); with --consistency asp
 *        (each push applied on arrival, as ps-lite's server sums) any number.
 *  pull: pull of the current version with no pushes; clients run freely.
 * Checks: every warm-up pull and one pull after each timed loop are
 * compared element by element; in the timed pulls a spread of elements (at
 * least two per chunk) is poisoned before and compared after each pull, so
 * checking costs nothing measurable; every pulled version must equal the
 * number of BSP steps made. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "config.h"
#include "log.h"
#include "net.h"
#include "procs.h"
#include "server_argv.h"
#include "ps.h"
#include "ps_bench.h"
#include "ucx_link.h"

#ifndef PS_SERVER_PATH
#define PS_SERVER_PATH "ps-server"
#endif

/* ---- configuration ------------------------------------------------------ */

/* Parses "4k,64k,1M" into at most max sizes; returns the count or -EINVAL
 * with the reason in err. */
static int parse_sizes(const char *s, uint64_t *out, int max, char *err, size_t errlen) {
  char elem[64];
  int n = 0;
  for (const char *p = s;; p++) {
    size_t len = strcspn(p, ",");
    while (len > 0 && *p == ' ') p++, len--;
    while (len > 0 && p[len - 1] == ' ') len--;
    if (len == 0 || len >= sizeof(elem)) {
      snprintf(err, errlen, "element %d is %s", n, len ? "too long" : "empty");
      return -EINVAL;
    }
    memcpy(elem, p, len);
    elem[len] = '\0';
    uint64_t v;
    if (config_parse_size(elem, &v) != 0 || v == 0 || v % 4 != 0 || v > MAX_VALUE_BYTES) {
      snprintf(err, errlen,
               "\"%s\" is not a size in bytes that is a positive multiple of 4 "
               "up to 1GiB (suffixes k, M, G)",
               elem);
      return -EINVAL;
    }
    if (n == max) {
      snprintf(err, errlen, "more than %d sizes", max);
      return -EINVAL;
    }
    out[n++] = v;
    p = strchr(p, ',');
    if (!p) return n;
  }
}

static int check_sizes(const char *value, char *err, size_t errlen) {
  uint64_t tmp[MAX_SIZES];
  return parse_sizes(value, tmp, MAX_SIZES, err, errlen) < 0 ? -EINVAL : 0;
}

const char *const op_names[NUM_OPS] = {"push", "push-nb", "pull"};

/* Parses "push,pull" into a bit set of enum bench_op. */
static int parse_ops(const char *s, unsigned *out, char *err, size_t errlen) {
  unsigned set = 0;
  for (const char *p = s;;) {
    size_t len = strcspn(p, ",");
    int op = -1;
    for (int i = 0; i < NUM_OPS; i++)
      if (strlen(op_names[i]) == len && strncmp(p, op_names[i], len) == 0) op = i;
    if (op < 0) {
      snprintf(err, errlen, "\"%.*s\" is not an operation (push, push-nb, pull)", (int)len, p);
      return -EINVAL;
    }
    set |= 1u << op;
    if (!p[len]) break;
    p += len + 1;
  }
  *out = set;
  return 0;
}

static int check_ops(const char *value, char *err, size_t errlen) {
  unsigned tmp;
  return parse_ops(value, &tmp, err, errlen);
}

static int check_consistency(const char *value, char *err, size_t errlen) {
  if (strcmp(value, "bsp") == 0 || strcmp(value, "asp") == 0) return 0;
  snprintf(err, errlen, "\"%s\" is not bsp or asp", value);
  return -EINVAL;
}

static int check_servers(const char *value, char *err, size_t errlen) {
  if (!value[0]) return 0; /* unset: --local-shards is used */
  struct net_addr *tmp = calloc(MAX_SHARDS, sizeof(*tmp));
  if (!tmp) {
    snprintf(err, errlen, "out of memory");
    return -EINVAL;
  }
  int n = net_parse_addr_list(value, tmp, MAX_SHARDS, err, errlen);
  free(tmp);
  return n < 0 ? -EINVAL : 0;
}

#define CONFIG_STRUCT struct bench_config
static const struct config_option bench_options[] = {
    CONFIG_CHOICE(
        "servers", servers, "", check_servers,
        "running shards host:port,... (element i = shard i), started with --num-workers equal "
        "to --clients and --lr 0"),
    CONFIG_OPT("local-shards", CONFIG_INT, local_shards, "0", 0, MAX_SHARDS,
               "start this many ps-server processes on 127.0.0.1 instead of --servers"),
    CONFIG_OPT("clients", CONFIG_INT, clients, "1", 1, MAX_CLIENTS,
               "client processes W, each with its own ps_client (rank r of W)"),
    CONFIG_CHOICE("sizes", sizes, "4k,64k,1M,16M", check_sizes,
                  "value sizes in bytes, comma-separated (k/M/G suffixes, multiples of 4)"),
    CONFIG_OPT("iters", CONFIG_INT, iters, "0", 0, 10000000,
               "timed iterations per size and op; 0 = enough for --seconds, at least 20"),
    CONFIG_OPT("warmup", CONFIG_INT, warmup, "10", 0, 1000000,
               "untimed iterations before each measurement (they also size --iters 0)"),
    CONFIG_OPT("seconds", CONFIG_DOUBLE, seconds, "0.5", 0.001, 3600,
               "target length of one measurement when --iters is 0"),
    CONFIG_OPT("chunk-bytes", CONFIG_SIZE, chunk_bytes, "4MiB", 4, 1073741824.0,
               "largest chunk (key) a tensor is cut into"),
    CONFIG_OPT(
        "server-bin", CONFIG_STRING, server_bin, PS_SERVER_PATH, 0, 0,
        "ps-server binary started by --local-shards (a name without '/' is looked up in PATH)"),
    CONFIG_OPT("auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
               "authenticate with this token (given to --local-shards too): measures the cost of "
               "the handshake and the per-frame tags"),
    CONFIG_CHOICE("log-level", log_level, "warn", log_level_check,
                  "log level of the clients' libps: debug, info, warn, error or off"),
    CONFIG_OPT(
        "depth", CONFIG_INT, depth, "1", 1, MAX_DEPTH,
        "requests in flight per client: each iteration issues one request to each of this many "
        "tensors of the size at once, then waits for all"),
    CONFIG_OPT(
        "no-batch", CONFIG_BOOL, no_batch, "false", 0, 0,
        "with --depth > 1: issue an iteration's requests without ps_batch_begin/ps_batch_end "
        "(each frame leaves on its own)"),
    CONFIG_CHOICE(
        "ops", ops, "push,pull", check_ops,
        "operations measured, comma-separated: push (with a barrier per iteration), push-nb "
        "(pushes alone), pull"),
    CONFIG_CHOICE("consistency", consistency, "bsp", check_consistency,
                  "bsp or asp: what --local-shards run (and what --servers must run)"),
    CONFIG_CHOICE(
        "transport", transport, "tcp", ulink_transport_check,
        "tcp or ucx (UCX active messages; UCX_TLS forces UCX's transports): what the clients "
        "and --local-shards use (and what --servers must use)"),
};

static const struct config_spec bench_spec = {
    "ps-bench", "push/pull throughput (GB/s, msgs/s) and p50/p99 latency of the parameter server",
    bench_options, sizeof(bench_options) / sizeof(bench_options[0]), NULL};

/* ---- parent: processes -------------------------------------------------- */

struct parent {
  struct bench_plan *plan;
  struct procs procs;  /* the signalfd and every child started */
  char dir[DIR_BYTES]; /* local shards' files; "" = none */
  int num_servers;     /* started so far */
  struct procs_child server[MAX_SHARDS];
  int num_clients;
  struct procs_child client[MAX_CLIENTS];
  int client_fd[MAX_CLIENTS];
  int results_read[MAX_CLIENTS]; /* measurements received from each client */
};

/* Reaps every child that has exited (procs_reap records each status). */
static void reap(struct parent *P) {
  while (procs_reap(&P->procs)) {
  }
}

/* The first shard started that has exited (after reaping), or -1. */
static int server_exited(struct parent *P) {
  reap(P);
  for (int i = 0; i < P->num_servers; i++)
    if (!P->server[i].running) return i;
  return -1;
}

/* During the measurements no shard may exit and no client may fail: says
 * which one did and returns -1. */
static int check_children(struct parent *P) {
  char how[96];
  int i = server_exited(P);
  if (i >= 0) {
    fprintf(stderr, "ps-bench: ps-server shard %d ended (%s)\n", i,
            procs_describe(P->server[i].status, how, sizeof(how)));
    return -1;
  }
  for (int r = 0; r < P->num_clients; r++) {
    if (P->client[r].running || procs_exited_ok(&P->client[r])) continue;
    fprintf(stderr, "ps-bench: client %d failed (%s)\n", r,
            procs_describe(P->client[r].status, how, sizeof(how)));
    return -1;
  }
  return 0;
}

static void shard_path(const struct parent *P, int i, const char *ext, char *buf, size_t len) {
  snprintf(buf, len, "%s/shard-%d.%s", P->dir, i, ext);
}

/* Starts ps-server i; its stdout and stderr go to shard-i.log. A wrong
 * --server-bin is reported as such (procs_spawn sees the exec fail) rather
 * than as a missing port file. */
static int server_spawn(struct parent *P, int i, const char *bin) {
  const struct bench_plan *p = P->plan;
  char port_file[PATH_BYTES], log_file[PATH_BYTES];
  shard_path(P, i, "port", port_file, sizeof(port_file));
  shard_path(P, i, "log", log_file, sizeof(log_file));
  uint64_t max_frame =
      p->cfg->chunk_bytes > DEFAULT_MAX_FRAME_BYTES ? p->cfg->chunk_bytes : DEFAULT_MAX_FRAME_BYTES;
  struct server_argv a;
  server_argv_init(&a, bin, "127.0.0.1:0", port_file, i, p->num_shards, p->world);
  server_argv_add(&a, "--lr", "0");
  server_argv_add_u64(&a, "--max-frame-bytes", max_frame);
  server_argv_add(&a, "--consistency", p->asp ? "asp" : "bsp");
  server_argv_add(&a, "--transport", p->cfg->transport);
  if (p->token) server_argv_add(&a, "--auth-token-file", p->cfg->auth_token_file);
  const char *const *argv = server_argv_get(&a);
  if (!argv) return -1;
  int fd = procs_open_log(&P->procs, log_file);
  if (fd < 0) return -1;
  struct procs_child *c = &P->server[i];
  procs_child_init(c, "ps-server shard", i);
  int r = procs_spawn(&P->procs, c, argv, &(struct procs_io){fd, fd, -1, NULL});
  close(fd);
  if (c->running) P->num_servers++;
  if (r < 0 && c->running)
    fprintf(stderr, "ps-bench: cannot run %s: %s (see --server-bin)\n", bin, strerror(-r));
  return r < 0 ? -1 : 0;
}

/* Waits until every shard wrote its bound address, handling on the way
 * what the signalfd brings: a stop signal, or a shard that exited. */
static int servers_wait_listening(struct parent *P) {
  struct bench_plan *p = P->plan;
  char port_file[PATH_BYTES], how[96];
  uint64_t deadline = clock_now_ms() + START_TIMEOUT_MS;
  for (int i = 0; i < p->num_shards;) {
    shard_path(P, i, "port", port_file, sizeof(port_file));
    int r = procs_wait_port(&P->procs, port_file, p->addrs[i], sizeof(p->addrs[i]), deadline);
    if (r == 0) {
      p->servers[i] = p->addrs[i];
      i++;
      continue;
    }
    if (r == -ETIMEDOUT) {
      fprintf(stderr, "ps-bench: ps-server shard %d did not listen within %d s\n", i,
              START_TIMEOUT_MS / 1000);
      return -1;
    }
    if (procs_stop_signal(&P->procs)) return -1;
    int k = server_exited(P);
    if (k >= 0) {
      fprintf(stderr, "ps-bench: ps-server shard %d exited during start-up (%s)\n", k,
              procs_describe(P->server[k].status, how, sizeof(how)));
      return -1;
    }
  }
  return 0;
}

static int servers_start(struct parent *P) {
  struct bench_plan *p = P->plan;
  if (procs_make_tmpdir(&P->procs, P->dir, sizeof(P->dir)) < 0) return -1;
  const char *bin = p->cfg->server_bin;
  /* An installed ps-bench outlives the build tree its default points into. */
  if (strcmp(bin, PS_SERVER_PATH) == 0 && strchr(bin, '/') && access(bin, X_OK) != 0)
    bin = "ps-server";
  for (int i = 0; i < p->num_shards; i++)
    if (server_spawn(P, i, bin) < 0) return -1;
  return servers_wait_listening(P);
}

static int clients_start(struct parent *P) {
  const struct bench_plan *p = P->plan;
  for (int r = 0; r < p->world; r++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
      fprintf(stderr, "ps-bench: socketpair: %s\n", strerror(errno));
      return -1;
    }
    procs_child_init(&P->client[r], "client", r);
    pid_t pid = procs_fork(&P->procs, &P->client[r]);
    if (pid == 0) {
      close(sv[0]);
      for (int k = 0; k < r; k++) close(P->client_fd[k]);
      exit(bench_client_main(p, r, sv[1])); /* exit, not _exit: LeakSanitizer runs at exit */
    }
    close(sv[1]);
    if (pid < 0) {
      close(sv[0]);
      return -1;
    }
    P->client_fd[P->num_clients++] = sv[0];
  }
  return 0;
}

/* Prints the end of each shard's log (after a failure). */
static void servers_dump_logs(const struct parent *P) {
  for (int i = 0; P->dir[0] && i < P->num_servers; i++) {
    char path[PATH_BYTES];
    shard_path(P, i, "log", path, sizeof(path));
    procs_print_log_tail(&P->procs, path, false, LOG_TAIL_LINES);
  }
}

/* Normal end: clients exit on their own; with local shards rank 0 is told
 * to shut them down once the others are gone, then the shards are reaped. */
static int wait_all(struct parent *P) {
  char how[96];
  int ret = 0;
  for (int k = 1; k <= P->num_clients; k++) {
    int r = k % P->num_clients; /* rank 0 last */
    if (r == 0 && P->num_servers > 0) {
      uint64_t go = 1;
      if (net_write_all(P->client_fd[0], &go, sizeof(go)) < 0) {
        fprintf(stderr, "ps-bench: client 0: channel closed before the shutdown\n");
        return -1;
      }
    }
    int w = procs_wait(&P->procs, &P->client[r], EXIT_TIMEOUT_MS);
    if (w == -EINTR) return -1;
    if (w < 0) {
      fprintf(stderr, "ps-bench: client %d did not exit within %d s\n", r, EXIT_TIMEOUT_MS / 1000);
      return -1;
    }
    if (!procs_exited_ok(&P->client[r])) {
      fprintf(stderr, "ps-bench: client %d failed (%s)\n", r,
              procs_describe(P->client[r].status, how, sizeof(how)));
      ret = -1;
    }
  }
  for (int i = 0; i < P->num_servers; i++) {
    int w = procs_wait(&P->procs, &P->server[i], EXIT_TIMEOUT_MS);
    if (w == -EINTR) return -1;
    if (w < 0) {
      fprintf(stderr, "ps-bench: ps-server shard %d did not exit after the shutdown\n", i);
      return -1;
    }
    if (!procs_exited_ok(&P->server[i])) {
      fprintf(stderr, "ps-bench: ps-server shard %d ended with %s\n", i,
              procs_describe(P->server[i].status, how, sizeof(how)));
      ret = -1;
    }
  }
  return ret;
}

/* ---- parent: the measurements -------------------------------------------- */

/* True if client k closed its channel before its last result was read
 * and nothing it sent is left unread: it failed (and may not even exit, if
 * it hangs on the way out). */
static bool channel_closed_early(const struct parent *P, int k) {
  int unread = 0;
  if (P->results_read[k] >= P->plan->num_sizes * __builtin_popcount(P->plan->ops)) return false;
  return ioctl(P->client_fd[k], FIONREAD, &unread) == 0 && unread == 0;
}

/* Reads len bytes from client r. While it waits, a shard that exits or
 * another client that fails or drops its channel ends the run at once: the
 * others would otherwise wait for it in a barrier forever. */
static int chan_read(struct parent *P, int r, void *buf, size_t len) {
  char *p = buf, how[96];
  bool quiet[MAX_CLIENTS] = {false}; /* hung up with data still to read: ask later */
  struct pollfd pfd[MAX_CLIENTS + 1];
  int n_cl = P->num_clients;
  while (len > 0) {
    /* Signals first, then exits: one after the check wakes the poll. */
    if (procs_stop_signal(&P->procs) || check_children(P) < 0) return -1;
    for (int k = 0; k < n_cl; k++) {
      pfd[k].fd = k != r && quiet[k] ? -1 : P->client_fd[k];
      pfd[k].events = k == r ? POLLIN : POLLRDHUP;
      pfd[k].revents = 0;
    }
    pfd[n_cl] = (struct pollfd){procs_signal_fd(&P->procs), POLLIN, 0};
    if (poll(pfd, (nfds_t)n_cl + 1, -1) < 0) {
      if (errno == EINTR) continue;
      fprintf(stderr, "ps-bench: poll: %s\n", strerror(errno));
      return -1;
    }
    for (int k = 0; k < P->num_clients; k++) {
      if (k == r || !(pfd[k].revents & (POLLHUP | POLLRDHUP | POLLERR))) continue;
      if (!channel_closed_early(P, k)) {
        quiet[k] = true;
        continue;
      }
      snprintf(how, sizeof(how), "closed its channel");
      if (procs_wait(&P->procs, &P->client[k], 1000) == 0)
        procs_describe(P->client[k].status, how, sizeof(how));
      fprintf(stderr, "ps-bench: client %d failed (%s)\n", k, how);
      return -1;
    }
    if (!pfd[r].revents) continue;
    ssize_t n = read(P->client_fd[r], p, len);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    snprintf(how, sizeof(how), "%s", n < 0 ? strerror(errno) : "closed its channel");
    if (procs_wait(&P->procs, &P->client[r], 1000) == 0)
      procs_describe(P->client[r].status, how, sizeof(how));
    fprintf(stderr, "ps-bench: client %d failed (%s)\n", r, how);
    return -1;
  }
  return 0;
}

static int chan_read_msg(struct parent *P, int r, enum msg_type want, struct msg *m) {
  if (chan_read(P, r, m, sizeof(*m)) < 0) return -1;
  if (m->type != (uint32_t)want || m->rank != (uint32_t)r) {
    fprintf(stderr, "ps-bench: client %d sent message %" PRIu32 ", expected %d\n", r, m->type,
            (int)want);
    return -1;
  }
  return 0;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v. */
static uint64_t percentile(const uint64_t *v, uint64_t n, double q) {
  uint64_t k = (uint64_t)ceil(q * (double)n);
  return v[k ? k - 1 : 0];
}

static uint64_t choose_iters(const struct bench_plan *p, uint64_t warm_ns) {
  const struct bench_config *cfg = p->cfg;
  if (cfg->iters > 0) return (uint64_t)cfg->iters;
  uint64_t cap = MAX_SAMPLES / (uint64_t)p->world, want = MIN_ADAPTIVE_ITERS;
  if (warm_ns > 0) want = (uint64_t)ceil(cfg->seconds * 1e9 / (double)warm_ns);
  if (want < MIN_ADAPTIVE_ITERS) want = MIN_ADAPTIVE_ITERS;
  return want < cap ? want : (cap > MIN_ADAPTIVE_ITERS ? cap : MIN_ADAPTIVE_ITERS);
}

/* One (size, op): agree on the count, gather, print. Returns 0, or -1 when a
 * client failed. *failed is set when a check failed. */
static int measure(struct parent *P, int t, enum bench_op op, bool *failed) {
  const struct bench_plan *p = P->plan;
  int W = p->world;
  struct msg m;
  uint64_t warm = 0;
  for (int r = 0; r < W; r++) {
    if (chan_read_msg(P, r, MSG_WARM, &m) < 0) return -1;
    if (m.warm_ns > warm) warm = m.warm_ns;
  }
  uint64_t iters = choose_iters(p, warm);
  uint64_t D = (uint64_t)p->depth, per = iters * D; /* latency samples per client */
  uint64_t *lat = malloc((size_t)W * per * sizeof(uint64_t));
  if (!lat) {
    fprintf(stderr, "ps-bench: out of memory for %" PRIu64 " latency samples\n", W * per);
    return -1;
  }
  for (int r = 0; r < W; r++) {
    if (net_write_all(P->client_fd[r], &iters, sizeof(iters)) < 0) {
      fprintf(stderr, "ps-bench: client %d: channel closed\n", r);
      free(lat);
      return -1;
    }
  }
  uint64_t start = UINT64_MAX, end = 0, bad = 0;
  for (int r = 0; r < W; r++) {
    if (chan_read_msg(P, r, MSG_RESULT, &m) < 0 || m.num_values != per ||
        chan_read(P, r, lat + (size_t)r * per, per * sizeof(uint64_t)) < 0) {
      free(lat);
      return -1;
    }
    P->results_read[r]++;
    if (m.start_ns < start) start = m.start_ns;
    if (m.end_ns > end) end = m.end_ns;
    bad += m.bad;
  }
  uint64_t n = (uint64_t)W * per, size = p->sizes[t]; /* requests */
  qsort(lat, n, sizeof(uint64_t), cmp_u64);
  double window = end > start ? (double)(end - start) : 1.0;
  double gbps = (double)n * (double)size / window;
  double msgs = (double)n * (double)chunks_of(p, size) * 1e9 / window;
  printf("%-9" PRIu64 " %-7s %8.3f %11.0f %9.1f %9.1f %s\n", size, op_names[op], gbps, msgs,
         (double)percentile(lat, n, 0.50) / 1e3, (double)percentile(lat, n, 0.99) / 1e3,
         bad ? "FAIL" : "ok");
  fflush(stdout);
  free(lat);
  if (bad) {
    fprintf(stderr, "ps-bench: bench.%" PRIu64 " %s: %" PRIu64 " failed checks%s\n", size,
            op_names[op], bad,
            p->local ? "" : " (shards given with --servers must run --lr 0 for ps-bench alone)");
    *failed = true;
  }
  return 0;
}

static int run_all(struct parent *P, bool *failed) {
  const struct bench_plan *p = P->plan;
  struct msg m;
  uint64_t bytes[MAX_SHARDS];
  if (chan_read_msg(P, 0, MSG_PLACEMENT, &m) < 0 || m.num_values != (uint64_t)p->num_shards ||
      chan_read(P, 0, bytes, m.num_values * sizeof(uint64_t)) < 0)
    return -1;
  printf("# placement bytes per shard (all sizes):");
  for (int i = 0; i < p->num_shards; i++) printf(" %" PRIu64, bytes[i]);
  printf("\n# %-7s %-7s %8s %11s %9s %9s %s\n", "size", "op", "GB/s", "msgs/s", "p50_us", "p99_us",
         "check");
  fflush(stdout);
  for (int t = 0; t < p->num_sizes; t++)
    for (int op = 0; op < NUM_OPS; op++)
      if ((p->ops & (1u << op)) && measure(P, t, (enum bench_op)op, failed) < 0) return -1;
  return 0;
}

static void print_setup(const struct bench_plan *p) {
  char date[32] = "?";
  struct utsname u;
  time_t now = time(NULL);
  struct tm tm;
  if (gmtime_r(&now, &tm)) strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &tm);
  if (uname(&u) != 0) snprintf(u.nodename, sizeof(u.nodename), "?");
  const char *tls = getenv("UCX_TLS");
  printf(
      "# ps-bench shards=%d clients=%d depth=%d%s consistency=%s auth=%s transport=%s%s%s"
      " chunk_bytes=%" PRIu64 " server=%s date=%s host=%s\n",
      p->num_shards, p->world, p->depth, p->cfg->no_batch ? " no-batch" : "",
      p->asp ? "asp" : "bsp", p->token ? "token" : "none", p->cfg->transport,
      strcmp(p->cfg->transport, "ucx") == 0 ? " UCX_TLS=" : "",
      strcmp(p->cfg->transport, "ucx") == 0 ? (tls ? tls : "(all)") : "", p->cfg->chunk_bytes,
      p->local ? "local" : p->cfg->servers, date, u.nodename);
  fflush(stdout);
}

/* Checks what the table cannot (option combinations) and fills the plan. */
static int plan_build(const struct bench_config *cfg, struct bench_plan *p) {
  char err[512];
  memset(p, 0, sizeof(*p));
  p->cfg = cfg;
  p->world = (int)cfg->clients;
  p->local = cfg->local_shards > 0;
  if (p->local == (cfg->servers[0] != '\0')) {
    fprintf(stderr, "ps-bench: give either --servers h:p,... or --local-shards S\n");
    return -EINVAL;
  }
  p->num_sizes = parse_sizes(cfg->sizes, p->sizes, MAX_SIZES, err, sizeof(err));
  if (p->num_sizes < 0) {
    fprintf(stderr, "ps-bench: option --sizes: %s\n", err); /* the check caught it already */
    return -EINVAL;
  }
  p->log_level = LOG_WARN; /* an empty --log-level keeps the default */
  log_level_parse(cfg->log_level, &p->log_level);
  p->depth = (int)cfg->depth;
  p->asp = strcmp(cfg->consistency, "asp") == 0;
  if (parse_ops(cfg->ops, &p->ops, err, sizeof(err)) < 0) return -EINVAL; /* checked already */
  for (int t = 0; t < p->num_sizes; t++) {
    if (p->sizes[t] * (uint64_t)p->depth > MAX_ROUND_BYTES) {
      fprintf(stderr,
              "ps-bench: --depth %d x size %" PRIu64
              " is more than 1 GiB per client: "
              "use a smaller --depth or size\n",
              p->depth, p->sizes[t]);
      return -EINVAL;
    }
  }
  if ((p->ops & (1u << OP_PUSH_NB)) && !p->asp && p->world > 1) {
    fprintf(stderr,
            "ps-bench: --ops push-nb with --clients %d needs --consistency asp: under bsp a "
            "client cannot push its next step before every client pushed this one\n",
            p->world);
    return -EINVAL;
  }
  if (p->asp && !p->local) {
    fprintf(stderr,
            "ps-bench: --consistency asp needs --local-shards (fresh shards: each "
            "client's steps start at 0)\n");
    return -EINVAL;
  }
  if (p->local) {
    p->num_shards = (int)cfg->local_shards;
    return 0;
  }
  struct net_addr *addrs = calloc(MAX_SHARDS, sizeof(*addrs));
  if (!addrs) return -ENOMEM;
  int n = net_parse_addr_list(cfg->servers, addrs, MAX_SHARDS, err, sizeof(err));
  if (n < 0) fprintf(stderr, "ps-bench: option --servers: %s\n", err);
  for (int i = 0; i < n; i++) {
    snprintf(p->addrs[i], sizeof(p->addrs[i]), strchr(addrs[i].host, ':') ? "[%s]:%u" : "%s:%u",
             addrs[i].host, addrs[i].port);
    p->servers[i] = p->addrs[i];
  }
  free(addrs);
  p->num_shards = n;
  return n < 0 ? -EINVAL : 0;
}

int main(int argc, char **argv) {
  static struct bench_config cfg;
  static struct bench_plan plan;
  int r = config_parse(&bench_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0 || plan_build(&cfg, &plan) < 0) return 2;
  char err[600];
  if (cfg.auth_token_file[0] &&
      ps_token_load(cfg.auth_token_file, &plan.token, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "ps-bench: option --auth-token-file: %s\n", err);
    return 2;
  }

  static struct parent P = {.plan = &plan};
  bool failed = false;
  int ret = 1, sig;
  if (procs_init(&P.procs, "ps-bench") < 0) goto out;
  if (plan.local && servers_start(&P) < 0) goto fail;
  print_setup(&plan);
  if (clients_start(&P) < 0 || run_all(&P, &failed) < 0 || wait_all(&P) < 0) goto fail;
  ret = failed ? 1 : 0;
  goto out;
fail:
  if ((sig = procs_stop_signal(&P.procs))) {
    fprintf(stderr, "ps-bench: %s, stopping\n", strsignal(sig));
    ret = 128 + sig;
  } else {
    servers_dump_logs(&P);
  }
  procs_kill_all(&P.procs);
out:
  procs_remove_dir(&P.procs, P.dir);
  procs_deinit(&P.procs);
  ps_token_free(plan.token);
  return ret;
}
