"""Export to Hugging Face transformers: a GPT of ours, its tokenizer and the classes that
load them (``AutoModelForCausalLM`` and ``AutoTokenizer`` with ``trust_remote_code``).

- ``hf.model``: ``TlabConfig`` and ``TlabForCausalLM`` (``generate`` on our decoding);
- ``hf.tokenizer``: ``TlabTokenizer``, the model's own tokenizer;
- ``hf.write``: ``export``, the folder ``tlab-export`` writes.

The exported folder's code imports ``transformers_lab``: the model is rebuilt from its
recipe by our own classes, so every kernel loads as it trained.
"""
