"""``jaxstreams.prefetch``'s public names, kept importable from here
(``from jaxstreams.staging.prefetch import Prefetcher,
BY_PLATFORM_TRANSFER``).

The code lives in private modules, one concept each: ``_prefetcher``
(``Prefetcher`` and ``prefetch()``), ``_prefetch_checks`` (the arguments),
``_lookahead`` (the pipeline of workers or the consumer's thread),
``_chooser`` (whether workers pay) and ``_transfer`` (how items reach the
device).
"""

from jaxstreams.staging._prefetcher import Prefetcher, prefetch
from jaxstreams.staging._transfer import BY_PLATFORM_TRANSFER, TRANSFERS

__all__ = ["prefetch", "Prefetcher", "TRANSFERS", "BY_PLATFORM_TRANSFER"]
