"""The step-time estimate's constants (``step_time.LaunchCosts``), fitted
to H100 runs by ``benchmarks/fit_step_time.py`` from programs compiled on
jax 0.11.2. Do not edit by hand: refit (see that script). Runs:

* ``benchmarks/results/archive/h100-jax0.11.2-session2/gpu_levers_gpu_jax0.11.2.json``
* ``benchmarks/results/h100/jax0.11.2/gpu_levers_gpu_jax0.11.2.json``
* ``benchmarks/results/h100/jax0.11.2/gpu_levers_two_candidates_gpu_jax0.11.2.json``
"""

from jaxstreams.xla.step_time import LaunchCosts

H100 = LaunchCosts(
    call=5.625357725660099e-05,
    argument=1.0667409722183258e-06,
    result=9.979467506827139e-06,
    graph=9.475215533113279e-09,
    graph_node=3.502276674300503e-07,
    graph_library=2.545411001313935e-05,
    kernel=5.669648119394529e-06,
    library=1.7883227982889828e-05,
    stream_call=8.156779460861745e-06,
    loop_step=0.0,
    host_wait=5.669648119394529e-06,
    kernel_time=1.1689129753954417e-06,
    graph_latency=1.637999772766363e-07,
    graph_issue=6.536008153162052e-09,
    stream_latency=3.741794626531376e-07,
    efficiency=0.4169389540880132)
