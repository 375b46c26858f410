"""The life of one run, sweep or not: build the data, model, task and trainer from the
config (``build``), fit and test (``fit``), the job around it and its record (``job``,
``record``), checkpoints and exact resume (``checkpoints``), the safety callbacks
(``safety``), and what a run's overrides and curves say (``overrides``, ``curves``).
Nothing here imports ``sweeps``: a sweep's pruning callback is handed to the trainer by
its caller."""
