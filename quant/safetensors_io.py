"""Find, check and stream the shards of a safetensors checkpoint (any checkpoint: the model's own, msModelSlim's).

About 650 lines for one job, the safetensors container: the hand-parsed header, shard discovery, the memory-mapped
reader and streaming all share the header's validation and its error messages, so they stay together.

The safetensors header is parsed here by hand (8-byte little-endian length, then a UTF-8 JSON object), so
that a broken checkpoint is reported as a :class:`CheckpointError` naming the shard, the tensor and what
was expected against what was found, instead of a bare ``SafetensorError``; a shard cut short by an
interrupted download says "truncated" and gives the expected and actual file sizes.

Tensor data is read through ``safetensors.safe_open`` (memory-mapped), one tensor at a time, so a
loader never holds a second full copy of the model; :meth:`ShardReader.get_slice` reads only the bytes
of one slice (per-rank tensor-parallel shards).

API:

* :func:`find_shards` / :func:`index_weight_map` / :func:`read_index` -- which shard files make up a checkpoint
  folder.
* :func:`read_header` -> :class:`ShardHeader` of :class:`TensorInfo` -- one shard's header, validated.
* :class:`ShardReader` -- ``keys / info / get / get_slice`` over one shard (context manager).
* :func:`stream_tensors` -- every (or the chosen) tensor of a folder, shard by shard, in file order,
  with a progress bar in bytes.
* :func:`checkpoint_inventory` -- name -> (shard, TensorInfo) from headers only; duplicates and index
  disagreements are errors.
* :func:`sequential_read_throughput` -- plain sequential read speed of some files (benchmark baseline).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from quant.errors import CheckpointError

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
PROGRESS_ENV = "ASCEND_DSV4_PROGRESS"

# safetensors dtype string -> (bits per element, torch dtype or None where this torch lacks it)
_DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (8, torch.bool),
    "U8": (8, torch.uint8),
    "I8": (8, torch.int8),
    "I16": (16, torch.int16),
    "U16": (16, getattr(torch, "uint16", None)),
    "I32": (32, torch.int32),
    "U32": (32, getattr(torch, "uint32", None)),
    "I64": (64, torch.int64),
    "U64": (64, getattr(torch, "uint64", None)),
    "F16": (16, torch.float16),
    "BF16": (16, torch.bfloat16),
    "F32": (32, torch.float32),
    "F64": (64, torch.float64),
    "C64": (64, torch.complex64),
    "F8_E4M3": (8, getattr(torch, "float8_e4m3fn", None)),
    "F8_E5M2": (8, getattr(torch, "float8_e5m2", None)),
    "F8_E4M3FNUZ": (8, getattr(torch, "float8_e4m3fnuz", None)),
    "F8_E5M2FNUZ": (8, getattr(torch, "float8_e5m2fnuz", None)),
    "F8_E8M0": (8, getattr(torch, "float8_e8m0fnu", None)),
    # FP4 (e2m1): the header's shape counts 4-bit values; torch packs two per float4_e2m1fn_x2 element.
    "F4": (4, getattr(torch, "float4_e2m1fn_x2", None)),
}


def _fmt_size(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n} bytes ({n / 2**20:.1f} MiB)"


# ----------------------------------------------------------------------------------------------------
# headers


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype_str: str
    torch_dtype: torch.dtype | None
    shape: tuple[int, ...]
    begin: int
    end: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bits(self) -> int:
        return _DTYPES[self.dtype_str][0]


@dataclass
class ShardHeader:
    """The parsed header of one ``.safetensors`` file. Tensors are in file (data offset) order."""

    path: str
    file_size: int
    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section (8 + header length)."""
        return 8 + self.header_len

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _expected_nbytes(path: str, name: str, dtype: str, shape: tuple[int, ...]) -> int:
    bits = _DTYPES[dtype][0]
    total_bits = math.prod(shape) * bits
    if total_bits % 8:
        raise CheckpointError(
            f"{path}: tensor {name!r}: {dtype} x {list(shape)} is {total_bits} bits, not a whole number of bytes"
        )
    return total_bits // 8


def _parse_entry(path: str, name: str, entry) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is a {type(entry).__name__}, expected an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(
            f"{where}: header entry lacks {', '.join(repr(m) for m in missing)} "
            f"(expected dtype, shape, data_offsets; found {sorted(entry)})"
        )
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (expected one of {', '.join(_DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offs = entry["data_offsets"]
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and o >= 0 for o in offs)
        or offs[0] > offs[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
    shape_t = tuple(shape)
    nbytes = _expected_nbytes(path, name, dtype, shape_t)
    begin, end = offs
    if end - begin != nbytes:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but {dtype} x {list(shape_t)} "
            f"needs {nbytes} bytes (dtype/shape do not match the stored data)"
        )
    return TensorInfo(name, dtype, _DTYPES[dtype][1], shape_t, begin, end, nbytes)


def read_header(path: str) -> ShardHeader:
    """Read and validate the header of the safetensors file ``path`` (no tensor data is read)."""
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: file is {file_size} bytes, shorter than the 8-byte header length prefix "
                    f"(empty or truncated shard)"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: corrupt header: header length field says {n} bytes, more than the "
                    f"{MAX_HEADER_BYTES}-byte limit (not a safetensors file?)"
                )
            if 8 + n > file_size:
                raise CheckpointError(
                    f"{path}: corrupt header: header length field says {n} bytes but the file is only "
                    f"{file_size} bytes (expected at least {8 + n}; not a safetensors file, or truncated)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: corrupt header: not valid UTF-8 ({e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt header: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, found a {type(obj).__name__}")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is a {type(meta).__name__}, expected an object")
    odd = [k for k, v in meta.items() if not isinstance(v, str)]
    if odd:
        raise CheckpointError(f"{path}: __metadata__ entry {odd[0]!r} is not a string (safetensors metadata is "
                              f"a string -> string map)")
    infos = [_parse_entry(path, name, entry) for name, entry in obj.items()]
    infos.sort(key=lambda t: (t.begin, t.end, t.name))
    header = ShardHeader(path, file_size, n, meta, {t.name: t for t in infos})
    if infos:
        last = max(infos, key=lambda t: t.end)
        if last.end > header.data_size:
            expected = header.data_start + last.end
            raise CheckpointError(
                f"{path}: truncated shard: tensor {last.name!r} ends at data offset {last.end}, so the file "
                f"should be at least {expected} bytes, but it is {file_size} bytes "
                f"({expected - file_size} bytes missing; re-download it)"
            )
    _check_layout(path, infos, header.data_size)
    return header


def _check_layout(path: str, infos: list[TensorInfo], data_size: int) -> None:
    """The safetensors format's layout rule: in offset order, every tensor begins where the previous one ends
    (the first at 0), and the last ends at the end of the file: no overlap, no gap, nothing uncovered.
    (``safetensors`` rejects a file breaking it with "invalid offset for tensor" / "file not fully covered".)"""
    pos, prev = 0, None
    for t in infos:  # sorted by (begin, end)
        if t.begin != pos:
            where = f"tensor {prev.name!r} [{prev.begin}, {prev.end}]" if prev else "the start of the data section"
            what = (f"overlaps {where}" if t.begin < pos else f"leaves a gap of {t.begin - pos} bytes after {where}")
            raise CheckpointError(
                f"{path}: corrupt header: tensor {t.name!r} data_offsets [{t.begin}, {t.end}] {what}; each tensor "
                f"must begin where the previous one ends (expected begin {pos})"
            )
        pos, prev = t.end, t
    if pos != data_size:
        after = f"after tensor {prev.name!r}" if prev else "and the header lists no tensor"
        raise CheckpointError(
            f"{path}: corrupt header: the data section is {data_size} bytes but its tensors cover {pos}: "
            f"{data_size - pos} bytes {after} belong to no tensor (the file is not fully covered)"
        )


# ----------------------------------------------------------------------------------------------------
# discovery


def index_weight_map(folder: str) -> dict[str, str] | None:
    """``weight_map`` (tensor name -> shard file name) of ``folder``'s index, or None without an index."""
    index = os.path.join(folder, INDEX_NAME)
    if not os.path.isfile(index):
        return None
    return read_index(index)


def read_index(index: str) -> dict[str, str]:
    """The validated ``weight_map`` (tensor name -> shard file name) of a ``*.safetensors.index.json`` file
    (Hugging Face layout: ``{"metadata": {...}, "weight_map": {...}}``; msModelSlim writes the same)."""
    try:
        with open(index, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: malformed index file: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: cannot read index file ({e})") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{index}: malformed index file: expected a JSON object, found a {type(obj).__name__}")
    if "weight_map" not in obj:
        raise CheckpointError(
            f"{index}: malformed index file: no \"weight_map\" key (found keys: {sorted(obj) or 'none'})"
        )
    wm = obj["weight_map"]
    if not isinstance(wm, dict):
        raise CheckpointError(f"{index}: malformed index file: \"weight_map\" is a {type(wm).__name__}, expected an object")
    bad = [k for k, v in wm.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(
            f"{index}: malformed index file: \"weight_map\" entries without a shard file name: {', '.join(bad[:10])}"
        )
    for k, v in wm.items():
        if not is_plain_file_name(v):
            raise CheckpointError(
                f"{index}: \"weight_map\" entry {k!r} names the shard {v!r}, which is not a plain file name "
                f"inside the model folder (no directories, no '..', no absolute paths); it was not opened"
            )
    return dict(wm)


def is_plain_file_name(name: str) -> bool:
    """True for a file name that stays inside its folder: no separator, not ``.``/``..``, no NUL, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.path.basename(name) == name and not os.path.isabs(name)
            and not (len(name) > 1 and name[1] == ":"))


_NUMBERED = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")


def check_numbered_set(folder: str, on_disk: list[str], index_name: str = INDEX_NAME) -> None:
    """Without an index, shards named ``*-0000k-of-0000N`` must be a complete set: a missing index file
    and a missing shard would otherwise load a partial model."""
    totals = {int(m.group(2)) for p in on_disk if (m := _NUMBERED.search(p))}
    for n in totals:
        have = {int(m.group(1)) for p in on_disk if (m := _NUMBERED.search(p)) and int(m.group(2)) == n}
        gone = sorted(set(range(1, n + 1)) - have)
        if gone:
            raise CheckpointError(
                f"{folder}: {index_name} is missing and the shard set is incomplete: shard(s) "
                f"{', '.join(str(i) for i in gone)} of {n} are not there")


def find_shards(folder: str) -> list[str]:
    """Paths of the shard files of the checkpoint in ``folder``.

    With ``model.safetensors.index.json``: the shards its weight_map names (sorted, each once), all of
    which must exist. Without one: every ``*.safetensors`` file of the folder, sorted.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist or is not a directory")
    on_disk = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    wm = index_weight_map(folder)
    if wm is None:
        if not on_disk:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        check_numbered_set(folder, on_disk)
        return on_disk
    index = os.path.join(folder, INDEX_NAME)
    if not wm:
        raise CheckpointError(f"{index}: \"weight_map\" is empty (no tensors, no shards)")
    files = sorted(set(wm.values()))
    missing = [s for s in files if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        lines = []
        for s in missing:
            names = [k for k, v in wm.items() if v == s]
            more = f", ... ({len(names)} tensors)" if len(names) > 3 else ""
            lines.append(f"{s} (holds {', '.join(names[:3])}{more})")
        raise CheckpointError(
            f"{index} lists {len(missing)} shard(s) that do not exist in {folder}: " + "; ".join(lines)
        )
    paths = [os.path.join(folder, s) for s in files]
    listed = {os.path.realpath(p) for p in paths}
    stray = [p for p in on_disk if os.path.realpath(p) not in listed]
    if stray:
        log.warning(
            "%s: ignoring %d *.safetensors file(s) not referenced by %s: %s",
            folder, len(stray), INDEX_NAME, ", ".join(os.path.basename(p) for p in stray),
        )
    return paths


# ----------------------------------------------------------------------------------------------------
# reading


class ShardReader:
    """Memory-mapped reader of one shard; every failure is a CheckpointError naming shard and tensor.

    ``with ShardReader(path) as r: r.get(name)``. The header is validated (:func:`read_header`) first.
    """

    def __init__(self, path: str, header: ShardHeader | None = None):
        self.path = path
        self.header = header if header is not None else read_header(path)
        self._f = None

    # -- lifetime
    def open(self) -> "ShardReader":
        if self._f is None:
            from safetensors import safe_open

            try:
                self._f = safe_open(self.path, framework="pt")
            except Exception as e:
                raise CheckpointError(f"{self.path}: cannot open shard ({type(e).__name__}: {e})") from e
        return self

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None and hasattr(f, "__exit__"):
            try:
                f.__exit__(None, None, None)
            except Exception:  # closing a read-only mmap cannot lose data
                pass

    def __enter__(self) -> "ShardReader":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- header
    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self.header.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.header.tensors

    def info(self, name: str) -> TensorInfo:
        t = self.header.tensors.get(name)
        if t is None:
            import difflib

            close = difflib.get_close_matches(name, self.header.tensors, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this shard{hint}")
        return t

    # -- data
    def _handle(self):
        return self._f if self._f is not None else self.open()._f

    def _fail(self, name: str, what: str, e: Exception) -> CheckpointError:
        return CheckpointError(f"{self.path}: tensor {name!r}: {what} ({type(e).__name__}: {e})")

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a CPU tensor of the stored dtype)."""
        info = self.info(name)
        self._need_dtype(info)
        try:
            t = self._handle().get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise self._fail(name, "cannot read tensor", e) from e
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``tensor[..., start:stop, ...]`` along ``dim``, reading only the bytes of that slice."""
        info = self.info(name)
        self._need_dtype(info)
        nd = len(info.shape)
        if nd == 0:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot slice a 0-dim tensor")
        if not -nd <= dim < nd:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: slice dim {dim} out of range for shape {list(info.shape)}"
            )
        dim %= nd
        size = info.shape[dim]
        if not 0 <= start <= stop <= size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: slice [{start}:{stop}] on dim {dim} is outside "
                f"shape {list(info.shape)} (dim {dim} has {size})"
            )
        if info.bits < 8:
            return self._subbyte_slice(info, dim, start, stop)
        index = (slice(None),) * dim + (slice(start, stop),)
        try:
            return self._handle().get_slice(name)[index]
        except Exception as e:
            raise self._fail(name, f"cannot read slice [{start}:{stop}] of dim {dim}", e) from e

    def _need_dtype(self, info: TensorInfo) -> None:
        if info.torch_dtype is None:
            raise CheckpointError(
                f"{self.path}: tensor {info.name!r}: dtype {info.dtype_str} has no torch equivalent in torch "
                f"{torch.__version__}"
            )

    def _subbyte_slice(self, info: TensorInfo, dim: int, start: int, stop: int) -> torch.Tensor:
        """Slices of packed (4-bit) tensors; safetensors cannot slice them, so read the bytes directly."""
        per = 8 // info.bits  # values per byte
        shape = list(info.shape)
        if shape[-1] % per:
            raise CheckpointError(
                f"{self.path}: tensor {info.name!r}: {info.dtype_str} last dim {shape[-1]} does not pack into bytes"
            )
        packed = shape[:-1] + [shape[-1] // per]
        if dim == len(shape) - 1:
            if start % per or stop % per:
                raise CheckpointError(
                    f"{self.path}: tensor {info.name!r}: {info.dtype_str} slice [{start}:{stop}] of the last dim "
                    f"must start and stop on a multiple of {per}"
                )
            start, stop = start // per, stop // per
        row = math.prod(packed[1:])  # bytes per index of dim 0
        lo, hi = (start, stop) if dim == 0 else (0, packed[0])
        try:
            with open(self.path, "rb") as f:
                f.seek(self.header.data_start + info.begin + lo * row)
                buf = bytearray(f.read((hi - lo) * row))
        except OSError as e:
            raise self._fail(info.name, "cannot read slice", e) from e
        if len(buf) != (hi - lo) * row:
            raise CheckpointError(f"{self.path}: tensor {info.name!r}: truncated shard (short read)")
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        t = t.reshape([hi - lo] + packed[1:])
        if dim != 0:
            t = t.narrow(dim, start, stop - start).contiguous()
        return t.view(info.torch_dtype)


# ----------------------------------------------------------------------------------------------------
# streaming and inventory


def _progress_enabled(progress: bool) -> bool:
    if not progress:
        return False
    env = os.environ.get(PROGRESS_ENV)
    if env == "1":
        return True
    if env == "0":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def stream_tensors(
    folder: str,
    names: Iterable[str] | None = None,
    progress: bool = True,
    desc: str = "loading",
    missing_ok: bool = False,
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield ``(shard_path, name, tensor)`` shard by shard, tensor by tensor, in file order.

    ``names`` restricts the stream to those tensors; the others are not read, and shards holding none of
    them are not opened. A requested name found in no shard is a CheckpointError unless ``missing_ok``.
    The progress bar (stderr, in bytes and bytes/s) shows when ``progress`` and stderr is a terminal, or
    when ``ASCEND_DSV4_PROGRESS=1`` (``=0`` turns it off).
    """
    wanted = None if names is None else set(names)
    headers = [read_header(p) for p in find_shards(folder)]
    plan: list[tuple[ShardHeader, list[TensorInfo]]] = []
    found: set[str] = set()
    for h in headers:
        sel = [t for t in h.tensors.values() if wanted is None or t.name in wanted]
        found.update(t.name for t in sel)
        if sel:
            plan.append((h, sel))
    if wanted is not None and not missing_ok:
        absent = sorted(wanted - found)
        if absent:
            more = f", ... ({len(absent)} in all)" if len(absent) > 10 else ""
            raise CheckpointError(f"{folder}: requested tensors not in any shard: {', '.join(absent[:10])}{more}")
    total = sum(t.nbytes for _, sel in plan for t in sel)

    from tqdm import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=desc,
        file=sys.stderr,
        disable=not _progress_enabled(progress),
        dynamic_ncols=True,
        leave=True,
    )
    try:
        for h, sel in plan:
            bar.set_postfix_str(os.path.basename(h.path), refresh=False)
            with ShardReader(h.path, h) as r:
                for t in sel:
                    tensor = r.get(t.name)
                    bar.update(t.nbytes)
                    yield h.path, t.name, tensor
    finally:
        bar.close()


def checkpoint_inventory(folder: str) -> dict[str, tuple[str, TensorInfo]]:
    """Every tensor of the checkpoint: name -> (shard path, TensorInfo), from the headers only.

    A name in two shards, or an index entry whose shard does not hold that tensor, is a CheckpointError.
    """
    inv: dict[str, tuple[str, TensorInfo]] = {}
    dups: list[str] = []
    for path in find_shards(folder):
        for name, info in read_header(path).tensors.items():
            if name in inv:
                dups.append(f"{name!r} in both {inv[name][0]} and {path}")
                continue
            inv[name] = (path, info)
    if dups:
        more = f"\n  ... ({len(dups)} in all)" if len(dups) > 20 else ""
        raise CheckpointError(
            f"{folder}: {len(dups)} tensor(s) stored in more than one shard:\n  " + "\n  ".join(dups[:20]) + more
        )
    wm = index_weight_map(folder)
    if wm is not None:
        index = os.path.join(folder, INDEX_NAME)
        wrong = []
        for name, shard in wm.items():
            want = os.path.join(folder, shard)
            have = inv.get(name)
            if have is None:
                wrong.append(f"{name!r}: index says {shard}, but no shard holds it")
            elif os.path.realpath(have[0]) != os.path.realpath(want):
                wrong.append(f"{name!r}: index says {shard}, but it is in {os.path.basename(have[0])}")
        if wrong:
            more = f"\n  ... ({len(wrong)} in all)" if len(wrong) > 20 else ""
            raise CheckpointError(
                f"{index} disagrees with the shards ({len(wrong)} tensor(s)):\n  " + "\n  ".join(wrong[:20]) + more
            )
        unindexed = [n for n in inv if n not in wm]
        if unindexed:
            log.warning(
                "%s: %d tensor(s) in the shards are not in %s (e.g. %s)",
                folder, len(unindexed), INDEX_NAME, ", ".join(unindexed[:3]),
            )
    return inv


def sequential_read_throughput(paths: str | Iterable[str], block: int = 64 << 20) -> float:
    """Bytes per second of plainly reading ``paths`` start to end in ``block``-sized reads.

    A baseline for the loader's speed. Files already in the page cache read far faster than from disk.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    dt = time.perf_counter() - t0
    return total / dt if dt > 0 else float("inf")


__all__ = [
    "INDEX_NAME",
    "ShardHeader",
    "ShardReader",
    "TensorInfo",
    "checkpoint_inventory",
    "find_shards",
    "index_weight_map",
    "is_plain_file_name",
    "read_header",
    "sequential_read_throughput",
    "stream_tensors",
]
