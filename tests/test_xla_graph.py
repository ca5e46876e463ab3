"""xla_graphs reads the CUDA graphs XLA logs while compiling (samples written
here by hand, in the formats of jaxlib 0.10-0.12)."""

import json

import pytest

from jaxstreams.xla.graph import GraphLogError, read_graphs
from jaxstreams.xla.xla_logs import parse_log

_PREFIX = "I1125 12:55:40.031516    3501 "


def _log(mode, commands, nodes, thunks, count=None, named=""):
  """XLA's log of one graph: its mode, one line per command (name and
  resources), the node list (each node's in-edges; a string is a line as
  cut off) and the thunks of the command buffer."""
  lines = [f"{_PREFIX}command_executor.cc:192] CreateCommandOperations with "
           f"synchronization mode: {mode}"]
  for name, resources in commands:
    res = ", ".join(f"token@0x{t}({a})" for t, a in resources)
    lines.append(f"{_PREFIX}command_executor.cc:116] {name} grid: [1, 1, 1] "
                 f"threads: [32, 1, 1]  shared_memory: 0 bytes "
                 f"resources=[{res}]")
  count = len(commands) if count is None else count
  lines.append(f"{_PREFIX}command_executor.cc:275] Execution graph: "
               f"ExecutionGraph: {count} nodes, #source_nodes=1 #sink_nodes=1, "
               f"is_sequential={'true' if mode == 'LHS' else 'false'}")
  for n, ins in enumerate(nodes):
    if isinstance(ins, str):
      lines.append(ins)
      continue
    edges = ", ".join(f"NodeEdge {{kind: execution, id: {i}}}" for i in ins)
    lines.append(f"node {n} (priority=0): in=[{edges}] out=[]")
  lines.append("")
  lines.append(f"{_PREFIX}command_buffer_conversion_pass.cc:531] Creating "
               f"command buffer thunk{named} with the following thunks: "
               f"{', '.join(thunks)}")
  return "\n".join(lines) + "\n"


# Two regions (streams 1 and 2, one kernel each) and a main-stream kernel
# that reads both, all in one command buffer.
SEQUENCE = """\
000: kCommandBuffer [source | sink] 
    001: kAsyncStart   [source        | next=005 (4)] stream=computation_stream[1], async_id=1
        002: kCustomKernel [source | sink] fusion_a grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    003: kAsyncStart   [source        | next=005 (2)] stream=computation_stream[2], async_id=3
        004: kCustomKernel [source | sink] fusion_b grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    005: kCustomKernel [prev=001 (4) | sink] fusion_c grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    006: kAsyncDone    [source | sink] async_id=1
    007: kAsyncDone    [source | sink] async_id=3
"""  # noqa: E501 (quoted as XLA writes it)

METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, name in [(1, "call-start"), (2, "fusion.a"), (3, "call-start.1"),
                    (4, "fusion.b"), (5, "fusion.c")])

_ATTRS = ('frontend_attributes={{_xla_stream_annotation="{s}",'
          'inlineable="false",jaxstreams_region="{r}"}}')
HLO = f"""HloModule jit_f, is_scheduled=true

%region_a (p0: f32[4]) -> f32[4] {{
  %p0 = f32[4]{{0}} parameter(0)
  ROOT %fusion.a = f32[4]{{0}} fusion(%p0), kind=kLoop, calls=%fused_a
}}

%region_b (q0: f32[4]) -> f32[4] {{
  %q0 = f32[4]{{0}} parameter(0)
  ROOT %fusion.b = f32[4]{{0}} fusion(%q0), kind=kLoop, calls=%fused_b
}}

ENTRY %main (x: f32[4]) -> f32[4] {{
  %x = f32[4]{{0}} parameter(0)
  %call-start = ((f32[4]{{0}}), f32[4]{{0}}) call-start(%x), to_apply=%region_a, {_ATTRS.format(s=1, r=0)}
  %call-start.1 = ((f32[4]{{0}}), f32[4]{{0}}) call-start(%x), to_apply=%region_b, {_ATTRS.format(s=2, r=1)}
  %call-done = f32[4]{{0}} call-done(%call-start), {_ATTRS.format(s=1, r=0)}
  %call-done.1 = f32[4]{{0}} call-done(%call-start.1), {_ATTRS.format(s=2, r=1)}
  ROOT %fusion.c = f32[4]{{0}} fusion(%call-done, %call-done.1), kind=kLoop, calls=%fused_c, metadata={{op_name="jit(f)/jaxstreams_region_2/add"}}
}}
"""  # noqa: E501 (quoted as XLA writes it)

# Where each value lives: the two regions' results side by side in one
# temporary allocation, the result in the output allocation.
BUFFERS = """\
BufferAssignment:
allocation 0: size 16, parameter 0, shape |f32[4]| at ShapeIndex {}:
 value: <0 x @0> (size=16,offset=0): f32[4]{0}
allocation 1: size 32, preallocated-temp:
 value: <1 fusion.a @0> (size=16,offset=0): f32[4]{0}
 value: <2 fusion.b @0> (size=16,offset=16): f32[4]{0}
allocation 2: size 16, output shape is |f32[4]|, maybe-live-out:
 value: <3 fusion.c @0> (size=16,offset=0): f32[4]{0}
"""

COMMANDS = [("fusion_a", [("1", "write")]), ("fusion_b", [("2", "write")]),
            ("fusion_c", [("3", "write")])]
THUNKS = ["call-start", "call-start.1", "fusion.c", "call-done", "call-done.1"]


def test_a_chain_as_jaxlib_0_10_and_0_11_draw_it():
  """The LHS builder: each command after the previous one. The regions are
  recognised (their call's jaxstreams_region attribute, and the main-stream
  kernel by its region's name scope) but run one after the other."""
  # LHS: each command also reads the token of the one before it.
  chain = [(name, res + ([(COMMANDS[n - 1][1][0][0], "read")] if n else []))
           for n, (name, res) in enumerate(COMMANDS)]
  log = _log("LHS", chain, [[], [0], [1]], THUNKS)
  graphs = read_graphs(log, SEQUENCE, METADATA, HLO)
  (graph,) = graphs.graphs
  assert [(k.name, k.instruction, k.region, k.stream)
          for k in graph.kernels] == [
      ("fusion_a", "fusion.a", 0, 1), ("fusion_b", "fusion.b", 1, 2),
      ("fusion_c", "fusion.c", 2, 0)]
  assert graph.sequential and graph.mode == "LHS"
  assert (graph.longest_path, graph.parallelism) == (3, 1.0)
  assert graphs.parallel_regions() == ()
  assert not graphs.outside and not graphs.ungraphed
  # Cut short, the chain is rebuilt from the tokens the commands read.
  cut = _log("LHS", chain, [[], [0], "node 2 (priority=0): in=[Node"], THUNKS)
  rebuilt = read_graphs(cut, SEQUENCE, METADATA, HLO, BUFFERS).graphs[0]
  assert rebuilt.edges == graph.edges == ((0, 1), (1, 2))


def test_two_branches_and_their_join():
  log = _log("Concurrent", COMMANDS, [[], [], [0, 1]], THUNKS,
             named=" command_buffer_1")
  graphs = read_graphs(log, SEQUENCE, METADATA, HLO)
  (graph,) = graphs.graphs
  assert graph.name == "command_buffer_1" and not graph.sequential
  assert graph.edges == ((0, 2), (1, 2))
  assert (graph.longest_path, graph.parallelism) == (2, 1.5)
  assert graph.parallel_regions() == ((0, 1),)
  text = str(graphs)
  assert "parallelism 1.50" in text and "R0|R1" in text
  dot = graphs.to_dot()
  assert dot.startswith("digraph") and "g0n0 -> g0n2" in dot
  trace = graphs.to_perfetto()
  spans = {e["name"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"}
  assert spans == {"fusion_a": 0, "fusion_b": 0, "fusion_c": 1}
  json.dumps(trace)


def test_a_node_list_cut_short_is_rebuilt_from_buffers_and_checked():
  """XLA logs a graph as one message, and its logger keeps 15,000 bytes:
  the rest is rebuilt from the buffer assignment, and must agree with
  every node the log kept."""
  cut = "node 2 (priority=0): in=[NodeEdge {kind: execution, id: 0}"
  log = _log("Concurrent", COMMANDS, [[], [], cut], THUNKS)
  assert parse_log(log)[0].truncated
  (graph,) = read_graphs(log, SEQUENCE, METADATA, HLO, BUFFERS).graphs
  assert graph.edges == ((0, 2), (1, 2))
  # The log said node 1 waits for node 0; the buffers say it does not.
  wrong = _log("Concurrent", COMMANDS, [[], [0], cut], THUNKS)
  with pytest.raises(GraphLogError, match="disagrees with XLA's log at node 1"):
    read_graphs(wrong, SEQUENCE, METADATA, HLO, BUFFERS)
  with pytest.raises(GraphLogError, match="buffer-assignment dump needed"):
    read_graphs(log, SEQUENCE, METADATA, HLO)


def test_buffer_reuse_is_an_edge():
  """Two kernels writing the same bytes may not run together, data or not:
  XLA's CONCURRENT graphs keep such false edges, and so does the rebuild."""
  reused = BUFFERS.replace("<2 fusion.b @0> (size=16,offset=16)",
                           "<2 fusion.b @0> (size=16,offset=8)")
  cut = "node 2 (priority=0): in=[NodeEdge"
  log = _log("Concurrent", COMMANDS, [[], [0], cut], THUNKS)
  (graph,) = read_graphs(log, SEQUENCE, METADATA, HLO, reused).graphs
  assert graph.edges == ((0, 1), (1, 2))
  assert graph.parallelism == 1.0


def test_a_region_xla_left_out_of_every_graph():
  """A region holding a custom call XLA cannot capture runs outside the
  graphs, on its stream; the main-stream kernels still form a graph."""
  sequence = """\
001: kAsyncStart    [source | next=005 (4)] stream=computation_stream[1], async_id=1
    002: kCustomCall   [source | next=003 (1)] kCustomCall
    003: kCustomKernel [prev=002 (1) | sink] fusion_a grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
000: kCommandBuffer [source | sink] 
    003: kAsyncStart   [source | next=005 (2)] stream=computation_stream[2], async_id=3
        004: kCustomKernel [source | sink] fusion_b grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
        No thunks.
    005: kCustomKernel [prev=001 (4) | sink] fusion_c grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
006: kAsyncDone     [source | sink] async_id=1
"""  # noqa: E501 (quoted as XLA writes it)
  log = _log("LHS", COMMANDS[1:], [[], [0]], ["call-start.1", "fusion.c"])
  graphs = read_graphs(log, sequence, METADATA, HLO)
  (outside,) = graphs.outside
  assert (outside.instruction, outside.region, outside.stream) == (
      "call-start", 0, 1)
  assert outside.kernels == ("kCustomCall", "fusion_a")
  assert "kCustomCall" in outside.reason
  assert graphs.graphs[0].regions == (1, 2)
  assert ((0, 1) in graphs.parallel_regions()
          and (0, 2) in graphs.parallel_regions())
  assert "outside any graph: R0 on stream 1" in graphs.summary()


def test_compare_checks_the_plans_pairs():
  import jax.numpy as jnp
  import jaxstreams

  def two(x):
    with jaxstreams.stream(1):
      a = jnp.sin(x)
    with jaxstreams.stream(2):
      b = jnp.cos(x)
    return a + b
  plan = jaxstreams.plan(two, streams=3)(jnp.ones(4))
  calls = [r.index for r in plan.regions if r.is_call]
  assert len(calls) == 2
  log = _log("Concurrent", COMMANDS, [[], [], [0, 1]], THUNKS)
  hlo = HLO.replace('jaxstreams_region="0"',
                    f'jaxstreams_region="{calls[0]}"') \
           .replace('jaxstreams_region="1"', f'jaxstreams_region="{calls[1]}"')
  graphs = read_graphs(log, SEQUENCE, METADATA, hlo, plan=plan)
  assert graphs.compare() == ((calls[0], calls[1], True),)
  chain = read_graphs(_log("LHS", COMMANDS, [[], [0], [1]], THUNKS),
                      SEQUENCE, METADATA, hlo, plan=plan)
  assert chain.compare() == ((calls[0], calls[1], False),)


@pytest.mark.parametrize("log, message", [
    (f"{_PREFIX}command_executor.cc:275] Execution graph: ExecutionGraph: 1 "
     "nodes, #source_nodes=1 #sink_nodes=1, is_sequential=true\n",
     "before the graph's 'CreateCommandOperations' line"),
    (f"{_PREFIX}command_executor.cc:192] CreateCommandOperations with "
     f"synchronization mode: LHS\n{_PREFIX}command_executor.cc:116] k grid: "
     "[1, 1, 1] resources=[token@0x1(write)]\n",
     "no 'Execution graph'"),
    (_log("LHS", COMMANDS, [[], [0], [1]], THUNKS, count=4),
     "a graph of 4 nodes logged 3 commands"),
])
def test_a_log_not_understood_is_a_clear_error(log, message):
  with pytest.raises(GraphLogError, match=message):
    read_graphs(log, SEQUENCE, METADATA, HLO)


def test_a_thunk_dump_not_understood_is_a_clear_error():
  log = _log("LHS", COMMANDS, [[], [0], [1]], THUNKS)
  with pytest.raises(GraphLogError, match="thunk dump line not understood"):
    read_graphs(log, "this is not a thunk sequence\n", METADATA, HLO)


def test_a_graph_the_dump_does_not_hold_is_a_clear_error():
  other = [("fusion_x", [("1", "write")])] + COMMANDS[1:]
  log = _log("LHS", other, [[], [0], [1]], THUNKS)
  with pytest.raises(GraphLogError, match="no command buffer in XLA's thunk "
                     "dump holds the 3 commands of graph 0"):
    read_graphs(log, SEQUENCE, METADATA, HLO)


# A loop (XLA's format: the condition and body as sections of the kWhile
# thunk) whose step runs two stream calls, both started before either is
# waited for; then a main-stream kernel outside any graph.
LOOP_SEQUENCE = """\
001: kCopy         [source       | next=002 (1)] kCopy
002: kWhile        [prev=001 (1) | next=009 (1)]   
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kAsyncStart   [source       | next=008 (3)] stream=computation_stream[1], async_id=4
        005: kCustomKernel [source | sink] fusion_a grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    006: kAsyncStart   [source       | next=008 (2)] stream=computation_stream[2], async_id=6
        007: kCustomKernel [source | sink] fusion_b grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    010: kAsyncDone    [source       | sink        ] async_id=4
    011: kAsyncDone    [source       | sink        ] async_id=6
    008: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
009: kCustomKernel [prev=002 (1) | sink] fusion_c grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
"""  # noqa: E501 (quoted as XLA writes it)

LOOP_METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n'
    f'    thunk_id: {i}\n  }}\n  thunk_kind: "k"\n}}\n'
    for i, name in [(2, "while.5"), (4, "call-start"), (5, "fusion.a"),
                    (6, "call-start.1"), (7, "fusion.b"), (9, "fusion.c")])


def _loop_hlo(trip_config: str) -> str:
  body = HLO.replace("ENTRY %main (x: f32[4]) -> f32[4] {",
                     "%body (x: f32[4]) -> f32[4] {")
  return body + f"""
ENTRY %main.2 (y: f32[4]) -> f32[4] {{
  %y = f32[4]{{0}} parameter(0)
  %while.5 = f32[4]{{0}} while(%y), condition=%cond, body=%body, backend_config={trip_config}
  ROOT %fusion.c = f32[4]{{0}} fusion(%while.5), kind=kLoop, calls=%fused_c, metadata={{op_name="jit(f)/jaxstreams_region_2/add"}}
}}
"""  # noqa: E501 (quoted as XLA writes it)


def test_a_loop_of_known_trip_count_runs_its_stream_calls_side_by_side():
  """No graph here: the view says so, lists the loop with its trip count,
  and finds the two regions in flight together inside every step."""
  hlo = _loop_hlo('{"known_trip_count":{"n":"6"},"known_init_step":{}}')
  graphs = read_graphs("", LOOP_SEQUENCE, LOOP_METADATA, hlo)
  assert graphs.graphs == ()
  (loop,) = graphs.loops
  assert (loop.instruction, loop.trip_count, loop.host_waits) == (
      "while.5", 6, False)
  starts = [l for l in loop.body if type(l).__name__ == "StreamCall"]
  assert ([(s.region, s.stream, s.window) for s in starts]
          == [(0, 1, 1), (1, 2, 0)])
  assert graphs.parallel_regions() == ((0, 1),)
  summary = graphs.summary()
  assert summary.startswith("no CUDA graph: every launch is made one by one")
  assert "loop while.5: 6 steps, a known count" in summary
  order = graphs.launch_order()
  assert "[0] loop while.5: 6 steps" in order
  assert "[1] stream call R0" in order and "[2] stream call R1" in order
  assert "fusion_c (R2)" in order


def test_a_loop_of_unknown_trip_count_makes_the_host_wait():
  hlo = _loop_hlo("{}")
  (loop,) = read_graphs("", LOOP_SEQUENCE, LOOP_METADATA, hlo).loops
  assert loop.trip_count is None and loop.host_waits


def test_calls_one_after_the_other_are_not_side_by_side():
  sequence = LOOP_SEQUENCE.replace(
      "    010: kAsyncDone    [source       | sink        ] async_id=4\n", "")
  sequence = sequence.replace(
      "    006: kAsyncStart",
      "    010: kAsyncDone    [source       | sink        ] async_id=4\n"
      "    006: kAsyncStart")
  hlo = _loop_hlo('{"known_trip_count":{"n":"6"}}')
  graphs = read_graphs("", sequence, LOOP_METADATA, hlo)
  assert graphs.parallel_regions() == ()


# A conditional inside a command buffer: XLA logs each branch as a graph
# of its own (before the graph that holds the conditional, whose command it
# logs without a name).
COND_SEQUENCE = """\
000: kCommandBuffer [source | sink] 
    001: kCustomKernel [source       | next=004 (1)] fusion_a grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    004: kConditional  [prev=001 (1) | next=005 (1)]       
      false_branch:
        002: kCustomKernel [source | sink] fusion_b grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
      true_branch:
        003: kCustomKernel [source | sink] fusion_c grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    005: kCustomKernel [prev=004 (1) | sink] fusion_c grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
"""  # noqa: E501 (quoted as XLA writes it)


def test_a_conditional_in_a_graph_and_its_branch_graphs():
  log = (_log("LHS", [("fusion_b", [("2", "write")])], [[]], ["fusion.b"])
         + _log("LHS", [("fusion_c", [("3", "write")])], [[]], ["fusion.c"])
         + _log("LHS", [("fusion_a", [("1", "write")]), ("", [("4", "write")]),
                        ("fusion_c", [("3", "write")])], [[], [0], [1]],
                ["fusion.a", "cond", "fusion.c"]).replace(
                    "] \x20grid: [1, 1, 1] threads: [32, 1, 1]  "
                    "shared_memory: 0 "
                    "bytes resources=[token@0x4(write)]", "] "))
  metadata = METADATA + ('thunk_metadata {\n  thunk_info {\n'
                         '    profile_annotation: "cond"\n    thunk_id: 4\n'
                         '  }\n  thunk_kind: "k"\n}\n')
  graphs = read_graphs(log, COND_SEQUENCE, metadata, HLO)
  assert [len(g.kernels) for g in graphs.graphs] == [1, 1, 3]
  (cond,) = graphs.conditionals
  assert not cond.host_waits   # a graph's conditional node: no host wait
  assert [b[0].graph.index for b in cond.branches] == [0, 1]
  assert "conditional cond (the branch chosen on the GPU), 2 branches" in \
      graphs.launch_order()
