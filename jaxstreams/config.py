"""jaxstreams options: one registry, three ways to set each option.

Every option is named ``jaxstreams_<something>`` and can be set

* in code: ``jaxstreams.config.update("jaxstreams_streams", 4)``;
* on the command line of an absl program: ``--jaxstreams_streams=4`` (the
  flags are defined when jaxstreams is imported, so import it before
  ``app.run``);
* in the environment: ``JAXSTREAMS_STREAMS=4``.

When several are given, the first of that list wins. Values are read when a
function is traced, not when it is decorated, so an absl flag parsed after
``@jaxstreams.jit`` was applied still counts. A program that does not use absl
never touches absl's flag registry beyond defining the flags, so it never sees
an absl error.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from typing import Any, Callable

__all__ = ["Option", "update", "read", "options", "reset"]


@dataclasses.dataclass(frozen=True)
class Option:
  """One option: its name, type, default and the rule for valid values."""
  name: str
  type: type
  default: Any
  help: str
  check: Callable[[Any], str | None] = lambda value: None  # error text or None

  @property
  def env_var(self) -> str:
    return self.name.upper()


def _at_least_one(value: int) -> str | None:
  return None if value >= 1 else "must be an integer >= 1"


_OPTIONS: dict[str, Option] = {}
_explicit: dict[str, Any] = {}   # set with update()
_resolved: dict[str, Any] = {}   # cache of read(); cleared by _changed()
_from_env: dict[str, Any] = {}   # environment or default, read once per option
_on_change: list[Callable[[], None]] = []   # called by _changed()


def _define(option: Option) -> Option:
  _OPTIONS[option.name] = option
  return option


STREAMS = _define(Option(
    "jaxstreams_streams", int, 1,
    "Default number of stream groups for jaxstreams.jit (1: no extra streams; "
    "stream ids run from 0, the main stream, to streams-1).",
    _at_least_one))


PROFILE = _define(Option(
    "jaxstreams_profile", bool, False,
    "Trace jaxstreams.jit functions with a timing marker at the start and end "
    "of each region (read when a function is traced; see "
    "jaxstreams.profile()).",
    ))


SPREAD = _define(Option(
    "jaxstreams_spread", bool, False,
    "Spread the equations nobody placed over the streams with the cost-model "
    "scheduler; the split is kept only when its estimated step time is "
    "lower (jaxstreams.jit(spread=...) decides for one function)."))

FORWARD_PROPAGATION = _define(Option(
    "jaxstreams_forward_propagation", bool, False,
    "An unplaced equation whose inputs all come from one stream joins that "
    "stream (TF_MULTI_STREAM_ALLOW_FORWARD_PROPAGATION)."))

STREAM_FROM_FILE = _define(Option(
    "jaxstreams_stream_from_file", str, "",
    "Path of a rules file, lines 'N:regex1,regex2': equations whose name "
    "matches go to stream N (TF_STREAM_FROM_FILE). Empty: no file."))

REDUCE_STREAM_WAIT = _define(Option(
    "jaxstreams_reduce_stream_wait", bool, True,
    "List only the cross-stream dependencies that no other path implies "
    "(TF_REDUCE_STREAM_WAIT); off keeps every cross-stream edge."))


# The values of jaxstreams_gpu_lowering: "default" and the names of the ways,
# which jaxstreams.lower.gpu defines (its NAMES are these, in this order).
GPU_LOWERINGS = ("default", "inline", "concurrent", "loops", "loops_concurrent",
                 "streams", "streams_concurrent")


def _gpu_lowering_value(value: str) -> str | None:
  if value in GPU_LOWERINGS:
    return None
  return f"must be one of {', '.join(GPU_LOWERINGS)}"


GPU_LOWERING = _define(Option(
    "jaxstreams_gpu_lowering", str, "default",
    "How a plan that uses several streams runs on a GPU "
    "(jaxstreams.lower.gpu). "
    "'default': at top level 'concurrent' ('loops_concurrent' where the plan "
    "has independent loops on different streams), or the fastest way timed "
    "in the first calls (jaxstreams_autotune); inside another jit 'streams' "
    "from jax 0.12, 'loops' before. 'inline': the program jax.jit builds. "
    "'concurrent': that program with XLA's CONCURRENT CUDA-graph scheduling "
    "(a top-level compiler option). 'loops': jax.jit's program with "
    "independent loops run as one loop, each body on its own CUDA stream; "
    "'loops_concurrent': that with CONCURRENT graphs. 'streams': each "
    "off-main region a call on its own CUDA stream, loops as in 'loops'. "
    "'streams_concurrent': stream calls with CONCURRENT graphs. A way asked "
    "for that XLA cannot compile for a region raises "
    "jaxstreams.LoweringError. Read when a jaxstreams.jit function is made "
    "(with streams=None: at its first call with each stream count); "
    "jaxstreams.jit(gpu_lowering=...) chooses for one function. Changes "
    "nothing on CPU, which runs one stream.",
    _gpu_lowering_value))

AUTOTUNE = _define(Option(
    "jaxstreams_autotune", bool, True,
    "With gpu_lowering 'default', on a GPU the first top-level call of a "
    "jaxstreams.jit function (per signature) runs jax.jit's program while "
    "the candidate ways compile beside it, and the calls after it time them "
    "and keep the fastest (jaxstreams.choose.choice), a way that needs more "
    "device memory only for a larger gain; the decision is cached on disk. "
    "Off: the top-level default ('concurrent', 'loops_concurrent' where the "
    "plan has independent loops, 'inline' where only loops can run side by "
    "side), untimed, or jax.jit's program where the default's compiled "
    "program would not fit in the GPU's free memory."))

# The names of jaxstreams.xla.target's built-in targets (config sits below
# xla and holds them itself; a test in test_step_time.py holds them to
# BUILTIN_TARGETS).
ESTIMATE_TARGETS = ("h100", "h200")


def _estimate_target_value(value: str) -> str | None:
  if (value.lower() in ("auto", "none") + ESTIMATE_TARGETS
      or os.path.isfile(value)):
    return None
  return (f"must be 'auto', 'none', one of {', '.join(ESTIMATE_TARGETS)}, "
          "or the path of a GpuTargetConfigProto text file")


ESTIMATE_TARGET = _define(Option(
    "jaxstreams_estimate_target", str, "auto",
    "Where nothing times the ways of a jaxstreams.jit function (no GPU in "
    "this process, or jaxstreams_autotune off), the GPU whose estimated step "
    "times (jaxstreams.xla.step_time) may overrule the default's structural "
    "way: the ways weighed are compiled for it in a child process, once per "
    "signature, and another way runs only where it is estimated faster by "
    "more than the estimate's held-out error, never where that error passes "
    "20% or on a kind of program no GPU run measured "
    "(jaxstreams.choose.estimated). 'auto': the GPU at hand, the "
    "target the arguments are placed on (lowering for a GPU from a machine "
    "without one) or this H100/H200 with autotuning off, none for a call "
    "on CPU; the structural way is weighed against jax.jit's program. "
    "'h100', 'h200' or a GpuTargetConfigProto file: that GPU wherever "
    "nothing times, every candidate way weighed. 'none': the structural "
    "default, neither timed nor estimated.",
    _estimate_target_value))

AUTOTUNE_CACHE = _define(Option(
    "jaxstreams_autotune_cache", str, "",
    "The file that keeps autotuning decisions across processes. Empty: "
    "$XDG_CACHE_HOME/jaxstreams/autotune.json (~/.cache by default); "
    "'none': keep nothing on disk."))


COMPILE_CACHE = _define(Option(
    "jaxstreams_compile_cache", str, "none",
    "A directory where compiles for a GPU target made in the view's child "
    "process (jaxstreams.xla_graphs, the step-time estimate's ways) are kept "
    "across processes, keyed by the program, the target, the compiler "
    "options, jax, jaxlib and the native libraries: a program compiled once "
    "is read back (jaxstreams.xla.kept_compiles). 'none': nothing kept."))


SEQUENCE_POINTS = _define(Option(
    "jaxstreams_sequence_points", bool, True,
    "Where XLA does not schedule stream regions itself (jax < 0.12), pin the "
    "plan's order in the GPU program with optimization barriers and return "
    "each region that can overlap other work as one buffer, so that XLA puts "
    "that work inside the region's start..done window. Off: XLA's memory "
    "scheduler orders the regions, which on jax 0.10 and 0.11 often runs them "
    "one at a time. Changes nothing on CPU or on jax >= 0.12."))


def options() -> dict[str, Option]:
  """All options by name."""
  return dict(_OPTIONS)


def _option(name: str) -> Option:
  if not isinstance(name, str):
    raise TypeError(f"jaxstreams option names are strings, got {name!r}")
  try:
    return _OPTIONS[name]
  except KeyError:
    close = difflib.get_close_matches(name, _OPTIONS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown jaxstreams option {name!r}.{hint} Known "
                     f"options: {', '.join(sorted(_OPTIONS))}.") from None


def _validate(option: Option, value: Any, source: str) -> Any:
  """``value`` checked against ``option``; errors name the source of the
  value."""
  if option.type is bool:
    ok = isinstance(value, bool)
  elif option.type is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  else:
    ok = isinstance(value, option.type)
  if not ok:
    raise TypeError(f"{option.name} (from {source}) must be of type "
                    f"{option.type.__name__}, got {value!r} of type "
                    f"{type(value).__name__}")
  problem = option.check(value)
  if problem:
    raise ValueError(f"{option.name} (from {source}) {problem}, got {value!r}")
  return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_env(option: Option, text: str) -> Any:
  source = f"environment variable {option.env_var}"
  stripped = text.strip()
  if option.type is bool:
    if stripped.lower() in _TRUE:
      return True
    if stripped.lower() in _FALSE:
      return False
    raise ValueError(f"{source}={text!r} is not a boolean; use one of "
                     f"{sorted(_TRUE | _FALSE)}")
  if option.type is int:
    try:
      value = int(stripped)
    except ValueError:
      raise ValueError(f"{source}={text!r} is not an integer") from None
    return _validate(option, value, source)
  return _validate(option, option.type(stripped), source)


def update(name: str, value: Any) -> None:
  """Set an option for this process; overrides flags and environment."""
  option = _option(name)
  _explicit[name] = _validate(option, value, "jaxstreams.config.update")
  _changed()


def reset(name: str | None = None) -> None:
  """Forget values set with ``update`` (one option, or all) and re-read the
  environment on the next read."""
  if name is None:
    _explicit.clear()
  else:
    _explicit.pop(_option(name).name, None)
  _from_env.clear()
  _changed()


def _changed() -> None:
  _resolved.clear()
  for callback in _on_change:
    callback()


def on_change(callback: Callable[[], None]) -> None:
  """Call ``callback()`` whenever what ``read`` gives may have changed:
  after ``update`` and ``reset``, and when absl parses or sets one of the
  flags. For whoever keeps what ``read`` said."""
  _on_change.append(callback)


def read(name: str) -> Any:
  """The value in force: update() > absl flag on the command line > env >
  default."""
  value = _resolved.get(name, _resolved)
  if value is _resolved:
    value = _resolved[name] = _resolve(_option(name))
  return value


def _resolve(option: Option) -> Any:
  if option.name in _explicit:
    return _explicit[option.name]
  flag_value = _absl_value(option)
  if flag_value is not None:
    return _validate(option, flag_value, f"flag --{option.name}")
  if option.name not in _from_env:
    text = os.environ.get(option.env_var)
    _from_env[option.name] = (option.default if text is None
                              else _parse_env(option, text))
  return _from_env[option.name]


# ---------------------------------------------------------------------------
# absl bridge.

def _absl_flags():
  """absl's FLAGS if absl is imported by this program, else None."""
  if "absl.flags" not in sys.modules:
    return None
  return sys.modules["absl.flags"].FLAGS


def _absl_value(option: Option) -> Any:
  """The value given on the command line (or set by the program), or None.
  Before absl parses there is none; the parse tells ``_flag_validator``."""
  flags = _absl_flags()
  if flags is None or not flags.is_parsed() or option.name not in flags:
    return None
  flag = flags[option.name]
  return flag.value if flag.present else None


def _define_absl_flags() -> None:
  """Define ``--jaxstreams_*`` flags when absl is installed; never fail."""
  try:
    from absl import flags
  except ImportError:
    return
  definers = {int: flags.DEFINE_integer, bool: flags.DEFINE_bool,
              str: flags.DEFINE_string}
  for option in _OPTIONS.values():
    try:
      if option.name not in flags.FLAGS:  # else: a reload, or another copy
        definers[option.type](option.name, None, option.help)
      flags.register_validator(option.name, _flag_validator)
    except flags.Error:
      pass


def _flag_validator(value: Any) -> bool:
  """absl runs this for each of our flags once it has parsed the command
  line, and when a program sets the flag: what ``read`` said may have
  changed. Accepts every value (``_validate`` judges it when read)."""
  del value
  _changed()
  return True


_define_absl_flags()
