/* worker_options: ps-worker's option table (see options.h). The enumerated values
 * are checked by the parsers of the modules that own them (libps, the
 * device, the log, the UCX link), so ps-local refuses a typo with the same
 * words before anything starts. */
#include "worker_options.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>

#include "blas_kernel.h"
#include "collective.h"
#include "device.h"
#include "log.h"
#include "net.h"
#include "ps.h"
#include "ucx_link.h"

/* libps's parsers (a public API returns ps_status) as config_check_fns. */
static int check_sync_mode(const char *value, char *err, size_t errlen) {
  ps_sync_mode mode;
  return ps_sync_mode_parse(value, &mode, err, errlen) == PS_OK ? 0 : -EINVAL;
}

/* --peer-listen: empty, or host:port with a real port (the ring's peers
 * are told this rank's port, so 0 cannot stand for "any"). */
static int check_peer_listen(const char *value, char *err, size_t errlen) {
  struct net_addr a;
  return value[0] ? net_parse_addr(value, &a, 0, err, errlen) : 0;
}

static int check_backend(const char *value, char *err, size_t errlen) {
  ps_coll_backend backend;
  return ps_coll_backend_parse(value, &backend, err, errlen) == PS_OK ? 0 : -EINVAL;
}

/* --allreduce-algorithm */
const char *const worker_algo_names[WORKER_NUM_ALGOS] = {"auto", "ring", "node-first"};

static int check_algorithm(const char *value, char *err, size_t errlen) {
  return config_choice(value, worker_algo_names, WORKER_NUM_ALGOS, err, errlen) < 0 ? -EINVAL : 0;
}

static int check_blas_kernel(const char *value, char *err, size_t errlen) {
  return ps_blas_kernel_check(value, err, errlen) == PS_OK ? 0 : -EINVAL;
}

/* --pipeline-schedule: the names of ps_pipe_schedule (pipeline.h), in its order;
 * ps_pipe_schedule_parse reads the same words. */
const char *const worker_schedule_names[WORKER_NUM_SCHEDULES] = {"gpipe", "1f1b", "interleaved",
                                                                 "zb-h1"};

static int check_schedule(const char *value, char *err, size_t errlen) {
  return config_choice(value, worker_schedule_names, WORKER_NUM_SCHEDULES, err, errlen) < 0
             ? -EINVAL
             : 0;
}

#define CONFIG_STRUCT struct worker_config
static const struct config_option worker_options[] = {
    CONFIG_CHOICE(
        "sync-mode", sync_mode, "ps", check_sync_mode,
        "how gradients are synchronised: ps (parameter-server shards) or allreduce (ring of "
        "workers)"),
    CONFIG_OPT("servers", CONFIG_STRING, servers, "", 0, 0,
               "shard addresses h:p,h:p (shard 0 first)"),
    CONFIG_CHOICE(
        "transport", transport, "tcp", ulink_transport_check,
        "push/pull to the shards over tcp, or ucx: UCX active messages (RDMA verbs, shared "
        "memory or TCP, as UCX finds; UCX_TLS forces a set); the shards must use the same"),
    CONFIG_OPT("server-template", CONFIG_STRING, server_template, "", 0, 0,
               "shard address with {i}, e.g. ps-server-{i}.ps-server:7070 (with --num-shards)"),
    CONFIG_OPT("num-shards", CONFIG_INT, num_shards, "0", 0, MAX_SHARDS,
               "number of shards for --server-template"),
    CONFIG_OPT(
        "rank", CONFIG_STRING, rank, "0", 0, 0,
        "this worker's rank: a number, or auto = pod index (PS_POD_INDEX or hostname name-N)"),
    CONFIG_OPT("world-size", CONFIG_INT, world_size, "1", 1, 65536, "number of workers"),
    CONFIG_OPT("data", CONFIG_STRING, data, "/usr/share/datasets/fashion-mnist", 0, 0,
               "directory with the IDX files (train-*, t10k-*; raw or .gz)"),
    CONFIG_OPT("model", CONFIG_STRING, model, "mlp:784-256-10", 0, 0,
               "model: mlp:IN-HIDDEN...-OUT"),
    CONFIG_CHOICE(
        "device", device, "auto", device_kind_check,
        "where the model computes: auto (a CUDA GPU when one is usable, else the CPU), cpu or "
        "cuda"),
    CONFIG_OPT("epochs", CONFIG_INT, epochs, "3", 1, 100000, "passes over the training set"),
    CONFIG_OPT("batch-size", CONFIG_INT, batch_size, "128", 1, 65536,
               "samples per step on this worker"),
    CONFIG_OPT("seed", CONFIG_INT, seed, "1", 0, 9.2e18,
               "seed of the initial weights and the data order"),
    CONFIG_OPT(
        "auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
        "file holding the job's shared secret (a Kubernetes Secret): authenticates this worker "
        "to the shards or ring peers and every frame it sends or takes. Empty = no "
        "authentication (warned)"),
    CONFIG_OPT("max-steps", CONFIG_INT, max_steps, "0", 0, 9.2e18,
               "stop after this many steps (0 = no limit)"),
    CONFIG_OPT("log-every", CONFIG_INT, log_every, "50", 1, 1e9,
               "steps between progress lines when stderr is not a terminal"),
    CONFIG_OPT("dump-params", CONFIG_STRING, dump_params, "", 0, 0,
               "write the final parameters here (raw float32, tensor order; rank 0)"),
    CONFIG_OPT("job-id", CONFIG_STRING, job_id, "ps-job", 0, 0, "job name shown to the shards"),
    CONFIG_OPT("connect-timeout-ms", CONFIG_INT, connect_timeout_ms, "60000", -1, 1e9,
               "how long to keep trying to reach the shards or ring peers at start (-1 = forever; "
               "0 is refused)"),
    CONFIG_OPT("chunk-bytes", CONFIG_SIZE, chunk_bytes, "0", 0, 1073741824.0,
               "largest key: tensors are cut into chunks of at most this size; 0 = auto: 4 MiB, or "
               "less so that a model smaller than 4 MiB per shard still spreads over every shard"),
    CONFIG_OPT(
        "grad-blocks", CONFIG_BOOL, grad_blocks, "true", 0, 0,
        "compute the first layer's weight gradient in pieces (one per key, or per all-reduce "
        "bucket) and send each as soon as it is computed; false = in one piece"),
    CONFIG_CHOICE("log-level", log_level, "info", log_level_check,
                  "debug, info, warn, error or off"),
    CONFIG_CHOICE(
        "http", http, "", net_listen_addr_or_empty_check,
        "address of /metrics, /healthz and /readyz (host:port, e.g. 0.0.0.0:9091; empty = off)"),
    CONFIG_OPT(
        "exit-when-done", CONFIG_BOOL, exit_when_done, "true", 0, 0,
        "exit 0 when training is done; false = release everything but keep /metrics up until "
        "SIGTERM (Kubernetes restarts a StatefulSet container that exits, even with 0)"),
    CONFIG_OPT("peers", CONFIG_STRING, peers, "", 0, 0,
               "allreduce: ring peer addresses h:p,h:p (rank 0 first, --world-size of them)"),
    CONFIG_OPT("peer-template", CONFIG_STRING, peer_template, "", 0, 0,
               "allreduce: ring peer address with {i}, e.g. ps-worker-{i}.ps-worker:7071"),
    CONFIG_CHOICE(
        "peer-listen", peer_listen, "", check_peer_listen,
        "allreduce: where to listen for ring peers (default 0.0.0.0 and this rank's peer port)"),
    CONFIG_OPT(
        "peer-listen-fd", CONFIG_INT, peer_listen_fd, "0", 0, 1e6,
        "allreduce: an inherited listening socket to use instead (launchers that bind the ports)"),
    CONFIG_CHOICE("allreduce-backend", allreduce_backend, "tcp", check_backend,
                  "allreduce: tcp (ring over TCP) or nccl (GPUs; TCP only to bootstrap)"),
    CONFIG_CHOICE(
        "allreduce-algorithm", allreduce_algorithm, "auto", check_algorithm,
        "allreduce (tcp): ring (one ring of every rank), node-first (reduce within each "
        "--node-name first, all-reduce among one leader per node, send the result back within "
        "the node: far less crosses between nodes) or auto (node-first where --node-name "
        "puts several ranks on a node and there are several nodes, else ring)"),
    CONFIG_OPT(
        "node-name", CONFIG_STRING, node_name, "", 0, 0,
        "allreduce: the node (host) this rank runs on, for --allreduce-algorithm; Kubernetes: "
        "spec.nodeName through the downward API (empty = unknown)"),
    CONFIG_OPT("fusion-bytes", CONFIG_SIZE, fusion_bytes, "256KiB", 0, 1073741824.0,
               "allreduce: gradients are fused into buckets of at most this size (0 = none)"),
    CONFIG_OPT(
        "shard-optimizer-state", CONFIG_BOOL, shard_optimizer_state, "false", 0, 0,
        "allreduce: ZeRO-1: gradients reduce-scattered, each rank keeps the optimizer state of "
        "and updates 1/W of the parameters, then all-gathers them (tcp backend; no "
        "--checkpoint-dir yet)"),
    CONFIG_OPT("lr", CONFIG_DOUBLE, lr, "0.1", 0, 1e6,
               "allreduce: learning rate of the local optimizer"),
    CONFIG_OPT("momentum", CONFIG_DOUBLE, momentum, "0.9", 0, 1,
               "allreduce: momentum of the local optimizer (0 = plain SGD)"),
    CONFIG_OPT(
        "lr-decay-steps", CONFIG_INT, lr_decay_steps, "0", 0, 9.2e18,
        "allreduce: cosine-anneal the learning rate to 0 over this many steps (0 = constant)"),
    CONFIG_OPT("peer-timeout-ms", CONFIG_INT, peer_timeout_ms, "10000", 100, 1e8,
               "allreduce: a ring peer silent this long is lost (a dead one is noticed at once)"),
    CONFIG_OPT("checkpoint-dir", CONFIG_STRING, checkpoint_dir, "", 0, 0,
               "allreduce: this rank's checkpoints (parameters, momentum, step); a restarted ring "
               "resumes from the newest step every rank holds (empty = none)"),
    CONFIG_OPT(
        "checkpoint-every", CONFIG_INT, checkpoint_every, "0", 0, 9.2e18,
        "allreduce: write a checkpoint every this many steps (0 = none; needs --checkpoint-dir)"),
    CONFIG_OPT("checkpoint-max-failures", CONFIG_INT, checkpoint_max_failures, "3", 0, 1e6,
               "allreduce: a checkpoint write that fails this many times in a row stops the worker "
               "(exit 1); 0 = log each failure and keep training"),
    CONFIG_CHOICE(
        "blas-kernel", blas_kernel, "auto", check_blas_kernel,
        "OpenBLAS kernel: auto (if OpenBLAS fell back to a kernel below the best one this CPU "
        "runs, the worker re-executes itself once with that one; OPENBLAS_CORETYPE in the "
        "environment is kept), keep (OpenBLAS's own pick) or a kernel this CPU runs, e.g. "
        "SkylakeX, Haswell, Zen"),
    CONFIG_OPT("tensor-parallel", CONFIG_INT, tensor_parallel, "1", 1, 1024,
               "model parallelism: ranks each layer is split over (Megatron-LM column/row "
               "pairs); --world-size must be a multiple of it times --pipeline-stages"),
    CONFIG_OPT("pipeline-stages", CONFIG_INT, pipeline_stages, "1", 1, 256,
               "model parallelism: stages the layers are cut into (balanced by cost); the rest of "
               "--world-size is data parallelism"),
    CONFIG_OPT("micro-batches", CONFIG_INT, micro_batches, "1", 1, 4096,
               "model parallelism: micro-batches per step (--batch-size must be a multiple); "
               "their gradients are accumulated"),
    CONFIG_CHOICE("pipeline-schedule", pipeline_schedule, "1f1b", check_schedule,
                  "model parallelism: gpipe, 1f1b, interleaved (--pipeline-chunks model chunks "
                  "per rank; --micro-batches a multiple of --pipeline-stages) or zb-h1 "
                  "(zero bubble)"),
    CONFIG_OPT("pipeline-chunks", CONFIG_INT, pipeline_chunks, "2", 1, 16,
               "model parallelism: model chunks per rank of --pipeline-schedule interleaved "
               "(ignored by the other schedules)"),
};

const struct config_spec worker_spec = {
    "ps-worker",
    "a data-parallel training worker (Fashion-MNIST MLP on CPU via BLAS; parameter server or "
    "ring all-reduce)",
    worker_options, sizeof(worker_options) / sizeof(worker_options[0]), NULL};
