"""Find and lazily read the safetensors files of an msModelSlim output folder.

What msModelSlim writes (README.md §3; ``modelslim_v1/save/utils/safetensors.py``):

* v0 ``safe_tensor`` / ``ascendV1``: one ``quant_model_weight_<type>.safetensors`` (or
  ``quant_model_weight.safetensors`` when ``safetensors_name=`` is passed);
* v1 ``AscendV1Saver``: ``quant_model_weights.safetensors``, or shards
  ``quant_model_weights-0000i-of-0000N.safetensors`` plus ``quant_model_weights.safetensors.index.json``
  (HF layout: ``{"metadata": {"total_size": ...}, "weight_map": {tensor: file}}``).

The v1 saver also copies the *source* model's ``*.json`` next to the output. Its copy skips ``*index.json``,
but a folder assembled by hand can still hold the source's ``model.safetensors.index.json`` naming
``model-0000x-of-0000N.safetensors`` files that are not there. So the search order here is:

1. an msModelSlim index ``quant_model_weight*.safetensors.index.json`` (its ``weight_map``);
2. every ``quant_model_weight*.safetensors`` file (a numbered set must be complete);
3. otherwise the generic rules of :func:`quant.safetensors_io.find_shards`
   (``model.safetensors.index.json`` or any ``*.safetensors``).

Only headers are read when a :class:`WeightStore` is opened; a tensor's data is read (memory-mapped, through
:class:`~quant.safetensors_io.ShardReader`) when :meth:`WeightStore.get` asks for it.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from quant.errors import CheckpointError, QuantFormatError
from quant.safetensors_io import ShardReader, TensorInfo, check_numbered_set, find_shards, read_header, read_index

log = logging.getLogger(__name__)

WEIGHT_GLOB = "quant_model_weight*.safetensors"
INDEX_GLOB = "quant_model_weight*.safetensors.index.json"


def _read_index(index: str) -> dict[str, str]:
    try:
        wm = read_index(index)
    except CheckpointError as e:
        raise QuantFormatError(str(e)) from None
    if not wm:
        raise QuantFormatError(f"{index}: malformed index file: expected a non-empty \"weight_map\" object")
    for k, v in wm.items():  # shard names are plain file names inside the folder: nothing else is opened
        if v in ("", ".", "..") or "/" in v or "\\" in v or "\0" in v or os.path.isabs(v) or v[1:2] == ":":
            raise QuantFormatError(f"{index}: \"weight_map\" entry {k!r} names the shard {v!r}, which is not a "
                                   f"plain file name inside the model folder; it was not opened")
    return wm


def _check_numbered(folder: str, paths: list[str]) -> None:
    try:
        check_numbered_set(folder, paths, f"an msModelSlim index ({INDEX_GLOB})")
    except CheckpointError as e:
        raise QuantFormatError(str(e)) from None


def find_weight_files(folder: str) -> tuple[list[str], str | None, dict[str, str] | None]:
    """``(files, index_path, weight_map)`` of the checkpoint in ``folder`` (search order: module docstring)."""
    if not os.path.isdir(folder):
        raise QuantFormatError(f"checkpoint folder {folder} does not exist or is not a directory")
    esc = glob.escape(folder)
    indexes = sorted(glob.glob(os.path.join(esc, INDEX_GLOB)))
    on_disk = sorted(glob.glob(os.path.join(esc, WEIGHT_GLOB)))
    if len(indexes) > 1:
        raise QuantFormatError(
            f"{folder}: several msModelSlim index files: {', '.join(os.path.basename(p) for p in indexes)}"
        )
    if indexes:
        index = indexes[0]
        wm = _read_index(index)
        files = sorted(set(wm.values()))
        missing = [s for s in files if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise QuantFormatError(f"{index} names shard(s) that do not exist in {folder}: {', '.join(missing)}")
        paths = [os.path.join(folder, s) for s in files]
        stray = sorted({os.path.realpath(p) for p in on_disk} - {os.path.realpath(p) for p in paths})
        if stray:
            log.warning("%s: ignoring %s (not in %s)", folder, ", ".join(map(os.path.basename, stray)), index)
        return paths, index, wm
    if on_disk:
        _check_numbered(folder, on_disk)
        return on_disk, None, None
    try:  # generic HF layout / any *.safetensors
        return find_shards(folder), None, None
    except Exception as e:  # CheckpointError: re-raise as a format error naming what was looked for
        raise QuantFormatError(
            f"{folder}: no msModelSlim weights ({WEIGHT_GLOB}) and no usable *.safetensors ({e})"
        ) from e


class WeightStore:
    """Lazy access to every tensor of an msModelSlim checkpoint.

    Opening reads the safetensors *headers* only. ``store.info(key)`` gives dtype/shape without data;
    ``store.get(key)`` reads one tensor (CPU, stored dtype); :meth:`load_all` reads everything.
    A tensor stored in two files, or an index entry that points at the wrong file, is a
    :class:`QuantFormatError`.
    """

    def __init__(self, folder: str):
        self.folder = folder
        self.files, self.index_path, weight_map = find_weight_files(folder)
        self._where: dict[str, str] = {}
        self._info: dict[str, TensorInfo] = {}
        self._headers = {}
        dups = []
        for path in self.files:
            h = read_header(path)
            self._headers[path] = h
            for name, info in h.tensors.items():
                if name in self._where:
                    dups.append(f"{name!r} in {os.path.basename(self._where[name])} and {os.path.basename(path)}")
                    continue
                self._where[name] = path
                self._info[name] = info
        if dups:
            raise QuantFormatError(f"{folder}: tensor(s) stored in more than one file: " + "; ".join(dups))
        if weight_map is not None:
            wrong = []
            for name, shard in weight_map.items():
                have = self._where.get(name)
                if have is None:
                    wrong.append(f"{name!r}: index says {shard}, no file holds it")
                elif os.path.basename(have) != shard:
                    wrong.append(f"{name!r}: index says {shard}, found in {os.path.basename(have)}")
            if wrong:
                raise QuantFormatError(f"{self.index_path} disagrees with the files: " + "; ".join(wrong))
        self._readers: dict[str, ShardReader] = {}

    # -- header-level
    def keys(self) -> list[str]:
        return list(self._info)

    def __contains__(self, key: str) -> bool:
        return key in self._info

    def __len__(self) -> int:
        return len(self._info)

    def info(self, key: str) -> TensorInfo:
        """dtype (``info.torch_dtype``), ``shape`` and ``nbytes`` of ``key``, from the header."""
        try:
            return self._info[key]
        except KeyError:
            raise KeyError(f"{self.folder}: no tensor {key!r} in the weights") from None

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._info)

    def file_of(self, key: str) -> str:
        self.info(key)
        return self._where[key]

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._info.values())

    # -- data
    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (memory-mapped; the file handle stays open until :meth:`close`)."""
        path = self.file_of(key)
        r = self._readers.get(path)
        if r is None:
            r = self._readers[path] = ShardReader(path, self._headers[path]).open()
        return r.get(key)

    def get_many(self, keys) -> dict[str, torch.Tensor]:
        return {k: self.get(k) for k in keys}

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor (this is the only call that reads the whole checkpoint)."""
        return self.get_many(self.keys())

    def close(self) -> None:
        readers, self._readers = self._readers, {}
        for r in readers.values():
            r.close()

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_weights(folder: str) -> WeightStore:
    """Open the weights of ``folder`` (headers only)."""
    return WeightStore(folder)


__all__ = ["INDEX_GLOB", "WEIGHT_GLOB", "WeightStore", "find_weight_files", "open_weights"]
