"""Looking inside models and at results: attention capture and maps (``attention``),
recorded features and their PCA (``features``), the notebooks' figures (``plots``), and
sweep summaries (``summary``)."""

from transformers_lab.analysis.summary import collect, read_result, summarize, write_result

__all__ = ["collect", "read_result", "summarize", "write_result"]
