"""``jaxstreams.PerformanceWarning``: a feature that was asked for is not
paying for itself here (the code still runs, correctly, only no faster or
slower than without it). One category, so users can filter all of them:
``warnings.filterwarnings("ignore", category=jaxstreams.PerformanceWarning)``.
"""


class PerformanceWarning(UserWarning):
  """A jaxstreams feature measured itself and found it does not pay here."""
