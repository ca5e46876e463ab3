"""The child process of ``jaxstreams.xla_graphs``, and the parent's handle
on it: compiles lowered programs for a GPU target with XLA's command-buffer
log on.

XLA reads its logging settings (``TF_CPP_VMODULE``) once, when the process
first logs, so the log that lists each CUDA graph's commands and edges can
only be turned on in a process started with it. The parent starts this
module so, once (``CompileChild``: starting jax and the CUDA compiler
costs seconds, every call of the view would pay them) and keeps it while
the environment it was started with stays the same. Each request is one
JSON line on the child's stdin: ``programs`` (each a ``module``, StableHLO
text, and its ``compiler_options``), ``target_name`` (``local``: this
machine's own GPUs), ``target_config``, ``devices`` (the node's GPUs, one
per partition). XLA's log goes to the child's stderr, a file the parent
reads, where a line ``MARKER<k>`` starts program ``k``'s part and
``END_MARKER`` ends the request. On stdout, as one JSON line, per program:
the compiled HLO text, XLA's dumps of the program's thunk sequence (which
command is which HLO instruction) and buffer assignment (which buffers each
reads and writes: the graph's edges where the log cuts them off), and
XLA's memory analysis (``memory``); or ``error``, where that program did
not compile.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import threading
import time

MARKER = "jaxstreams-graph-child: program "
END_MARKER = "jaxstreams-graph-child: done"
# A child whose resident memory grew past this after a request (XLA keeps
# what a large compile allocated) is ended; the next request starts another.
MAX_CHILD_RSS_BYTES = 2 << 30
# -P: the working directory (a source checkout without built native
# libraries, say) must not shadow the jaxstreams the parent imported, whose
# FFI handlers the compile needs; the parent puts that first on the child's
# PYTHONPATH instead.
CHILD_COMMAND = [sys.executable, "-P", "-m", "jaxstreams.xla._graph_child"]
_MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes",
                  "output_size_in_bytes", "alias_size_in_bytes",
                  "generated_code_size_in_bytes")


def main() -> None:
  """Answer requests, one per line of stdin, until stdin ends."""
  targets = {}
  for line in iter(sys.stdin.readline, ""):
    if line.strip():
      _answer(json.loads(line), targets)


def _answer(request: dict, targets: dict) -> None:
  key = (request["target_name"], request["target_config"],
         request.get("devices", 1))
  if key not in targets:
    targets[key] = _devices(request)
  devices = targets[key]
  results = []
  for k, program in enumerate(request["programs"]):
    sys.stderr.flush()
    os.write(2, f"\n{MARKER}{k}\n".encode())   # XLA writes to fd 2 itself
    try:
      results.append(_compile(program, devices))
    except Exception as error:  # noqa: BLE001 - reported with its program
      results.append({"error": f"{type(error).__name__}: {error}"[:2000]})
  sys.stderr.flush()
  os.write(2, f"\n{END_MARKER}\n".encode())
  sys.stdout.write(json.dumps({"programs": results}) + "\n")
  sys.stdout.flush()


def _devices(request: dict) -> list:
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
  return devices


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


class ChildFailed(RuntimeError):
  """The child ended or ran out of time before answering; the message has
  the end of its stderr."""


class CompileChild:
  """This process's one compile child, started on first use with the
  environment of the request and kept while that and the working directory
  stay the same (else it is ended and another started): requests from any
  thread run one at a time. A child that fails, times out or grows too large is
  ended; the next request starts a new one."""

  _lock = threading.Lock()
  _current: "CompileChild | None" = None

  def __init__(self, env: dict):
    self.env = env
    self.cwd = os.getcwd()
    self._pending = b""   # stdout read but not yet a whole line
    handle, self.log_path = tempfile.mkstemp(prefix="jaxstreams-graph-log-")
    os.close(handle)
    # The child appends, so the parent can empty the file between requests.
    with open(self.log_path, "ab") as log:
      self.process = subprocess.Popen(
          CHILD_COMMAND,
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)

  @classmethod
  def request(cls, request: dict, env: dict,
              timeout: float) -> tuple[dict, str]:
    """The child's answer to ``request`` and XLA's log of it."""
    with cls._lock:
      child = cls._current
      if child is not None and (child.env != env or child.cwd != os.getcwd()
                                or child.process.poll() is not None):
        child.close()
        child = None
      if child is None:
        child = cls._current = CompileChild(env)
      try:
        answer = child._ask(request, timeout)
      except BaseException:
        child.close()
        cls._current = None
        raise
      if child._rss() > MAX_CHILD_RSS_BYTES:
        child.close()
        cls._current = None
      return answer

  def _ask(self, request: dict, timeout: float) -> tuple[dict, str]:
    os.truncate(self.log_path, 0)
    try:
      self.process.stdin.write((json.dumps(request) + "\n").encode())
      self.process.stdin.flush()
    except OSError:
      pass   # it died: said below, with its stderr
    deadline = time.monotonic() + timeout
    line = b""
    while not line.startswith(b'{"programs"'):   # past anything else printed
      line = self._read_line(deadline)
      if line is None:
        if time.monotonic() < deadline:   # its stdout ended: it is ending
          try:
            self.process.wait(timeout=30)
          except subprocess.TimeoutExpired:
            pass
        how = (f"no answer in {timeout:g} s" if self.process.poll() is None
               else f"exit {self.process.returncode}")
        raise ChildFailed(f"{how}:\n{self._log_text()[-3000:]}")
    log = self._log_text()
    return json.loads(line), log.split(f"\n{END_MARKER}\n")[0]

  def _read_line(self, deadline: float) -> bytes | None:
    """The child's next line of stdout; None at its end or at the
    deadline."""
    fd = self.process.stdout.fileno()
    while b"\n" not in self._pending:
      ready, _, _ = select.select([fd], [], [],
                                  max(0.0, deadline - time.monotonic()))
      chunk = os.read(fd, 1 << 20) if ready else b""
      if not chunk:
        return None
      self._pending += chunk
    line, self._pending = self._pending.split(b"\n", 1)
    return line

  def _log_text(self) -> str:
    with open(self.log_path, "rb") as log:
      return log.read().decode(errors="replace")

  def _rss(self) -> int:
    try:
      with open(f"/proc/{self.process.pid}/status") as status:
        for line in status:
          if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
      pass
    return 0

  def close(self) -> None:
    """End the child: its stdin closed, killed if it has not left soon."""
    try:
      self.process.stdin.close()
      self.process.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
      self.process.kill()
      self.process.wait()
    self.process.stdout.close()
    try:
      os.remove(self.log_path)
    except OSError:
      pass

  @classmethod
  def close_current(cls) -> None:
    with cls._lock:
      if cls._current is not None:
        cls._current.close()
        cls._current = None


atexit.register(CompileChild.close_current)


if __name__ == "__main__":
  main()
