"""LoRA adapters: PEFT folders (adapter_config.json + adapter_model.safetensors) read into per-module low-rank pairs.

`read_peft_adapter(name, path, max_rank)` gives a LoRAAdapter: for every targeted linear layer of the decoder
(HF names, "model.layers.3.self_attn.q_proj"), A [r, in] and B [out, r] already multiplied by the adapter's
scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora). What PEFT options would change the math and are
not reproduced (DoRA, biases, fan_in_fan_out, modules_to_save, per-module ranks or alphas, targets outside the
attention and MLP projections) are refused with a ModelFormatError naming them. The backend adds the adapters'
products to the projections of the rows that ask for them (runtime/backends/ort_lora.py); the engine gives each
adapter a slot (1..max_loras; 0 is the base model) and salts its requests' prefix-cache hashes with its name.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from octavo.errors import InvalidRequestError, ModelFormatError
from octavo.export.safetensors_file import SafetensorsFile

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.default)?\.weight$")
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None}


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # module -> (A, scaled B)


@dataclass(slots=True)
class LoRARegistry:
    """The adapters an engine serves, by name, and the backend slot each one is in (1..max_loras)."""

    max_loras: int = 0
    slots: dict[str, int] = field(default_factory=dict)
    adapters: dict[str, LoRAAdapter] = field(default_factory=dict)
    salts: dict[str, bytes] = field(default_factory=dict)  # per adapter: its prefix-cache salt (name + load number)
    loads: int = 0  # adapters loaded so far: an adapter loaded again under the same name gets a new salt
    enabled: bool = False  # the backend has LoRA slots
    max_rank: int = 0

    def slot(self, name: str) -> int:
        """NAME's slot, or InvalidRequestError listing the adapters served."""
        if name not in self.slots:
            served = ", ".join(repr(n) for n in self.slots) or "none"
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (served: {served})")
        return self.slots[name]

    def cache_salt(self, name: str) -> bytes:
        return self.salts[name]

    def add(self, adapter: LoRAAdapter, backend: Any) -> int:
        """Load ADAPTER into a free slot of BACKEND; returns the slot."""
        if not self.enabled:
            raise InvalidRequestError("this engine has no LoRA slots: start it with lora_modules or enable_lora")
        if adapter.name in self.slots:
            raise InvalidRequestError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        free = [s for s in range(1, self.max_loras + 1) if s not in self.slots.values()]
        if not free:
            raise InvalidRequestError(f"all {self.max_loras} LoRA slots are in use (max_loras): unload one first")
        backend.load_lora(free[0], adapter)
        self.loads += 1
        self.slots[adapter.name], self.adapters[adapter.name] = free[0], adapter
        self.salts[adapter.name] = f"lora:{adapter.name}#{self.loads}".encode("utf-8", "surrogateescape")
        return free[0]

    def remove(self, name: str, backend: Any) -> None:
        slot = self.slot(name)
        backend.load_lora(slot, None)
        del self.slots[name], self.adapters[name], self.salts[name]


def load_lora_modules(text: str | None, max_loras: int, max_rank: int, backend: object) -> LoRARegistry:
    """Read the adapters of TEXT (EngineArgs.lora_modules) and load them into BACKEND's slots 1, 2, ..."""
    registry = LoRARegistry(max_loras, max_rank=max_rank, enabled=getattr(backend, "lora", None) is not None)
    modules = parse_lora_modules(text)
    if len(modules) > max_loras:
        raise InvalidRequestError(f"{len(modules)} LoRA adapters but max_loras is {max_loras}")
    for name, path in modules:
        registry.add(read_peft_adapter(name, path, max_rank), backend)
    return registry


def parse_lora_modules(text: str | None) -> list[tuple[str, str]]:
    """'name=path,name2=path2' (vLLM's --lora-modules, comma- or space-separated) -> [(name, path)]."""
    if not text:
        return []
    out = []
    for item in re.split(r"[,\s]+", text.strip()):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"lora_modules takes name=path entries, got {item!r}")
        if name in (n for n, _ in out):
            raise InvalidRequestError(f"lora_modules names the adapter {name!r} twice")
        out.append((name, path))
    return out


def read_peft_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    folder = Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelFormatError(f"{folder} is not a PEFT LoRA folder (adapter_config.json and "
                               "adapter_model.safetensors expected; .bin adapters are refused as pickle)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{config_path}: cannot read JSON ({exc})") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelFormatError(f"{config_path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, off in _REFUSED.items():
        if config.get(key) not in (off, None) and config.get(key) != off:
            raise ModelFormatError(f"{config_path}: {key} = {config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ModelFormatError(f"{config_path}: bias {config['bias']!r} is not supported (only 'none')")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise InvalidRequestError(f"adapter {name!r} has rank {rank}; this engine takes ranks up to {max_rank} "
                                  "(--max-lora-rank)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    file = SafetensorsFile(weights_path)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key in file.names():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            raise ModelFormatError(f"{weights_path}: tensor {key!r} is not a LoRA weight of a projection octavo "
                                   f"adapts ({', '.join(MODULES)})")
        pairs.setdefault(m.group(1), {})[m.group(3)] = file.get(key).astype(np.float32)
    adapter = LoRAAdapter(name, str(folder), rank)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise ModelFormatError(f"{weights_path}: {module} needs lora_A [r={rank}, in] and lora_B [out, r={rank}]")
        adapter.weights[module] = (ab["A"], ab["B"] * np.float32(scaling))
    if not adapter.weights:
        raise ModelFormatError(f"{weights_path} holds no LoRA weights")
    return adapter


__all__ = ["MODULES", "LoRAAdapter", "LoRARegistry", "load_lora_modules", "parse_lora_modules", "read_peft_adapter"]
