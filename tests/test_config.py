"""Options: code, environment and absl flags, with clear errors."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxstreams import config


@pytest.fixture(autouse=True)
def clean_config():
  config.reset()
  yield
  config.reset()


def test_default_is_one_stream():
  assert config.read("jaxstreams_streams") == 1


def test_update_and_reset():
  config.update("jaxstreams_streams", 4)
  assert config.read("jaxstreams_streams") == 4
  config.reset("jaxstreams_streams")
  assert config.read("jaxstreams_streams") == 1


def test_environment_variable(monkeypatch):
  monkeypatch.setenv("JAXSTREAMS_STREAMS", "3")
  config.reset()
  assert config.read("jaxstreams_streams") == 3
  config.update("jaxstreams_streams", 2)   # code beats the environment
  assert config.read("jaxstreams_streams") == 2


@pytest.mark.parametrize("text, message", [
    ("three", "JAXSTREAMS_STREAMS='three' is not an integer"),
    ("0", "must be an integer >= 1, got 0"),
])
def test_bad_environment_values(monkeypatch, text, message):
  monkeypatch.setenv("JAXSTREAMS_STREAMS", text)
  config.reset()
  with pytest.raises(ValueError, match=message):
    config.read("jaxstreams_streams")


def test_unknown_option_suggests_the_right_name():
  with pytest.raises(ValueError, match="Did you mean 'jaxstreams_streams'"):
    config.update("jaxstreams_stream", 2)
  with pytest.raises(ValueError, match="unknown jaxstreams option"):
    config.read("streams")


@pytest.mark.parametrize("value, error", [
    ("4", TypeError), (2.5, TypeError), (True, TypeError), (0, ValueError)])
def test_bad_values_in_code(value, error):
  with pytest.raises(error, match="jaxstreams_streams"):
    config.update("jaxstreams_streams", value)
  assert config.read("jaxstreams_streams") == 1   # nothing half-set


def test_a_function_made_after_an_option_changed_is_made_under_it():
  """Programs and plans of one Python function are shared by its
  jaxstreams.jit functions, but not across a change of an option read while
  planning or lowering: a function made after the change lowers under it."""
  import jaxstreams
  from jaxstreams import _compat
  from programs import four_branches, four_branches_args
  args = four_branches_args(8, 16)

  def pinned_calls():
    f = jaxstreams.jit(four_branches, streams=4, gpu_lowering="streams")
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text().count(
        'jaxstreams_order = "1"')

  before = pinned_calls()
  # Before jaxlib 0.12 the calls are pinned in order (lower/order.py);
  # from 0.12 XLA schedules stream calls itself and nothing is pinned.
  assert (before > 0) == (not _compat.XLA_SCHEDULES_STREAM_CALLS)
  config.update("jaxstreams_sequence_points", False)
  assert pinned_calls() == 0
  config.reset("jaxstreams_sequence_points")
  assert pinned_calls() == before


def test_a_function_reading_the_option_follows_every_change():
  """streams=None: calls go straight to the function for the count in
  force, and every update() or reset() is seen by the next call."""
  import jax.numpy as jnp
  import jaxstreams

  @jaxstreams.jit
  def f(x):
    with jaxstreams.stream(2):
      return x + 1

  x = jnp.ones(2)
  for streams in (1, 3, 3, 1):
    if streams == 1:
      config.reset("jaxstreams_streams")
    else:
      config.update("jaxstreams_streams", streams)
    for _ in range(2):      # the first call settles, the second goes straight
      if streams == 1:
        with pytest.raises(jaxstreams.StreamIdError, match="2"):
          f(x)
      else:
        assert f(x).tolist() == [2.0, 2.0]
    assert f.func._streams == streams   # where calls go now


def _run(code, *argv, env=None):
  full_env = {k: v for k, v in os.environ.items()
              if not k.startswith("JAXSTREAMS_")}
  full_env.update(env or {})
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv],
                        capture_output=True, text=True, env=full_env,
                        timeout=120)


ABSL_PROGRAM = """
    import jaxstreams, jax.numpy as jnp
    from absl import app

    @jaxstreams.jit
    def f(x):
      with jaxstreams.stream(3):
        return x + 1

    def main(argv):
      print("streams", jaxstreams.config.read("jaxstreams_streams"))
      print("plan", f.plan(jnp.ones(2)).streams)

    app.run(main)
"""


def test_absl_flag_sets_the_option():
  result = _run(ABSL_PROGRAM, "--jaxstreams_streams=4")
  assert result.returncode == 0, result.stderr
  assert "streams 4" in result.stdout and "plan 4" in result.stdout


def test_a_function_called_before_absl_parses_sees_the_flag_after():
  result = _run("""
      import jaxstreams, jax.numpy as jnp
      from absl import app

      @jaxstreams.jit
      def f(x):
        with jaxstreams.stream(3):
          return x + 1

      try:
        f(jnp.ones(2))        # one stream until the flags are parsed
      except jaxstreams.StreamIdError:
        print("before: one stream")

      def main(argv):
        print("after", f(jnp.ones(2)).tolist())

      app.run(main)
  """, "--jaxstreams_streams=4")
  assert result.returncode == 0, result.stderr
  assert result.stdout.split("\n")[:2] == ["before: one stream",
                                           "after [2.0, 2.0]"]


def test_absl_flag_beats_the_environment():
  result = _run(ABSL_PROGRAM, "--jaxstreams_streams=5",
                env={"JAXSTREAMS_STREAMS": "2"})
  assert result.returncode == 0, result.stderr
  assert "streams 5" in result.stdout


def test_program_without_absl_never_sees_an_absl_error():
  result = _run("""
      import sys
      import jaxstreams, jax.numpy as jnp
      print(jaxstreams.config.read("jaxstreams_streams"))
      print(jaxstreams.jit(lambda x: x * 2)(jnp.ones(2)).tolist())
  """, "--not-an-absl-flag", env={"JAXSTREAMS_STREAMS": "2"})
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == ["2", "[2.0,", "2.0]"]
  assert "absl" not in result.stderr.lower()


def test_options_table_lists_every_option():
  for name, option in config.options().items():
    assert name.startswith("jaxstreams_") and option.env_var == name.upper()
    assert option.help
