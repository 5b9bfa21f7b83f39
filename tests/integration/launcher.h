/* launcher: runs of tools/ps-local for the tests that check it end to end
 * (test_local_launcher, test_launch_command), and what they look for once
 * it has exited: processes it left running and files it left behind.
 *
 * Every run gets TMPDIR set to a private directory of the test, so the test
 * can see that ps-local removed its temp dir. A test that calls
 * launcher_leftovers must make itself a child subreaper
 * (PR_SET_CHILD_SUBREAPER) first: a child orphaned by ps-local is then
 * re-parented to the test instead of to init, so "no live process has us as
 * its parent once ps-local is reaped" proves that nothing was left running.
 * Processes whose command line names a given string count as well. */
#ifndef PS_TEST_LAUNCHER_H
#define PS_TEST_LAUNCHER_H

#include <sys/types.h>

enum { LAUNCHER_MAX_ARGS = 47 };

struct launcher_run {
  const char *argv[LAUNCHER_MAX_ARGS + 2];
  char out[512], err[512]; /* files holding its stdout and stderr */
  char tmpdir[512];        /* its TMPDIR */
};

/* Starts ps-local with the options opts (NULL-terminated, at most
 * LAUNCHER_MAX_ARGS; they must outlive the run) and our environment; tag
 * names its files in harness_dir(). Returns its pid. */
pid_t launcher_start(struct launcher_run *r, const char *tag, const char *const *opts);

/* launcher_start, then waits for it to exit (timeout_s at most: a REQUIRE
 * fails after showing its stderr). Returns its wait status. */
int launcher_run(struct launcher_run *r, const char *tag, const char *const *opts, int timeout_s);

/* A wait status as a shell shows it: the exit code, or 128 + the signal. */
int launcher_exit_code(int status);

/* Copies the file at path to stderr under a header (nothing if it is missing). */
void launcher_show(const char *path);

/* Entries of dir other than . and .., or -1 if it cannot be read. */
int launcher_dir_entries(const char *dir);

/* Live processes of ours: children of this (subreaper) process, or whose
 * command line holds needle. Waits up to 3 s for them to go (the kernel
 * takes a moment to tear down a process that PR_SET_PDEATHSIG killed;
 * seconds for an ASan one), then kills and reports what still runs, and
 * returns how many that were. */
int launcher_leftovers(const char *needle);

/* Live (not zombie) children of parent. */
int launcher_count_children(pid_t parent);

#endif
