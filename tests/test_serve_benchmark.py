"""benchmarks/serve.py's baselines, driven on CPU without their hardware.

PyTorch with a CUDA stream per client thread runs here against a NumPy
fake of the few torch calls the benchmark makes (PyTorch is not installed
where the tests run, and there is no GPU): the same models give jax.jit's
results, and every client thread runs its requests on a stream of its own.
vmap batching gives each client its own request's result. Results and
structure only, never timings.
"""

import contextlib
import pathlib
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from programs import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench():
  """benchmarks/serve.py as a module, with sys.path as it was."""
  return load_benchmark("serve")


class FakeTensor(np.ndarray):
  """The tensor methods the models call, on NumPy."""

  def transpose(self, a, b):
    return np.swapaxes(self, a, b)

  def mean(self, dim=None, keepdim=False):
    return np.asarray(self).mean(axis=dim, keepdims=keepdim).view(FakeTensor)

  def detach(self):
    return self

  def cpu(self):
    return self

  def numpy(self):
    return np.asarray(self)


def _t(x):
  return np.asarray(x).view(FakeTensor)


def fake_torch():
  """A ``torch`` module of the calls serve.py makes, recording which thread
  entered which CUDA stream and synchronized it."""
  torch = types.ModuleType("torch")
  local = threading.local()
  torch.events = []                       # (event, thread, stream)

  class Stream:
    def __init__(self):
      self.owner = threading.current_thread()
      torch.events.append(("made", self.owner, self))

    def synchronize(self):
      torch.events.append(("synchronized", threading.current_thread(), self))

  @contextlib.contextmanager
  def stream(s):
    torch.events.append(("entered", threading.current_thread(), s))
    local.current = s
    yield
    local.current = None

  def softmax(x, dim):
    e = np.exp(x - np.max(x, axis=dim, keepdims=True))
    return _t(e / e.sum(axis=dim, keepdims=True))

  torch.cuda = types.SimpleNamespace(is_available=lambda: True, Stream=Stream,
                                     stream=stream)
  torch.inference_mode = contextlib.nullcontext
  torch.as_tensor = lambda x, device=None: _t(np.array(x))
  torch.relu = lambda x: _t(np.maximum(x, 0))
  torch.softmax = softmax
  torch.log_softmax = lambda x, dim: _t(np.log(softmax(x, dim)))
  torch.sigmoid = lambda x: _t(1 / (1 + np.exp(-np.asarray(x))))
  torch.sqrt = lambda x: _t(np.sqrt(x))
  torch.cat = lambda xs, dim: _t(np.concatenate(xs, axis=dim))
  torch.stack = lambda xs, dim: _t(np.stack(xs, axis=dim))
  return torch


@pytest.mark.parametrize("name", ["mlp", "encoder", "dlrm"])
def test_torch_baseline_runs_each_client_on_a_stream_of_its_own(
    bench, name, monkeypatch):
  torch = fake_torch()
  monkeypatch.setitem(sys.modules, "torch", torch)
  model = bench.serve_models.MODELS[name]()
  inputs_np = [model.inputs(i) for i in range(4)]
  call, inputs, device, why_not = bench.torch_way(model, inputs_np)
  assert why_not is None and device == "cuda"
  jitted = jax.jit(bench.serve_models.jax_function(model))
  results = {}

  def client(t):
    results[t] = [np.asarray(call(*inputs[t])) for _ in range(3)]

  threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  for t in range(4):
    want = np.asarray(jitted(*(jnp.asarray(a) for a in inputs_np[t])))
    for got in results[t]:
      np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  made = [(thread, s) for event, thread, s in torch.events if event == "made"]
  assert len(made) == 4 and len({thread for thread, _ in made}) == 4
  stream_of = dict(made)
  for event, thread, s in torch.events:
    assert s is stream_of[thread], (event, thread)   # only its own stream
  assert sum(e == "entered" for e, _, _ in torch.events) == 12
  assert sum(e == "synchronized" for e, _, _ in torch.events) == 12


def test_torch_baseline_without_pytorch_says_so(bench, monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)      # import fails
  model = bench.serve_models.mlp()
  assert bench.torch_way(model, [model.inputs(0)]) == (
      None, None, None, "n/a: PyTorch is not installed")


@pytest.mark.parametrize("name", ["mlp", "dlrm"])
def test_vmap_batching_gives_each_client_its_own_result(bench, name):
  model = bench.serve_models.MODELS[name]()
  fn = bench.serve_models.jax_function(model)
  inputs = [tuple(jnp.asarray(a) for a in model.inputs(i)) for i in range(6)]
  batcher = bench.VmapBatching(fn, 6)
  assert batcher.buckets == [1, 2, 4, 8]
  try:
    batcher.warm(inputs[0])
    results = {}

    def client(t):
      results[t] = [batcher(*inputs[t]) for _ in range(5)]

    threads = [threading.Thread(target=client, args=(t,)) for t in range(6)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
  finally:
    batcher.close()
  for t in range(6):
    want = np.asarray(jax.jit(fn)(*inputs[t]))
    for got in results[t]:
      assert np.asarray(got).shape == want.shape
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_kernels_are_counted_per_gpu_stream_of_a_trace(bench):
  trace = {"traceEvents": [
      {"ph": "M", "name": "process_name", "pid": 7,
       "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 1,
       "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 7, "tid": 13, "ts": 0, "dur": 5},
      {"ph": "X", "pid": 7, "tid": 13, "ts": 6, "dur": 5},
      {"ph": "X", "pid": 7, "tid": 21, "ts": 2, "dur": 5},
      {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 50}]}
  assert bench.kernels_by_stream(trace) == {"7/13": 2, "7/21": 1}
