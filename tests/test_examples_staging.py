"""The staging examples run, and print what they claim.

`examples/smart_stage.py` and `examples/dlrm_staged.py` run as their own
processes (``sys.executable``, from the repository root, this process's
environment) with small sizes. Their output is checked for what was staged
and for results equal to the unstaged loop (bitwise on CPU). Throughputs are
printed by the examples and only checked to be there, never compared.
"""

import re

import pytest

from programs import run_example

# Each example is a process of its own that imports jax (see conftest.py).
pytestmark = pytest.mark.once


def line(pattern, out):
  match = re.search(pattern, out, re.M)
  assert match, f"no line matching {pattern!r} in:\n{out}"
  return match


def expected_agreement(out):
  """Bitwise on CPU (the split runs the step's own equations); a GPU may
  fuse the split programs differently."""
  backend = line(r"^backend: (\w+)", out).group(1)
  return ("bitwise",) if backend == "cpu" else ("bitwise", "to rounding")


def test_smart_stage_stages_parsing_not_the_lookup():
  out = run_example("smart_stage.py", "--rows=2048", "--batch=256",
                    "--repeats=1", "--read_ms=0", "--buckets=64")
  # What SmartStage chose, with no stage() call in the step.
  line(r"^StagedPlan \S+: 1 producer stage\(s\) \+ consumer, data argument 1, "
       r"split by smart", out)
  producer = line(r"^producer primitives: (.*)$", out).group(1)
  assert "'scan'" in producer and "'log1p'" in producer, out
  line(r"^decode_csv \(parse and hash, a scan\) staged: True; "
       r"embedding_lookup staged: False$", out)
  staged_fns = line(r"^staged equations per function: (.*)$", out).group(1)
  assert "decode_csv" in staged_fns and "features" in staged_fns, out
  consumer_fns = line(r"^consumer equations per function: (.*)$", out).group(1)
  assert "embedding_lookup" in consumer_fns, out
  # Same steps, same losses and parameters as the unstaged loop.
  line(r"^steps: staged 8, unstaged 8$", out)
  final = line(r"^final loss: staged (\S+), unstaged (\S+)$", out)
  assert final.group(1) == final.group(2), out
  verdict = line(r"^losses and parameters identical to the unstaged loop: "
                 r"(.*)$", out).group(1)
  assert verdict in expected_agreement(out), out
  line(r"^throughput \(steps/s.*\): staged [\d.]+, unstaged [\d.]+, "
       r"ratio [\d.]+x$", out)


def test_dlrm_staged_matches_unstaged():
  out = run_example("dlrm_staged.py", "--steps=6", "--batch=64", "--pool=256",
                    "--buckets=256", "--towers=3", "--streams=3",
                    "--repeats=1", "--read_ms=0", "--fetch_every=2")
  line(r"^streams: 3; towers placed on streams \[1, 2, 1\]; regions per "
       r"stream: stream 0: \d+, stream 1: \d+, stream 2: \d+$", out)
  staged = line(r"^staged \(smart=True\): 1 producer stage\(s\), (\d+) "
                r"equation\(s\) run ahead (\[.*\]); consumer (\d+)", out)
  assert int(staged.group(1)) > 0 and "'log1p'" in staged.group(2), out
  for loop in ("staged", "prefetch"):
    verdict = line(rf"^{loop} results identical to unstaged: (.*)$",
                   out).group(1)
    assert verdict in expected_agreement(out), out
  line(r"^loss: first [\d.]+, last [\d.]+ after 6 steps$", out)
  line(r"^throughput \(steps/s.*loss fetched every 2 step\(s\)\): unstaged "
       r"[\d.]+, staged [\d.]+, prefetch [\d.]+$", out)
  line(r"^speedup over unstaged: staged [\d.]+x, prefetch [\d.]+x$", out)
