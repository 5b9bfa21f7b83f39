/* server_options: ps-server's option table (see server_options.h). */
#include "server_options.h"

#include <stddef.h>

#include "conn_transports.h"
#include "log.h"
#include "net.h"
#include "optimizer.h"
#include "server.h"
#include "store.h"

#define CONFIG_STRUCT struct server_config
static const struct config_option server_options[] = {
    CONFIG_CHOICE("listen", listen, "0.0.0.0:7070", net_listen_addr_check,
                  "address to accept workers on (host:port; port 0 picks a free one)"),
    CONFIG_CHOICE(
        "transport", transport, "tcp", conn_transport_check,
        "tcp, or ucx: UCX active messages (RDMA verbs, shared memory or TCP, as UCX finds; "
        "UCX_TLS forces a set); workers must use the same"),
    CONFIG_OPT("port-file", CONFIG_STRING, port_file, "", 0, 0,
               "write the bound host:port to this file once listening (launchers, tests)"),
    CONFIG_OPT("shard", CONFIG_STRING, shard, "auto", 0, 0,
               "this shard's id: a number, or auto = pod index (PS_POD_INDEX or hostname name-N)"),
    CONFIG_OPT("num-shards", CONFIG_INT, num_shards, "1", 1, 4096, "number of shards in the job"),
    CONFIG_OPT("num-workers", CONFIG_INT, num_workers, "1", 1, 65536,
               "number of workers in the job"),
    CONFIG_CHOICE(
        "consistency", consistency, "bsp", store_consistency_check,
        "bsp (all workers' step-v gradients make version v+1), asp (each push applied on "
        "arrival) or ssp:K (asp, but no worker reads more than K clocks ahead of the slowest)"),
    CONFIG_OPT("staleness-aware", CONFIG_BOOL, staleness_aware, "true", 0, 0,
               "asp and ssp:K: account for each update's staleness (the updates applied since the "
               "parameters its gradient was computed on were pulled), as --staleness-method says"),
    CONFIG_CHOICE(
        "staleness-method", staleness_method, "lookahead", store_staleness_method_check,
        "lookahead (with --optimizer momentum: a velocity per worker, and the shard serves "
        "the parameters where the next round of pushes will take them, DANA, Hakimi et al. "
        "2019; an update staler than one round is also divided; W+1 floats of state per "
        "parameter; other optimizers divide) or divide (every update divided by its "
        "staleness + 1, Zhang et al. 2016)"),
    CONFIG_CHOICE(
        "optimizer", optimizer, "sgd", opt_check,
        "update applied to the aggregated gradient (torch.optim semantics): sgd, momentum, adam, "
        "adamw (decoupled weight decay), or sum (bsp only: the shard returns the mean gradient "
        "and the workers run the optimizer)"),
    CONFIG_OPT("lr", CONFIG_DOUBLE, lr, "0.1", 0, 1e6, "learning rate"),
    CONFIG_OPT("momentum", CONFIG_DOUBLE, momentum, "0.9", 0, 1,
               "momentum factor (--optimizer momentum)"),
    CONFIG_OPT("nesterov", CONFIG_BOOL, nesterov, "false", 0, 0,
               "Nesterov momentum (--optimizer momentum)"),
    CONFIG_OPT("weight-decay", CONFIG_DOUBLE, weight_decay, "0", 0, 1,
               "weight decay: an L2 term added to the gradient (sgd, momentum, adam), or decoupled "
               "p *= 1 - lr * wd (adamw; torch's AdamW default is 0.01)"),
    CONFIG_OPT("beta1", CONFIG_DOUBLE, beta1, "0.9", 0, 0.999999, "Adam's first-moment decay"),
    CONFIG_OPT("beta2", CONFIG_DOUBLE, beta2, "0.999", 0, 0.999999, "Adam's second-moment decay"),
    CONFIG_OPT("eps", CONFIG_DOUBLE, eps, "1e-8", 0, 1, "Adam's denominator term"),
    CONFIG_OPT("lr-decay-steps", CONFIG_INT, lr_decay_steps, "0", 0, 9.2e18,
               "cosine-anneal the learning rate to 0 over this many worker steps (0 = constant)"),
    CONFIG_OPT("worker-timeout", CONFIG_DOUBLE, worker_timeout, "60", 0, 1e7,
               "seconds a worker may stay disconnected before --on-worker-timeout applies "
               "(0 = wait for it forever)"),
    CONFIG_OPT("first-worker-timeout", CONFIG_DOUBLE, first_worker_timeout, "0", 0, 1e7,
               "seconds to wait for the first layout (no worker ever connected, and no checkpoint "
               "was loaded) before the shard exits 1 (permanent: its workers are not coming); "
               "0 = wait forever (a Job's shards set it; a StatefulSet's wait for their workers)"),
    CONFIG_CHOICE(
        "on-worker-timeout", on_worker_timeout, "auto", server_timeout_action_check,
        "auto: fail with --optimizer sum (the parameters live on the workers: a restarted "
        "one could not rejoin), continue with an optimizer on the shard (a restarted worker "
        "pulls the current parameters); fail: an error to every waiting request, every worker "
        "and the shard exit 129 (retryable: the job restarts); continue: go on with the live "
        "workers, averaging over those that pushed, never silently (an error line, "
        "ps_server_workers_lost_total, the stats' lost ranks); a worker that comes back rejoins"),
    CONFIG_OPT("max-frame-bytes", CONFIG_SIZE, max_frame_bytes, "64MiB", 4, 4294967295.0,
               "largest payload of one frame; larger frames are refused before allocation"),
    CONFIG_CHOICE("log-level", log_level, "info", log_level_check,
                  "debug, info, warn, error or off"),
    CONFIG_CHOICE(
        "http", http, HTTP_DEFAULT, net_listen_addr_or_empty_check,
        "address of /metrics, /healthz and /readyz (host:port; empty = off). If the default "
        "address is taken (another shard on this host) the shard runs without it"),
    CONFIG_OPT(
        "exit-when-done", CONFIG_BOOL, exit_when_done, "true", 0, 0,
        "exit 0 once worker 0 ends the training; false = stop serving workers but keep "
        "/metrics up until SIGTERM (Kubernetes restarts a StatefulSet container that exits)"),
    CONFIG_OPT(
        "fail-on-signal", CONFIG_BOOL, fail_on_signal, "false", 0, 0,
        "exit 128+N (143 for SIGTERM) when signal N stops the shard before worker 0 ended the "
        "training, after the same drain and final checkpoint, instead of 0: a Job's shards set it "
        "(a pod evicted mid-training that exits 0 counts as done, and its index is not run "
        "again; 143 makes the Job start a new pod, which resumes from the checkpoint)"),
    CONFIG_CHOICE(
        "checkpoint-dir", checkpoint_dir, "", ckpt_dir_check,
        "directory of this shard's checkpoints (empty = none; created if missing, must be "
        "writable): this job's newest valid one is loaded at start, SIGTERM finishes started "
        "steps and writes a final one"),
    CONFIG_OPT("checkpoint-every", CONFIG_INT, checkpoint_every, "0", 0, 9.2e18,
               "write a checkpoint every this many versions (bsp: steps), from a writer thread "
               "(0 = only the final one)"),
    CONFIG_OPT(
        "checkpoint-max-failures", CONFIG_INT, checkpoint_max_failures, "3", 0, 1000000,
        "checkpoint writes failing this many times in a row (full or read-only disk) stop the "
        "job: an error to every waiting request, the shard exits 3 (permanent: the volume needs "
        "an operator); 0 = train on without checkpoints (each failure still logged, counted)"),
    CONFIG_CHOICE(
        "job-id", job_id, "", ckpt_job_id_check,
        "this job's name, written into its checkpoints (printable, at most 64 bytes): only "
        "this job's are loaded and pruned, another job's in the same directory (a reused "
        "volume) are reported and left alone. Empty = the unnamed job (and format-1 files)"),
    CONFIG_OPT(
        "auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
        "file holding the job's shared secret (16..4096 bytes; a Kubernetes Secret): workers "
        "must prove it and every frame is authenticated. Empty = anyone can connect (warned)"),
    CONFIG_OPT("reject-nonfinite", CONFIG_BOOL, reject_nonfinite, "true", 0, 0,
               "refuse (and count) pushed gradients and initial values holding NaN or Inf"),
    CONFIG_OPT("max-connections", CONFIG_INT, max_connections, "1024", 1, 1000000,
               "connections open at once; more are closed at accept"),
    CONFIG_OPT("max-output-queue-bytes", CONFIG_SIZE, max_output_queue_bytes, "256MiB", 65536,
               1099511627776.0,
               "replies queued for one client that does not read them: above 1/4 of this the shard "
               "stops reading from it, above all of it the connection is closed"),
    CONFIG_OPT("max-waiting-pulls", CONFIG_INT, max_waiting_pulls, "65536", 1, 100000000,
               "pulls that may wait for a version on one connection"),
    CONFIG_OPT("handshake-timeout", CONFIG_DOUBLE, handshake_timeout, "10", 0, 1e6,
               "seconds a new connection has to finish hello (and authentication); 0 = no limit"),
    CONFIG_OPT("frame-timeout", CONFIG_DOUBLE, frame_timeout, "60", 0, 1e6,
               "seconds a frame may take to arrive once its first byte came (slow senders); 0 = no "
               "limit"),
    CONFIG_OPT("idle-timeout", CONFIG_DOUBLE, idle_timeout, "300", 0, 1e7,
               "seconds a connection may send nothing while no request of it waits; 0 = no limit"),
    CONFIG_OPT("tcp-user-timeout", CONFIG_DOUBLE, tcp_user_timeout, "60", 0, 3600,
               "seconds sent data may stay unacknowledged before the connection breaks "
               "(TCP_USER_TIMEOUT); 0 = kernel default"),
};

const struct config_spec server_spec = {
    "ps-server",
    "a parameter-server shard: aggregates pushed gradients, applies the optimizer, serves pulls",
    server_options, sizeof(server_options) / sizeof(server_options[0]), NULL};
