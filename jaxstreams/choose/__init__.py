"""Which way a ``jaxstreams.jit`` function's calls run: the choice, on its
own floor above lowering (which makes each way's program) and the XLA view
(which reads what XLA compiles of it), since it weighs what both made.
Its rooms, in the one direction a choice walks them (each imports only
those after it):

* ``choice``: which way a function's calls run, from the first top-level
  call on (the structural rule, timed on a GPU, estimated where nothing
  times, kept per signature);
* ``dispatch``: what the function calls as its choice goes (its first
  call, top-level and nested calls apart, calls by signature);
* ``signature``: one signature's trial of the ways beside its first calls;
* ``estimated``: the ways weighed by their estimated GPU steps, where
  nothing times them, and the rule that lets the estimate decide only
  beyond its held-out error;
* ``compile_pool``: the compiles beside the first call;
* ``timing``: timing the ways, the rule that keeps one, and the decisions
  kept on disk.
"""
