"""Seeing inside a model: attention capture, feature recording, PCA, the plots and the
validation-images callback."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from transformers_lab.analysis.attention import (
    AttentionCapture,
    attention_maps,
    plot_attention,
    plot_attention_maps,
)
from transformers_lab.analysis.features import FeatureRecorder, as_points, pca, plot_pca
from transformers_lab.analysis.plots import (
    figure_to_array,
    plot_kernel_benchmark,
    plot_masks,
    plot_positional_encoding,
    plot_predictions,
    positional_table,
)
from transformers_lab.attention import KERNELS
from transformers_lab.attention.gated.kernel import GatedKernel
from transformers_lab.config import compose_config
from transformers_lab.models import GPT, Transformer, ViT
from transformers_lab.nn.layers import sinusoidal_table
from transformers_lab.run.callbacks.views import ValidationImages
from transformers_lab.run.checkpoints import load_task
from transformers_lab.run.fit import train
from transformers_lab.tasks.examples import Example, patch_labels, token_labels

KERNEL_NAMES = sorted(KERNELS)


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def small_transformer(kernel: str) -> Transformer:
    cross = "softmax" if getattr(KERNELS[kernel], "positional", False) else None  # cosformer
    return Transformer(
        src_vocab_size=13, tgt_vocab_size=11, d_model=16, n_head=2, n_encoder_layers=1,
        n_decoder_layers=1, block_size=16, pad_id=0, dropout=0.0, attention=kernel,
        cross_attention=cross,
    )  # fmt: skip


# ------------------------------------------------------------------ attention capture


def assert_rows_sum_to_one(weights: torch.Tensor) -> None:
    """Each row sums to 1 (every query of these maps sees a key)."""
    sums = weights.sum(-1)
    assert ((sums - 1).abs() < 1e-5).all(), sums


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_captured_gpt_maps_are_causal_distributions_for_every_kernel(kernel):
    model = GPT(vocab_size=20, block_size=16, n_layer=2, n_head=2, d_model=16, attention=kernel)
    x = torch.randint(0, 20, (3, 10))
    with AttentionCapture(model) as capture:
        model(x)
    maps = capture.maps
    assert list(maps) == ["blocks.0.mixer", "blocks.1.mixer"]
    for weights in maps.values():
        assert weights.shape == (3, 2, 10, 10)
        if KERNELS[kernel].normalized:  # sigmoid and relu weigh each key on its own
            assert_rows_sum_to_one(weights)
        if not issubclass(KERNELS[kernel], GatedKernel):  # theirs are signed: q.k unsquashed
            assert (weights >= 0).all()
        assert torch.triu(weights, diagonal=1).abs().max() == 0  # lower-triangular
    assert all(r.causal for r in capture.records)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_captured_encoder_decoder_maps_respect_padding_for_every_kernel(kernel):
    if KERNELS[kernel].causal_only:
        with pytest.raises(ValueError, match="causal only"):
            small_transformer(kernel)
        return
    model = small_transformer(kernel).eval()
    src = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10]])  # 0 = padding
    tgt = torch.tensor([[1, 4, 5, 6], [1, 7, 8, 9]])
    maps = attention_maps(model, src, tgt)
    encoder = maps["encoder.0.mixer"]
    cross = maps["decoder.0.cross"]
    decoder = maps["decoder.0.mixer"]
    assert encoder.shape == (2, 2, 6, 6) and cross.shape == (2, 2, 4, 6)
    assert decoder.shape == (2, 2, 4, 4)
    for weights in (encoder, cross, decoder):
        if KERNELS[kernel].normalized:
            assert_rows_sum_to_one(weights)
        assert (weights >= 0).all() and weights.abs().max() > 0
    assert encoder[0, :, :, 4:].abs().max() == 0 and cross[0, :, :, 4:].abs().max() == 0
    assert torch.triu(decoder, diagonal=1).abs().max() == 0


def test_the_maps_are_the_kernels_own_weights_of_the_layer_inputs():
    model = GPT(vocab_size=20, block_size=16, n_layer=1, n_head=2, d_model=16)
    x = torch.randint(0, 20, (2, 7))
    with AttentionCapture(model) as capture:
        model(x)
    attn = model.blocks[0].mixer
    h = model.blocks[0].norm_mixer(model.embed(x))
    expected = attn.attention_weights(h, causal=True)
    torch.testing.assert_close(capture.maps["blocks.0.mixer"], expected.detach())


def test_no_hook_remains_after_a_capture_even_when_the_forward_fails():
    model = GPT(vocab_size=20, block_size=8, n_layer=2, n_head=2, d_model=16)
    before = hook_count(model)
    with AttentionCapture(model):
        assert hook_count(model) == before + 2
        model(torch.randint(0, 20, (1, 5)))
    assert hook_count(model) == before
    too_long = torch.randint(0, 20, (1, 9))  # longer than block_size
    with pytest.raises(ValueError, match="positions table"), AttentionCapture(model):
        model(too_long)
    assert hook_count(model) == before
    with FeatureRecorder(model, modules=["blocks.0.mlp"]):
        assert hook_count(model) > before
    assert hook_count(model) == before


def test_capture_selects_layers_and_explains_a_bad_selection():
    model = small_transformer("softmax")
    src, tgt = torch.randint(1, 13, (1, 5)), torch.randint(1, 11, (1, 3))
    maps = attention_maps(model, src, tgt, layers=["cross"], max_batch=1)
    assert list(maps) == ["decoder.0.cross"]
    with pytest.raises(ValueError, match=r"no attention layer matches \['nope'\].*encoder.0.mixer"):
        AttentionCapture(model, layers=["nope"])
    with pytest.raises(ValueError, match="has no attention kernel"):
        AttentionCapture(torch.nn.Linear(2, 2))


def test_attention_maps_runs_in_eval_mode_and_restores_the_mode():
    model = GPT(vocab_size=20, block_size=8, n_layer=1, n_head=2, d_model=16, dropout=0.5)
    model.train()
    x = torch.randint(0, 20, (1, 6))
    first, second = attention_maps(model, x), attention_maps(model, x)
    torch.testing.assert_close(first["blocks.0.mixer"], second["blocks.0.mixer"])  # no dropout
    assert model.training


def test_axis_labels_follow_the_layer_kind():
    example = Example((), source=["a", "b", "c"], target=["<s>", "x"])
    assert example.axis_labels("encoder.0.mixer", 3, 3) == (["a", "b", "c"], ["a", "b", "c"])
    assert example.axis_labels("decoder.0.cross", 2, 3) == (["<s>", "x"], ["a", "b", "c"])
    assert example.axis_labels("decoder.1.mixer", 2, 2) == (["<s>", "x"], ["<s>", "x"])
    assert example.axis_labels("decoder.1.mixer", 5, 5) == (None, None)  # sizes disagree
    gpt = Example((), tokens=["t", "o"])
    assert gpt.axis_labels("blocks.0.mixer", 2, 2) == (["t", "o"], ["t", "o"])
    assert token_labels([1, 2, 3]) == ["1", "2", "3"]
    chars = {1: "a", 2: " ", 3: "\n", 4: ""}
    assert token_labels([1, 2, 3, 4], lambda ids: chars[ids[0]]) == ["a", "\u2423", "\\n", "4"]
    assert patch_labels(4, 5) == ["cls", "p0", "p1", "p2", "p3"]


def test_attention_plots_draw_one_panel_per_layer_and_head_with_token_ticks():
    weights = torch.softmax(torch.randn(1, 3, 4, 4), -1)
    fig = plot_attention_maps(
        {"blocks.0.mixer": weights, "blocks.1.mixer": weights},
        Example((), tokens=list("abcd")),
        max_heads=2,
    )
    maps = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert isinstance(fig, Figure) and len(maps) == 4
    assert len(bars) == 4 and all(b.get_ylabel() == "weight" for b in bars)  # each its scale
    ax = maps[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcd")
    np.testing.assert_allclose(ax.images[0].get_array(), weights[0, 0].numpy())
    with pytest.raises(ValueError, match="one \\(Nq, Nk\\) map"):
        plot_attention(weights)
    with pytest.raises(ValueError, match="no attention maps"):
        plot_attention_maps({})


def test_a_long_maps_ticks_are_an_evenly_spaced_subset_of_its_tokens():
    """A language model's example labels its positions with its tokens (the data's
    detokenizer gives the characters); 120 of them do not fit a panel, so every k-th is
    drawn, from the first, and each tick reads the token at its position."""
    from functools import partial

    from transformers_lab.data import CharTokenizer
    from transformers_lab.tasks import LanguageModelTask

    text = ("to be, or not to be, that is the question:\n" * 3)[:120]
    tokenizer = CharTokenizer.from_text(text)
    model = GPT(vocab_size=tokenizer.vocab_size, block_size=128, n_layer=1, n_head=2, d_model=16)
    task = LanguageModelTask(model, partial(torch.optim.Adam, lr=1e-3))
    task.detokenize = tokenizer.decode
    x = torch.tensor([tokenizer.encode(text)])
    example = task.example((x, torch.full_like(x, -100)))
    fig = plot_attention_maps(attention_maps(model, *example.inputs), example, max_heads=1)
    tokens = [{" ": "\u2423", "\n": "\\n"}.get(c, c) for c in text]
    ax = fig.axes[0]
    for ticks, labels in (
        (ax.get_xticks(), ax.get_xticklabels()),
        (ax.get_yticks(), ax.get_yticklabels()),
    ):
        positions = [int(t) for t in ticks]
        assert [label.get_text() for label in labels] == [tokens[i] for i in positions]
        assert positions[0] == 0 and 5 < len(positions) < len(text)
        assert len(set(np.diff(positions))) == 1  # evenly spaced


# ------------------------------------------------------------------ features and PCA


def test_feature_recorder_records_outputs_and_the_attention_inputs_and_output():
    model = GPT(vocab_size=20, block_size=16, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 20, (2, 9))
    with FeatureRecorder(model, modules=[r"blocks\.\d\.mlp", "norm"]) as rec:
        logits = model(x)
    features = rec.features
    assert {"blocks.0.mlp", "blocks.1.mlp", "norm"} <= set(features)
    assert {f"blocks.{i}.mixer.{t}" for i in (0, 1) for t in "qkva"} <= set(features)
    assert features["blocks.0.mixer.q"].shape == (2, 2, 9, 8)
    assert features["norm"].shape == (2, 9, 16)
    torch.testing.assert_close(model.lm_head(features["norm"]), logits.detach())
    # a = the kernel of q, k, v: the attention module's output is its projection
    attn = model.blocks[0].mixer
    q, k, v = (features[f"blocks.0.mixer.{t}"] for t in "qkv")
    torch.testing.assert_close(attn.kernel(q, k, v, causal=True), features["blocks.0.mixer.a"])
    with pytest.raises(ValueError, match="no submodule of GPT is named or matches 'mlp'"):
        FeatureRecorder(model, modules=["mlp"])


def test_pca_finds_the_direction_of_most_variance():
    torch.manual_seed(0)
    t = torch.randn(200, 1)
    direction = torch.tensor([[3.0, 4.0, 0.0]]) / 5
    points = t * 10 * direction + 0.01 * torch.randn(200, 3) + 7.0
    coords, explained = pca(points, k=2)
    assert coords.shape == (200, 2) and explained[0] > 0.999
    # the first coordinate is the position along the line, up to the stable sign
    assert abs(torch.corrcoef(torch.stack([coords[:, 0], t[:, 0]]))[0, 1]) > 0.999
    assert coords[:, 0].mean().abs() < 1e-3  # centred
    assert as_points(torch.zeros(2, 3, 5, 4)).shape == (10, 12)
    with pytest.raises(ValueError, match="at least 2 points"):
        pca(torch.zeros(1, 3))


def test_plot_pca_draws_one_scatter_per_feature():
    features = {"a": torch.randn(2, 10, 8), "b": torch.randn(2, 2, 10, 4)}
    fig = plot_pca(features, color=torch.linspace(0, 1, 20), color_label="position")
    scatters = [ax for ax in fig.axes if ax.collections and ax.get_label() != "<colorbar>"]
    assert len(scatters) == 2 and len(scatters[0].collections[0].get_offsets()) == 20
    assert re.search(r"PC1 \d+%", scatters[0].get_title())
    bar = next(ax for ax in fig.axes if ax.get_label() == "<colorbar>")
    assert bar.get_ylabel() == "position"  # a colour bar says what it shows
    with pytest.raises(ValueError, match="no recorded feature named \\['c'\\]"):
        plot_pca(features, names=["c"])


def test_plot_pca_colours_by_a_label_a_sample_with_a_legend_of_classes():
    """One label an image (3 images of 5 tokens): each token takes its image's class, each
    class its own colour and legend entry; the colours were dropped (all blue) before."""
    features = {"blocks.0": torch.randn(3, 5, 8), "pooled": torch.randn(3, 8)}
    fig = plot_pca(features, color=torch.tensor([7, 2, 7]), color_label="digit")
    ax = fig.axes[0]
    counts = {c.get_label(): len(c.get_offsets()) for c in ax.collections}
    assert counts == {"2": 5, "7": 10}
    assert {c.get_label(): len(c.get_offsets()) for c in fig.axes[1].collections} == {
        "2": 1, "7": 2
    }  # fmt: skip
    legend = fig.legends[0]
    assert legend.get_title().get_text() == "digit"
    assert [t.get_text() for t in legend.get_texts()] == ["2", "7"]
    with pytest.raises(ValueError, match=r"^plot_pca: color has 4 values, but blocks.0 has 15 "):
        plot_pca(features, color=torch.arange(4))


# ------------------------------------------------------------------ plots


def test_positional_encoding_plot_shows_the_models_table():
    torch.testing.assert_close(positional_table("sinusoidal", 50, 16), sinusoidal_table(50, 16))
    torch.testing.assert_close(positional_table("fourier", 50, 16), sinusoidal_table(50, 16))
    fig = plot_positional_encoding("sinusoidal", 50, 16, dims=(0, 1, 4))
    curves = fig.axes[0].get_lines()
    assert len(curves) == 3
    np.testing.assert_allclose(curves[2].get_ydata(), sinusoidal_table(50, 16)[:, 4].numpy())
    with pytest.raises(ValueError, match="no closed form"):
        positional_table("learned", 10, 8)


def test_mask_plot_shows_causal_and_padding_masks():
    fig = plot_masks(length=5, lengths=(5, 3))
    causal = fig.axes[0].images[0].get_array()
    np.testing.assert_array_equal(causal, np.tril(np.ones((5, 5))))
    padded = fig.axes[3].images[0].get_array()  # padding of the 3-token sequence
    np.testing.assert_array_equal(padded, np.repeat([[1, 1, 1, 0, 0]], 5, axis=0))
    with pytest.raises(ValueError, match="in 1..5"):
        plot_masks(length=5, lengths=(6,))


def test_kernel_benchmark_plot_reads_the_benchmark_csv(tmp_path):
    path = tmp_path / "kernels.csv"
    path.write_text(
        "variant,causal,n,time_ms,peak_mib,status\n"
        "softmax,True,256,1.0,2.0,ok\nsoftmax,True,512,3.0,8.0,ok\n"
        "fastmax_p2,True,256,2.0,1.0,ok\nfastmax_p2,True,512,,,oom\n"
    )
    fig = plot_kernel_benchmark(path)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"softmax (causal)", "fastmax_p2 (causal)"}
    np.testing.assert_array_equal(lines["softmax (causal)"].get_ydata(), [1.0, 3.0])
    assert len(lines["fastmax_p2 (causal)"].get_xdata()) == 1  # the oom row is left out


def test_prediction_grid_marks_the_wrong_ones_and_renders_to_pixels():
    images = torch.rand(3, 1, 8, 8)
    fig = plot_predictions(images, targets=[1, 2, 3], predictions=[1, 0, 3])
    titles = [(ax.get_title(), ax.title.get_color()) for ax in fig.axes[:3]]
    assert titles == [("1 (1)", "black"), ("0 (2)", "red"), ("3 (3)", "black")]
    assert fig.get_suptitle() == "predicted (true); red: wrong"  # what "1 (1)" means
    pixels = figure_to_array(fig)
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3


# ------------------------------------------------------------------ the callback

SMALL_VIT = [
    "logger=csv",
    "model.d_model=32",
    "model.n_layer=2",
    "model.n_head=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "test=false",
    "callbacks=inspect",
]


def test_the_callback_writes_images_at_the_configured_cadence(tmp_path):
    cfg = compose_config(
        "train",
        [*SMALL_VIT, "trainer.max_epochs=4", "callbacks.validation_images.every_n_epochs=2"],
        tmp_path / "run",
    )
    train(cfg)
    images = sorted(p.name for p in (tmp_path / "run" / "images").glob("*.png"))
    epochs = sorted({int(re.search(r"epoch(\d+)", n).group(1)) for n in images})
    assert epochs == [1, 3]  # the 2nd and 4th epochs, no sanity-check image
    assert sum(n.startswith("val_attention") for n in images) == 2
    assert sum(n.startswith("val_predictions") for n in images) == 2  # an image classifier
    # the run's checkpoint, loaded back for inspection in Python
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    task, datamodule = load_task(checkpoint)
    assert not task.training
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    for name, value in task.state_dict().items():
        torch.testing.assert_close(value, saved[name])
    example = task.example(next(iter(datamodule.val_dataloader())), index=0)
    maps = attention_maps(task.model, *example.inputs)
    assert len(maps) == 2 and all(w.shape[:2] == (1, 2) for w in maps.values())


def test_the_callback_counts_validations_and_logs_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [
        *SMALL_VIT,
        "logger=tensorboard",
        "trainer.max_epochs=1",
        "trainer.val_check_interval=5",
        "trainer.limit_train_batches=15",
        "callbacks.validation_images.every_n_validations=2",
        "callbacks.validation_images.dirpath=null",
    ]
    train(compose_config("train", overrides, tmp_path / "run"))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"val/attention", "val/predictions"}
    steps = [e.step for e in events.Images("val/attention")]
    assert steps == [10]  # validations at steps 5, 10, 15: the 2nd is drawn
    assert not (tmp_path / "run" / "images").exists()


def test_the_callback_logs_images_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    overrides = [
        *SMALL_VIT,
        "logger=wandb",
        "trainer.max_epochs=1",
        "callbacks.validation_images.dirpath=null",
    ]
    train(compose_config("train", overrides, tmp_path / "run"))
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    media = [p.relative_to(run).as_posix() for p in run.glob("files/media/images/**/*.png")]
    assert any("attention" in p for p in media), media
    assert any("predictions" in p for p in media), media


def test_the_callback_refuses_bad_settings():
    with pytest.raises(ValueError, match="every_n_epochs must be >= 1, got 0"):
        ValidationImages(every_n_epochs=0)
    with pytest.raises(ValueError, match="every_n_validations must be >= 1 or null"):
        ValidationImages(every_n_validations=0)


def test_vit_maps_are_labelled_with_the_class_token_and_patches():
    model = ViT(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=16, n_layer=1,
                n_head=2)  # fmt: skip
    maps = attention_maps(model, torch.rand(1, 1, 8, 8))
    (weights,) = maps.values()
    assert weights.shape == (1, 2, 5, 5)
    assert math.isclose(float(weights.sum()), 2 * 5, rel_tol=1e-5)


# ------------------------------------------------------------------ the tasks' examples


def test_each_task_gives_an_example_whose_labels_fit_every_map():
    from functools import partial

    from transformers_lab.tasks import ClassificationTask, LanguageModelTask, TranslationTask

    adam = partial(torch.optim.Adam, lr=1e-3)
    words = {i: f"w{i}" for i in range(20)}

    def decode(ids):
        return " ".join(words[i] for i in ids if i > 2)  # 0 pad, 1 bos, 2 eos: no text

    lm = LanguageModelTask(GPT(vocab_size=20, block_size=8, n_layer=1, n_head=2, d_model=16), adam)
    lm.detokenize = decode
    x = torch.randint(3, 20, (2, 6))
    y = torch.full((2, 6), -100)
    y[:, -1] = 5
    example = lm.example((x, y), index=1)
    assert example.inputs[0].tolist() == x[1:2].tolist()
    assert example.tokens == [f"w{i}" for i in x[1].tolist()]
    assert example.caption.endswith("1 supervised")

    translator = TranslationTask(small_transformer("softmax").eval(), adam)
    translator.detokenize = decode
    src = torch.tensor([[5, 6, 7, 2, 0, 0], [8, 9, 2, 0, 0, 0]])
    tgt = torch.tensor([[1, 10, 9, 2, 0], [1, 8, 2, 0, 0]])
    example = translator.example((src, tgt), index=0)
    assert [t.tolist() for t in example.inputs] == [[[5, 6, 7, 2]], [[1, 10, 9]]]
    assert example.source == ["w5", "w6", "w7", "2"] and example.target == ["1", "w10", "w9"]
    assert example.caption == "w5 w6 w7 -> w10 w9"
    maps = attention_maps(translator.model, *example.inputs)
    for layer, weights in maps.items():
        queries, keys = example.axis_labels(layer, *weights.shape[-2:])
        assert queries is not None and keys is not None, layer

    vit = ViT(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=16, n_layer=1,
              n_head=2)  # fmt: skip
    classifier = ClassificationTask(vit, adam)
    images = torch.rand(3, 1, 8, 8)
    example = classifier.example((images, torch.tensor([0, 2, 1])), index=1)
    assert example.tokens == ["cls", "p0", "p1", "p2", "p3"] and example.caption.endswith("label 2")
    torch.testing.assert_close(example.image, images[1])
