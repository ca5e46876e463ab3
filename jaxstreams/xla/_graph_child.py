"""The child process of ``jaxstreams.xla_graphs``: compiles one lowered
program for a GPU target with XLA's command-buffer log on.

XLA reads its logging settings (``TF_CPP_VMODULE``) once, when the process
first logs, so the log that lists each CUDA graph's commands and edges can
only be turned on in a process started with it; the parent starts this
module so, hands it the program on stdin as JSON (``module``: StableHLO
text, ``compiler_options``, ``target_name`` (``local``: this machine's own
GPUs), ``target_config``, ``devices``: the node's GPUs, one per partition)
and reads
XLA's log from its stderr. On stdout, as one JSON line: the compiled HLO
text and XLA's dumps of the program's thunk sequence (which command is
which HLO instruction) and buffer assignment (which buffers each reads and
writes: the graph's edges where the log cuts them off).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile


def main() -> None:
  request = json.loads(sys.stdin.read())
  from jaxstreams import _compat
  from jaxstreams.xla import target
  if request["target_name"] == "local":   # this machine's own GPUs
    import jax
    devices = jax.devices("cuda")[:request.get("devices", 1)]
  else:
    devices = list(target.target_from_config(
        request["target_name"], request["target_config"],
        request.get("devices", 1)).mesh.devices.flat)
  try:   # register the runtime's FFI targets, for programs that call them
    from jaxstreams.runtime import _loader
    _loader.load()
  except Exception:   # a program without them compiles all the same
    pass
  with tempfile.TemporaryDirectory(prefix="jaxstreams-graph-") as dump:
    options = dict(request["compiler_options"], xla_dump_to=dump)
    executable = _compat.compile_module_text(request["module"], devices,
                                             options)
    files = {}
    # The thunk sequence as it runs: XLA dumps it after its thunk passes
    # where those changed it (they make the command buffers), else as
    # emitted.
    for kind in ("thunk_sequence_after_thunk_passes", "thunk_sequence",
                 "thunk_metadata", "gpu_after_optimizations-buffer-assignment"):
      found = sorted(pathlib.Path(dump).glob(f"*.{kind}.txt"))
      files[kind] = found[-1].read_text() if found else None
  sequence = (files["thunk_sequence_after_thunk_passes"]
              or files["thunk_sequence"])
  print(json.dumps({"hlo": executable.hlo_modules()[0].to_string(),
                    "sequence": sequence,
                    "metadata": files["thunk_metadata"],
                    "buffers": files["gpu_after_optimizations-buffer-assignment"]}))


if __name__ == "__main__":
  main()
