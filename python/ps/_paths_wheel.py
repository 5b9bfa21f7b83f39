"""Where libps is, in a wheel (tools/build-wheel writes this file as the
wheel's ps/_paths.py): the libps.so.0 bundled in ps/_libs, next to this
package, wherever pip installed it. $PS_LIBPS still comes first (_lib.py).
The NCCL plugin, when the build had one, sits beside it (libps looks next to
itself, nccl_loader.c)."""
import os

LIBPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_libs", "libps.so.0")
