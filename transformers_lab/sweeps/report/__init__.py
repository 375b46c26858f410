"""A sweep's report (``tlab-summarize``): ``collect`` -> ``groups`` (with ``stats``) ->
``tables`` and ``plots`` (and ``study``, an Optuna study's trials) -> ``cli``, which
writes the files. Each module imports only those before it."""
