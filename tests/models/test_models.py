"""The models: shapes, causality, cached decoding, beam search, overfitting, bad input."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import KERNELS, FastmaxAttention
from transformers_lab.attention.testbed import state_numbers
from transformers_lab.models import GPT, EncoderClassifier, Transformer, ViT
from transformers_lab.nn import ACTIVATIONS, POSITIONAL_ENCODINGS, weight_decay_groups

KERNEL_NAMES = sorted(KERNELS)
# the kernels an encoder and a cross-attention take: not those that read tokens in order
BOTH_WAYS = [name for name in KERNEL_NAMES if not KERNELS[name].causal_only]
CAUSAL_ONLY = [name for name in KERNEL_NAMES if KERNELS[name].causal_only]
V = 23


def tiny_gpt(attention="softmax", **kw) -> GPT:
    options = {"n_layer": 2, "n_head": 2, "d_model": 16, "block_size": 24} | kw
    return GPT(V, attention=attention, **options).eval()


def tiny_transformer(attention="softmax", **kw) -> Transformer:
    options = {
        "d_model": 16,
        "n_head": 2,
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "block_size": 20,
        "dropout": 0.0,
    } | kw
    if getattr(KERNELS[attention], "positional", False):  # cosformer: no cross-attention
        options.setdefault("cross_attention", "softmax")
    return Transformer(V, V + 2, attention=attention, **options).eval()


def source_batch() -> torch.Tensor:
    src = torch.randint(3, V, (3, 9))
    src[1, 6:] = 0  # padding (pad_id = 0)
    return src


# ---------------------------------------------------------------- shapes and options


@pytest.mark.parametrize("pos", POSITIONAL_ENCODINGS)
@pytest.mark.parametrize("norm_first", [True, False])
def test_gpt_shapes_with_every_position_kind_and_norm(pos, norm_first):
    model = tiny_gpt(pos_encoding=pos, norm_first=norm_first, bias=False)
    assert model(torch.randint(0, V, (3, 11))).shape == (3, 11, V)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_every_activation_builds_and_runs(act):
    model = ViT(image_size=8, patch_size=4, d_model=16, n_layer=1, n_head=2, act=act)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_vit_and_encoder_shapes_and_pooling():
    images = torch.randn(2, 3, 12, 12)
    for pool in ("cls", "mean"):
        vit = ViT(image_size=12, patch_size=4, in_channels=3, num_classes=5, pool=pool, head="mlp")
        assert vit(images).shape == (2, 5)
    tokens = EncoderClassifier(4, vocab_size=V, pad_id=0, pool="none", d_model=16, n_head=2)
    assert tokens(torch.randint(0, V, (2, 7))).shape == (2, 7, 4)
    patches = EncoderClassifier(4, image_size=12, patch_size=6, in_channels=3, pool="mean")
    assert patches(images).shape == (2, 4)


def test_transformer_shapes():
    model = tiny_transformer()
    assert model(source_batch(), torch.randint(0, V, (3, 5))).shape == (3, 5, V + 2)
    shared = Transformer(
        V, V, d_model=16, n_head=2, n_encoder_layers=1, n_decoder_layers=1, share_embeddings=True
    )
    assert shared.tgt_tok is shared.src_tok and shared.out.weight is shared.tgt_tok.weight


def test_cross_attention_kernel_is_chosen_separately():
    model = tiny_transformer("softmax", cross_attention="fastmax")
    block = model.decoder[0]
    assert block.mixer.kernel.name == "softmax" and block.cross.kernel.name == "fastmax"
    assert model.encoder[0].cross is None and model.encoder[0].mixer.kernel.name == "softmax"


def test_dropout_acts_in_training_only():
    model = tiny_gpt(dropout=0.5)
    idx = torch.randint(0, V, (2, 8))
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


def test_mean_pooling_ignores_padding():
    model = EncoderClassifier(3, vocab_size=V, pad_id=0, pool="mean", d_model=16, n_head=2).eval()
    x = torch.randint(1, V, (1, 6))
    padded = torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded), model(x), rtol=1e-5, atol=1e-6)


def test_sequence_max_fastmax_ignores_padded_tokens():
    """normalize=sequence_max divides by the largest token norm of the sequence: padded
    queries must not count in it, or the padding of a batch would change the logits."""
    kernel = functools.partial(FastmaxAttention, normalize="sequence_max")
    model = EncoderClassifier(
        3, vocab_size=V, pad_id=0, pool="mean", d_model=16, n_head=2, attention=kernel
    ).eval()
    with torch.no_grad():  # a pad embedding with a large norm: it would win the max
        model.embedding.weight[0] = 50.0
    x = torch.randint(1, V, (1, 6))
    padded = torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded), model(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPT


def test_gpt_parameter_count_matches_nanogpt_baby_gpt():
    """nanoGPT's CPU baby GPT (4 layers, 4 heads, 128 wide, block 64, vocab 65, no bias)
    reports 0.80M parameters, position embeddings not counted."""
    model = GPT(65, 64, n_layer=4, n_head=4, d_model=128, bias=False)
    assert model.num_params() == 795_904
    assert f"{model.num_params() / 1e6:.2f}M" == "0.80M"
    assert model.lm_head.weight is model.tok.weight


def test_gpt_init_scales_residual_projections():
    model = GPT(65, 64, n_layer=8, n_head=4, d_model=256)
    proj = model.blocks[0].mixer.out_proj.weight.std().item()
    fc = model.blocks[0].mlp.fc.weight.std().item()
    assert abs(fc - 0.02) < 0.002
    assert abs(proj - 0.02 / 4) < 0.001  # 0.02 / sqrt(2 * 8)


@pytest.mark.parametrize("positions", ["learned", "rope"])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_gpt_is_causal(name, positions):
    model = tiny_gpt(name, pos_encoding=positions)
    idx = torch.randint(0, V, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = torch.randint(0, V, (2, 5))
    torch.testing.assert_close(model(changed)[:, :7], model(idx)[:, :7], rtol=0, atol=1e-6)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi"])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_gpt_cached_decoding_equals_full_forward(name, positions):
    """With RoPE the cache carries the count of tokens seen: the new ones' rotations
    start there; ALiBi's distances follow from the keys in the cache."""
    if positions == "alibi" and not KERNELS[name].forms_scores:
        with pytest.raises(ValueError, match="pos_encoding=alibi adds a bias"):
            tiny_gpt(name, pos_encoding=positions)
        return
    model = tiny_gpt(name, pos_encoding=positions)
    idx = torch.randint(0, V, (2, 15))
    full = model(idx)
    logits, cache = model.forward_cached(idx[:, :6])
    steps = [logits]
    for t in range(6, 15):
        logits, cache = model.forward_cached(idx[:, t : t + 1], cache, offset=t)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    # greedy generation with and without the cache, within block_size (and past it where
    # the positions end there: the window is re-encoded either way; tests/models/
    # test_decoding.py holds the decoding past block_size on the state)
    prompt = idx[:, :5]
    steps = 30 if positions == "learned" else model.block_size - 5
    cached = model.generate(prompt, steps, temperature=0)
    recomputed = model.generate(prompt, steps, temperature=0, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_nucleus_sampling_keeps_the_smallest_set_reaching_p():
    from transformers_lab.models.common import sample_next

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next(probs.log(), top_p=0.75, generator=gen).item() for _ in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.75
    draws = {sample_next(probs.log(), top_p=0.85, generator=gen).item() for _ in range(300)}
    assert draws == {0, 1, 2}
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        sample_next(probs.log(), top_k=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        sample_next(probs.log(), top_p=1.5)


def test_sampling_respects_top_k_and_top_p():
    model = tiny_gpt()
    prompt = torch.randint(0, V, (4, 3))
    logits = model(prompt)[:, -1]
    allowed = logits.topk(3, dim=-1).indices
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        out = model.generate(prompt, 1, temperature=1.0, top_k=3, generator=gen)[:, -1]
        assert (out[:, None] == allowed).any(dim=1).all()
    nucleus = model.generate(prompt, 4, top_p=1e-6, generator=gen)  # only the top token
    assert torch.equal(nucleus, model.generate(prompt, 4, temperature=0))


@pytest.mark.parametrize("name", ["softmax", "linear", "fastmax"])
def test_gpt_state_size_counts_what_the_cache_holds(name):
    model = tiny_gpt(name)
    idx = torch.randint(0, V, (2, 9))
    held = {}
    for n in (3, 9):
        _, cache = model.forward_cached(idx[:, :n])
        held[n] = state_numbers(cache) // 2
        assert model.state_size(n) == held[n]
    assert (held[3] == held[9]) == KERNELS[name].constant_state
    assert model.state_size() == model.state_size(model.block_size)


@pytest.mark.parametrize("name", ["softmax", "linear", "fastmax"])
def test_an_encoders_state_is_what_a_decoder_with_its_kernels_keeps_of_its_context(name):
    """What the sweep summary shows for an encoder: its kernels' state over the whole
    input (a class token included), counted as the decoder's cache would hold it."""
    options = {"n_layer": 2, "n_head": 2, "d_model": 16}
    gpt = GPT(V, attention=name, block_size=13, **options)
    encoder = EncoderClassifier(
        3, vocab_size=V, block_size=12, pool="cls", attention=name, **options
    )
    assert encoder.state_size() == gpt.state_size(13)  # 12 tokens and the class token
    assert (encoder.state_size(4) == encoder.state_size(12)) == KERNELS[name].constant_state


# ---------------------------------------------------------------- encoder-decoder


@pytest.mark.parametrize("name", BOTH_WAYS)
def test_decoder_step_ignores_later_targets_and_padded_source(name):
    model = tiny_transformer(name)
    src, tgt = source_batch(), torch.randint(3, V, (3, 8))
    out = model(src, tgt)
    tgt2 = tgt.clone()
    tgt2[:, 5:] = torch.randint(3, V, (3, 3))
    torch.testing.assert_close(model(src, tgt2)[:, :5], out[:, :5], rtol=0, atol=1e-6)
    # more padding after the source changes nothing (up to float32 summation order)
    longer = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(longer, tgt), out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", BOTH_WAYS)
def test_padded_source_tokens_change_nothing(name):
    model = tiny_transformer(name)
    src, tgt = source_batch(), torch.randint(3, V, (3, 6))
    memory, pad = model.encode(src)
    # the decoder sees the memory only through unpadded keys: scramble the padded rows
    scrambled = memory.clone()
    scrambled[pad] = 100 * torch.randn_like(scrambled[pad])
    torch.testing.assert_close(model.decode(tgt, scrambled, pad), model.decode(tgt, memory, pad))


@pytest.mark.parametrize(
    ("name", "positions"), [("softmax", "sinusoidal"), ("fastmax", "sinusoidal"),
                            ("softmax", "rope"), ("linear", "rope"), ("additive", "alibi")]
)  # fmt: skip
def test_transformer_cached_greedy_equals_full_recompute(name, positions):
    model = tiny_transformer(name, pos_encoding=positions)
    src = source_batch()
    memory, pad = model.encode(src)
    ys = torch.full((3, 1), model.bos_id)
    for _ in range(8):  # greedy by recomputing the whole target every step
        next_id = model._never_emit(model.decode(ys, memory, pad)[:, -1]).argmax(-1)
        ys = torch.cat([ys, next_id[:, None]], dim=1)
    cached = model.greedy(src, max_new_tokens=8)
    eos = (ys[:, 1:] == model.eos_id).cumsum(1) - (ys[:, 1:] == model.eos_id).long() > 0
    expected = ys[:, 1:].masked_fill(eos, model.pad_id)  # padding after EOS
    assert torch.equal(cached, expected[:, : cached.shape[1]])


@pytest.mark.parametrize("name", ["softmax", "fastmax", "cosine"])
def test_beam_search_with_beam_one_equals_greedy(name):
    model = tiny_transformer(name)
    src = source_batch()
    assert torch.equal(
        model.beam_search(src, beam_size=1, max_new_tokens=10), model.greedy(src, 10)
    )
    beams = model.translate(src, max_new_tokens=10, beam_size=4)
    assert beams.shape[0] == 3 and beams.shape[1] <= 10


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_equals_exhaustive_search(alpha):
    """With a beam as wide as every hypothesis, beam search finds the best score / lp."""
    import itertools

    torch.manual_seed(2)
    vt, steps = 6, 3
    model = Transformer(
        10,
        vt,
        d_model=16,
        n_head=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        block_size=8,
        dropout=0.0,
        tie_output=False,
    ).eval()
    with torch.no_grad():
        model.out.weight.normal_(0, 0.5)  # sharper distributions
    src = torch.randint(3, 10, (3, 4))
    src[1, 3] = 0
    memory, pad = model.encode(src)
    words = [t for t in range(vt) if t not in (model.pad_id, model.bos_id)]

    def logprob(b, seq):
        ys = torch.tensor([[model.bos_id, *seq]])
        logits = model._never_emit(model.decode(ys[:, :-1], memory[b : b + 1], pad[b : b + 1])[0])
        return logits.log_softmax(-1)[torch.arange(len(seq)), torch.tensor(seq)].sum().item()

    def hypotheses():
        for length in range(1, steps + 1):
            for seq in itertools.product(words, repeat=length):
                if model.eos_id not in seq[:-1] and (length == steps or seq[-1] == model.eos_id):
                    yield seq

    beams = model.beam_search(
        src, beam_size=len(words) ** steps, max_new_tokens=steps, length_penalty=alpha
    )
    for b in range(3):
        best = max(hypotheses(), key=lambda s: logprob(b, s) / ((5 + len(s)) / 6) ** alpha)
        got = beams[b].tolist()
        got = got[: got.index(model.eos_id) + 1] if model.eos_id in got else got
        assert tuple(got) == best


def test_decoding_never_emits_pad_or_bos():
    model = tiny_transformer()
    with torch.no_grad():  # make PAD and BOS the most likely tokens everywhere
        model.out.weight[model.pad_id] = 5 * model.out.weight[model.eos_id].abs().sum()
        model.out.weight[model.bos_id] = model.out.weight[model.pad_id]
    src = source_batch()
    for out in (model.greedy(src, 6), model.beam_search(src, 3, 6)):
        for row in out.tolist():
            real = row[: row.index(model.eos_id)] if model.eos_id in row else row
            assert model.pad_id not in real and model.bos_id not in real


def test_transformer_init_keeps_the_kernels_own_init():
    cosine = tiny_transformer("cosine")
    torch.testing.assert_close(cosine.encoder[0].mixer.kernel.tau(), torch.full((2, 1, 1), 10.0))
    additive = tiny_transformer("additive")
    assert (additive.decoder[0].cross.kernel.b == 0).all()


# ---------------------------------------------------------------- learning


def fit(model, loss_fn, steps=150, lr=1e-2):
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_model_overfits_one_batch(name):
    torch.manual_seed(0)
    idx = torch.randint(0, V, (4, 12))
    gpt = tiny_gpt(name, d_model=32)
    gpt_loss = fit(
        gpt, lambda: F.cross_entropy(gpt(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    )
    if name in CAUSAL_ONLY:  # a GPT only: the other models attend both ways
        assert gpt_loss < 0.05, gpt_loss
        return

    src, tgt = torch.randint(3, V, (4, 8)), torch.randint(3, V, (4, 8))
    tr = tiny_transformer(name, d_model=32, norm_first=True)
    tr_loss = fit(
        tr, lambda: F.cross_entropy(tr(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten())
    )

    images, labels = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    vit = ViT(image_size=8, patch_size=4, d_model=32, n_layer=2, n_head=2, attention=name)
    vit_loss = fit(vit, lambda: F.cross_entropy(vit(images), labels))

    tokens, classes = torch.randint(1, V, (8, 10)), torch.randint(0, 3, (8,))
    enc = EncoderClassifier(3, vocab_size=V, d_model=32, n_layer=2, n_head=2, attention=name)
    enc_loss = fit(enc, lambda: F.cross_entropy(enc(tokens), classes))

    losses = {"gpt": gpt_loss, "transformer": tr_loss, "vit": vit_loss, "encoder": enc_loss}
    assert max(losses.values()) < 0.05, losses


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_models_that_attend_both_ways_refuse_a_causal_only_kernel(name):
    """A kernel that reads the sequence in order (a decaying state) is refused, in one line
    that names it, by every model with an encoder or a cross-attention."""
    builds = {
        "transformer": lambda: tiny_transformer(name),
        "vit": lambda: ViT(image_size=8, patch_size=4, d_model=16, n_layer=1, n_head=2,
                           attention=name),
        "encoder": lambda: EncoderClassifier(3, vocab_size=V, d_model=16, n_layer=1, n_head=2,
                                             attention=name),
    }  # fmt: skip
    for model, build in builds.items():
        with pytest.raises(ValueError, match=f"attention={name} .*causal only") as caught:
            build()
        assert "\n" not in str(caught.value), model


def test_weight_decay_groups():
    model = GPT(V, 16, n_layer=2, n_head=2, d_model=16)
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decay_ids = {id(p) for p in decay["params"]}
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert not decay_ids & no_decay_ids
    assert decay_ids | no_decay_ids == {id(p) for p in model.parameters()}
    assert id(model.tok.weight) in no_decay_ids  # the tied embedding / LM head
    assert id(model.blocks[0].mixer.qkv_proj.weight) in decay_ids
    assert all(
        p.dim() == 1
        for p in no_decay["params"]
        if p is not model.tok.weight and p is not model.pos.embedding.weight
    )


# ---------------------------------------------------------------- bad input


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        GPT(V, 16, n_head=4, d_model=30)
    model = tiny_gpt()
    with pytest.raises(
        ValueError, match=r"25 tokens is longer than the positions table \(block_size=24\)"
    ):
        model(torch.randint(0, V, (1, 25)))
    with pytest.raises(ValueError, match=r"token id 23 is outside the vocabulary \[0, 23\)"):
        model(torch.tensor([[1, 2, 23]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(torch.tensor([[-1, 2]]))
    vit = ViT(image_size=8, patch_size=4, in_channels=1)
    with pytest.raises(ValueError, match=r"in_channels=1, got \(2, 3, 8, 8\)"):
        vit(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="expected 8x8 images"):
        vit(torch.randn(2, 1, 9, 9))
    with pytest.raises(ValueError, match="image_size=30 does not fit the patch grid"):
        ViT(image_size=30, patch_size=4)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        tiny_gpt(act="swish")
    with pytest.raises(
        ValueError,
        match="unknown positional encoding 'nope'; valid ones are: sinusoidal, learned, fourier, ",
    ):
        tiny_gpt(pos_encoding="nope")
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        Transformer(10, 12, share_embeddings=True)
    with pytest.raises(ValueError, match="either vocab_size"):
        EncoderClassifier(3)
    with pytest.raises(ValueError, match="patch_size=None"):
        EncoderClassifier(3, vocab_size=10, image_size=8)


def test_positional_encodings():
    from transformers_lab.nn import PositionalEncoding, sinusoidal_table

    x = torch.randn(2, 10, 8)
    sinusoidal = PositionalEncoding("sinusoidal", 8, 16)
    torch.testing.assert_close(sinusoidal(x, offset=3), x + sinusoidal_table(16, 8)[3:13])
    # the Fourier features start as the sinusoidal table, with trainable frequencies
    fourier = PositionalEncoding("fourier", 8, 16)
    torch.testing.assert_close(fourier(x), sinusoidal(x), rtol=1e-5, atol=1e-5)
    assert fourier.freqs.requires_grad
    assert torch.equal(PositionalEncoding("none", 8, 16)(x), x)
    learned = PositionalEncoding("learned", 8, 16)
    assert learned(x).shape == x.shape and learned.embedding.weight.requires_grad


def test_positional_encoding_scale_is_a_learned_gain():
    from transformers_lab.nn import PositionalEncoding, sinusoidal_table

    x = torch.zeros(1, 10, 8)
    for kind in ("sinusoidal", "fourier"):
        scaled = PositionalEncoding(kind, 8, 16, scale=0.25)
        torch.testing.assert_close(
            scaled(x)[0], 0.25 * sinusoidal_table(16, 8)[:10], atol=1e-6, rtol=0
        )
        assert scaled.gain.requires_grad
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        PositionalEncoding("sinusoidal", 8, 16, scale=0)


def rms(t: torch.Tensor) -> float:
    return float(t.detach().pow(2).mean().sqrt())


@pytest.mark.parametrize("pos", ["sinusoidal", "fourier"])
@pytest.mark.parametrize("vocab", [65, 5000])
def test_fixed_positions_are_as_large_as_the_token_embeddings_they_are_added_to(pos, vocab):
    """A fixed table 35 times larger than GPT's N(0, 0.02) embeddings drowned them: a GPT
    with sinusoidal positions stayed at the unigram loss (issue 18). In every model the
    positions now start as large as the tokens they are added to (within 25%)."""
    ids = torch.randint(0, vocab, (4, 32))
    gpt = GPT(vocab, 32, n_layer=1, n_head=2, d_model=64, pos_encoding=pos)
    transformer = Transformer(vocab, vocab, block_size=32, d_model=64, n_head=2, pos_encoding=pos)
    encoder = EncoderClassifier(
        3, vocab_size=vocab, block_size=32, d_model=64, n_head=2, pos_encoding=pos
    )
    added = {  # (token vectors, position vectors) as each model sums them
        "gpt": (gpt.tok(ids), gpt.pos.table_rows(32)),
        "transformer": (transformer.src_tok(ids) * 64**0.5, transformer.pos.table_rows(32)),
        "encoder": (encoder.embedding(ids), encoder.pos.table_rows(32)),
    }
    for name, (tokens, positions) in added.items():
        ratio = rms(positions) / rms(tokens)
        assert 0.8 < ratio < 1.25, f"{name}: positions / tokens = {ratio:.3f}"


def test_patch_stride_and_padding_set_the_grid():
    """5x5 patches on 28x28 MNIST: padding 1 gives a 6x6 grid, stride 1 overlapping 24x24."""
    from transformers_lab.nn import PatchEmbedding

    images = torch.randn(2, 1, 28, 28)
    padded = PatchEmbedding(28, 5, 1, 8, stride=5, padding=1)
    assert padded.num_patches == 36 and padded(images).shape == (2, 36, 8)
    # the first patch sees the zero border: the conv over the padded image's corner
    corner = torch.nn.functional.pad(images, (1, 1, 1, 1))[:, :, :5, :5]
    expected = torch.einsum("bchw,dchw->bd", corner, padded.proj.weight) + padded.proj.bias
    torch.testing.assert_close(padded(images)[:, 0], expected)
    overlapping = PatchEmbedding(28, 5, 1, 8, stride=1)
    assert overlapping.num_patches == 24 * 24
    vit = ViT(
        image_size=28,
        patch_size=5,
        patch_stride=5,
        patch_padding=1,
        d_model=15,
        n_head=5,
        n_layer=1,
        mlp_ratio=1.6,
    )
    assert vit(images).shape == (2, 10)
    with pytest.raises(ValueError, match=r"= 23 is not a non-negative multiple of the stride 5"):
        PatchEmbedding(28, 5, 1, 8, stride=5)


def test_mlp_ratio_zero_makes_attention_only_blocks():
    """Zoology's models mix with attention alone (their state mixer is an Identity)."""
    plain, bare = tiny_gpt(), tiny_gpt(mlp_ratio=0)
    assert all(block.mlp is None and block.norm_mlp is None for block in bare.blocks)
    d = 16  # per block: the MLP (d -> 4d -> d, with biases) and its LayerNorm are gone
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * d
    assert plain.num_params() - bare.num_params() == 2 * mlp
    idx = torch.randint(0, V, (2, 8))
    logits, cache = bare.forward_cached(idx[:, :5])
    steps = [logits]
    for t in range(5, 8):
        logits, cache = bare.forward_cached(idx[:, t : t + 1], cache, offset=t)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), bare(idx), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="mlp_ratio must be a number >= 0"):
        tiny_gpt(mlp_ratio=-1)


def test_the_recorded_layer_names_tell_fastmax_p1_from_p2():
    from transformers_lab.models.common import layer_names

    def gpt(attention) -> GPT:
        return GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16,
                   attention=attention, hybrid={1: "sliding_window"})  # fmt: skip

    assert layer_names(gpt("fastmax")) == ["fastmax(p=2)", "sliding_window(window=64)"]
    p1 = functools.partial(FastmaxAttention, p=1)
    assert layer_names(gpt(p1))[0] == "fastmax(p=1)"  # once recorded as "fastmax" alone


def grads_of(build, inputs, loss_of, checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build(activation_checkpointing=checkpointing).train()
    torch.manual_seed(1)  # the same dropout masks, drawn again in the recomputation
    loss = loss_of(model, *inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gpt", "vit", "transformer"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(name):
    """Each block recomputed in the backward pass, dropout on: what is kept changes, the
    loss and every gradient do not; a block that recomputes keeps only its input."""
    builds = {
        "gpt": (lambda **o: GPT(40, 16, n_layer=2, n_head=2, d_model=16, dropout=0.2, **o),
                (torch.randint(0, 40, (2, 16)),), lambda m, x: m(x).square().mean()),
        "vit": (lambda **o: ViT(image_size=8, patch_size=4, d_model=16, n_head=2,
                                dropout=0.2, **o),
                (torch.randn(2, 1, 8, 8),), lambda m, x: m(x).square().mean()),
        "transformer": (lambda **o: Transformer(30, 30, d_model=16, n_head=2, n_encoder_layers=1,
                                                n_decoder_layers=2, dropout=0.2, **o),
                        (torch.randint(3, 30, (2, 7)), torch.randint(3, 30, (2, 5))),
                        lambda m, s, t: m(s, t).square().mean()),
    }  # fmt: skip
    build, inputs, loss_of = builds[name]
    plain_loss, plain = grads_of(build, inputs, loss_of, False)
    loss, grads = grads_of(build, inputs, loss_of, True)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    for key, grad in plain.items():
        assert torch.allclose(grads[key], grad, atol=1e-6), key
    blocks = [m for m in build(activation_checkpointing=True).modules() if hasattr(m, "recompute")]
    assert blocks and all(b.recompute for b in blocks)
    with pytest.raises(TypeError, match="activation_checkpointing must be true or false"):
        build(activation_checkpointing="yes")
