"""A damaged checkpoint folder gives an error that names the file and what is wrong with it, before any
tensor is read: a config.json or index that is not JSON, a safetensors header that is not."""

import json
import struct

import pytest

from tileweave.models import from_pretrained
from tileweave.models.safetensors import Checkpoint, SafetensorsFile


def _safetensors(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_a_config_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')  # cut short
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON .*line 1"):
        from_pretrained(tmp_path, group=None)


def test_a_config_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        from_pretrained(tmp_path, group=None)


@pytest.mark.parametrize("header", [b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]', b"\xff\xfe{}"])
def test_a_corrupted_header_is_named(tmp_path, header):
    path = tmp_path / "model.safetensors"
    _safetensors(path, header, b"\0" * 8)
    with pytest.raises(ValueError, match=r"model\.safetensors: the safetensors header is not (valid JSON|UTF-8)"):
        SafetensorsFile(path)


def test_an_index_that_is_not_json_or_has_no_weight_map_is_named(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        Checkpoint(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: no \"weight_map\""):
        Checkpoint(tmp_path)


def test_bfloat16_on_the_cpu_is_refused_before_loading_or_widened_by_default(tmp_path):
    import torch

    from tileweave.models import model_dtype

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                                      "intermediate_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "max_position_embeddings": 64, "torch_dtype": "bfloat16"}))
    # No safetensors in the folder: the refusal comes before any file is opened.
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 on the CPU"):
        from_pretrained(tmp_path, group=None, dtype=torch.bfloat16, device="cpu")
    hf = {"torch_dtype": "bfloat16"}
    assert model_dtype(None, hf, torch.device("cpu")) == torch.float32
    assert model_dtype(None, hf, torch.device("cuda", 0)) == torch.bfloat16
    assert model_dtype(torch.float16, hf, torch.device("cpu")) == torch.float16
