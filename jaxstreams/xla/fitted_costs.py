"""The step-time estimate's constants (``step_time.LaunchCosts``), fitted
to H100 runs by ``benchmarks/fit_step_time.py`` from programs compiled on
jax 0.11.2. Do not edit by hand: refit (see that script). Runs:

* ``benchmarks/results/h100/jax0.11.2/gpu_levers_earlier_run_gpu_jax0.11.2.json``
* ``benchmarks/results/h100/jax0.11.2/gpu_levers_gpu_jax0.11.2.json``
* ``benchmarks/results/h100/jax0.11.2/gpu_levers_two_candidates_gpu_jax0.11.2.json``

Pinned, not fitted (public figures or first principles; the runs do not
identify them):

* ``kernel``: 5 us, a kernel launch, 4-6 us (CUDA runtime, published)
* ``library``: 5 us, one kernel launch (first principles; one model has it)
* ``graph``: 5 us, one kernel launch (CUDA graphs, published)
* ``stream_call``: 2 us, two event records and waits, ~1 us each
* ``argument``: 1 us, per buffer, order 1 us (first principles)
* ``result``: 1 us, per buffer, order 1 us (first principles)
* ``loop_step``: 0 us, nothing beyond its body's launches (no run has one)
* ``host_wait``: 5 us, a copy launched like a kernel (no run has one)
* ``graph_library``: as ``graph_node``

``HELD_OUT``: per jaxstreams way, the lowest and highest error of its
estimated ratio to ``jax.jit`` (estimated / measured, less 1) where the
constants were fitted without that model or that way, over every jax's
compiled programs (``step_time_held_out_h100_jax<version>.txt``): what the
estimate's figure for that kind of program may be off by, and what the
default weighs it with (``jaxstreams.choose.estimated``). ``STEP_HELD_OUT``:
the same for ``jax.jit``'s own step time, each model left out: what a
step's figure in microseconds may be off by.
"""

from jaxstreams.xla.step_time import LaunchCosts

H100 = LaunchCosts(
    call=7.342064962378411e-05,
    argument=1e-06,
    result=1e-06,
    graph=5e-06,
    graph_node=7.969393210205261e-07,
    graph_library=7.969393210205261e-07,
    kernel=5e-06,
    library=5e-06,
    stream_call=2e-06,
    loop_step=0.0,
    host_wait=5e-06,
    kernel_time=1.812069099710146e-06,
    graph_latency=1.3303875915188466e-07,
    graph_issue=6.349949045198478e-07,
    stream_latency=1.2055004054979434e-06,
    efficiency=0.5782140333962202)

HELD_OUT = {
    'concurrent': (-0.27505030867096314, 0.9743145600117638),
    'inline': (-0.04532781494166516, 0.017618047397963466),
    'streams': (-0.15972236755970004, 0.1291447126836056),
    'streams_concurrent': (-0.19703023432014932, 1.2900697933322327),
}

STEP_HELD_OUT = (-0.4588971842097459, 0.9390581518464189)
