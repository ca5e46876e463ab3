"""The child process of ``jaxstreams.xla_graphs``: compiles lowered programs
for a GPU target with XLA's command-buffer log on.

XLA reads its logging settings (``TF_CPP_VMODULE``) once, when the process
first logs, so the log that lists each CUDA graph's commands and edges can
only be turned on in a process started with it; the parent starts this
module so, hands it the programs on stdin as JSON (``programs``: each a
``module``, StableHLO text, and its ``compiler_options``; ``target_name``
(``local``: this machine's own GPUs), ``target_config``, ``devices``: the
node's GPUs, one per partition) and reads XLA's log from its stderr, where
a line ``MARKER<k>`` starts program ``k``'s part. On stdout, as one JSON
line, per program: the compiled HLO text, XLA's dumps of the program's
thunk sequence (which command is which HLO instruction) and buffer
assignment (which buffers each reads and writes: the graph's edges where
the log cuts them off), and XLA's memory analysis (``memory``); or
``error``, where that program did not compile.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

MARKER = "jaxstreams-graph-child: program "
_MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes",
                  "output_size_in_bytes", "alias_size_in_bytes",
                  "generated_code_size_in_bytes")


def main() -> None:
  request = json.loads(sys.stdin.read())
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
  results = []
  for k, program in enumerate(request["programs"]):
    sys.stderr.flush()
    os.write(2, f"\n{MARKER}{k}\n".encode())   # XLA writes to fd 2 itself
    try:
      results.append(_compile(program, devices))
    except Exception as error:  # noqa: BLE001 - reported with its program
      results.append({"error": f"{type(error).__name__}: {error}"[:2000]})
  print(json.dumps({"programs": results}))


def _compile(program: dict, devices) -> dict:
  from jaxstreams import _compat
  with tempfile.TemporaryDirectory(prefix="jaxstreams-graph-") as dump:
    options = dict(program["compiler_options"], xla_dump_to=dump)
    executable = _compat.compile_module_text(program["module"], devices,
                                             options)
    files = {}
    # The thunk sequence as it runs: XLA dumps it after its thunk passes
    # where those changed it (they make the command buffers), else as
    # emitted. File names carry the GPU ("...sm_9.0a_gpu_after...").
    for kind in ("thunk_sequence_after_thunk_passes", "thunk_sequence",
                 "thunk_metadata", "gpu_after_optimizations-buffer-assignment"):
      found = sorted(pathlib.Path(dump).glob(f"*[._]{kind}.txt"))
      files[kind] = found[-1].read_text() if found else None
  sequence = (files["thunk_sequence_after_thunk_passes"]
              or files["thunk_sequence"])
  try:
    stats = executable.get_compiled_memory_stats()
    memory = {f: int(getattr(stats, f, 0) or 0) for f in _MEMORY_FIELDS}
  except Exception:  # noqa: BLE001 - a backend without memory analysis
    memory = None
  return {"hlo": executable.hlo_modules()[0].to_string(),
          "sequence": sequence,
          "metadata": files["thunk_metadata"],
          "buffers": files["gpu_after_optimizations-buffer-assignment"],
          "memory": memory}


if __name__ == "__main__":
  main()
