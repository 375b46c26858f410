"""The life of one run, sweep or not, in order: the config checked before the data is read
(``preflight``), the data, model, task and trainer built from it (``build``), fit and
test (``fit``), the job around it and its record (``job``, ``record``), checkpoints (the
one restore, the atomic writer: ``checkpoints``), the callbacks (``callbacks/``: safety,
with exact resume, and views), W&B (``loggers``), and what a run's overrides and curves
say (``overrides``, ``curves``).
Nothing here imports ``sweeps``: a sweep's pruning callback is handed to the trainer by
its caller."""
