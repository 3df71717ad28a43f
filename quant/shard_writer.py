"""Write tensors into safetensors shards of bounded size, with a Hugging Face ``*.safetensors.index.json``.

One writer for every checkpoint the package produces: the model's own layout (``model-0000k-of-0000N.safetensors``
and ``model.safetensors.index.json``, always numbered) and msModelSlim's (``quant_model_weights.safetensors`` when
one shard suffices, else numbered shards and ``quant_model_weights.safetensors.index.json``). Only one shard's
tensors are held in memory at a time.
"""

from __future__ import annotations

import json
import os

import torch

from quant.errors import CheckpointError


def make_readable(path: str) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0666 less the umask, i.e. 0644 usually):
    ``safetensors.save_file`` creates its files 0600, unreadable to the other users of a shared model folder."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class ShardWriter:
    """``add`` tensors, then ``close`` (returns the shard paths). ``stem``: file name stem; ``single_file``: a
    checkpoint that fits one shard is written as ``{stem}.safetensors`` without an index (msModelSlim's layout)."""

    def __init__(self, out_dir: str, shard_bytes: int = 1 << 30, stem: str = "model", single_file: bool = False):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_bytes = out_dir, max(1, shard_bytes)
        self.stem, self.single_file = stem, single_file
        self.parts: list[str] = []
        self.weight_map: dict[str, int] = {}  # tensor -> part number
        self.buf: dict[str, torch.Tensor] = {}
        self.size = self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map or name in self.buf:
            raise CheckpointError(f"{self.out_dir}: tensor {name} written twice")
        nbytes = t.numel() * t.element_size()
        if self.size and self.size + nbytes > self.shard_bytes:
            self._flush()
        # own storage: safetensors refuses tensors that share memory (one expert of a stack, a tied copy)
        self.buf[name] = t.detach().cpu().clone().contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        path = os.path.join(self.out_dir, f".{self.stem}-part{len(self.parts):05d}.safetensors")
        save_file(self.buf, path, metadata={"format": "pt"})
        make_readable(path)
        for k in self.buf:
            self.weight_map[k] = len(self.parts)
        self.parts.append(path)
        self.buf, self.size = {}, 0

    def close(self, config: dict | None = None) -> list[str]:
        """Write the last shard, name the shards (the count is known only now), write the index and, if given,
        ``config.json``; returns the shard paths."""
        self._flush()
        n = len(self.parts)
        if n == 1 and self.single_file:
            final = [os.path.join(self.out_dir, f"{self.stem}.safetensors")]
        else:
            final = [os.path.join(self.out_dir, f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
        for a, b in zip(self.parts, final):
            os.replace(a, b)
        if not (n == 1 and self.single_file):
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: os.path.basename(final[i]) for k, i in self.weight_map.items()}}
            with open(os.path.join(self.out_dir, f"{self.stem}.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=1)
        if config is not None:
            with open(os.path.join(self.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
        self.parts = final
        return final
