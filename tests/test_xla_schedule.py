"""xla_schedule reads the async regions of scheduled HLO text (handwritten
here)."""

import json

import jax.numpy as jnp
import pytest

import jaxstreams
from jaxstreams.xla.schedule import HloParseError, xla_schedule
from programs import random_inputs, two_towers

# These read the GPU program's stream calls (or compare programs that have
# them): jaxstreams.jit functions are made with the 'streams' lowering.
pytestmark = pytest.mark.usefixtures("stream_calls")

# A region call as XLA prints it: its stream, and the plan region it is.
_ATTRS = ('frontend_attributes={{_xla_stream_annotation="{s}",'
          'inlineable="false",jaxstreams_region="{r}"}}')

# Two regions on streams 1 and 2; region 2 starts inside region 1's window,
# and a main-stream fusion runs inside both.
TWO_REGIONS = f"""HloModule jit_f, is_scheduled=true

FileNames
1 "f.py"

%region_a (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %t = f32[8]{{0}} fusion(%p0), kind=kLoop, calls=%fused_tanh
}}

%region_b (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %s = f32[8]{{0}} fusion(%p0), kind=kLoop, calls=%fused_sin
}}

%split (p0: (f32[8], f32[8])) -> f32[8] {{
  %p0 = (f32[8]{{0}}, f32[8]{{0}}) parameter(0)
  ROOT %g = f32[8]{{0}} get-tuple-element(%p0), index=0
}}

ENTRY %main.1 (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %call-start = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=0)}
  %call-start.1 = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_b, {_ATTRS.format(s=2, r=1)}
  %cos = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused_cos
  %call-done.1 = f32[8]{{0}} call-done(%call-start.1), {_ATTRS.format(s=2, r=1)}
  %call-done = f32[8]{{0}} call-done(%call-start), {_ATTRS.format(s=1, r=0)}
  %call-start.2 = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%call-done), to_apply=%split, {_ATTRS.format(s=1, r=0)}
  %call-done.2 = f32[8]{{0}} call-done(%call-start.2), {_ATTRS.format(s=1, r=0)}
  %sync = f32[8]{{0}} call(%cos), to_apply=%region_b, {_ATTRS.format(s=3, r=2)}
  ROOT %add = f32[8]{{0}} fusion(%call-done.2, %call-done.1, %sync), kind=kLoop, calls=%fused_add
}}
"""  # noqa: E501 (quoted as XLA writes it)

# One chain: the region's result feeds the main stream, nothing in between.
ONE_CHAIN = f"""HloModule jit_g, is_scheduled=true

%region_a (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %t = f32[8]{{0}} fusion(%p0), kind=kLoop, calls=%fused_tanh
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %call-start = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=0)}
  %call-done = f32[8]{{0}} call-done(%call-start), {_ATTRS.format(s=1, r=0)}
  ROOT %y = f32[8]{{0}} fusion(%call-done), kind=kLoop, calls=%fused_cos
}}
"""  # noqa: E501 (quoted as XLA writes it)


def test_regions_windows_and_overlap():
  schedule = xla_schedule(TWO_REGIONS)
  a, b, split = schedule.regions
  assert (a.stream, a.start, a.done) == (1, 1, 5)
  assert (b.stream, b.start, b.done) == (2, 2, 4)
  assert a.main_work == ("cos",) and b.main_work == ("cos",)
  assert a.overlapping == (1,) and b.overlapping == (0,)
  assert split.fragment and not split.overlaps
  assert schedule.main_regions == (a, b)
  assert schedule.peak_in_flight == 2
  assert [i.name for i in schedule.synchronous] == ["sync"]


def test_negative_control_has_nothing_in_its_window():
  (region,) = xla_schedule(ONE_CHAIN).regions
  assert region.main_work == () and region.overlapping == ()
  assert xla_schedule(ONE_CHAIN).overlapped == ()


def test_lane_view_and_perfetto(tmp_path):
  schedule = xla_schedule(TWO_REGIONS)
  text = str(schedule)
  assert text.splitlines()[0] == schedule.summary()
  assert "2 async region(s) on stream(s) [1, 2], 2 with work" in text
  header = text.splitlines()[1].split()
  assert header == ["pos", "main", "stream", "1", "stream", "2"]
  cos_row = next(line for line in text.splitlines() if " cos" in line)
  assert cos_row.split() == ["3", "cos", "|", "|"]
  path = tmp_path / "schedule.json"
  schedule.to_perfetto(path)
  events = json.loads(path.read_text())["traceEvents"]
  spans = {(e["tid"], e["ts"], e.get("dur")) for e in events if e["ph"] == "X"}
  assert {(1, 1, 4), (2, 2, 2), (0, 3, 1)} <= spans


def test_comparison_with_the_plan():
  xs = random_inputs((8, 8), (8, 8), (8, 8))
  plan = jaxstreams.plan(two_towers, streams=3)(*xs)
  schedule = xla_schedule(TWO_REGIONS, plan=plan)
  assert [r.plan_region for r in schedule.main_regions] == [0, 1]
  (pair,) = schedule.compare(plan)
  assert (pair.first, pair.second, pair.scheduled_together) == (0, 1, True)
  # Region b moved after region a's done: the two no longer overlap.
  lines = TWO_REGIONS.splitlines(keepends=True)
  b_lines = [line for line in lines
             if "%call-start.1 =" in line or "%call-done.1 =" in line]
  rest = [line for line in lines if line not in b_lines]
  after_a = next(i for i, line in enumerate(rest)
                 if "%call-done = " in line) + 1
  serial = "".join(rest[:after_a] + b_lines + rest[after_a:])
  serial_schedule = xla_schedule(serial, plan=plan)
  (pair,) = serial_schedule.compare(plan)
  assert pair.scheduled_together is False


def _two_calls_on_one_stream(first, second):
  """Two region calls on stream 1, started in this order, tagged with the
  plan regions ``first`` and ``second``."""
  return f"""HloModule jit_h, is_scheduled=true

%region_a (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %t = f32[8]{{0}} fusion(%p0), kind=kLoop, calls=%fused_tanh
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %call-start = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=first)}
  %call-done = f32[8]{{0}} call-done(%call-start), {_ATTRS.format(s=1, r=first)}
  %call-start.1 = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=second)}
  %call-done.1 = f32[8]{{0}} call-done(%call-start.1), {_ATTRS.format(s=1, r=second)}
  ROOT %y = f32[8]{{0}} fusion(%call-done, %call-done.1), kind=kLoop, calls=%fused_add
}}
"""  # noqa: E501 (quoted as XLA writes it)


def _two_regions_on_stream_1(x, w):
  with jaxstreams.stream(1):
    x = jnp.tanh(x @ w)
  x = jnp.sin(x @ w)     # main-stream work between: two regions on stream 1
  with jaxstreams.stream(1):
    x = jnp.cos(x @ w)
  return x


def test_regions_are_matched_to_the_plan_by_the_region_they_name():
  x = jnp.ones((8, 8))
  plan = jaxstreams.plan(_two_regions_on_stream_1, streams=2)(x, x)
  on_one = [r.index for r in plan.regions if r.stream == 1]
  assert len(on_one) == 2
  # Whatever order the schedule has them in (XLA may start independent
  # regions of one stream in either order), the attribute says which is which.
  for order in (on_one, on_one[::-1]):
    schedule = xla_schedule(_two_calls_on_one_stream(*order), plan=plan)
    assert [r.plan_region for r in schedule.main_regions] == order


def test_notes_say_what_xla_serialized():
  xs = random_inputs((8, 8), (8, 8), (8, 8))
  plan = jaxstreams.plan(two_towers, streams=3)(*xs)
  assert xla_schedule(TWO_REGIONS, plan=plan).notes == ()
  assert xla_schedule(TWO_REGIONS).notes == ()   # no plan, nothing to compare
  lines = TWO_REGIONS.splitlines(keepends=True)
  b_lines = [line for line in lines
             if "%call-start.1 =" in line or "%call-done.1 =" in line]
  rest = [line for line in lines if line not in b_lines]
  after_a = next(i for i, line in enumerate(rest)
                 if "%call-done = " in line) + 1
  serial = xla_schedule("".join(rest[:after_a] + b_lines + rest[after_a:]),
                        plan=plan)
  assert serial.notes[0] == ("R0 and R1 may run together; XLA scheduled them "
                             "one after the other")
  assert f"note: {serial.notes[0]}" in str(serial)


@pytest.mark.parametrize("text, message", [
    ("", "expected HLO text"),
    ("HloModule m\n%f (x: f32[]) -> f32[] {\n"
     "  ROOT %x = f32[] parameter(0)\n}\n", "no ENTRY"),
    ("HloModule m\nENTRY %main () -> f32[] {\n  this is not hlo\n}\n",
     "line 3: not an HLO instruction"),
    ("HloModule m\nENTRY %main () -> f32[] {\n"
     "  ROOT %x = f32[] parameter(0)\n", "not closed"),
    ("HloModule m\nENTRY %main () -> f32[] {\n"
     "  %s = (f32[]) call-start(%x), to_apply=%f, "
     'frontend_attributes={_xla_stream_annotation="1"}\n}\n',
     "no matching done"),
])
def test_malformed_text_is_a_clear_error(text, message):
  with pytest.raises(HloParseError, match=message):
    xla_schedule(text)


def test_unknown_target_names_the_choices():
  with pytest.raises(ValueError,
                     match=r"unknown GPU target 'a100'.*\['h100', 'h200'\]"):
    jaxstreams.gpu_target("a100")


# A collective in flight while a region runs, and one after it.
WITH_COLLECTIVES = f"""HloModule jit_h, is_scheduled=true

%region_a (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %t = f32[8]{{0}} fusion(%p0), kind=kLoop, calls=%fused_tanh
}}

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}}

ENTRY %main.2 (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %call-start = ((f32[8]{{0}}), f32[8]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=0)}
  %all-reduce-start = f32[8]{{0}} all-reduce-start(%x), replica_groups={{}}, to_apply=%sum
  %all-reduce-done = f32[8]{{0}} all-reduce-done(%all-reduce-start)
  %call-done = f32[8]{{0}} call-done(%call-start), {_ATTRS.format(s=1, r=0)}
  ROOT %all-reduce = f32[8]{{0}} all-reduce(%call-done), replica_groups={{}}, to_apply=%sum
}}
"""  # noqa: E501 (quoted as XLA writes it)


def test_each_collective_names_the_regions_in_flight_beside_it():
  schedule = xla_schedule(WITH_COLLECTIVES)
  assert [(c.name, c.opcode, c.regions_in_flight)
          for c in schedule.collectives] == [
              ("all-reduce-start", "all-reduce-start", (0,)),
              ("all-reduce", "all-reduce", ())]
  # The second reduces the region's result: it waits for the region.
  assert [c.waits_for for c in schedule.collectives] == [(), (0,)]
  assert schedule.summary().endswith(
      "2 collective(s), 1 with a region in flight")
