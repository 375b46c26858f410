"""transformers_lab: ablations over transformer attention kernels.

``attention`` (the kernels), ``nn`` and ``models`` (plain PyTorch), ``data`` and ``tasks``
(Lightning), ``run`` (the life of one run: build, fit, the job and its record,
checkpoints, safety), ``sweeps`` (sweepers, studies, pruning, summaries), ``analysis``
(inside a model), ``bench``; the entry points ``train``, ``eval``, ``sample`` and
``translate``, and what they share (``config``, ``preflight``, ``cli``, ``errors``,
``files``).
"""
