"""Small programs the tests run through jaxstreams and jax.jit alike."""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstreams
from jaxstreams import _compat
from jaxstreams.staging import _policy


def random_inputs(*shapes, seed=0):
  key = jax.random.PRNGKey(seed)
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def two_towers(x, w1, w2):
  """Two independent towers on streams 1 and 2, joined on the main stream."""
  with jaxstreams.stream(1):
    a = jnp.tanh(x @ w1) * 2.0
  with jaxstreams.stream(2):
    b = jax.nn.relu(x @ w2).sum(axis=0)
  return (a * b).sum() + jnp.cos(x).mean()


def tuned_towers():
  """``two_towers`` as a function of its own, named ``tuned_towers`` to
  count its compiles (jax's caches know nothing of it yet)."""
  def tuned_towers(x, w1, w2):
    return two_towers(x, w1, w2)
  return tuned_towers


def towers_args(batch=8):
  """Arguments of ``two_towers`` (16 features)."""
  return random_inputs((batch, 16), (16, 16), (16, 16))


def four_branches(x, ws):
  """Four independent branches, one per stream (0 to 3), summed."""
  outs = []
  for i, w in enumerate(ws):
    with jaxstreams.stream(i):
      outs.append(jnp.tanh(jnp.tanh(x @ w) @ w))
  return sum(o.sum() for o in outs)


def four_branches_args(batch, width):
  return jnp.ones((batch, width)), [jnp.ones((width, width)) * (i + 1)
                                    for i in range(4)]


def one_chain(x, w):
  """Each region needs the one before it: nothing can overlap."""
  with jaxstreams.stream(1):
    x = jnp.tanh(x @ w)
  x = jnp.sin(x @ w)
  with jaxstreams.stream(1):
    x = jnp.tanh(x @ w)
  return x.sum()


def training_step(params, x, y):
  """A two-tower regression loss; its gradient is the usual test subject."""
  def loss(params):
    with jaxstreams.stream(1):
      h1 = jnp.tanh(x @ params["w1"])
    with jaxstreams.stream(2):
      h2 = jax.nn.sigmoid(x @ params["w2"])
    pred = (h1 + h2) @ params["out"]
    return jnp.mean((pred - y) ** 2)
  return jax.value_and_grad(loss)(params)


def gathered_towers(mesh, axis="data", placed=True):
  """Each device's step (shard_map) with the weights sharded over ``axis``
  (FSDP-style): each tower all-gathers its weight on the main stream, then
  computes on a stream of its own (``placed``; else nobody places it), so
  one tower's all-gather can be in flight while the other tower runs."""
  def body(ws, x):
    outs = []
    for t, shard in enumerate(ws):
      w = jax.lax.all_gather(shard, axis, tiled=True)
      with jaxstreams.stream(1 + t) if placed else contextlib.nullcontext():
        outs.append(jnp.tanh(jnp.tanh(x @ w) @ w))
    return sum(outs)
  from jax.sharding import PartitionSpec as P
  return jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis)),
                       out_specs=P(axis))


def training_params(d=16, seed=0):
  w1, w2, out = random_inputs((d, d), (d, d), (d, 1), seed=seed)
  return {"w1": w1, "w2": w2, "out": out}


# On XLA:CPU jaxstreams runs the same equations through the same kernels as
# jax.jit, so results must match bit for bit. On a GPU, regions change what XLA
# fuses and how matmuls are tiled (TF32 by default), so results agree to
# rounding: up to 2.5e-3 of the largest magnitude on an H100 with jax 0.11.2;
# the bound is the one the benchmarks use.
GPU_TOLERANCE = 2e-2


def _on_gpu(x) -> bool:
  return (isinstance(x, jax.Array)
          and any(d.platform == "gpu" for d in x.devices()))


def assert_equal_results(actual, expected):
  """Same pytree, dtypes and shapes; values bitwise equal (signed zeros and
  NaNs too), or, for floating arrays computed on a GPU, within GPU_TOLERANCE
  of the largest magnitude (at least 1)."""
  leaves_a, tree_a = jax.tree_util.tree_flatten(actual)
  leaves_e, tree_e = jax.tree_util.tree_flatten(expected)
  assert tree_a == tree_e
  for a, e in zip(leaves_a, leaves_e):
    gpu = _on_gpu(a) or _on_gpu(e)
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape
    if gpu and jnp.issubdtype(a.dtype, jnp.inexact):
      wide = (np.complex128 if jnp.issubdtype(a.dtype, jnp.complexfloating)
              else np.float64)
      a, e = a.astype(wide), e.astype(wide)
      scale = float(np.max(np.abs(e[np.isfinite(e)]), initial=1.0))
      np.testing.assert_allclose(a, e, rtol=0, atol=GPU_TOLERANCE * scale)
      continue
    np.testing.assert_array_equal(a, e)
    assert a.tobytes() == e.tobytes()  # bitwise, signed zeros and NaNs too


def check_region_graph(plan):
  """Regions come in an order where each reads only what earlier regions made
  (so the region graph is acyclic), and every cross-stream data edge is
  implied by the listed dependencies plus same-stream edges."""
  made_by = {}
  edges = set()
  for region in plan.regions:
    for name in region.inputs:
      if not name.startswith(("a", "c")):   # not an argument or constant
        assert made_by[name] < region.index, (
            f"R{region.index} reads {name} early")
        edges.add((made_by[name], region.index))
    for name in region.outputs:
      made_by[name] = region.index
  kept = {(d.producer, d.consumer) for d in plan.dependencies}
  kept |= {(a, b) for a, b in edges
           if plan.regions[a].stream == plan.regions[b].stream}
  assert kept <= edges

  def reachable(a, b):
    todo, seen = [a], set()
    while todo:
      node = todo.pop()
      if node == b:
        return True
      seen.add(node)
      todo += [y for x, y in kept if x == node and y not in seen]
    return False

  for a, b in edges:
    assert reachable(a, b), f"R{a} -> R{b} is not covered by the dependencies"


def cuda_text(jitted, *args, **kwargs):
  """StableHLO of ``jitted`` lowered for CUDA: works on a CPU-only machine."""
  return jitted.trace(*args, **kwargs).lower(
      lowering_platforms=("cuda",)).as_text()


def cpu_text(jitted, *args, **kwargs):
  """StableHLO of ``jitted`` lowered for XLA:CPU, whatever JAX's default
  backend is."""
  return jitted.trace(*args, **kwargs).lower(
      lowering_platforms=("cpu",)).as_text()


TRACES = "trace_to_jaxpr"              # a jit trace (a trace-cache miss)
LOWERINGS = "lower_jaxpr_to_module"   # a jaxpr lowered to a module


def jax_events(event):
  """Counts jax's ``event`` (``TRACES``, ``LOWERINGS``, nested traces
  included) while open, as jax's own tests count them; yields a function
  giving the count so far."""
  return _compat.count_jax_events(event)


def jaxstreams_threads(prefix="jaxstreams-"):
  """Live threads that jaxstreams started (prefetch, staged and serve
  workers name theirs jaxstreams-...)."""
  return [t for t in threading.enumerate()
          if t.name.startswith(prefix) and t.is_alive()]


def wait_until(predicate, seconds=10.0):
  """Poll ``predicate`` until it holds (True) or ``seconds`` pass (False)."""
  deadline = time.monotonic() + seconds
  while not predicate():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.005)
  return True


@contextlib.contextmanager
def keyboard_interrupt_after(seconds, then=None):
  """Raises KeyboardInterrupt in the main thread after ``seconds``, as Ctrl-C
  would, calling ``then()`` first (to let a blocked worker out only once
  the interrupt is on its way, however late a loaded machine delivers it);
  the timer is cancelled and the handler restored on the way out."""
  def handler(signum, frame):
    if then is not None:
      then()
    raise KeyboardInterrupt("test interrupt")
  old = signal.signal(signal.SIGALRM, handler)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


class FlippingChooser:
  """Stands in for ``mode="measured"``'s chooser
  (``jaxstreams.staging._policy.Chooser``, shared by prefetch and staged)
  and switches between its two ways every ``every`` items (prefetch) or
  calls (staged) it is shown, so that every promise is checked across
  switches: ``monkeypatch.setattr(module, "Chooser", FlippingChooser)``,
  or a ``functools.partial`` of it with another ``every``. (Its windows, as
  the ``Meter`` sums them, are ``every`` items of the way it runs, and each
  ends in a switch.)"""

  def __init__(self, ahead, words, verify=False, unseen_gain=False,
               shares_cores=False, unseen_cycle_s=float("inf"),
               steady_s=0.0, every=2):
    del ahead, verify, unseen_gain, shares_cores, unseen_cycle_s, steady_s
    self.words = words
    self.mode, self.inline = words.inline, True
    self.reason, self.news, self.news_cycle = "switching (test)", None, 0.0
    self.switches, self.trials = 0, []
    self.busy_from = float("inf")     # never asks for busy times
    self.skip, self.check_at, self.windows, self.trial = 0, every, 0, None

  def judge(self, n, cycle, produce, busy, waited, wait, cycles):
    self.inline = not self.inline
    self.mode = self.words.inline if self.inline else self.words.overlap
    self.switches += 1
    self.windows += 1
    return True


def meter_for(chooser):
  """The ``Meter`` through which a test shows ``chooser`` made-up items
  (and which takes its ``news``): one per chooser, whose clock (``last``)
  starts at 0 so that the first item shown has a cycle too."""
  meter = _meters.get(id(chooser))
  if meter is None or meter.chooser is not chooser:
    ways = (chooser.words.overlap, chooser.words.inline)
    meter = _policy.Meter(ways, chooser, ("items", "own_us", "produce_us"))
    meter.last = 0.0
    _meters[id(chooser)] = meter
  return meter


_meters = {}


def three_chains(x, w):
  """Three independent matmul chains joined at the end: parallel work."""
  outs = []
  for k in range(3):
    h = x * (k + 1)
    for _ in range(4):
      h = jnp.tanh(h @ w)
    outs.append(h)
  return outs[0] + outs[1] + outs[2]


ROOT = pathlib.Path(__file__).resolve().parent.parent


def gpu_target_problem():
  """Why this machine cannot compile for a GPU it lacks (the CUDA plugin
  missing or at another version than jaxlib), or None."""
  import importlib.metadata
  import jaxlib
  from jaxstreams.xla.target import PLUGIN_PACKAGES
  for package in PLUGIN_PACKAGES:
    try:
      version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return f"{package} is not installed"
    if version != jaxlib.__version__:
      return f"{package} {version} does not match jaxlib {jaxlib.__version__}"
  return None


# Fixtures the test files share (import them by name).

@pytest.fixture
def compiles():
  """The names of the functions XLA compiled while the test ran (jax
  names them ``jit(f)``: listed as ``f``)."""
  names = []

  def listen(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      name = str(kwargs.get("fun_name"))
      names.append(name[4:-1] if name.startswith("jit(") else name)
  jax.monitoring.register_event_duration_secs_listener(listen)
  yield names
  jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def _arguments_on_a_gpu(*, autotune, cache=None):
  """jaxstreams.jit told that arguments are on a GPU (the programs compile
  and run on CPU, where XLA ignores the GPU options), its first calls
  timing the ways or not (``autotune``), with ``cache`` the autotune cache
  there; everything restored on the way out."""
  from jaxstreams.choose import choice
  platform = choice.platform
  choice.platform = lambda *a: "gpu"
  jaxstreams.config.update("jaxstreams_autotune", autotune)
  if cache is not None:
    jaxstreams.config.update("jaxstreams_autotune_cache", str(cache))
  try:
    yield
  finally:
    choice.platform = platform
    jaxstreams.config.reset("jaxstreams_autotune_cache")
    jaxstreams.config.reset("jaxstreams_autotune")


@pytest.fixture
def on_a_gpu(tmp_path):
  """Arguments on a pretend GPU, first calls timing the ways, and a fresh
  autotune cache (the fixture's value: its path)."""
  with _arguments_on_a_gpu(autotune=True, cache=tmp_path / "tune.json"):
    yield tmp_path / "tune.json"


@pytest.fixture
def untimed_gpu():
  """Arguments on a pretend GPU, autotuning off: the static default runs."""
  with _arguments_on_a_gpu(autotune=False):
    yield


def require_gpu_target(what="compiling for an H100"):
  """Skip the test when this machine cannot compile for a GPU it lacks; fail
  instead where JAXSTREAMS_REQUIRE_GPU_TARGET=1 (scripts/test.sh sets it)."""
  from jaxstreams.xla.target import install_command
  problem = gpu_target_problem()
  if problem:
    message = f"{what}: {problem}; {install_command()}"
    if os.environ.get("JAXSTREAMS_REQUIRE_GPU_TARGET") == "1":
      pytest.fail(f"JAXSTREAMS_REQUIRE_GPU_TARGET=1 but {message}")
    pytest.skip(message)


def run_example(name, *flags, env=None, timeout=120):
  """Run ``examples/<name>`` from the repository root, as a user would (the
  stream count from the environment left out unless ``env`` sets it);
  returns its standard output, failing with its output if it fails."""
  environ = dict(os.environ)
  environ.pop("JAXSTREAMS_STREAMS", None)
  environ.update(env or {})
  proc = subprocess.run(
      [sys.executable, str(ROOT / "examples" / name), *flags], cwd=ROOT,
      env=environ, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, (
      f"{name} exited with {proc.returncode}\nstdout:\n{proc.stdout}\n"
      f"stderr:\n{proc.stderr[-4000:]}")
  return proc.stdout


def load_benchmark(name: str):
  """``benchmarks/<name>.py`` as a module, with sys.path as it was: a script
  puts its own directory first (for _common), which would otherwise stay
  there for every test after this one (benchmarks/ holds modules named
  serve, prefetch)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      f"_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  saved = list(sys.path)
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module
