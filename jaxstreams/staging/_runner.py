"""``staged(step, data=...)``: software pipelining of a step (TensorFlow's
staging areas, DeepRec's SmartStage): the arguments, the run
(``_measured``) and the one warning.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Iterable

import jax

from jaxstreams import _checks
from jaxstreams._jit import jit as streams_jit, spec_of
from jaxstreams._performance import PerformanceWarning
from jaxstreams.partition.stages import FUNC, Split, StagedPlan, build_split
from jaxstreams.staging._measured import MeasuredRun
from jaxstreams.staging._fused import FusedRun
from jaxstreams.staging._splits import Splits

MODES = ("measured", "fused", "plain")


class StagedRunner:
  """What ``jaxstreams.staged`` returns: call it with the step's other
  arguments to run the next batch; ``StopIteration`` once the data is
  drained. A context manager with ``close()``. ``mode``: the mode asked for
  (``stats()["mode"]`` the way it runs); ``plan``: the latest batch's
  ``StagedPlan``; ``stream``, ``streams`` (from the first call): the
  producer's stream, the programs' stream count."""

  def __init__(self, step: Callable, data: Iterable[Any], data_argnums: int,
               capacity: int, stream: int | None, smart: bool, mode: str):
    fun, self._name, self._streams_now, self._plain = _unwrap(step)
    self._data = data
    self.data_argnums = data_argnums
    self.capacity = capacity
    self.stream = stream
    self.streams: int | None = None
    self.smart = smart
    self.mode = mode
    self._splits = Splits(fun, self._name, data_argnums, smart)
    self._run: MeasuredRun | None = None
    self._done = False

  def _start(self, other_args: tuple, kwargs: dict) -> None:
    """The first call reads the first batch and splits the step with it."""
    data, self._data = self._data, None     # the run owns the iterable now
    self._run = MeasuredRun(self._splits, data, self.mode, self.capacity,
                            self.stream, self._streams_now, self._plain,
                            self.data_argnums, (other_args, kwargs))
    self.stream, self.streams = self._run.stream, self._run.streams

  def __call__(self, *other_args, **kwargs):
    if self._done:
      raise StopIteration
    try:
      if self._run is None:
        self._start(other_args, kwargs)
      outs = self._run.call(other_args, kwargs)
      if any(self._run.last_split.may_raise):
        # Raise a failure while the program runs at this call.
        outs = jax.block_until_ready(outs)
    except BaseException:
      self.close()
      raise
    meter = self._run.meter
    if meter.news is not None:      # the one warning: staging stepped aside
      news, meter.news = meter.news, None
      warnings.warn(
          f"{FUNC} does not pay here and stepped aside: {news} "
          f"(runner.stats() has the figures; staged(..., mode='fused') keeps "
          f"staging; filter jaxstreams.PerformanceWarning to silence this)",
          PerformanceWarning, stacklevel=2)
    return outs

  @property
  def plan(self) -> StagedPlan | None:
    return None if self._run is None else self._run.last_split.plan

  @property
  def _fused(self) -> FusedRun | None:
    return None if self._run is None else self._run.fused

  @property
  def schedule(self) -> list[str]:
    """The latest fused programs run (up to 64), oldest first: ``"A2 B1
    C0"`` ran stage A for batch 2, B for batch 1 and the consumer for 0."""
    return self._fused.labels() if self._fused is not None else []

  def step_program(self) -> tuple[Callable, list]:
    """The steady-state fused program for the latest batch and its
    arguments as ``jax.ShapeDtypeStruct``s, to inspect."""
    if self._fused is None:
      raise RuntimeError(f"{FUNC}: step_program() needs a runner that has "
                         "run a call")
    return self._fused.step_program(self._run.last_split)

  @property
  def programs_run(self) -> int:
    """How many fused programs ran."""
    return self._fused.programs if self._fused is not None else 0

  def stats(self) -> dict[str, Any]:
    """How the runner runs and why: ``mode`` (``"fused"`` or ``"plain"``)
    and ``mode_reason``; ``calls``; ``switches`` and
    ``trials`` (``mode="measured"``); per way ``calls``, ``waited`` (calls
    that waited for the reader) and per call ``read_us``, ``wait_us``,
    ``call_us`` (its other time) and ``cycle_us``."""
    if self._run is None:
      way = "plain" if self.mode == "measured" else self.mode
      return {"mode": way, "mode_reason": "no call yet", "calls": 0,
              "switches": 0, "trials": []}
    return self._run.meter.report(self._run.way, self._run.reason)

  def staged_plan(self) -> StagedPlan:
    """The ``StagedPlan`` of the latest batch (from the first call on)."""
    if self.plan is None:
      raise RuntimeError(f"{FUNC}: the runner has not traced a batch yet; call "
                         "it once, or use jaxstreams.staging.staged_plan("
                         "step, *args) with an example batch")
    return self.plan

  def close(self) -> None:
    """Stops the reader and workers and waits for them; idempotent. Staged
    values in flight are dropped."""
    self._done = True
    if self._run is not None:
      self._run.close()

  def __enter__(self) -> StagedRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    way = "" if self._run is None else f" ({self._run.way})"
    return (f"<jaxstreams.staged {self._name}, mode={self.mode!r}{way}, "
            f"capacity={self.capacity}, smart={self.smart}>")


def _unwrap(step: Callable) -> tuple[Callable, str, Callable[[], int],
                                     Callable[[Split], Callable]]:
  """The function to trace, a name, the streams the step's own plan uses,
  and the plain step for a split (the step jitted whole)."""
  spec = spec_of(step)
  name = (getattr(step, "__qualname__", None)
          or getattr(step, "__name__", repr(step)))
  if spec is not None:
    fun = spec.array_function(FUNC)
    return fun, name, spec.streams_now, lambda split: step
  inner = getattr(step, "__wrapped__", None)
  if inner is not None and hasattr(step, "lower"):
    # A jax.jit function: trace what it wraps, so stage() is visible.
    return inner, name, lambda: 1, lambda split: step
  return (step, name, lambda: 1,
          lambda split: streams_jit(step, streams=split.streams_used))


_DATA_ARGNUMS = ("an int or a sequence of exactly one int (the position of "
                 "the data argument, -1 for the last)")


def _data_argnums(value: Any) -> int:
  """``data_argnums`` as the one position it names."""
  item = value
  if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
    if len(value) != 1:
      raise ValueError(f"{FUNC}: data_argnums must be {_DATA_ARGNUMS}: "
                       f"staged reads one data argument, got {value!r}")
    item = value[0]
  if not isinstance(item, bool):
    try:
      return operator.index(item)
    except TypeError:
      pass
  raise TypeError(f"{FUNC}: data_argnums must be {_DATA_ARGNUMS}, got "
                  f"{value!r} of type {type(value).__name__}")


def _check_options(data_argnums, capacity, stream, smart, mode="measured"):
  """The options checked: ``(data_argnums, capacity, stream)``."""
  data_argnums = _data_argnums(data_argnums)
  capacity = _checks.integer(capacity, name="capacity", context=FUNC,
                             minimum=1)
  stream = _checks.integer(stream, name="stream", context=FUNC, minimum=0,
                           meaning=" (0 is the main stream)", none_ok=True)
  if not isinstance(smart, bool):
    raise TypeError(f"{FUNC}: smart must be True or False, got {smart!r}")
  _checks.one_of(mode, MODES, name="mode", context=FUNC)
  return data_argnums, capacity, stream


def staged(step: Callable, data: Iterable[Any], *,
           data_argnums: int | Sequence[int] = -1,
           capacity: int = 1, stream: int | None = None,
           smart: bool = False, mode: str = "measured") -> StagedRunner:
  """Runs ``step`` as a software pipeline over the batches of ``data``.

  ``runner = jaxstreams.staged(step, data=batches)``; each
  ``runner(*other_args)`` takes the next batch ``b`` and returns what
  ``step(*other_args, b)`` returns (``b`` at ``data_argnums``: an int, -1
  for the last, or a sequence of exactly one int), while the producer part
  of the step (what computes the ``jaxstreams.stage()`` values from ``b``;
  with ``smart=True`` all of the step that depends only on ``b``) already
  runs for the following batches. Once ``data`` is exhausted and drained,
  calls raise ``StopIteration``. An exception raised by ``data`` at batch
  ``k``, or by a producer stage for batch ``k``, is raised by call ``k``.

  ``mode="fused"``: each call runs ONE ``jaxstreams.jit`` program with the
  consumer part for batch ``k`` and producer stage ``j`` for batch
  ``k + K - j`` (``K`` stages): ``A0; A1 B0`` (warm-up), ``A2 B1 C0``, ...,
  ``B4 C3``, ``C4`` (drain); ``runner.schedule`` lists them. The producer
  runs on stream ``stream`` (``None``: the first the step does not use;
  ``0``: the main stream); the program has ``max(step's streams, stream +
  1)``. A reader thread places batches up to ``capacity`` ahead; a warm
  pipeline never waits for one. At most ``K + 1`` batches' staged values
  are on the device at once.

  ``mode="measured"`` (default): the plain step (jitted whole, on batches
  read in the caller's thread) until the runner's own measurements say
  staging pays, then fused, and back when it stops paying
  (docs/sharp-edges.md). A switch drains the pipeline first, so outputs,
  order, errors and ``close()`` hold either way. One
  ``jaxstreams.PerformanceWarning`` the first time it steps aside.
  ``mode="plain"``: always the plain step (the first call still splits).

  ``step`` is a plain function, a ``jaxstreams.jit`` function (its consumer
  keeps its stream plan) or a ``jax.jit`` one. Its other arguments must
  keep their shapes while it stages. A failed fused program is run again
  part by part to find the batch the error belongs to, so the consumer's
  side effects of that call may happen twice.
  """
  if not callable(step):
    raise TypeError(f"{FUNC}: step must be callable, got {step!r} of type "
                    f"{type(step).__name__}")
  data_argnums, capacity, stream = _check_options(data_argnums, capacity,
                                                  stream, smart, mode)
  try:
    iter(data)
  except TypeError:
    raise TypeError(f"{FUNC}: data must be an iterable of batches, got "
                    f"{data!r} of type {type(data).__name__}") from None
  return StagedRunner(step, data, data_argnums, capacity, stream, smart, mode)


def staged_plan(step: Callable, *args,
                data_argnums: int | Sequence[int] = -1,
                smart: bool = False, **kwargs) -> StagedPlan:
  """The ``StagedPlan`` ``staged`` would make for ``step(*args, **kwargs)``,
  the argument at ``data_argnums`` an example batch. Traces, runs nothing."""
  given = data_argnums
  data_argnums, _, _ = _check_options(data_argnums, 1, None, smart)
  fun, name, _, _ = _unwrap(step)
  position = data_argnums if data_argnums >= 0 else len(args) + data_argnums
  if not 0 <= position < len(args):
    raise ValueError(f"{FUNC}: data_argnums={given!r} does not name one of "
                     f"the {len(args)} argument(s)")
  other = args[:position] + args[position + 1:]
  return build_split(fun, name, other, kwargs, args[position], position,
                     smart).plan
