"""Data-parallel training with towers on streams, on JAX's own multi-device
runtime: one process with several devices, or several processes under
``jax.distributed``.

The batch is sharded over every device of every process (a ``data`` mesh
axis), the parameters are replicated, and ``jax.jit``'s sharding
propagation adds the all-reduce of the gradients; ``jaxstreams.jit`` adds
nothing to that but the plan: each tower (and its gradient) on a stream of
its own. The script runs the same loop with ``jax.jit`` and checks that
the losses and the final parameters are the same, bitwise on CPU.

One machine, eight CPU devices:

  python examples/sharded_training.py --devices=8

The same step written with ``shard_map`` (``--shard_map``) is each device's
own program: jaxstreams plans its body, the towers' regions run on their
streams on every device, and the gradients' all-reduces stay on the main
stream. Each tower's gradients are reduced on their own (jaxstreams keeps
XLA from merging them with the other tower's), so XLA:GPU schedules one
tower's all-reduce while the other tower still computes. Written for
``jax.jit`` to partition, the regions stay in place (XLA's partitioner may
put collectives into them), and none runs beside a collective.

Two processes on this machine, four CPU devices each (the same step,
unchanged, with gradients all-reduced across processes by JAX's CPU
collectives):

  python examples/sharded_training.py --devices=4 --num_processes=2 \\
      --process_id=0 --coordinator=localhost:12355 &
  python examples/sharded_training.py --devices=4 --num_processes=2 \\
      --process_id=1 --coordinator=localhost:12355

On a cluster, start one process per host with the same flags (or none:
``jax.distributed.initialize`` then reads the cluster's environment).
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

_DEVICES = flags.DEFINE_integer(
    "devices", 0, "CPU devices per process (0: leave JAX's default).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0, for jax.distributed.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank.")
_STEPS = flags.DEFINE_integer("steps", 40, "SGD steps.")
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch (all devices).")
_FEATURES = flags.DEFINE_integer("features", 16, "Input features.")
_WIDTH = flags.DEFINE_integer("width", 32, "Hidden width of each tower.")
_TOWERS = flags.DEFINE_integer("towers", 2, "Independent MLP towers.")
_LR = flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.")
_SHARD_MAP = flags.DEFINE_bool(
    "shard_map", False, "Write the step as each device's program (shard_map) "
    "instead of one program jax.jit partitions.")


def init(features, width, towers, seed=0):
  rng = np.random.default_rng(seed)
  params = {"towers": [{"w": (rng.standard_normal((features, width))
                              / features ** 0.5),
                        "v": rng.standard_normal((width, 1)) / width ** 0.5}
                       for _ in range(towers)]}
  x = rng.standard_normal((_BATCH.value, features))
  y = np.sin(x.sum(axis=1, keepdims=True))
  as32 = lambda a: np.asarray(a, np.float32)
  return jax.tree_util.tree_map(as32, params), as32(x), as32(y)


def loss_fn(params, x, y):
  out = 0.0
  for t, tower in enumerate(params["towers"]):
    with jaxstreams.stream(1 + t % 2):   # each tower, and its gradient
      out = out + jnp.tanh(x @ tower["w"]) @ tower["v"]
  return jnp.mean((out - y) ** 2)


def make_step(towers, lr):
  """The step as one program: jax.jit's partitioner shards it and adds the
  gradients' all-reduce."""
  del towers

  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss
  return step


def make_shard_map_step(lr, mesh):
  """The same step as each device's program (``shard_map``): the towers'
  regions run on their streams on every device, and XLA:GPU schedules one
  tower's gradient all-reduce, on the main stream, while the other tower
  computes."""
  from jax.sharding import PartitionSpec as P

  def local_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    # The gradient of the replicated parameters is summed over the devices
    # by shard_map itself; the mean over the global batch needs the count.
    count = jax.lax.psum(1, "data")
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g / count,
                                    params, grads)
    return params, jax.lax.pmean(loss, "data")

  return jax.shard_map(local_step, mesh=mesh,
                       in_specs=(P(), P("data"), P("data")),
                       out_specs=(P(), P()))


def global_array(host, sharding):
  """``host`` (the same on every process) as one array over the mesh: each
  process supplies the pieces on its own devices."""
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def local_copy(array):
  """A replicated array's value, read on this process."""
  return np.asarray(array.addressable_data(0))


def train(step, params, x, y):
  losses = []
  for _ in range(_STEPS.value):
    params, loss = step(params, x, y)
    if jax.process_count() > 1:
      # One step in flight: with many queued, XLA:CPU's collectives between
      # processes (gloo) hung here, with jax.jit as with jaxstreams.jit
      # (40 steps on a 2-core machine, jax 0.10.2; 10 ran).
      loss.block_until_ready()
    losses.append(loss)
  return params, np.array([local_copy(l) for l in losses])


def main(argv):
  del argv
  if _DEVICES.value:
    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
  if _NUM_PROCESSES.value and _NUM_PROCESSES.value > 1:
    # Collectives between processes on CPU (GPUs use NCCL by themselves).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value)
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  if _BATCH.value % jax.device_count():
    raise app.UsageError(f"--batch={_BATCH.value} must be a multiple of the "
                         f"{jax.device_count()} devices")

  host_params, host_x, host_y = init(_FEATURES.value, _WIDTH.value,
                                     _TOWERS.value)
  params = jax.tree_util.tree_map(lambda a: global_array(a, replicated),
                                  host_params)
  x, y = global_array(host_x, batch), global_array(host_y, batch)
  step = (make_shard_map_step(_LR.value, mesh) if _SHARD_MAP.value
          else make_step(_TOWERS.value, _LR.value))
  streamed = jaxstreams.jit(step, streams=3)
  lead = jax.process_index() == 0

  if lead:
    print(f"{jax.process_count()} process(es), {jax.device_count()} "
          f"{jax.devices()[0].platform} devices, batch sharded {P('data')}")
    plan = streamed.plan(params, x, y)
    for where, each in [("plan", plan), *(
        (f"shard_map #{i} body", body) for i, body in plan.bodies.items())]:
      print(f"{where}: {len(each.regions)} regions on streams "
            f"{sorted({r.stream for r in each.regions})}")
  got_params, got_losses = train(streamed, params, x, y)
  want_params, want_losses = train(jax.jit(step), params, x, y)
  if lead:
    print(f"loss {got_losses[0]:.6f} -> {got_losses[-1]:.6f} "
          f"over {_STEPS.value} steps")
  np.testing.assert_array_equal(got_losses, want_losses)
  for got, want in zip(jax.tree_util.tree_leaves(got_params),
                       jax.tree_util.tree_leaves(want_params)):
    np.testing.assert_array_equal(local_copy(got), local_copy(want))
  if lead:
    print("results equal jax.jit: bitwise")


if __name__ == "__main__":
  app.run(main)
