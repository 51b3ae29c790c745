"""CPU backend: ONNX Runtime + the octavo.PagedAttention custom-op library.

The KV pools are plain numpy arrays [num_blocks, block_size, kv_heads, head_dim], one key and one
value pool per layer, float32 (the export's dtype) or, with kv_cache_dtype="float16", float16: then the
loaded graph's pool declarations are switched to float16 in memory before the session is created (the
export on disk is unchanged) and the op rounds new K/V to fp16 on write and widens them on read.
kv_cache_dtype="int8" switches them to int8 pools whose head rows end in their scale (head_dim + 2 bytes:
ort_kv_pools.pool_shape); the op quantizes on write. The switched graph also lists the pool outputs as graph
outputs, bound to the pools themselves (see ort_kv_pools.expose_pool_outputs for why). They are bound ONCE
through IOBinding as OrtValues that wrap the numpy memory (zero copy); the custom op writes new K/V into them
in place. Per step only the small integer inputs and the logits output are bound.

ORT's intra-op worker threads, ort_spinning (EngineArgs.ort_spinning, default $OCTAVO_ORT_SPINNING or "run"):
- "run" (the default since 2026-12-01): they spin-wait between the parallel sections of a step and stop
  spinning when Run() returns (session.intra_op.allow_spinning=1 + session.force_spinning_stop=1), so a
  step does not pay a thread wake-up per parallel op, and between steps (the engine's Python work, the
  server's event loop) the cores are free. Measured on the quiet 2-core machine: one decode step of the
  SmolLM2 GGUF 23 ms with blocking threads -> 14.5 ms; the engine's decode-only step 15.5 ms ("0"), 10.7 ms
  ("run"), 10.2 ms ("1").
- "0": block between parallel sections (the default until 2026-12-01). It was chosen on 2026-11-29 on this
  machine while other processes ran (load ~7), where spinning made decode steps slower (batch 1: 28 -> 51 ms
  median of rounds; batch 8: 86 -> 97 ms) because a spinning worker took the core the thread with the work
  needed; that was a loaded machine, not the quiet one above.
- "1": spin always, also between steps (ORT's own default; slightly faster than "run" when nothing else
  wants the cores).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

from octavo.errors import InvalidRequestError, ModelFormatError, OpLibraryError
from octavo.export.graph import HIDDEN_INPUT, HIDDEN_OUTPUT, STEP_INPUTS, cache_input_names
from octavo.export.manifest import Manifest
from octavo.runtime.backends.base import StepInputs
from octavo.runtime.backends.longrope_table import select_longrope_factors
from octavo.runtime.backends.oplib import library_path
from octavo.runtime.backends.ort_fusions import fuse_rotary, fuse_rotary_into_attention, set_int8_activations
from octavo.runtime.backends.ort_kv_pools import expose_pool_outputs, pool_dtype, pool_shape, set_cache_dtype
from octavo.runtime.backends.ort_lora import SLOTS_INPUT, LoraPools, LoraSite, add_lora_branches
from octavo.runtime.lora import LoRAAdapter
from octavo.runtime.kv_dtype import resolve_kv_cache_dtype

log = logging.getLogger(__name__)

# Steps with at most this many logits rows (every decode step of up to 64 sequences) write them into one
# buffer the backend keeps (64 x the vocabulary: 12 MiB for 49152 tokens), bound once per step as an
# OrtValue; larger ones (prompt logprobs of a long chunk) let ORT allocate the step's logits.
_LOGITS_BUFFER_ROWS = 64
_NUMPY_DTYPE = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32}
_ORT_KV_TYPE = {"float32": "tensor(float)", "float16": "tensor(float16)", "int8": "tensor(int8)"}


class OnnxRuntimeBackend:
    """Runs an exported octavo model on the CPU; owns the paged KV pools."""

    def __init__(
        self,
        model_dir: str | Path,
        manifest: Manifest,
        num_blocks: int,
        block_size: int,
        num_threads: int | None = None,
        profile_prefix: str | None = None,
        kv_cache_dtype: str = "auto",
        ort_fusions: bool = True,
        ort_spinning: str = "run",
        amx: bool = True,
        max_model_len: int | None = None,
        lora: tuple[int, int] | None = None,
        prompt_activations: str = "float32",
        decode_activations: str = "int16",
    ) -> None:
        """profile_prefix: turn on ONNX Runtime's profiler, writing PREFIX_<date>.json at session.end_profiling().
        kv_cache_dtype: "auto" (runtime/kv_dtype.py), "float32", "float16" or "int8" pools.
        ort_fusions, ort_spinning, amx: EngineArgs' fields of those names (the graph rewrites at load, how the
        threads wait: module docstring, the op library's AMX switch for the process: oplib.set_amx).
        max_model_len: the engine's context; a longrope model gets the factor set it calls for (longrope_table).
        lora: (max_loras, max_lora_rank): the graph gets LoRA branches (ort_lora.py) and `load_lora` fills slots."""
        from octavo.runtime.backends.oplib import set_amx
        from octavo.runtime.engine_args import ORT_SPINNING_MODES, check_activations

        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = manifest.vocab_size
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, manifest)
        self.ort_fusions = ort_fusions
        check_activations("prompt_activations", prompt_activations)
        check_activations("decode_activations", decode_activations)
        self.prompt_activations = prompt_activations
        self.decode_activations = decode_activations
        self.max_model_len = max_model_len or manifest.max_context
        pool_type = pool_dtype(self.kv_cache_dtype)  # fails early for a dtype these pools cannot hold

        options = ort.SessionOptions()
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        if ort_spinning not in ORT_SPINNING_MODES:
            raise InvalidRequestError(f"ort_spinning must be one of {ORT_SPINNING_MODES}, got {ort_spinning!r}")
        options.add_session_config_entry("session.intra_op.allow_spinning", "0" if ort_spinning == "0" else "1")
        if ort_spinning == "run":  # spin between a step's parallel sections, stop when it returns
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.register_custom_ops_library(str(library_path()))
        set_amx(amx)  # after the library's CPU check (registration); before any step
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        onnx_path = self.model_dir / manifest.onnx_file
        if not onnx_path.is_file():
            raise ModelFormatError(f"{onnx_path} is missing; re-export the model with `octavo export`")
        self._pool_output_aliases: dict[str, str] = {}  # float16 pools: pool output -> its pool input
        self._pooled = manifest.pooling is not None  # an embedding export: hidden_indices in, hidden_states out
        self._lora_config = lora
        self._lora_sites: list[LoraSite] = []
        try:
            self.session = ort.InferenceSession(self._model_source(onnx_path, options), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            missing = re.search(r"octavo:(\w+)\(-?\d+\) is not a registered function/op", str(exc))
            if missing:  # an export newer than the built op library (e.g. after `git pull` without `make op`)
                raise OpLibraryError(
                    f"{onnx_path} uses the op octavo.{missing.group(1)}, which the custom-op library "
                    f"{library_path()} does not have: it was built from older sources. Rebuild it with "
                    "`make op` (or `python -m octavo.oplib_build`), or reinstall octavo") from exc
            raise ModelFormatError(f"ONNX Runtime cannot load {onnx_path}: {exc}") from exc
        self._input_dtypes = self._validate()

        shape = pool_shape(self.kv_cache_dtype, num_blocks, block_size, manifest.num_kv_heads, manifest.head_dim)
        self.key_caches = [np.zeros(shape, pool_type) for _ in range(manifest.num_layers)]
        self.value_caches = [np.zeros(shape, pool_type) for _ in range(manifest.num_layers)]
        self._binding = self.session.io_binding()
        self._pool_values: list[ort.OrtValue] = []  # keep the wrappers alive as long as the binding
        pools = [p for pair in zip(self.key_caches, self.value_caches) for p in pair]
        by_input: dict[str, ort.OrtValue] = {}
        for name, pool in zip(cache_input_names(manifest.num_layers), pools):
            value = ort.OrtValue.ortvalue_from_numpy(pool)
            self._binding.bind_ortvalue_input(name, value)
            self._pool_values.append(value)
            by_input[name] = value
        # float16 pools: each pool output is bound to its own pool's OrtValue, so it is written in place
        self._pool_outputs = [(out, by_input[pool]) for out, pool in self._pool_output_aliases.items()]
        self._binding.bind_output("logits", "cpu")  # first: get_outputs()[0]; rebound (replaced) every step
        self._logits_buffer = np.empty((_LOGITS_BUFFER_ROWS, manifest.vocab_size), np.float32)
        for name, pool in self._pool_outputs:  # bound once (they were rebound every step: 60 calls)
            self._binding.bind_ortvalue_output(name, pool)
        self.lora: LoraPools | None = None
        if self._lora_config is not None:  # the adapters' A/B arrays, bound once like the pools
            self.lora = LoraPools.zeros(self._lora_sites, *self._lora_config)
            for s in self._lora_sites:
                for name, array in ((f"lora_a.{s.weight}", self.lora.a[s.weight]),
                                    (f"lora_b.{s.weight}", self.lora.b[s.weight])):
                    value = ort.OrtValue.ortvalue_from_numpy(array)
                    self._binding.bind_ortvalue_input(name, value)
                    self._pool_values.append(value)
        log.info(
            "onnxruntime backend: %s, %d blocks x %d slots, %.1f MiB KV (%s)", onnx_path, num_blocks, block_size,
            2 * manifest.num_layers * self.key_caches[0].nbytes / 2**20, self.kv_cache_dtype,
        )

    def _model_source(self, onnx_path: Path, options: ort.SessionOptions) -> bytes:
        """The graph (weights left in their external file) as bytes, rewritten in memory: RoPE fused into
        ONNX Runtime's RotaryEmbedding, then moved into the PagedAttention nodes (ort_fusions;
        self.ort_fusions False turns both off) and, for pools in
        another dtype than the export's, the pool declarations switched."""
        import onnx

        try:
            model = onnx.load(str(onnx_path), load_external_data=False)
        except Exception as exc:  # protobuf / onnx raise assorted types
            raise ModelFormatError(f"cannot read {onnx_path}: {exc}; re-export the model") from exc
        select_longrope_factors(model, self.manifest.rope_scaling, self.manifest.rope_theta, self.max_model_len)
        if self.kv_cache_dtype != self.manifest.dtype:
            if set_cache_dtype(model, self.kv_cache_dtype) == 0 and self.manifest.num_layers > 0:
                raise ModelFormatError(f"{onnx_path} declares no octavo.PagedAttention pools to switch to "
                                       f"{self.kv_cache_dtype}; re-export the model")
            self._pool_output_aliases = expose_pool_outputs(model)  # keeps ORT from casting the pools away
        if self.ort_fusions:
            if fuse_rotary(model, self.manifest.max_context):
                fuse_rotary_into_attention(model)
        for knob, steps in (("prompt_activations", "prompt"), ("decode_activations", "decode")):
            if getattr(self, knob) != "int8":
                continue
            marked = set_int8_activations(model, steps)
            if marked == 0:
                log.warning("%s='int8' changes nothing for %s: it has no BlockMatMul / MoE node on blocks the int8 "
                            "path takes (a Q4_0 / Q4_1 / Q4_K GGUF's own blocks; on decode steps Q6_K / Q5_x too)",
                            knob, self.model_dir)
            log.info("int8 %s activations on %d BlockMatMul / MoE nodes", steps, marked)
        if self._lora_config is not None:  # after the fusions, which match the export's own pattern
            self._lora_sites = add_lora_branches(model, *self._lora_config)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(onnx_path.parent))
        return model.SerializeToString()

    def _validate(self) -> dict[str, type]:
        """Check the ONNX graph's inputs/outputs against the manifest and the contract."""
        m = self.manifest
        inputs = {i.name: i for i in self.session.get_inputs()}
        expected = [name for name, _, _ in STEP_INPUTS] + cache_input_names(m.num_layers)
        expected += [HIDDEN_INPUT[0]] if self._pooled else []
        expected += [f"lora_{ab}.{s.weight}" for s in self._lora_sites for ab in "ab"]
        expected += [SLOTS_INPUT] if self._lora_sites else []
        names = [i.name for i in self.session.get_inputs()]
        if names != expected:
            raise ModelFormatError(
                f"{self.model_dir}: model.onnx inputs do not match octavo.json ({m.num_layers} layers); "
                f"expected {expected[:9]}..., found {names[:9]}...; re-export the model"
            )
        row = pool_shape(self.kv_cache_dtype, 0, 0, m.num_kv_heads, m.head_dim)[2:]  # int8: head_dim + 2 bytes
        for name in cache_input_names(m.num_layers):
            shape = inputs[name].shape
            if len(shape) != 4 or tuple(shape[2:]) != row:
                raise ModelFormatError(
                    f"{self.model_dir}: input {name} has shape {shape}, octavo.json says "
                    f"[num_blocks, block_size, {row[0]}, {row[1]}]; re-export the model"
                )
            if inputs[name].type != _ORT_KV_TYPE[self.kv_cache_dtype]:
                raise ModelFormatError(
                    f"{self.model_dir}: input {name} is {inputs[name].type}, the pool is {self.kv_cache_dtype}; "
                    f"octavo.json says dtype {m.dtype}; re-export the model"
                )
        outputs = self.session.get_outputs()
        hidden = [HIDDEN_OUTPUT] if self._pooled else []
        if [o.name for o in outputs] != ["logits", *hidden, *self._pool_output_aliases] \
                or outputs[0].shape[-1] != m.vocab_size:
            raise ModelFormatError(
                f"{self.model_dir}: model.onnx must have the output logits [N, {m.vocab_size}]"
                f"{' and hidden_states (octavo.json has pooling)' if hidden else ''}, "
                f"found {[(o.name, o.shape) for o in outputs]}; re-export the model"
            )
        return {name: _NUMPY_DTYPE[inputs[name].type] for name, _, _ in STEP_INPUTS}

    def run_with_hidden(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """An embedding export's step: (logits [N, vocab], hidden states [H, hidden_size] of inputs.hidden_indices)."""
        if not self._pooled:
            raise ModelFormatError(f"{self.model_dir} has no hidden_states output (octavo.json has no pooling): "
                                   "export it with `octavo export --pooling last` (or mean, cls)")
        rows = 0 if inputs.hidden_indices is None else len(inputs.hidden_indices)
        hidden = np.empty((rows, self.manifest.hidden_size), np.float32)
        return self.run(inputs, hidden), hidden

    def run(self, inputs: StepInputs, hidden: np.ndarray | None = None) -> np.ndarray:
        """One step: writes the new tokens' K/V into the pools, returns float32 logits [N, vocab]. An embedding
        export also writes the hidden states of inputs.hidden_indices into HIDDEN (none asked: an empty array)."""
        keep = []  # the bound arrays must outlive run_with_iobinding
        for name, dtype in self._input_dtypes.items():
            array = np.ascontiguousarray(getattr(inputs, name), dtype=dtype)
            keep.append(array)
            self._binding.bind_cpu_input(name, array)
        if self.lora is not None:  # per token: its adapter's slot (0: the base model)
            slots = inputs.lora_slots if inputs.lora_slots is not None else np.zeros(len(inputs.input_ids), np.int64)
            keep.append(slots := np.ascontiguousarray(slots, dtype=np.int64))
            self._binding.bind_cpu_input(SLOTS_INPUT, slots)
        if self._pooled:
            indices = inputs.hidden_indices if inputs.hidden_indices is not None else np.zeros(0, np.int64)
            keep.append(indices := np.ascontiguousarray(indices, dtype=np.int64))
            self._binding.bind_cpu_input(HIDDEN_INPUT[0], indices)
            out = hidden if hidden is not None else np.empty((0, self.manifest.hidden_size), np.float32)
            keep.append(out)
            self._binding.bind_ortvalue_output(HIDDEN_OUTPUT, ort.OrtValue.ortvalue_from_numpy(out))
        rows = len(inputs.logits_indices)
        if rows <= _LOGITS_BUFFER_ROWS:  # into our own buffer: get_outputs() wraps every output (61 with float16 pools)
            view = self._logits_buffer[:rows]
            self._binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(view))
            self.session.run_with_iobinding(self._binding)
            del keep
            return view.copy()  # the caller may keep it; the buffer is the next step's
        self._binding.bind_output("logits", "cpu")  # many prompt-logprob rows: ORT allocates them for this step
        self.session.run_with_iobinding(self._binding)
        logits = self._binding.get_outputs()[0].numpy()
        self._binding.bind_output("logits", "cpu")  # the binding would hold ORT's array until the next step
        del keep
        return logits

    def load_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ADAPTER's weights into SLOT (None clears it). Call between steps: the next step sees them."""
        if self.lora is None:
            raise InvalidRequestError("this backend was made without LoRA (engine argument lora_modules)")
        self.lora.load(slot, adapter)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer's pools (beam search's copy on write). The pools are
        the numpy arrays ONNX Runtime reads in place, so the next step sees the copies."""
        if not pairs:
            return
        src = np.fromiter((s for s, _ in pairs), np.int64)
        dst = np.fromiter((d for _, d in pairs), np.int64)
        for pool in (*self.key_caches, *self.value_caches):
            pool[dst] = pool[src]

    def close(self) -> None:
        """Drop the session and the pools (their memory is freed once nobody else references it)."""
        self._binding = None  # type: ignore[assignment]
        self._logits_buffer = np.empty((0, 0), np.float32)
        self._pool_values = []
        self._pool_outputs = []
        self.session = None  # type: ignore[assignment]
        self.key_caches = []
        self.value_caches = []
