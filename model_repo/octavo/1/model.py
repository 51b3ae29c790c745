"""octavo as a Triton python-backend model (decoupled).

Each model instance owns one octavo AsyncEngine. `execute` only parses requests and hands them to the engine
(`engine.submit`), so requests from all Triton clients meet in our scheduler and are batched in flight; the
engine thread calls back with each request's delta output (output_kind="delta") and the callback sends Triton
responses through the request's response sender: each delta when `stream` is true, one response with the
whole text (joined once at the end) otherwise, the
last one flagged TRITONSERVER_RESPONSE_COMPLETE_FINAL. A small watcher thread aborts requests whose client
cancelled (their KV blocks are freed at once) and publishes the engine's counters as Triton custom metrics
(`octavo_*` on the metrics port). A bad request gets a Triton error response and touches nothing else.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from octavo.errors import InvalidRequestError, OctavoError
from octavo.runtime.engine_args import EngineArgs
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.stats import ENGINE_METRICS
from octavo.serving.engine_params import engine_args_from_strings
from octavo.serving.constraints import from_request_parameters
from octavo.structured.params import CONSTRAINT_FAILED
from octavo.structured.params import StructuredOutputError

log = logging.getLogger("octavo.triton")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WATCH_INTERVAL_S = 0.02  # cancellation polling and metrics refresh


# optional request inputs -> (SamplingParams field, python type)
SCALAR_INPUTS: dict[str, tuple[str, type]] = {
    "max_tokens": ("max_tokens", int),
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "min_tokens": ("min_tokens", int),
    "ignore_eos": ("ignore_eos", bool),
}


@dataclass(slots=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    constraint_source: str | None = None  # the request parameter the output constraint came from


@dataclass(slots=True)
class LiveRequest:
    """A request the engine is working on, and what has been sent for it so far."""

    request_id: str
    request: Any  # pb_utils.InferenceRequest (kept for is_cancelled())
    sender: Any  # its response sender
    parsed: ParsedRequest
    pieces: list[str] = field(default_factory=list)  # non-streaming: the text so far, joined at the end
    num_output_tokens: int = 0
    responses: int = 0
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def engine_args_from_config(model_config: dict, model_dir: Path) -> EngineArgs:
    """EngineArgs from config.pbtxt `parameters`: model_path, plus any EngineArgs field under its own name (strings
    converted by the field's type; empty means the engine's default). An unknown parameter fails the model load."""
    values = {k: str(v.get("string_value", "")).strip() for k, v in model_config.get("parameters", {}).items()}
    model_path = values.pop("model_path", "")
    if not model_path:
        raise InvalidRequestError("config.pbtxt parameter model_path is empty: set it to an octavo export folder, "
                                  "an HF checkpoint folder or a .gguf file")
    path = Path(model_path)
    if not path.is_absolute():
        path = (model_dir / path).resolve()
    return engine_args_from_strings(str(path), values, where="config.pbtxt parameter")


def _optional_scalar(request: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise InvalidRequestError(f"input {name} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _as_text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"input {name} is not valid UTF-8") from None
    return str(value)


def parse_request(request: Any) -> ParsedRequest:
    """Read the request's tensors into a prompt, SamplingParams and output options (InvalidRequestError if bad)."""
    text = _optional_scalar(request, "text_input")
    if text is None:
        raise InvalidRequestError("input text_input is required")
    prompt = _as_text(text, "text_input")
    kwargs: dict[str, Any] = {}
    for name, (field_name, kind) in SCALAR_INPUTS.items():
        value = _optional_scalar(request, name)
        if value is None:
            continue
        kwargs[field_name] = bool(value) if kind is bool else kind(value.item() if hasattr(value, "item") else value)
    stop = pb_utils.get_input_tensor_by_name(request, "stop_words")
    if stop is not None:
        words = [_as_text(w, "stop_words") for w in stop.as_numpy().reshape(-1)]
        kwargs["stop"] = [w for w in words if w]
    structured, source = from_request_parameters(request.parameters())  # guided_json, structured_outputs, ...
    if structured is not None:
        kwargs["structured_outputs"] = structured
    stream = _optional_scalar(request, "stream")
    exclude = _optional_scalar(request, "exclude_input_in_output")
    try:
        params = SamplingParams(**kwargs, output_kind="delta")  # the engine's native form: only what is new
    except TypeError as exc:
        raise InvalidRequestError(str(exc)) from None
    return ParsedRequest(prompt, params, bool(stream) if stream is not None else False,
                         bool(exclude) if exclude is not None else False, source)


def _error_response(message: str, code: str = "INVALID_ARG") -> Any:
    try:
        error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    except (AttributeError, TypeError):
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _response(text: str, num_input: int, num_output: int, finish_reason: str | None, num_cached: int = 0) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([num_input], dtype=np.int32)),
        pb_utils.Tensor("num_output_tokens", np.array([num_output], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
        # prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)
        pb_utils.Tensor("num_cached_tokens", np.array([num_cached], dtype=np.int32)),
    ])


class EngineMetrics:
    """Triton custom metrics (gauges) mirroring the engine's counters; absent on servers without the API."""

    # the engine's counters by Triton name (octavo.runtime.stats owns the table), plus the largest batch
    NAMES = {m.triton: m.doc for m in ENGINE_METRICS if m.triton is not None}
    NAMES["max_batch_size"] = "Largest number of sequences scheduled in one engine step so far."

    def __init__(self, model_name: str, instance_name: str) -> None:
        self.families: list[Any] = []  # must outlive their Metric objects
        self.gauges: dict[str, Any] = {}
        if not hasattr(pb_utils, "MetricFamily"):
            return
        labels = {"model": model_name, "instance": instance_name}
        for name, description in self.NAMES.items():
            family = pb_utils.MetricFamily(name=f"octavo_{name}", description=description,
                                           kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.gauges[name] = family.Metric(labels=labels)

    def publish(self, values: dict[str, float]) -> None:
        for name, gauge in self.gauges.items():
            if name in values:
                gauge.set(float(values[name]))


class TritonPythonModel:
    """The python backend instantiates this once per model instance."""

    def initialize(self, args: dict) -> None:
        from octavo.runtime.async_engine import AsyncEngine

        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise OctavoError("the octavo model must run in decoupled mode: "
                              "set model_transaction_policy { decoupled: true } in config.pbtxt")
        self.instance_name = args.get("model_instance_name", "octavo")
        model_dir = Path(args["model_repository"])
        engine_args = engine_args_from_config(model_config, model_dir)
        if engine_args.trace_path:
            engine_args.trace_path = engine_args.trace_path.replace("{instance}", self.instance_name)
        self.engine = AsyncEngine(engine_args)
        self.engine.start_thread()
        self.max_batch_size = 0
        self.engine.add_step_listener(self._on_step)
        self.live: dict[str, LiveRequest] = {}
        self.live_lock = threading.Lock()
        self.ids = itertools.count()
        self.metrics = EngineMetrics(model_config.get("name", "octavo"), self.instance_name)
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="octavo-triton-watch", daemon=True)
        self.watcher.start()
        log.warning("octavo: instance %s serving %s (%s)", self.instance_name, engine_args.model, engine_args)

    # ---- requests in -------------------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(request)
            except (InvalidRequestError, ValueError, TypeError, OverflowError) as exc:
                sender.send(_error_response(f"octavo: {exc}"), flags=FINAL)
                continue
            except Exception as exc:  # noqa: BLE001 - one odd request must not fail the others of this call
                log.exception("octavo: could not read a request")
                sender.send(_error_response(f"octavo: could not read the request: {exc}", "INTERNAL"), flags=FINAL)
                continue
            request_id = f"triton-{self.instance_name}-{next(self.ids)}"
            client_id = "".join(c for c in str(request.request_id() or "") if c.isalnum() or c in "-_.:")[:64]
            if client_id:
                request_id += f"-{client_id}"  # the client's id shows up in the trace rows
            live = LiveRequest(request_id, request, sender, parsed)
            with self.live_lock:
                self.live[request_id] = live
            try:
                self.engine.submit(parsed.prompt, parsed.params, request_id,
                                   lambda out, live=live: self._on_output(live, out))
            except Exception as exc:  # noqa: BLE001 - InvalidRequestError, PromptTooLongError, EngineDeadError, ...
                where = f"request parameter {parsed.constraint_source}: " if isinstance(exc, StructuredOutputError) else ""
                self._finish_with_error(live, f"octavo: {where}{exc}",
                                        "INVALID_ARG" if isinstance(exc, InvalidRequestError) else "INTERNAL")
        return None

    # ---- responses out (engine thread) -------------------------------------------------------------------
    def _on_output(self, live: LiveRequest, out: RequestOutput) -> None:
        completion = out.outputs[0]
        if completion.finish_reason == "error":  # the request's own constraint failing is its fault, not the server's
            bad = completion.error is not None and completion.error.startswith(CONSTRAINT_FAILED)
            self._finish_with_error(live, f"octavo: {completion.error or 'request failed'}",
                                    "INVALID_ARG" if bad else "INTERNAL")
            return
        with live.lock:
            if live.done:
                return
            if completion.finish_reason == "abort":
                self._close(live, cancelled=True)
                return
            parsed = live.parsed
            live.num_output_tokens += len(completion.token_ids)
            prefix = "" if parsed.exclude_input or live.responses else parsed.prompt
            if parsed.stream:
                if not completion.text and not out.finished:
                    return  # only tokens whose text the detokenizer still holds back (an incomplete character)
                text = prefix + completion.text
            else:
                live.pieces.append(completion.text)
                if not out.finished:
                    return
                text = prefix + "".join(live.pieces)
            response = _response(text, len(out.prompt_token_ids), live.num_output_tokens, completion.finish_reason,
                                 out.num_cached_tokens)
            self._send(live, response, FINAL if out.finished else 0)
            live.responses += 1
            if out.finished:
                live.done = True
                self._forget(live)

    def _send(self, live: LiveRequest, response: Any, flags: int) -> None:
        try:
            live.sender.send(response, flags=flags)
        except Exception as exc:  # noqa: BLE001 - a vanished client must not take the engine thread down
            log.warning("octavo: could not send a response for %s (%s); aborting it", live.request_id, exc)
            live.done = True
            self._forget(live)
            self._abort(live.request_id)

    def _finish_with_error(self, live: LiveRequest, message: str, code: str) -> None:
        with live.lock:
            if live.done:
                return
            live.done = True
            try:
                live.sender.send(_error_response(message, code), flags=FINAL)
            except Exception as exc:  # noqa: BLE001
                log.warning("octavo: could not send the error for %s: %s", live.request_id, exc)
            self._forget(live)

    def _close(self, live: LiveRequest, cancelled: bool) -> None:
        """End a request that will produce no more output (called with live.lock held)."""
        live.done = True
        self._forget(live)
        try:
            if cancelled:
                live.sender.send(_error_response("octavo: request cancelled", "CANCELLED"), flags=FINAL)
            else:
                live.sender.send(flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - the client is gone; nothing to tell it, but say so: a final
            # response that did not go out may leave its response factory (and so the model) held until exit
            log.warning("octavo: could not send the final response for %s: %s", live.request_id, exc)

    def _forget(self, live: LiveRequest) -> None:
        with self.live_lock:
            self.live.pop(live.request_id, None)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_nowait(request_id)
        except OctavoError:  # already finished
            pass

    # ---- watcher thread: cancellations and metrics ------------------------------------------------------
    def _on_step(self, record: Any) -> None:  # a StepRecord: reads one field, builds no trace row
        self.max_batch_size = max(self.max_batch_size, record.batch_size)

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.live_lock:
                live_now = list(self.live.values())
            for live in live_now:
                # Under live.lock and only while no final response was sent: once the final response is out,
                # Triton frees the request's response factory and is_cancelled() would read freed memory
                # (measured: tritonserver 2.51 segfaults in TRITONBACKEND_ResponseFactoryIsCancelled).
                with live.lock:
                    if live.done:
                        continue
                    try:
                        cancelled = bool(live.request.is_cancelled())
                    except Exception:  # noqa: BLE001
                        cancelled = False
                    if not cancelled:
                        continue
                    self._close(live, cancelled=True)
                self._abort(live.request_id)
                log.info("octavo: %s cancelled by the client; aborted", live.request_id)
            try:
                self._publish_metrics()
            except Exception as exc:  # noqa: BLE001 - metrics are best effort; cancellation polling must go on
                log.warning("octavo: could not publish metrics: %s", exc)

    def _publish_metrics(self) -> None:
        if not self.metrics.gauges:
            return
        try:
            stats = self.engine.stats()
        except OctavoError:
            return
        values = {m.triton: getattr(stats, m.field) for m in ENGINE_METRICS if m.triton is not None}
        self.metrics.publish({**values, "max_batch_size": self.max_batch_size})

    def finalize(self) -> None:
        self.stopping.set()
        self.watcher.join(timeout=5)
        with self.live_lock:
            remaining = list(self.live.values())
        for live in remaining:
            with live.lock:
                if not live.done:
                    self._close(live, cancelled=True)
            self._abort(live.request_id)
        self.engine.shutdown_sync()
        log.warning("octavo: instance %s stopped; max batch size seen %d", self.instance_name, self.max_batch_size)
