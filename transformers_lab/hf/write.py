"""The folder ``tlab-export`` writes: safetensors weights, ``config.json`` (the model's
recipe), ``generation_config.json``, the tokenizer and ``modeling_tlab.py``, the code that
``from_pretrained(..., trust_remote_code=True)`` runs, which imports ours."""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from transformers_lab.data.corpus.tokenizer import CorpusTokenizer
from transformers_lab.errors import ConfigError
from transformers_lab.hf.model import TlabConfig, TlabForCausalLM
from transformers_lab.hf.tokenizer import TlabTokenizer, end_of_text, write_tokenizer_state
from transformers_lab.models.gpt import GPT

CODE = "modeling_tlab.py"
REMOTE_CODE = '''"""A GPT of transformers_lab, exported by tlab-export: the classes that load it.
It is rebuilt by transformers_lab's own code (pip install transformers_lab)."""

from transformers_lab.hf.model import TlabConfig, TlabForCausalLM
from transformers_lab.hf.tokenizer import TlabTokenizer

__all__ = ["TlabConfig", "TlabForCausalLM", "TlabTokenizer"]
'''
AUTO_MAP = {
    "AutoConfig": "modeling_tlab.TlabConfig",
    "AutoModelForCausalLM": "modeling_tlab.TlabForCausalLM",
}
TOKENIZER_MAP = {"AutoTokenizer": ["modeling_tlab.TlabTokenizer", None]}


def tied_names(model: GPT) -> dict[str, str]:
    """{name: the name it shares its tensor with}: the LM head tied to the embedding."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return {other: group[0] for group in names.values() for other in group[1:]}


def check_out(out: Path) -> None:
    """Refuse a folder that holds something: an export never writes over one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"out={out} exists and is not empty; give a new folder (or remove that one): "
            "an export never writes over files"
        )


def export(
    model: GPT,
    recipe: dict[str, Any],
    tokenizer: CorpusTokenizer,
    prefix: int,
    out: Path,
    version: str = "",
) -> Path:
    """Write ``model`` (built from ``recipe``: its Hydra config with sizes) and
    ``tokenizer`` to the new folder ``out``, whole or not at all (written beside it, then
    moved in); ``prefix``: the token a text with no context is read after."""
    out = Path(out)
    check_out(out)
    eot = tokenizer.eot_id  # generate stops there; a tokenizer without one goes on
    config = TlabConfig(
        tlab_model=recipe,
        vocab_size=model.lm_head.out_features,
        max_position_embeddings=model.block_size,
        tied=tied_names(model),
        tlab_version=version,
        tlab_prefix_token_id=prefix,
        tlab_end_of_text=None if eot is not None else end_of_text(tokenizer),
        eos_token_id=eot,
        auto_map=AUTO_MAP,
        architectures=["TlabForCausalLM"],
    )
    hf = TlabForCausalLM(config)
    hf.gpt.load_state_dict(model.state_dict())
    hf.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf.generation_config.eos_token_id = eot
        hf.generation_config.pad_token_id = eot
        hf.save_pretrained(staging)
        state = staging / "tlab_tokenizer.json"
        write_tokenizer_state(tokenizer, state)
        TlabTokenizer(state_file=str(state), auto_map=TOKENIZER_MAP).save_pretrained(staging)
        (staging / CODE).write_text(REMOTE_CODE)
        if out.exists():
            out.rmdir()  # empty (check_out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
