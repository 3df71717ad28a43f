"""Finding and lazily reading msModelSlim weight files (single, sharded + index, v0 names, fallbacks)."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from quant.errors import QuantFormatError
from quant.msmodelslim.weights import WeightStore, find_weight_files

T = {"a.weight": torch.arange(6, dtype=torch.int8).reshape(2, 3), "a.deq_scale": torch.tensor([1, 2]),
     "b.weight": torch.ones(4), "c.bias": torch.zeros(2)}


def _save(folder, name, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, name))


def test_v0_single_file(tmp_path):
    _save(tmp_path, "quant_model_weight_w8a8.safetensors", T)
    with WeightStore(str(tmp_path)) as s:
        assert sorted(s.keys()) == sorted(T)
        assert s.index_path is None
        assert torch.equal(s.get("a.weight"), T["a.weight"])
        assert s.info("a.deq_scale").torch_dtype == torch.int64


def test_v1_sharded_with_index_is_lazy(tmp_path, monkeypatch):
    wm = {}
    keys = list(T)
    for i in range(2):
        fn = f"quant_model_weights-{i + 1:05d}-of-00002.safetensors"
        part = {k: T[k] for k in keys[i::2]}
        _save(tmp_path, fn, part)
        wm.update({k: fn for k in part})
    (tmp_path / "quant_model_weights.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    # a stale copy of the source model's index must not be followed
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00009.safetensors"}}))

    import quant.safetensors_io as sio

    reads = []
    orig = sio.ShardReader.get
    monkeypatch.setattr(sio.ShardReader, "get", lambda self, name: reads.append(name) or orig(self, name))
    s = WeightStore(str(tmp_path))
    assert os.path.basename(s.index_path) == "quant_model_weights.safetensors.index.json"
    assert len(s.files) == 2 and sorted(s.keys()) == sorted(T)
    assert s.info("b.weight").shape == (4,) and reads == []  # headers only so far
    assert torch.equal(s.get("c.bias"), T["c.bias"]) and reads == ["c.bias"]
    assert sorted(s.load_all()) == sorted(T)
    s.close()


def test_index_disagreement_and_missing_shard(tmp_path):
    _save(tmp_path, "quant_model_weights-00001-of-00001.safetensors", T)
    idx = tmp_path / "quant_model_weights.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"a.weight": "quant_model_weights-00001-of-00001.safetensors",
                                              "zzz": "quant_model_weights-00001-of-00001.safetensors"}}))
    with pytest.raises(QuantFormatError, match="zzz"):
        WeightStore(str(tmp_path))
    idx.write_text(json.dumps({"weight_map": {"a.weight": "quant_model_weights-00002-of-00002.safetensors"}}))
    with pytest.raises(QuantFormatError, match="do not exist"):
        find_weight_files(str(tmp_path))


def test_incomplete_numbered_set_without_index(tmp_path):
    _save(tmp_path, "quant_model_weights-00001-of-00002.safetensors", T)
    with pytest.raises(QuantFormatError, match="incomplete"):
        find_weight_files(str(tmp_path))


def test_fallback_to_any_safetensors(tmp_path):
    _save(tmp_path, "model.safetensors", T)
    files, index, _ = find_weight_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["model.safetensors"] and index is None


def test_duplicate_tensor_across_files(tmp_path):
    _save(tmp_path, "quant_model_weight_w8a8.safetensors", T)
    _save(tmp_path, "quant_model_weight_w8a16.safetensors", {"a.weight": T["a.weight"]})
    with pytest.raises(QuantFormatError, match="a.weight"):
        WeightStore(str(tmp_path))


def test_no_weights(tmp_path):
    with pytest.raises(QuantFormatError, match="quant_model_weight"):
        find_weight_files(str(tmp_path))
    with pytest.raises(QuantFormatError, match="does not exist"):
        find_weight_files(str(tmp_path / "nope"))
