"""transformers_lab: ablations over transformer attention kernels."""
