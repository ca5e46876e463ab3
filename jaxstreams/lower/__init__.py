"""Stage 4 of the pipeline: emit each region where its plan puts it, in the
way a GPU runs it best. The rooms, in the one direction a plan walks them
(each imports only those after it):

* the ways: ``memory`` (what each way needs on the device and whether it
  fits) and ``gpu`` (the ways and the static rule); which way a function's
  calls run is chosen above lowering and the view, in ``jaxstreams.choose``;
* deciding before emitting: ``decide`` (which regions run in place, how
  each group of loops runs as one, the functions each region and body is
  cut into, the ordering's keys and packings; kept in the plan, once per
  program);
* emitting regions: ``emit`` (the plan in order, a region in place or as a
  call, as decided);
* emitting loop groups: ``loops`` (independent loops as one loop, each body
  on its stream);
* ordering: ``order`` (sequence points, barriers, collectives' combiner
  keys) and ``packing`` (a call's outputs in one buffer);
* region calls: ``calls`` (a region as a stream call, and the rules jax
  lowers such calls by);
* what XLA cannot compile: ``limits``.
"""

from jaxstreams.lower.emit import emit, region_function

__all__ = ["emit", "region_function"]
