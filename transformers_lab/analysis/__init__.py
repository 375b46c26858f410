"""Looking at results: sweep summaries (tables and plots)."""

from transformers_lab.analysis.summary import collect, read_result, summarize, write_result

__all__ = ["collect", "read_result", "summarize", "write_result"]
