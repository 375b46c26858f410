"""The life of one run, sweep or not, a module a stage in the order a run takes them
(``fit.fit_and_test`` reads as that order, a line a step): the config checked before any
data is read (``preflight``), the checkpoint it resumes read once and safely and held to
it (``checkpoints/``), W&B (``loggers``), data, model and task (``components``), the
trainer (``trainer``), fit and test (``fit``), the evaluation past the trained length
(``lengths``), and what the run records and prints (``record``). Around it: the job of a
sweep (``job``), the callbacks (``callbacks/``: safety, with exact resume; views), and
what a run's overrides and curves say (``overrides``, ``curves``).
Nothing here imports ``sweeps``: a sweep's pruning callback is handed to the trainer by
its caller."""
