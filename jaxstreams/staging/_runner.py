"""``staged(step, data=...)``: software pipelining of a step, the runner.

A training step usually begins with work that depends only on the batch
(decoding, hashing, casting, feature crosses, the host-to-device copy) and
continues with work on parameters and state. The first part of batch
``k + 1`` does not need batch ``k``'s results, so it can run while batch
``k``'s second part runs: TensorFlow's staging areas (warm-up
``A0; A1 B0; A2 B1 C0; ...``), DeepRec's ``tf.staged`` and SmartStage.

Where each piece lives: ``_marker`` (``stage(x)``), ``_analysis`` (how a step
is split), ``_splits`` (the split a batch uses, cached, and the other
arguments it is made for), ``_source`` (reading the batches), ``_fused``
(the fused pipeline: one program per call), ``_measured`` (modes
``"measured"``, ``"fused"`` and ``"plain"``: the fused pipeline where it
pays, the plain step where it does not) and ``_threads``
(``mode="threads"``). This module checks the arguments, picks the run and
tells the user once when staging stepped aside. Each way, each equation is
the one ``step`` would run, on the same inputs, so the outputs are
``step``'s (bitwise on CPU).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Iterable

import jax

from jaxstreams import _checks, config
from jaxstreams._jit import jit as streams_jit, spec_of
from jaxstreams._performance import PerformanceWarning
from jaxstreams.staging._analysis import FUNC, Split, build_split
from jaxstreams.staging._measured import MeasuredRun
from jaxstreams.staging._fused import FusedRun
from jaxstreams.staging._plan import StagedPlan
from jaxstreams.staging._splits import Splits
from jaxstreams.staging._threads import ThreadRun, jit_parts

MODES = ("measured", "fused", "plain", "threads")


class StagedRunner:
  """What ``jaxstreams.staged`` returns: call it with the step's other
  arguments to run the next batch. Raises ``StopIteration`` once the data is
  exhausted and drained; also an iterator-friendly context manager with
  ``close()``. ``mode`` is the mode asked for (``stats()["mode"]`` is the
  way it runs now); ``plan`` is the ``StagedPlan`` of the latest batch
  staged (the first batch's until one is; None before the first call);
  ``stream`` and ``streams`` (from the first call on, all modes but
  ``"threads"``) the producer's stream and the stream count its fused
  program is compiled with; ``data_argnums`` the data argument's position,
  normalised to the one int that was given (``[1]`` is kept as ``1``, and
  a negative position stays negative: counted from the end)."""

  def __init__(self, step: Callable, data: Iterable[Any], data_argnums: int,
               capacity: int, stream: int | None, smart: bool, mode: str):
    fun, consumer_jit, self._name, self._streams_now, self._plain = \
        _unwrap(step)
    self._data = data
    self.data_argnums = data_argnums
    self.capacity = capacity
    self.stream = stream
    self.streams: int | None = None
    self.smart = smart
    self.mode = mode
    if mode == "threads":
      # Thread mode jits each part on its own (the producer on ``stream``);
      # fused programs apply the stream inside the one program they fuse.
      self._splits = Splits(fun, self._name, data_argnums, smart,
                            jit_key=(stream, consumer_jit.key,
                                     config.read("jaxstreams_gpu_lowering")),
                            jit_parts=jit_parts(stream, consumer_jit.jit))
    else:
      self._splits = Splits(fun, self._name, data_argnums, smart)
    self._run: MeasuredRun | ThreadRun | None = None
    self._done = False

  def _start(self, other_args: tuple, kwargs: dict) -> None:
    """The first call: reads the first batch and splits the step with it
    (in the caller, so a planning error is raised by this call), then
    starts the run."""
    data, self._data = self._data, None     # the run owns the iterable now
    other = (other_args, kwargs)
    if self.mode == "threads":
      self._run = ThreadRun(self._splits, data, self.capacity, other)
    else:
      self._run = MeasuredRun(self._splits, data, self.mode, self.capacity,
                              self.stream, self._streams_now, self._plain,
                              self.data_argnums, other)
      self.stream, self.streams = self._run.stream, self._run.streams

  def __call__(self, *other_args, **kwargs):
    if self._done:
      raise StopIteration
    try:
      if self._run is None:
        self._start(other_args, kwargs)
      outs = self._run.call(other_args, kwargs)
      if any(self._run.last_split.may_raise):
        # A host callback or foreign call can fail while the program runs:
        # waiting for the results raises its error at this call on every
        # platform (XLA:GPU would raise it when they are read).
        outs = jax.block_until_ready(outs)
    except BaseException:
      self.close()
      raise
    if self._run.meter.news is not None:
      self._tell()
    return outs

  def _tell(self) -> None:
    """The one ``PerformanceWarning``: staging stepped aside."""
    meter = self._run.meter
    news, meter.news = meter.news, None
    warnings.warn(
        f"{FUNC} does not pay here and stepped aside: {news} "
        f"(runner.stats() has the figures; staged(..., mode='fused') keeps "
        f"staging; filter jaxstreams.PerformanceWarning to silence this)",
        PerformanceWarning, stacklevel=3)

  @property
  def plan(self) -> StagedPlan | None:
    return None if self._run is None else self._run.last_split.plan

  @property
  def _fused(self) -> FusedRun | None:
    return getattr(self._run, "fused", None)

  @property
  def schedule(self) -> list[str]:
    """The latest fused programs run (up to 64), oldest first, in the
    pipeline's notation: ``"A2 B1 C0"`` is one program that ran producer stage A
    (stage 0) for batch 2, stage B for batch 1 and the consumer (the letter
    after the last stage) for batch 0. Calls that ran the plain step (and
    mode ``"threads"``) add none."""
    return self._fused.labels() if self._fused is not None else []

  def step_program(self) -> tuple[Callable, list]:
    """The steady-state fused program (consumer of batch ``k`` with every
    producer stage of the following batches) for the latest batch shapes
    staged, and its arguments as ``jax.ShapeDtypeStruct``s, to inspect it:
    ``program, args = runner.step_program();
    program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()``
    shows the producer inside calls annotated with ``stream``. Whichever
    way the runner runs now (all modes but ``"threads"``)."""
    if self._fused is None:
      raise RuntimeError(f"{FUNC}: step_program() needs a runner in mode "
                         "'measured', 'fused' or 'plain' that has run a "
                         "call")
    return self._fused.step_program(self._run.last_split)

  @property
  def programs_run(self) -> int:
    """How many fused programs ran (one per staged call after the
    warm-up)."""
    return self._fused.programs if self._fused is not None else 0

  def stats(self) -> dict[str, Any]:
    """How the runner runs and why, from its own counters: ``mode`` (the
    way it runs now: ``"fused"``, ``"plain"`` or ``"threads"``) and
    ``mode_reason``; ``calls`` returned; ``switches`` between fused and
    plain and the ``trials`` that compared them (``mode="measured"``); and
    per way (``"fused"`` and ``"plain"``, or ``"threads"`` in that mode):
    ``calls``, ``waited`` (calls that waited for the reader), and per call
    ``read_us`` (reading and placing its batch: in the reader when fused,
    in the caller's thread when plain), ``wait_us``, ``call_us`` (the
    call's own time besides reading in it and waiting) and ``cycle_us``
    (from one call's return to the next's)."""
    if self._run is None:
      way = "plain" if self.mode == "measured" else self.mode
      return {"mode": way, "mode_reason": "no call yet", "calls": 0,
              "switches": 0, "trials": []}
    return self._run.stats()

  def staged_plan(self) -> StagedPlan:
    """What was staged: the ``StagedPlan`` of the latest batch (available
    from the first call on; ``jaxstreams.staging.staged_plan`` makes one from
    example arguments without running)."""
    if self.plan is None:
      raise RuntimeError(f"{FUNC}: the runner has not traced a batch yet; call "
                         "it once, or use jaxstreams.staging.staged_plan("
                         "step, *args) with an example batch")
    return self.plan

  def close(self) -> None:
    """Stops the reader and every stage's worker and waits for them;
    idempotent. Staged values still in flight are dropped."""
    self._done = True
    if self._run is not None:
      self._run.close()

  def __enter__(self) -> StagedRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __repr__(self) -> str:
    way = "" if self._run is None else f" ({self._run.stats()['mode']})"
    return (f"<jaxstreams.staged {self._name}, mode={self.mode!r}{way}, "
            f"capacity={self.capacity}, smart={self.smart}>")


class _ConsumerJit:
  """How thread mode jits the consumer: as the step was jitted (a
  ``jaxstreams.jit`` step keeps its stream plan), and what tells two such
  ways apart in the split cache."""

  def __init__(self, jit: Callable, key: Any):
    self.jit, self.key = jit, key


def _unwrap(step: Callable) -> tuple[Callable, _ConsumerJit, str,
                                     Callable[[], int],
                                     Callable[[Split], Callable]]:
  """The function to trace, how to jit the consumer (thread mode), a name,
  how many streams the step's own plan uses (read when a runner starts),
  and the plain step for a split: the step jitted whole, as the unstaged
  loop runs it (a jitted step itself; a plain function as a
  ``jaxstreams.jit`` one with the streams its own ``stream()`` blocks use,
  as the fused program honours them)."""
  spec = spec_of(step)
  name = getattr(step, "__qualname__", None) or getattr(step, "__name__", repr(step))
  if spec is not None:
    fun = spec.array_function(FUNC)
    consumer_jit = _ConsumerJit(
        lambda f: streams_jit(f, streams=spec.streams),
        ("jaxstreams.jit", spec.streams))
    return fun, consumer_jit, name, spec.streams_now, lambda split: step
  inner = getattr(step, "__wrapped__", None)
  if inner is not None and hasattr(step, "lower"):
    # A jax.jit function: trace what it wraps, so stage() is visible.
    return (inner, _ConsumerJit(jax.jit, "jax.jit"), name, lambda: 1,
            lambda split: step)
  return (step, _ConsumerJit(jax.jit, "jax.jit"), name, lambda: 1,
          lambda split: streams_jit(step, streams=split.streams_used))


_DATA_ARGNUMS = ("an int or a sequence of exactly one int (the position of "
                 "the data argument, -1 for the last)")


def _data_argnums(value: Any) -> int:
  """``data_argnums`` as the one position it names. Spelled as jax spells
  ``static_argnums``: an int, or a sequence of ints; ``staged`` reads one
  data argument, so a sequence must hold exactly one."""
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
  """The options checked; returns ``(data_argnums, capacity, stream)``
  normalised (``data_argnums`` to the one int it names)."""
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

  ``runner = jaxstreams.staged(step, data=batches)``; then each
  ``runner(*other_args)`` takes the next batch ``b``, and returns what
  ``step(*other_args, b)`` returns (``b`` goes in at the position
  ``data_argnums`` names: an int, -1 for the last, or as jax spells
  ``static_argnums`` a sequence, which must hold exactly one int), while
  the producer part of the step (what computes the ``jaxstreams.stage()``
  values from ``b``; with ``smart=True`` all of the step that depends only on
  ``b``) already runs for the following batches. The first call warms the
  pipeline up; once ``data`` is exhausted and drained, calls raise
  ``StopIteration``. An exception raised by ``data`` at batch ``k``, or by a
  producer stage's computation for batch ``k``, is raised by call ``k``.

  ``mode="measured"`` (the default): staged (the fused way below) only
  where the runner's measurements of its own calls say it pays. Staging
  costs every call work of its own, so a step under a millisecond whose
  result is read every step can run slower staged than plain. The runner
  starts *plain*: each call reads the next batch in the caller's thread and
  runs the plain step on it (the step jitted whole, as the unstaged loop
  runs it). It measures its calls and moves to the fused way at once when
  reading a batch takes a third of a call's cycle and at least 200 us (then
  its first 16 staged calls must come out faster than the plain ones that
  chose it, or a trial runs at once), or after a trial that times calls
  both ways when it takes a fifth and at least 30 us. On a platform that
  runs streams (not XLA:CPU), with the producer on a stream of its own, a
  trial runs even when reading is cheap (staging may hide device work no
  clock sees). While staged, trials check that staged calls are faster (at
  doubling intervals, the first after 256 staged calls), and it steps aside
  when one finds them slower or reading turns cheap. A switch keeps every
  promise: the pipeline drains (no new batch enters, a
  fused program per call finishes the staged ones) before the plain step
  runs, so outputs, their order, each batch run once, the errors at call
  ``k`` and ``close()`` are those of either way. The first time it keeps or
  puts the plain step in place, one ``jaxstreams.PerformanceWarning`` says
  so and why; ``runner.stats()`` and ``repr(runner)`` say which way it runs.
  ``mode="plain"`` always runs the plain step (the first call still splits
  the step, so a planning error is raised either way).

  ``mode="fused"``, always staged: each call runs ONE ``jaxstreams.jit``
  program that computes the consumer part for batch ``k`` and, at the same
  time, producer stage ``j`` for batch ``k + K - j`` (``K`` producer stages),
  and hands the staged values on to the next call on the device: a
  software pipeline, ``A0; A1 B0`` on the first call (warm-up), then
  ``A2 B1 C0``, ``A3 B2 C1``, ... and ``B4 C3``, ``C4`` at the end (drain);
  ``runner.schedule`` lists the programs run in that notation. The producer
  part is placed on stream ``stream`` inside the program, so on a GPU it
  runs on its own CUDA stream beside the consumer (an annotated call, as for
  any ``jaxstreams.stream()`` block); on CPU it is inlined and the results
  are bitwise those of the unstaged step. ``stream=None`` picks the first
  stream the step does not use itself (one above its own ``stream()``
  blocks, ``N`` for a ``jaxstreams.jit(streams=N)`` step), and the program is
  compiled with ``streams = max(step's streams, stream + 1)``; ``stream=0``
  keeps the producer on the main stream (no overlap). A thread reads and
  places the batches on the device ahead of the programs that need them,
  at most ``capacity`` ahead; a call never waits for a batch the reader has
  not finished once the pipeline is warm (the program then runs without
  that producer stage, and a later program catches up). The staged values
  of at most ``K + 1`` batches are on the device at once.

  ``mode="threads"``: every producer stage is a program of its own run by a
  worker thread, ``capacity`` finished items ahead per stage, and the
  consumer runs in the caller's thread. On a GPU separate programs do not
  run their device work at the same time, so this hides only host work
  (reading, Python parsing, dispatch) and copies; on CPU, where each program
  runs on its caller's thread, producer work also runs on other cores,
  which helps when the producer's computation is heavy. ``stream`` tags the
  producer's programs.

  ``step`` is a plain function, a ``jaxstreams.jit`` function (its consumer
  part keeps its stream plan) or a ``jax.jit`` function (its wrapped function
  is traced; the plain step is the function itself). Its other arguments
  must keep their shapes from call to call while it stages (the plain step
  takes what the step takes; staging that starts anew takes them as they are
  then). In the fused way, a consumer that uses ``jaxstreams.stream()`` blocks gets
  them honoured even for a plain or ``jax.jit`` step (the program is a
  ``jaxstreams.jit`` one), within the ``streams`` count above. When a fused
  program fails (on CPU, where errors are raised by the call), its parts are
  run again one by one to find the batch the error belongs to, so the
  consumer's side effects of that call may happen twice; on a GPU an error
  raised asynchronously by the device surfaces in the outputs of the call
  that ran it.
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
  where the argument ``data_argnums`` names (as for ``staged``) is an
  example batch. Traces; runs nothing."""
  given = data_argnums
  data_argnums, _, _ = _check_options(data_argnums, 1, None, smart)
  fun, _, name, _, _ = _unwrap(step)
  position = data_argnums if data_argnums >= 0 else len(args) + data_argnums
  if not 0 <= position < len(args):
    raise ValueError(f"{FUNC}: data_argnums={given!r} does not name one of "
                     f"the {len(args)} argument(s)")
  other = args[:position] + args[position + 1:]
  return build_split(fun, name, other, kwargs, args[position], position,
                     smart).plan
