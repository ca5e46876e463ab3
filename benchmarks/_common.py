"""What the benchmark scripts share: their common options, a description of
the machine and of its load, interleaved rounds with paired ratios, and
saving results.

Why interleaved and paired: on a shared machine the load drifts during a
run. Each round runs every candidate once, in alternating order (forward,
then backward), so drift hits all of them alike; the ratio of two samples
taken next to each other in one round is disturbed less than a ratio of
medians taken minutes apart, and the median over rounds drops the rounds a
burst of load spoiled. The load average is recorded with every result, so
a reader can tell a quiet run from a noisy one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
from typing import Callable

import jax

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OUT_HELP = ("directory for the results (default benchmarks/results/<device>/"
            "jax<version>, beside the current result of each benchmark)")


def device_name() -> str:
  """This machine's device as a folder of ``results``: ``cpu``, or the GPU's
  model (``h100`` for an "NVIDIA H100 80GB HBM3"); else the platform."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return "cpu"
  for word in dev.device_kind.lower().replace("-", " ").split():
    if re.fullmatch(r"[a-z]+\d+[a-z\d]*", word):
      return word
  return dev.platform


def results_folder(device: str | None = None) -> str:
  """Where a run's results go by default: ``results/<device>/jax<version>``
  (``device``: ``device_name()``'s unless given), the one place of the
  current result of each benchmark on that device and jax."""
  return os.path.join(RESULTS, device or device_name(), f"jax{jax.__version__}")


def parser(description: str, quick: str) -> argparse.ArgumentParser:
  """An argument parser with the options every script takes: ``--quick``
  (described by ``quick``), ``--quiet`` and ``--out`` (None: ``save`` and
  ``out_folder`` take ``results_folder()``)."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--quick", action="store_true", help=quick)
  p.add_argument("--quiet", action="store_true",
                 help="record that the machine was otherwise idle")
  p.add_argument("--out", default=None, help=OUT_HELP)
  return p


def out_folder(out: str | None, device: str | None = None) -> str:
  """``out`` (a script's ``--out``), else ``results_folder(device)``;
  made if missing."""
  folder = out or results_folder(device)
  os.makedirs(folder, exist_ok=True)
  return folder


def _cpu_model() -> str | None:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def machine() -> dict:
  """The device, host, software versions and the load at the start."""
  dev = jax.devices()[0]
  try:
    import jaxlib
    jaxlib_version = jaxlib.__version__
  except (ImportError, AttributeError):
    jaxlib_version = None
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count()
  return {
      "platform": dev.platform, "device_kind": dev.device_kind,
      "device_count": jax.device_count(), "backend": jax.default_backend(),
      "cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(),
      "cpu_cores_usable": usable, "os": platform.platform(),
      "python": platform.python_version(), "jax": jax.__version__,
      "jaxlib": jaxlib_version, "xla_flags": os.environ.get("XLA_FLAGS"),
      "load_average_at_start": load(),
  }


def load() -> list[float] | None:
  """The 1, 5 and 15 minute load averages (None where the OS has none)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except (AttributeError, OSError):
    return None


def rounds(candidates: dict[str, Callable[[], float]],
           count: int) -> dict[str, list[float]]:
  """Runs each candidate once per round, ``count`` rounds, in alternating
  order; each call returns its sample (a time or a rate). Returns the
  samples per candidate, round by round."""
  names = list(candidates)
  samples: dict[str, list[float]] = {name: [] for name in names}
  for r in range(count):
    for name in (names if r % 2 == 0 else names[::-1]):
      samples[name].append(candidates[name]())
  return samples


def paired(numerators: list[float], denominators: list[float]) -> float:
  """The median over rounds of numerator / denominator, each pair taken in
  the same round."""
  return statistics.median(n / d for n, d in zip(numerators, denominators))


def save(out_dir: str | None, name: str, result: dict,
         text: str | None = None) -> str:
  """Writes ``<name>.json`` (and ``<name>.txt`` with ``text``) under
  ``out_dir`` (None: ``results_folder()``); returns the JSON's path."""
  out_dir = out_folder(out_dir)
  path = os.path.join(out_dir, name + ".json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  if text is not None:
    with open(os.path.join(out_dir, name + ".txt"), "w") as f:
      f.write(text)
  return path
