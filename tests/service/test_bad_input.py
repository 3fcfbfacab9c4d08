"""Every mistake a user can make gets an error that names it, never an index error."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import unimax
from helpers import write_qwen_checkpoint
from unimax import CheckpointError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    write_qwen_checkpoint(path, seed=0, tie=False)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return unimax.load_model(checkpoint, device="cpu", dtype="float32")


def copy_checkpoint(src, dst, edit_config=None, edit_weights=None):
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    if edit_weights:
        edit_weights(weights)
    save_file(weights, dst / "model.safetensors")
    return dst


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="model path ./no/such/model does not exist"):
        unimax.load_model("./no/such/model")


def test_hub_id_that_cannot_be_fetched(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="nobody-here/no-such-gdn is not a local folder"):
        unimax.load_model("nobody-here/no-such-gdn")


def test_unknown_model_type(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path / "m",
                           lambda c: c.update(model_type="mamba2"))
    with pytest.raises(CheckpointError, match="unknown model_type 'mamba2'"):
        unimax.load_model(path)


def test_layer_types_checked(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path / "m", lambda c: c.update(
        layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(CheckpointError, match="tensor model.layers.1.self_attn.q_proj.weight is "
                                              "missing"):
        unimax.load_model(path)
    path = copy_checkpoint(checkpoint, tmp_path / "n", lambda c: c.update(
        layer_types=["linear_attention", "sliding_attention"]))
    with pytest.raises(CheckpointError, match="unknown layer type 'sliding_attention'"):
        unimax.load_model(path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.1.linear_attn.in_proj_z.weight"
    path = copy_checkpoint(checkpoint, tmp_path / "m", edit_weights=lambda w: w.pop(name))
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        unimax.load_model(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"

    def shrink(weights):
        weights[name] = weights[name][:, :10].contiguous()

    path = copy_checkpoint(checkpoint, tmp_path / "m", edit_weights=shrink)
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \(64, 10\), expected"):
        unimax.load_model(path)


def test_untied_checkpoint_without_lm_head(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path / "m", edit_weights=lambda w: w.pop(
        "lm_head.weight"))
    with pytest.raises(CheckpointError, match="tensor lm_head.weight is missing"):
        unimax.load_model(path)


def test_folder_without_weights(tmp_path, checkpoint):
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        unimax.load_model(tmp_path)


def test_cuda_without_cuda(checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        unimax.load_model(checkpoint, device="cuda")


def test_unknown_dtype(checkpoint):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        unimax.load_model(checkpoint, dtype="float8")


def test_token_id_outside_vocabulary(model):
    ids = torch.tensor([[3, 5, 97, 2]])
    with pytest.raises(ValueError, match="token id 97 at position 2 .*outside the vocabulary"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="token id -1"):
        model(input_ids=torch.tensor([[-1]]))
    cache = model.make_recurrent_cache()
    with pytest.raises(ValueError, match="token id 500"):
        model.greedy_step(torch.tensor([[500]]), cache)
    assert cache.seen_tokens == 0  # nothing half-applied


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="empty prompt"):
        model(input_ids=torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        unimax.exact_greedy_tokens(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_wrong_id_types_and_shapes(model):
    with pytest.raises(TypeError, match="integer token ids"):
        model(input_ids=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"shape \(batch, tokens\)"):
        model(input_ids=torch.ones(3, dtype=torch.long))


def test_cache_of_another_batch_size(model):
    cache = model.make_recurrent_cache(batch_size=2)
    with pytest.raises(ValueError, match="made for batch size 2 but input_ids has batch size 1"):
        model(input_ids=torch.tensor([[1, 2]]), past_key_values=cache)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        model.make_recurrent_cache(batch_size=0)


def test_compile_step_off_cuda_warns_and_decodes_plainly(model):
    """compile_step is a CUDA option: on the CPU it is named in a warning and ignored."""
    ids = torch.randint(0, model.config.vocab_size, (1, 9),
                        generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="compile_step is for CUDA"):
        engine = unimax.build_engine(model, compile_step=True)
    assert engine.decode_model is model
    assert torch.equal(engine.generate_fast(ids, 6), unimax.exact_greedy_tokens(model, ids, 6))


def test_compile_step_without_triton_is_named(monkeypatch):
    import importlib.util

    from unimax.fast_step import fast_step_unavailable

    assert "on cpu" in fast_step_unavailable(torch.device("cpu"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    assert "needs Triton" in fast_step_unavailable(torch.device("cuda"))
