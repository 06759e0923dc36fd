"""Unit tests of lab 6's workload: ddp_course.models.CharTransformer and the standard-library text corpus."""

import math

import pytest
import torch
import torch.nn.functional as F

from ddp_course import data
from ddp_course.cli import CourseError
from ddp_course.models import CharTransformer


def small_model(**shape) -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(data.TEXT_VOCAB_SIZE, **{"context": 16, "d_model": 32, "n_layers": 2, "n_heads": 4, **shape})


# ---- the model --------------------------------------------------------------------------------


def test_default_size_and_tensor_count():
    """The numbers lab 6's docstring and sheet quote: 0.81 M parameters in 52 tensors (12 per block + 4)."""
    model = CharTransformer(data.TEXT_VOCAB_SIZE)
    parameters = list(model.parameters())
    assert len(parameters) == 12 * 4 + 4
    assert sum(p.numel() for p in parameters) == 813_952
    assert len({p.numel() for p in parameters}) >= 6  # tensors of many different sizes for the buckets


def test_tied_weights_are_one_parameter_with_one_storage():
    model = small_model()
    assert model.head.weight is model.token_embedding.weight
    assert model.head.weight.data_ptr() == model.token_embedding.weight.data_ptr()
    names = [name for name, _ in model.named_parameters()]
    assert "token_embedding.weight" in names and "head.weight" not in names  # listed once: averaged once by DDP
    with torch.no_grad():
        model.token_embedding.weight[0, 0] = 123.0
    assert model.head.weight[0, 0] == 123.0


def test_tied_gradient_is_the_sum_of_both_uses():
    """Untie a copy of the model: the tied weight's gradient is embedding gradient + output-layer gradient."""
    tied = small_model()
    untied = small_model()
    untied.head.weight = torch.nn.Parameter(untied.token_embedding.weight.detach().clone())
    tokens = torch.randint(0, data.TEXT_VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(1))
    for model in (tied, untied):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, dims=1).flatten()).backward()
    expected = untied.token_embedding.weight.grad + untied.head.weight.grad
    torch.testing.assert_close(tied.token_embedding.weight.grad, expected)
    assert untied.head.weight.grad.abs().sum() > 0 and untied.token_embedding.weight.grad.abs().sum() > 0


def test_attention_is_causal():
    """Changing the last characters must leave the logits of every earlier position unchanged."""
    model = small_model()
    tokens = torch.randint(1, data.TEXT_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % data.TEXT_VOCAB_SIZE
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12])
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_output_shape_deterministic_forward_and_context_limit():
    model = small_model()
    tokens = torch.randint(0, data.TEXT_VOCAB_SIZE, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, data.TEXT_VOCAB_SIZE)
    assert torch.equal(logits, model(tokens))  # training mode, no dropout: the same output every call
    assert not any(isinstance(m, (torch.nn.Dropout, torch.nn.BatchNorm1d)) for m in model.modules())
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_heads"):
        small_model(d_model=30)


def test_loss_at_initialization_is_near_uniform():
    """Small initial logits (std 0.02 embeddings): the first loss is close to ln(vocabulary size)."""
    model = small_model()
    tokens = torch.randint(0, data.TEXT_VOCAB_SIZE, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(data.TEXT_VOCAB_SIZE)) < 0.2


# ---- the text ---------------------------------------------------------------------------------


def test_vocabulary_is_fixed_and_unknown_characters_map_to_id_0():
    assert data.TEXT_VOCAB_SIZE == 97 and data.UNKNOWN_ID == 0
    assert len(set(data.TEXT_CHARACTERS)) == len(data.TEXT_CHARACTERS) == 96
    text = "def f(x):\n    return x ~ 1  # ok"
    ids = data.encode_text(text)
    assert ids.dtype == torch.long and ids.min() >= 1 and ids.max() < data.TEXT_VOCAB_SIZE
    assert data.decode_text(ids) == text
    assert data.encode_text("é\tA").tolist() == [0, 0, data.encode_text("A").item()]
    assert data.decode_text([0]) == "\ufffd"


def test_stdlib_text_is_deterministic_capped_and_mostly_known_characters():
    first = data.load_stdlib_text(max_chars=200_000)
    assert first == data.load_stdlib_text(max_chars=200_000)
    assert len(first) == 200_000
    assert data.load_stdlib_text(max_chars=1_000).startswith(first[:1_000])
    unknown = (data.encode_text(first) == data.UNKNOWN_ID).float().mean()
    assert unknown < 0.01  # Python source is ASCII almost everywhere


def test_stdlib_files_are_public_modules_in_sorted_order():
    files = data.stdlib_source_files()
    assert files == sorted(files) and len(files) > 50
    assert all(path.suffix == ".py" and not path.name.startswith("_") for path in files)


def test_text_from_a_given_folder(tmp_path):
    (tmp_path / "b.py").write_text("bbbb")
    (tmp_path / "a.py").write_text("aaa")
    (tmp_path / "_private.py").write_text("never")
    (tmp_path / "notes.txt").write_text("never")
    assert [p.name for p in data.stdlib_source_files(tmp_path)] == ["a.py", "b.py"]
    assert data.load_stdlib_text(max_chars=5, stdlib_dir=tmp_path) == "aaabb"
    assert data.load_stdlib_text(max_chars=100, stdlib_dir=tmp_path) == "aaabbbb"
    with pytest.raises(CourseError, match="no Python source files"):
        data.stdlib_source_files(tmp_path / "empty_or_missing")


def test_splits_and_windows():
    tokens = torch.arange(1000)
    train, held_out = data.text_splits(tokens, held_out_fraction=0.1)
    assert torch.equal(train, tokens[:900]) and torch.equal(held_out, tokens[900:])
    inputs, targets = data.sample_windows(train, 6, 32, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (6, 32)
    assert torch.equal(targets[:, :-1], inputs[:, 1:])  # the target is the next character
    assert torch.equal(inputs, data.sample_windows(train, 6, 32, torch.Generator().manual_seed(0))[0])
    assert int(targets.max()) < 900  # windows stay inside the training part
    with pytest.raises(CourseError, match="too few"):
        data.sample_windows(tokens[:10], 1, 32, torch.Generator())
