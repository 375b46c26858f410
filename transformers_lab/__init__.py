"""transformers_lab: ablations over transformer attention kernels.

``attention`` (the kernels), ``nn`` and ``models`` (plain PyTorch), ``data`` and ``tasks``
(Lightning), ``sweeps`` (jobs, records, summaries), ``analysis`` (inside a model),
``bench``; the entry points ``train``, ``eval``, ``sample`` and ``translate`` and what
they share (``runs``, ``config``, ``config_checks``, ``builders``, ``checkpoints``,
``safety``, ``cli``, ``errors``, ``files``).
"""
