"""The run's Lightning callbacks, in one home: those that keep a run safe (``safety``: the
NaN guard, stopping on a signal, exact resume) and those that show it (``views``: the
progress bar, the final validation, pictures); the checkpoint callback is
``run.checkpoints``'. ``run.trainer`` builds the ``callbacks`` group's."""
