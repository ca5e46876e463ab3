"""The walk of a plan through emission, as a reader follows it.

Lowering decides before it emits (``jaxstreams.lower.decide``, kept in
``PartitionedProgram.decisions``): emission binds what was decided and
asks nothing again. This holds the shape that leaves to the code. The walk
is where execution is, module by module, while ``emit`` lowers a plan,
read the way a person follows the code: each jaxstreams function is
followed at its first call, and a function already read is not followed
again. A module on a floor below ``lower`` (``test_layout.FLOORS``:
``runtime``, ``_compat``, ``config``, the stages before lowering) is a
service the walk calls: a call into it is one stay, and what it calls in
turn is its own walk, not the plan's. A *stay* is each stretch spent in
one module; a *climb* is a step into a module of a higher floor than the
one before it (back up from such a service). One-time setup (jax's rules
for region calls, the runtime's pool) is done before the walk is taken.

Run as a script, it prints each walk.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxstreams
import test_layout
import test_loops
from programs import four_branches, four_branches_args, gathered_towers

MAX_STAYS = 20
MAX_CLIMBS = 3
EMIT = ("jaxstreams.lower.emit", "emit")
LOWER_FLOOR = test_layout.FLOORS.index(("lower",))


def _floor(module: str) -> int:
  name = module.split(".")[1] if "." in module else module
  for k, names in enumerate(test_layout.FLOORS):
    if name in names:
      return k
  raise AssertionError(f"{module} is on no floor of test_layout.FLOORS")


def walk(function, args, way: str) -> list[tuple[str, str]]:
  """The walk of ``function``'s plan through ``emit`` lowered for CUDA in
  ``way``: (module, function) at each change of module."""
  seen: set = set()
  # Per open frame: followed (True), not (False), a service's (SERVICE,
  # followed, what it calls not), or None (not jaxstreams').
  SERVICE = "service"
  stack: list = []
  walked: list[tuple[str, str]] = []

  def module_of(frame):
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("jaxstreams") else None

  def arrive(module: str, name: str) -> None:
    if not walked or walked[-1][0] != module:
      walked.append((module, name))

  def profile(frame, event, _):
    if event not in ("call", "return"):
      return
    module = module_of(frame)
    if event == "call":
      if not stack and (module, frame.f_code.co_name) != EMIT:
        return
      if module is None:
        stack.append(None)
        return
      key = frame.f_code
      follow = (key not in seen and False not in stack
                and SERVICE not in stack)
      seen.add(key)
      stack.append(SERVICE if follow and _floor(module) < LOWER_FLOOR
                   else follow)
      if follow:
        arrive(module, frame.f_code.co_name)
      return
    if not stack:
      return
    followed = stack.pop()
    if (followed and stack and False not in stack
        and SERVICE not in stack):
      caller = frame.f_back
      while caller is not None and module_of(caller) is None:
        caller = caller.f_back
      if caller is not None:
        arrive(module_of(caller), caller.f_code.co_name)

  def lower():
    fresh = lambda *a: function(*a)   # noqa: E731 (nothing traced is reused)
    try:
      jaxstreams.jit(fresh, streams=4, gpu_lowering=way).trace(
          *args).lower(lowering_platforms=("cuda",))
    except jaxstreams.LoweringError:
      pass   # a way asked for that this jaxlib refuses: emitted all the same

  lower()   # the one-time setup, outside the walk
  sys.setprofile(profile)
  try:
    lower()
  finally:
    sys.setprofile(None)
  return walked


def stays_and_climbs(walked) -> tuple[int, int]:
  modules = [module for module, _ in walked]
  climbs = sum(_floor(b) > _floor(a) for a, b in zip(modules, modules[1:]))
  return len(modules), climbs


def _grad(function):
  return jax.grad(lambda *a: jnp.sum(function(*a)))


def _gathered():
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  ws = [jnp.linspace(-1, 1, 256).reshape(16, 16) / (t + 2) for t in range(2)]
  x = jnp.linspace(0, 1, 512).reshape(32, 16)
  step = gathered_towers(mesh)
  return (lambda x, ws: step(ws, x)), (x, ws)


def _programs():
  towers = test_loops._two_towers(test_loops._delta_scan)
  nested = test_loops._two_towers(test_loops._nested_delta_scan)
  return {
      "loop towers": (towers, test_loops._mixed_args((8, 4))),
      "loop towers, grad": (_grad(towers), test_loops._mixed_args((8, 4))),
      "nested loop towers, grad": (_grad(nested),
                                   test_loops._mixed_args((4, 4))),
      "four branches": (four_branches, four_branches_args(8, 16)),
      "four branches, grad": (_grad(four_branches), four_branches_args(8, 16)),
      "shard_map bodies, grad": _gathered(),
  }


WAYS = ("inline", "loops", "streams", "concurrent")


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", list(_programs()))
def test_emission_walks_each_plan_in_few_stays(name, way):
  if name.startswith("shard_map") and len(jax.devices()) < 2:
    pytest.skip("needs 2 devices of JAX's default backend")
  function, args = _programs()[name]
  walked = walk(function, args, way)
  stays, climbs = stays_and_climbs(walked)
  path = " > ".join(f"{m.removeprefix('jaxstreams.')}:{f}"
                    for m, f in walked)
  assert walked and walked[0] == EMIT, path
  assert stays <= MAX_STAYS and climbs <= MAX_CLIMBS, (
      f"{stays} stays, {climbs} climbs: {path}")


if __name__ == "__main__":
  for name, (function, args) in _programs().items():
    for way in WAYS:
      walked = walk(function, args, way)
      stays, climbs = stays_and_climbs(walked)
      print(f"{name}, {way}: {stays} stays, {climbs} climbs")
      print("  " + " > ".join(f"{m.removeprefix('jaxstreams.')}:{f}"
                              for m, f in walked))
