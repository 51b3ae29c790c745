"""Stand-in for `tensorrt.plugin` (the quickly deployable plugin API), tests only (see ../README.md).

Mirrors what octavo relies on: `register` / `aot_impl` decorators with the real signature validation
(tensor inputs first, then attributes; aot_impl's parameters exactly (inputs..., attributes...,
outputs, tactic) and a return annotation), TensorDesc.like()/aliased(), symbolic shape expressions,
KernelLaunchParams, SymInt32 / SymIntExprs, cdiv. Shape expressions evaluate against concrete shapes.
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import tensorrt as trt


# ---- symbolic shapes ------------------------------------------------------------------------------
class ShapeExpr:
    """A dimension: a constant, or (input index, axis), or an operation on two expressions."""

    def __init__(self, value: Any = None, *, source: tuple[int, int] | None = None,  # noqa: ANN401
                 op: str | None = None, args: tuple = ()) -> None:
        self._value, self._source, self._op, self._args = value, source, op, args

    @property
    def is_constant(self) -> bool:
        return self._op is None and self._source is None

    @property
    def is_fake(self) -> bool:
        return False

    def constant_value(self) -> int:
        if not self.is_constant:
            raise ValueError("not a constant shape expression")
        return int(self._value)

    def evaluate(self, shapes: list[tuple[int, ...]]) -> int:
        if self.is_constant:
            return int(self._value)
        if self._source is not None:
            i, axis = self._source
            return int(shapes[i][axis])
        a, b = (x.evaluate(shapes) if isinstance(x, ShapeExpr) else int(x) for x in self._args)
        return {"+": a + b, "-": a - b, "*": a * b, "//": a // b, "cdiv": -(-a // b),
                "max": max(a, b), "min": min(a, b)}[self._op]

    def to_json(self) -> Any:  # noqa: ANN401
        """Serializable form (kept in the stand-in's engine): int | ["in", input, axis] | [op, a, b]."""
        if self.is_constant:
            return int(self._value)
        if self._source is not None:
            return ["in", *self._source]
        return [self._op, *(a.to_json() if isinstance(a, ShapeExpr) else int(a) for a in self._args)]

    def _bin(self, op: str, other: Any) -> "ShapeExpr":  # noqa: ANN401
        if not isinstance(other, (ShapeExpr, int)):
            raise TypeError(f"unsupported operand {type(other)} for a shape expression")
        return ShapeExpr(op=op, args=(self, other))

    def __add__(self, other: Any) -> "ShapeExpr":  # noqa: ANN401
        return self._bin("+", other)

    def __radd__(self, other: Any) -> "ShapeExpr":  # noqa: ANN401
        return ShapeExpr(op="+", args=(other, self))

    def __sub__(self, other: Any) -> "ShapeExpr":  # noqa: ANN401
        return self._bin("-", other)

    def __mul__(self, other: Any) -> "ShapeExpr":  # noqa: ANN401
        return self._bin("*", other)

    def __floordiv__(self, other: Any) -> "ShapeExpr":  # noqa: ANN401
        return self._bin("//", other)


def cdiv(first: Any, second: Any) -> ShapeExpr:  # noqa: ANN401
    if isinstance(first, int) and isinstance(second, int):
        raise ValueError("Both arguments cannot be 'int's")
    first = first if isinstance(first, ShapeExpr) else ShapeExpr(first)
    return ShapeExpr(op="cdiv", args=(first, second))


@dataclass(eq=False)  # identity matters: aliased() points at one particular input
class TensorDesc:
    dtype: Any = None  # noqa: ANN401
    shape_expr: tuple = ()
    _aliased_to: "TensorDesc | None" = None

    def like(self) -> "TensorDesc":
        return TensorDesc(self.dtype, self.shape_expr)

    def aliased(self) -> "TensorDesc":
        return TensorDesc(self.dtype, self.shape_expr, _aliased_to=self)

    def get_aliased(self) -> "TensorDesc | None":
        return self._aliased_to


class SymInt32:
    def __init__(self, expr: Any) -> None:  # noqa: ANN401
        if not isinstance(expr, (ShapeExpr, int)):
            raise TypeError(f"SymInt32 takes a shape expression or an int, got {type(expr)}")
        self.expr = expr if isinstance(expr, ShapeExpr) else ShapeExpr(expr)


class SymExprs:
    def __init__(self, length: int) -> None:
        self._items: list[Any] = [None] * length

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Any:  # noqa: ANN401
        return self._items[i]

    def __setitem__(self, i: int, value: Any) -> None:  # noqa: ANN401
        self._items[i] = value

    def __iter__(self):  # noqa: ANN204
        return iter(self._items)


SymIntExprs = SymExprs


@dataclass
class KernelLaunchParams:
    grid_x: Any = 1  # noqa: ANN401
    grid_y: Any = 1  # noqa: ANN401
    grid_z: Any = 1  # noqa: ANN401
    block_x: Any = 1  # noqa: ANN401
    block_y: Any = 1  # noqa: ANN401
    block_z: Any = 1  # noqa: ANN401
    shared_mem: Any = 0  # noqa: ANN401


# ---- registry -------------------------------------------------------------------------------------
SUPPORTED_ATTR_TYPES = (int, float, str, bool, bytes)


@dataclass
class PluginDef:
    plugin_id: str
    register_func: Callable
    input_names: list[str]
    input_attrs: dict[str, type]  # registration order
    aot_impl_func: Callable | None = None
    extra: dict = field(default_factory=dict)


REGISTRY: dict[str, PluginDef] = {}


def _is_tensor_desc(annotation: Any) -> bool:  # noqa: ANN401
    return inspect.isclass(annotation) and issubclass(annotation, TensorDesc)


def register(plugin_id: str) -> Callable:
    def decorator(func: Callable) -> Callable:
        sig = inspect.signature(func)
        names, attrs, seen_attr = [], {}, False
        for name, param in sig.parameters.items():
            if _is_tensor_desc(param.annotation):
                if seen_attr:
                    raise ValueError(f"input tensor '{name}' declared after an attribute")
                names.append(name)
            else:
                if not (inspect.isclass(param.annotation) and issubclass(param.annotation, SUPPORTED_ATTR_TYPES)):
                    raise ValueError(f"attribute '{name}' has unsupported annotation {param.annotation!r}")
                seen_attr = True
                attrs[name] = param.annotation
        ret = sig.return_annotation
        if not (_is_tensor_desc(ret) or (typing.get_origin(ret) is tuple
                                         and all(_is_tensor_desc(a) for a in typing.get_args(ret)))):
            raise ValueError(f"register function must return TensorDesc or Tuple[TensorDesc, ...], got {ret!r}")
        if plugin_id in REGISTRY:
            raise ValueError(f"plugin {plugin_id} is already registered")
        REGISTRY[plugin_id] = PluginDef(plugin_id, func, names, attrs)
        namespace, name = plugin_id.split("::")
        trt.get_plugin_registry()._add(name, "1", namespace, list(attrs))
        return func

    return decorator


def aot_impl(plugin_id: str) -> Callable:
    def decorator(func: Callable) -> Callable:
        if plugin_id not in REGISTRY:
            raise ValueError(f"plugin {plugin_id} must be registered with @register before @aot_impl")
        definition = REGISTRY[plugin_id]
        sig = inspect.signature(func)
        expected = [*definition.input_names, *definition.input_attrs, "outputs", "tactic"]
        if list(sig.parameters) != expected:
            raise ValueError(f"aot_impl signature {list(sig.parameters)} != expected {expected}")
        for name, param in sig.parameters.items():
            if name in definition.input_attrs and param.annotation is not inspect.Parameter.empty \
                    and param.annotation != definition.input_attrs[name]:
                raise ValueError(f"attribute '{name}' annotated differently from registration")
        if sig.return_annotation is inspect.Parameter.empty or typing.get_origin(sig.return_annotation) is not tuple:
            raise ValueError("aot_impl needs a return annotation Tuple[str|bytes, str|bytes, KernelLaunchParams, SymExprs]")
        definition.aot_impl_func = func
        return func

    return decorator
