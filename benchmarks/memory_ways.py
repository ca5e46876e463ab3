"""How much device memory each GPU way holds beyond ``jax.jit``'s program,
and whose it is: CONCURRENT graphs' own, the loop grouping's own, stream
calls', together; compiled for an H100 on a machine without one.

No timing, no GPU: XLA's memory analysis (``compiled.memory_analysis()``)
of each program compiled for the target, as ``f.plan(*args,
target="h100")`` states it. Per program: ``jax.jit``'s temporaries, and
for each way what it needs beyond them (temporaries; arguments and outputs
are the same for every way): ``concurrent`` is ``jax.jit``'s program with
CONCURRENT graphs (CONCURRENT's own), ``loops`` groups independent loops
without it (the grouping's own), ``loops_concurrent`` both; ``streams``
and ``streams_concurrent`` stream calls; "nested" what jaxstreams' default
runs inside another jit, with the bound of it that decides whether it may
(``jaxstreams.lower.memory.extra_bound``), which must hold also under a
gradient taken outside (measured for the programs that are not training
steps already).

Needs the CUDA plugin at jaxlib's version (``jaxstreams.xla.target``).

  JAX_PLATFORMS=cpu python benchmarks/memory_ways.py [--quick] [--out DIR]
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import _common  # noqa: E402
import jaxstreams  # noqa: E402
from jaxstreams.lower import gpu, memory  # noqa: E402


def _towers(layers, width, batch, train):
  """Two towers of ``lax.scan`` over stacked MLP layers (two matmuls and
  tanh each), on streams 1 and 2; the training step returns the loss and
  the gradients of both towers' weights."""
  def layer(h, w):
    return jnp.tanh(jnp.tanh(h @ w[0]) @ w[1]), None

  def forward(w1, w2, x):
    with jaxstreams.stream(1):
      a = lax.scan(layer, x, w1)[0]
    with jaxstreams.stream(2):
      b = lax.scan(layer, x, w2)[0]
    return a, b

  def loss(w1, w2, x):
    a, b = forward(w1, w2, x)
    return jnp.sum(a * b)

  fn = jax.value_and_grad(loss, argnums=(0, 1)) if train else forward
  args = (jax.ShapeDtypeStruct((layers[0], 2, width, width), jnp.float32),
          jax.ShapeDtypeStruct((layers[1], 2, width, width), jnp.float32),
          jax.ShapeDtypeStruct((batch, width), jnp.float32))
  return fn, args, 3


def _four_branches():
  import gpu_compile_programs
  fn, args, streams = gpu_compile_programs.four_branches()
  return fn, jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args), streams


def _matrix(name):
  """A program of the compile matrix (tests/compile_matrix.py)."""
  def make():
    import compile_matrix
    fn, args, streams = compile_matrix.PROGRAMS[name]()
    return fn, jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args), streams
  return make


# Programs that are training steps already: no gradient taken outside.
TRAINING_STEPS = ("training step", "dual_encoder", "demo")


def programs(quick):
  if quick:
    return {"towers 4+4, d=128, batch 16, forward":
            lambda: _towers((4, 4), 128, 16, False)}
  return {
      "towers 12+12, d=512, batch 64, training step":
          lambda: _towers((12, 12), 512, 64, True),
      "towers 24+12, d=512, batch 64, training step":
          lambda: _towers((24, 12), 512, 64, True),
      # Lengths whose ratio is more than four layers a step: two phases.
      "towers 10+4, d=512, batch 64, training step":
          lambda: _towers((10, 4), 512, 64, True),
      "towers 12+12, d=512, batch 64, forward":
          lambda: _towers((12, 12), 512, 64, False),
      "four branches (no loops), forward": _four_branches,
      "compile matrix: scan_towers": _matrix("scan_towers"),
      "compile matrix: checkpointed_scan_towers":
          _matrix("checkpointed_scan_towers"),
      "compile matrix: dual_encoder (training step)": _matrix("dual_encoder"),
      "compile matrix: demo (training step)": _matrix("demo"),
  }


def _scalar_loss(fn):
  def loss(*args):
    return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(fn(*args))
               if jnp.issubdtype(leaf.dtype, jnp.inexact))
  return loss


def measure(fn, args, streams, target, gradient_outside: bool) -> dict:
  """Each way's footprint (compiled in this process for ``target``), the
  nested default's (inside another jit, and with ``gradient_outside``
  under ``jax.grad`` taken there, against ``jax.jit``'s gradient), and the
  bound of the nested one."""
  abstract = target.abstract(*args)
  f = jaxstreams.jit(fn, streams=streams)
  rows = {}

  def footprint(jitted):
    try:
      found = memory.footprint(jitted.lower(*abstract).compile())
      if found is None:
        return "no memory analysis"
      return {**found.as_dict(), "needed": found.needed}
    except Exception as error:  # noqa: BLE001 - a way XLA cannot compile
      return f"error: {type(error).__name__}: {str(error)[:200]}"

  rows["jax.jit"] = footprint(jax.jit(fn))
  for way in gpu.WAYS.values():
    rows[way.name] = footprint(f._jit(way, top_level=True))
  nested_way = f._nested_way()
  rows["nested"] = footprint(jax.jit(lambda *a: f(*a)))
  if gradient_outside:
    nums = tuple(i for i, a in enumerate(args)
                 if any(jnp.issubdtype(leaf.dtype, jnp.floating)
                        for leaf in jax.tree_util.tree_leaves(a)))
    rows["jax.jit, gradient"] = footprint(
        jax.jit(jax.grad(_scalar_loss(fn), argnums=nums)))
    rows["nested, gradient outside"] = footprint(
        jax.jit(jax.grad(_scalar_loss(f), argnums=nums)))
  program = f._program(nested_way, top_level=False)
  bound = memory.extra_bound(f._spec.partitioned(*args), program)
  return {"ways": rows, "nested_way": nested_way.name,
          "nested_bound_bytes": bound,
          "groups": len(f.plan(*args).loops)}


def summary(name, result) -> str:
  rows = result["ways"]
  base = rows["jax.jit"]
  if not isinstance(base, dict):
    return f"{name}: jax.jit's program did not compile ({base})"
  cells = [f"jax.jit temp {memory.bytes_text(base['temp'])}"]
  for way in ("concurrent", "loops", "loops_concurrent", "streams",
              "streams_concurrent", "nested"):
    row = rows.get(way)
    if not isinstance(row, dict):
      cells.append(f"{way}: -")
      continue
    extra = row["temp"] - base["temp"]
    sign = "+" if extra >= 0 else "-"
    cells.append(f"{way} {sign}{memory.bytes_text(abs(extra))} "
                 f"({row['temp'] / max(base['temp'], 1):.2f}x)")
  bound = result["nested_bound_bytes"]
  extras = nested_extras(result)
  cells.append(f"nested is {result['nested_way']!r}, bound "
               f"{memory.bytes_text(bound)}"
               + (f" (gradient outside: +{memory.bytes_text(extras[1])})"
                  if len(extras) > 1 else "")
               + ("" if all(bound >= e for e in extras)
                  else " BELOW XLA's figure"))
  return f"{name} ({result['groups']} loop group(s)): " + "; ".join(cells)


def nested_extras(result) -> list[int]:
  """What the nested default needs beyond jax.jit's program (bytes for a
  call): inside another jit, and under a gradient taken outside."""
  rows = result["ways"]
  pairs = [("nested", "jax.jit"),
           ("nested, gradient outside", "jax.jit, gradient")]
  return [rows[a]["needed"] - rows[b]["needed"] for a, b in pairs
          if isinstance(rows.get(a), dict) and isinstance(rows.get(b), dict)]


def main():
  p = _common.parser(__doc__.splitlines()[0], "one small program")
  options = p.parse_args()
  target = jaxstreams.gpu_target("h100")
  result = {"machine": _common.machine(), "target": "h100 (deviceless)",
            "method": "XLA's memory analysis of each way's program compiled "
                      "for an H100 without one; bytes", "programs": {}}
  lines = [f"Device memory of each way, H100 deviceless, jax "
           f"{jax.__version__}: temporaries beyond jax.jit's program "
           "(arguments and outputs are the same for every way)"]
  for name, make in programs(options.quick).items():
    fn, args, streams = make()
    result["programs"][name] = found = measure(
        fn, args, streams, target,
        gradient_outside=not any(t in name for t in TRAINING_STEPS))
    lines.append(summary(name, found))
    print(lines[-1], flush=True)
  suffix = "_quick" if options.quick else ""
  # Compiled for an H100 (without one): its results are the H100's.
  path = _common.save(options.out or _common.results_folder("h100"),
                      f"memory_ways_h100_jax{jax.__version__}{suffix}",
                      result, "\n".join(lines) + "\n")
  print("saved", path)


if __name__ == "__main__":
  main()
