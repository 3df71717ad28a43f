"""The model-family registry (keyed by ``model_type``) and config loading for every family.

``load_config(model)`` takes a preset name, a ``config.json`` path or a folder holding one, and returns the
family's config (:class:`~ascend_dsv4.models.deepseek_v4.config.DeepseekV4Config` or
:class:`~ascend_dsv4.models.deepseek_v3.config.DeepseekV3Config`); :func:`family_of` gives the
:class:`~ascend_dsv4.models.family.ModelFamily` record of a config, which is all the rest of the package asks.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError
from . import deepseek_v3, deepseek_v4
from .family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (deepseek_v4.FAMILY, deepseek_v3.FAMILY)}
DEFAULT_FAMILY = deepseek_v4.FAMILY  # a config.json without model_type is read as the package's first family

# every preset name of every family
ALL_PRESETS = {name: make for fam in FAMILIES.values() for name, make in fam.presets.items()}


def family(model_type: str) -> ModelFamily:
    if model_type not in FAMILIES:
        raise ConfigError(f"no model family for model_type {model_type!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def family_of(cfg: Any) -> ModelFamily:
    """The family record of a config object."""
    return family(cfg.model_type)


def preset(name: str) -> Any:
    if name not in ALL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(ALL_PRESETS))}")
    return ALL_PRESETS[name]().validate()


def from_dict(d: dict, where: str = "config.json") -> Any:
    """A Hugging Face ``config.json`` dict (family by ``model_type``) or an official inference one (family by
    :attr:`ModelFamily.claims_official_dict`; the official files carry no ``model_type``)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if "hidden_size" in d or "num_hidden_layers" in d:
        return FAMILIES.get(d.get("model_type"), DEFAULT_FAMILY).from_hf_dict(d, where)
    if "dim" in d or "n_layers" in d:
        fam = next((f for f in FAMILIES.values() if f is not DEFAULT_FAMILY and f.claims_official_dict(d)),
                   DEFAULT_FAMILY)
        return fam.from_official_dict(d, where)
    raise ConfigError(f"{where}: not a DeepSeek config (no 'hidden_size' nor 'dim' field)")


def load_config(model: str) -> Any:
    """A preset name, a ``config.json`` path, or a folder holding ``config.json`` (or ``inference/config.json``)."""
    if model in ALL_PRESETS:
        return preset(model)
    path = model
    if os.path.isdir(path):
        for cand in ("config.json", os.path.join("inference", "config.json")):
            if os.path.isfile(os.path.join(path, cand)):
                path = os.path.join(path, cand)
                break
        else:
            raise ConfigError(f"{model}: folder has no config.json")
    elif not os.path.isfile(path):
        raise ConfigError(f"unknown model {model!r}: not a preset ({', '.join(sorted(ALL_PRESETS))}), file or folder")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 JSON file ({e.reason} at byte {e.start})") from None
    return from_dict(d, where=path)
