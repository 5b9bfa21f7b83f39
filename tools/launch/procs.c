/* procs: child processes of a single-threaded launcher (procs.h says what
 * a child is started with and why).
 *
 * Invariants: the four signals are blocked from procs_init on, so they only
 * ever arrive through the signalfd; a pid is on P's list from the fork that
 * made it until the process exits, and running is true exactly while it has
 * not been reaped, so a signal is never sent to a pid the kernel may have
 * given to someone else. Only procs_reap, procs_wait and procs_kill_all
 * reap; procs_stopped only peeks (WNOWAIT). */
#include "procs.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

enum {
  PORT_POLL_MS = 10,  /* how often procs_wait_port looks for the file */
  WAIT_POLL_MS = 100, /* procs_wait wakes on SIGCHLD; this only bounds a missed one */
};

/* ---- signals ------------------------------------------------------------- */

int procs_init(struct procs *P, const char *prog) {
  memset(P, 0, sizeof(*P));
  for (int fd = 0; fd <= 2; fd++) {
    if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    int null_fd = open("/dev/null", O_RDWR); /* the lowest free number: fd itself */
    if (null_fd >= 0 && null_fd != fd) close(null_fd);
  }
  P->prog = prog;
  P->sig_fd = -1;
  P->self = getpid();
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGHUP);
  sigaddset(&mask, SIGCHLD);
  if (sigprocmask(SIG_BLOCK, &mask, &P->old_mask) < 0 ||
      (P->sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
    int e = errno;
    fprintf(stderr, "%s: signalfd: %s\n", prog, strerror(e));
    return -e;
  }
  return 0;
}

void procs_deinit(struct procs *P) {
  if (!P) return;
  if (P->sig_fd >= 0) close(P->sig_fd);
  P->sig_fd = -1;
}

int procs_signal_fd(const struct procs *P) {
  return P->sig_fd;
}

int procs_next_signal(struct procs *P) {
  struct signalfd_siginfo si;
  while (read(P->sig_fd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
    int sig = (int)si.ssi_signo;
    if (sig == SIGCHLD) continue;
    if (!P->stop_signal) P->stop_signal = sig;
    return sig;
  }
  return 0;
}

int procs_stop_signal(struct procs *P) {
  while (procs_next_signal(P)) {
  }
  return P->stop_signal;
}

/* ---- starting children ----------------------------------------------------- */

void procs_child_init(struct procs_child *c, const char *what, int index) {
  memset(c, 0, sizeof(*c));
  snprintf(c->name, sizeof(c->name), "%s %d", what, index);
}

pid_t procs_fork(struct procs *P, struct procs_child *c) {
  if (c->pid) return -EALREADY; /* on the list already: a second link would loop it */
  fflush(NULL);                 /* or the child would write our buffered output again */
  pid_t pid = fork();
  if (pid == 0) {
    /* Undo what the launcher set for itself: the signal mask and SIGPIPE's
     * disposition survive exec. */
    sigprocmask(SIG_SETMASK, &P->old_mask, NULL);
    signal(SIGPIPE, SIG_DFL);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != P->self) _exit(127); /* the launcher died before prctl */
    close(P->sig_fd);
    return 0;
  }
  if (pid < 0) {
    int e = errno;
    fprintf(stderr, "%s: fork: %s\n", P->prog, strerror(e));
    return -e;
  }
  c->pid = pid;
  c->running = true;
  c->next = P->kids;
  P->kids = c;
  return pid;
}

/* Formats argv as one shell-like line for the debug log. */
static void format_cmd(const char *const *argv, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; argv[i] && used + 1 < len; i++) {
    bool plain = argv[i][0] != '\0';
    for (const char *p = argv[i]; *p; p++)
      if (!(isalnum((unsigned char)*p) || strchr("-_./:,=+@", *p))) plain = false;
    int n = snprintf(buf + used, len - used, plain ? "%s%s" : "%s'%s'", i ? " " : "", argv[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
}

/* In the child: stdin from /dev/null, the streams io names, then exec. An
 * exec error goes to the parent through err_fd. Does not return. */
static void exec_child(const char *const *argv, const struct procs_io *io, int err_fd) {
  int null_fd = open("/dev/null", O_RDONLY);
  if (null_fd >= 0 && null_fd != 0) {
    dup2(null_fd, 0);
    close(null_fd);
  }
  if (io->out_fd >= 0) dup2(io->out_fd, 1);
  if (io->err_fd >= 0) dup2(io->err_fd, 2);
  if (io->keep_fd >= 0) fcntl(io->keep_fd, F_SETFD, 0); /* survives exec; the rest is CLOEXEC */
  char *const *env = io->env ? io->env : environ;
  if (strchr(argv[0], '/'))
    execve(argv[0], (char *const *)argv, env);
  else
    execvpe(argv[0], (char *const *)argv, env); /* PATH is ours, as the shell's would be */
  int e = errno;
  if (write(err_fd, &e, sizeof(e)) < 0) _exit(127);
  _exit(127);
}

int procs_spawn(struct procs *P, struct procs_child *c, const char *const *argv,
                const struct procs_io *io) {
  static const struct procs_io inherit = {-1, -1, -1, NULL};
  if (!io) io = &inherit;
  if (log_enabled(LOG_DEBUG)) {
    char cmd[8192], qcmd[8300], qname[96];
    format_cmd(argv, cmd, sizeof(cmd));
    log_debug("starting", "child=%s cmd=%s", log_quote(qname, sizeof(qname), c->name),
              log_quote(qcmd, sizeof(qcmd), cmd));
  }
  int ep[2];
  if (pipe2(ep, O_CLOEXEC) < 0) {
    int e = errno;
    fprintf(stderr, "%s: pipe: %s\n", P->prog, strerror(e));
    return -e;
  }
  pid_t pid = procs_fork(P, c);
  if (pid == 0) {
    close(ep[0]);
    exec_child(argv, io, ep[1]);
  }
  close(ep[1]);
  if (pid < 0) {
    close(ep[0]);
    return (int)pid;
  }
  /* The pipe closes at a successful exec; an errno on it is the failure. */
  int e = 0;
  ssize_t n;
  do n = read(ep[0], &e, sizeof(e));
  while (n < 0 && errno == EINTR);
  close(ep[0]);
  return n == (ssize_t)sizeof(e) ? -e : 0;
}

/* ---- environments ------------------------------------------------------------ */

int procs_env_init(struct procs_env *e) {
  memset(e, 0, sizeof(*e));
  size_t n = 0;
  while (environ[n]) n++;
  e->cap = n + 32;
  e->vars = calloc(e->cap, sizeof(*e->vars));
  if (!e->vars) {
    e->failed = true;
    return -ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    if (!(e->vars[e->len] = strdup(environ[i]))) {
      e->failed = true;
      return -ENOMEM;
    }
    e->len++;
  }
  return 0;
}

/* The index of name's entry in e, or e->len. */
static size_t env_find(const struct procs_env *e, const char *name) {
  size_t n = strlen(name);
  for (size_t i = 0; i < e->len; i++)
    if (strncmp(e->vars[i], name, n) == 0 && e->vars[i][n] == '=') return i;
  return e->len;
}

void procs_env_unset(struct procs_env *e, const char *name) {
  if (e->failed) return;
  size_t i = env_find(e, name);
  if (i == e->len) return;
  free(e->vars[i]);
  memmove(e->vars + i, e->vars + i + 1, (e->len - i) * sizeof(*e->vars)); /* the NULL too */
  e->len--;
}

void procs_env_set(struct procs_env *e, const char *name, const char *fmt, ...) {
  if (e->failed) return;
  char *value = NULL, *var = NULL;
  va_list ap;
  va_start(ap, fmt);
  int ok = vasprintf(&value, fmt, ap);
  va_end(ap);
  if (ok < 0 || asprintf(&var, "%s=%s", name, value) < 0) var = NULL;
  if (ok >= 0) free(value);
  if (!var) {
    e->failed = true;
    return;
  }
  size_t i = env_find(e, name);
  if (i < e->len) {
    free(e->vars[i]);
    e->vars[i] = var;
    return;
  }
  if (e->len + 1 >= e->cap) {
    char **more = realloc(e->vars, 2 * e->cap * sizeof(*more));
    if (!more) {
      free(var);
      e->failed = true;
      return;
    }
    e->vars = more;
    e->cap *= 2;
  }
  e->vars[e->len++] = var;
  e->vars[e->len] = NULL;
}

char *const *procs_env_vars(const struct procs_env *e) {
  return e->failed ? NULL : e->vars;
}

void procs_env_deinit(struct procs_env *e) {
  if (!e || !e->vars) return;
  for (size_t i = 0; i < e->len; i++) free(e->vars[i]);
  free(e->vars);
  memset(e, 0, sizeof(*e));
}

/* ---- reaping and stopping --------------------------------------------------- */

/* Records that c exited with status. */
static void mark_exited(struct procs_child *c, int status) {
  c->running = false;
  c->status = status;
  if (log_enabled(LOG_DEBUG)) {
    char how[96];
    log_debug("child exited", "child=\"%s\" status=\"%s\"", c->name,
              procs_describe(status, how, sizeof(how)));
  }
}

struct procs_child *procs_reap(struct procs *P) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    for (struct procs_child *c = P->kids; c; c = c->next) {
      if (c->pid == pid && c->running) {
        mark_exited(c, status);
        return c;
      }
    }
  }
  return NULL;
}

void procs_kill(struct procs_child *c, int sig) {
  if (!c->running) return;
  c->signalled = true;
  kill(c->pid, sig);
}

int procs_wait(struct procs *P, struct procs_child *c, int timeout_ms) {
  uint64_t deadline = clock_now_ms() + (uint64_t)timeout_ms;
  for (;;) {
    /* Signals first, then the reaping: an exit after it leaves SIGCHLD
     * readable for the poll below. */
    procs_stop_signal(P);
    while (procs_reap(P)) {
    }
    if (!c->running) return 0;
    if (P->stop_signal) return -EINTR;
    uint64_t now = clock_now_ms();
    if (now >= deadline) return -ETIMEDOUT;
    struct pollfd pf = {P->sig_fd, POLLIN, 0};
    uint64_t left = deadline - now;
    poll(&pf, 1, left < WAIT_POLL_MS ? (int)left : WAIT_POLL_MS);
  }
}

void procs_kill_all(struct procs *P) {
  while (procs_reap(P)) {
  }
  for (struct procs_child *c = P->kids; c; c = c->next) procs_kill(c, SIGKILL);
  for (struct procs_child *c = P->kids; c; c = c->next) {
    int status;
    pid_t r;
    if (!c->running) continue;
    do r = waitpid(c->pid, &status, 0);
    while (r < 0 && errno == EINTR);
    if (r == c->pid) mark_exited(c, status);
  }
}

enum procs_stop procs_stopped(const struct procs_child *c, int *sig) {
  *sig = 0;
  if (!c->running) return PROCS_NOT_STOPPED;
  char path[64], buf[1024];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)c->pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PROCS_NOT_STOPPED;
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return PROCS_NOT_STOPPED;
  buf[n] = '\0';
  const char *rp = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold ')' itself */
  if (!rp || rp[1] != ' ') return PROCS_NOT_STOPPED;
  if (rp[2] == 't') return PROCS_TRACED;
  if (rp[2] != 'T') return PROCS_NOT_STOPPED;
  /* Its stop report, left for a waitpid(WUNTRACED) that never comes (WNOWAIT). */
  siginfo_t si;
  memset(&si, 0, sizeof(si));
  if (waitid(P_PID, (id_t)c->pid, &si, WSTOPPED | WNOHANG | WNOWAIT) == 0 && si.si_pid == c->pid &&
      si.si_code == CLD_STOPPED)
    *sig = si.si_status;
  return PROCS_STOPPED;
}

bool procs_exited_ok(const struct procs_child *c) {
  return !c->running && c->pid > 0 && WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0;
}

const char *procs_describe(int status, char *buf, size_t len) {
  if (WIFEXITED(status))
    snprintf(buf, len, "exit status %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, len, "killed by signal %d, %s", WTERMSIG(status), strsignal(WTERMSIG(status)));
  else
    snprintf(buf, len, "wait status 0x%x", (unsigned)status);
  return buf;
}

/* ---- port files --------------------------------------------------------------- */

int procs_read_port_file(const char *path, char *addr, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  bool ok = fgets(addr, (int)len, f) != NULL;
  fclose(f);
  if (!ok) addr[0] = '\0';
  addr[strcspn(addr, "\r\n")] = '\0';
  return addr[0] ? 1 : 0;
}

/* True if a child has exited and not been reaped yet (it stays unreaped). */
static bool exit_pending(void) {
  siginfo_t si;
  memset(&si, 0, sizeof(si));
  return waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid != 0;
}

int procs_wait_port(struct procs *P, const char *path, char *addr, size_t len,
                    uint64_t deadline_ms) {
  for (;;) {
    if (procs_read_port_file(path, addr, len)) return 0;
    /* An exit whose SIGCHLD the launcher already read is still news. */
    if (exit_pending()) return -EINTR;
    uint64_t now = clock_now_ms();
    if (now >= deadline_ms) return -ETIMEDOUT;
    uint64_t left = deadline_ms - now;
    struct pollfd pf = {P->sig_fd, POLLIN, 0};
    if (poll(&pf, 1, left < PORT_POLL_MS ? (int)left : PORT_POLL_MS) > 0) return -EINTR;
  }
}

/* ---- directories and logs ------------------------------------------------------ */

int procs_make_tmpdir(const struct procs *P, char *dir, size_t len) {
  const char *base = getenv("TMPDIR");
  if (!base || !*base || strlen(base) + 32 > len) base = "/tmp";
  snprintf(dir, len, "%s/%s-XXXXXX", base, P->prog);
  if (!mkdtemp(dir)) {
    int e = errno;
    fprintf(stderr, "%s: cannot create a directory in %s: %s\n", P->prog, base, strerror(e));
    dir[0] = '\0';
    return -e;
  }
  return 0;
}

/* Removes what lies below the directory path (a buffer of len bytes that
 * is extended in place), depth first; links are removed, not followed. */
static void remove_below(const struct procs *P, char *path, size_t len) {
  DIR *d = opendir(path);
  if (!d) {
    if (errno != ENOENT)
      fprintf(stderr, "%s: cannot read %s: %s\n", P->prog, path, strerror(errno));
    return;
  }
  size_t n = strlen(path);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    int w = snprintf(path + n, len - n, "/%s", e->d_name);
    if (w < 0 || (size_t)w >= len - n) {
      path[n] = '\0';
      fprintf(stderr, "%s: cannot remove %s/%s: %s\n", P->prog, path, e->d_name,
              strerror(ENAMETOOLONG));
      continue;
    }
    struct stat st;
    bool is_dir = lstat(path, &st) == 0 && S_ISDIR(st.st_mode);
    if (is_dir) remove_below(P, path, len);
    if ((is_dir ? rmdir(path) : unlink(path)) != 0 && errno != ENOENT)
      fprintf(stderr, "%s: cannot remove %s: %s\n", P->prog, path, strerror(errno));
    path[n] = '\0';
  }
  closedir(d);
}

void procs_remove_dir(const struct procs *P, const char *dir) {
  if (!dir[0]) return;
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s", dir);
  remove_below(P, path, sizeof(path));
  if (rmdir(dir) != 0 && errno != ENOENT)
    fprintf(stderr, "%s: cannot remove %s: %s\n", P->prog, dir, strerror(errno));
}

int procs_open_log(const struct procs *P, const char *path) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    int e = errno;
    fprintf(stderr, "%s: cannot create %s: %s\n", P->prog, path, strerror(e));
    return -e;
  }
  return fd;
}

/* Reads the last len - 1 bytes of path (at most) into buf, NUL-terminated;
 * *start is where its first whole line begins (after the line the window
 * cut, if any). Returns the bytes read, or a negative errno. */
static long read_tail(const char *path, char *buf, size_t len, const char **start) {
  *start = buf;
  buf[0] = '\0';
  FILE *f = fopen(path, "r");
  if (!f) return -errno;
  long skip = 0;
  if (fseek(f, 0, SEEK_END) == 0 && ftell(f) > (long)len - 1) skip = ftell(f) - (long)len + 1;
  fseek(f, skip, SEEK_SET);
  size_t n = fread(buf, 1, len - 1, f);
  fclose(f);
  buf[n] = '\0';
  if (skip > 0 && strchr(buf, '\n')) *start = strchr(buf, '\n') + 1; /* a cut first line */
  return (long)n;
}

void procs_print_log_tail(const struct procs *P, const char *path, bool full_path, int lines) {
  const char *shown = full_path || !strrchr(path, '/') ? path : strrchr(path, '/') + 1;
  char buf[16384];
  const char *start;
  long n = read_tail(path, buf, sizeof(buf), &start);
  if (n < 0) {
    fprintf(stderr, "%s: (cannot read %s: %s)\n", P->prog, path, strerror((int)-n));
    return;
  }
  if (n == 0) {
    fprintf(stderr, "%s: (its log %s is empty)\n", P->prog, shown);
    return;
  }
  size_t len = strlen(start);
  if (len == 0) return;
  int seen = 0;
  size_t i = len;
  if (i > 0 && start[i - 1] == '\n') i--;
  while (i > 0) {
    if (start[i - 1] == '\n' && ++seen == lines) break;
    i--;
  }
  fprintf(stderr, "---- last lines of %s ----\n%s%s----\n", shown, start + i,
          start[len - 1] == '\n' ? "" : "\n");
}
