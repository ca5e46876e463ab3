"""The six models of ``gpu_levers.py`` compiled for an H100 without one,
each of the ways that script times: what ``fit_step_time.py`` fits the
step-time estimate to and ``tests/test_step_time.py`` holds it to.

A model's ways are compiled in one child process (``xla_graphs_of``: one
start of jax and the CUDA plugin, each kernel compiled once), and a way
whose program and compiler options are another's (``jaxstreams``'
``inline`` is ``jax.jit``'s program; its name scopes change only debug
information) is compiled once.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (HERE, os.path.join(HERE, "..", "examples")):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # noqa: E402

import gpu_levers  # noqa: E402
import streams_demo  # noqa: E402,F401 - gpu_levers' demo model imports it when made
from workloads import common  # noqa: E402

import jaxstreams  # noqa: E402
from jaxstreams import _compat  # noqa: E402
from jaxstreams.xla import graph  # noqa: E402

NAMES = tuple(name for name, _, _ in gpu_levers.MODELS)


def lowered_ways(name: str, ways: dict) -> dict:
  """Way name -> its program lowered for CUDA, compiler options included,
  for model ``name`` of ``gpu_levers.MODELS``; ``ways``: name -> ``plain``
  (``jax.jit``'s program, with ``concurrent`` or ``no_graphs``) or ``way``
  (a ``jaxstreams`` way)."""
  model, size = {n: (m, s) for n, m, s in gpu_levers.MODELS}[name]
  make_fn, args = model(size, gpu_levers.STREAMS, jax.random.PRNGKey(0))
  found = {}
  for way, how in ways.items():
    if how.get("plain"):
      options = (common.CONCURRENT_OPTIONS if how.get("concurrent") else
                 gpu_levers.NO_COMMAND_BUFFERS if how.get("no_graphs") else {})
      jitted = jax.jit(make_fn(common.place_none),
                       **({"compiler_options": dict(options)} if options
                          else {}))
    else:
      jitted = jaxstreams.jit(make_fn(common.place_jaxstreams),
                              streams=gpu_levers.STREAMS,
                              gpu_lowering=how["way"])
    found[way] = jitted.trace(*args).lower(lowering_platforms=("cuda",))
  return found


def compile_model(name: str, ways: dict, target: str = "h100") -> dict:
  """Way name -> ``XlaGraphs`` of model ``name`` compiled each way for
  ``target``, in one child process; a way that did not compile raises."""
  first: dict = {}           # (program text, options) -> the way compiled
  compiled, same = {}, {}    # way -> lowered; way -> the way it shares
  for way, lowered in lowered_ways(name, ways).items():
    options = sorted((k, str(v)) for k, v in
                     _compat.lowered_compiler_options(lowered).items())
    same[way] = first.setdefault((lowered.as_text(), tuple(options)), way)
    if same[way] == way:
      compiled[way] = lowered
  views = graph.xla_graphs_of(compiled, target=target)
  for view in views.values():
    if isinstance(view, Exception):
      raise view
  return {way: views[shared] for way, shared in same.items()}
