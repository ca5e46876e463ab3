"""Inference mode: concurrent requests for one model or several.

Multi-Stream TensorFlow's inference mode gives every ``session.run`` a free
stream group, so many small requests share one GPU at the same time. JAX's
GPU clients launch every execution of a device on one compute stream (as
read in XLA's sources), so threads calling ``jax.jit`` run one after
another there.
``jaxstreams.serve(f)`` (or ``serve({"a": f, "b": g})`` for several models)
can run requests that arrive together as one execution in which each
request is a region on a stream of its own (``mode="grouped"``), or each as
``jax.jit(f)`` in its caller's thread (``mode="direct"``). The default,
``mode="by_platform"``, runs direct on XLA:CPU and measures both on a GPU::

    server = jaxstreams.serve(model, groups=4)
    with server:
      y = server(x)                  # from any number of threads
      fut = server.submit(x2)        # or a concurrent.futures.Future

See ``jaxstreams.serving.serve`` for the options and the guarantees, and
``_server`` for the modules along a request's path. The subpackage is
``serving``, not ``serve``: ``jaxstreams.serve`` is the function (the
package exports it), and a subpackage of that name would be hidden behind
it.
"""

from jaxstreams.serving._server import (ModelStats, QueueFullError, Server,
                                        ServerClosedError, ServeStats, serve)

__all__ = ["ModelStats", "QueueFullError", "ServeStats", "Server",
           "ServerClosedError", "serve"]
