"""transformers_lab: ablations over transformer attention kernels.

``attention`` (the kernels and their engines), ``nn`` and ``models`` (plain PyTorch),
``data`` and ``tasks`` (Lightning), ``run`` (the life of one run: preflight, build, fit,
the job and its record, checkpoints, callbacks, loggers), ``sweeps`` (sweepers, studies,
pruning, summaries), ``analysis`` (inside a model), ``bench``; the entry points ``train``,
``eval``, ``sample`` and ``translate``, and what they share (``config``, ``cli``,
``errors``, ``files``). Each package imports only those below it (tests/test_layering.py).
"""
