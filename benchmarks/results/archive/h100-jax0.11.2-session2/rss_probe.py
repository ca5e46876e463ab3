"""Host RSS growth over 9000 steps: jax.jit's loop against staged's, one process."""
import gc, sys, time
import numpy as np, jax, jax.numpy as jnp
import jaxstreams

STEPS = 10_000

def rss():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024

rng = np.random.default_rng(0)
batches = [(rng.standard_normal((4, 3)).astype(np.float32),
            rng.standard_normal((4,)).astype(np.float32)) for _ in range(64)]
def data():
  for i in range(STEPS):
    yield batches[i % len(batches)]

def step(w, batch):
  x, y = batch
  f = jaxstreams.stage(jnp.tanh(x * 0.5))
  loss, g = jax.value_and_grad(lambda w: jnp.mean((f @ w - y) ** 2))(w)
  return w - 0.01 * g, loss

def measure(name, run_one, make=None):
  w = jnp.zeros((3,), jnp.float32)
  pending, marks = [], {}
  t = time.perf_counter()
  it = data()
  for i in range(STEPS):
    w, loss = run_one(w, it)
    pending.append(loss)
    if (i + 1) % 250 == 0:
      jax.device_get(pending); pending = []
    if i + 1 in (1000, STEPS):
      gc.collect(); marks[i + 1] = rss()
  print(f"{name:24s} grew {(marks[STEPS]-marks[1000])/2**20:6.2f} MB over 9000 steps "
        f"({(marks[STEPS]-marks[1000])/9000:.0f} B/step), {time.perf_counter()-t:.1f} s", flush=True)

print(jax.devices()[0].device_kind, jax.__version__)
plain = jax.jit(step)
for rep in range(2):
  measure(f"jax.jit loop #{rep}", lambda w, it: plain(w, next(it)))
  for mode in ("fused", "threads"):
    runner = jaxstreams.staged(step, data=data(), capacity=2, mode=mode)
    with runner:
      measure(f"staged {mode} #{rep}", lambda w, it: runner(w))
