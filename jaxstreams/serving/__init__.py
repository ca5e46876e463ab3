"""Inference mode: concurrent requests, each on its own stream group.

Multi-Stream TensorFlow's inference mode gives every ``session.run`` a free
stream group, so many small requests share one GPU at the same time.
``jaxstreams.serve(f)`` does the same for a JAX function: requests that
arrive together run as one execution of a ``jaxstreams.jit`` program in
which each request is a region on its own stream, and each caller gets its
own result (or its own error). The default ``mode="by_platform"`` runs each
request as ``jax.jit(f)`` in its caller's thread instead on every platform
where that was measured faster, which so far is every one (XLA:CPU, and an
H100 with jax 0.11.2); ``mode="grouped"`` asks for the stream groups::

    server = jaxstreams.serve(model, groups=4)
    with server:
      y = server(x)                  # from any number of threads
      fut = server.submit(x2)        # or a concurrent.futures.Future

See ``jaxstreams.serving.serve`` for the options and the guarantees. The
subpackage is ``serving``, not ``serve``: ``jaxstreams.serve`` is the function
(the package exports it), and a subpackage of that name would be hidden
behind it.
"""

from jaxstreams.serving._server import (QueueFullError, Server,
                                        ServerClosedError, ServeStats, serve)

__all__ = ["QueueFullError", "ServeStats", "Server", "ServerClosedError",
           "serve"]
