"""SmartStage in JAX: the data-only part of a step runs ahead, found for you.

The JAX counterpart of DeepRec's SmartStage example (`tf.data.TextLineDataset`
-> `decode_csv` -> `string_to_hash_bucket` -> `embedding_lookup`, with
`do_smart_stage = True`). There, the optimizer finds the widest subgraph that
depends only on the input iterator and runs it asynchronously, ahead of the
rest of the graph. Here, `jaxstreams.staged(step, data=batches, smart=True)`
does the same with a JAX training step that contains no `jaxstreams.stage()`
call:

* input: a synthetic CSV file written to a temporary directory, with a label,
  two integer count columns and three categorical string columns
  (`1,37,1024,u4821,i_17a3,sports`). A reader (plain Python) reads it line by
  line and hands each batch of lines to the step as fixed-width raw bytes
  (`uint8[batch, width]`), the way `TextLineDataset().batch()` hands strings
  to `decode_csv`.
* the step, jitted as one function: `decode_csv` (a `lax.scan` over the bytes
  of each line that splits fields at commas, parses the integers and computes
  the 32-bit FNV-1a hash of each categorical string), `string_to_hash_bucket`
  (hash mod `--buckets`), `log1p` of the counts, then the embedding lookup, a
  small MLP, the logistic loss, its gradient and an SGD update.
* `smart=True` stages everything that depends only on the batch (parsing,
  hashing, bucketing, the count transform, the host-to-device copy) and
  leaves what reads the parameters (the embedding lookup onwards) to the
  consumer. The example prints that split (`runner.staged_plan()`).

It then runs the same step as a plain loop (`for batch in reader:
params, loss = step(params, batch)`, with `jax.jit`) and prints both
throughputs (steps/s, first step excluded, median of `--repeats` runs) and
whether the two loss trajectories and final parameters are identical: bitwise
on CPU, where the staged program computes exactly the equations of the step.
(On a GPU, XLA may fuse the staged program differently, so agreement is to
rounding.) Both loops fetch the loss every `--fetch_every` steps (default 1,
as `sess.run([target])` does in the seed's example each step).

The reader waits `--read_ms` per batch (default 1 ms), a stand-in for
storage latency; the staged runner reads in a thread of its own, so it hides
that wait and the parsing behind the previous step. On a CPU the producer and
the consumer share the cores: with `--read_ms=0` on a small, busy machine
(two cores, others' work on them) staging costs more than it hides, since
there is no free core to overlap on and each hand-off between the
pipeline's threads costs some tenths of a millisecond per step. The runner
(default `mode="measured"`) measures that itself: it stages where reading a
batch is worth hiding and otherwise runs the plain step on batches read in
the caller's thread, and says so; the example prints which way it ran.

Run from the repository root:

  python examples/smart_stage.py
  python examples/smart_stage.py --rows=32768 --batch=256 --capacity=2
  python examples/smart_stage.py --read_ms=0 --fetch_every=0

With its defaults it runs on a CPU in a few seconds.
"""

import os
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

_ROWS = flags.DEFINE_integer("rows", 65536, "Rows of the synthetic CSV file.")
_BATCH = flags.DEFINE_integer("batch", 1024, "Lines per batch (step).")
_BUCKETS = flags.DEFINE_integer(
    "buckets", 1000, "Hash buckets per categorical column (embedding rows).")
_DIM = flags.DEFINE_integer("dim", 16, "Embedding dimension.")
_HIDDEN = flags.DEFINE_integer("hidden", 64, "Hidden width of the MLP.")
_LR = flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate.")
_CAPACITY = flags.DEFINE_integer(
    "capacity", 1, "Batches the staged producer may run ahead (SmartStage's "
    "capacity).")
_READ_MS = flags.DEFINE_float(
    "read_ms", 1.0, "Sleep per batch in the reader: simulated storage "
    "latency, in ms (0: none).")
_FETCH_EVERY = flags.DEFINE_integer(
    "fetch_every", 1, "Fetch the loss to the host every N steps, as "
    "`sess.run([target])` does every step (0: never).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Times each loop is run (alternating); the median rate is "
    "printed.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and parameters.")

WIDTH = 48                    # bytes per line, zero-padded (lines are shorter)
NUMERIC = ("label", "clicks", "views")          # fields 0..2: integers
CATEGORICAL = ("user", "item", "category")      # fields 3..5: strings
FNV_OFFSET, FNV_PRIME = 2166136261, 16777619


# ---------------------------------------------------------------------------
# The data: a CSV file and a reader.

def write_csv(path, rows, seed):
  """Writes `rows` lines `label,clicks,views,user,item,category`. The label
  depends on the user, the category and the clicks, so there is something to
  learn."""
  rng = np.random.default_rng(seed)
  users = rng.integers(0, 5000, rows)
  items = rng.integers(0, 0x10000, rows)
  cats = rng.integers(0, 12, rows)
  clicks = rng.poisson(5, rows)
  views = clicks * 20 + rng.integers(0, 200, rows)
  categories = ["sports", "news", "music", "games", "food", "travel",
                "tech", "autos", "kids", "home", "style", "money"]
  score = (np.sin(users * 0.37) + (cats % 3 - 1) + 0.2 * (clicks - 5)
           + 0.5 * rng.standard_normal(rows))
  labels = (score > 0).astype(int)
  with open(path, "w") as f:
    for i in range(rows):
      f.write(f"{labels[i]},{clicks[i]},{views[i]},u{users[i]},"
              f"i_{items[i]:04x},{categories[cats[i]]}\n")


def read_batches(path, batch, read_ms=0.0):
  """Yields `uint8[batch, WIDTH]`: the raw bytes of `batch` lines (the last,
  partial batch is dropped, as `batch(drop_remainder=True)` does)."""
  with open(path, "rb") as f:
    while True:
      lines = [f.readline() for _ in range(batch)]
      if not lines[-1]:
        return
      if read_ms:
        time.sleep(read_ms / 1000)
      raw = np.array([line.rstrip(b"\n") for line in lines], dtype=f"S{WIDTH}")
      yield {"lines": raw.view(np.uint8).reshape(batch, WIDTH)}


# ---------------------------------------------------------------------------
# The step.

def decode_csv(lines):
  """`uint8[B, WIDTH]` -> integer columns `int32[B, 3]` and the FNV-1a hash of
  each string column `uint32[B, 3]`: one pass over the bytes of the lines."""
  n = lines.shape[0]
  columns = jnp.transpose(lines.astype(jnp.uint32))          # [WIDTH, B]

  def scan_byte(carry, byte):
    field, ints, hashes = carry
    is_comma = byte == ord(",")
    is_char = (byte != 0) & ~is_comma
    is_digit = (byte >= ord("0")) & (byte <= ord("9"))
    digit = byte.astype(jnp.int32) - ord("0")
    f_num = field[:, None] == jnp.arange(len(NUMERIC))[None, :]
    ints = jnp.where(f_num & is_digit[:, None], ints * 10 + digit[:, None],
                     ints)
    f_cat = (field[:, None]
             == (len(NUMERIC) + jnp.arange(len(CATEGORICAL)))[None, :])
    fnv = (hashes ^ byte[:, None]) * jnp.uint32(FNV_PRIME)
    hashes = jnp.where(f_cat & is_char[:, None], fnv, hashes)
    return (field + is_comma.astype(jnp.int32), ints, hashes), None

  init = (jnp.zeros((n,), jnp.int32),
          jnp.zeros((n, len(NUMERIC)), jnp.int32),
          jnp.full((n, len(CATEGORICAL)), FNV_OFFSET, jnp.uint32))
  (_, ints, hashes), _ = jax.lax.scan(scan_byte, init, columns)
  return ints, hashes


def features(batch, buckets):
  """Parsing and hashing: depends only on the batch, so SmartStage's."""
  ints, hashes = decode_csv(batch["lines"])
  # string_to_hash_bucket
  bucket = (hashes % jnp.uint32(buckets)).astype(jnp.int32)
  ids = bucket + jnp.arange(len(CATEGORICAL), dtype=jnp.int32) * buckets
  dense = jnp.log1p(ints[:, 1:].astype(jnp.float32))
  label = ints[:, 0].astype(jnp.float32)
  return ids, dense, label


def embedding_lookup(table, ids):
  return jnp.take(table, ids, axis=0)


def init_params(key, buckets, dim, hidden):
  k1, k2, k3 = jax.random.split(key, 3)
  n_in = len(CATEGORICAL) * dim + len(NUMERIC) - 1
  return {
      "embedding": 0.05 * jax.random.normal(
          k1, (len(CATEGORICAL) * buckets, dim)),
      "w1": jax.random.normal(k2, (n_in, hidden)) * n_in ** -0.5,
      "b1": jnp.zeros((hidden,)),
      "w2": jax.random.normal(k3, (hidden, 1)) * hidden ** -0.5,
      "b2": jnp.zeros((1,)),
  }


def make_train_step(buckets, learning_rate):
  def loss_fn(params, batch):
    ids, dense, label = features(batch, buckets)
    emb = embedding_lookup(params["embedding"], ids)
    x = jnp.concatenate([emb.reshape(ids.shape[0], -1), dense], axis=1)
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logit = (h @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean(jax.nn.softplus(logit) - label * logit)  # logistic loss

  def train_step(params, batch):   # no jaxstreams.stage() anywhere
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g,
                                    params, grads)
    return params, loss
  return train_step


# ---------------------------------------------------------------------------
# Reading the staged plan.

def per_function(equations):
  """{function: equation count} from the plan's `file:line:col (function)`."""
  counts = {}
  for e in equations:
    name = e.source.rsplit("(", 1)[-1].rstrip(")").rsplit(".", 1)[-1]
    counts[name] = counts.get(name, 0) + 1
  return counts


# ---------------------------------------------------------------------------
# The two loops.

class Loop:
  """Collects the losses, fetches one every `fetch_every` steps, times all
  steps but the first (which compiles)."""

  def __init__(self, fetch_every):
    self.fetch_every, self.losses, self.start = fetch_every, [], None

  def after_step(self, loss):
    self.losses.append(loss)
    if self.fetch_every and len(self.losses) % self.fetch_every == 0:
      float(loss)
    if self.start is None:
      jax.block_until_ready(loss)
      self.start = time.perf_counter()

  def finish(self, params):
    jax.block_until_ready(params)
    return params, self.losses, time.perf_counter() - self.start


def run_unstaged(step, params, batches, fetch_every):
  """The reference: read a batch, run the step, in one thread."""
  loop = Loop(fetch_every)
  for batch in batches:
    params, loss = step(params, batch)
    loop.after_step(loss)
  return loop.finish(params)


def run_staged(step, params, batches, fetch_every, capacity):
  """SmartStage: each call consumes the next batch; the reader thread has
  read it ahead, and the program of the previous call already computed its
  data-only part (beside that call's consumer, on a stream of its own)."""
  loop = Loop(fetch_every)
  with jaxstreams.staged(step, data=batches, smart=True,
                         capacity=capacity) as runner:
    while True:
      try:
        params, loss = runner(params)
      except StopIteration:
        break
      loop.after_step(loss)
    plan, way = runner.staged_plan(), runner.stats()
  return (*loop.finish(params), plan, way)


def main(argv):
  del argv
  if _ROWS.value < 2 * _BATCH.value or _BATCH.value < 1:
    raise app.UsageError("need --batch >= 1 and --rows >= 2 * --batch")
  steps = _ROWS.value // _BATCH.value
  print(f"backend: {jax.default_backend()}, jax {jax.__version__}, "
        f"{os.cpu_count()} CPU cores")

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "train.csv")
    write_csv(path, _ROWS.value, _SEED.value)
    with open(path) as f:
      head = [next(f).rstrip() for _ in range(3)]
    print(f"data: {path}, {_ROWS.value} rows, {steps} batches of "
          f"{_BATCH.value}; first lines: {head}")

    params = init_params(jax.random.PRNGKey(_SEED.value), _BUCKETS.value,
                         _DIM.value, _HIDDEN.value)
    step = jax.jit(make_train_step(_BUCKETS.value, _LR.value))

    def batches():
      return read_batches(path, _BATCH.value, _READ_MS.value)

    fetch = _FETCH_EVERY.value
    loops = {
        "staged": lambda: run_staged(step, params, batches(), fetch,
                                     _CAPACITY.value),
        "unstaged": lambda: run_unstaged(step, params, batches(), fetch),
    }
    results, seconds = {}, {name: [] for name in loops}
    for _ in range(max(_REPEATS.value, 1)):
      for name, loop in loops.items():
        out = loop()
        results.setdefault(name, out)    # every repeat computes the same
        seconds[name].append(out[2])
    s_params, s_losses, _, plan, way = results["staged"]
    u_params, u_losses, _ = results["unstaged"]
    s_seconds = float(np.median(seconds["staged"]))
    u_seconds = float(np.median(seconds["unstaged"]))

  print()
  print("What smart=True staged (no stage() call in the step):")
  print(plan)
  producer = [e for spec in plan.producers for e in spec.equations]
  consumer = list(plan.consumer.equations)
  print(f"producer primitives: {sorted({e.primitive for e in producer})}")
  print(f"consumer primitives: {sorted({e.primitive for e in consumer})}")
  print(f"staged equations per function: {per_function(producer)}")
  print(f"consumer equations per function: {per_function(consumer)}")
  staged_fns, consumer_fns = per_function(producer), per_function(consumer)
  print(f"decode_csv (parse and hash, a scan) staged: "
        f"{'decode_csv' in staged_fns and 'decode_csv' not in consumer_fns}; "
        f"embedding_lookup staged: {'embedding_lookup' in staged_fns}")

  s_losses = np.asarray(jax.device_get(s_losses))
  u_losses = np.asarray(jax.device_get(u_losses))
  pairs = [(np.asarray(a), np.asarray(b)) for a, b in
           zip(jax.tree_util.tree_leaves(s_params),
               jax.tree_util.tree_leaves(u_params))]
  same_len = len(s_losses) == len(u_losses)
  bitwise = same_len and np.array_equal(s_losses, u_losses) and all(
      np.array_equal(a, b) for a, b in pairs)
  close = (same_len
           and np.allclose(s_losses, u_losses, rtol=1e-4, atol=1e-6)
           and all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs))
  verdict = "bitwise" if bitwise else "to rounding" if close else "NO"

  timed = steps - 1                      # the first step is not timed
  print()
  print(f"steps: staged {len(s_losses)}, unstaged {len(u_losses)}")
  print(f"loss: first {u_losses[0]:.6f}, last {u_losses[-1]:.6f}")
  print(f"final loss: staged {s_losses[-1]:.9g}, unstaged {u_losses[-1]:.9g}")
  print(f"losses and parameters identical to the unstaged loop: {verdict}")
  print(f"the staged runner ran {way['mode']} at the end ({way['switches']} "
        f"switch(es)): {way['mode_reason']}")
  staged_rate, plain_rate = timed / s_seconds, timed / u_seconds
  fetch = _FETCH_EVERY.value
  fetched = (f"loss fetched every {fetch} step(s)" if fetch
             else "loss never fetched")
  print(f"throughput (steps/s, first step excluded, median of "
        f"{len(seconds['staged'])} runs, {fetched}): staged {staged_rate:.1f}, "
        f"unstaged {plain_rate:.1f}, ratio {staged_rate / plain_rate:.2f}x")
  if verdict == "NO":
    raise SystemExit("the staged loop and the unstaged loop disagree")


if __name__ == "__main__":
  app.run(main)
