"""Multi-stream inference: many client threads, requests run side by side.

The JAX counterpart of the `multistream_inference` example of Multiple Stream
TensorFlow. There, `TF_GPU_STREAM_GROUP_COUNT=N` with
`TF_NODE_LEVEL_MULTISTREAM=false` makes every `session.run` take a free
stream group, and the example runs a model from `number_of_threads` threads
for `iters` iterations at `batch_size`. Here the model is built in code (an
MLP classifier with fixed random weights), `jaxstreams.serve(model,
groups=N)` is the session, and `--threads` client threads send `--requests`
requests in all. With ``mode="grouped"``, requests that arrive together (up
to N) run as one execution, each a region on a stream of its own. serve's
default, ``mode="by_platform"``, runs each request as ``jax.jit`` in its
caller's thread on a CPU, and on a GPU measures both ways at its warm-up and
keeps the faster; so groups=N here asks for ``mode="grouped"`` to show the
grouped path at work.

The example runs the same requests with groups=1 (the default mode), with
groups=N (grouped), and with two models served together (the classifier
and a second MLP of another width: their requests share batches), prints
the throughput of each, and checks every result against `jax.jit` of its
model: bitwise on CPU (XLA:CPU has one stream; regions are lowered inline),
to rounding on a GPU. On a CPU there is no speedup to expect.

Run from the repository root:

  python examples/multistream_inference.py
  python examples/multistream_inference.py --groups 8 --threads 16 \\
      --requests 4000 --batch_size 16
"""

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

MODELS = ("classifier", "second")     # the two-model server's, alternating


def build_model(key, features, width, depth, classes):
  """An MLP classifier; its weights are closed over, as a served model's are."""
  keys = jax.random.split(key, depth + 1)
  sizes = [features] + [width] * depth
  layers = [(jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
             jnp.full((o,), 0.01, jnp.float32))
            for k, i, o in zip(keys, sizes[:-1], sizes[1:])]
  head = jax.random.normal(keys[-1], (width, classes), jnp.float32)

  def model(x):
    for w, b in layers:
      x = jax.nn.relu(x @ w + b)
    logits = x @ head / np.sqrt(width)
    return {"probs": jax.nn.softmax(logits), "label": jnp.argmax(logits, -1)}

  return model


def run(server, inputs, threads):
  """Clients share the request list; returns the outputs and the seconds."""
  outputs = [None] * len(inputs)
  next_index = iter(range(len(inputs)))
  lock = threading.Lock()

  errors = []

  def client():
    try:
      while True:
        with lock:
          i = next(next_index, None)
        if i is None:
          return
        call = server if len(server.models) == 1 else server[MODELS[i % 2]]
        outputs[i] = call(inputs[i])
    except Exception as e:  # noqa: BLE001 -- raised in the main thread
      errors.append(e)

  workers = [threading.Thread(target=client) for _ in range(threads)]
  start = time.perf_counter()
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  if errors:
    raise errors[0]
  return outputs, time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--groups", type=int, default=4,
                      help="stream groups (TF_GPU_STREAM_GROUP_COUNT)")
  parser.add_argument("--threads", type=int, default=8,
                      help="client threads (number_of_threads)")
  parser.add_argument("--requests", type=int, default=2000,
                      help="requests in all (iters x threads)")
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--features", type=int, default=128)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--depth", type=int, default=3)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  key_model, key_second, key_data = jax.random.split(
      jax.random.PRNGKey(args.seed), 3)
  model = build_model(key_model, args.features, args.width, args.depth,
                      args.classes)
  second = build_model(key_second, args.features, args.width // 2,
                       args.depth, args.classes)
  distinct = [jax.random.normal(k, (args.batch_size, args.features))
              for k in jax.random.split(key_data, 32)]
  inputs = [distinct[i % len(distinct)] for i in range(args.requests)]
  expected = {name: [jax.jit(fn)(x) for x in distinct]
              for name, fn in (("classifier", model), ("second", second))}

  backend = jax.default_backend()
  print(f"backend: {backend}")
  print(f"model: MLP {args.features}-{args.width}x{args.depth}-"
        f"{args.classes}, batch {args.batch_size}; {args.requests} requests "
        f"from {args.threads} threads")

  bitwise = backend == "cpu"
  all_equal = True
  throughput = {}
  runs = [(f"groups={groups}", groups,
           "grouped" if groups > 1 else "by_platform", model)
          for groups in sorted({1, args.groups})]
  runs.append((f"two models, groups={args.groups}", args.groups, "grouped",
               dict(zip(MODELS, (model, second)))))
  for label, groups, mode, served in runs:
    with jaxstreams.serve(served, groups=groups, mode=mode) as server:
      # Compile every batch program ahead (batches of 1 to groups of these
      # shapes), then warm up.
      if len(server.models) == 1:
        server.warmup(distinct[0])
      else:
        server.warmup({name: (distinct[0],) for name in MODELS})
      run(server, distinct, args.threads)
      outputs, seconds = run(server, inputs, args.threads)
      stats = server.stats()
    throughput[label] = args.requests / seconds
    per_model = ("; per model " + ", ".join(
        f"{name} {s.completed}" for name, s in stats.models.items())
                 if len(stats.models) > 1 else "")
    print(f"{label}: {args.requests} requests in {seconds:.3f} s, "
          f"{throughput[label]:.0f} requests/s; mode {stats.mode}; requests "
          f"per execution {stats.batch_sizes or '(none: run directly)'}"
          f"{per_model}")
    for i, out in enumerate(outputs):
      name = MODELS[i % 2] if isinstance(served, dict) else "classifier"
      want = expected[name][i % len(distinct)]
      all_equal = all_equal and out is not None
      for a, b in zip(jax.tree_util.tree_leaves(out),
                      jax.tree_util.tree_leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        same = (a.tobytes() == b.tobytes() if bitwise
                else np.allclose(a, b, rtol=1e-5, atol=1e-6))
        all_equal = all_equal and same
  if args.groups != 1:
    print(f"groups={args.groups} / groups=1 throughput: "
          f"{throughput[f'groups={args.groups}'] / throughput['groups=1']:.2f}"
          "x")
  kind = "bitwise" if bitwise else "to rounding"
  print(f"results equal to jax.jit: {'yes' if all_equal else 'NO'} ({kind})")
  if not all_equal:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
