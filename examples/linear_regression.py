"""Linear regression on two streams: the DeepRec multi-stream best practice.

The JAX counterpart of the "Best Practice" example of DeepRec's GPU
Multi-stream document. The model is Z = W_X*X + b + W_Y*Y: the X half
(W_X, b) is written under `with jaxstreams.stream(0):` and the Y half (W_Y)
under `with jaxstreams.stream(1):`, in a step compiled with
`jaxstreams.jit(streams=2)` (DeepRec's `multi_stream_num = 2`). Gradient
descent (learning rate 0.01) runs 1,000 steps on the example's 17 points,
printing loss, W_X, b and W_Y every 100 steps as that example prints them.
The gradient of each half follows its stream.

It then runs the same 1,000 steps with plain jax.jit and checks that the
loss trajectory (the loss of every step) and the final parameters are the
same: bitwise on CPU (XLA:CPU has one stream, so regions are lowered
inline), to rounding on a GPU.

Run from the repository root:

  python examples/linear_regression.py
  python examples/linear_regression.py --max_train_steps=200 --log_step=50

It takes a few seconds on a CPU.
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import jaxstreams

_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.01, "SGD learning rate.")
_MAX_TRAIN_STEPS = flags.DEFINE_integer("max_train_steps", 1000, "Steps.")
_LOG_STEP = flags.DEFINE_integer("log_step", 100, "Print every N steps.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the initial W_X and W_Y.")

train_X = np.array([[3.3], [4.4], [5.5], [6.71], [6.93], [4.168], [9.779],
                    [6.182], [7.59], [2.167], [7.042], [10.791], [5.313],
                    [7.997], [5.654], [9.27], [3.1]], dtype=np.float32)
train_Y = np.array([[3.3], [4.4], [5.5], [6.71], [6.93], [4.168], [9.779],
                    [6.182], [7.59], [2.167], [7.042], [10.791], [5.313],
                    [7.997], [5.654], [9.27], [3.1]], dtype=np.float32)
train_Z = np.array([[1.7], [2.76], [2.09], [3.19], [1.694], [1.573], [3.336],
                    [2.596], [2.53], [1.221], [2.827], [3.465], [1.65],
                    [2.904], [2.42], [2.94], [1.3]], dtype=np.float32)

total_samples = train_X.shape[0]


def loss_fn(params, X, Y, Z_):
  with jaxstreams.stream(0):
    X_Result = X @ params["W_X"] + params["b"]
  with jaxstreams.stream(1):
    Y_Result = Y @ params["W_Y"]
  Z = X_Result + Y_Result
  return jnp.sum((Z - Z_) ** 2) / total_samples


def make_train_op(learning_rate):
  def train_op(params, X, Y, Z_):
    loss, grads = jax.value_and_grad(loss_fn)(params, X, Y, Z_)
    params = jax.tree_util.tree_map(
        lambda p, g: p - learning_rate * g, params, grads)
    return params, loss
  return train_op


def init_params(seed):
  key_x, key_y = jax.random.split(jax.random.PRNGKey(seed))
  return {"W_X": jax.random.normal(key_x, (1, 1)),
          "b": jnp.zeros((1,)),
          "W_Y": jax.random.normal(key_y, (1, 1))}


def train(train_op, loss, params, steps, log_step, verbose):
  """The example's loop: after step `step`, log the loss and the weights."""
  data = (train_X, train_Y, train_Z)
  losses = []   # the loss of every step, before its update
  report = lambda step, c, p: print(
      "Step:%d, loss==%.4f, W_X==%.4f, b==%.4f, W_Y=%.4f" %
      (step, c, p["W_X"][0, 0], p["b"][0], p["W_Y"][0, 0]))
  for step in range(steps):
    params, step_loss = train_op(params, *data)
    losses.append(step_loss)
    if verbose and step % log_step == 0:
      report(step, loss(params, *data), params)
  final_loss = loss(params, *data)
  if verbose:
    report(steps, final_loss, params)
  return params, np.asarray(jax.device_get(losses)), final_loss


def main(argv):
  del argv
  train_op = make_train_op(_LEARNING_RATE.value)
  params = init_params(_SEED.value)
  data = (train_X, train_Y, train_Z)

  # DeepRec: use_multi_stream = ON, multi_stream_num = 2.
  fast_train_op = jaxstreams.jit(train_op, streams=2)
  fast_loss = jaxstreams.jit(loss_fn, streams=2)

  plan = fast_train_op.plan(params, *data)
  print(f"backend: {jax.default_backend()}, jax {jax.__version__}")
  print(str(plan).split("\n\n")[0])
  print("regions: " + ", ".join(
      f"R{r.index} on stream {r.stream} ({len(r.equations)} equations)"
      for r in plan.regions))

  print("Start training:")
  fast_params, fast_losses, fast_final = train(
      fast_train_op, fast_loss, params, _MAX_TRAIN_STEPS.value,
      _LOG_STEP.value, verbose=True)
  w_x, b, w_y = (float(fast_params[k].reshape(-1)[0])
                 for k in ("W_X", "b", "W_Y"))
  print("Linear Regression Model: Z=%.4f*X + %.4f*Y + %.4f" % (w_x, w_y, b))

  plain_params, plain_losses, plain_final = train(
      jax.jit(train_op), jax.jit(loss_fn), params, _MAX_TRAIN_STEPS.value,
      _LOG_STEP.value, verbose=False)
  pairs = [(np.asarray(fast_params[k]), np.asarray(plain_params[k]))
           for k in ("W_X", "b", "W_Y")]
  pairs += [(fast_losses, plain_losses),
            (np.asarray(fast_final), np.asarray(plain_final))]
  if all(np.array_equal(a, c) for a, c in pairs):
    verdict = "yes (bitwise)"
  elif all(np.allclose(a, c, rtol=1e-5, atol=1e-6) for a, c in pairs):
    verdict = "yes (to rounding)"
  else:
    verdict = "NO"
  print(f"Loss trajectory of {len(fast_losses)} steps and final W_X, b, W_Y "
        f"identical to jax.jit: {verdict}")
  if verdict == "NO":
    raise SystemExit("jaxstreams and jax.jit disagree")


if __name__ == "__main__":
  app.run(main)
