"""ctypes bindings of libps (ps.h, collective.h, grid.h): the only module that
touches C.

libps is found, in this order, at $PS_LIBPS, at the path the build wrote into
_paths.py (the build tree's or the installed libps.so.0), then by the dynamic
loader's search for libps.so.0. ctypes.CDLL releases the GIL around every
call, so a thread that waits in ps_wait or ps_coll_wait lets the others run
(Horovod deadlocked until its waits did: horovod#3352).

Every prototype below mirrors a declaration of the public headers; a pointer
handed to an asynchronous call must stay alive until its request is waited
for, which the callers (ps.torch) guarantee by keeping the tensor."""

import ctypes
import os

# ps_status (ps.h)
OK = 0
ERR_INVALID = 1
ERR_CONNECT = 2
ERR_IO = 3
ERR_LAYOUT_MISMATCH = 4
ERR_REMOTE = 5
ERR_NOMEM = 6
ERR_STATE = 7
ERR_CLOSED = 8
ERR_ROLLBACK = 9
ERR_STATE_LOST = 10

REDOP_SUM = 0
REDOP_AVG = 1
REDOP_MAX = 2
REDOP_MIN = 3

# ps_dtype (collective.h)
DTYPE_FLOAT32 = 0
DTYPE_FLOAT64 = 1
DTYPE_FLOAT16 = 2
DTYPE_BFLOAT16 = 3
DTYPE_INT8 = 4
DTYPE_UINT8 = 5
DTYPE_INT32 = 6
DTYPE_UINT32 = 7
DTYPE_INT64 = 8
DTYPE_UINT64 = 9

UINT64_MAX = (1 << 64) - 1
COLL_UNDEFINED = -1  # collective.h: PS_COLL_UNDEFINED

# ps_leave_kind (ps.h)
LEAVE_JOINED = 1
LEAVE_FINISHED = 2


class ClientOpts(ctypes.Structure):
    _fields_ = [
        ("servers", ctypes.POINTER(ctypes.c_char_p)),
        ("num_servers", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("job_id", ctypes.c_char_p),
        ("chunk_bytes", ctypes.c_uint64),
        ("connect_timeout_ms", ctypes.c_int),
        ("reconnect_timeout_ms", ctypes.c_int),
        ("auth_token", ctypes.c_void_p),
        ("transport", ctypes.c_char_p),
    ]


class CollOpts(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("peers", ctypes.POINTER(ctypes.c_char_p)),
        ("job_id", ctypes.c_char_p),
        ("listen_addr", ctypes.c_char_p),
        ("listen_fd", ctypes.c_int),
        ("connect_timeout_ms", ctypes.c_int),
        ("peer_timeout_ms", ctypes.c_int),
        ("slice_bytes", ctypes.c_size_t),
        ("small_bytes", ctypes.c_size_t),
        ("round_bytes", ctypes.c_size_t),
        ("spin_us", ctypes.c_int),
        ("auth_token", ctypes.c_void_p),
        ("p2p", ctypes.c_int),
        ("node_first", ctypes.c_int),
        ("node", ctypes.c_char_p),
    ]


class ShardStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "pushes", "pulls", "updates", "duplicates", "rejected_frames", "bytes_in",
        "bytes_out", "param_bytes", "min_version", "max_version")] + [
        ("connected_workers", ctypes.c_uint32),
        ("num_keys", ctypes.c_uint32),
        ("live_workers", ctypes.c_uint32),
        ("optimizer", ctypes.c_char * 16),
        ("consistency", ctypes.c_char * 32),
    ]


def _candidates():
    env = os.environ.get("PS_LIBPS")
    if env:
        return [env]
    out = []
    try:
        from . import _paths  # written by meson (build tree or install)
        out.append(_paths.LIBPS)
    except ImportError:
        pass
    out.append("libps.so.0")
    return out


def _load():
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("ps: cannot load libps (set PS_LIBPS to its path): " + "; ".join(errors))


lib, path = _load()

_P = ctypes.c_void_p
_status = ctypes.c_int


def _proto(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_proto("ps_strerror", ctypes.c_char_p, _status)
_proto("ps_token_load", _status, ctypes.c_char_p, ctypes.POINTER(_P), ctypes.c_char_p,
       ctypes.c_size_t)
_proto("ps_token_free", None, _P)
_proto("ps_client_new", _status, ctypes.POINTER(ClientOpts), ctypes.POINTER(_P),
       ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_client_free", None, _P)
_proto("ps_errmsg", ctypes.c_char_p, _P, ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_declare", _status, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
       ctypes.POINTER(ctypes.c_uint64))
_proto("ps_declare_owned", _status, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.POINTER(ctypes.c_int)),
       ctypes.POINTER(ctypes.c_int))
_proto("ps_init", _status, _P, ctypes.c_int, _P)
_proto("ps_push_async", _status, _P, ctypes.c_int, ctypes.c_uint64, _P, _P, _P,
       ctypes.POINTER(_P))
_proto("ps_pull_async", _status, _P, ctypes.c_int, ctypes.c_uint64, _P, _P, _P,
       ctypes.POINTER(_P))
_proto("ps_wait", _status, _P, ctypes.POINTER(ctypes.c_uint64))
_proto("ps_pull", _status, _P, ctypes.c_int, ctypes.c_uint64, _P,
       ctypes.POINTER(ctypes.c_uint64))
_proto("ps_barrier", _status, _P)
_proto("ps_stats", _status, _P, ctypes.c_int, ctypes.POINTER(ShardStats))
_proto("ps_resume_step", _status, _P, ctypes.POINTER(ctypes.c_uint64))
_proto("ps_shutdown_servers", _status, _P)
_proto("ps_coll_open", _status, ctypes.POINTER(CollOpts), ctypes.POINTER(_P), ctypes.c_char_p,
       ctypes.c_size_t)
_proto("ps_coll_close", None, _P)
_proto("ps_coll_allreduce", _status, _P, _P, ctypes.c_size_t, ctypes.c_int)
_proto("ps_coll_allreduce_async", _status, _P, _P, ctypes.c_size_t, ctypes.c_int,
       ctypes.POINTER(_P))
_proto("ps_coll_wait", _status, _P)
_proto("ps_coll_broadcast", _status, _P, _P, ctypes.c_size_t, ctypes.c_int)
_proto("ps_coll_barrier", _status, _P)
_proto("ps_coll_allgather", _status, _P, _P, _P, ctypes.c_size_t)
_proto("ps_coll_reduce_scatter", _status, _P, _P, _P, ctypes.c_size_t, ctypes.c_int)
_proto("ps_coll_reduce_scatter_async", _status, _P, _P, _P, ctypes.c_size_t, ctypes.c_int,
       ctypes.POINTER(_P))
_proto("ps_coll_reduce", _status, _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
_proto("ps_coll_allreduce_typed", _status, _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
_proto("ps_coll_allreduce_typed_async", _status, _P, _P, ctypes.c_size_t, ctypes.c_int,
       ctypes.c_int, ctypes.POINTER(_P))
_proto("ps_coll_reduce_scatter_typed", _status, _P, _P, _P, ctypes.c_size_t, ctypes.c_int,
       ctypes.c_int)
_proto("ps_coll_reduce_typed", _status, _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
       ctypes.c_int)
_proto("ps_coll_alltoall", _status, _P, _P, _P, ctypes.c_size_t)
_proto("ps_coll_send", _status, _P, _P, ctypes.c_size_t, ctypes.c_int)
_proto("ps_coll_recv", _status, _P, _P, ctypes.c_size_t, ctypes.c_int)
_proto("ps_coll_send_async", _status, _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(_P))
_proto("ps_coll_recv_async", _status, _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(_P))
_proto("ps_coll_errmsg", ctypes.c_char_p, _P, ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_coll_lost_rank", ctypes.c_int, _P)
_proto("ps_coll_status", _status, _P)
_proto("ps_coll_abort", _status, _P, ctypes.c_char_p)
_proto("ps_coll_rank", ctypes.c_int, _P)
_proto("ps_coll_world_size", ctypes.c_int, _P)
_proto("ps_coll_split", _status, _P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P))
_proto("ps_coll_job_rank", ctypes.c_int, _P, ctypes.c_int)
_proto("ps_coll_group_id", ctypes.c_uint64, _P)


class GridCoords(ctypes.Structure):
    _fields_ = [("tp", ctypes.c_int), ("dp", ctypes.c_int), ("pp", ctypes.c_int)]


# grid.h
_proto("ps_grid_new", _status, _P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_P),
       ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_grid_free", None, _P)
_proto("ps_grid_coords", GridCoords, _P)
_proto("ps_grid_size", ctypes.c_int, _P, ctypes.c_char)
_proto("ps_grid_group", _P, _P, ctypes.c_char)
_proto("ps_worker_clocks", _status, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)
_proto("ps_leave", _status, _P, ctypes.c_int)
_proto("ps_rejoin", _status, _P, ctypes.POINTER(ctypes.c_uint64))
_proto("ps_lost_workers", _status, _P, ctypes.POINTER(ctypes.c_int), ctypes.c_int,
       ctypes.POINTER(ctypes.c_int))


def strerror(status):
    return lib.ps_strerror(status).decode()


def errbuf(n=1024):
    return ctypes.create_string_buffer(n)


def cstrings(items):
    """A char*[] of the strings (kept alive by the returned array)."""
    arr = (ctypes.c_char_p * len(items))()
    for i, s in enumerate(items):
        arr[i] = s.encode()
    return arr


# pipeline.h: the pipeline schedules as data (ps.torch.pipeline executes them)
class PipeAction(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int), ("micro", ctypes.c_int), ("chunk", ctypes.c_int),
                ("peer_stage", ctypes.c_int)]


class PipeShape(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("stages", ctypes.c_int), ("micro", ctypes.c_int),
                ("chunks", ctypes.c_int)]


_proto("ps_pipe_check", _status, ctypes.POINTER(PipeShape), ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_pipe_actions", _status, ctypes.POINTER(PipeShape), ctypes.c_int,
       ctypes.POINTER(ctypes.POINTER(PipeAction)), ctypes.POINTER(ctypes.c_size_t),
       ctypes.c_char_p, ctypes.c_size_t)
_proto("ps_pipe_validate", _status, ctypes.POINTER(PipeShape), ctypes.c_char_p, ctypes.c_size_t)


class PipeCosts(ctypes.Structure):  # struct ps_pipe_costs: one chunk's times, any unit
    _fields_ = [(n, ctypes.c_double) for n in ("forward", "backward", "backward_input", "weight",
                                               "transfer")]


class PipeSim(ctypes.Structure):  # struct ps_pipe_sim
    _fields_ = [("step_time", ctypes.c_double), ("ideal_time", ctypes.c_double),
                ("bubble", ctypes.c_double), ("peak_acts", ctypes.c_int * 256)]


_proto("ps_pipe_simulate", _status, ctypes.POINTER(PipeShape), ctypes.POINTER(PipeCosts),
       ctypes.POINTER(PipeSim), ctypes.c_char_p, ctypes.c_size_t)
# ps_pipe_actions' list is malloc'd: the caller frees it with the C library's free
_libc = ctypes.CDLL(None)
libc_free = _libc.free
libc_free.restype = None
libc_free.argtypes = [ctypes.c_void_p]
