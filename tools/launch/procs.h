/* procs: the child processes of a single-threaded launcher (ps-local,
 * ps-bench): signals, starting, reaping and stopping children, the port
 * files of the ps-server shards they start, their logs and the private
 * directory those live in.
 *
 * Signals. procs_init blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD and reads
 * them from a signalfd, which the launcher polls next to its own
 * descriptors (procs_signal_fd): a signal that arrives between a check and
 * a wait stays readable on the fd, so none is lost, and nothing runs in a
 * handler. They stay blocked until exit (procs_deinit leaves the mask), so a
 * late second Ctrl-C cannot kill the launcher after it chose its exit code.
 *
 * Children. Every child is started through a struct procs (procs_spawn runs
 * a program, procs_fork the launcher's own code), which keeps it on its
 * list, and is reaped only by procs_reap, which waits for any pid that
 * exited and records the status in that child's struct procs_child. A child
 * starts with the launcher's old signal mask, SIGPIPE at its default and
 * PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILL of the launcher leaves no
 * orphan; it stays in the launcher's process group, so a terminal's Ctrl-C
 * and Ctrl-Z reach it as well. A spawned program reads /dev/null, inherits
 * no descriptor of ours but the one procs_io.keep_fd names, and gets our
 * environment or the one procs_io.env gives (struct procs_env); an exec
 * that fails is reported back through a close-on-exec pipe, so a wrong path
 * reads as such and not as a child that never became ready.
 *
 * Port files. ps-server --port-file writes its bound address to a
 * temporary file and renames it into place, so a port file that exists
 * holds a whole line; procs_wait_port looks for it until a deadline and
 * returns early whenever a signal or a child's exit waits to be handled.
 *
 * Errors of system calls are reported here, once, on stderr, prefixed with
 * the launcher's name; what a failure means for the launcher's options (a
 * failed exec, a shard that never wrote its port file) it says itself. */
#ifndef PS_PROCS_H
#define PS_PROCS_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

enum { PROCS_NAME_BYTES = 64 };

/* One child. The launcher embeds it in its own record of the child and
 * reads the fields; only procs.c writes them. */
struct procs_child {
  char name[PROCS_NAME_BYTES]; /* for messages: "ps-server shard 0" */
  pid_t pid;                   /* 0 until started */
  bool running;                /* started and not reaped yet */
  bool signalled;              /* procs_kill sent it a signal: its death is not its failure */
  int status;                  /* wait status, once reaped */
  struct procs_child *next;    /* the list of started children */
};

/* The launcher's side: one per process, set up by procs_init; its fields
 * are procs.c's. */
struct procs {
  const char *prog;         /* prefix of our messages */
  int sig_fd;               /* the signalfd; -1 if procs_init failed */
  int stop_signal;          /* the first SIGINT, SIGTERM or SIGHUP read; 0 = none */
  sigset_t old_mask;        /* the mask before procs_init: restored in children */
  pid_t self;               /* a child checks that we are still its parent */
  struct procs_child *kids; /* every child started, newest first */
};

/* Where a spawned program's output goes and what it inherits. */
struct procs_io {
  int out_fd;  /* its stdout; -1 = ours */
  int err_fd;  /* its stderr; -1 = ours */
  int keep_fd; /* a descriptor it keeps across exec (all others are close-on-exec); -1 = none */
  char *const *env; /* its environment (NULL-terminated NAME=value); NULL = ours */
};

/* A child's environment, built from ours: procs_env_init copies environ,
 * procs_env_set and procs_env_unset change the copy, and procs_env_vars is
 * what procs_io.env takes. A failed allocation is sticky: the calls after it
 * do nothing and procs_env_vars returns NULL, so the caller checks once. */
struct procs_env {
  char **vars; /* NULL-terminated; each string owned */
  size_t len, cap;
  bool failed;
};

/* Copies our environment into e. Returns 0 or -ENOMEM (e->failed). */
int procs_env_init(struct procs_env *e);

/* Sets name to the printf-formatted value, replacing any earlier value. */
void procs_env_set(struct procs_env *e, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Removes name, if present. */
void procs_env_unset(struct procs_env *e, const char *name);

/* The variables for procs_io.env, or NULL if an allocation failed. */
char *const *procs_env_vars(const struct procs_env *e);

/* Frees e's strings; e may be re-initialised. NULL is fine. */
void procs_env_deinit(struct procs_env *e);

/* Blocks the four signals and opens the signalfd; prog prefixes every
 * message (it must outlive P). Descriptors 0-2 that are closed are opened on
 * /dev/null first, so no socket of ours can take one of their numbers (a
 * child's stdio would replace it). Returns 0 or a negative errno after
 * saying why. */
int procs_init(struct procs *P, const char *prog);

/* Closes the signalfd; the children are the caller's to have reaped (or
 * killed, procs_kill_all) before. The signals stay blocked. NULL is fine. */
void procs_deinit(struct procs *P);

/* The signalfd, for the launcher's poll: readable when a signal or a
 * child's exit waits to be handled (procs_next_signal, procs_reap). */
int procs_signal_fd(const struct procs *P);

/* Reads the signalfd: returns the next SIGINT, SIGTERM or SIGHUP that
 * arrived, or 0 when none is left. SIGCHLD is read and dropped (procs_reap
 * finds exits by itself). The first stop signal is also kept in
 * P->stop_signal. */
int procs_next_signal(struct procs *P);

/* Reads every pending signal and returns the first stop signal ever
 * received (0 = none): for a launcher that stops at the first one. */
int procs_stop_signal(struct procs *P);

/* Clears c and names it "<what> <index>" for messages; before it starts. */
void procs_child_init(struct procs_child *c, const char *what, int index);

/* Forks a child that runs the caller's code. Returns 0 in the child (set up
 * as the header says, with the signalfd closed), its pid in the parent (c is
 * then running and on P's list), or a negative errno after saying why. */
pid_t procs_fork(struct procs *P, struct procs_child *c);

/* Runs argv (argv[0] with a '/' is a path, otherwise looked up in PATH) as
 * child c, with stdout, stderr and the kept descriptor as io says (NULL:
 * ours, nothing kept). Returns 0 once it runs. A negative errno with
 * c->running false means it never started (said here); with c->running
 * true the exec failed with that errno: the child exits 127, and what to
 * tell the user is the caller's to say. */
int procs_spawn(struct procs *P, struct procs_child *c, const char *const *argv,
                const struct procs_io *io);

/* Reaps one exited child without waiting: returns the child of ours it
 * was, its status recorded and running false, or NULL when none is left to
 * reap. Exits of pids not started through P are reaped and skipped. */
struct procs_child *procs_reap(struct procs *P);

/* Sends sig to c if it still runs and marks it signalled. */
void procs_kill(struct procs_child *c, int sig);

/* Waits up to timeout_ms for c to exit, reaping every child that does.
 * Returns 0 once c was reaped, -EINTR as soon as a stop signal has arrived
 * (procs_stop_signal), -ETIMEDOUT after timeout_ms. */
int procs_wait(struct procs *P, struct procs_child *c, int timeout_ms);

/* SIGKILL to every child still running, then waits for each: after a
 * failure, when nobody is to be waited for politely. */
void procs_kill_all(struct procs *P);

/* Whether a running child is stopped, from the state in /proc/PID/stat. */
enum procs_stop {
  PROCS_NOT_STOPPED = 0, /* running, sleeping, exiting, or not running at all */
  PROCS_STOPPED,         /* state T: SIGSTOP, SIGTSTP, SIGTTIN or SIGTTOU */
  PROCS_TRACED,          /* state t: stopped by a tracer (a debugger) */
};

/* How c stands (above); for PROCS_STOPPED, *sig gets the signal that
 * stopped it (0 if the kernel does not say; nothing here ever consumes that
 * report, since procs_reap waits for exits only). Safe on any child of
 * ours: its pid is not reused before we reap it. */
enum procs_stop procs_stopped(const struct procs_child *c, int *sig);

/* True if c exited by itself with status 0. */
bool procs_exited_ok(const struct procs_child *c);

/* "exit status 1", "killed by signal 9, Killed": a wait status for a
 * message. Returns buf. */
const char *procs_describe(int status, char *buf, size_t len);

/* Reads the address a ps-server wrote to its port file: 1 with it in addr
 * (without the newline), 0 while the file does not exist yet. */
int procs_read_port_file(const char *path, char *addr, size_t len);

/* Waits until path holds an address (procs_read_port_file), looking every
 * 10 ms. Returns 0 with the address in addr, -ETIMEDOUT once deadline_ms
 * (clock_now_ms) has passed, or -EINTR as soon as there is something for
 * the launcher to handle before it calls again: a signal on the signalfd,
 * or a child that exited and is not reaped yet (even if its SIGCHLD was
 * read already). */
int procs_wait_port(struct procs *P, const char *path, char *addr, size_t len,
                    uint64_t deadline_ms);

/* Creates a private directory <$TMPDIR or /tmp>/<prog>-XXXXXX (mkdtemp,
 * mode 0700) into dir. Returns 0, or a negative errno after saying why (dir
 * is then ""). */
int procs_make_tmpdir(const struct procs *P, char *dir, size_t len);

/* Removes dir and everything below it, saying what could not be removed.
 * "" is fine (nothing to remove). */
void procs_remove_dir(const struct procs *P, const char *dir);

/* Creates (truncates) a child's log file for writing, close-on-exec.
 * Returns the descriptor, or a negative errno after saying why. */
int procs_open_log(const struct procs *P, const char *path);

/* Prints the last `lines` lines of a child's log (of its last 16 KiB) to
 * stderr under a header naming it: by its full path if it outlives us
 * (full_path), else by its file name. Says so if it is empty or cannot be
 * read. */
void procs_print_log_tail(const struct procs *P, const char *path, bool full_path, int lines);

#endif
