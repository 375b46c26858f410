"""The models: plain nn.Modules that take an attention-kernel factory."""

from transformers_lab.models.encoder import EncoderClassifier, ViT
from transformers_lab.models.gpt import GPT
from transformers_lab.models.transformer import Transformer

__all__ = ["GPT", "EncoderClassifier", "Transformer", "ViT"]
