/* allreduce-baseline: the same all-reduce measurement as allreduce-bench,
 * for OpenMPI's MPI_Allreduce (TCP only: --mca pml ob1 --mca btl tcp,self)
 * and Gloo over TCP, printed side by side, one line per size.
 *
 * One command: started without mpirun it re-executes itself under
 * `mpirun -np W` with those MCA options (plus --oversubscribe when W exceeds
 * the cores), so
 *     allreduce-baseline --world-size 2 --sizes 4K:256M
 * prints the table. MPI also carries Gloo's rendezvous (a FileStore in a
 * temporary directory that rank 0 creates and broadcasts).
 *
 * Per size and library: --warmup runs, rank 0 picks the iteration count that
 * fills --seconds and broadcasts it, a barrier, the timed loop in place on one
 * buffer, the mean time over ranks; then one checked run on the pattern
 * x_r[i] = ((131 i + 7 r) mod 61) - 30, whose sum is exact in float32, so
 * `wrong` counts elements that differ from the exact sum (over all ranks).
 * Gloo is measured with each of its all-reduce algorithms (ring, ring_chunked,
 * halving_doubling and the newer gloo::allreduce); the table shows the
 * fastest per size and its name, --all-gloo every one of them. busbw =
 * algbw * 2(W-1)/W in GB/s (1e9 bytes), as nccl-tests. C++ only because Gloo
 * is; built only when Gloo and MPI are found (meson).
 *
 * --collective allgather|reduce_scatter|reduce|alltoall|broadcast measures
 * OpenMPI's MPI_Allgather, MPI_Reduce_scatter_block, MPI_Reduce (root 0),
 * MPI_Alltoall and MPI_Bcast (root 0) instead, with allreduce-bench
 * --collective's sizes (the larger buffer, in W equal parts), inputs,
 * checks and busbw factors, next to Gloo's gloo::allgather,
 * ReduceScatterHalvingDoubling, gloo::reduce, gloo::alltoall and
 * gloo::broadcast. --collective sendrecv: every rank sends to rank+1 and
 * receives from rank-1 at once, MPI_Sendrecv against Gloo's unbound buffers
 * (send and recv posted, then both waited), busbw = algbw. */
/* Only MPI's C API is used; its C++ bindings do not build with -Werror. */
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/transport/tcp/device.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Options {
  int world = 2;
  std::vector<size_t> sizes;
  int warmup = 5;
  double seconds = 0.3;
  bool all_gloo = false;
  bool mpi = true, gloo = true;
  std::string collective = "allreduce";
};

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool parse_size(const std::string &s, size_t *out) {
  char *end;
  double v = strtod(s.c_str(), &end);
  std::string suf(end);
  double mul = 1;
  if (suf == "K" || suf == "k" || suf == "KiB")
    mul = 1024;
  else if (suf == "M" || suf == "MiB")
    mul = 1024.0 * 1024;
  else if (suf == "G" || suf == "GiB")
    mul = 1024.0 * 1024 * 1024;
  else if (!suf.empty())
    return false;
  if (end == s.c_str() || v <= 0) return false;
  *out = (size_t)(v * mul);
  return *out % 4 == 0;
}

bool parse_sizes(const std::string &s, std::vector<size_t> *out) {
  size_t colon = s.find(':');
  if (colon != std::string::npos) { /* FROM:TO[:FACTOR] */
    size_t colon2 = s.find(':', colon + 1), lo, hi;
    long factor = colon2 == std::string::npos ? 2 : atol(s.c_str() + colon2 + 1);
    if (!parse_size(s.substr(0, colon), &lo) ||
        !parse_size(s.substr(colon + 1,
                             colon2 == std::string::npos ? std::string::npos : colon2 - colon - 1),
                    &hi) ||
        lo > hi || factor < 2)
      return false;
    for (size_t v = lo; v <= hi; v *= (size_t)factor) out->push_back(v);
    return true;
  }
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    std::string e = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t v;
    if (!parse_size(e, &v)) return false;
    out->push_back(v);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return !out->empty();
}

int usage(const char *why) {
  if (why) fprintf(stderr, "allreduce-baseline: %s\n", why);
  fprintf(stderr,
          "usage: allreduce-baseline [--world-size W] [--sizes 4K:256M[:FACTOR] | 4K,1M,...] "
          "[--warmup N] [--seconds S] [--all-gloo] [--only mpi|gloo] [--collective NAME]\n"
          "  Measures MPI_Allreduce (OpenMPI over TCP) and Gloo's all-reduce algorithms;\n"
          "  re-runs itself under mpirun -np W when started directly.\n");
  return why ? 2 : 0;
}

float pattern(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 7u * (uint64_t)r) % 61u) - 30);
}

struct Result {
  double time_us = 0;
  double wrong = 0;
};

/* One measurement (the top of the file): fill, warm up, the timed loop of
 * run, then one checked run counted by wrong; the mean time over ranks and
 * the wrong elements summed over them. */
Result time_checked(const Options &o, int rank, int world, const std::function<void()> &fill,
                    const std::function<void()> &run, const std::function<double()> &wrong) {
  fill();
  double t0 = now_s();
  for (int w = 0; w < o.warmup; w++) run();
  long long iters = 0;
  if (rank == 0) {
    double each = (now_s() - t0) / o.warmup;
    iters = each > 0 ? (long long)(o.seconds / each) : 1000;
    if (iters < 3) iters = 3;
  }
  MPI_Bcast(&iters, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = now_s();
  for (long long i = 0; i < iters; i++) run();
  double us = (now_s() - t0) / iters * 1e6;
  fill();
  run();
  double bad = wrong();
  Result res;
  MPI_Allreduce(&us, &res.time_us, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  res.time_us /= world;
  MPI_Allreduce(&bad, &res.wrong, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return res;
}

/* Times fn (an in-place all-reduce of buf) as described at the top. */
Result measure(const Options &o, int rank, int world, float *buf, size_t count,
               const std::function<void()> &fn) {
  return time_checked(
      o, rank, world,
      [&] {
        for (size_t i = 0; i < count; i++) buf[i] = pattern(i, rank);
      },
      fn,
      [&] {
        double bad = 0;
        for (size_t i = 0; i < count; i++) {
          float sum = 0;
          for (int r = 0; r < world; r++) sum += pattern(i, r);
          bad += buf[i] != sum;
        }
        return bad;
      });
}

int run_collective(const Options &o, int rank, int world,
                   const std::shared_ptr<gloo::rendezvous::Context> &ctx) {
  const std::string &c = o.collective;
  bool split = c == "allgather" || c == "reduce_scatter" || c == "alltoall";
  bool p2p = c == "sendrecv";
  double factor = c == "reduce" || c == "broadcast" || p2p ? 1.0 : (double)(world - 1) / world;
  int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  size_t maxb = 0;
  for (size_t s : o.sizes) maxb = s > maxb ? s : maxb;
  std::vector<float> x(maxb / 4 + 16), y(maxb / 4 + 16);
  if (rank == 0) {
    char ver[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(ver, &len);
    char *nl = strchr(ver, '\n');
    if (nl) *nl = 0;
    printf("# allreduce-baseline: %s, world %d, op sum, float32; %s; Gloo over TCP 127.0.0.1\n",
           c.c_str(), world, ver);
    printf("# busbw = algbw * %s, GB/s = 1e9 bytes/s\n", factor == 1.0 ? "1" : "(W-1)/W");
    printf("#%12s %11s %9s %8s  %11s %9s %8s\n", "size", "mpi_us", "mpi_busbw", "mpi_wrong",
           "gloo_us", "gloo_busbw", "gloo_wrong");
  }
  uint32_t tag = 0;
  for (size_t want : o.sizes) {
    size_t per = want / 4 / (split ? world : 1), bytes = per * 4 * (split ? world : 1);
    int n = (int)per;
    auto fill = [&] {
      size_t k = c == "alltoall" || c == "reduce_scatter" ? per * world : per;
      for (size_t i = 0; i < k; i++) x[i] = pattern(i, rank);
    };
    /* where the result is: y (out of place), x (in place), or x + rank's chunk
     * (Gloo's reduce-scatter works in place) */
    auto wrong_in = [&](const float *res, bool root_only) {
      double bad = 0;
      for (size_t i = 0; i < per; i++) {
        float sum = 0, mine = 0;
        for (int q = 0; q < world; q++) {
          sum += pattern(i, q);
          mine += pattern(rank * per + i, q);
        }
        if (c == "allgather")
          for (int q = 0; q < world; q++) bad += res[q * per + i] != pattern(i, q);
        else if (c == "reduce_scatter")
          bad += res[i] != mine;
        else if (c == "reduce")
          bad += rank == 0 ? res[i] != sum : !root_only && res[i] != pattern(i, rank);
        else if (c == "alltoall")
          for (int q = 0; q < world; q++) bad += res[q * per + i] != pattern(rank * per + i, q);
        else if (p2p)
          bad += res[i] != pattern(i, prev);
        else
          bad += res[i] != pattern(i, 0);
      }
      return bad;
    };
    auto mpi_run = [&] {
      if (c == "allgather")
        MPI_Allgather(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
      else if (c == "reduce_scatter")
        MPI_Reduce_scatter_block(x.data(), y.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (c == "reduce")
        MPI_Reduce(rank == 0 ? MPI_IN_PLACE : x.data(), x.data(), n, MPI_FLOAT, MPI_SUM, 0,
                   MPI_COMM_WORLD);
      else if (c == "alltoall")
        MPI_Alltoall(x.data(), n, MPI_FLOAT, y.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
      else if (p2p)
        MPI_Sendrecv(x.data(), n, MPI_FLOAT, next, 0, y.data(), n, MPI_FLOAT, prev, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      else
        MPI_Bcast(x.data(), n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    };
    bool in_x = c == "reduce" || c == "broadcast";
    Result mpi = time_checked(o, rank, world, fill, mpi_run,
                              [&] { return wrong_in(in_x ? x.data() : y.data(), false); });
    auto sum_fn =
        static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>);
    std::shared_ptr<gloo::ReduceScatterHalvingDoubling<float>> rs;
    if (c == "reduce_scatter")
      rs = std::make_shared<gloo::ReduceScatterHalvingDoubling<float>>(
          ctx, std::vector<float *>{x.data()}, n * world, std::vector<int>(world, n));
    std::unique_ptr<gloo::transport::UnboundBuffer> ub_out, ub_in; /* sendrecv */
    if (p2p) {
      ub_out = ctx->createUnboundBuffer(x.data(), per * 4);
      ub_in = ctx->createUnboundBuffer(y.data(), per * 4);
    }
    auto gloo_run = [&] {
      if (c == "allgather") {
        gloo::AllgatherOptions opts(ctx);
        opts.setInput(x.data(), per);
        opts.setOutput(y.data(), per * world);
        opts.setTag(tag);
        gloo::allgather(opts);
      } else if (c == "reduce_scatter") {
        rs->run();
      } else if (c == "reduce") {
        gloo::ReduceOptions opts(ctx);
        opts.setOutput(x.data(), per);
        opts.setRoot(0);
        opts.setReduceFunction(sum_fn);
        opts.setTag(tag);
        gloo::reduce(opts);
      } else if (p2p) {
        ub_in->recv(prev, tag);
        ub_out->send(next, tag);
        ub_in->waitRecv();
        ub_out->waitSend();
      } else if (c == "alltoall") {
        gloo::AlltoallOptions opts(ctx);
        opts.setInput(x.data(), per * world);
        opts.setOutput(y.data(), per * world);
        opts.setTag(tag);
        gloo::alltoall(opts);
      } else {
        gloo::BroadcastOptions opts(ctx);
        opts.setOutput(x.data(), per);
        opts.setRoot(0);
        opts.setTag(tag);
        gloo::broadcast(opts);
      }
    };
    Result gl = time_checked(o, rank, world, fill, gloo_run, [&] {
      /* Gloo's reduce leaves the other ranks' buffers undefined (scratch) */
      return wrong_in(c == "reduce_scatter" ? x.data() + rank * per
                      : in_x                ? x.data()
                                            : y.data(),
                      true);
    });
    tag++;
    if (rank == 0) {
      printf(" %12zu %11.2f %9.3f %8.0f  %11.2f %9.3f %8.0f\n", bytes, mpi.time_us,
             (double)bytes / (mpi.time_us * 1e-6) / 1e9 * factor, mpi.wrong, gl.time_us,
             (double)bytes / (gl.time_us * 1e-6) / 1e9 * factor, gl.wrong);
      fflush(stdout);
    }
  }
  return 0;
}

double busbw(size_t bytes, double us, int world) {
  return (double)bytes / (us * 1e-6) / 1e9 * 2.0 * (world - 1) / world;
}

/* Not under mpirun yet: run ourselves there with TCP-only transports. */
int relaunch(int argc, char **argv, int world) {
  /* OpenMPI's defaults otherwise (one rank per core, bound): --oversubscribe
   * only when there are more ranks than cores, since it makes idle ranks
   * yield, which cost MPI 5x here. */
  std::vector<std::string> args = {
      "mpirun",   "-np",   std::to_string(world), "--mca", "pml", "ob1", "--mca", "btl",
      "tcp,self", "--mca", "btl_tcp_if_include",  "lo"};
  if (world > sysconf(_SC_NPROCESSORS_ONLN)) args.push_back("--oversubscribe");
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  args.push_back(self);
  for (int i = 1; i < argc; i++) args.push_back(argv[i]);
  std::vector<char *> cargs;
  for (auto &a : args) cargs.push_back(const_cast<char *>(a.c_str()));
  cargs.push_back(nullptr);
  setenv("ALLREDUCE_BASELINE_CHILD", "1", 1);
  execvp("mpirun", cargs.data());
  perror("allreduce-baseline: cannot run mpirun (apt-get install openmpi-bin)");
  return 1;
}

}  // namespace

int main(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&](const char *name) -> const char * {
      if (i + 1 >= argc) {
        fprintf(stderr, "allreduce-baseline: option %s needs a value\n", name);
        exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") return usage(nullptr);
    if (a == "--world-size") {
      o.world = atoi(val("--world-size"));
      if (o.world < 1) return usage("option --world-size: want a number >= 1");
    } else if (a == "--sizes") {
      if (!parse_sizes(val("--sizes"), &o.sizes))
        return usage("option --sizes: want a list 4K,1M or a range 4K:256M of multiples of 4");
    } else if (a == "--warmup") {
      o.warmup = atoi(val("--warmup"));
      if (o.warmup < 1) return usage("option --warmup: want a number >= 1");
    } else if (a == "--seconds") {
      o.seconds = atof(val("--seconds"));
      if (o.seconds <= 0) return usage("option --seconds: want a positive number");
    } else if (a == "--collective") {
      o.collective = val("--collective");
      const char *known[] = {"allreduce", "allgather", "reduce_scatter", "reduce",
                             "alltoall",  "broadcast", "sendrecv"};
      bool ok = false;
      for (const char *k : known) ok = ok || o.collective == k;
      if (!ok)
        return usage(
            "option --collective: want allreduce, allgather, reduce_scatter, reduce, alltoall, "
            "broadcast or sendrecv");
    } else if (a == "--all-gloo") {
      o.all_gloo = true;
    } else if (a == "--only") {
      std::string v = val("--only");
      if (v != "mpi" && v != "gloo") return usage("option --only: want mpi or gloo");
      o.mpi = v == "mpi";
      o.gloo = v == "gloo";
    } else {
      std::string why = "unknown option " + a;
      return usage(why.c_str());
    }
  }
  if (o.sizes.empty()) parse_sizes("4K:256M", &o.sizes);
  if (!getenv("ALLREDUCE_BASELINE_CHILD") && !getenv("OMPI_COMM_WORLD_SIZE"))
    return relaunch(argc, argv, o.world);

  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);

  char dir[256] = "";
  if (rank == 0) {
    snprintf(dir, sizeof(dir), "%s/allreduce-baseline-XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(dir)) dir[0] = 0;
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!dir[0]) {
    if (rank == 0) fprintf(stderr, "allreduce-baseline: cannot create a temporary directory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  gloo::rendezvous::PrefixStore prefix("allreduce-baseline", store);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
  ctx->connectFullMesh(prefix, dev);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    std::string cmd = "rm -rf '" + std::string(dir) + "'";
    if (system(cmd.c_str()) != 0) fprintf(stderr, "allreduce-baseline: could not remove %s\n", dir);
  }

  if (o.collective != "allreduce") {
    int r = run_collective(o, rank, world, ctx);
    MPI_Finalize();
    return r;
  }
  size_t maxb = 0;
  for (size_t s : o.sizes) maxb = s > maxb ? s : maxb;
  float *buf = static_cast<float *>(aligned_alloc(64, (maxb + 63) / 64 * 64));
  if (rank == 0) {
    struct utsname u;
    uname(&u);
    time_t t = time(nullptr);
    char date[64];
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%MZ", gmtime(&t));
    char ver[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(ver, &len);
    char *nl = strchr(ver, '\n');
    if (nl) *nl = 0;
    printf(
        "# allreduce-baseline: world %d, op sum, float32, in place; %s; Gloo over TCP 127.0.0.1\n",
        world, ver);
    printf("# host %s, %ld CPUs, %s %s, %s; busbw = algbw * 2(W-1)/W, GB/s = 1e9 bytes/s\n",
           u.nodename, sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, date);
    printf("#%12s %11s %9s %8s  %11s %9s %8s  %s\n", "size", "mpi_us", "mpi_busbw", "mpi_wrong",
           "gloo_us", "gloo_busbw", "gloo_wrong", "gloo_algorithm (fastest)");
    fflush(stdout);
  }
  for (size_t bytes : o.sizes) {
    size_t count = bytes / sizeof(float);
    Result mpi;
    if (o.mpi)
      mpi = measure(o, rank, world, buf, count, [&] {
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      });
    std::vector<float *> ptrs{buf};
    struct Algo {
      const char *name;
      std::function<void()> run;
    };
    std::vector<Algo> algos;
    auto ring = std::make_shared<gloo::AllreduceRing<float>>(ctx, ptrs, (int)count);
    auto chunked = std::make_shared<gloo::AllreduceRingChunked<float>>(ctx, ptrs, (int)count);
    auto hd = std::make_shared<gloo::AllreduceHalvingDoubling<float>>(ctx, ptrs, (int)count);
    algos.push_back({"ring", [ring] { ring->run(); }});
    algos.push_back({"ring_chunked", [chunked] { chunked->run(); }});
    algos.push_back({"halving_doubling", [hd] { hd->run(); }});
    algos.push_back({"allreduce", [&] {
                       gloo::AllreduceOptions opts(ctx);
                       opts.setOutput(buf, count);
                       opts.setReduceFunction(
                           static_cast<void (*)(void *, const void *, const void *, size_t)>(
                               &gloo::sum<float>));
                       gloo::allreduce(opts);
                     }});
    Result best;
    const char *best_name = "";
    std::string all;
    for (auto &a : algos) {
      if (!o.gloo) break;
      Result r = measure(o, rank, world, buf, count, a.run);
      char part[96];
      snprintf(part, sizeof(part), " %s=%.3f%s", a.name, busbw(bytes, r.time_us, world),
               r.wrong ? "(wrong)" : "");
      all += part;
      if (!best_name[0] || r.time_us < best.time_us) {
        best = r;
        best_name = a.name;
      }
    }
    if (rank == 0) {
      char m[64] = "          -         -        -", gl[64] = "          -         -        -";
      if (o.mpi)
        snprintf(m, sizeof(m), "%11.2f %9.3f %8.0f", mpi.time_us, busbw(bytes, mpi.time_us, world),
                 mpi.wrong);
      if (o.gloo)
        snprintf(gl, sizeof(gl), "%11.2f %9.3f %8.0f", best.time_us,
                 busbw(bytes, best.time_us, world), best.wrong);
      printf(" %12zu %s  %s  %s\n", bytes, m, gl, o.gloo ? best_name : "-");
      if (o.all_gloo) printf("#   gloo busbw:%s\n", all.c_str());
      fflush(stdout);
    }
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
