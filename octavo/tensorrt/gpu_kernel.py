"""`octavo.PagedAttention` as ONE OpenAI-Triton kernel (the GPU path; TensorRT plugin + torch launcher).

Semantics are those of `octavo.reference.paged_attention_ref`: the new tokens' K/V are written
into the paged pools ([num_blocks, block_size, kv_heads, head_dim]) at `slot_mapping`, and every new
query token attends causally over its sequence's cached positions plus the new tokens up to itself
(ragged prefill, chunked prefill and decode are the same code path).

Why one kernel: TensorRT's ahead-of-time Python plugin (`tensorrt.plugin.aot_impl`) hands TensorRT a
single compiled kernel and its launch parameters. So the cache write cannot be a second kernel, and the
kernel must not read back positions that another program writes in the same launch. It doesn't: cached
positions (< past_seqlens[b]) come from the pool through the block table, the new positions come
straight from the `key`/`value` inputs, and each program stores only its own tokens' K/V into the pool.

Grid: axis 0 walks "query tiles" (BLOCK_M consecutive new tokens of ONE sequence), axis 1 the KV heads.
The number of tiles is at most cdiv(T, BLOCK_M) + B, a function of the input SHAPES only, which is what
TensorRT needs to size the launch; surplus programs return at once. A program finds its sequence with a
vectorised scan (64 sequences per step) over the cumulative sequence lengths. Each program handles the
BLOCK_H (= group size, padded to a power of two) query heads that share one KV head, so K/V are loaded
once per group (GQA). Rows of the score tile are (token, head) pairs: M = BLOCK_M * BLOCK_H >= 16, so
both products are tensor-core dots. The KV loop takes BLOCK_N = max(64, block_size) positions per
iteration, gathering the physical block of every row from the block table (several 16-token pages per
iteration). Accumulation (scores, softmax, P@V) is float32 for fp16/bf16/fp32 inputs; fp32 dots use
"ieee" precision (not TF32).

Kernel argument order follows TensorRT's AOT convention (input pointers, int32 extras, output pointers):
the pool inputs and the pool outputs are the same buffers (aliased); the kernel reads through the
`*_cache_in` pointers and writes through the `*_cache_out` ones.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import triton
import triton.language as tl

from octavo.tensorrt.kernel_launch import block_h, block_m, num_tiles

# Names of the kernel's runtime parameters, in order: 9 inputs, 3 int32 extras, 3 outputs.
INPUT_NAMES = (
    "query", "key", "value", "key_cache_in", "value_cache_in",
    "cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping",
)
EXTRA_NAMES = ("num_tokens", "num_seqs", "max_blocks")
OUTPUT_NAMES = ("output", "key_cache_out", "value_cache_out")
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_in, v_cache_in,
    cu_ptr, past_ptr, table_ptr, slot_ptr,
    num_tokens, num_seqs, max_blocks,
    out_ptr, k_cache_out, v_cache_out,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SCAN: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    GROUP: tl.constexpr = NUM_HEADS // KV_HEADS
    M: tl.constexpr = BLOCK_M * BLOCK_H

    # Which sequence / which tile of it is this program? Vectorised scan over the B sequences, SCAN at a
    # time: tiles per sequence, their running sum, and the one sequence whose tile range holds `tile`.
    seq = tile * 0 - 1
    seq_tile = tile * 0
    first = tile * 0
    for chunk in range(0, num_seqs, SCAN):
        idx = chunk + tl.arange(0, SCAN)
        valid = idx < num_seqs
        start = tl.load(cu_ptr + idx, mask=valid, other=0)
        end = tl.load(cu_ptr + idx + 1, mask=valid, other=0)
        n = tl.where(valid, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
        begin = first + tl.cumsum(n, 0) - n  # first tile of each sequence
        hit = valid & (tile >= begin) & (tile < begin + n)
        seq = tl.maximum(seq, tl.max(tl.where(hit, idx, -1), 0))
        seq_tile = tl.maximum(seq_tile, tl.max(tl.where(hit, tile - begin, 0), 0))
        first += tl.sum(n, 0)
    if seq >= 0:
        tok_start = tl.load(cu_ptr + seq)
        tok_end = tl.load(cu_ptr + seq + 1)
        past = tl.load(past_ptr + seq)
        local0 = seq_tile * BLOCK_M  # first new token of this tile, relative to the sequence's new tokens

        # ---- rows = (token, head-in-group) pairs --------------------------------------------------
        rows = tl.arange(0, M)
        r_tok = rows // BLOCK_H
        r_head = rows % BLOCK_H
        r_local = local0 + r_tok
        row_ok = (tok_start + r_local < tok_end) & (r_head < GROUP)
        q_pos = past + r_local  # absolute position of each row's token
        head = kvh * GROUP + r_head
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_off = (tok_start + r_local)[:, None] * (NUM_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # ---- write this tile's new K/V rows into the pool (slot < 0 = padding, skipped) ------------
        m_tok = tl.arange(0, BLOCK_M)
        t_idx = tok_start + local0 + m_tok
        t_ok = t_idx < tok_end
        slot = tl.load(slot_ptr + t_idx, mask=t_ok, other=-1).to(tl.int64)
        new_off = t_idx[:, None] * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        io_mask = t_ok[:, None] & d_ok[None, :]
        k_new = tl.load(k_ptr + new_off, mask=io_mask, other=0.0)
        v_new = tl.load(v_ptr + new_off, mask=io_mask, other=0.0)
        pool_off = slot[:, None] * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        w_mask = io_mask & (slot[:, None] >= 0)
        tl.store(k_cache_out + pool_off, k_new, mask=w_mask)
        tl.store(v_cache_out + pool_off, v_new, mask=w_mask)

        # ---- online softmax over the KV pages this tile can see --------------------------------------
        last_pos = past + tl.minimum(local0 + BLOCK_M, tok_end - tok_start) - 1
        lo_pos = 0
        if WINDOW > 0:
            lo_pos = tl.maximum(past + local0 - WINDOW + 1, 0)
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        n_off = tl.arange(0, BLOCK_N)
        for kv_tile in range(lo_pos // BLOCK_N, last_pos // BLOCK_N + 1):
            pos = kv_tile * BLOCK_N + n_off  # BLOCK_N positions = BLOCK_N // BLOCK_SIZE pages (or part of one)
            cached = pos < past
            page = pos // BLOCK_SIZE
            block = tl.load(table_ptr + seq.to(tl.int64) * max_blocks + page, mask=cached & (page < max_blocks), other=0)
            c_off = ((block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
            c_mask = cached[:, None] & d_ok[None, :]
            fresh = (pos >= past) & (pos <= last_pos)
            f_off = (tok_start + pos - past)[:, None] * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
            f_mask = fresh[:, None] & d_ok[None, :]
            k = tl.where(c_mask, tl.load(k_cache_in + c_off, mask=c_mask, other=0.0),
                         tl.load(k_ptr + f_off, mask=f_mask, other=0.0))
            v = tl.where(c_mask, tl.load(v_cache_in + c_off, mask=c_mask, other=0.0),
                         tl.load(v_ptr + f_off, mask=f_mask, other=0.0))
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = s * SCALE
            if SOFTCAP > 0:
                s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))  # c * tanh(s / c)
            visible = (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(slots=True, frozen=True)
class KernelConfig:
    """Everything that is baked into one compiled variant (the node's attributes + shapes + dtype)."""

    dtype: str  # "float32" | "float16" | "bfloat16"
    num_heads: int
    kv_num_heads: int
    head_dim: int
    block_size: int
    scale: float
    sliding_window: int = 0
    softcap: float = 0.0
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the KV loop (shared memory grows with it)
    kv_tile: int = 0  # KV positions per loop iteration; 0 = max(64, block_size)
    upcast: bool = False  # run the dots in fp32 (used under TRITON_INTERPRET=1 for bf16, see below)

    def __post_init__(self) -> None:
        if self.dtype not in TRITON_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TRITON_DTYPES)}, got {self.dtype!r}")
        if self.num_heads % self.kv_num_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of kv_num_heads {self.kv_num_heads}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    @property
    def block_h(self) -> int:
        return block_h(self.num_heads, self.kv_num_heads)

    @property
    def block_m(self) -> int:
        return block_m(self.num_heads, self.kv_num_heads)

    @property
    def block_d(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))

    @property
    def block_n(self) -> int:
        """KV positions per loop iteration: several small pages at once (block ids gathered per row)."""
        return self.kv_tile or max(64, self.block_size)

    @property
    def use_dot(self) -> bool:
        return self.block_m * self.block_h >= 16 and self.block_n >= 16

    def constexprs(self) -> dict[str, Any]:
        return {
            "SCALE": float(self.scale), "SOFTCAP": float(self.softcap), "WINDOW": int(self.sliding_window),
            "NUM_HEADS": self.num_heads, "KV_HEADS": self.kv_num_heads, "HEAD_DIM": self.head_dim,
            "BLOCK_SIZE": self.block_size, "BLOCK_M": self.block_m, "BLOCK_H": self.block_h,
            "BLOCK_D": self.block_d, "BLOCK_N": self.block_n, "SCAN": 64, "USE_DOT": self.use_dot,
            "DOT_PRECISION": "ieee" if self.dtype == "float32" or self.upcast else "tf32",
            "UPCAST": self.upcast,
        }

    def signature(self) -> dict[str, str]:
        """Triton signature of the runtime parameters (constexprs marked as such), in kernel order."""
        t = TRITON_DTYPES[self.dtype]
        sig = {
            "q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "k_cache_in": f"*{t}", "v_cache_in": f"*{t}",
            "cu_ptr": "*i32", "past_ptr": "*i32", "table_ptr": "*i32", "slot_ptr": "*i64",
            "num_tokens": "i32", "num_seqs": "i32", "max_blocks": "i32",
            "out_ptr": f"*{t}", "k_cache_out": f"*{t}", "v_cache_out": f"*{t}",
        }
        sig.update({name: "constexpr" for name in self.constexprs()})
        return sig


# Pointer arguments promised 16-byte aligned in the AOT compile. Triton's JIT infers this per launch
# from the actual addresses (and then emits 128-bit vector loads / cp.async); an ahead-of-time compile
# knows nothing unless told, and without the hint every K/V element is a scalar 2-byte load. The
# promise holds: TensorRT hands plugins 256-byte aligned tensors (its own allocations, and user
# addresses, which setTensorAddress requires to be 256-byte aligned); gpu_check's AOT section launches
# exactly this PTX on such buffers.
POINTER_ALIGNMENT = 16


def aot_attrs(config: "KernelConfig") -> dict[tuple[int, ...], list[list[Any]]]:
    """ASTSource attrs: `tt.divisibility` = POINTER_ALIGNMENT on every pointer parameter."""
    return {(index,): [["tt.divisibility", POINTER_ALIGNMENT]]
            for index, kind in enumerate(config.signature().values()) if kind.startswith("*")}


def compile_kernel(config: KernelConfig, arch: int = 90, ptx_version: int | None = None,
                   aligned_pointers: bool = True):  # noqa: ANN201
    """Compile ahead of time for `sm_<arch>` (no GPU needed). Returns triton's CompiledKernel
    (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.name/.shared/.num_warps`). ALIGNED_POINTERS passes the
    16-byte divisibility hints (`aot_attrs`); False only to measure what they change."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=_paged_attention_kernel, signature=config.signature(), constexprs=config.constexprs(),
                    attrs=aot_attrs(config) if aligned_pointers else None)
    options: dict[str, Any] = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if ptx_version is not None:
        options["ptx_version"] = ptx_version
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def check_aot_launchable(compiled) -> None:  # noqa: ANN001
    """Refuse a compiled variant that TensorRT's AOT launch cannot reproduce: TensorRT passes only
    (inputs, int32 extras, outputs); Triton's hidden scratch pointers then arrive as null, which is only
    fine when the kernel asks for no scratch memory."""
    meta = compiled.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, field, 0):
            raise RuntimeError(f"kernel {meta.name} needs {field}={getattr(meta, field)}; the TensorRT AOT "
                               "launch cannot provide Triton scratch memory")
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) \
            or getattr(meta, "launch_pdl", False) or getattr(meta, "tmem_size", 0):
        raise RuntimeError(f"kernel {meta.name} needs a cluster/cooperative/PDL launch or tensor memory, "
                           "which TensorRT's AOT launch (grid, block, shared memory only) does not set up")


# Triton's own launcher opts a kernel in to more than 48 KiB of dynamic shared memory; TensorRT's AOT
# launch is not documented to, so AOT variants are kept within the default limit.
AOT_SHARED_LIMIT = 48 * 1024
_AOT_FALLBACKS = ((3, 0), (2, 0), (1, 0), (2, 32), (1, 32), (1, 16))  # (num_stages, kv_tile)


def compile_for_aot(config: KernelConfig, arch: int, ptx_version: int | None = None,
                    shared_limit: int = AOT_SHARED_LIMIT):  # noqa: ANN201
    """Compile for TensorRT's AOT launch: the deepest pipelining / widest KV tile that fits SHARED_LIMIT."""
    tried = []
    for stages, tile in _AOT_FALLBACKS:
        variant = replace(config, num_stages=stages, kv_tile=tile)
        compiled = compile_kernel(variant, arch=arch, ptx_version=ptx_version)
        check_aot_launchable(compiled)
        if compiled.metadata.shared <= shared_limit:
            return compiled
        tried.append(f"stages={stages} kv_tile={variant.block_n}: {compiled.metadata.shared} B")
    raise RuntimeError(f"no paged-attention variant for {config} fits {shared_limit} B of shared memory "
                       f"({'; '.join(tried)})")


def paged_attention(
    query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
    slot_mapping, *, num_heads: int, kv_num_heads: int, scale: float | None = None, sliding_window: int = 0,
    softcap: float = 0.0, num_warps: int = 4,
):  # noqa: ANN001, ANN201
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1). Pools are updated in place;
    returns the attention output [T, num_heads*head_dim] in the query's dtype."""
    import torch

    num_tokens = query.shape[0]
    num_seqs = past_seqlens.shape[0]
    head_dim = query.shape[1] // num_heads
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[query.dtype]
    # The interpreter's numpy tl.dot mis-reads bfloat16 operands (measured: error ~1e10 on a 16x16
    # product with triton 3.7.1), so under TRITON_INTERPRET=1 bf16 dots run on fp32 copies.
    upcast = dtype == "bfloat16" and os.environ.get("TRITON_INTERPRET") == "1"
    config = KernelConfig(
        dtype=dtype, num_heads=num_heads, kv_num_heads=kv_num_heads, head_dim=head_dim,
        block_size=key_cache.shape[1], scale=scale if scale is not None else 1.0 / math.sqrt(head_dim),
        sliding_window=sliding_window, softcap=softcap, num_warps=num_warps, upcast=upcast,
    )
    output = torch.empty_like(query)
    if num_tokens == 0:
        return output
    grid = (num_tiles(num_tokens, num_seqs, config.block_m), kv_num_heads)
    args = (
        query.contiguous(), key.contiguous(), value.contiguous(), key_cache, value_cache,
        cumulative_sequence_length.to(torch.int32).contiguous(), past_seqlens.to(torch.int32).contiguous(),
        block_table.to(torch.int32).contiguous(), slot_mapping.to(torch.int64).contiguous(),
        num_tokens, num_seqs, block_table.shape[1],
        output, key_cache, value_cache,
    )
    from triton.runtime.errors import OutOfResources

    for stages, tile in _AOT_FALLBACKS:  # shallower pipelines / narrower KV tiles on smaller-smem GPUs
        variant = replace(config, num_stages=stages, kv_tile=tile)
        try:
            _paged_attention_kernel[grid](*args, num_warps=num_warps, num_stages=stages, **variant.constexprs())
            return output
        except OutOfResources as exc:  # raised before the launch: nothing was written yet
            last = exc
    raise last
