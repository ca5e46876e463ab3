"""A DLRM-style recommender trained staged and unstaged: input preparation
hidden behind the step.

DeepRec's staging and SmartStage rows are measured on DLRM; this is the same
shape of program in JAX:

* host side, per batch: a read that waits `--read_ms` (a sleep standing in
  for storage latency: remote files, object stores; 0 turns it off), then raw
  text rows (`label0,...,dense0,...,sparse0,...`,
  Criteo-like: integer counts and categorical strings such as
  `c3_9f1ab2`) are split in Python and each categorical string is hashed to
  a bucket with a vectorised 32-bit FNV-1a in NumPy; the counts are parsed to
  floats. This is the host preparation of a real recommender input
  pipeline, and costs a realistic share of the step (print with
  `--report_host`).
* the step, one `jaxstreams.jit(streams=--streams)` function: `log1p` of the
  counts, one embedding lookup per sparse feature, the bottom MLP, DLRM's dot
  interaction (pairwise dot products of the bottom output and the
  embeddings), and `--towers` task towers (multi-task top MLPs, one logistic
  loss each), tower `t` placed with `jaxstreams.stream(1 + t % (streams - 1))`
  so it and its gradient run on their own stream on a GPU; then the gradient
  and an SGD update.

Three loops over the same batches, from the same parameters:

* unstaged: `for raw in rows: params, loss = step(params, prepare(raw))`.
* staged: `jaxstreams.staged(step, data=prepared_batches, smart=True)`. The
  host preparation and the host-to-device copy run in the runner's reader
  thread; each call is one program that runs the consumer (lookups, MLPs,
  towers, update; its stream plan kept) for this batch and, on a stream of
  its own, the data-only part of the step (the count transform, the
  per-feature id offsets, the labels) for the next batch. By default
  (`mode="measured"`) the runner does so only where its own measurements say
  staging pays, and otherwise runs the plain step on batches read in the
  caller's thread; the example prints which way it ran.
* prefetch: `for batch in jaxstreams.prefetch(prepared_batches):` the same
  step, with the preparation and copy in a worker thread.

Like a TF1 `session.run` loop, the loops fetch the loss to the host every
`--fetch_every` steps (default 1: every step, as training loops that log,
check for NaNs or early-stop do). A loop that never fetches (`--fetch_every=0`)
already overlaps host work with the previous step through JAX's asynchronous
dispatch, and staging has less to add. The example prints the throughputs
(steps/s, first step excluded), the speedups, and whether every loss and the
final parameters are identical to the unstaged loop: bitwise on CPU, where the
staged program runs exactly the step's equations; to rounding on a GPU, where
XLA fuses the staged program differently.

On a CPU the host preparation and XLA's computation share the cores: the
gain from overlapping CPU work with CPU work needs a free core for each, so
on a small, busy machine it comes mostly from the read latency; with
`--read_ms=0` on two busy cores expect little or none (each pipeline hand-off
between threads also costs some tenths of a millisecond per step there).

Run from the repository root:

  python examples/dlrm_staged.py
  python examples/dlrm_staged.py --batch=1024 --sparse=16 --towers=4 --streams=5
  python examples/dlrm_staged.py --fetch_every=0 --report_host

With its defaults it runs on a CPU in well under a minute.
"""

import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

_STEPS = flags.DEFINE_integer("steps", 120, "Training steps per loop.")
_BATCH = flags.DEFINE_integer("batch", 512, "Examples per step.")
_DENSE = flags.DEFINE_integer("dense", 13, "Dense (count) features.")
_SPARSE = flags.DEFINE_integer("sparse", 8, "Sparse (categorical) features.")
_BUCKETS = flags.DEFINE_integer("buckets", 4096,
                                "Hash buckets (embedding rows) per feature.")
_DIM = flags.DEFINE_integer("dim", 16, "Embedding dimension.")
_BOTTOM = flags.DEFINE_integer("bottom", 64, "Hidden width of the bottom MLP.")
_TOP = flags.DEFINE_integer("top", 128, "Hidden width of each tower.")
_TOWERS = flags.DEFINE_integer("towers", 2, "Task towers (one label each).")
_STREAMS = flags.DEFINE_integer(
    "streams", 3, "Stream groups of the step: towers go to streams 1..N-1.")
_LR = flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
_CAPACITY = flags.DEFINE_integer("capacity", 2,
                                 "Batches the staged producer runs ahead.")
_FETCH_EVERY = flags.DEFINE_integer(
    "fetch_every", 1, "Fetch the loss to the host every N steps (0: never).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Times each loop is run (alternating); the median rate is "
    "printed.")
_POOL = flags.DEFINE_integer(
    "pool", 4096, "Distinct raw rows generated (the reader cycles over them).")
_READ_MS = flags.DEFINE_float(
    "read_ms", 2.0, "Simulated storage latency per batch read, in ms (a "
    "sleep; 0: the raw rows are in memory).")
_REPORT_HOST = flags.DEFINE_bool(
    "report_host", False, "Also time the host preparation and the step alone.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of data and parameters.")

FIELD = 16                    # bytes per categorical string (zero-padded)
FNV_OFFSET, FNV_PRIME = np.uint32(2166136261), np.uint32(16777619)


# ---------------------------------------------------------------------------
# Host side: raw rows and their preparation.

def make_raw_rows(pool, dense, sparse, towers, seed):
  """`pool` raw text rows `labels,counts,categories` (bytes). Labels depend
  on a few categories and counts, so the towers have something to learn."""
  rng = np.random.default_rng(seed)
  counts = rng.poisson(3.0, (pool, dense))
  vocab = rng.integers(0, 100, (pool, sparse))
  weights = rng.standard_normal((towers, sparse))
  score = (np.sin(vocab * 0.7) @ weights.T
           + (np.log1p(counts[:, :1]) - 1.3)
           + 0.3 * rng.standard_normal((pool, towers)))
  labels = (score > 0).astype(int)
  rows = []
  for i in range(pool):
    cats = [f"c{j}_{vocab[i, j] * 2654435761 % 2**24:06x}"
            for j in range(sparse)]
    rows.append(",".join([*map(str, labels[i]), *map(str, counts[i]), *cats])
                .encode())
  return rows


def fnv1a(strings):
  """32-bit FNV-1a of each byte string, vectorised over a NumPy `S` array."""
  raw = np.ascontiguousarray(strings, dtype=f"S{FIELD}")
  octets = raw.view(np.uint8).reshape(*raw.shape, FIELD)
  h = np.full(raw.shape, FNV_OFFSET, np.uint32)
  for j in range(FIELD):
    c = octets[..., j].astype(np.uint32)
    h = np.where(c != 0, (h ^ c) * FNV_PRIME, h)
  return h


def prepare(rows, towers, dense, buckets):
  """Raw rows -> the step's batch: labels, counts (float) and sparse ids
  (hash mod buckets). All NumPy/Python: the host preparation."""
  fields = [row.split(b",") for row in rows]
  labels = np.array([f[:towers] for f in fields], dtype="S1").astype(np.float32)
  counts = np.array([f[towers:towers + dense] for f in fields],
                    dtype="S8").astype(np.float32)
  cats = np.array([f[towers + dense:] for f in fields], dtype=f"S{FIELD}")
  ids = (fnv1a(cats) % np.uint32(buckets)).astype(np.int32)
  return {"labels": labels, "counts": counts, "ids": ids}


def raw_batches(pool_rows, batch, steps, read_ms):
  """`steps` batches of raw rows, cycling over the pool; each read waits
  `read_ms` (a stand-in for storage latency: remote files, object stores)."""
  n = len(pool_rows)
  for k in range(steps):
    if read_ms:
      time.sleep(read_ms / 1000)
    start = (k * batch) % n
    yield [pool_rows[(start + i) % n] for i in range(batch)]


def prepared_batches(pool_rows, batch, steps, read_ms, towers, dense, buckets):
  for rows in raw_batches(pool_rows, batch, steps, read_ms):
    yield prepare(rows, towers, dense, buckets)


# ---------------------------------------------------------------------------
# The model.

def tower_stream(tower, streams):
  return 0 if streams == 1 else 1 + tower % (streams - 1)


def mlp_params(key, sizes):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) * m ** -0.5, "b": jnp.zeros((n,))}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def mlp(layers, x):
  for layer in layers[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ layers[-1]["w"] + layers[-1]["b"]


def init_params(key, dense, sparse, buckets, dim, bottom, top, towers):
  k_emb, k_bot, k_top = jax.random.split(key, 3)
  n_vec = sparse + 1
  n_inter = n_vec * (n_vec - 1) // 2 + dim
  return {
      "embedding": 0.1 * jax.random.normal(k_emb, (sparse * buckets, dim)),
      "bottom": mlp_params(k_bot, [dense, bottom, dim]),
      "towers": [mlp_params(k, [n_inter, top, top // 2, 1])
                 for k in jax.random.split(k_top, towers)],
  }


def make_train_step(streams, towers, sparse, buckets, learning_rate):
  def loss_fn(params, batch):
    # Data only: SmartStage's part.
    dense = jnp.log1p(batch["counts"])
    ids = batch["ids"] + jnp.arange(sparse, dtype=jnp.int32) * buckets
    # Embeddings, bottom MLP, dot interaction.
    emb = jnp.take(params["embedding"], ids, axis=0)          # [B, S, D]
    bot = mlp(params["bottom"], dense)                         # [B, D]
    vecs = jnp.concatenate([bot[:, None, :], emb], axis=1)     # [B, S+1, D]
    dots = jnp.einsum("bid,bjd->bij", vecs, vecs)
    i, j = np.triu_indices(sparse + 1, k=1)
    inter = jnp.concatenate([bot, dots[:, i, j]], axis=1)
    # Task towers, each (and its gradient) on its own stream.
    total = 0.0
    for t, tower in enumerate(params["towers"]):
      with jaxstreams.stream(tower_stream(t, streams)):
        logit = mlp(tower, inter)[:, 0]
        label = batch["labels"][:, t]
        total = total + jnp.mean(jax.nn.softplus(logit) - label * logit)
    return total / towers

  def train_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g,
                                    params, grads)
    return params, loss
  return train_step


# ---------------------------------------------------------------------------
# The loops.

class Loop:
  """Collects the losses, fetches one every `fetch_every` steps, times all
  steps but the first (which compiles)."""

  def __init__(self, fetch_every):
    self.fetch_every, self.losses, self.start = fetch_every, [], None

  def after_step(self, loss):
    self.losses.append(loss)
    k = len(self.losses)
    if self.fetch_every and k % self.fetch_every == 0:
      float(loss)
    if self.start is None:
      jax.block_until_ready(loss)
      self.start = time.perf_counter()

  def finish(self, params):
    jax.block_until_ready(params)
    seconds = time.perf_counter() - self.start
    return params, np.asarray(jax.device_get(self.losses)), seconds


def run_unstaged(step, params, data_args, fetch_every):
  pool_rows, batch, steps, read_ms, towers, dense, buckets = data_args
  loop = Loop(fetch_every)
  for rows in raw_batches(pool_rows, batch, steps, read_ms):
    params, loss = step(params, prepare(rows, towers, dense, buckets))
    loop.after_step(loss)
  return loop.finish(params)


def run_staged(step, params, data_args, fetch_every, capacity):
  loop = Loop(fetch_every)
  with jaxstreams.staged(step, data=prepared_batches(*data_args), smart=True,
                         capacity=capacity) as runner:
    while True:
      try:
        params, loss = runner(params)
      except StopIteration:
        break
      loop.after_step(loss)
    plan, way = runner.staged_plan(), runner.stats()
  return (*loop.finish(params), plan, way)


def run_prefetch(step, params, data_args, fetch_every, capacity):
  loop = Loop(fetch_every)
  with jaxstreams.prefetch(prepared_batches(*data_args), size=capacity) as it:
    for batch in it:
      params, loss = step(params, batch)
      loop.after_step(loss)
  return loop.finish(params)


def compare(got, want):
  """'bitwise', 'to rounding' or 'NO' for (params, losses) pairs."""
  (gp, gl), (wp, wl) = got, want
  pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(wp))]
  pairs.append((gl, wl))
  if any(a.shape != b.shape for a, b in pairs):
    return "NO"
  if all(np.array_equal(a, b) for a, b in pairs):
    return "bitwise"
  if all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs):
    return "to rounding"
  return "NO"


def time_host_and_step(step, params, data_args):
  """The host preparation alone and the step alone (data on the device)."""
  pool_rows, batch, _, _, towers, dense, buckets = data_args
  raws = list(raw_batches(pool_rows, batch, 20, 0))
  start = time.perf_counter()
  prepared = [prepare(r, towers, dense, buckets) for r in raws]
  host = (time.perf_counter() - start) / len(raws)
  on_device = jax.device_put(prepared)
  jax.block_until_ready(step(params, on_device[0]))
  start = time.perf_counter()
  for b in on_device:
    jax.block_until_ready(step(params, b))
  return host, (time.perf_counter() - start) / len(on_device)


def main(argv):
  del argv
  if min(_STEPS.value, _BATCH.value, _SPARSE.value, _DENSE.value,
         _TOWERS.value, _STREAMS.value,
         _CAPACITY.value) < 1 or _STEPS.value < 2:
    raise app.UsageError("sizes must be >= 1 and --steps >= 2")
  streams, towers = _STREAMS.value, _TOWERS.value
  print(f"backend: {jax.default_backend()}, jax {jax.__version__}, "
        f"{os.cpu_count()} CPU cores")
  pool_rows = make_raw_rows(_POOL.value, _DENSE.value, _SPARSE.value, towers,
                            _SEED.value)
  print(f"data: {_STEPS.value} batches of {_BATCH.value} raw rows "
        f"({towers} labels, {_DENSE.value} counts, {_SPARSE.value} "
        f"categorical strings), e.g. {pool_rows[0].decode()!r}")
  data_args = (pool_rows, _BATCH.value, _STEPS.value, _READ_MS.value, towers,
               _DENSE.value, _BUCKETS.value)
  print(f"host side per batch: read ({_READ_MS.value:g} ms simulated storage "
        f"latency), split, parse counts, FNV-1a hash of "
        f"{_BATCH.value * _SPARSE.value} strings (Python/NumPy)")

  params = init_params(jax.random.PRNGKey(_SEED.value), _DENSE.value,
                       _SPARSE.value, _BUCKETS.value, _DIM.value,
                       _BOTTOM.value, _TOP.value, towers)
  step = jaxstreams.jit(
      make_train_step(streams, towers, _SPARSE.value, _BUCKETS.value,
                      _LR.value),
      streams=streams)

  example = prepare(pool_rows[:_BATCH.value], towers, _DENSE.value,
                    _BUCKETS.value)
  plan = step.plan(params, example)
  print(f"streams: {streams}; towers placed on streams "
        f"{[tower_stream(t, streams) for t in range(towers)]}; regions per "
        "stream: " + ", ".join(
            f"stream {s}: {sum(r.stream == s for r in plan.regions)}"
            for s in plan.streams_used))

  if _REPORT_HOST.value:
    host, alone = time_host_and_step(step, params, data_args)
    print(f"host preparation {host * 1e3:.2f} ms per batch, step alone "
          f"{alone * 1e3:.2f} ms (data on the device)")

  fetch, capacity = _FETCH_EVERY.value, _CAPACITY.value
  loops = {
      "unstaged": lambda: run_unstaged(step, params, data_args, fetch),
      "staged": lambda: run_staged(step, params, data_args, fetch, capacity),
      "prefetch": lambda: run_prefetch(step, params, data_args, fetch,
                                       capacity),
  }
  results, seconds = {}, {name: [] for name in loops}
  for _ in range(max(_REPEATS.value, 1)):
    for name, loop in loops.items():
      out = loop()
      results.setdefault(name, out)      # every repeat computes the same
      seconds[name].append(out[2])
  u_params, u_losses, _ = results["unstaged"]
  s_params, s_losses, _, staged_plan, way = results["staged"]
  p_params, p_losses, _ = results["prefetch"]
  u_s, s_s, p_s = (float(np.median(seconds[n])) for n in loops)

  producer = [e.primitive for spec in staged_plan.producers
              for e in spec.equations]
  print(f"staged (smart=True): {len(staged_plan.producers)} producer "
        f"stage(s), {len(producer)} equation(s) run ahead "
        f"{sorted(set(producer))}; consumer "
        f"{len(staged_plan.consumer.equations)} equation(s)")
  print(f"loss: first {u_losses[0]:.6f}, last {u_losses[-1]:.6f} after "
        f"{len(u_losses)} steps")
  staged_verdict = compare((s_params, s_losses), (u_params, u_losses))
  prefetch_verdict = compare((p_params, p_losses), (u_params, u_losses))
  print(f"staged results identical to unstaged: {staged_verdict}")
  print(f"prefetch results identical to unstaged: {prefetch_verdict}")
  print(f"the staged runner ran {way['mode']} at the end ({way['switches']} "
        f"switch(es)): {way['mode_reason']}")

  timed = _STEPS.value - 1
  u_rate, s_rate, p_rate = timed / u_s, timed / s_s, timed / p_s
  fetched = (f"loss fetched every {fetch} step(s)" if fetch
             else "loss never fetched")
  print(f"throughput (steps/s, first step excluded, median of "
        f"{len(seconds['staged'])} runs, {fetched}): unstaged {u_rate:.1f}, "
        f"staged {s_rate:.1f}, prefetch {p_rate:.1f}")
  print(f"speedup over unstaged: staged {s_rate / u_rate:.2f}x, prefetch "
        f"{p_rate / u_rate:.2f}x")
  if "NO" in (staged_verdict, prefetch_verdict):
    raise SystemExit("the staged or prefetched loop disagrees with the "
                     "unstaged one")


if __name__ == "__main__":
  app.run(main)
