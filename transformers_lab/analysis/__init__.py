"""Looking inside models: attention capture and maps (``attention``), recorded features
and their PCA (``features``), and the notebooks' figures (``plots``). Sweep summaries and
learning curves live in ``transformers_lab.sweeps``."""
