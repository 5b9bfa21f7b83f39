/* The 3D options refuse what cannot run, before anything starts (exit 2,
 * one line naming the option and why): a world size that is no multiple of
 * T*P, a layer width that --tensor-parallel does not divide, fewer layers
 * than stages, a batch that the micro-batches do not divide, a schedule's
 * shape it cannot run, a bad schedule name, the GPU with the 3D trainer,
 * ZeRO-1 and worker checkpoints in ps mode (allreduce mode takes both, 3D
 * too: test_3d_equivalence, test_3d_resume); ps-local refuses --workers
 * that is no multiple of T*P. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ring_workers.h"

#define PEERS2 "127.0.0.1:1,127.0.0.1:2"
#define PEERS4 "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4"

static int seq;

/* Runs bin with args; it must exit 2 and say each of want (NULL-ended). */
static void refused(const char *bin_rel, const char *const *args, const char *const *want) {
  char bin[512], log[512];
  harness_bin(bin_rel, bin, sizeof(bin));
  snprintf(log, sizeof(log), "%s/refused-%d.log", harness_dir(), ++seq);
  const char *argv[40] = {bin};
  int n = 1;
  for (int i = 0; args[i]; i++) argv[n++] = args[i];
  argv[n] = NULL;
  pid_t pid = harness_spawn(argv, NULL, log);
  int st = harness_wait(pid, 30000);
  REQUIRE(ring_exited(st, 2), "case %d (%s %s ...): exit status 0x%x, want exit 2", seq, bin_rel,
          args[0], st);
  for (int i = 0; want[i]; i++)
    REQUIRE(harness_grep(log, want[i]) > 0, "case %d: the message does not say \"%s\"", seq,
            want[i]);
  FILE *f = fopen(log, "r");
  char line[512] = "";
  if (f && fgets(line, sizeof(line), f)) printf("refused: %s", line);
  if (f) fclose(f);
}

#define W "ps-worker/ps-worker"
#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

int main(void) {
  refused(W,
          ARGS("--sync-mode", "allreduce", "--world-size", "6", "--tensor-parallel", "2",
               "--pipeline-stages", "2"),
          ARGS("--tensor-parallel 2", "--world-size 6 is not a multiple of 4"));
  refused(W,
          ARGS("--sync-mode", "allreduce", "--world-size", "2", "--peers", PEERS2, "--model",
               "mlp:784-63-10", "--tensor-parallel", "2"),
          ARGS("--tensor-parallel", "63"));
  refused(W,
          ARGS("--sync-mode", "allreduce", "--world-size", "4", "--peers", PEERS4, "--model",
               "mlp:784-10", "--pipeline-stages", "4"),
          ARGS("--pipeline-stages", "stages"));
  refused(W, ARGS("--batch-size", "30", "--micro-batches", "4"),
          ARGS("--micro-batches 4", "--batch-size 30 is not a multiple"));
  refused(W,
          ARGS("--sync-mode", "allreduce", "--world-size", "2", "--peers", PEERS2, "--model",
               "mlp:784-64-32-32-10", "--pipeline-stages", "2", "--batch-size", "96",
               "--micro-batches", "3", "--pipeline-schedule", "interleaved"),
          ARGS("--pipeline-schedule interleaved"));
  refused(W, ARGS("--pipeline-schedule", "zb-h2"), ARGS("--pipeline-schedule", "zb-h1"));
  refused(W,
          ARGS("--sync-mode", "allreduce", "--world-size", "2", "--peers", PEERS2, "--device",
               "cuda", "--tensor-parallel", "2"),
          ARGS("CPU only for now"));
  /* ZeRO-1 runs over the data-parallel group in allreduce mode; in ps mode
   * the shards hold the optimizer state */
  refused(W,
          ARGS("--sync-mode", "ps", "--servers", "127.0.0.1:1", "--world-size", "2",
               "--shard-optimizer-state", "true", "--pipeline-stages", "2"),
          ARGS("--shard-optimizer-state", "allreduce only"));
  /* worker checkpoints are allreduce mode's, 3D or not (test_3d_resume): in
   * ps mode the shards hold every slice and checkpoint it */
  refused(W,
          ARGS("--sync-mode", "ps", "--world-size", "2", "--peers", PEERS2, "--servers",
               "127.0.0.1:1", "--checkpoint-dir", "/tmp/x", "--pipeline-stages", "2"),
          ARGS("--checkpoint-dir", "allreduce only"));
  refused("tools/ps-local", ARGS("--workers", "6", "--tensor-parallel", "4"),
          ARGS("--workers 6 is not a multiple of 4"));
  return 0;
}
