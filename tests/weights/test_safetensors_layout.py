"""Issue 10 items 3 and 4: safetensors files are validated exactly as the format requires (offsets ordered,
contiguous, no overlap, no gap, covering the data section; metadata a string map), and every malformed file
rejected here is also rejected by ``safetensors.safe_open``; index entries must be plain file names inside the
model folder (never opened otherwise)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ascend_dsv4 import LLM
from ascend_dsv4.models import preset
from ascend_dsv4.errors import CheckpointError
from quant.safetensors_io import find_shards, index_weight_map, is_plain_file_name, read_header
from ascend_dsv4.weights.random_checkpoint import write_checkpoint

_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64",
       torch.float8_e8m0fnu: "F8_E8M0", torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32",
       torch.float16: "F16"}


def _raw(path, entries, data: bytes, metadata=None, pad: bytes = b""):
    """Write a safetensors file by hand: entries = [(name, dtype, shape, begin, end)]."""
    hdr = {n: {"dtype": d, "shape": list(s), "data_offsets": [b, e]} for n, d, s, b, e in entries}
    if metadata is not None:
        hdr["__metadata__"] = metadata
    h = json.dumps(hdr).encode() + pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _f32(n, b, e):
    return (n, "F32", [(e - b) // 4], b, e)


def _library_rejects(path) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:  # noqa: BLE001 - SafetensorError and friends
        return True
    return False


MALFORMED = {
    "same range": ([_f32("a", 0, 8), _f32("b", 0, 8)], 8, "tensor 'b' data_offsets [0, 8] overlaps tensor 'a'"),
    "partial overlap": ([_f32("a", 0, 8), _f32("b", 4, 12)], 12, "tensor 'b' data_offsets [4, 12] overlaps"),
    "contained": ([_f32("a", 0, 16), _f32("b", 4, 8)], 16, "overlaps tensor 'a' [0, 16]"),
    "gap": ([_f32("a", 0, 8), _f32("b", 12, 20)], 20, "gap of 4 bytes after tensor 'a'"),
    "gap at start": ([_f32("a", 4, 12)], 12, "gap of 4 bytes after the start of the data section"),
    "uncovered tail": ([_f32("a", 0, 8)], 12, "4 bytes after tensor 'a' belong to no tensor"),
    "data without tensors": ([], 4, "4 bytes and the header lists no tensor"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_layout_rejected_here_and_by_the_library(tmp_path, case):
    entries, size, msg = MALFORMED[case]
    p = str(tmp_path / "x.safetensors")
    _raw(p, entries, bytes(size))
    with pytest.raises(CheckpointError, match="corrupt header") as e:
        read_header(p)
    assert msg in str(e.value) and p in str(e.value)
    assert _library_rejects(p), f"safetensors accepts the {case!r} file: this validation would be stricter"


def test_non_string_metadata_rejected_here_and_by_the_library(tmp_path):
    p = str(tmp_path / "m.safetensors")
    _raw(p, [_f32("a", 0, 8)], bytes(8), metadata={"format": "pt", "n": 1})
    with pytest.raises(CheckpointError, match="__metadata__ entry 'n' is not a string"):
        read_header(p)
    assert _library_rejects(p)


@pytest.mark.parametrize("entries,size,pad", [
    ([_f32("a", 0, 8), _f32("b", 8, 16)], 16, b""),
    ([_f32("b", 8, 16), _f32("a", 0, 8)], 16, b""),  # header order need not be offset order
    ([("z", "F32", [0], 0, 0), _f32("a", 0, 8), ("y", "F32", [0], 8, 8), _f32("b", 8, 16)], 16, b""),  # empty
    ([], 0, b""),
    ([_f32("a", 0, 8)], 8, b"    "),  # header padded with spaces (alignment), as the library writes
])
def test_valid_layouts_accepted_here_and_by_the_library(tmp_path, entries, size, pad):
    p = str(tmp_path / "ok.safetensors")
    _raw(p, entries, bytes(size), pad=pad)
    h = read_header(p)
    assert sorted(h.tensors) == sorted(n for n, *_ in entries)
    assert not _library_rejects(p)


# ---- a real checkpoint whose shard has two tensors sharing bytes is refused before any data is read ----------
@pytest.fixture(scope="module")
def official(tmp_path_factory):
    d = tmp_path_factory.mktemp("official")
    cfg = preset("toy-v4").replace(index_topk=128, vocab_size=512, n_routed_experts=8)
    write_checkpoint(cfg, str(d), "official", seed=5, shard_bytes=2 << 20, progress=False)
    return str(d)


def _rewrite_with_shared_bytes(path, a: str, b: str, partial: bool) -> None:
    """Rewrite shard ``path`` so that tensor ``b`` reads (all or half of) tensor ``a``'s bytes."""
    h = read_header(path)
    ts = load_file(path)
    entries, chunks, pos = [], [], 0
    for name in h.tensors:  # file order
        if name == b:
            continue
        t = ts[name]
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        entries.append((name, h.tensors[name].dtype_str, list(t.shape), pos, pos + len(raw)))
        if name == a:
            a_begin, a_len = pos, len(raw)
        chunks.append(raw)
        pos += len(raw)
    nb = h.tensors[b].nbytes
    start = a_begin + (a_len // 2 if partial else 0)  # partial: b begins inside a
    entries.append((b, h.tensors[b].dtype_str, list(h.tensors[b].shape), start, start + nb))
    _raw(path, entries, b"".join(chunks), metadata=h.metadata or None)


@pytest.mark.parametrize("partial", [False, True])
def test_checkpoint_with_overlapping_tensors_does_not_load(official, tmp_path, partial):
    import shutil

    d = str(tmp_path / "ck")
    shutil.copytree(official, d)
    wm = index_weight_map(d)
    a, b = "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight"
    assert wm[a] == wm[b]
    shard = os.path.join(d, wm[a])
    _rewrite_with_shared_bytes(shard, a, b, partial)
    assert _library_rejects(shard)
    with pytest.raises(CheckpointError, match="overlaps") as e:
        LLM(model=d, device="cpu", progress=False)
    assert b in str(e.value) and wm[a] in str(e.value)


# ---- item 4: index entries are plain file names inside the folder ----------------------------------------------
@pytest.mark.parametrize("entry", ["/etc/passwd", "../../../x.safetensors", "../x.safetensors", "sub/x.safetensors",
                                   "..", ".", "x\\..\\y.safetensors", "C:x.safetensors", "a\0b.safetensors"])
def test_index_entry_outside_the_folder_is_refused_unopened(tmp_path, monkeypatch, entry):
    d = tmp_path / "m"
    d.mkdir()
    _raw(str(d / "model-00001-of-00001.safetensors"), [_f32("a", 0, 8)], bytes(8))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "evil.weight": entry}}))
    opened = []
    real_open = open

    def spy(f, *a, **k):
        opened.append(str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(CheckpointError) as e:
        find_shards(str(d))
    monkeypatch.undo()
    assert "'evil.weight'" in str(e.value) and repr(entry) in str(e.value) and "not a plain file name" in str(e.value)
    assert all(os.path.basename(p) != os.path.basename(entry) or p.endswith("index.json") for p in opened
               if entry not in ("..", ".")), opened
    assert not any("passwd" in p for p in opened)


def test_plain_file_names():
    for ok in ("model-00001-of-00002.safetensors", "x.safetensors", "..x.safetensors", "a b.safetensors"):
        assert is_plain_file_name(ok), ok
    for bad in ("", ".", "..", "/x", "a/b", "a\\b", "C:\\x", "x\0"):
        assert not is_plain_file_name(bad), bad


def test_msmodelslim_index_entry_outside_the_folder_is_refused(tmp_path):
    from quant.errors import QuantFormatError
    from quant.msmodelslim.weights import find_weight_files

    _raw(str(tmp_path / "quant_model_weight_w8a8_dynamic.safetensors"), [_f32("a", 0, 8)], bytes(8))
    (tmp_path / "quant_model_weight_w8a8_dynamic.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "quant_model_weight_w8a8_dynamic.safetensors", "b": "../../etc/passwd"}}))
    with pytest.raises(QuantFormatError, match="not a plain file name"):
        find_weight_files(str(tmp_path))
