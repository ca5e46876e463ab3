"""Where a test run's time went, from pytest's JUnit XML (``--junitxml``).

Prints the run's wall time as pytest reported it, the sum of every test's
time (setup, call and teardown: over the wall time where workers ran side
by side), each file's share, and every test slower than ``--over`` seconds.
``.ci/run`` prints it for each jax; a full run's listing is committed as
``benchmarks/results/cpu/jax<version>/test_durations_cpu_jax<version>.txt``
so that the next change starts from where the time goes.

  python scripts/test_durations.py RUN.xml [--over SECONDS] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ElementTree


def report(path: str, over: float, top: int) -> str:
  root = ElementTree.parse(path).getroot()
  suite = root if root.tag == "testsuite" else root.find("testsuite")
  tests = []
  for case in suite.iter("testcase"):
    name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    state = ("skipped" if case.find("skipped") is not None
             else "failed" if case.find("failure") is not None
             or case.find("error") is not None else "passed")
    tests.append((float(case.get("time", 0.0)), name, state))
  per_file = collections.Counter()
  for seconds, name, _ in tests:
    per_file[name.split("::")[0]] += seconds
  total = sum(seconds for seconds, _, _ in tests)
  lines = [f"{len(tests)} tests in {float(suite.get('time', 0.0)):.0f} s of "
           f"wall time; {total:.0f} s of test time (setup, call and teardown "
           "summed over the workers)", "", "per file (s):"]
  lines += [f"  {seconds:8.1f}  {name}" for name, seconds in
            per_file.most_common()]
  slow = sorted(tests, reverse=True)
  shown = [t for t in slow if t[0] > over] if over else slow[:top]
  lines += ["", (f"tests over {over:g} s:" if over else f"the {top} slowest:")]
  lines += [f"  {seconds:8.1f}  {name}" + ("" if state == "passed"
                                           else f"  ({state})")
            for seconds, name, state in shown]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("xml")
  parser.add_argument("--over", type=float, default=0.0,
                      help="list every test slower than this (seconds)")
  parser.add_argument("--top", type=int, default=25,
                      help="without --over: list this many of the slowest")
  args = parser.parse_args(argv)
  sys.stdout.write(report(args.xml, args.over, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
