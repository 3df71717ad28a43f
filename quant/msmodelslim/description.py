"""The msModelSlim description JSON: which quantisation type each checkpoint tensor has.

msModelSlim writes, next to the weights, a flat JSON object (README.md §3):

* ``quant_model_description.json`` (v1 ``AscendV1Saver`` and v0 ``save_type=["ascendV1"]``), or
* ``quant_model_description_<type>.json`` (v0 ``save_type=["safe_tensor"]``, e.g. ``_w8a8.json``).

Its entries are of three kinds:

* **tensor entries** ``"<tensor key>": "<TYPE>"`` -- every tensor of the safetensors files, e.g.
  ``"model.layers.0.self_attn.q_proj.weight": "W8A8"``, ``"model.norm.weight": "FLOAT"``,
  ``"...k_proj.kv_cache_scale": "C8"``;
* **global keys** -- ``model_quant_type``, ``kv_cache_type`` / ``kv_quant_type`` (``"C8"``), ``fa_quant_type``
  (``"FAKQuant"``), ``indexer_quant_type``, ``version`` (``"1.0.0"``, v1/ascendV1 only), ``group_size`` (int),
  ``metadata`` (object), ``optional`` (object) and whatever a newer tool adds; unknown globals are kept;
* **attribute entries** with no tensor behind them, e.g. ``"<attn>.quant_type": "INT8_DYNAMIC"`` (v1
  per-token activation tags).

A key is a *global* when it is one of :data:`KNOWN_GLOBALS`, when it has no ``.`` (tensor keys are always
``<module>.<param>``), or when its value is not a string. The type of a tensor entry must be one of
:data:`KNOWN_TYPES`; anything else is a :class:`~quant.errors.QuantFormatError` naming the key, the value and the
known types. ``model_quant_type`` is *not* checked against that list: msModelSlim writes the highest-priority type
of ``AscendV1Saver.QUANT_TYPE_PRIORITY`` and, since ``W4A8_DYNAMIC`` is absent from that list, a pure W4A8 model
gets ``"FLOAT"`` or ``"Unknown"`` (README.md §3).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from quant.errors import QuantFormatError

# -- per-tensor types -------------------------------------------------------------------------------------------

FLOAT = "FLOAT"
W8A16 = "W8A16"
W8A8 = "W8A8"
W8A8S = "W8A8S"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8_MIX = "W8A8_MIX"
W4A8_DYNAMIC = "W4A8_DYNAMIC"
W4A16 = "W4A16"
C8 = "C8"

#: Types this package reads and computes (``W4A16``: unpacked weights only, see :mod:`.schemes`).
SUPPORTED_TYPES: tuple[str, ...] = (FLOAT, W8A16, W8A8, W8A8S, W8A8_DYNAMIC, W8A8_MIX, W4A8_DYNAMIC, W4A16, C8)

#: Types msModelSlim 26.x can write (``AscendV1Saver``) that are recognised but not computed here:
#: ``.linear()`` refuses them with a message instead of calling them "unknown".
RECOGNISED_UNSUPPORTED_TYPES: tuple[str, ...] = (
    "W16A16S",
    "WFP8AFP8_DYNAMIC",
    "W8A8_MXFP8",
    "W4A8_MXFP",
    "W4A4_DYNAMIC",
    "W4A4_MXFP4",
    "W4A4_MXFP4_DUALSCALE",
    "FAQuant",  # per-head FA activation scales (``fa_q/fa_k/fa_v.scale|offset``)
)

KNOWN_TYPES: tuple[str, ...] = SUPPORTED_TYPES + RECOGNISED_UNSUPPORTED_TYPES

#: Linear types that quantise the weight (everything but FLOAT and the KV type).
QUANT_LINEAR_TYPES: tuple[str, ...] = (W8A16, W8A8, W8A8S, W8A8_DYNAMIC, W8A8_MIX, W4A8_DYNAMIC, W4A16)

#: Global (non-tensor) keys msModelSlim is known to write.
KNOWN_GLOBALS: tuple[str, ...] = (
    "model_quant_type",
    "kv_cache_type",
    "kv_quant_type",
    "fa_quant_type",
    "indexer_quant_type",
    "reduce_quant_type",
    "version",
    "group_size",
    "metadata",
    "optional",
)

#: Suffixes of description keys that tag a module instead of naming a tensor (v1 ``on_activation_per_token``).
ATTRIBUTE_SUFFIXES: tuple[str, ...] = (".quant_type",)

DESCRIPTION_NAME = "quant_model_description.json"
DESCRIPTION_GLOB = "quant_model_description*.json"


@dataclass
class Description:
    """A parsed description file.

    Attributes:
        path: the file it was read from (None when parsed from an in-memory object).
        types: tensor key -> type string (one of :data:`KNOWN_TYPES`), in file order.
        globals: every global key with its JSON value, unknown ones included.
        attributes: non-tensor module tags (``"<attn>.quant_type": "INT8_DYNAMIC"``).
    """

    path: str | None
    types: dict[str, str]
    globals: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, str] = field(default_factory=dict)

    # -- global keys
    @property
    def model_quant_type(self) -> str | None:
        return self.globals.get("model_quant_type")

    @property
    def kv_cache_type(self) -> str | None:
        """``"C8"`` when the KV cache is quantised; v0 writes ``kv_cache_type`` and/or ``kv_quant_type``."""
        v = self.globals.get("kv_cache_type")
        return v if v is not None else self.globals.get("kv_quant_type")

    @property
    def fa_quant_type(self) -> str | None:
        return self.globals.get("fa_quant_type")

    @property
    def indexer_quant_type(self) -> str | None:
        return self.globals.get("indexer_quant_type")

    @property
    def version(self) -> str | None:
        """``"1.0.0"`` for v1 / ascendV1 output; None for v0 ``safe_tensor`` output (no version key)."""
        return self.globals.get("version")

    @property
    def group_size(self) -> int | None:
        v = self.globals.get("group_size")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    # -- tensor entries
    def __contains__(self, key: str) -> bool:
        return key in self.types

    def __getitem__(self, key: str) -> str:
        return self.types[key]

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.types.get(key, default)

    def keys(self) -> list[str]:
        return list(self.types)

    def with_types(self, extra: dict[str, str]) -> "Description":
        """A copy with ``extra`` tensor entries added (used to describe an undescribed MTP layer as FLOAT)."""
        types = dict(self.types)
        types.update(extra)
        return Description(self.path, types, dict(self.globals), dict(self.attributes))


def _where(path: str | None) -> str:
    return path if path else "<description>"


def check_type(key: str, value: Any, path: str | None = None) -> str:
    """Return ``value`` if it is a known type string, else raise :class:`QuantFormatError` naming ``key``."""
    if not isinstance(value, str) or value not in KNOWN_TYPES:
        raise QuantFormatError(
            f"{_where(path)}: entry {key!r} has unknown quantisation type {value!r}; "
            f"known types: {', '.join(KNOWN_TYPES)}"
        )
    return value


def is_global_key(key: str, value: Any) -> bool:
    """True for the description's global keys (see the module docstring for the rule).

    A dot-less key whose value is a known quantisation type and that is not a known global is a tensor entry:
    DeepSeek-V4's native names put ``hc_head_fn``, ``hc_head_base``, ``hc_head_scale`` at the top level."""
    if key in KNOWN_GLOBALS or not isinstance(value, str):
        return True
    return "." not in key and value not in KNOWN_TYPES


def parse_description(obj: Any, path: str | None = None) -> Description:
    """Split a description object into tensor types, globals and attribute entries (checking every type)."""
    if not isinstance(obj, dict):
        raise QuantFormatError(f"{_where(path)}: expected a JSON object, found a {type(obj).__name__}")
    types: dict[str, str] = {}
    globals_: dict[str, Any] = {}
    attributes: dict[str, str] = {}
    for key, value in obj.items():
        if not isinstance(key, str):  # pragma: no cover - JSON keys are strings
            raise QuantFormatError(f"{_where(path)}: non-string key {key!r}")
        if is_global_key(key, value):
            globals_[key] = value
        elif key.endswith(ATTRIBUTE_SUFFIXES):
            attributes[key] = value
        else:
            types[key] = check_type(key, value, path)
    return Description(path, types, globals_, attributes)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dups = []
    for k, v in pairs:
        if k in out and out[k] != v:
            dups.append(f"{k!r}: {out[k]!r} vs {v!r}")
        out[k] = v
    if dups:
        raise QuantFormatError("key(s) given twice with different values: " + "; ".join(dups))
    return out


def find_description(folder: str) -> str:
    """Path of the description file of ``folder``.

    ``quant_model_description.json`` wins; otherwise exactly one ``quant_model_description_<type>.json`` must
    exist (two are ambiguous: pass the file itself to :func:`read_description`).
    """
    if not os.path.isdir(folder):
        raise QuantFormatError(f"checkpoint folder {folder} does not exist or is not a directory")
    exact = os.path.join(folder, DESCRIPTION_NAME)
    if os.path.isfile(exact):
        return exact
    found = sorted(glob.glob(os.path.join(glob.escape(folder), DESCRIPTION_GLOB)))
    if not found:
        raise QuantFormatError(
            f"{folder}: no msModelSlim description file ({DESCRIPTION_NAME} or quant_model_description_<type>.json)"
        )
    if len(found) > 1:
        raise QuantFormatError(
            f"{folder}: several description files and no {DESCRIPTION_NAME}: "
            f"{', '.join(os.path.basename(p) for p in found)}; pass the one to use"
        )
    return found[0]


def read_description(path: str) -> Description:
    """Read a description file, or the description file of the folder ``path``."""
    if os.path.isdir(path):
        path = find_description(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f, object_pairs_hook=_no_duplicates)
    except QuantFormatError as e:
        raise QuantFormatError(f"{path}: {e}") from None
    except json.JSONDecodeError as e:
        raise QuantFormatError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise QuantFormatError(f"{path}: cannot read description file ({e})") from e
    return parse_description(obj, path)


__all__ = [
    "ATTRIBUTE_SUFFIXES",
    "C8",
    "DESCRIPTION_GLOB",
    "DESCRIPTION_NAME",
    "Description",
    "FLOAT",
    "KNOWN_GLOBALS",
    "KNOWN_TYPES",
    "QUANT_LINEAR_TYPES",
    "RECOGNISED_UNSUPPORTED_TYPES",
    "SUPPORTED_TYPES",
    "W4A16",
    "W4A8_DYNAMIC",
    "W8A16",
    "W8A8",
    "W8A8S",
    "W8A8_DYNAMIC",
    "W8A8_MIX",
    "check_type",
    "find_description",
    "is_global_key",
    "parse_description",
    "read_description",
]
