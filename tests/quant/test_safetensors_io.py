"""Shard discovery, header parsing, streaming and the error for each kind of broken checkpoint."""

import json
import logging
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from ascend_dsv4.errors import CheckpointError
from quant import safetensors_io as sio
from quant.safetensors_io import (
    ShardReader,
    checkpoint_inventory,
    find_shards,
    index_weight_map,
    read_header,
    sequential_read_throughput,
    stream_tensors,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(8, 6, generator=g),
        "b.bf16": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "c.fp8": torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn),
        "d.scale": torch.rand(2, 4, generator=g).to(torch.float8_e8m0fnu),
        "e.int8": torch.randint(-128, 127, (3, 7), generator=g, dtype=torch.int8),
        "f.i64": torch.arange(5, dtype=torch.int64),
        "g.scalar": torch.tensor(3.5, dtype=torch.float32),
        "h.f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "i.u8": torch.arange(10, dtype=torch.uint8),
        "j.bool": torch.tensor([True, False, True]),
        "k.i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


def _same(x, y):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x, y.view(torch.uint8) if y.element_size() == 1 else y)


def _two_shards(folder, with_index=True):
    t = _tensors()
    names = list(t)
    s1 = {k: t[k] for k in names[:5]}
    s2 = {k: t[k] for k in names[5:]}
    f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file(s1, os.path.join(folder, f1), metadata={"format": "pt"})
    save_file(s2, os.path.join(folder, f2))
    if with_index:
        wm = {**{k: f1 for k in s1}, **{k: f2 for k in s2}}
        _write_index(folder, {"metadata": {"total_size": 0}, "weight_map": wm})
    return t, f1, f2


def _write_index(folder, obj):
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(obj, f)


def _raw_shard(path, header, data=b""):
    """Write a safetensors file by hand: header (dict or bytes) and the data section."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _rewrite_header(path, edit):
    """Hand-edit the JSON header of an existing file, keeping its data section."""
    with open(path, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8 : 8 + n])
    edit(header)
    _raw_shard(path, header, b[8 + n :])


# ---------------------------------------------------------------------------------------------- headers


def test_read_header_dtypes_shapes_offsets(tmp_path):
    t = _tensors()
    p = str(tmp_path / "m.safetensors")
    save_file(t, p, metadata={"format": "pt", "who": "test"})
    h = read_header(p)
    assert h.path == p and h.file_size == os.path.getsize(p)
    assert h.metadata == {"format": "pt", "who": "test"}
    assert set(h.tensors) == set(t)
    for name, x in t.items():
        info = h.tensors[name]
        assert info.name == name
        assert info.torch_dtype == x.dtype
        assert info.shape == tuple(x.shape)
        assert info.nbytes == x.numel() * x.element_size() == info.end - info.begin
    assert h.tensors["c.fp8"].dtype_str == "F8_E4M3" and h.tensors["c.fp8"].torch_dtype == torch.float8_e4m3fn
    assert h.tensors["d.scale"].dtype_str == "F8_E8M0" and h.tensors["d.scale"].torch_dtype == torch.float8_e8m0fnu
    assert h.tensors["b.bf16"].dtype_str == "BF16" and h.tensors["b.bf16"].nbytes == 4 * 5 * 2
    assert h.tensors["g.scalar"].shape == () and h.tensors["g.scalar"].nbytes == 4
    # file order, contiguous, and the data section ends where the file does
    infos = list(h.tensors.values())
    assert [i.begin for i in infos] == sorted(i.begin for i in infos)
    assert h.data_start + max(i.end for i in infos) == h.file_size
    # offsets agree with the bytes on disk
    with open(p, "rb") as f:
        f.seek(h.data_start + h.tensors["a.weight"].begin)
        raw = f.read(h.tensors["a.weight"].nbytes)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(8, 6), t["a.weight"])


# ---------------------------------------------------------------------------------------------- discovery


def test_index_two_shards(tmp_path):
    _, f1, f2 = _two_shards(tmp_path)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "zzz_stray.safetensors"))
    assert find_shards(str(tmp_path)) == [str(tmp_path / f1), str(tmp_path / f2)]
    wm = index_weight_map(str(tmp_path))
    assert wm["a.weight"] == f1 and wm["k.i32"] == f2


def test_unreferenced_shard_warns(tmp_path, caplog):
    _two_shards(tmp_path)
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "zzz_stray.safetensors"))
    with caplog.at_level(logging.WARNING, logger=sio.__name__):
        shards = find_shards(str(tmp_path))
    assert all("zzz_stray" not in s for s in shards)
    assert "zzz_stray.safetensors" in caplog.text


def test_no_index_sorted_glob(tmp_path):
    _two_shards(tmp_path, with_index=False)
    (tmp_path / "notes.txt").write_text("x")
    assert index_weight_map(str(tmp_path)) is None
    assert [os.path.basename(p) for p in find_shards(str(tmp_path))] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files in .*"):
        find_shards(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        find_shards(str(tmp_path / "nope"))


def test_index_references_missing_shard(tmp_path):
    _, f1, f2 = _two_shards(tmp_path)
    os.remove(tmp_path / f2)
    with pytest.raises(CheckpointError) as e:
        find_shards(str(tmp_path))
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and "do not exist" in msg
    assert f2 in msg and f1 not in msg
    assert "f.i64" in msg  # a tensor whose shard is missing


def test_malformed_index_json(tmp_path):
    _two_shards(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=r"index\.json: malformed index file: not valid JSON"):
        find_shards(str(tmp_path))


def test_index_without_weight_map(tmp_path):
    _two_shards(tmp_path)
    _write_index(tmp_path, {"metadata": {}})
    with pytest.raises(CheckpointError, match=r"index\.json: malformed index file: no \"weight_map\" key"):
        find_shards(str(tmp_path))
    _write_index(tmp_path, {"weight_map": ["a"]})
    with pytest.raises(CheckpointError, match=r"\"weight_map\" is a list"):
        index_weight_map(str(tmp_path))


# ---------------------------------------------------------------------------------------------- streaming


def test_stream_yields_every_tensor(tmp_path):
    t, f1, f2 = _two_shards(tmp_path)
    got = list(stream_tensors(str(tmp_path), progress=False))
    assert sorted(n for _, n, _ in got) == sorted(t)
    shards = [os.path.basename(p) for p, _, _ in got]
    assert shards == sorted(shards)  # shard by shard
    for path, name, x in got:
        _same(x, t[name])
        assert name in read_header(path).tensors
    # within a shard, file order
    h1 = read_header(str(tmp_path / f1))
    assert [n for p, n, _ in got if p.endswith(f1)] == list(h1.tensors)


def test_stream_names_filter_reads_only_those(tmp_path, monkeypatch):
    t, f1, f2 = _two_shards(tmp_path)
    read, opened = [], []
    orig_get, orig_open = ShardReader.get, ShardReader.open

    def spy_get(self, name):
        read.append(name)
        return orig_get(self, name)

    def spy_open(self):
        opened.append(os.path.basename(self.path))
        return orig_open(self)

    monkeypatch.setattr(ShardReader, "get", spy_get)
    monkeypatch.setattr(ShardReader, "open", spy_open)
    want = {"c.fp8", "a.weight"}  # both in shard 1
    got = {n: x for _, n, x in stream_tensors(str(tmp_path), names=want, progress=False)}
    assert set(got) == want and sorted(read) == sorted(want)
    assert opened == [f1]  # shard 2 is never opened
    for n in want:
        _same(got[n], t[n])
    with pytest.raises(CheckpointError, match="requested tensors not in any shard: nope"):
        list(stream_tensors(str(tmp_path), names={"a.weight", "nope"}, progress=False))
    assert [n for _, n, _ in stream_tensors(str(tmp_path), names={"nope"}, progress=False, missing_ok=True)] == []


def test_progress_bar_in_bytes(tmp_path, monkeypatch, capfd):
    _two_shards(tmp_path)
    monkeypatch.setenv("ASCEND_DSV4_PROGRESS", "1")
    list(stream_tensors(str(tmp_path), progress=True, desc="testload"))
    err = capfd.readouterr().err
    assert "testload" in err and "B/s" in err
    monkeypatch.setenv("ASCEND_DSV4_PROGRESS", "1")
    list(stream_tensors(str(tmp_path), progress=False, desc="quiet"))
    monkeypatch.delenv("ASCEND_DSV4_PROGRESS")
    list(stream_tensors(str(tmp_path), progress=True, desc="notty"))  # captured stderr is not a TTY
    err = capfd.readouterr().err
    assert "quiet" not in err and "notty" not in err


# ---------------------------------------------------------------------------------------------- ShardReader


def test_shard_reader_get_and_slice(tmp_path):
    t = _tensors()
    p = str(tmp_path / "m.safetensors")
    save_file(t, p)
    with ShardReader(p) as r:
        assert set(r.keys()) == set(t)
        assert r.info("c.fp8").shape == (16, 32)
        _same(r.get("b.bf16"), t["b.bf16"])
        _same(r.get("g.scalar"), t["g.scalar"])
        _same(r.get_slice("a.weight", 0, 2, 5), t["a.weight"][2:5])
        _same(r.get_slice("a.weight", 1, 1, 4), t["a.weight"][:, 1:4])
        _same(r.get_slice("a.weight", -1, 0, 6), t["a.weight"])
        _same(r.get_slice("c.fp8", 1, 8, 16), t["c.fp8"][:, 8:16].contiguous())
        _same(r.get_slice("h.f16", 1, 1, 3), t["h.f16"][:, 1:3])
        _same(r.get_slice("h.f16", 2, 0, 2), t["h.f16"][:, :, 0:2])
        assert r.get_slice("a.weight", 0, 3, 3).shape == (0, 6)
        with pytest.raises(CheckpointError, match=r"m\.safetensors: tensor 'a\.weight': slice \[4:9\] on dim 0"):
            r.get_slice("a.weight", 0, 4, 9)
        with pytest.raises(CheckpointError, match="slice dim 2 out of range"):
            r.get_slice("a.weight", 2, 0, 1)
        with pytest.raises(CheckpointError, match="0-dim"):
            r.get_slice("g.scalar", 0, 0, 1)
        with pytest.raises(CheckpointError, match=r"m\.safetensors: no tensor 'a\.weihgt'.*a\.weight"):
            r.get("a.weihgt")


def test_shard_reader_fp4(tmp_path):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch without float4_e2m1fn_x2")
    packed = torch.arange(6 * 8, dtype=torch.uint8).reshape(6, 8)
    p = str(tmp_path / "m.safetensors")
    save_file({"pad": torch.zeros(3), "w": packed.view(torch.float4_e2m1fn_x2)}, p)
    with ShardReader(p) as r:
        info = r.info("w")
        assert info.dtype_str == "F4" and info.shape == (6, 16) and info.nbytes == 48
        assert torch.equal(r.get("w").view(torch.uint8), packed)
        assert torch.equal(r.get_slice("w", 0, 2, 5).view(torch.uint8), packed[2:5])
        assert torch.equal(r.get_slice("w", 1, 4, 12).view(torch.uint8), packed[:, 2:6])
        with pytest.raises(CheckpointError, match="multiple of 2"):
            r.get_slice("w", 1, 3, 12)


def test_safetensors_error_is_wrapped(tmp_path, monkeypatch):
    p = str(tmp_path / "m.safetensors")
    save_file({"x": torch.zeros(2)}, p)
    with ShardReader(p) as r:

        class Broken:
            def get_tensor(self, name):
                raise RuntimeError("boom")

        r._f = Broken()
        with pytest.raises(CheckpointError, match=r"m\.safetensors: tensor 'x': cannot read tensor \(RuntimeError: boom\)"):
            r.get("x")
        r._f = None


# ---------------------------------------------------------------------------------------------- inventory


def test_inventory_from_headers(tmp_path, monkeypatch):
    t, f1, f2 = _two_shards(tmp_path)
    monkeypatch.setattr(ShardReader, "get", lambda *a: pytest.fail("inventory read tensor data"))
    inv = checkpoint_inventory(str(tmp_path))
    assert set(inv) == set(t)
    assert inv["a.weight"][0].endswith(f1) and inv["k.i32"][0].endswith(f2)
    assert inv["b.bf16"][1].shape == (4, 5)


def test_duplicate_tensor_across_shards(tmp_path):
    save_file({"x": torch.zeros(2), "y": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError) as e:
        checkpoint_inventory(str(tmp_path))
    msg = str(e.value)
    assert "more than one shard" in msg and "'x'" in msg
    assert "a.safetensors" in msg and "b.safetensors" in msg


def test_index_points_at_wrong_shard(tmp_path):
    _, f1, f2 = _two_shards(tmp_path)
    wm = index_weight_map(str(tmp_path))
    wm["a.weight"] = f2
    wm["ghost"] = f1
    _write_index(tmp_path, {"weight_map": wm})
    with pytest.raises(CheckpointError) as e:
        checkpoint_inventory(str(tmp_path))
    msg = str(e.value)
    assert "disagrees with the shards (2 tensor(s))" in msg
    assert f"'a.weight': index says {f2}, but it is in {f1}" in msg
    assert f"'ghost': index says {f1}, but no shard holds it" in msg


# ---------------------------------------------------------------------------------------------- corruption


def test_truncated_shard(tmp_path):
    p = str(tmp_path / "model-00001-of-00001.safetensors")
    save_file(_tensors(), p)
    full = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(full - 7)
    with pytest.raises(CheckpointError) as e:
        read_header(p)
    msg = str(e.value)
    assert msg.startswith(p) and "truncated" in msg
    assert f"at least {full} bytes" in msg and f"it is {full - 7} bytes" in msg
    with pytest.raises(CheckpointError, match="truncated"):
        list(stream_tensors(str(tmp_path), progress=False))
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_inventory(str(tmp_path))


def test_file_shorter_than_prefix(tmp_path):
    p = str(tmp_path / "m.safetensors")
    open(p, "wb").write(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match=r"m\.safetensors: file is 3 bytes, shorter than the 8-byte"):
        read_header(p)


def test_header_length_larger_than_file(tmp_path):
    p = str(tmp_path / "m.safetensors")
    open(p, "wb").write(struct.pack("<Q", 5000) + b'{"x": 1}')
    with pytest.raises(CheckpointError, match=r"header length field says 5000 bytes but the file is only 16 bytes"):
        read_header(p)


def test_header_length_absurd(tmp_path):
    p = str(tmp_path / "m.safetensors")
    open(p, "wb").write(struct.pack("<Q", 1 << 40) + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"more than the 100000000-byte limit"):
        read_header(p)


def test_header_garbage_bytes(tmp_path):
    p = str(tmp_path / "m.safetensors")
    _raw_shard(p, b"\xff\xfe\x00garbage\x80\x81")
    with pytest.raises(CheckpointError, match=r"m\.safetensors: corrupt header: not valid UTF-8"):
        read_header(p)


def test_header_invalid_json(tmp_path):
    p = str(tmp_path / "m.safetensors")
    _raw_shard(p, b'{"x": {"dtype": "F32", ', b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: corrupt header: not valid JSON"):
        read_header(p)
    _raw_shard(p, b"[1, 2, 3]")
    with pytest.raises(CheckpointError, match=r"corrupt header: expected a JSON object, found a list"):
        read_header(p)


def test_header_entry_missing_fields_and_unknown_dtype(tmp_path):
    p = str(tmp_path / "m.safetensors")
    _raw_shard(p, {"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'x': header entry lacks 'data_offsets'"):
        read_header(p)
    _raw_shard(p, {"x": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'x': unknown dtype 'F12'"):
        read_header(p)
    _raw_shard(p, {"x": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'x': shape \[2, -1\] is not a list"):
        read_header(p)


def test_dtype_size_mismatch_in_edited_header(tmp_path):
    p = str(tmp_path / "m.safetensors")
    save_file({"w": torch.zeros(4, 4), "v": torch.zeros(3)}, p)

    def to_bf16(h):
        h["w"]["dtype"] = "BF16"

    _rewrite_header(p, to_bf16)
    with pytest.raises(CheckpointError) as e:
        read_header(p)
    msg = str(e.value)
    assert msg.startswith(p) and "tensor 'w'" in msg
    assert "span 64 bytes, but BF16 x [4, 4] needs 32 bytes" in msg

    save_file({"w": torch.zeros(4, 4)}, p)

    def reshape(h):
        h["w"]["shape"] = [4, 5]

    _rewrite_header(p, reshape)
    with pytest.raises(CheckpointError, match=r"span 64 bytes, but F32 x \[4, 5\] needs 80 bytes"):
        read_header(p)


def test_each_corruption_has_its_own_message(tmp_path):
    """The messages differ, so a user can tell the failures apart."""
    msgs = set()
    cases = {
        "short": lambda p: open(p, "wb").write(b"abc"),
        "huge": lambda p: open(p, "wb").write(struct.pack("<Q", 1 << 40)),
        "beyond": lambda p: open(p, "wb").write(struct.pack("<Q", 99) + b"{}"),
        "utf8": lambda p: _raw_shard(p, b"\xff\xff"),
        "json": lambda p: _raw_shard(p, b"{oops"),
        "list": lambda p: _raw_shard(p, b"[]"),
        "size": lambda p: _raw_shard(p, {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "trunc": lambda p: _raw_shard(p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    }
    for key, make in cases.items():
        p = str(tmp_path / f"{key}.safetensors")
        make(p)
        with pytest.raises(CheckpointError) as e:
            read_header(p)
        msgs.add(str(e.value).replace(p, "").split("(")[0])
    assert len(msgs) == len(cases)


# ---------------------------------------------------------------------------------------------- benchmark


def test_sequential_read_throughput(tmp_path):
    p = str(tmp_path / "m.safetensors")
    save_file({"x": torch.zeros(1 << 16)}, p)
    assert sequential_read_throughput([p], block=1 << 12) > 0
    assert sequential_read_throughput(p) > 0
