"""The compile matrix: programs x call contexts x GPU ways, each compiled for
an H100 without one, one cell after another in a child process.

A cell that kills XLA's compiler (a segmentation fault, an abort in ptxas)
kills its process: ``tests/test_compile_matrix.py`` runs this script, reads
one JSON line per cell, and where the process died, records the cell that
was being compiled as crashed and starts a new process for the cells left.

    JAX_PLATFORMS=cpu python tests/compile_matrix.py CELL [CELL ...]

A cell is ``program/context/way``:

* programs (``PROGRAMS``): two towers of loops in stream blocks (``lax.scan``
  over stacked layers, ``fori_loop``, ``while_loop`` with a data-dependent
  bound, ``lax.cond``, a checkpointed scan, towers of unequal depth, one
  dividing the other or not),
  constants in regions, and the suite's models;
* contexts: ``top`` (the function's own ``lower``), ``jit`` (called inside
  another ``jax.jit``), ``grad`` and ``vmap`` (under ``jax.grad`` /
  ``jax.vmap`` inside another ``jax.jit``), and ``candidate`` (a way as the
  default's first call on a GPU compiles it to time it);
* ways: every ``gpu_lowering`` name (``default`` included).

Each line printed: ``{"cell", "status", "detail"}`` with status ``ok``
(compiled), ``refused`` (jaxstreams raised its ``LoweringError`` before XLA
compiled anything) or ``error`` (anything else raised).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "tests")]
# The checkout last: the installed jaxstreams (with its native libraries)
# comes first, as in the tests; a checkout that is not installed still runs.
sys.path.append(str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxstreams  # noqa: E402

LAYERS, WIDTH, BATCH = 4, 128, 16
CONTEXTS = ("top", "jit", "grad", "vmap")
# Programs jax.grad cannot differentiate (reverse mode through a while loop
# of unknown trip count), whatever the way; and programs that are training
# steps already (their gradient would be a second derivative: compile time,
# no new construct).
NOT_DIFFERENTIABLE = frozenset({"while_towers"})
TRAINING_STEPS = frozenset({"demo", "dlrm", "dual_encoder", "gru_bank",
                            "dual_encoders_train"})
# Programs of many groups, and towers inside wrappers (taken apart before
# any way is chosen, so every way is the plain towers' way): the default at
# top level, inside another jit and under jax.grad, and stream calls at top
# level (CI time).
FEW_CELLS = frozenset({"dual_encoders", "dual_encoders_train",
                       "checkpointed_towers", "jitted_towers",
                       "custom_vjp_towers"})
# Programs without loops: inside another trace, every way's program is one
# of those the default picks from (the suite's tests compile them too).
LOOPLESS = frozenset({"constant_towers", "demo", "dlrm", "inception",
                      "mlp_bank", "control"})


def _weights(seed, layers=LAYERS, width=WIDTH):
  return jax.random.normal(jax.random.PRNGKey(seed),
                           (layers, width, width)) * 0.1


def _towers(tower):
  """A step with two towers, ``tower(weights, x)`` on streams 1 and 2, and
  main-stream work that needs neither."""
  def step(w1, w2, x):
    with jaxstreams.stream(1):
      a = tower(w1, x)
    with jaxstreams.stream(2):
      b = tower(w2, x)
    return jnp.sum(a * b) + jnp.sum(jnp.cos(x))
  return step


def _scan_tower(ws, x):
  return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def _fori_tower(ws, x):
  return lax.fori_loop(0, ws.shape[0], lambda i, h: jnp.tanh(h @ ws[i]), x)


def _while_tower(ws, x):
  # The bound depends on the data: XLA cannot know the trip count.
  def cond(c):
    i, h = c
    return (i < ws.shape[0]) & (jnp.max(jnp.abs(h)) < 1e6)
  return lax.while_loop(cond, lambda c: (c[0] + 1, jnp.tanh(c[1] @ ws[c[0]])),
                        (0, x))[1]


def _cond_tower(ws, x):
  h = jnp.tanh(x @ ws[0])
  h = lax.cond(jnp.sum(h) > 0, lambda h: jnp.tanh(h @ ws[1]),
               lambda h: h * 2.0, h)
  # A branch whose result is a constant.
  return h + lax.cond(jnp.sum(h) > 1, lambda: 1.0, lambda: 0.0)


def _checkpointed_scan_tower(ws, x):
  body = jax.checkpoint(lambda h, w: (jnp.tanh(jnp.tanh(h @ w) @ w.T), None))
  return lax.scan(body, x, ws)[0]


_CONSTANT = (np.random.RandomState(0).randn(WIDTH, WIDTH).astype(np.float32)
             * 0.1)


def _constant_tower(ws, x):
  # A closed-over numpy constant, and one XLA folds from it.
  return jnp.tanh(x @ _CONSTANT) + jnp.tanh(x @ (_CONSTANT * 2.0)) @ ws[0]


def _tower_program(tower, layers=(LAYERS, LAYERS)):
  def make():
    args = (_weights(1, layers[0]), _weights(2, layers[1]),
            jnp.ones((BATCH, WIDTH)))
    return _towers(tower), args, 3
  return make


def _encoder_tower(ws, x):
  """A dual encoder's tower, small: a scanned stack of residual layers,
  its output normalized."""
  h = lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)[0]
  return h / jnp.linalg.norm(h, axis=-1, keepdims=True)


@jax.custom_vjp
def _custom_vjp_tower(ws, x):
  return _encoder_tower(ws, x)


def _custom_vjp_tower_fwd(ws, x):
  return _encoder_tower(ws, x), (ws, x)


def _custom_vjp_tower_bwd(residuals, cotangent):
  return jax.vjp(_encoder_tower, *residuals)[1](cotangent)


_custom_vjp_tower.defvjp(_custom_vjp_tower_fwd, _custom_vjp_tower_bwd)

TOWER_WRAPS = {None: _encoder_tower,
               "checkpoint": jax.checkpoint(_encoder_tower),
               "jit": jax.jit(_encoder_tower),
               "custom_vjp": _custom_vjp_tower}
# Dual encoders as users write them: (image, text) depths and how each
# tower is wrapped. Real ones differ in depth (ViT-L/14's image tower has
# 24 layers, its text tower 12). Towers inside wrappers, in the view:
# tests/test_loops.py.
ENCODERS = (((4, 4), None), ((6, 3), None), ((24, 12), None))


def dual_encoders(encoders=ENCODERS, training=False):
  """``(fn, args, streams)``: dual encoders side by side in one step, each
  with its image tower on stream 1 and its text tower on stream 2, a
  contrastive loss over each pair; the step returns the embeddings, or
  with ``training`` the loss and its gradients."""
  def embed(params, images, texts):
    out = []
    for (image_ws, text_ws), (_, wrap) in zip(params, encoders):
      tower = TOWER_WRAPS[wrap]
      with jaxstreams.stream(1):
        a = tower(image_ws, images)
      with jaxstreams.stream(2):
        b = tower(text_ws, texts)
      out.append((a, b))
    return out

  def loss(params, images, texts):
    total = 0.0
    for a, b in embed(params, images, texts):
      logits = a @ b.T * 10.0
      total += -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))
    return total

  params = [(_weights(2 * i, a, WIDTH // 2) * 0.5,
             _weights(2 * i + 1, b, WIDTH // 2) * 0.5)
            for i, ((a, b), _) in enumerate(encoders)]
  args = (params, jnp.ones((BATCH, WIDTH // 2)) * 0.1,
          jnp.ones((BATCH, WIDTH // 2)) * 0.2)
  return (jax.value_and_grad(loss) if training else embed), args, 3


def _suite(module_name):
  def make():
    from benchmarks.workloads import common
    module = __import__(f"benchmarks.workloads.{module_name}",
                        fromlist=["model"])
    size = module.sizes(quick=True)[0]
    make_fn, args = module.model(size, 4, jax.random.PRNGKey(0))
    return make_fn(common.place_jaxstreams), args, 4
  return make


def _demo():
  import streams_demo
  params = streams_demo.init(2, 128, 2, jax.random.PRNGKey(0))
  return (streams_demo.make_step(2), (params, jnp.ones((32, 128)),
                                      jnp.ones((32, 1))), 3)


PROGRAMS = {
    "scan_towers": _tower_program(_scan_tower),
    "fori_towers": _tower_program(_fori_tower),
    "while_towers": _tower_program(_while_tower),
    "cond_towers": _tower_program(_cond_tower),
    "checkpointed_scan_towers": _tower_program(_checkpointed_scan_tower),
    # The longer tower runs two layers a step of the towers' one loop.
    "unequal_scan_towers": _tower_program(_scan_tower, (LAYERS, LAYERS // 2)),
    # No common divisor: one loop of three steps, then the layer left.
    "remainder_scan_towers": _tower_program(_scan_tower, (7, 3)),
    "constant_towers": _tower_program(_constant_tower),
    # Towers wrapped as users write them (jax.checkpoint of a whole tower,
    # a jax.jit function, a custom_vjp function), of different depths.
    "checkpointed_towers": _tower_program(TOWER_WRAPS["checkpoint"],
                                          (LAYERS, LAYERS // 2)),
    "jitted_towers": _tower_program(TOWER_WRAPS["jit"], (LAYERS, LAYERS // 2)),
    "custom_vjp_towers": _tower_program(TOWER_WRAPS["custom_vjp"],
                                        (LAYERS, LAYERS // 2)),
    "dual_encoders": dual_encoders,
    "dual_encoders_train": lambda: dual_encoders(training=True),
    "demo": _demo,
    "dlrm": _suite("dlrm"),
    "inception": _suite("inception"),
    "mlp_bank": _suite("mlp_bank"),
    "control": _suite("control"),
    "dual_encoder": _suite("dual_encoder"),
    "gru_bank": _suite("gru_bank"),
    "ode_ensemble": _suite("ode_ensemble"),
}


def _scalar_loss(fn):
  """``fn``'s first result leaf, summed: what ``jax.grad`` differentiates."""
  def loss(*args):
    return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(fn(*args))
               if jnp.issubdtype(leaf.dtype, jnp.inexact))
  return loss


def _float_arguments(args):
  """The positions of the arguments with a float leaf (what grad takes)."""
  return tuple(i for i, a in enumerate(args)
               if any(jnp.issubdtype(leaf.dtype, jnp.floating)
                      for leaf in jax.tree_util.tree_leaves(a)))


def _vmapped_arguments(args):
  """Every argument with a leading axis of 2 added (vmap over it)."""
  return jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), args)


def in_context(f, context: str, args):
  """``(outer, args)``: a jitted function that calls ``f`` in ``context``
  (``top``: ``f`` itself), and the arguments it takes."""
  if context == "top":
    return f, args
  if context == "jit":
    return jax.jit(lambda *a: f(*a)), args
  if context == "grad":
    return jax.jit(jax.grad(_scalar_loss(f),
                            argnums=_float_arguments(args))), args
  if context == "vmap":
    return jax.jit(jax.vmap(f)), _vmapped_arguments(args)
  raise ValueError(f"unknown context {context!r}; one of {CONTEXTS}")


def lower_cell(cell: str, target):
  """Lower one cell for the target: what ``compile()`` of it compiles."""
  program, context, way = cell.split("/")
  fn, args, streams = PROGRAMS[program]()
  if context == "candidate":
    # As the first call on a GPU compiles a way it times: the default's
    # function, that way's top-level program (regions XLA cannot compile
    # that way run in place).
    from jaxstreams.lower import gpu
    f = jaxstreams.jit(fn, streams=streams)
    jitted = f._jit(gpu.WAYS[way], top_level=True, donate=False,
                    plan=f.plan(*args))
    return jitted.lower(*target.abstract(*args))
  f = jaxstreams.jit(fn, streams=streams, gpu_lowering=way)
  outer, args = in_context(f, context, args)
  return outer.lower(*target.abstract(*args))


def _compiled_text(lowered, cell: str, target) -> str:
  """The compiled HLO of a cell. A top-level program is compiled as the
  view compiles it (``jaxstreams.xla.graph.capture``: XLA:GPU's whole
  pipeline in the view's child process, the same compile as
  ``lowered.compile()``), so that the run's compile cache
  (``jaxstreams_compile_cache``, set by ``tests/conftest.py``) serves what
  the default's estimate already compiled for the same program, and the
  other ways' cells the programs another test compiled; a compile XLA
  fails raises. Nested programs never reach the estimate: compiled here."""
  if cell.split("/")[1] not in ("top", "candidate"):
    return lowered.compile().as_text()
  from jaxstreams.xla import graph
  return graph.capture(lowered, target=target)["hlo"]


def main(cells) -> None:
  from jaxstreams import _compat
  target = jaxstreams.gpu_target("h100")
  compiled: dict[str, dict] = {}   # program text and options -> result
  for cell in cells:
    print(json.dumps({"cell": cell, "status": "started"}), flush=True)
    try:
      lowered = lower_cell(cell, target)
      # Cells that hand XLA the same program with the same options compile
      # the same: each is compiled once.
      key = hashlib.sha256((lowered.as_text() + repr(sorted(
          _compat.lowered_compiler_options(lowered).items()))).encode()
                           ).hexdigest()
      if key not in compiled:
        text = _compiled_text(lowered, cell, target)
        compiled[key] = {"status": "ok", "detail": "",
                         "stream_calls": text.count("call-start(")
                         + text.count("async-start(")}
      result = dict(compiled[key])
    except jaxstreams.LoweringError as error:
      result = {"status": "refused", "detail": str(error)[:2000]}
    except Exception as error:  # noqa: BLE001 - every failure is a result
      result = {"status": "error",
                "detail": f"{type(error).__name__}: {str(error)[:2000]}"}
    print(json.dumps({"cell": cell, **result}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
