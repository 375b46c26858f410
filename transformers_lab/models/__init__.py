"""The models: plain nn.Modules that take an attention-kernel factory: ``GPT``, the
encoder-decoder ``Transformer``, ``EncoderClassifier`` and ``ViT`` (``common``: the
block stack and sampling they share)."""

from transformers_lab.models.encoder import EncoderClassifier, ViT
from transformers_lab.models.gpt import GPT
from transformers_lab.models.transformer import Transformer

__all__ = ["GPT", "EncoderClassifier", "Transformer", "ViT"]
